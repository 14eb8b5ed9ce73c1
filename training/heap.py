"""The C allocator told to keep the memory a training step frees, so that the next step does not fault it back in.

A CPU step allocates its large tensors (activations, gradients, the products' packed operands) with malloc and frees
them before the next. glibc's malloc hands a block above its mmap threshold straight back to the kernel when freed,
and gives the top of its heap back (``brk``) once more than its trim threshold lies free there; the next step then
touches fresh pages, each a page fault and a zeroed page. Measured on a 2-core Zen 5 EPYC (2026-12-04, float32, the
compiled step, whole train.py processes at two lengths differenced, TINYCHAR_KEEP_MEMORY=0 and 1 in turns):
nanoGPT's CPU config (block 64, 4 layers of 128, batch 12, AdamW) with the libraries kept to AVX2 took about 6,500
page faults and 37.7-39.5 ms a step, against about none and 24.8-27.5 ms with the memory kept; through MKL's AVX-512
code glibc faulted in some runs and not others (36.0 and 26.5 ms, against 26.0-28.6); configs/shakespeare_char.yaml
(block 256, 6 layers of 384, batch 64) took about 950,000 faults and 5.2 s a step, against 3,000 and 3.3-3.7 s. Where
no step faults (block 8; block 64 through oneDNN, the Zen 5's default) both ran alike; sample.py,
whose block-64 characters fault nothing (1,000 and 6,000 of them kept to AVX2: as many faults), is left as it is.

So train.py, while it runs, has glibc serve every block from its heap (no mmap) and never trim the heap's top
(``mallopt``). The memory a step frees stays with the process for the next step, which needs it again: the peak
resident memory rose by 2-5% (block 64: 434 to 441-443 MB; block 256: 4.25 to 4.32-4.45 GB) and did not grow with
the steps. TINYCHAR_KEEP_MEMORY=0 leaves glibc's own policy. Other C libraries (macOS, Windows, musl) are left as
they are.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager

from .devices import DeviceError

# mallopt's parameters (glibc's malloc.h) and glibc's defaults for the two this sets, to put back on leaving.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
DEFAULT_TRIM_THRESHOLD = 128 * 1024
DEFAULT_MMAP_MAX = 65536
NEVER = -1  # as a trim threshold: mallopt takes an int and glibc stores it as a size_t, the largest there is

# TINYCHAR_KEEP_MEMORY: 1 (the default) or 0; see memory_kept.
KEEP_SETTINGS = ("1", "0")


def keep_wanted() -> bool:
    """TINYCHAR_KEEP_MEMORY: whether to keep freed memory for the next step (1, unset or empty) or leave the C
    library's policy (0); another value is a DeviceError."""
    setting = os.environ.get("TINYCHAR_KEEP_MEMORY", "1").strip() or "1"
    if setting not in KEEP_SETTINGS:
        raise DeviceError(f"TINYCHAR_KEEP_MEMORY must be 1 (keep the memory a training step frees for the next, the "
                          f"default) or 0 (give it back to the system as the C library decides), got {setting!r}")
    return setting == "1"


def glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc (whose mallopt this module speaks), else None."""
    try:
        os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):  # no confstr (Windows), or not glibc
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


@contextmanager
def memory_kept() -> Iterator[bool]:
    """While inside, glibc's malloc serves every block from its heap and never gives the heap's top back to the
    system, unless TINYCHAR_KEEP_MEMORY=0 or the C library is not glibc; yields whether it does. On leaving, glibc's
    default limits are set again (fixed ones: glibc's own raise themselves as large blocks are freed, and that cannot
    be turned back on) and what lies free is given back (``malloc_trim``), for the Python that goes on in the process
    (a test, a notebook)."""
    libc = glibc() if keep_wanted() else None
    if libc is None or not libc.mallopt(M_MMAP_MAX, 0):
        yield False
        return
    try:
        libc.mallopt(M_TRIM_THRESHOLD, NEVER)
        yield True
    finally:
        libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
        libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
        libc.malloc_trim(0)
