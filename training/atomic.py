"""Writing a file so that a crash at any moment leaves the old one or the new one whole: checkpoints, config.yaml,
bench.py's reports. Imports no torch: training/outdir.py's checks run before train.py imports it."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


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
