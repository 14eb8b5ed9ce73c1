"""Which files a corpus is made of (a file, a folder or a glob). The run and cache folders a folder or glob leaves
out are told apart in data/leftout.py; where encoded corpora are cached, and the key that names one, in
data/cachekey.py.

Every failure a person can fix raises DataError with a one-line message saying what is wrong and what to do.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from configs.userinput import file_kind

from .corpus import data_dir, locate, no_such_file
from .globs import expand, fixed_part, matches_any
from .leftout import RUN_CONFIG, LeftOut, entry_files, identities, is_cache, is_run, owner_of
from .paths import DataError, not_a_file, not_utf8, open_regular, os_failure, quoted, stat_path, unreadable, walk

# Bump when the encoded files or their meta change meaning, so old caches are not trusted. 2: the meta carries the
# CRC-32 of the ids, checked whenever the entry is opened. 3: a byte-order mark that starts a file is left out (the
# "bom" setting), and the meta counts the marks and the files holding NUL bytes. The meta's checksum of itself
# ("meta_crc32") came without a bump: entries written before it are encoded again (data/cache.py).
FORMAT_VERSION = 3
SNIFF_BYTES = 8000  # bytes looked at for a NUL to tell a binary file from text (git looks at as many)
_GLOB_MAGIC = frozenset("*?[")


@dataclass(frozen=True)
class Source:
    """One input file as it was when listed: its size and modification time key the cache."""

    path: Path  # as the user's data.path reaches it, for messages
    size: int
    mtime_ns: int
    # when its status last changed, which no one can set back as mtime can be (touch -d, cp -p, rsync -t): an edit
    # that keeps size and mtime is still seen while the file is encoded (the cache key needs no more: its content)
    ctime_ns: int = 0


@dataclass(frozen=True)
class Inputs:
    """The files of a corpus in the order they are joined, plus what a folder or glob held that is not text."""

    spec: str  # data.path as given, or the built-in file's path
    label: str  # the setting the inputs came from, for messages: "data.path" or "data.dataset=..."
    sources: list[Source]
    skipped: list[Path]  # binary files under a folder or glob, left out
    # tinychar run folders under a folder or glob, left out; or the config.yaml of the run whose out_dir is the
    # folder data.path names (its other files are binary)
    runs: list[Path] = field(default_factory=list)
    # folders of tinychar's encoded-corpus cache under a folder or glob, left out whole; or the folder data.path
    # names, when it holds cache entries (those files alone are left out)
    caches: list[Path] = field(default_factory=list)
    # entries under a folder or glob that are no file to read: a named pipe, a socket, a device, a broken link
    others: list[Path] = field(default_factory=list)
    # hidden files and folders (a name that starts with '.': .git, .DS_Store) under a folder, left out
    hidden: list[Path] = field(default_factory=list)
    # what spec came to: the file's or folder's full path, links resolved, or the glob's pattern from its fixed part's,
    # and where that lies on this machine (_asked); the cache's entries of one corpus are told by it, whatever files it
    # held: data/cache.py's prune
    asked: str = ""

    @property
    def n_bytes(self) -> int:
        return sum(s.size for s in self.sources)


def resolve_inputs(spec: str | Path, label: str = "data.path", caches: Iterable[Path] = (),
                   runs: Iterable[Path] = ()) -> Inputs:
    """The non-empty files that spec names, in the order they are joined; DataError if there is no text.

    A file is taken as it is, unless it is binary. A folder gives every file under it, sorted by relative path;
    hidden ones, binary ones, tinychar run folders and cache folders are left out (an out_dir inside data.path must
    not make its config.yaml training text for the next run, nor a --resume's text differ from the run's; a cache
    folder inside it, its meta files). caches are the folders encoded corpora are cached in (cache_dirs); a folder
    holding a cache entry counts as one too. runs are run folders known as such before they are marked (the run's own
    out_dir: a first run would train on what it held, and its resume, the folder marked by then, would not).
    Anything else holding *, ? or [ is a glob (** reaches into sub-folders without entering links to folders);
    folders it matches are walked like a folder. A pipe, device or socket is
    refused by what it is, after a stat that never blocks.
    """
    text = str(spec)
    p, globbed, st = named(text, label)
    out = LeftOut(label, identities(caches), identities(runs))
    if st is None and globbed:
        files, p = _glob(p, out)
        if not files:
            raise DataError(
                f"{label}: no text file matches {quoted(text)}{out.said()}; check the pattern (** reaches sub-folders)"
            )
    elif stat.S_ISDIR(st.st_mode):
        files = _walk(p, out, named=True)
        if not files:
            raise DataError(
                f"{label}: {quoted(text)} is a folder with no text files in it{out.said()}; add some, or give a file"
            )
    elif (kind := file_kind(st.st_mode)) is not None:
        raise not_a_file(label, text, kind)
    elif not _is_text(p, label, st):
        with open_regular(p, label) as f:
            raise not_utf8(label, text, f.read(4))
    else:
        files = [p]
    sources = _sources(files, label)
    if not sources:
        what = "is empty" if st is not None and stat.S_ISREG(st.st_mode) else "holds only empty files"
        if os.path.realpath(p).startswith(("/proc/", "/sys/")):  # the kernel's files, made as they are read
            what += " (the kernel's files under /proc and /sys say 0 bytes whatever they hold: copy one first)"
        raise DataError(f"{label}: {quoted(text)} {what}; give UTF-8 text with at least one training window")
    return Inputs(text, label, sources, out.skipped, out.runs, out.caches, out.others, out.hidden, _asked(p, st))


def _asked(p: Path, st: os.stat_result | None) -> str:
    """Inputs.asked for the file, folder or glob p (st: its stat, None for a glob): its full path, or the pattern from
    its fixed part's, and that file's or folder's identity on this machine (device and inode). Machines sharing one
    cache folder (a home on a network file system), each with its own copy of a folder at one path, would otherwise
    take each other's entries for stale ones of the same corpus, and encode it again at every run."""
    asked = _resolved(p) if st is None else p.resolve()
    try:
        here = os.stat(fixed_part(p)) if st is None else st
    except OSError:
        return str(asked)
    return f"{asked} ({here.st_dev}:{here.st_ino})"


def _resolved(pattern: Path) -> Path:
    """pattern from its fixed part's full path, links resolved: the same pattern however it was written."""
    base = fixed_part(pattern)
    return base.resolve().joinpath(*pattern.parts[len(base.parts):])


def named(text: str, label: str = "data.path") -> tuple[Path, bool, os.stat_result | None]:
    """(where the path text names lies, whether it is a glob, its stat; None for a glob that names no one path).
    DataError when it is unusable, or names nothing that is there: a stat, no more, which train.py asks before it
    imports torch (seconds), so that a mistyped data.path is said at once, and resolve_inputs asks again."""
    if "\0" in text:
        raise DataError(f"{label}: {quoted(text)} is not a usable path (it holds a NUL character)")
    p = locate(text)
    globbed = bool(_GLOB_MAGIC & set(text))
    st = _stat_or_glob(p, label) if globbed else stat_path(p, label)
    if st is None and not globbed:
        raise no_such_file(label, text, p)
    return p, globbed, st


def refuse_if_nothing_there(text: str, label: str = "data.path") -> None:
    """named()'s checks and, for a glob that matches nothing or a folder with no file under it (hidden ones aside),
    resolve_inputs's refusal, found without listing more than it takes to see one match or one file: what train.py
    asks before it imports torch (seconds). A glob or folder of binary or empty files alone is refused by the run."""
    p, globbed, st = named(text, label)
    if st is None:  # a pattern; a relative one that matches nothing here is looked for in TINYCHAR_DATA_DIR too
        folder = data_dir()
        there = matches_any(p, label) or (folder is not None and not p.is_absolute() and matches_any(folder / p, label))
    elif stat.S_ISDIR(st.st_mode):
        there = _any_file(p, label)
    else:
        return
    if not there:
        resolve_inputs(text, label)  # says what is wrong as the run would


def _any_file(folder: Path, label: str) -> bool:
    """Whether anything but a folder lies under folder, hidden files and folders left out (a cheap _walk)."""
    for _, dirs, names in walk(folder, unreadable(label)):
        if any(not n.startswith(".") for n in names):
            return True
        dirs[:] = [d for d in dirs if not d.startswith(".")]
    return False


def _stat_or_glob(p: Path, label: str) -> os.stat_result | None:
    """p's status when a file or folder is named so (a name may hold '[' or '*'); None to read it as a pattern."""
    try:
        return stat_path(p, label)
    except DataError:  # a pattern may be no usable path at all ('*' parts over 255 bytes); the pattern is tried
        return None


def _glob(pattern: Path, out: LeftOut) -> tuple[list[Path], Path]:
    """(the text files that pattern matches, in sorted order of the matches, folders walked in place; the pattern
    matched, in TINYCHAR_DATA_DIR if that is where). Matches in or of tinychar run and cache folders are left out
    (said in out)."""
    label = out.label
    matches = expand(pattern, label)
    folder = data_dir()
    if not matches and folder is not None and not pattern.is_absolute():
        pattern = folder / pattern
        matches = expand(pattern, label)
    base = fixed_part(pattern)
    files: list[Path] = []
    for m in matches:
        st = _regular_or_folder(m, label)
        if st is None:  # a pipe, device, socket or broken link matched by a wildcard: never opened
            out.others.append(m)
            continue
        if (above := _owner_above(m, base, out)) is not None:
            out.add(*above)
        elif stat.S_ISDIR(st.st_mode):
            files += _walk(m, out, named=m == base)  # a '**' that ends the pattern matches base: named, as a folder is
        else:
            (files if _is_text(m, label, st) else out.skipped).append(m)
    return files, pattern


def _owner_above(match: Path, base: Path, out: LeftOut) -> tuple[str, Path] | None:
    """('run' or 'cache', what is left out) for the tinychar run or cache folder that match lies in, looking up from
    its folder to base (the pattern's fixed part, which a person named), as walking a matched folder leaves out such a
    folder's whole tree; None if it lies in none. base itself is named, as a folder data.path names is (_walk): of a
    run there, only its config.yaml is left out (the rest of its files are binary), of a cache only its entries."""
    if base not in match.parents:  # a '**' that ends the pattern matches base itself: never look above base
        return None
    for folder in match.parents:  # (not 'base in folder.parents' at each: time in the cube of the depth)
        if folder == base:
            return _owned_in_base(match, base, out) if match.parent == base else None
        if (owner := owner_of(folder, out)) is not None:
            return owner, folder
    return None


def _owned_in_base(match: Path, base: Path, out: LeftOut) -> tuple[str, Path] | None:
    """('run', its config.yaml) or ('cache', base) for a match in base that is the run's config.yaml or a cache
    entry's file; None for any other."""
    if base not in out.listed:
        try:
            out.listed[base] = os.listdir(base)
        except OSError:
            out.listed[base] = []
    names = out.listed[base]
    if match.name == RUN_CONFIG and is_run(names, base, out.run_ids):
        return "run", match
    if match.name in entry_files(names):
        return "cache", base
    return None


def _sources(files: list[Path], label: str) -> list[Source]:
    """files as Sources, each real file once and empty ones left out."""
    sources, seen = [], set()
    for f in files:
        key = f.resolve()
        if key in seen:  # '**' matches a folder (walked) and the files in it; links lead to a file twice
            continue
        seen.add(key)
        st = _stat(f, label)
        if st.st_size:  # an empty file adds nothing, not even a separating newline
            sources.append(Source(f, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return sources


def _walk(folder: Path, out: LeftOut, named: bool = False) -> list[Path]:
    """The text files under folder sorted by relative path; hidden files and folders (.git, .DS_Store) left out.

    A tinychar run folder (config.yaml beside .lock, ckpt.pt or best.pt) is left out whole and added to out.runs:
    what a run writes, or what was put beside it (sample.py's output), is not the corpus. So is a cache folder (added
    to out.caches): its meta files are JSON text, and each run would add one more to the next run's text. Except
    folder itself when it is named (data.path=. with out_dir=. or data.cache_dir=.): the person chose it as the
    corpus, so only the run's config.yaml and the cache's entries are left out, the rest of a run's files being
    binary. Links to folders are not entered (as by os.walk), so a link back up the tree cannot loop; a folder
    that cannot be read is refused rather than skipped, which would train on part of the corpus without saying so.
    """
    label = out.label
    found = []
    for root, dirs, names in walk(folder, unreadable(label)):
        here = Path(root)
        whole = not named or here != folder
        if is_run(names, here, out.run_ids):
            if whole:
                out.add("run", here)
                dirs[:] = []
                continue
            if RUN_CONFIG in names:  # the named folder is the run's own before the run has written its config
                names = [n for n in names if n != RUN_CONFIG]
                out.runs.append(here / RUN_CONFIG)
        if is_cache(here, names, out.cache_ids):
            if whole:
                out.add("cache", here)
                dirs[:] = []
                continue
            if entries := entry_files(names):
                out.caches.append(here)
                names = [n for n in names if n not in entries]
        out.hidden += sorted(Path(root, n) for n in (*dirs, *names) if n.startswith("."))
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [Path(root, n) for n in names if not n.startswith(".")]
    found.sort(key=lambda f: f.relative_to(folder).as_posix())
    text = []
    for f in found:
        st = _regular_or_folder(f, label)
        if st is None:  # a socket, fifo, device or broken link (or a file removed since it was listed)
            out.others.append(f)
            continue
        if stat.S_ISDIR(st.st_mode):
            continue  # a folder made since it was listed
        (text if _is_text(f, label, st) else out.skipped).append(f)
    return text


def _regular_or_folder(path: Path, label: str) -> os.stat_result | None:
    """path's status if it is a regular file or a folder (following links); None for anything else, or a broken
    link; DataError if it cannot be looked at (no permission)."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None
        raise os_failure(label, path, e) from None
    return st if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) else None


def _is_text(path: Path, label: str, st: os.stat_result) -> bool:
    """False for a file with a NUL byte near its start (an image, an archive, UTF-16): no UTF-8 text has one.

    An empty file (st: path's status) is not opened: it adds nothing to a corpus (_sources leaves it out), and some
    files that say they are empty never end (/proc/kmsg, whose read waits for the kernel's next message: forever).
    """
    if not st.st_size:
        return True
    with open_regular(path, label) as f:
        return b"\0" not in f.read(SNIFF_BYTES) and not _has_hole(f.fileno(), st.st_size)


def _has_hole(fd: int, size: int) -> bool:
    """Whether the open file of size bytes has a hole (a sparse file: a disk image, a download not yet written): bytes
    never written, which read as NUL bytes however many there are. `truncate -s 1T` after a line of text took hours
    to read, and its ids filled the cache's disk."""
    if not hasattr(os, "SEEK_HOLE"):
        return False
    try:
        return os.lseek(fd, 0, os.SEEK_HOLE) < size
    except OSError:  # a file system that cannot tell
        return False


def _stat(path: Path, label: str) -> os.stat_result:
    try:
        return path.stat()
    except OSError as e:
        raise os_failure(label, path, e) from None
