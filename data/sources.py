"""Which files a corpus is made of (a file, a folder or a glob), where encoded corpora are cached, and the cache key.

Every failure a person can fix raises DataError with a one-line message saying what is wrong and what to do.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .corpus import DataError, _did_you_mean, data_dir, locate

FORMAT_VERSION = 1  # bump when the encoded files or their meta change meaning, so old caches are not trusted
CONTENT_HASH_BELOW = 64 << 20  # inputs smaller than this in total are hashed, catching edits that keep size and mtime
_HASH_CHUNK = 1 << 20
_SNIFF = 8000  # bytes looked at for a NUL to tell a binary file from text (git looks at as many)
_GLOB_MAGIC = frozenset("*?[")


@dataclass(frozen=True)
class Source:
    """One input file as it was when listed: its size and modification time key the cache."""

    path: Path  # as the user's data.path reaches it, for messages
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Inputs:
    """The files of a corpus in the order they are joined, plus what a folder or glob held that is not text."""

    spec: str  # data.path as given, or the built-in file's path
    label: str  # the setting the inputs came from, for messages: "data.path" or "data.dataset=..."
    sources: list[Source]
    skipped: list[Path]  # binary files under a folder or glob, left out

    @property
    def n_bytes(self) -> int:
        return sum(s.size for s in self.sources)


def resolve_inputs(spec: str | Path, label: str = "data.path") -> Inputs:
    """The non-empty files that spec names, in the order they are joined; DataError if there is no text.

    A file is taken as it is, unless it is binary. A folder gives every file under it (hidden ones and binary ones
    left out), sorted by relative path. Anything else holding *, ? or [ is a glob (** reaches into sub-folders);
    folders it matches are walked like a folder.
    """
    shown = str(spec)
    if "\0" in shown:
        raise DataError(f"{label}: {shown!r} is not a usable path (it holds a NUL character)")
    p = locate(shown)
    skipped: list[Path] = []
    if p.is_file():
        if not _is_text(p, label):
            # said plainly: NUL bytes are valid UTF-8, so a UTF-16 file would otherwise become a corpus of garbage
            raise DataError(
                f"{label}: {shown!r} is a binary file (it holds NUL bytes: a checkpoint, an archive, UTF-16 text?), "
                "not UTF-8 text; give a UTF-8 text file"
            )
        files = [p]
    elif p.is_dir():
        files = _walk(p, skipped, label)
        if not files:
            raise DataError(f"{label}: {shown!r} is a folder with no text files in it; add some, or give a file")
    elif _GLOB_MAGIC & set(shown):
        files = []
        matches = sorted(glob.glob(str(p), recursive=True))
        folder = data_dir()
        if not matches and folder is not None and not p.is_absolute():
            matches = sorted(glob.glob(str(folder / p), recursive=True))
        for match in matches:
            m = Path(match)
            if m.is_dir():
                files += _walk(m, skipped, label)
            elif m.is_file():
                (files if _is_text(m, label) else skipped).append(m)
        if not files:
            raise DataError(f"{label}: no text file matches {shown!r}; check the pattern (** reaches sub-folders)")
    else:
        raise DataError(f"{label}: no such file {shown!r}{_did_you_mean(p)}")
    sources, seen = [], set()
    for f in files:
        key = f.resolve()
        if key in seen:  # '**' matches a folder (walked) and the files in it: each file is read once
            continue
        seen.add(key)
        st = _stat(f, label)
        if st.st_size:  # an empty file adds nothing, not even a separating newline
            sources.append(Source(f, st.st_size, st.st_mtime_ns))
    if not sources:
        what = "is empty" if p.is_file() else "holds only empty files"
        raise DataError(f"{label}: {shown!r} {what}; give UTF-8 text with at least one training window")
    return Inputs(shown, label, sources, skipped)


def _walk(folder: Path, skipped: list[Path], label: str) -> list[Path]:
    """The text files under folder sorted by relative path; hidden files and folders (.git, .DS_Store) left out."""
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [Path(root, n) for n in names if not n.startswith(".")]
    found.sort(key=lambda f: f.relative_to(folder).as_posix())
    text = []
    for f in found:
        if not f.is_file():
            continue  # a socket, fifo or broken link
        (text if _is_text(f, label) else skipped).append(f)
    return text


def _is_text(path: Path, label: str) -> bool:
    """False for a file with a NUL byte near its start (an image, an archive, UTF-16): no UTF-8 text has one."""
    with open_source(path, label) as f:
        return b"\0" not in f.read(_SNIFF)


def _stat(path: Path, label: str) -> os.stat_result:
    try:
        return path.stat()
    except OSError as e:
        raise DataError(f"{label}: cannot read {str(path)!r} ({e.strerror or e})") from e


@contextmanager
def open_source(path: Path, label: str) -> Iterator[BinaryIO]:
    """path opened for binary reading, OSErrors on opening turned into DataError."""
    try:
        f = path.open("rb")
    except PermissionError as e:
        raise DataError(f"{label}: cannot read {str(path)!r} (permission denied); check the file's permissions") from e
    except OSError as e:
        raise DataError(f"{label}: cannot read {str(path)!r} ({e.strerror or e})") from e
    with f:
        yield f


def cache_key(inputs: Inputs, settings: dict) -> str:
    """A hex digest naming the encoded corpus: inputs' paths, sizes and mtimes, the settings, and for small inputs
    their content (an edit that keeps size and mtime, as some tools and copies do, still changes the key)."""
    files = [[str(s.path.resolve()), s.size, s.mtime_ns] for s in inputs.sources]
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps({"format": FORMAT_VERSION, "settings": settings, "files": files}).encode())
    if inputs.n_bytes < CONTENT_HASH_BELOW:
        for s in inputs.sources:
            with open_source(s.path, inputs.label) as f:
                while chunk := f.read(_HASH_CHUNK):
                    digest.update(chunk)
    return digest.hexdigest()


def cache_dirs(configured: str | None) -> list[Path]:
    """Folders to look for and write encoded corpora in, in order.

    data.cache_dir, else $TINYCHAR_CACHE_DIR, is the only folder. Otherwise the per-user cache
    ($XDG_CACHE_HOME/tinychar/encoded, else ~/.cache/tinychar/encoded), then the temp folder should that one be
    read-only or missing. Never a folder of the project or of the corpus.
    """
    chosen = configured or os.environ.get("TINYCHAR_CACHE_DIR")
    if chosen:
        return [Path(chosen).expanduser()]
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "tinychar" / "encoded"
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    temp = Path(tempfile.gettempdir()) / f"tinychar-{uid}" / "encoded"
    return [user, temp]
