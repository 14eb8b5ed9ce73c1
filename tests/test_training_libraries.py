"""training/libraries.py: libraries of compiled code cut short, removed from the compile cache before compiling."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from training import compile_cache


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the check reads ELF, Linux's libraries")
def test_libraries_of_compiled_code_cut_short_are_removed_before_compiling_and_whole_ones_kept(monkeypatch, tmp_path):
    """A library in the cache cut short (its linker killed, a full disk): loading it killed the process with SIGBUS at
    every later compile (exit 135, no line), or, empty, made every later run train eagerly. A missing one is built
    again. Here a real library (one of Python's own modules) and copies of it cut at several places."""
    import _ctypes

    from training.libraries import SETTLED_SECONDS, drop_damaged_libraries, whole_elf

    whole = Path(_ctypes.__file__).read_bytes()
    folder = tmp_path / "x86_64-avx2-0" / "ab"
    folder.mkdir(parents=True)
    cut = {f"cut{n}.so": whole[:n] for n in (0, 3, 60, 4096, len(whole) // 2, len(whole) - 1)}
    for name, data in {"whole.so": whole, "whole.main.so": whole, **cut, "notes.txt": b"", "c.cpp": b"x"}.items():
        (folder / name).write_bytes(data)
    assert whole_elf(folder / "whole.so") and not any(whole_elf(folder / name) for name in cut)
    old = time.time() - SETTLED_SECONDS - 1
    for path in folder.iterdir():
        os.utime(path, (old, old))
    (folder / "linking.so").write_bytes(whole[:4096])  # young: perhaps another process's linker at work on it
    assert drop_damaged_libraries(tmp_path) == len(cut)
    assert sorted(p.name for p in folder.iterdir()) == ["c.cpp", "linking.so", "notes.txt", "whole.main.so",
                                                          "whole.so"]

    # prepare_compile looks, in the folder the compiles go to
    monkeypatch.setattr(compile_cache, "cache_folder", lambda say=False: tmp_path)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "set by prepare_compile")  # put back after the test
    (folder / "cut.so").write_bytes(whole[:100])
    os.utime(folder / "cut.so", (old, old))
    assert compile_cache.prepare_compile() == tmp_path and not (folder / "cut.so").exists()
