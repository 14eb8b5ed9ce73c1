"""The paths a person gives data/ (data.path, data.cache_dir), looked at before they are used: stat first, open only
regular files, and every OSError turned into one line that names the setting, the path and what to do.

Every failure a person can fix raises DataError with a one-line message saying what is wrong and what to do.
"""

from __future__ import annotations

import codecs
import errno
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from configs.userinput import QUOTE_LIMIT, file_kind, shell_word, shown

if TYPE_CHECKING:
    from .sources import Source

# Characters of a path in a log line (a note, not an error): all of any real path, still never a flood.
LOG_PATH = 400
_NAME_MAX = 255  # bytes in one file or folder name: ext4, XFS, btrfs, APFS, NTFS (in UTF-16 units)
# What to do about the errors a user's path can give; the system's own words (e.strerror) say what happened.
_WHAT_TO_DO = {
    errno.ELOOP: "a symbolic link on the way leads back to itself; fix or remove the link",
    errno.EACCES: "check its permissions and those of the folders above it",
    errno.EPERM: "check its permissions and those of the folders above it",
    errno.ENOTDIR: "a part of the path that should be a folder is a file; check the path",
    errno.EIO: "the disk or network share holding it failed; check it and run again",
}


class DataError(ValueError):
    """The training text cannot be had; the message is one line for a person: what is wrong, what to do."""


# The byte-order marks that start UTF-32 and UTF-16 text (Windows's "Unicode"), never UTF-8, whose characters have
# no byte FF or FE. UTF-32's little-endian mark begins with UTF-16's, so it is looked for first.
_WIDE_MARKS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
               (codecs.BOM_UTF16_BE, "UTF-16"))
UTF16_MARKS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)  # (UTF-32's begin with these, or with NUL bytes)


def not_utf8(label: str, path: object, head: bytes) -> DataError:
    """The DataError for a file that is not UTF-8 text by its first bytes (head): UTF-16 or UTF-32 text when it
    starts with their byte-order mark, with the command that converts it, else a binary file (NUL bytes: valid UTF-8,
    so a UTF-16 file would otherwise become a corpus of garbage)."""
    for mark, encoding in _WIDE_MARKS:
        if head.startswith(mark):
            word = shell_word(str(path))
            return DataError(
                f"{label}: {quoted(path)} is {encoding} text (it starts with {encoding}'s byte-order mark), not "
                f"UTF-8; convert it to UTF-8, e.g. iconv -f {encoding} -t UTF-8 "
                f"{word if len(word) <= QUOTE_LIMIT else 'FILE'} > converted.txt"
            )
    return DataError(
        f"{label}: {quoted(path)} is a binary file (it holds NUL bytes: a checkpoint, an archive, UTF-16 text?), "
        "not UTF-8 text; give a UTF-8 text file"
    )


def quoted(path: object, limit: int = QUOTE_LIMIT) -> str:
    """path as a message quotes it: escaped onto one line, cut past limit characters, in single quotes."""
    return f"'{shown(str(path), limit)}'"


def os_failure(label: str, path: object, e: OSError, doing: str = "cannot read") -> DataError:
    """The one-line DataError for an OSError on a path that the setting `label` gave."""
    reason = e.strerror or type(e).__name__
    if e.errno == errno.ENAMETOOLONG:
        todo = _too_long(str(path))
    else:
        todo = _WHAT_TO_DO.get(e.errno or 0, "check the path, or give another one")
    return DataError(f"{label}: {doing} {quoted(path)} ({reason}); {todo}")


def _too_long(path: str) -> str:
    """Which limit a path broke: one name's (255 bytes on most file systems) or the whole path's (4,096 on Linux)."""
    longest = max((len(os.fsencode(part)) for part in Path(path).parts), default=0)
    if longest > _NAME_MAX:
        return f"a name in it is {longest:,} bytes, over the limit of {_NAME_MAX}; use a shorter name"
    return f"the whole path is {len(os.fsencode(path)):,} bytes, over the system's limit; use a shorter path"


def not_a_file(label: str, path: object, kind: str) -> DataError:
    """The refusal of what is neither a regular file nor a folder: a pipe (a FIFO, <(command)), a socket, a device."""
    if "device" in kind or kind == "a folder":  # /dev/zero, a disk: never a corpus, and may never end
        return DataError(f"{label}: {quoted(path)} is {kind}, not a file; give the path of a UTF-8 text file")
    return DataError(
        f"{label}: {quoted(path)} is {kind}, not a file; tinychar reads a corpus twice (to count its characters, "
        "then to encode them), so save it to a file first (zcat corpus.gz > corpus.txt)"
    )


def expand_home(value: str, setting: str) -> Path:
    """value as a Path with a leading '~' or '~user' made the home folder it names; DataError when there is none.

    pathlib raises RuntimeError for '~nouser/x' (no such user) and for '~' with no $HOME and no entry in the user
    database, as in some containers: said here in one line that names the setting the value came from.
    """
    try:
        return Path(value).expanduser()
    except RuntimeError:
        user = value[1:].replace(os.sep, "/").split("/", 1)[0]
        whose = f"the home folder of '{shown(user)}', a user this machine does not know" if user else (
            "the home folder, which this machine cannot find (no $HOME)"
        )
        raise DataError(f"{setting}: {quoted(value)} starts with {whose}; give the folder's full path") from None


def stat_path(path: Path, label: str) -> os.stat_result | None:
    """path's status, following links; None when nothing is there; DataError for any other failure.

    A link to nowhere is said plainly: 'no such file' would send the person looking for the link itself.
    """
    try:
        return os.stat(path)
    except FileNotFoundError:
        try:
            target = os.readlink(path) if os.path.islink(path) else None
        except OSError:  # replaced since: it is not there either way
            target = None
        if target is not None:
            raise DataError(
                f"{label}: {quoted(path)} is a symbolic link to {quoted(target)}, which does not exist; fix the link"
            ) from None
        return None
    except OSError as e:
        raise os_failure(label, path, e) from None
    except ValueError:  # a NUL character, or a lone surrogate the file system encoding cannot write
        raise DataError(
            f"{label}: {quoted(path)} is not a usable path (it holds a character no file name can); check the path"
        ) from None


def walk(top: Path, onerror: Callable[[OSError], None]) -> Iterator[tuple[str, list[str], list[str]]]:
    """os.walk(top, onerror=onerror): top-down, links to folders listed but not entered, dirs pruned in place; without
    recursion, where Python 3.11's os.walk recursed once a level, so that a tree some 1,000 folders deep was a
    RecursionError (a traceback) instead of a corpus."""
    stack = [os.fspath(top)]
    while stack:
        root = stack.pop()
        dirs, names = [], []
        try:
            with os.scandir(root) as entries:
                for entry in entries:
                    try:
                        is_dir = entry.is_dir()
                    except OSError:
                        is_dir = False
                    (dirs if is_dir else names).append(entry.name)
        except OSError as e:
            onerror(e)
            continue
        yield root, dirs, names
        below = (os.path.join(root, d) for d in reversed(dirs))
        stack.extend(path for path in below if not os.path.islink(path))


def unreadable(label: str) -> Callable[[OSError], None]:
    """walk's onerror: a folder that cannot be read is refused; one removed while it was being listed is passed over."""

    def refuse(e: OSError) -> None:
        if e.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise os_failure(label, e.filename, e, "cannot read the folder") from None

    return refuse


@contextmanager
def open_regular(path: Path, label: str) -> Iterator[BinaryIO]:
    """path opened for binary reading, if it is a regular file; else DataError, without ever blocking.

    O_NONBLOCK because opening a FIFO that no one writes to waits forever; once the open file is known to be a
    regular file (fstat, so that a file swapped for a pipe after a stat cannot slip through), reads go on as usual.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise os_failure(label, path, e) from None
    try:
        kind = file_kind(os.fstat(fd).st_mode)
        if kind is not None:
            raise not_a_file(label, path, kind)
        if hasattr(os, "O_NONBLOCK"):  # (Windows has neither the flag nor FIFOs to need it)
            os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        try:
            yield f
        except OSError as e:  # the bodies only read: EIO from a failing disk or share
            raise os_failure(label, path, e) from None


def check_unchanged(f: BinaryIO, source: Source, label: str, ctime: bool = True) -> None:
    """DataError unless the open file f, just read as far as source's listed size, still has that size and the
    times it was listed with (os.fstat: at once, not after both passes over the corpus).

    A file is read no further than its listed size, so one that grows meanwhile (appended to, or given a hole with
    `truncate -s 1T`) is not read to its new end for hours; its growth is said here instead. Running again cannot
    help a file that is being written to, so that line says to copy it first. ctime=False: a change of its
    metadata alone (chmod, a backup tool's extended attributes) leaves its text as it was: no change.
    """
    st = os.fstat(f.fileno())
    if (st.st_size, st.st_mtime_ns) == (source.size, source.mtime_ns) and (
            not ctime or st.st_ctime_ns == source.ctime_ns):
        return
    if st.st_size > source.size:
        word = shell_word(str(source.path))
        raise DataError(
            f"{label}: {quoted(source.path)} grew from {source.size:,} to {st.st_size:,} bytes while it was being "
            f"read; a file still being written to (a live log) changes at every run: train on a copy of it, kept out "
            f"of what data.path reads (cp -- {word if len(word) <= QUOTE_LIMIT else 'FILE'} COPY)"
        )
    raise DataError(f"{label}: {quoted(source.path)} changed while it was being read; run again")
