"""training/libraries.py: libraries of compiled code cut short, removed from the compile cache before compiling."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, needs_cpu_compile

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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the check reads ELF, Linux's libraries")
def test_a_library_inductor_was_cut_short_linking_is_removed_at_once_unless_another_process_builds_it(tmp_path):
    """A run killed while inductor linked one of its libraries left it cut short, and for the next 10 minutes (it was
    "young", perhaps still being written) every run loaded it and died of SIGBUS. Inductor builds each under a lock
    (its cache folder's locks/<key>.lock, its own FileLock here), which tells one being built from one cut short."""
    import _ctypes

    from torch.utils._filelock import FileLock

    from training.libraries import drop_damaged_libraries

    whole = Path(_ctypes.__file__).read_bytes()
    ab = tmp_path / "ab"  # inductor's folder for the keys whose second and third letters are "ab"
    ab.mkdir()
    cut, building, done = ab / "cabcut.main.so", ab / "cabbuilding.so", ab / "cabdone.main.so"
    cut.write_bytes(whole[:4096])
    building.write_bytes(whole[:4096])
    done.write_bytes(whole)
    elsewhere = tmp_path / "zz" / "cabcut.so"  # not where inductor puts a library of that key: its age decides
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(whole[:4096])
    with FileLock(str(tmp_path / "locks" / "cabbuilding.lock")):  # another process at work on it
        assert drop_damaged_libraries(tmp_path) == 1
        assert sorted(p.name for p in ab.iterdir()) == ["cabbuilding.so", "cabdone.main.so"] and elsewhere.exists()
    assert drop_damaged_libraries(tmp_path) == 1  # its builder gone, and it not whole: cut short
    assert sorted(p.name for p in ab.iterdir()) == ["cabdone.main.so"] and elsewhere.exists()

    # where there are no locks (a file system whose flock says ENOLCK), the library's age decides
    from training import atomic

    def refused(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    cut.write_bytes(whole[:4096])
    with pytest.MonkeyPatch.context() as m:
        m.setattr(atomic, "fcntl", SimpleNamespace(flock=refused, LOCK_EX=2, LOCK_NB=4))
        assert drop_damaged_libraries(tmp_path) == 0 and cut.exists()
        assert drop_damaged_libraries(tmp_path, now=time.time() + 3600) == 2  # and the one elsewhere
        assert not cut.exists() and not elsewhere.exists()
    # nor where the lock cannot be taken (a file in place of the locks' folder)
    shutil.rmtree(tmp_path / "locks")
    (tmp_path / "locks").write_text("")
    cut.write_bytes(whole[:4096])
    assert drop_damaged_libraries(tmp_path) == 0 and cut.exists()
    assert drop_damaged_libraries(tmp_path, now=time.time() + 3600) == 1 and not cut.exists()


@needs_cpu_compile
@pytest.mark.slow
def test_a_library_inductor_built_and_a_killed_run_cut_short_is_built_again_not_loaded(tmp_path):
    """The same with inductor's own C++ cache, which builds a library where the check looks for it and under the
    lock it takes: cut short a moment ago, it was loaded (the process died of SIGBUS, exit 135, no line)."""
    from training.libraries import whole_elf

    probe = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
             "from pathlib import Path\n"
             "from torch._inductor.codecache import CppCodeCache\n"
             "from training.libraries import drop_damaged_libraries\n"
             "drop_damaged_libraries(Path(sys.argv[1]))\n"
             "lib = CppCodeCache.load('extern \"C\" int answer() { return 41 + 1; }')\n"
             "print(lib.answer(), lib._name)\n")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    built = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, env=env,
                           check=False)
    assert built.returncode == 0, built.stderr
    answer, library = built.stdout.split()
    library = Path(library)
    assert answer == "42" and library.parent.parent == tmp_path
    whole = library.read_bytes()
    library.write_bytes(whole[:len(whole) // 6])  # cut in its code: what dlopen maps is not there
    again = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, env=env,
                           check=False)
    assert again.returncode == 0, again.stderr
    assert again.stdout.split()[0] == "42" and whole_elf(library)
