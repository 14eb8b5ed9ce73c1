"""Where compiled code is kept (training.compile_cache): a folder per instruction set in tinychar's cache folder or
the user's, torch pointed at it, the markers that tell a later run its cache is warm, and what the log expects a
compile to take."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, needs_cpu_compile, train_small_run

from configs.userinput import shown
from model import GPTConfig
from sampling.compiling import sampling_key
from training import c_kernels, compile_cache
from training.compile_cache import cannot_compile, compile_options
from training.config import TrainConfig
from training.engine import compile_key

CPU = torch.device("cpu")


def test_the_log_expects_a_compile_from_the_cache_to_take_what_the_last_one_from_it_took(monkeypatch, tmp_path):
    monkeypatch.setattr(compile_cache, "_USER_CACHE", str(tmp_path))
    key = sampling_key(GPTConfig(vocab_size=5), 1, 0.8, None, None, CPU)
    # tiny.yaml's 3 layers compiled in 26 s on a Zen 4 EPYC and in 61 s on a Zen 1 (it said 15-25 there)
    assert compile_cache.compile_expectation(key, CPU) == "first time for this model: about 15-60 s"
    # the step unrolls its layers and micro-batches: configs/shakespeare_char.yaml's 6 layers compiled in 49 s (it
    # said 15-25), 2 layers of 3 micro-batches in 62 s
    assert compile_cache.compile_expectation(key, CPU, layers=6) == "first time for this model: about 30-120 s"
    assert compile_cache.compile_expectation(key, CPU, 2, 3) == "first time for this model: about 45-180 s"
    cuda = torch.device("cuda")
    assert compile_cache.compile_expectation(key, cuda, 6) == "first time for this model: about 30 s on an H100"
    compile_cache.remember_compile(key, 26.0, cold=True)  # from an empty cache: the next compile reads it, faster
    assert compile_cache.compile_expectation(key, CPU) == "cached; the first compile took 26 s"
    assert compile_cache.cached_compile_seconds(key) == 26.0
    compile_cache.remember_compile(key, 3.5)
    assert compile_cache.compile_expectation(key, CPU) == "cached: about 4 s"
    compile_cache._marker(key).write_text('{"seconds": 2.0}', encoding="utf-8")  # a marker from before "cold" was kept
    assert compile_cache.compile_expectation(key, CPU) == "cached: about 2 s"
    compile_cache._marker(key).write_text("[]", encoding="utf-8")
    assert compile_cache.cached_compile_seconds(key) is None


def test_the_marker_keeps_the_step_times_measured_beside_the_compile_time(monkeypatch, tmp_path):
    monkeypatch.setattr(compile_cache, "_USER_CACHE", str(tmp_path))
    key = sampling_key(GPTConfig(vocab_size=5), 1, 0.8, None, None, CPU)
    compile_cache.remember_step_times(key, 54.0, 33.0)
    assert compile_cache.measured_saving(key) is None  # timed, but never compiled here: the cache is cold
    compile_cache.remember_compile(key, 8.3)
    assert compile_cache.measured_saving(key) == (54.0, 33.0, 8.3)
    compile_cache.remember_compile(key, 40.0, cold=True)  # a compile from an empty cache: the warm one is a share
    assert compile_cache.measured_saving(key) == (54.0, 33.0, 40.0 * compile_cache.WARM_SHARE)
    compile_cache.remember_step_times(key, 50.0, 30.0)  # either write keeps what the other wrote
    assert compile_cache.measured_saving(key) == (50.0, 30.0, 40.0 * compile_cache.WARM_SHARE)
    assert compile_cache.cached_compile_seconds(key) == 40.0
    compile_cache._marker(key).write_text('{"seconds": 8.3, "eager_ms": "x", "compiled_ms": 1}', encoding="utf-8")
    assert compile_cache.measured_saving(key) is None and compile_cache.cached_compile_seconds(key) == 8.3



def test_two_processes_noting_one_step_at_once_keep_both_notes(monkeypatch, tmp_path):
    """The warm-cache helper wrote its step times while a run of the same step noted its compile: the run wrote back
    the marker it had read before, without them, and no later helper times them again. Here the other writer comes
    just as this one has read the marker, from a thread of its own (each opens the lock file itself, as another
    process would), and this one goes on once the other has written or waits for the lock."""
    from training import atomic

    monkeypatch.setattr(compile_cache, "_USER_CACHE", str(tmp_path))
    key = sampling_key(GPTConfig(vocab_size=5), 1, 0.8, None, None, CPU)
    read, other, written_or_waiting = compile_cache.read_marker, [], threading.Event()

    def waiting(seconds):
        written_or_waiting.set()
        time.sleep(seconds)

    def read_then_let_the_other_write(name):
        last = read(name)
        if not other:  # this process's read: the other's update comes now
            other.append(threading.Thread(target=lambda: (compile_cache.remember_step_times(key, 54.0, 33.0),
                                                          written_or_waiting.set())))
            other[0].start()
            assert written_or_waiting.wait(60)
        return last

    monkeypatch.setattr(atomic, "time", SimpleNamespace(monotonic=time.monotonic, sleep=waiting))
    monkeypatch.setattr(compile_cache, "read_marker", read_then_let_the_other_write)
    compile_cache.remember_compile(key, 8.3)
    other[0].join(60)
    assert compile_cache.measured_saving(key) == (54.0, 33.0, 8.3)
    assert json.loads(compile_cache._marker(key).read_text()) == {"seconds": 8.3, "cold": False, "eager_ms": 54.0,
                                                                  "compiled_ms": 33.0}

def test_a_marker_holding_an_integer_too_large_for_a_float_is_no_measurement(monkeypatch, tmp_path):
    """JSON reads 1 and 400 zeros as a Python int, which float() cannot convert: train.py and sample.py stopped in an
    OverflowError's traceback on such a marker, before choosing their engine."""
    monkeypatch.setattr(compile_cache, "_USER_CACHE", str(tmp_path))
    huge = "1" + "0" * 400
    for field in ("seconds", "eager_ms", "compiled_ms"):
        fields = {"seconds": "8", "cold": "false", "eager_ms": "10", "compiled_ms": "5", field: huge}
        text = "{" + ", ".join(f'"{name}": {value}' for name, value in fields.items()) + "}"
        compile_cache._marker("step-k").write_text(text, encoding="utf-8")
        assert compile_cache.measured_saving("step-k") is None, field
        assert compile_cache.cached_compile_seconds("step-k") == (None if field == "seconds" else 8.0)

def test_inductor_options_keep_the_cpp_wrapper_to_cpus(monkeypatch):
    """The C++ wrapper saves a CPU step's overhead; on CUDA it tripled the cold compile (H100: 102.7 s vs 29.3 s).
    On a CPU it is built at -O1 apart from the kernels, where this torch can. On CUDA, mix-order reduction is turned
    off where torch has it (it read a workspace it had not written)."""
    monkeypatch.delenv("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", raising=False)
    known = compile_cache.inductor_settings()
    later = {"cpp_wrapper_build_separate": True, "cpp_cache_precompile_headers": False}
    assert set(later) <= known or tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 13)  # 2.13 has
    assert compile_options(CPU) == {"cpp_wrapper": True, **{k: v for k, v in later.items() if k in known}}
    has_it = "triton.mix_order_reduction" in compile_cache.inductor_settings()
    assert compile_options(torch.device("cuda")) == ({"triton.mix_order_reduction": False} if has_it else {})
    compile_options(CPU)["cpp_wrapper"] = False  # a copy: the callers' options cannot change the defaults
    assert compile_options(CPU)["cpp_wrapper"] is True
    monkeypatch.setenv("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "1")  # the user's choice stands
    assert "cpp_cache_precompile_headers" not in compile_options(CPU)
    monkeypatch.setattr(compile_cache, "inductor_settings", lambda: {"cpp_wrapper"})  # a torch from before the rest
    assert compile_options(torch.device("cuda")) == {}
    assert compile_options(CPU) == {"cpp_wrapper": True}


def test_code_compiled_under_other_inductor_options_is_not_taken_for_cached(monkeypatch):
    """The options are part of inductor's own cache key: the compile keys, whose markers say how long a compile from
    the cache takes (and so whether `auto` compiles), change with them."""

    def keys(device: torch.device) -> tuple[str, str]:
        tc = TrainConfig()
        return (compile_key(GPTConfig(vocab_size=5), tc, device, torch.float32),
                sampling_key(GPTConfig(vocab_size=5), 1, 0.8, None, None, device))

    cuda = torch.device("cuda")
    cpu_keys, cuda_keys = keys(CPU), keys(cuda)
    monkeypatch.setattr(compile_cache, "COMPILE_OPTIONS", {"cpp_wrapper": True})  # the wrapper built with its kernels
    assert all(a != b for a, b in zip(keys(CPU), cpu_keys, strict=True)) and keys(cuda) == cuda_keys
    monkeypatch.setattr(compile_cache, "CUDA_OPTIONS", {})
    assert all(a != b for a, b in zip(keys(cuda), cuda_keys, strict=True))


def test_cannot_compile_names_what_is_missing(monkeypatch):
    assert "mps" in cannot_compile(torch.device("mps"))
    monkeypatch.setattr(c_kernels.shutil, "which", lambda name: None)
    assert "C++ compiler" in cannot_compile(CPU)


def test_compile_cache_goes_to_tinychars_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setattr(compile_cache, "_USER_CACHE", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    here = compile_cache.machine_tag(torch.backends.cpu.get_cpu_capability(), compile_cache.cpu_vector_flags())
    assert compile_cache.compile_cache_dir() == tmp_path / "tinychar" / "compiled" / here
    # a relative XDG_CACHE_HOME is ignored (the XDG specification): it named another folder in each working folder
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.compile_cache_dir() == tmp_path / "home" / ".cache" / "tinychar" / "compiled" / here
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    # the user's own folder gets the same folder per instruction set inside it (a cluster's shared home holds the
    # code of every CPU it has); one that already is this machine's folder (a run's helper is given it) stays
    monkeypatch.setattr(compile_cache, "_USER_CACHE", str(tmp_path / "mine"))
    assert compile_cache.compile_cache_dir() == tmp_path / "mine" / here
    monkeypatch.setattr(compile_cache, "_USER_CACHE", str(tmp_path / "mine" / here))
    assert compile_cache.compile_cache_dir() == tmp_path / "mine" / here


CPUINFO = """processor\t: 0
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 fma avx avx2 avx512f avx512_bf16 amx_tile aes rdrand
bugs\t\t: spectre_v1
"""


def test_code_built_for_one_instruction_set_is_cached_apart_from_anothers():
    """Inductor's cache mixes them up (a crash, or NaN from step 1, when the vector capability changed between two
    runs on one cache), so each capability and set of vector flags has a folder of its own."""
    flags = compile_cache.cpu_vector_flags(CPUINFO)
    assert flags == {"sse", "sse2", "ssse3", "sse4_1", "sse4_2", "fma", "avx", "avx2", "avx512f", "avx512_bf16",
                     "amx_tile"}
    assert compile_cache.cpu_vector_flags("processor\t: 0\n") == set()
    tag = compile_cache.machine_tag
    tags = {tag("AVX512", flags), tag("AVX2", flags), tag("AVX512", flags - {"avx512_bf16"}), tag("AVX512", set(flags))}
    assert len(tags) == 3  # the same machine and capability give the same folder; any difference, another
    assert all("/" not in tag and " " not in tag for tag in tags)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT",
                    reason="this CPU has no vector unit torch uses")
def test_lowering_the_vector_capability_moves_the_compile_cache(tmp_path, monkeypatch):
    """ATEN_CPU_CAPABILITY (read once, when torch starts) takes a process to another cache folder, in tinychar's cache
    folder and in one the user names with TORCHINDUCTOR_CACHE_DIR alike."""
    # A process of its own for the lowered capability (torch reads it once), naming both folders: tinychar's, then the
    # one TORCHINDUCTOR_CACHE_DIR names (read when compile_cache is imported: set here as that import would have set
    # it). This process, at the capability it started with (not DEFAULT: above), names them for the CPU's own.
    shared = tmp_path / "shared"
    code = ("from training import compile_cache; print(compile_cache.compile_cache_dir()); "
            f"compile_cache._USER_CACHE = {str(shared)!r}; print(compile_cache.compile_cache_dir())")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    lowered = [Path(line) for line in subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).parents[1], env={**env, "ATEN_CPU_CAPABILITY": "default"},
        capture_output=True, text=True, check=True).stdout.split("\n") if line]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(compile_cache, "_USER_CACHE", None)
    mine = [compile_cache.compile_cache_dir()]
    monkeypatch.setattr(compile_cache, "_USER_CACHE", str(shared))
    mine.append(compile_cache.compile_cache_dir())
    for base, folders in ((tmp_path / "xdg" / "tinychar" / "compiled", [mine[0], lowered[0]]),
                          (shared, [mine[1], lowered[1]])):
        assert folders[0] != folders[1] and {f.parent for f in folders} == {base}
        assert folders[1].name == compile_cache.machine_tag("default", compile_cache.cpu_vector_flags())


def test_prepare_compile_points_torch_at_the_cache_and_skips_the_instruction_set_probes(monkeypatch, tmp_path):
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(compile_cache, "_USER_CACHE", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "elsewhere")  # put back after the test
    monkeypatch.delenv("TORCHINDUCTOR_VEC_ISA_OK", raising=False)
    # Set and put back by hand, not by monkeypatch: pytest 9.2 reads a torch config setting as missing, and so
    # deletes it when it undoes the patch, after which every compile in the process fails ("does not exist").
    kept = inductor_config.cpp.vec_isa_ok
    try:
        inductor_config.cpp.vec_isa_ok = None
        folder = compile_cache.prepare_compile()
        assert folder.parent == tmp_path / "tinychar" / "compiled" and folder.is_dir()
        assert compile_cache.os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
        assert inductor_config.cpp.vec_isa_ok is True
        # the user's own setting wins
        monkeypatch.setenv("TORCHINDUCTOR_VEC_ISA_OK", "0")
        inductor_config.cpp.vec_isa_ok = False
        compile_cache.prepare_compile()
        assert inductor_config.cpp.vec_isa_ok is False
    finally:
        inductor_config.cpp.vec_isa_ok = kept


def cache_folder_blocked(monkeypatch, tmp_path: Path) -> None:
    """tinychar's cache folder made impossible (a file where its folder goes, under XDG_CACHE_HOME), the temp folder
    in tmp_path/temp, and nothing said yet of a move."""
    monkeypatch.setattr(compile_cache, "_USER_CACHE", None)
    monkeypatch.setattr(compile_cache, "_SAID_MOVED", set())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "elsewhere")  # put back after the test
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))
    (tmp_path / "xdg").mkdir()
    (tmp_path / "xdg" / "tinychar").write_text("a file where the cache folder goes", encoding="utf-8")


def test_a_cache_folder_that_cannot_be_written_moves_to_the_temp_folder_keeping_its_instruction_set(monkeypatch,
                                                                                                     tmp_path, capsys):
    """The temp folder's cache had no folder per instruction set: a run kept to AVX2 and then a native one shared one
    folder, and the second crashed (heap corruption, exit 134). The move was not said either."""
    cache_folder_blocked(monkeypatch, tmp_path)
    wanted = compile_cache.compile_cache_dir()
    folder = compile_cache.prepare_compile()
    uid = os.getuid()
    assert folder == tmp_path / "temp" / f"tinychar-{uid}" / "compiled" / wanted.name and folder.is_dir()
    assert wanted.name.startswith(f"{compile_cache.platform.machine()}-")  # the instruction set's own folder
    assert capsys.readouterr().err == (
        f"compile cache: cannot use '{shown(str(wanted))}' (Not a directory), so compiled code goes to "
        f"'{shown(str(folder))}'; set TORCHINDUCTOR_CACHE_DIR to choose the folder\n")
    assert compile_cache.prepare_compile() == folder and capsys.readouterr().err == ""  # said once
    # where TORCHINDUCTOR_CACHE_DIR named it, that is what to change ("set it to choose the folder" told the person
    # to do what they had done)
    monkeypatch.setattr(compile_cache, "_SAID_MOVED", set())
    monkeypatch.setattr(compile_cache, "_USER_CACHE", str(tmp_path / "xdg" / "tinychar"))
    compile_cache.prepare_compile()
    assert capsys.readouterr().err.endswith(
        "; set TORCHINDUCTOR_CACHE_DIR, which names it, to a folder this user can write\n")


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="needs POSIX user ids (os.getuid)")
def test_the_temp_folders_stand_in_is_used_only_where_it_is_this_users_alone(monkeypatch, tmp_path):
    """Its name is known to all: another user could make it first, or let everyone write in it, and put there
    libraries that this user's compiles would load and run."""
    cache_folder_blocked(monkeypatch, tmp_path)
    root = tmp_path / "temp" / f"tinychar-{os.getuid()}"
    assert compile_cache.cache_folder().is_relative_to(root)
    assert root.stat().st_mode & 0o777 == 0o700  # made for this user alone
    root.chmod(0o777)
    open_to_all = rf"\(others can write in '{re.escape(shown(str(root)))}'; remove it\)"
    with pytest.raises(compile_cache.NoCacheFolder, match=open_to_all):
        compile_cache.cache_folder()
    root.chmod(0o755)  # others may read, not write: this user's own still
    assert compile_cache.cache_folder().is_relative_to(root)
    root.rename(tmp_path / "elsewhere")
    root.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(compile_cache.NoCacheFolder, match="is a symbolic link, not this user's own folder"):
        compile_cache.cache_folder()


@pytest.mark.parametrize("odd", [" ", "'", '"', "\\", "\t", "\n"],
                         ids=["space", "quote", "double-quote", "backslash", "tab", "newline"])
def test_a_cache_path_that_would_split_the_compilers_command_moves_to_the_temp_folder(monkeypatch, tmp_path, capsys,
                                                                                      odd):
    """Inductor splits the C++ compiler's command like a shell without quoting paths: a cache folder under a home
    with a space in it failed every compile ("CppCompileError", or "No closing quotation"), and the run trained
    eagerly."""
    monkeypatch.setattr(compile_cache, "_USER_CACHE", None)
    monkeypatch.setattr(compile_cache, "_SAID_MOVED", set())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / f"my{odd}cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "elsewhere")  # put back after the test
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))
    wanted = compile_cache.compile_cache_dir()
    folder = compile_cache.prepare_compile()
    assert folder == tmp_path / "temp" / f"tinychar-{os.getuid()}" / "compiled" / wanted.name and folder.is_dir()
    name = {" ": "a space", "\t": "a tab", "\n": "a line break", "\\": "a backslash"}.get(odd, "a quote")
    assert capsys.readouterr().err == (
        f"compile cache: cannot use '{shown(str(wanted))}' (its path holds {name}, which splits inductor's compiler "
        f"command), so compiled code goes to '{shown(str(folder))}'; set TORCHINDUCTOR_CACHE_DIR to choose the "
        f"folder\n")
    assert not wanted.exists()  # nothing made there
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "a temp"))
    with pytest.raises(compile_cache.NoCacheFolder, match="its path holds a space"):
        compile_cache.prepare_compile()


def test_a_cache_folder_on_a_read_only_file_system_is_said_to_be_so(monkeypatch, tmp_path):
    # a read-only mount was "Permission denied", which sends one to chmod a folder nobody can write
    from types import SimpleNamespace

    monkeypatch.setattr(compile_cache.os, "access", lambda path, mode: False)
    for flags, said in ((os.ST_RDONLY, "Read-only file system"), (0, "Permission denied")):
        monkeypatch.setattr(compile_cache.os, "statvfs", lambda path, flags=flags: SimpleNamespace(f_flag=flags))
        with pytest.raises(OSError) as e:
            compile_cache._usable(tmp_path)
        assert e.value.strerror == said


def test_with_no_folder_to_write_in_compiling_is_said_to_be_impossible_and_markers_follow_the_moved_cache(
        monkeypatch, tmp_path):
    """Where the temp folder's stand-in could not be made either, prepare_compile raised the OSError: train.py said
    "cannot use '<the temp folder's stand-in>'; give another path" (exit 2) of a path nobody gave, and sample.py
    "cannot write the samples to stdout" (exit 1). And the markers stayed in the folder that could not be written,
    so a cache moved to the temp folder never counted as warm."""
    cache_folder_blocked(monkeypatch, tmp_path)
    compile_cache.remember_compile("step-k", 12.5, cold=True)  # into the temp folder's stand-in, where code goes
    assert compile_cache.cached_compile_seconds("step-k") == 12.5
    moved = compile_cache.cache_folder()
    assert (moved / "tinychar-step-k.json").is_file()
    assert moved.parent.parent == tmp_path / "temp" / f"tinychar-{os.getuid()}"

    (tmp_path / "temp").rename(tmp_path / "old")
    (tmp_path / "temp").mkdir()
    (tmp_path / "temp" / f"tinychar-{os.getuid()}").write_text("a file where its stand-in goes", encoding="utf-8")
    monkeypatch.setattr(c_kernels.shutil, "which", lambda name: f"/usr/bin/{name}")  # a compiler, whatever is here
    wanted = compile_cache.compile_cache_dir()
    assert compile_cache.cannot_compile(torch.device("cpu")) == (
        f"no folder for compiled code: cannot use '{shown(str(wanted))}' (Not a directory) nor '{shown(str(moved))}' "
        f"('{shown(str(moved.parent.parent))}' is a file, not a folder; remove it); set TORCHINDUCTOR_CACHE_DIR to "
        f"a writable folder whose path has no space or quote")
    with pytest.raises(compile_cache.NoCacheFolder):
        compile_cache.prepare_compile()
    assert compile_cache.cached_compile_seconds("step-k") is None  # cold, without an error
    compile_cache.remember_compile("step-k", 1.0)  # nowhere to write it: nothing happens


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train.py", "sample.py"])
def test_with_no_folder_for_compiled_code_train_and_sample_go_on_eagerly_in_one_line(tmp_path, script):
    run = train_small_run(tmp_path)
    (tmp_path / "xdg").write_text("a file where the cache folder goes", encoding="utf-8")
    (tmp_path / "temp").mkdir()
    (tmp_path / "temp" / f"tinychar-{os.getuid()}").write_text("a file where its stand-in goes", encoding="utf-8")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "TMPDIR": str(tmp_path / "temp"),
           "OMP_NUM_THREADS": "1"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    if script == "train.py":
        args = ["--config", str(run / "config.yaml"), f"out_dir={tmp_path / 'again'}", "train.compile=true"]
    else:
        args = ["--out-dir", str(run), "--compile", "true", "--max-new-tokens", "20"]
    result = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    said = [line for line in (result.stdout + result.stderr).splitlines() if "no folder for compiled code" in line]
    assert len(said) == 1, result.stdout + result.stderr
    assert said[0].endswith("training without compiling)" if script == "train.py" else "sampling without compiling")


@needs_cpu_compile
@pytest.mark.slow
def test_sample_py_compiles_where_torchinductor_cache_dir_names_a_file(tmp_path):
    """torch.compile, called before the cache folder was chosen, made the folder TORCHINDUCTOR_CACHE_DIR named: a
    file there failed the run with "cannot write the samples to stdout (File exists)", exit 1, before compiling.
    Now it compiles in the temp folder's stand-in; stopped a second into that compile (a cold one takes 15 s)."""
    run = train_small_run(tmp_path)
    (tmp_path / "file").write_text("not a folder", encoding="utf-8")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "file"), "TMPDIR": str(tmp_path),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "sample.py", "--out-dir", str(run), "--compile", "true",
                             "--max-new-tokens", "20"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        said = [proc.stderr.readline() for _ in range(2)]  # the checkpoint's line, then the cache's
        assert said[1].startswith("compile cache: cannot use ") and "compiled code goes to" in said[1], said
        time.sleep(1.0)  # into the compile, past torch.compile's first call
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip() == "interrupted (SIGTERM); stopped sampling" and out == ""  # no "cannot write the samples"


def test_a_relative_torchinductor_cache_dir_is_taken_from_where_the_run_started(monkeypatch, tmp_path):
    # handed on as it was, the warm-cache helper (started in the project's folder) would have cached elsewhere
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(compile_cache, "_USER_CACHE", "mine")
    assert compile_cache.compile_cache_dir().parent == tmp_path / "mine"


def test_a_torchinductor_cache_dir_of_an_unknown_users_home_is_one_line_before_out_dir_is_touched(monkeypatch, tmp_path,
                                                                                                  capsys):
    # It was a 30-line traceback (Path.expanduser's "Could not determine home directory"), with the fresh out_dir
    # already claimed, holding .lock and config.yaml; sample.py failed the same way.
    import sample
    import train

    monkeypatch.setattr(compile_cache, "_USER_CACHE", "~nosuchuser-of-tinychar/cache")
    line = ("error: TORCHINDUCTOR_CACHE_DIR='~nosuchuser-of-tinychar/cache' starts with ~nosuchuser-of-tinychar, the "
            "home of a user this machine does not know; give the folder's full path, or unset it\n")
    tiny = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    assert train.main(["--config", tiny, f"out_dir={tmp_path / 'out'}"]) == 2
    assert capsys.readouterr().err == line and not (tmp_path / "out").exists()
    (tmp_path / "any.pt").write_bytes(b"a file: a path with none is refused before the setting is read")
    assert sample.main(["--checkpoint", str(tmp_path / "any.pt")]) == 2
    assert capsys.readouterr().err == line
    monkeypatch.setattr(compile_cache, "_USER_CACHE", str(tmp_path / "cache"))
    assert compile_cache.user_cache_problem() is None


def cache_events(fresh_functions: list, args: tuple) -> list[tuple[set[str], torch.Tensor]]:
    """Compile each function in turn, with prepare_compile's settings, a run's options (and so the precompiled headers
    of the suite's other compiles) and a cache of the test's own, and call it on args: what AOTAutograd's cache did
    for each (hit, miss, saved, bypass) and what it returned."""
    from torch._dynamo.utils import counters

    seen = []
    options = compile_options(torch.device("cpu"))
    for f in fresh_functions:
        before = dict(counters["aot_autograd"])
        y = torch.compile(f, fullgraph=True, dynamic=False, options=options)(*args)
        seen.append(({k for k, v in counters["aot_autograd"].items() if v != before.get(k, 0)} - {"total", "ok"}, y))
    return seen


def fresh(f, **constants):  # noqa: ANN001, ANN201
    """f as a function of a new code object, so that dynamo compiles it again (its own cache is per code object)
    while inductor's and AOTAutograd's caches may answer; constants become globals it reads."""
    import types

    return types.FunctionType(f.__code__.replace(), {**f.__globals__, **constants})


@pytest.fixture
def marked_functions(monkeypatch, tmp_path):  # noqa: ANN201
    """prepare_compile run with a cache of the test's own, torch's setting put back after the test."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(compile_cache, "_USER_CACHE", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "elsewhere")  # put back after the test
    kept = inductor_config.unsafe_marked_cacheable_functions  # by hand, as in the prepare_compile test above
    try:
        inductor_config.unsafe_marked_cacheable_functions = {"user.function": "1"}
        compile_cache.prepare_compile()
        assert inductor_config.unsafe_marked_cacheable_functions["user.function"] == "1"  # the user's entry kept
        yield
    finally:
        inductor_config.unsafe_marked_cacheable_functions = kept


MISS, HIT = {"autograd_cache_miss", "autograd_cache_saved"}, {"autograd_cache_hit"}


def product_under_autocast(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", DTYPE):  # noqa: F821 (a global of each fresh copy)
        return x @ w


def test_code_compiled_under_autocast_is_kept_in_the_cache_and_keyed_by_the_autocasts_dtype(marked_functions):
    """A bfloat16 step enters autocast inside its compiled code, which AOTAutograd's cache declined until
    prepare_compile marked autocast's functions cacheable (a compile from the warm cache 15 s -> 6 s). Another
    autocast dtype must still be another entry: float16 after bfloat16 compiles anew and gives float16."""
    w, x = torch.randn(8, 8), torch.randn(2, 8)
    dtypes = (torch.bfloat16, torch.bfloat16, torch.float16)
    seen = cache_events([fresh(product_under_autocast, DTYPE=d) for d in dtypes], (w, x))
    assert [events for events, _ in seen] == [MISS, HIT, MISS]
    for (_, y), dtype in zip(seen, dtypes, strict=True):
        assert y.dtype == dtype and torch.equal(y, x.to(dtype) @ w.to(dtype))


def doubled_while_below(x: torch.Tensor) -> torch.Tensor:
    from torch._higher_order_ops import while_loop

    start = (torch.zeros(1, dtype=torch.long), x)
    return while_loop(lambda i, _: i[0] < BOUND, lambda i, y: (i + 1, y * 2), start)[1]  # noqa: F821 (a global)


def test_a_while_loop_is_kept_in_the_cache_and_keyed_by_its_body(marked_functions):
    """The compiled sampler draws its characters in a while_loop, which inductor's and AOTAutograd's caches declined
    until prepare_compile marked it cacheable (sample.py's compile from the warm cache 14-16 s -> 6.5 s). The loops
    below differ only inside the loop's condition, a graph of its own: the second, the same as the first, comes from
    the cache; the third must not."""
    x = torch.ones(3)
    bounds = (3, 3, 4)
    seen = cache_events([fresh(doubled_while_below, BOUND=b) for b in bounds], (x,))
    assert [events for events, _ in seen] == [MISS, HIT, MISS]
    assert [y.tolist() for _, y in seen] == [[8.0] * 3, [8.0] * 3, [16.0] * 3]


@needs_cpu_compile
def test_compiled_code_leaves_no_precompiled_headers_in_the_temp_folder(marked_functions, tmp_path, monkeypatch):
    """Inductor kept its precompiled headers in the temp folder, outside the compile cache and never pruned (285 MB
    for one model's sampler), and made them again for a compile from a warm cache once that folder was emptied: 12.6-
    15.9 s against 2.4-2.6 s (training/compile_cache.py). Here, with the options a run compiles with, a loop in C++."""
    import torch._inductor.codecache as codecache

    headers = tmp_path / "headers"  # where inductor puts them, for this test
    monkeypatch.setattr(codecache, "_HEADER_DIR", str(headers))
    monkeypatch.setattr(codecache, "_HEADER_LOCK_DIR", str(headers / "locks"))
    monkeypatch.delenv("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", raising=False)
    loop = torch.compile(fresh(doubled_while_below, BOUND=5), fullgraph=True, dynamic=False,
                         options=compile_options(CPU))
    assert loop(torch.ones(3)).tolist() == [32.0] * 3
    assert any(tmp_path.rglob("*.so"))  # built, into the test's cache
    assert not any(headers.rglob("*.gch"))
