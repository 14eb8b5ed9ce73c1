"""Glob patterns in data.path, expanded so that no layout of links can make them run forever.

glob.glob(recursive=True) follows links to folders under '**', so a link back up the tree (`ln -s . latest`, as
release folders often have) makes it walk latest/latest/latest/... until a lookup passes the system's 40 links:
with two such links, some 2**40 paths. Here '**' walks real folders only, as os.walk and the folder form of
data.path do; '*' and the other wildcards still follow links, as glob does, but each real folder is visited at most
once for each part of the pattern, so the work is bounded by the folders that exist, not by the paths that lead to
them.
"""

from __future__ import annotations

import errno
import fnmatch
import glob
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from .paths import os_failure, stat_path, unreadable, walk

_GONE = (errno.ENOENT, errno.ENOTDIR)  # removed while listed, or a file where the pattern wants a folder


def expand(pattern: Path, label: str) -> list[Path]:
    """The paths matching pattern, sorted; names starting with '.' only where the pattern's part does too.

    Where '**' ends the pattern it matches the folder it stands in, whose files the caller walks; elsewhere it
    stands for that folder and every real (not linked) folder under it, hidden ones left out, as in glob.
    """
    return sorted(set(_matches(pattern, label)), key=str)


def matches_any(pattern: Path, label: str) -> bool:
    """Whether pattern matches anything expand would give, looking no further than the first match."""
    return next(_matches(pattern, label), None) is not None


def _matches(pattern: Path, label: str) -> Iterator[Path]:
    """expand's paths as they are found: unsorted, and one of them may come more than once."""
    parts = pattern.parts
    base = fixed_part(pattern)
    first = len(base.parts) if base != Path() else 0
    st = stat_path(base, label)  # the fixed part of the pattern: any failure but absence is the person's to fix
    if st is None or not stat.S_ISDIR(st.st_mode):
        return
    yield from _match(base, parts[first:], set(), label)


def fixed_part(pattern: Path) -> Path:
    """The folders of pattern before its first wildcard ('.' when it starts with one)."""
    parts = pattern.parts
    first = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    return Path(*parts[:first]) if first else Path()


def _match(folder: Path, parts: tuple[str, ...], seen: set[tuple[int, int, int]], label: str) -> Iterator[Path]:
    """The paths under folder that match parts, visiting each (real folder, rest of the pattern) once.

    A stack of the (folder, part) pairs left to visit, not recursion, which a pattern of a thousand wildcard parts
    ran out of; a real folder is known by its device and inode (os.path.realpath took a system call for each folder
    above it, so a deep tree took time in the square of its depth).
    """
    stack = [(folder, 0)]
    while stack:
        folder, at = stack.pop()
        if at == len(parts):
            yield folder
            continue
        st = _status(folder, label, os.stat)
        if st is None:  # gone since it was listed
            continue
        visit = (st.st_dev, st.st_ino, len(parts) - at)
        if visit in seen:  # reached again through a link: the same real folder gives the same matches
            continue
        seen.add(visit)
        head, last = parts[at], at + 1 == len(parts)
        if head == "**":
            if last:
                yield folder
            else:
                stack += [(sub, at + 1) for sub in _real_folders(folder, label)]
        elif glob.has_magic(head):
            for name in _names(folder, label):
                if (name.startswith(".") and not head.startswith(".")) or not fnmatch.fnmatchcase(name, head):
                    continue
                if last:
                    yield folder / name
                elif _is_dir(folder / name, label):
                    stack.append((folder / name, at + 1))
        elif last:
            if _status(folder / head, label, os.lstat) is not None:
                yield folder / head
        elif _is_dir(folder / head, label):
            stack.append((folder / head, at + 1))


def _real_folders(top: Path, label: str) -> Iterator[Path]:
    """top and every folder under it reached without passing through a link; hidden ones left out."""
    for root, dirs, _ in walk(top, unreadable(label)):  # a link to a folder is not entered
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        yield Path(root)


def _names(folder: Path, label: str) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except OSError as e:
        if e.errno in _GONE:
            return []
        raise os_failure(label, folder, e, "cannot read the folder") from None


def _is_dir(path: Path, label: str) -> bool:
    st = _status(path, label, os.stat)
    return st is not None and stat.S_ISDIR(st.st_mode)


def _status(path: Path, label: str, how: Callable[[Path], os.stat_result]) -> os.stat_result | None:
    """how(path) (os.stat or os.lstat); None when nothing usable is there (absent, or a link that loops), DataError
    for a failure a person must see (a name too long, no permission)."""
    try:
        return how(path)
    except OSError as e:
        if e.errno in _GONE or e.errno == errno.ELOOP:
            return None
        raise os_failure(label, path, e) from None
