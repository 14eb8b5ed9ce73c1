"""training.warm: a run that `auto` trains eagerly because the compile cache is cold leaves a helper that compiles the
step into the cache once the run has ended, so that the next run of the model compiles in seconds."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, SMALL_TEXT, needs_cpu_compile, tiny_overrides
from test_training_engine import ENGINE_KEYS
from training_runs import call, train_main, write_corpus

from data import CharTokenizer
from model import GPT, GPTConfig
from training import compile_cache, engine, load_config, step_file, warm
from training.engine import WARM_HELPER_MIN_STEPS, WARM_MIN_STEPS, EngineChoice, choose_engine, start_engine
from training.errors import UsageError
from training.launch import Launch
from training.optim import make_optimizer

CPU = torch.device("cpu")
# the steps from which auto compiles this model from a warm cache (where the step was never timed here): WARM_MIN_STEPS
# for each micro-batch a step unrolls; and the fewest from which an eager run leaves a helper to warm the cache
WARM_STEPS = WARM_MIN_STEPS * ENGINE_KEYS["train.grad_accum_steps"]
HELPER_STEPS = WARM_HELPER_MIN_STEPS * ENGINE_KEYS["train.grad_accum_steps"]


def trainer_for(tmp_path: Path, max_iters: int, **keys: object) -> SimpleNamespace:
    """What choose_engine and start_engine read of a Trainer, for the tests' small model (keys: more overrides)."""
    cfg = load_config(None, tiny_overrides(write_corpus(tmp_path), tmp_path / "out", **{
        **ENGINE_KEYS, "train.compile": "auto", "train.max_iters": max_iters, **keys}))
    model = GPT(replace(cfg.model, vocab_size=CharTokenizer.from_text(SMALL_TEXT).vocab_size))
    return SimpleNamespace(cfg=cfg, tc=cfg.train, model=model, dtype=torch.float32, step=0, scaler=None,
                           optimizer=make_optimizer(model, cfg.train, CPU), launch=Launch(),
                           flops_per_token=model.flops_per_token(),
                           tokens_per_step=cfg.train.batch_size * cfg.model.block_size * cfg.train.grad_accum_steps)


def test_an_eager_run_leaves_a_helper_only_where_a_warm_cache_could_compile(a_compiler, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("TINYCHAR_WARM_CACHE", "1")
    trainer = trainer_for(tmp_path, HELPER_STEPS)
    key = engine.compile_key(trainer.model.config, trainer.tc, CPU, torch.float32)
    choice = choose_engine(trainer, None, CPU)
    assert (choice.kind, choice.warm_key) == ("eager", key) and "cold cache" in choice.reason
    # a step bound by its multiplies (OVERHEAD_BOUND_FLOPS) leaves one too: what the helper times decides later
    with monkeypatch.context() as m:
        m.setattr(engine, "OVERHEAD_BOUND_FLOPS", 1.0)
        bound = choose_engine(trainer, None, CPU)
    assert (bound.kind, bound.warm_key) == ("eager", key) and "matrix multiplies" in bound.reason

    started = []
    monkeypatch.setattr(warm, "start", lambda *args: started.append(args) or None)
    said: list[str] = []
    start_engine(trainer, choice, said.append)
    assert said[0].startswith("engine: eager (auto:") and "helper compiles its step" in said[1]
    folder, started_key, spec = started[0]
    assert (folder, started_key) == (compile_cache.compile_cache_dir(), key)
    assert spec == {"model": asdict(trainer.model.config), "train": asdict(trainer.tc), "dtype": "float32",
                    "threads": torch.get_num_threads()}

    assert choose_engine(trainer_for(tmp_path, HELPER_STEPS - 1), None, CPU).warm_key is None  # too short anyway
    assert choose_engine(trainer, None, torch.device("cuda")).warm_key is None  # CPUs only
    monkeypatch.setenv("TINYCHAR_WARM_CACHE", "0")
    # (a run this long takes tinychar's kernels in its eager step: training/eager_kernels.py)
    assert choose_engine(trainer, None, CPU) == EngineChoice("eager", choice.reason, kernels=True)
    monkeypatch.setenv("TINYCHAR_WARM_CACHE", "yes")
    for compile in ("auto", "false"):  # said whatever the run would do
        with pytest.raises(UsageError, match="TINYCHAR_WARM_CACHE must be 1 or 0, got 'yes'"):
            choose_engine(SimpleNamespace(**{**vars(trainer), "tc": replace(trainer.tc, compile=compile)}), None, CPU)
    monkeypatch.setenv("TINYCHAR_WARM_CACHE", "1")
    compile_cache.compile_cache_dir().mkdir(parents=True, exist_ok=True)
    compile_cache.remember_compile(key, 3.0)  # warm, but the step never timed here: the counts decide
    choice = choose_engine(trainer, None, CPU)
    assert (choice.kind, choice.warm_key) == ("eager", None) and "too few" in choice.reason
    assert choose_engine(trainer_for(tmp_path, WARM_STEPS), None, CPU).kind == "step"
    # timed by the helper: what compiling saves here decides, and nothing is left to warm
    compile_cache.remember_step_times(key, 10.0, 5.0)  # HELPER_STEPS x 5 ms: 10 s, over 1.5 x the 3 s
    choice = choose_engine(trainer, None, CPU)
    assert (choice.kind, choice.warm_key) == ("step", None) and "measured here" in choice.reason
    # after a compile from an empty cache a repeated run loads the step saved whole, on a CPU in a tenth of its time:
    # 2,000 steps x 5 ms win back 10 s, over 1.5 x 40 s x 0.1, under 1.5 x 40 s x WARM_SHARE (0.25)
    compile_cache.remember_compile(key, 40.0, cold=True)
    choice = choose_engine(trainer_for(tmp_path, 2_000), None, CPU)
    assert choice.kind == ("step" if step_file.used_on(CPU) else "eager"), choice.reason
    assert f"{40.0 * step_file.warm_share(CPU):.1f} s of a compile" in choice.reason
    assert choose_engine(trainer_for(tmp_path, 3_000), None, CPU).kind == "step"
    compile_cache.remember_compile(key, 3.0)
    compile_cache.remember_step_times(key, 10.0, 10.2)  # slower compiled: eager, however many steps
    choice = choose_engine(trainer_for(tmp_path, 10 * WARM_STEPS), None, CPU)
    assert (choice.kind, choice.warm_key) == ("eager", None) and "less than" in choice.reason


def test_more_micro_batches_than_the_compiled_step_unrolls_compile_the_blocks(a_compiler, tmp_path):
    # compiling the whole step grows with its micro-batches (171 s for 8 in one measurement): above MAX_STEP_ACCUM
    # a compiled run compiles the model block by block, whose cost does not grow with them
    trainer = trainer_for(tmp_path, 10**9)
    for accum, kind in ((engine.MAX_STEP_ACCUM, "step"), (engine.MAX_STEP_ACCUM + 1, "blocks")):
        tc = replace(trainer.tc, grad_accum_steps=accum, compile="true")
        choice = choose_engine(SimpleNamespace(**{**vars(trainer), "tc": tc}), None, CPU)
        assert choice.kind == kind
        assert ("more than the compiled step unrolls (8)" in choice.reason) is (kind == "blocks")


def test_one_helper_per_step_and_none_after_one_failed(tmp_path, monkeypatch):
    # a helper on the job, started before Popen is replaced (it is subprocess's own, patched for every module)
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(warm.job_file(tmp_path, "k"))])
    spawned = []  # what would have been started (nothing is)
    monkeypatch.setattr(warm.subprocess, "Popen", lambda args, **kw: spawned.append(args) or SimpleNamespace(pid=-1))
    spec = {"threads": 1}
    assert warm.start(tmp_path, "k", spec) is None
    job = warm.job_file(tmp_path, "k")
    assert json.loads(job.read_text()) == {"threads": 1, "key": "k", "helper": -1}
    assert spawned[0][1:] == [str(Path(warm.__file__).resolve()), str(job), str(os.getpid()), warm.started(os.getpid())]

    try:
        job.write_text(json.dumps({"helper": helper.pid}))  # a live helper is on it
        assert warm.start(tmp_path, "k", spec) == "another process is warming it"
    finally:
        helper.kill()
        helper.wait()
    job.write_text(json.dumps({"helper": 2**22 + 1}))  # above Linux's largest pid: a helper that was killed
    assert warm.start(tmp_path, "k", spec) is None and len(spawned) == 2
    # A helper's pid that another process has since taken (after a reboot, or a kill): warming stopped for good,
    # "another process is warming it" in every later run
    job.write_text(json.dumps({"helper": os.getpid()}))
    assert warm.start(tmp_path, "k", spec) is None and len(spawned) == 3
    for damaged in ("[]", "null", "7"):  # JSON, but no record: an AttributeError traceback ended train.py
        job.write_text(damaged)
        assert warm.start(tmp_path, "k", spec) == "another process is warming it"  # fresh: another start() mid-way
        os.utime(job, (time.time() - 3600, time.time() - 3600))  # stale: left by a helper long gone
        assert warm.start(tmp_path, "k", spec) is None
    assert len(spawned) == 6

    warm.failed_file(tmp_path, "j").write_text("RuntimeError: no\n")
    assert "an earlier attempt failed" in warm.start(tmp_path, "j", spec)
    assert len(spawned) == 6


def test_two_runs_that_find_one_dead_helpers_job_at_once_start_one_helper(tmp_path, monkeypatch):
    """Two runs of one model ending together both found the job of a helper that was killed, each removed it and made
    its own, and both started a helper: two compiles of one step. Here the second run's start() comes just as the
    first one has found the helper gone (inside its look at the helper), as it would from another process."""
    spawned = []
    monkeypatch.setattr(warm.subprocess, "Popen", lambda args, **kw: spawned.append(args) or SimpleNamespace(
        pid=-1, poll=lambda: 0))
    job = warm.job_file(tmp_path, "k")
    job.write_text(json.dumps({"helper": 2**22 + 1}))  # above Linux's largest pid: a helper that was killed
    looked, answers = warm.warming, []

    def warming(pid, path):
        if not answers:  # the first run's look: the other run's start() comes now (and looks for itself)
            answers.append(None)
            answers[0] = warm.start(tmp_path, "k", {"threads": 2})
        return looked(pid, path)

    monkeypatch.setattr(warm, "warming", warming)
    assert warm.start(tmp_path, "k", {"threads": 1}) is None
    assert answers == ["another process is warming it"] and len(spawned) == 1
    assert json.loads(job.read_text())["threads"] == 1
    # the lock is the kernel's, dropped with its holder: the next run finds the job as the first left it
    monkeypatch.setattr(warm, "warming", lambda pid, path: True)
    assert warm.start(tmp_path, "k", {"threads": 2}) == "another process is warming it"
    monkeypatch.setattr(warm, "warming", lambda pid, path: False)
    assert warm.start(tmp_path, "k", {"threads": 2}) is None and len(spawned) == 2


@pytest.mark.parametrize("flock", ["missing", "refused", "nfs"])
def test_where_there_are_no_file_locks_a_run_still_leaves_a_helper(tmp_path, monkeypatch, flock):
    """No fcntl (another platform), or a file system whose flock says ENOLCK, or NFS's EBADF for a lock file another
    user made that this one opened for reading only: start() goes on without the lock, as it did before it had one,
    rather than saying it cannot write to the folder."""
    from training import atomic

    def refused(fd, operation):
        code = errno.EBADF if flock == "nfs" else errno.ENOLCK
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(atomic, "fcntl", None if flock == "missing" else SimpleNamespace(
        flock=refused, LOCK_EX=2, LOCK_NB=4))
    spawned = []
    monkeypatch.setattr(warm.subprocess, "Popen", lambda args, **kw: spawned.append(args) or SimpleNamespace(
        pid=-1, poll=lambda: 0))
    assert warm.start(tmp_path, "k", {"threads": 1}) is None and len(spawned) == 1
    assert warm.start(tmp_path, "k", {"threads": 1}) == "another process is warming it"  # the job's look still
    monkeypatch.setattr(compile_cache, "cache_folder", lambda say=False: tmp_path)
    compile_cache.remember_compile("k", 3.0)
    assert compile_cache.cached_compile_seconds("k") == 3.0

def test_a_lock_file_another_user_made_in_a_shared_cache_folder_keeps_no_run_from_leaving_a_helper(tmp_path,
                                                                                                   monkeypatch):
    """In a cache folder users share, the first to start a helper makes tinychar-<key>.warming.lock, which stays: made
    owner-writable only, and opened for writing, it was refused to every other user (Permission denied), whose runs
    then said they could not write to the folder and never warmed the cache. flock needs no write access: the file is
    opened for reading, and made writable as the umask allows, as the markers are. Another user's file is emulated
    (the tests may run as root, whom the kernel lets write anything): opening a file without its write bit for writing
    is refused here as the kernel refuses it to them."""
    from training import atomic

    real_open = os.open

    def kernel_open(path, flags, mode=0o777, **kw):
        if flags & (os.O_WRONLY | os.O_RDWR) and os.path.exists(path) and not os.stat(path).st_mode & 0o200:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(atomic.os, "open", kernel_open)
    spawned = []
    monkeypatch.setattr(warm.subprocess, "Popen", lambda args, **kw: spawned.append(args) or SimpleNamespace(
        pid=-1, poll=lambda: 0))
    lock = Path(f"{warm.job_file(tmp_path, 'k')}.lock")
    lock.touch()
    lock.chmod(0o444)  # another user's, as this user sees it
    assert warm.start(tmp_path, "k", {"threads": 1}) is None and len(spawned) == 1
    # and one this user makes is as writable as its umask allows, as the markers are (a group's shared folder)
    lock.unlink()
    previous = os.umask(0o002)
    try:
        with atomic.locked(lock) as held:
            assert held
    finally:
        os.umask(previous)
    assert lock.stat().st_mode & 0o777 == 0o664


def at_once(call, *args):
    """call(*args), which must return within seconds (a named pipe opened for reading waits for a writer forever)."""
    import threading

    result = []
    worker = threading.Thread(target=lambda: result.append(call(*args)), daemon=True)
    worker.start()
    worker.join(20)
    assert result, f"{call.__name__} still waiting"
    return result[0]


def test_odd_things_in_place_of_the_helpers_files_neither_hang_nor_stop_the_run_nor_are_written_through(
        tmp_path, monkeypatch):
    """A named pipe as the job file hung the run at its end; a folder there stopped it before its first step
    ("cannot use ... (Is a directory); give another path"); a link as the helper's log had it write into the file the
    link names."""
    monkeypatch.setattr(warm.subprocess, "Popen", lambda args, **kw: SimpleNamespace(pid=-1))  # nothing is started
    old = time.time() - 3600
    job = warm.job_file(tmp_path, "k")
    os.mkfifo(job)
    os.utime(job, (old, old))
    assert at_once(warm.start, tmp_path, "k", {"threads": 1}) is None  # taken for a dead helper's, replaced
    assert json.loads(job.read_text())["key"] == "k"
    job.unlink()
    job.mkdir()
    os.utime(job, (old, old))
    assert warm.start(tmp_path, "k", {"threads": 1}) == f"cannot write to {tmp_path} (Is a directory)"
    job.rmdir()
    precious = tmp_path / "precious.txt"
    precious.write_text("not the helper's")
    Path(f"{job}.log").unlink()  # the first start's
    Path(f"{job}.log").symlink_to(precious)
    assert warm.start(tmp_path, "k", {"threads": 1}) is None
    assert precious.read_text() == "not the helper's" and not Path(f"{job}.log").is_symlink()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_helpers_compile_ends_when_the_helper_is_killed(tmp_path):
    """A helper killed with SIGKILL (the OOM killer, kill -9) left its compile running, an orphan, beside the next
    run's helper compiling the same step. A stand-in helper here starts its "compile" (a long sleep) as the real one
    does, then is killed."""
    pid_file = tmp_path / "child.pid"
    helper = subprocess.Popen([sys.executable, "-c", (
        f"import os, subprocess, sys; sys.path.insert(0, {str(ROOT)!r})\n"
        "from training import warm\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
        "preexec_fn=warm.ends_with(os.getpid()))\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "child.wait()\n")])
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert warm.alive(child)
    helper.kill()
    helper.wait()
    deadline = time.monotonic() + 20
    while warm.alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not warm.alive(child)


def test_a_damaged_marker_is_no_measurement_and_is_never_written_through(tmp_path, monkeypatch):
    """A named pipe as the marker hung train.py and a plain sample.py; a link as the marker had the compile's time
    written into the file it names; nan ms, -5 s or "cold": "false" were taken at their word, and auto compiled."""
    monkeypatch.setattr(compile_cache, "cache_folder", lambda say=False: tmp_path)
    marker = compile_cache._marker("k")
    os.mkfifo(marker)
    assert at_once(compile_cache.cached_compile_seconds, "k") is None
    assert at_once(compile_cache.measured_saving, "k") is None
    marker.unlink()
    precious = tmp_path / "precious.txt"
    precious.write_text("not a marker")
    marker.symlink_to(precious)
    compile_cache.remember_compile("k", 8.5, cold=True)
    assert precious.read_text() == "not a marker" and not marker.is_symlink()
    assert compile_cache.cached_compile_seconds("k") == 8.5
    good = {"seconds": 4.0, "cold": False, "eager_ms": 10.0, "compiled_ms": 5.0}
    marker.write_text(json.dumps(good))
    assert compile_cache.measured_saving("k") == (10.0, 5.0, 4.0)
    for damage in ({"seconds": -5}, {"seconds": float("nan")}, {"seconds": True}, {"seconds": "4"},
                   {"eager_ms": float("nan")}, {"compiled_ms": -1.0}, {"eager_ms": float("inf")}):
        marker.write_text(json.dumps({**good, **damage}))
        assert compile_cache.measured_saving("k") is None, damage
    marker.write_text(json.dumps({**good, "cold": "false"}))  # not true: the time of a warm compile, as it says
    assert compile_cache.measured_saving("k") == (10.0, 5.0, 4.0)


def test_a_run_started_just_after_another_finds_its_helper_warming(tmp_path, monkeypatch):
    """start(), twice in a row, as when two runs of one model end together. The kernel shows a process's command
    line a moment after Popen returns (empty in 12% of reads made at once on an idle 2-core EPYC, most of them on a
    busy one); the first start() wrote its helper's pid before that, and the second, seeing no helper of this job at
    that pid, took the job for abandoned and started another (once in CI, 2 of 100 pairs here). The moment is
    stretched here to half a second: the helper's process runs another command line first, then execs into its
    own."""
    run = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # the run the helpers wait for
    popen = subprocess.Popen

    def late(args, **kwargs):  # the helper, shown under its own command line only after half a second
        env = {**kwargs.pop("env", os.environ), "HELPER_ARGS": json.dumps(args)}
        return popen([sys.executable, "-c", "import json, os, sys, time; time.sleep(0.5); "
                      "os.execv(sys.executable, json.loads(os.environ['HELPER_ARGS']))"], env=env, **kwargs)

    monkeypatch.setattr(warm.subprocess, "Popen", late)
    helpers = []
    try:
        for key in ("a", "b"):
            assert warm.start(tmp_path, key, {"threads": 1}, parent=run.pid) is None
            helpers.append(json.loads(warm.job_file(tmp_path, key).read_text())["helper"])
            assert warm.start(tmp_path, key, {"threads": 1}) == "another process is warming it"
            assert json.loads(warm.job_file(tmp_path, key).read_text())["helper"] == helpers[-1]
    finally:
        for pid in helpers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        run.kill()
        run.wait()


def test_a_helper_stops_waiting_once_its_runs_pid_is_another_processs(tmp_path, monkeypatch):
    """The run ends and its pid goes to another process: reproduced in a pid namespace of its own, a sleep given the
    run's pid kept the helper waiting as long as the sleep lasted (a daemon's pid: for good), its job file keeping
    every later run from warming the cache. The helper goes by the pid's start time as well."""
    run = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    spawned = []
    monkeypatch.setattr(warm.subprocess, "Popen", lambda args, **kw: spawned.append(args) or SimpleNamespace(
        pid=-1, poll=lambda: 0))
    try:
        assert warm.start(tmp_path, "k", {"threads": 1}, parent=run.pid) is None
        job, parent, *born = spawned[0][2:]
        assert int(parent) == run.pid
        # the pid now another process's: the same pid, started later
        monkeypatch.setattr(warm, "started", lambda pid: f"1{born}", raising=False)
        compiles = []
        monkeypatch.setattr(warm.subprocess, "run", lambda args, **kw: compiles.append(args))
        monkeypatch.setattr(warm, "lowest_priority", lambda: None)
        monkeypatch.setattr(warm.time, "sleep", lambda s: pytest.fail("the helper waits on another process"))
        assert warm.main(Path(job), int(parent), *born) == 0
        assert len(compiles) == 2 and not Path(job).exists()
    finally:
        run.kill()
        run.wait()


@pytest.mark.parametrize("status", [1, -signal.SIGSEGV, -signal.SIGABRT, -signal.SIGTERM, -signal.SIGKILL, 75],
                         ids=["failed", "SIGSEGV", "SIGABRT", "SIGTERM", "SIGKILL", "passing"])
def test_only_a_compile_that_failed_and_not_one_that_was_killed_stops_later_runs_warming(tmp_path, monkeypatch,
                                                                                       status):
    """A compile the OOM killer or a shutdown ended was written down as failed, and no later run warmed the cache;
    so was one that failed for a cause that passes (a full disk), which its process says with status 75."""
    job = warm.job_file(tmp_path, "k")
    job.write_text(json.dumps({"helper": os.getpid()}))
    monkeypatch.setattr(warm, "alive", lambda pid: False)  # the run has ended
    monkeypatch.setattr(warm, "lowest_priority", lambda: None)

    def compile_child(args, **kwargs):
        raise subprocess.CalledProcessError(status, args)

    monkeypatch.setattr(warm.subprocess, "run", compile_child)
    with pytest.raises(subprocess.CalledProcessError):
        warm.main(job, 2**22 + 1)
    assert not job.exists()
    # a compile that crashed (SIGSEGV, SIGABRT) would crash again: a failure, unlike one killed from outside
    assert warm.failed_file(tmp_path, "k").exists() == (status not in (-signal.SIGTERM, -signal.SIGKILL, 75))


def raised(error: BaseException, cause: BaseException | None = None, handling: BaseException | None = None):
    """error as a compile raises it: from cause, or while handling another error."""
    try:
        try:
            if handling is not None:
                raise handling
        except BaseException:
            raise error from cause
        raise error from cause
    except BaseException as e:
        return e


FULL = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("error, passing", [
    (raised(FULL), True),
    (raised(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))), True),
    (raised(OSError(errno.EROFS, os.strerror(errno.EROFS))), True),
    (raised(MemoryError()), True),
    (raised(RuntimeError("backend='inductor' raised:"), FULL), True),  # dynamo's error, from the disk's
    (raised(RuntimeError("C++ compile error\n/usr/bin/ld: final link failed: No space left on device")), True),
    (raised(RuntimeError("C++ compile error\ng++: fatal error: Killed signal terminated program cc1plus")), True),
    (raised(RuntimeError("C++ compile error\nc.cpp:3:5: error: 'x' was not declared in this scope")), False),
    (raised(ZeroDivisionError("division by zero")), False),
    (raised(OSError(errno.EISDIR, os.strerror(errno.EISDIR))), False),
    # raised while handling a cache miss: the miss is no sign of its cause
    (raised(RuntimeError("C++ compile error"), handling=FileNotFoundError(errno.ENOENT, "no such entry")), False),
], ids=["ENOSPC", "EDQUOT", "EROFS", "MemoryError", "wrapped", "linker", "cc1plus-killed", "C++", "bug", "EISDIR",
        "while-handling"])
def test_a_compile_that_failed_for_a_cause_that_passes_leaves_it_to_a_later_run(tmp_path, monkeypatch, capsys,
                                                                                 error, passing):
    """A full disk, a cache folder made read-only or no memory wrote tinychar-<key>.failed, as a C++ error does, and
    no later run warmed that cache again. The compile's process tells the helper by its exit status."""
    def compile_step(job, remember):
        raise error

    monkeypatch.setattr(warm, "compile_step", compile_step)
    job = warm.job_file(tmp_path, "k")
    if passing:
        assert warm.compile_main(job, False) == 75
        assert "not a fault of the compile" in capsys.readouterr().out
    else:
        with pytest.raises(type(error)):
            warm.compile_main(job, False)

    def run(args, **kwargs):  # the compile's process, in this one
        try:
            status = warm.compile_main(job, False)
        except Exception:  # noqa: BLE001 - as an exception ends a process
            status = 1
        if status:
            raise subprocess.CalledProcessError(status, args)

    job.write_text(json.dumps({"helper": os.getpid()}))
    monkeypatch.setattr(warm, "alive", lambda pid: False)  # the run has ended
    monkeypatch.setattr(warm, "lowest_priority", lambda: None)
    monkeypatch.setattr(warm.subprocess, "run", run)
    with pytest.raises(subprocess.CalledProcessError):
        warm.main(job, 2**22 + 1)
    assert warm.failed_file(tmp_path, "k").exists() is not passing
    assert not job.exists()


@pytest.mark.parametrize("error", [BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN)), MemoryError()])
def test_a_helper_that_cannot_start_its_compile_for_now_leaves_it_to_a_later_run(tmp_path, monkeypatch, error):
    """No process or memory to spare for the compile's process (fork's EAGAIN): no failure of the compile's."""
    job = warm.job_file(tmp_path, "k")
    job.write_text(json.dumps({"helper": os.getpid()}))
    monkeypatch.setattr(warm, "alive", lambda pid: False)
    monkeypatch.setattr(warm, "lowest_priority", lambda: None)

    def run(args, **kwargs):
        raise error

    monkeypatch.setattr(warm.subprocess, "run", run)
    with pytest.raises(type(error)):
        warm.main(job, 2**22 + 1)
    assert not warm.failed_file(tmp_path, "k").exists() and not job.exists()


def test_the_compiles_process_says_a_vanished_cache_folder_by_its_exit_status(tmp_path):
    """The real process: its cache folder removed while the helper waited for the run to end."""
    job = warm.job_file(tmp_path / "gone", "k")
    done = subprocess.run([sys.executable, str(Path(warm.__file__)), "--compile", str(job)], capture_output=True,
                          text=True, check=False, cwd=ROOT)
    assert done.returncode == 75, done.stderr
    assert done.stdout.strip().splitlines()[-1] == ("not a fault of the compile (No such file or directory): a later "
                                                     "run tries again")


@needs_cpu_compile
@pytest.mark.slow
def test_the_helper_compiles_the_step_into_the_cache_once_the_run_has_ended(tmp_path, capsys):
    """The real helper, from a cold cache. Its worker's cache holds the engine tests' step only where chance ran their
    file in the same worker first (this test took 35 s then, 76-81 s otherwise), so it compiles the cheapest step
    instead, one micro-batch with AdamW: 23 s cold against 43 s for their two micro-batches with Muon (2-core Xeon,
    2026-12-02)."""
    trainer = trainer_for(tmp_path, WARM_STEPS, **{"train.grad_accum_steps": 1, "train.optimizer": "adamw"})
    key = engine.compile_key(trainer.model.config, trainer.tc, CPU, torch.float32)
    folder = compile_cache.compile_cache_dir()
    compile_cache._marker(key).unlink(missing_ok=True)
    spec = {"model": asdict(trainer.model.config), "train": asdict(trainer.tc), "dtype": "float32",
            "threads": torch.get_num_threads()}
    run = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])  # the run that leaves it
    try:
        assert warm.start(folder, key, spec, parent=run.pid) is None
        assert warm.start(folder, key, spec) == "another process is warming it"
        time.sleep(1.5)
        # still waiting
        assert warm.job_file(folder, key).exists() and compile_cache.cached_compile_seconds(key) is None
    finally:
        run.wait()
    deadline = time.monotonic() + 240
    while warm.job_file(folder, key).exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    log = Path(f"{warm.job_file(folder, key)}.log").read_text(encoding="utf-8")
    assert log.count("compiled in") == 2, log  # into the cold cache, then from it
    # the step saved whole (training/step_file.py) by the first, loaded by the second as by the next run
    assert re.findall(r"compiled in [0-9.]+ s \((\w+)\)", log) == ["compiled", "loaded"], log
    assert not warm.job_file(folder, key).exists() and not warm.failed_file(folder, key).exists()
    eager_ms, compiled_ms, seconds = compile_cache.measured_saving(key)  # and timed the step both ways, from it
    assert eager_ms > 0 and compiled_ms > 0 and seconds == compile_cache.cached_compile_seconds(key)
    said = re.search(r"a step: ([0-9.]+) ms eager, ([0-9.]+) ms compiled", log)
    assert said is not None, log
    assert [float(said[1]), float(said[2])] == pytest.approx([eager_ms, compiled_ms], abs=0.01)
    # and the next run of the model, train.py's, loads the step the helper saved
    overrides = tiny_overrides(write_corpus(tmp_path), tmp_path / "next", **{
        **ENGINE_KEYS, "train.grad_accum_steps": 1, "train.optimizer": "adamw", "train.compile": "true",
        "train.max_iters": 2})
    code, out, err = call(train_main, overrides, capsys)
    assert code == 0, err
    assert re.search(r"engine: compiled in [0-9.]+ s \(the step saved whole, loaded from compile cache: ", out), out


def test_the_helper_times_real_eager_steps_beside_the_compiled_one_and_keeps_slow_steps_few(monkeypatch):
    """time_steps, with a stand-in for the compiled step (the real one is timed in the test above): the eager side
    trains the model it is given, as the trainer's eager path does; the rounds take the fastest of each."""
    from training.config import TrainConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16))
    before = [p.detach().clone() for p in model.parameters()]
    tc = TrainConfig(batch_size=4, grad_accum_steps=2, optimizer="muon")
    xs = torch.randint(0, 11, (2, 4, 8))
    calls: list[float] = []

    def compiled(xs_: torch.Tensor, ys_: torch.Tensor, lr: float) -> None:
        calls.append(lr)
        time.sleep(0.02)

    eager_ms, compiled_ms = warm.time_steps(compiled, model, tc, torch.float32, xs, xs.roll(1, -1))
    assert compiled_ms >= 20 and 0 < eager_ms < 1000
    assert len(calls) == 1 + warm.TIMING_ROUNDS * warm.TIMING_STEPS  # one first step, then the rounds
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # trained

    # a step slower than a round may take: one step a round, and two rounds once the time is up
    monkeypatch.setattr(warm, "TIMING_ROUND_SECONDS", 0.1)
    monkeypatch.setattr(warm, "TIMING_SECONDS", 0.1)
    calls.clear()
    slow = lambda *args: calls.append(0.0) or time.sleep(0.2)  # noqa: E731
    warm.time_steps(slow, model, tc, torch.float32, xs, xs.roll(1, -1))
    assert len(calls) == 1 + 2


def test_a_helper_ended_by_sigterm_stops_its_compile_and_removes_its_job(tmp_path):
    # killed, it left its job file, and a compile it had started went on alone; here, the compile is a long sleep
    script = tmp_path / "warm_probe.py"
    script.write_text(
        "import subprocess, sys, time\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from training import warm\n"
        "real = subprocess.run\n"
        "child = 'import sys, time; open(sys.argv[1], \"w\").close(); time.sleep(600)'\n"
        "def compile_forever(args, **kw):  # the compile's process: says it has begun, then takes its time\n"
        "    return real([sys.executable, '-c', child, sys.argv[2]], **kw)\n"
        "warm.subprocess.run = compile_forever\n"
        "sys.exit(warm.main(warm.Path(sys.argv[1]), 2**22 + 1))\n", encoding="utf-8")
    job, started = warm.job_file(tmp_path, "k"), tmp_path / "compiling"
    job.write_text("{}", encoding="utf-8")
    helper = subprocess.Popen([sys.executable, str(script), str(job), str(started)])
    compiling: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not started.exists():  # the helper's compile has begun
            assert helper.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        compiling += [int(p) for p in subprocess.run(["pgrep", "-P", str(helper.pid)], capture_output=True,
                                                     text=True, check=False).stdout.split()]
        assert len(compiling) == 1
        helper.terminate()
        assert helper.wait(timeout=30) == 128 + 15
        time.sleep(0.2)
        assert not os.path.exists(f"/proc/{compiling[0]}") or "Z" in Path(f"/proc/{compiling[0]}/stat").read_text()
        assert not job.exists() and not warm.failed_file(tmp_path, "k").exists()
    finally:  # nothing left behind, whatever failed
        helper.kill()
        for pid in compiling:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_bad_setting_stops_train_py_in_one_line_before_out_dir_is_touched(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TINYCHAR_WARM_CACHE", "later")
    out = tmp_path / "out"
    code, _, err = call(train_main, tiny_overrides(write_corpus(tmp_path), out), capsys)
    assert code == 2
    assert err.strip().splitlines() == ["error: TINYCHAR_WARM_CACHE must be 1 or 0, got 'later'"]
    assert not out.exists()


def test_the_helper_takes_the_lowest_priority_for_its_whole_scheduling_group(tmp_path):
    """Under autogroup scheduling nice counts only within a session, and the helper has one of its own: its group's
    nice must be 19 too, or it takes half the CPU from a run started after it (measured: 7x slower)."""
    probe = ("import os, sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); from training import warm; "
             "warm.lowest_priority(); group = Path('/proc/self/autogroup'); "
             "print(os.nice(0), group.read_text().split()[-1] if group.exists() else '-')")
    # in a session of its own, as the helper is started, so that the group it lowers is its own
    out = subprocess.run([sys.executable, "-c", probe, str(ROOT)], capture_output=True, text=True, check=True,
                         start_new_session=True).stdout.split()
    assert out[0] == "19"
    if Path("/proc/self/autogroup").exists():
        assert out[1] == "19"


def test_the_helper_asks_again_when_the_kernel_says_try_later(monkeypatch):
    """A user may change an autogroup's nice once per 100 ms system-wide (EAGAIN otherwise): the helper asks again."""
    answers, written = [BlockingIOError(11, "try again"), None], []

    class Group:  # the text file open() gives: the kernel's answer comes when the write is flushed, on closing
        def __enter__(self):
            return self

        def write(self, text):
            self.text = text

        def __exit__(self, *exc):
            answer = answers.pop(0)
            if answer is not None:
                raise answer
            written.append(self.text)
            return False

    monkeypatch.setattr(os, "nice", lambda increment: 19)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    monkeypatch.setattr("builtins.open", lambda path, *args, **kwargs: Group())
    warm.lowest_priority()
    assert written == ["19"] and answers == []
