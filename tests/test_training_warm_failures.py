"""training.warm's failures (training/warm_failures.py): what tinychar-<key>.failed records keeps later runs from
warming the cache only where it is the whole record of a failure that would recur; and a library in the cache that
cannot be loaded is removed and compiled again by the helper, as by a run, not written down as a failure."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT
from test_training_engine import load_compiled_module

from model import GPTConfig
from training import compile_cache, engine, warm, warm_failures
from training.compiled_step import CompiledStep
from training.config import TrainConfig
from training.devices import subnormals_kept

# What an older tinychar's helper left, and whether a later run takes it for a failure that would recur
RECORDED = "CalledProcessError: Command '['python', 'warm.py', '--compile']' {} (its output: {}.log)\n"
LEFT = {
    "empty": (b"", False),  # its write met the full disk that had failed the compile
    "cut short": (b"CalledProcessError: Command '['python', 'wa", False),
    "garbled": (b"\xff\xfe\x00\x00\x9c\x00\x01", False),
    "not a record": (b"\n\n", False),
    "killed": (RECORDED.format("died with <Signals.SIGKILL: 9>.", "j").encode(), False),  # by the OOM killer, say
    "shut down": (RECORDED.format("died with <Signals.SIGTERM: 15>.", "j").encode(), False),
    "failed": (RECORDED.format("returned non-zero exit status 1.", "j").encode(), True),
    "crashed": (RECORDED.format("died with <Signals.SIGSEGV: 11>.", "j").encode(), True),  # would crash again
    "in the helper": (b"RuntimeError: this process would compile another step (its output: j.log)\n", True),
}


@pytest.mark.parametrize("left", [*LEFT, "a named pipe", "a folder"])
def test_a_failure_file_that_records_no_lasting_failure_keeps_no_run_from_warming(tmp_path, monkeypatch, left):
    """An older tinychar wrote tinychar-<key>.failed for a compile killed from outside, or met a full disk, and then
    often wrote it empty (its write met the same full disk): start() said "an earlier attempt failed" in every later
    run, until the person removed the file."""
    spawned = []
    monkeypatch.setattr(warm.subprocess, "Popen", lambda args, **kw: spawned.append(args) or SimpleNamespace(pid=-1))
    failed = warm.failed_file(tmp_path, "j")
    if left == "a named pipe":  # never waited on
        os.mkfifo(failed)
    elif left == "a folder":
        failed.mkdir()
    else:
        failed.write_bytes(LEFT[left][0])
    lasting = LEFT.get(left, (b"", False))[1]
    why = warm.start(tmp_path, "j", {"threads": 1})
    if lasting:
        assert why == f"an earlier attempt failed (see {failed})" and not spawned
        assert failed.read_bytes() == LEFT[left][0]  # kept, for the person to read
        return
    assert why is None and len(spawned) == 1
    assert failed.is_dir() if left == "a folder" else not os.path.lexists(failed)  # a folder is not removed


# The helper, its run ended, whose compile fails (status 1, a fault of its own), in a process whose files can grow to
# sys.argv[2] bytes at most: as a disk that fills while the helper writes its record
FAILING_HELPER = """import resource, signal, subprocess, sys
sys.path.insert(0, sys.argv[3])
from pathlib import Path
from training import warm
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk (ENOSPC)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
warm.alive, warm.lowest_priority = (lambda pid: False), (lambda: None)
def compile_child(args, **kwargs):
    raise subprocess.CalledProcessError(1, args)
warm.subprocess.run = compile_child
try:
    warm.main(Path(sys.argv[1]), 2**22 + 1)
except BaseException as e:
    print(type(e).__name__, e)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="no file size limit here (not POSIX)")
def test_a_failure_the_helper_records_is_whole_or_not_there(tmp_path, monkeypatch):
    """An older helper whose record met the full disk left it empty or cut short; it is written whole or not at all
    now (training.atomic), so that a run never reads a real failure's record half-written, and a record written whole
    is read back as a failure."""
    job = warm.job_file(tmp_path, "k")
    failed = warm.failed_file(tmp_path, "k")
    for limit, status in ((16, "OSError [Errno 27] File too large"), (1 << 20, "CalledProcessError")):
        job.write_text(json.dumps({"helper": os.getpid()}))
        done = subprocess.run([sys.executable, "-c", FAILING_HELPER, str(job), str(limit), str(ROOT)],
                              capture_output=True, text=True, timeout=60)
        assert done.stdout.startswith(status), done.stdout + done.stderr
        assert not job.exists()
        if limit == 16:  # nothing half-written, nor a temporary file
            assert list(tmp_path.iterdir()) == []
    assert failed.read_text().endswith(f"returned non-zero exit status 1. (its output: {job}.log)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == [failed.name]
    monkeypatch.setattr(warm.subprocess, "Popen", lambda args, **kw: pytest.fail("a helper started"))
    assert warm.start(tmp_path, "k", {"threads": 1}) == f"an earlier attempt failed (see {failed})"


def compile_in_this_process(job: Path):
    """A stand-in for subprocess.run that runs the helper's compiling process (--compile) in this one, its exception
    ending it with status 1 as it would end a process."""
    def run(args, **kwargs):
        try:
            status = warm.compile_main(job, "--remember" in args)
        except Exception:  # noqa: BLE001 - as an exception ends a process
            status = 1
        if status:
            raise subprocess.CalledProcessError(status, args)

    return run


def test_the_helper_removes_a_library_in_the_cache_that_cannot_be_loaded_and_compiles_again(
        tmp_path, monkeypatch, capsys):
    """A library an interrupted compile left in the cache, which inductor loads rather than builds: a run removes it
    and compiles again (training.compile_errors.compile_or_clear), where the helper failed on it ("ImportError: ...
    main.so: file too short") and wrote tinychar-<key>.failed, so that no later run warmed the cache. Staged without
    compiling: the warm-up loads the file while it is there, by the real loader."""
    monkeypatch.setattr(compile_cache, "_USER_CACHE", str(tmp_path / "cache"))
    folder = compile_cache.cache_folder()
    monkeypatch.setattr(compile_cache, "prepare_compile", lambda: folder)
    monkeypatch.setenv("TINYCHAR_KEEP_MEMORY", "0")  # this process's malloc left as it is
    monkeypatch.setenv("TINYCHAR_FLUSH_DENORMALS", "0" if subnormals_kept() else "1")  # as this process has it
    library = folder / "ab" / "main.so"
    library.parent.mkdir(parents=True)
    library.touch()
    tries: list[bool] = []

    def warm_up(self, xs, ys):
        tries.append(library.exists())
        if library.exists():
            load_compiled_module(library)
        return 0.0

    monkeypatch.setattr(CompiledStep, "warm_up", warm_up)
    model, tc = GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=1, n_embd=8), TrainConfig(batch_size=2)
    key = engine.compile_key(model, tc, torch.device("cpu"), torch.float32)
    job = warm.job_file(folder, key)
    job.write_text(json.dumps({"model": asdict(model), "train": asdict(tc), "dtype": "float32",
                               "threads": torch.get_num_threads(), "key": key, "helper": os.getpid()}))
    monkeypatch.setattr(warm, "alive", lambda pid: False)  # the run has ended
    monkeypatch.setattr(warm, "lowest_priority", lambda: None)
    monkeypatch.setattr(warm.subprocess, "run", compile_in_this_process(job))
    monkeypatch.setattr(warm, "time_steps", lambda *args: (2.0, 1.0))
    assert warm.main(job, 2**22 + 1) == 0
    assert tries == [True, False, False] and not library.exists()
    assert not warm.failed_file(folder, key).exists() and not job.exists()
    captured = capsys.readouterr()
    assert (f"compile cache: '{library}' in it could not be loaded (file too short), left over from an interrupted "
            f"compile: it was removed, and is compiled again") in captured.err
    assert captured.out.count("compiled in") == 2


def test_a_compile_that_fails_for_a_passing_cause_every_time_is_tried_three_times_in_a_row_then_once_a_day(
        tmp_path, monkeypatch):
    """A cause that looks as if it passes may not: a file inductor needs that is missing (ENOENT) fails every compile.
    Such a failure wrote nothing, and every later run left a helper that compiled for tens of seconds and failed
    again, for good. They are counted now: a fourth run leaves none until a day after the last, and a helper that
    warms the cache clears the count."""
    spawned = []
    monkeypatch.setattr(warm.subprocess, "Popen", lambda args, **kw: spawned.append(args) or SimpleNamespace(
        pid=-1, poll=lambda: 0))
    monkeypatch.setattr(warm, "alive", lambda pid: False)  # the run has ended
    monkeypatch.setattr(warm, "lowest_priority", lambda: None)
    missing = FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), "/usr/include/python3.11/Python.h")
    outcome = {"error": missing}

    def compile_step(job, remember):
        if outcome["error"] is not None:
            raise RuntimeError("backend='inductor' raised:") from outcome["error"]
        return 1.0, "compiled"

    job = warm.job_file(tmp_path, "k")
    monkeypatch.setattr(warm, "compile_step", compile_step)
    monkeypatch.setattr(warm.subprocess, "run", compile_in_this_process(job))
    counted = tmp_path / "tinychar-k.temporary"

    def a_run() -> str | None:  # an eager run ends, and its helper (if it left one) compiles
        why = warm.start(tmp_path, "k", {"threads": 1})
        if why is None:
            job.write_text(json.dumps({"helper": os.getpid()}))
            if outcome["error"] is None:
                assert warm.main(job, 2**22 + 1) == 0
            else:
                with pytest.raises(subprocess.CalledProcessError):
                    warm.main(job, 2**22 + 1)
        return why

    def failures() -> int:
        return json.loads(counted.read_text())["failures"] if counted.exists() else 0

    assert a_run() is None and a_run() is None and failures() == 2
    outcome["error"] = None  # the file is back: the cache warms, and the failures before no longer count
    assert a_run() is None and not counted.exists()
    outcome["error"] = missing
    assert [a_run() for _ in range(3)] == [None] * 3 and len(spawned) == 6 and failures() == 3
    record = json.loads(counted.read_text())
    assert record["cause"].endswith(f"exit status 75. (its output: {job}.log)")
    assert a_run() == f"an earlier attempt failed (see {counted})" and len(spawned) == 6
    assert not warm.failed_file(tmp_path, "k").exists()
    # A day after the last, one more may try (a disk full three times in a row is not full for good), then a day more
    record["last"] -= warm_failures.TEMPORARY_PAUSE + 1
    counted.write_text(json.dumps(record))
    assert a_run() is None and len(spawned) == 7 and failures() == 4
    assert a_run() == f"an earlier attempt failed (see {counted})" and len(spawned) == 7
    # a time to come (a clock set back), or none a float holds, keeps no run from trying
    for last in (time.time() + 3600, 10**400):
        counted.write_text(json.dumps({**record, "last": last}))
        assert warm_failures.earlier_failure(tmp_path, "k") is None


def test_a_failure_record_this_user_may_not_read_is_kept_and_keeps_the_run_from_warming(tmp_path, monkeypatch):
    """In a cache folder users share, a record another user wrote that this one may not read was removed as if it were
    garbled, by a user who could not know what it held, and the cache warmed again. It is kept now, and taken for the
    failure it most likely records. Another user's file is emulated (the tests may run as root, who reads anything):
    the kernel's refusal to open it."""
    real_open = os.open
    failed = warm.failed_file(tmp_path, "j")
    failed.write_bytes(LEFT["failed"][0])

    def kernel_open(path, flags, mode=0o777, **kw):
        if os.fspath(path) == os.fspath(failed):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", kernel_open)
    monkeypatch.setattr(warm.subprocess, "Popen", lambda args, **kw: pytest.fail("a helper started"))
    assert warm.start(tmp_path, "j", {"threads": 1}) == f"an earlier attempt failed (see {failed})"
    assert failed.read_bytes() == LEFT["failed"][0]
