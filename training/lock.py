"""One live run per out_dir: an OS lock (flock) on out_dir/.lock, held for the run's whole life and dropped by the
kernel when the process ends, however it ends."""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from configs.userinput import shown

from .errors import UsageError

LOCK = ".lock"  # held (flock) by the process training in out_dir; holds its pid and host, for the message


class RunLock:
    """An exclusive OS lock (flock) on out_dir/.lock for a run's whole life. The kernel drops it when the process
    ends however it ends (kill -9 included), so it is never stale; the file itself stays, harmless."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOCK
        self.fd: int | None = None

    def busy(self) -> str | None:
        """Who holds the lock ('process 123 on host'), or None when no live run does. Takes nothing."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):  # no folder there: no run in it either
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return self._holder(fd)
        finally:
            os.close(fd)  # flock belongs to this open file: closing it releases only what it took
        return None

    def acquire(self) -> None:
        """Take the lock, or UsageError naming the live run that holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder(fd)
            os.close(fd)
            raise in_use(self.path.parent, holder) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            pid, host = os.pread(fd, 200, 0).decode("utf-8", "replace").split()[:2]
            return f"process {pid} on {host}"
        except (OSError, ValueError):
            return "another process"


def in_use(out_dir: Path, holder: str) -> UsageError:
    return UsageError(f"'{shown(str(out_dir))}' is in use by a run that is still going ({holder}); wait for it to "
                      f"end or stop it, or choose another out_dir")
