"""Writing a file so that a crash at any moment leaves the old one or the new one whole: checkpoints, config.yaml,
bench.py's reports; and a lock for a file that processes read, change and write back. Imports no torch:
training/outdir.py's checks run before train.py imports it."""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO

try:
    import fcntl
except ImportError:  # no flock (Windows): locked holds nothing
    fcntl = None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """Call write on a new file that then replaces path at once: a crash at any moment leaves the old file or the
    new one, never a part of either.

    The bytes go to a temporary file in the same folder, are flushed to disk, and the file is renamed over the
    old one (``os.replace`` is atomic within a file system). The temporary name, ``.<name>.<random>.tmp``, starts
    with a dot and ends in ``.tmp`` so it is never mistaken for the file itself; a process killed before the rename
    leaves it behind, for the next writer of the folder to remove.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp makes it owner-only; this is a normal file
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


# What flock says where the file system has no such locks (some network and FUSE file systems), and what NFS says of
# an exclusive lock on a file open for reading only (_lock_file).
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF}


@contextmanager
def locked(path: Path, wait: float = 0.0) -> Iterator[bool | None]:
    """Hold an exclusive lock (flock) on path, an empty file made if missing, for what two processes must not do at
    once (read a file, change it and write it back; find a job abandoned and take it over). Yields True where this
    process holds it, False where another still held it after wait seconds, None where there are no such locks (no
    flock on this platform or file system), holding nothing then. The kernel drops the lock when its process ends,
    however it ends, so it is never stale; the file stays, for the next to lock. OSError where path is not a regular
    file (a folder, a link, a named pipe put there) or cannot be made."""
    if fcntl is None:
        yield None
        return
    with _lock_file(path) as fd:
        yield _flock(fd, wait)  # released when the file closes


def _flock(fd: int, wait: float) -> bool | None:
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
        except OSError as e:
            if e.errno in _NO_FLOCK:
                return None
            raise
        time.sleep(0.01)


@contextmanager
def _lock_file(path: Path) -> Iterator[int]:
    """path opened (made if missing) as a lock file: never through a link, never waiting on a named pipe, and never
    anything but a regular file (opening a device can do things)."""
    with suppress(FileNotFoundError):
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise OSError(errno.EINVAL, f"'{path.name}' is there and is not a lock file")
    # Made as writable as the umask allows, as the markers are (write_atomic): in a cache folder users share, the
    # file one user made stays for the next to lock, and a file only its maker could write was refused to the others
    # (Permission denied). One of another user's that this user may only read is opened for reading, which flock
    # needs no more than, except on NFS, which takes flock for a lock of the file's bytes, a write lock for LOCK_EX
    # (EBADF, taken as no locks there: _NO_FLOCK).
    flags = os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, os.O_RDWR | flags, 0o666)
    except PermissionError:
        fd = os.open(path, os.O_RDONLY | flags, 0o666)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # put there meanwhile
            raise OSError(errno.EINVAL, f"'{path.name}' is there and is not a lock file")
        yield fd
    finally:
        os.close(fd)
