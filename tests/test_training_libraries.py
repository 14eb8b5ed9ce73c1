"""training/libraries.py: what interrupted compiles and writes left in the compile cache (libraries of compiled code cut
short, temporary files), removed before compiling."""

from __future__ import annotations

import errno
import os
import shutil
import signal
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
    from torch._inductor.codecache import CppCodeCache

    from training.libraries import whole_elf

    # A source of this test's own (the comment): inductor keeps what it loaded in memory, by the source's key, and
    # this process must build it anew, into the test's folder.
    source = f'extern "C" int answer() {{ return 41 + 1; }}  // {tmp_path}'
    probe = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
             "from pathlib import Path\n"
             "from torch._inductor.codecache import CppCodeCache\n"
             "from training.libraries import drop_damaged_libraries\n"
             "drop_damaged_libraries(Path(sys.argv[1]))\n"
             "lib = CppCodeCache.load(sys.argv[2])\n"
             "print(lib.answer(), lib._name)\n")
    # The process that loads the library cut short, below, is one of its own: it may die. Told, as prepare_compile
    # tells inductor, that the CPU's vector instruction sets need no test programs, which it would otherwise build and
    # run into the empty cache first (2026-12-05, 2-core AMD EPYC (Zen 3, AVX2): 6.5 -> 3.7 s of CPU).
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "TORCHINDUCTOR_VEC_ISA_OK": "1"}
    # The library is built here, in this process, where prepare_compile has readied inductor: a process to build it
    # took 3.4 s more CPU (torch's import).
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
        lib = CppCodeCache.load(source)
    library = Path(lib._name)
    assert lib.answer() == 42 and library.parent.parent == tmp_path
    whole = library.read_bytes()
    # cut in its code, what dlopen maps is not there: a file of its own, as this process keeps the whole one mapped
    library.unlink()
    library.write_bytes(whole[:len(whole) // 6])
    again = subprocess.run([sys.executable, "-c", probe, str(tmp_path), source], capture_output=True, text=True,
                           env=env, check=False)
    assert again.returncode == 0, again.stderr
    assert again.stdout.split()[0] == "42" and whole_elf(library)


# A marker's write killed midway (kill -9, the OOM killer, a power cut), as training.atomic's writer is, before the
# rename: the cache folder it wrote in on the first line
KILLED_WRITE = """import os, signal, sys
sys.path.insert(0, sys.argv[1])
from training import atomic, compile_cache
print(compile_cache.cache_folder(), flush=True)
atomic.os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
compile_cache.remember_compile("train-abc", 1.0)
"""


def test_the_temporary_files_of_writes_killed_midway_are_removed_from_the_cache_once_abandoned(monkeypatch, tmp_path):
    """A marker's write, or torch's of a step saved whole, killed before its rename left its temporary file in the
    compile cache folder (`.tinychar-<key>.json.<random>.tmp`, `tmp<random>`: the saved step's some MB), and nothing
    ever removed it. One an hour old is removed before the next compile; a younger one may still be being written."""
    import tempfile

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", KILLED_WRITE, str(ROOT)], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    assert done.returncode == -signal.SIGKILL, done.stderr
    folder = Path(done.stdout.strip())
    left = [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    assert [p.name.startswith(".tinychar-train-abc.json.") for p in left] == [True]
    with tempfile.NamedTemporaryFile(dir=folder, delete=False) as saving:  # as torch's atomic_write_binary names it
        saving.write(b"a step, cut short")
    (folder / "tmpabcd_123").mkdir()  # not a file: never removed
    kept = {name: b"" for name in ("tinychar-train-abc.json", "tinychar-markers.lock", "notes.tmp", "tmp.txt")}
    for name, data in kept.items():
        (folder / name).write_bytes(data)
    (folder / "ab").mkdir()
    (folder / "ab" / ".tinychar-k.json.abcd1234.tmp").write_bytes(b"")  # below: inductor's folders, never ours
    old = time.time() - 2 * 3600  # two hours unchanged, where their writers take a second at most
    for path in [*folder.iterdir(), folder / "ab" / ".tinychar-k.json.abcd1234.tmp"]:
        os.utime(path, (old, old))
    young = folder / ".tinychar-train-xyz.json.0123abcd.tmp"  # another process's write, under way
    young.write_bytes(b"{")

    monkeypatch.setattr(compile_cache, "cache_folder", lambda say=False: folder)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "set by prepare_compile")  # put back after the test
    assert compile_cache.prepare_compile() == folder
    assert sorted(p.name for p in folder.iterdir()) == sorted([*kept, "ab", "tmpabcd_123", young.name])
    assert (folder / "ab" / ".tinychar-k.json.abcd1234.tmp").exists()
