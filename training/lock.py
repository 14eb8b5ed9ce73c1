"""One live run per out_dir: an OS lock (flock) on out_dir/.lock, held for the run's whole life and dropped by the
kernel when the process ends, however it ends."""

from __future__ import annotations

import fcntl
import os
import re
import socket
import stat
import tempfile
from pathlib import Path

from configs.errors import UsageError
from configs.userinput import shown

LOCK = ".lock"  # held (flock) by the process training in out_dir; holds its pid and host, for the message
# .lock is opened without following a link, which would have the run write its pid into the file the link names,
# outside out_dir, and without waiting, which opening a named pipe for reading would do until a writer came.
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK


class RunLock:
    """An exclusive OS lock (flock) on out_dir/.lock for a run's whole life. The kernel drops it when the process
    ends however it ends (kill -9 included), so it is never stale; the file itself stays, harmless."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOCK
        self.fd: int | None = None

    def busy(self) -> str | None:
        """Who holds the lock ('process 123 on host'), or None when no live run does. Takes nothing."""
        for _ in range(100):  # as in acquire: a free file that is no longer .lock says nothing of the one that is
            try:
                fd = self._open(os.O_RDONLY)
            except (FileNotFoundError, NotADirectoryError):  # no folder there: no run in it either
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return self._holder(fd)
            else:
                if self._named(fd):
                    return None
            finally:
                os.close(fd)  # flock belongs to this open file: closing it releases only what it took
        return "a process that keeps replacing its .lock"

    def acquire(self) -> None:
        """Take the lock, or UsageError naming the live run that holds it."""
        for _ in range(100):  # another run may put a new .lock in place between the open and the lock: open again
            fd = self._open(os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._holder(fd)
                os.close(fd)
                raise in_use(self.path.parent, holder) from None
            if self._named(fd):
                break
            os.close(fd)
        else:
            raise UsageError(f"'{shown(str(self.path))}' keeps being replaced while a run takes it; stop whatever is "
                             f"replacing it, or choose another out_dir")
        if os.fstat(fd).st_nlink == 1 and not _written_by_a_run(fd):
            # a file of a person's, with no other name to keep it by: writing the pid would have replaced it
            os.close(fd)
            raise UsageError(f"'{shown(str(self.path))}' holds something a run did not write (a run's .lock holds its "
                             f"process id and host); move the file away, or choose another out_dir")
        if os.fstat(fd).st_nlink > 1:
            # A hard link: the file has other names (a copy made with `cp -al`, say), and writing the pid into it
            # would overwrite it under every one of them. Nobody holds its lock (just taken), so .lock becomes a file
            # of its own, locked before it takes the name; the other names keep theirs as it was.
            try:
                own = self._own_file()
            finally:
                os.close(fd)
            fd = own
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        self.fd = fd

    def _named(self, fd: int) -> bool:
        """Whether the file open as fd is still the one named .lock (not one another run has since replaced)."""
        try:
            named = os.lstat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _own_file(self) -> int:
        """A new, locked file put in the place of .lock (an atomic rename): its open descriptor."""
        fd, tmp = tempfile.mkstemp(prefix=f"{LOCK}.", suffix=".tmp", dir=self.path.parent)
        try:
            os.fchmod(fd, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no other process knows of it yet
            os.replace(tmp, self.path)
        except BaseException:
            os.close(fd)
            Path(tmp).unlink(missing_ok=True)
            raise
        return fd

    def _open(self, flags: int) -> int:
        """.lock opened with flags, or UsageError if it is anything but a regular file. Looked at before it is
        opened, so that a device is never opened, and again once open, in case another was put in its place."""
        self._refuse_unless_a_file()
        try:
            fd = os.open(self.path, flags | _OPEN_FLAGS, 0o644)
        except PermissionError as e:  # another user's .lock, or one made unreadable: "give another path" said
            raise UsageError(f"cannot open '{shown(str(self.path))}' ({e.strerror}), the lock that keeps two runs out "
                             f"of one folder; let this user read and write it, or choose another out_dir") from None
        except OSError:
            self._refuse_unless_a_file()  # a link (ELOOP), a socket (ENXIO) or a folder (EISDIR) put there meanwhile
            raise
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise not_a_lock(self.path, mode)
        return fd

    def _refuse_unless_a_file(self) -> None:
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:  # acquire makes it; for busy there is no run
            return
        if not stat.S_ISREG(mode):
            raise not_a_lock(self.path, mode)

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            pid, host = os.pread(fd, 200, 0).decode("utf-8", "replace").split()[:2]
            return f"process {pid} on {host}"
        except (OSError, ValueError):
            return "another process"


# What a run writes into .lock: its process id and host name, on one line.
_LOCK_TEXT = re.compile(rb"\d+ \S+\n?")


def _written_by_a_run(fd: int) -> bool:
    """Whether the open .lock is empty or holds what a run writes there (_LOCK_TEXT)."""
    head = os.pread(fd, 512, 0)
    return not head or _LOCK_TEXT.fullmatch(head) is not None


def in_use(out_dir: Path, holder: str) -> UsageError:
    return UsageError(f"'{shown(str(out_dir))}' is in use by a run that is still going ({holder}); wait for it to "
                      f"end or stop it, or choose another out_dir")


def not_a_lock(path: Path, mode: int) -> UsageError:
    """The refusal of a .lock that is not a regular file: no run made it, and using it could hang the run or write
    outside out_dir."""
    kind = ("a symbolic link" if stat.S_ISLNK(mode) else "a named pipe" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a folder" if stat.S_ISDIR(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a special file")
    return UsageError(f"'{shown(str(path))}' is {kind}, not a lock file that tinychar made; remove it (a run makes "
                      f"its own .lock), or choose another out_dir")


def file_identity(path: Path) -> tuple[int, int, int, int] | None:
    """What tells one version of a file from another (device, inode, size, modification time); None if absent. A
    checkpoint is replaced by a rename (write_atomic), so a new one always differs."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns
