"""training.heap: while train.py runs, glibc keeps the memory a step frees instead of giving it back to the system.
A bad TINYCHAR_KEEP_MEMORY is tested with the other numerics settings, in test_training_devices.py."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from training import heap

BLOCK = 96 << 20  # bytes: above glibc's largest mmap threshold (32 MB) and twice that, its largest trim threshold
MB = 1 << 20

needs_glibc = pytest.mark.skipif(heap.glibc() is None, reason="the C library is not glibc (mallopt is glibc's)")


def resident() -> int:
    """This process's resident memory in bytes (Linux), read without a buffer from malloc (which would then lie
    above the block that freed_back frees, and keep it from the top of the heap)."""
    fd = os.open("/proc/self/statm", os.O_RDONLY)
    try:
        return int(os.read(fd, 200).split()[1]) * os.sysconf("SC_PAGE_SIZE")
    finally:
        os.close(fd)


def freed_back() -> int:
    """Bytes the process's resident memory fell by when a block of BLOCK bytes, allocated as torch allocates a CPU
    tensor's memory (posix_memalign, 64-byte aligned) and written through, was freed. Nothing else is allocated in
    between, so the block is what lies at the top of the heap when freed."""
    libc = ctypes.CDLL(None)
    libc.free.argtypes = [ctypes.c_void_p]
    block = ctypes.c_void_p()
    assert libc.posix_memalign(ctypes.byref(block), 64, ctypes.c_size_t(BLOCK)) == 0
    ctypes.memset(block, 1, BLOCK)
    held = resident()
    libc.free(block)
    return held - resident()


@needs_glibc
def test_a_freed_block_stays_with_the_process_inside_and_goes_back_on_leaving(monkeypatch):
    monkeypatch.delenv("TINYCHAR_KEEP_MEMORY", raising=False)
    assert freed_back() > BLOCK - 8 * MB  # glibc's own policy: the block was mapped for itself, and unmapped
    with heap.memory_kept() as kept:
        assert kept
        assert freed_back() < 8 * MB  # kept in the heap, for the next step
        before = resident()
    assert before - resident() > BLOCK - 8 * MB  # malloc_trim gave it back
    assert freed_back() > BLOCK - 8 * MB  # and glibc's limits are back


@needs_glibc
def test_keep_memory_0_leaves_the_c_librarys_policy(monkeypatch):
    monkeypatch.setenv("TINYCHAR_KEEP_MEMORY", "0")
    with heap.memory_kept() as kept:
        assert not kept
        assert freed_back() > BLOCK - 8 * MB


class RecordingLibc:
    """Stands in for glibc: records what is asked of it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append(("mallopt", param, value))
        return 1

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", pad))
        return 1


def test_a_training_run_keeps_freed_memory_while_it_runs_and_sets_glibcs_limits_back(tmp_path, monkeypatch):
    from conftest import tiny_overrides
    from training_runs import train_main, write_corpus

    libc = RecordingLibc()
    monkeypatch.setattr(heap, "glibc", lambda: libc)
    monkeypatch.delenv("TINYCHAR_KEEP_MEMORY", raising=False)
    built = []
    real_build = torch.nn.Module.__init__

    def build(self, *args, **kwargs):  # when the model is made, the heap is already kept
        built.append(len(libc.calls))
        real_build(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__init__", build)
    assert train_main(tiny_overrides(write_corpus(tmp_path), tmp_path / "run", **{"train.max_iters": 2})) == 0
    assert libc.calls == [("mallopt", heap.M_MMAP_MAX, 0), ("mallopt", heap.M_TRIM_THRESHOLD, heap.NEVER),
                          ("mallopt", heap.M_MMAP_MAX, heap.DEFAULT_MMAP_MAX),
                          ("mallopt", heap.M_TRIM_THRESHOLD, heap.DEFAULT_TRIM_THRESHOLD), ("malloc_trim", 0)]
    assert built and min(built) == 2
