"""The ids file of an encoded-corpus cache entry (data/cache.py): summed and checked as it is read, into memory or,
for a large corpus, a memory map; and, once written, put on disk and out of the page cache."""

from __future__ import annotations

import errno
import mmap
import os
import zlib
from typing import BinaryIO

import numpy as np
import torch

# Bytes read at a time by scan: 1 and 8 MB pieces read 200 MB cold in 0.12-0.19 s, 64 MB ones in 0.23-0.24 s
# (measured on a 2-core machine); 8 MB of memory is nothing beside the corpus it checks.
_CRC_PIECE = 8 << 20
# Ids files up to this size are read into the process's memory rather than mapped (see read_ids): 32 million
# characters of two-byte ids; tiny Shakespeare's take 2.2 MB. Larger ones stay mapped, their pages read as used.
IN_MEMORY_BYTES = 64 << 20


def scan(f: BinaryIO, dtype: np.dtype | None = None) -> tuple[int, int]:
    """(CRC-32, largest id) of the whole file f, read from its start as ids of dtype; the file is then dropped from
    the page cache. The largest id is -1 without a dtype, or for a file of no ids.

    Cheap enough for every start: on a 200 MB ids file (tiny Shakespeare repeated), on a 2-core machine, the CRC-32
    took 0.12-0.14 s with the file out of the page cache and 0.09-0.11 s with it in, and a whole cached
    prepare_corpus 0.13-0.15 s; zlib.crc32 alone runs at ~4 GB/s there (0.05 s for 200 MB in memory). The largest id
    is found in the same pass, on the pieces already read, for 0.02 s more (numpy's max over 200 MB of uint8 ids in
    8 MB pieces, in memory, on the same machine). Dropped from the page cache afterwards because reading
    leaves the file there in large folios, and a memory map over large folios maps a whole folio at each fault:
    3,000 random windows of that file then made 182 MB resident instead of 12 MB (measured, Linux 6.18); see settle.
    """
    f.seek(0)
    buffer = bytearray(_CRC_PIECE)
    view = memoryview(buffer)
    crc, top = 0, -1
    rest = b""  # the bytes of an id that a read cut in two (a short read, or a piece size no multiple of the id's)
    while n := f.readinto(buffer):
        crc = zlib.crc32(view[:n], crc)
        if dtype is not None:
            piece = rest + view[:n] if rest else view[:n]
            whole = len(piece) - len(piece) % dtype.itemsize
            if whole:
                top = max(top, int(np.frombuffer(piece, dtype, count=whole // dtype.itemsize).max()))
            rest = bytes(piece[whole:])
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return crc, top


def read_ids(f: BinaryIO, dtype: np.dtype, n_tokens: int) -> tuple[int, int, torch.Tensor]:
    """(CRC-32, largest id or -1, the ids) of the open ids file f: read into memory and summed there when it is no
    larger than IN_MEMORY_BYTES, so that what was checked is what is used; a larger one scanned, then mapped.

    A map shares the file's pages: a file cut short or rewritten in place while a run read it (`cp backup.ids ...`,
    `rsync --inplace`) killed the run with SIGBUS and no checkpoint, or trained it on other text without a word."""
    size = n_tokens * dtype.itemsize
    if size > IN_MEMORY_BYTES:
        return *scan(f, dtype), map_ids(f, dtype, n_tokens)
    data = np.empty(size, np.uint8)  # not zeroed first (bytearray(50 MB) took 30 ms); writable, so torch.from_numpy
    view, got = memoryview(data), 0  # has nothing to warn about
    f.seek(0)
    while got < size and (n := f.readinto(view[got:])):
        got += n
    if got < size or f.read(1):
        raise OSError(errno.EIO, "it changed size while it was read")
    if hasattr(os, "posix_fadvise"):  # as scan leaves it: a memory map of it (data/bench.py's) faults in page by page
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    ids = data.view(dtype)
    return zlib.crc32(data), int(ids.max()) if n_tokens else -1, torch.from_numpy(ids)


def map_ids(f: BinaryIO, dtype: np.dtype, n_tokens: int) -> torch.Tensor:
    """The open ids file as a 1-D tensor over a private, copy-on-write memory map: nothing is read until it is used."""
    if not n_tokens:  # an empty file cannot be mapped: a text of nothing but a byte-order mark has no ids
        return torch.from_numpy(np.zeros(0, dtype=dtype))
    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if hasattr(mapped, "madvise"):
        # Training reads windows at random: without this, each page fault reads ahead ~128 KB around it, which in
        # a cold cache made batches ~8x slower and resident memory grow ~16x faster (measured on a 1 GB file).
        mapped.madvise(mmap.MADV_RANDOM)
    # a writable buffer (copy-on-write) so torch.from_numpy has nothing to warn about; no byte is copied
    return torch.from_numpy(np.frombuffer(mapped, dtype=dtype, count=n_tokens))


def settle(out: BinaryIO) -> None:
    """Put the ids on disk and out of the page cache.

    On disk before the rename, so that a crash cannot leave a name pointing at blocks never written. Out of the
    page cache because the writes left it in large folios (up to 2 MB), and a memory map maps a whole cached folio
    on each fault: 3,000 random windows of a 2 GB file then made 1.5 GB resident (Linux 6.18, ext4). Read back
    page by page (MADV_RANDOM), a window costs 4 KB of resident memory instead.
    """
    out.flush()
    os.fsync(out.fileno())
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(out.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
