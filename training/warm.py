"""Warming the compile cache in the background, so that a repeated run of a model compiles in seconds.

``train.compile: auto`` trains a run of a few thousand steps eagerly while the compile cache is cold: compiling would
cost more (15-60 s on a 2-core CPU) than the run wins back. From a warm cache it costs 1.5-9 s, and auto may compile
then (engine.MEASURED_MARGIN). Left alone, though, the cache never warms: every later run of the same model is eager
too. So such a run starts a helper process, which sleeps until the run has ended, then compiles the run's step into the
cache at the lowest priority (nice 19, for its scheduling group too: see lowest_priority), times the step eagerly and
compiled (time_steps), and writes the marker that tells the next run its cache is warm and what compiling saves
here, by which `auto` decides (engine.MEASURED_MARGIN). It never competes with the run that started it, and yields
to any run started after it; TINYCHAR_WARM_CACHE=0 turns it off.

The helper is this file run as a script. Until the run ends it imports nothing but the standard library and two small
modules of tinychar's that need no more (training.atomic, training.warm_failures): a few MB. Its state lives in the
cache folder: tinychar-<key>.warming (what to compile; present while a helper is on it), tinychar-<key>.warming.lock
(locked while a run looks at the job and starts a helper: one at a time), tinychar-<key>.warming.log (its output) and
tinychar-<key>.failed (why it could not, so no later run tries again; written only for a fault of the compile's own,
which would fail again, never for a cause that passes) and tinychar-<key>.temporary (how many helpers in a row failed
for a cause that passes: from the third on no later run tries again either; see training/warm_failures.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if __name__ == "__main__":  # the helper, run as a script: tinychar's packages are found from the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Imported after the path above is set (E402); failed_file is warm's name for the file too.
from training.atomic import locked  # noqa: E402
from training.warm_failures import (  # noqa: E402
    TEMPORARY,
    clear_temporary_failures,
    earlier_failure,
    helper_failed,
    passing_cause,
    record_failure,
    record_temporary_failure,
)
from training.warm_failures import failed_file as failed_file  # noqa: E402

if TYPE_CHECKING:  # the helper imports torch only once the run has ended
    import torch
    from torch import nn

    from training.compiled_step import CompiledStep
    from training.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ("1", "0")
JOB_BYTES = 65536  # a job file holds the run's settings, a few hundred bytes


def enabled() -> bool:
    """TINYCHAR_WARM_CACHE: 1 (or unset) warms the cache after a run that auto trained eagerly, 0 never."""
    setting = os.environ.get("TINYCHAR_WARM_CACHE", "1").strip() or "1"
    if setting not in SETTINGS:
        raise ValueError(f"TINYCHAR_WARM_CACHE must be 1 or 0, got {setting!r}")
    return setting == "1"


def job_file(folder: Path, key: str) -> Path:
    return folder / f"tinychar-{key}.warming"


def alive(pid: int) -> bool:
    """Whether process pid is running (an ended one that its parent has not yet reaped is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
        return stat.rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (macOS): signal 0 is the answer
        return True


def started(pid: int) -> str | None:
    """When process pid started (clock ticks since boot, /proc/<pid>/stat's 22nd field), or None where that cannot be
    read (no such process, or no /proc: macOS)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
        return stat.rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def warming(pid: int, job: Path) -> bool:
    """Whether process pid is alive and is the helper of this job: after a reboot, or once the helper was killed,
    its pid may be another process's, which would keep every later run from warming the cache."""
    if not alive(pid):
        return False
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:  # no /proc (macOS): alive is all there is to go by
        return True
    return os.fsencode(job.name) in {os.path.basename(arg) for arg in command}


def start(folder: Path, key: str, spec: dict, parent: int | None = None) -> str | None:
    """Start a helper that compiles the step spec describes (see compile_step) into folder once process parent (this one
    by default) has ended. Returns why it did not start (another helper is on it, an earlier one failed, the folder
    is read-only), or None."""
    if (failed := earlier_failure(folder, key)) is not None:  # one that would fail again (an empty file: none)
        return f"an earlier attempt failed (see {failed})"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # Held from the look at the job file to the helper's pid in it: two runs ending together that both found a
        # dead helper's job each removed it, made their own and started a helper, and both compiled.
        with locked(Path(f"{job_file(folder, key)}.lock")) as held:
            if held is False:  # another run's start() is on it at this moment (None: no locks here, as before them)
                return "another process is warming it"
            return _start_helper(folder, key, spec, parent)
    except OSError as e:
        return f"cannot write to {folder} ({e.strerror or e})"


def _start_helper(folder: Path, key: str, spec: dict, parent: int | None) -> str | None:
    """start's work, with the job's lock held: the job file taken (made, or taken over from a helper that is gone),
    the helper started and its pid written in it."""
    job = job_file(folder, key)
    fd = _take_job(job)
    if fd is None:
        return "another process is warming it"
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({**spec, "key": key, "helper": None}, f)
        log_path = Path(f"{job}.log")
        log_path.unlink(missing_ok=True)  # a new file, never written through a link put in its place
        with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "w", encoding="utf-8") as log:
            parent = parent or os.getpid()
            command = [sys.executable, str(Path(__file__).resolve()), str(job), str(parent), started(parent) or "-"]
            helper = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(folder)})
        # Its pid goes in once the process shows the helper's command line: the kernel sets that up a moment after
        # Popen returns (an empty line in 35 of 300 starts on an idle 2-core EPYC, 283 of 300 beside four busy
        # loops), and another run's start() reading the pid then took the job for abandoned and started a second
        # helper on it.
        deadline = time.monotonic() + 10
        while not warming(helper.pid, job) and helper.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        # Read by the helper only once this process has ended, and by another run's start() meanwhile.
        job.write_text(json.dumps({**spec, "key": key, "helper": helper.pid}), encoding="utf-8")
    except OSError:
        with contextlib.suppress(OSError):  # this start()'s job, which no helper will take
            job.unlink(missing_ok=True)
        raise
    return None


def _take_job(job: Path) -> int | None:
    """The job file made anew for this process (its open descriptor): where there is one, only if the helper it
    names is gone; None where a helper, or a start() of a tinychar without the job's lock, is on it."""
    from configs.userinput import read_user_file

    try:
        return os.open(job, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        pass
    try:  # a regular file of a few hundred bytes: a named pipe put there waited for a writer forever
        record = json.loads(read_user_file(job, "job file", JOB_BYTES))
    except (OSError, ValueError):
        record = None
    helper = record.get("helper") if isinstance(record, dict) else None
    try:
        age = time.time() - job.stat().st_mtime
    except FileNotFoundError:  # its helper has just ended, and removed it
        age = math.inf
    starting = helper is None and age < 60  # another start() mid-way
    if starting or (isinstance(helper, int) and warming(helper, job)):
        return None
    job.unlink(missing_ok=True)  # left by a helper that was killed
    return os.open(job, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)


def compile_step(job: Path, remember: bool) -> tuple[float, str]:
    """Compile the step the job file describes (into the cache that TORCHINDUCTOR_CACHE_DIR names); with remember,
    time it eagerly and compiled, and write the marker that tells the next run its cache is warm, with the seconds
    this compile took and the two times. Returns those seconds, and where the step came from (CompiledStep.source:
    the second process loads the step that the first saved whole, as the next run will)."""
    import torch

    from model import GPT, GPTConfig
    from training import compile_cache, eager_kernels, engine
    from training.compile_errors import compile_or_clear
    from training.compiled_step import CompiledStep
    from training.config import TrainConfig
    from training.devices import flush_wanted
    from training.optim import make_optimizer

    spec = json.loads(job.read_text(encoding="utf-8"))
    torch.set_flush_denormal(flush_wanted())  # as the run does (training.devices.denormals_as_zero), to time it so
    torch.set_num_threads(spec["threads"])
    model_cfg, tc = GPTConfig(**spec["model"]), TrainConfig(**spec["train"])
    dtype, device = getattr(torch, spec["dtype"]), torch.device("cpu")
    key = engine.compile_key(model_cfg, tc, device, dtype)
    if key != spec["key"]:
        raise RuntimeError(f"this process would compile another step ({key}, not {spec['key']})")
    begun = time.perf_counter()  # a run's compile, as auto weighs it, includes the compiler's imports
    compile_cache.prepare_compile()
    model = GPT(model_cfg)
    step = CompiledStep(model, make_optimizer(model, tc, device, dtype), tc, device, dtype)
    xs = torch.randint(0, model_cfg.vocab_size, (tc.grad_accum_steps, tc.batch_size, model_cfg.block_size))
    ys = xs.roll(1, -1)
    compile_or_clear(lambda: step.warm_up(xs, ys))  # a library cut short in the cache: removed, and built again
    seconds = time.perf_counter() - begun
    if remember:  # this second compile read the cache the first one filled, as the next run will
        compile_cache.remember_compile(key, seconds, cold=False)
        eager_model = GPT(model_cfg)  # with tinychar's kernels where an eager run of the job's takes them
        eager_optimizer = make_optimizer(eager_model, tc, device, dtype)
        if eager_kernels.wanted(tc.compile, device, dtype, False, tc.max_iters, None):
            eager_kernels.attach(eager_model, tc.batch_size * model_cfg.block_size, optimizer=eager_optimizer)
        eager_ms, compiled_ms = time_steps(step, eager_model, tc, dtype, xs, ys, eager_optimizer)
        compile_cache.remember_step_times(key, eager_ms, compiled_ms)
        print(f"a step: {eager_ms:.2f} ms eager, {compiled_ms:.2f} ms compiled", flush=True)
    return seconds, step.source


# time_steps: rounds of up to TIMING_STEPS steps of each engine in turn (no more than fit in TIMING_ROUND_SECONDS,
# at least one), at most TIMING_ROUNDS of them, no more than TIMING_SECONDS in all once two
# are done. Each engine's time is its fastest round's: a machine busy with something else (the helper runs at the
# lowest priority) only ever adds time.
TIMING_STEPS, TIMING_ROUNDS, TIMING_SECONDS, TIMING_ROUND_SECONDS = 5, 5, 10.0, 1.0


def time_steps(step: CompiledStep, model: nn.Module, tc: TrainConfig, dtype: torch.dtype, xs: torch.Tensor,
               ys: torch.Tensor, optimizer: torch.optim.Optimizer | None = None) -> tuple[float, float]:
    """Milliseconds an optimizer step of tc's takes here eagerly (model, a fresh copy of the run's, as the trainer's
    eager path takes it: forward and backward for each micro-batch, clipping, the optimizer's step: optimizer's, by
    default a new one) and through the compiled step, timed in turns on the same batches."""
    import math

    import torch

    from training.devices import autocast_context
    from training.optim import make_optimizer

    device = torch.device("cpu")
    optimizer = optimizer or make_optimizer(model, tc, device, dtype)
    params = list(model.parameters())

    def eager() -> None:
        for x, y in zip(xs, ys, strict=True):
            with autocast_context(device, dtype):
                _, loss = model(x, y)
            (loss / tc.grad_accum_steps).backward()
        torch.nn.utils.clip_grad_norm_(params, tc.grad_clip if tc.grad_clip > 0 else math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def compiled() -> None:
        step(xs, ys, tc.min_lr)

    best = {eager: math.inf, compiled: math.inf}
    start = time.perf_counter()
    for run in best:  # the first step of each allocates what the later ones reuse
        run()
    first = (time.perf_counter() - start) / 2
    steps = max(1, min(TIMING_STEPS, int(TIMING_ROUND_SECONDS / max(first, 1e-9))))
    start = time.perf_counter()
    for done in range(1, TIMING_ROUNDS + 1):
        for run in best:
            began = time.perf_counter()
            for _ in range(steps):
                run()
            best[run] = min(best[run], (time.perf_counter() - began) / steps)
        if done >= 2 and time.perf_counter() - start > TIMING_SECONDS:
            break
    return best[eager] * 1000, best[compiled] * 1000


def lowest_priority() -> None:
    """Take the lowest CPU priority, so that compiling yields to whatever else runs, a training run above all.

    nice alone is not enough on Linux: with autogroup scheduling (the default on desktop and server kernels alike)
    the CPU is shared fairly between sessions first and nice counts only within one, and the helper has a session of
    its own (it must outlive the run's terminal). Measured on a 2-core EPYC: tiny.yaml trained at 52,000 tokens/s
    alone, 6,700-7,600 beside two nice-19 busy loops each in its own session, 50,400-50,700 once their sessions'
    nice was 19 as well (written to /proc/self/autogroup)."""
    os.nice(19)  # the kernel caps it at 19
    for attempt in range(3):
        try:
            with open("/proc/self/autogroup", "w", encoding="ascii") as f:
                f.write("19")
            return
        except BlockingIOError:  # EAGAIN: the kernel takes such a change from a user once per 100 ms, system-wide
            time.sleep(0.2 * (attempt + 1))
        except OSError:  # no autogroup scheduling here (another OS, or a kernel built without it): nice is all
            return


def ends_with(parent: int) -> Callable[[], None]:
    """A preexec_fn that has the child end (SIGTERM) when process parent does, however it ends: a helper killed with
    SIGKILL (the OOM killer, `kill -9`) left its compile running, an orphan, beside the next run's helper compiling
    the same step. Linux's PR_SET_PDEATHSIG; elsewhere nothing."""
    def arrange() -> None:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # not Linux
            return
        if os.getppid() != parent:  # it ended before the setting took
            os._exit(128 + signal.SIGTERM)

    return arrange


def compile_main(job: Path, remember: bool) -> int:
    """The helper's compiling process (--compile): compile_step, saying how it went. TEMPORARY where it failed for a
    cause that passes (passing_cause, or no folder to write in now), said in the log first."""
    from training.compile_cache import NoCacheFolder
    from training.heap import memory_kept

    try:
        with memory_kept():  # as the run does, to time its steps so
            seconds, source = compile_step(job, remember)
    except Exception as e:
        cause = str(e) if isinstance(e, NoCacheFolder) else passing_cause(e)
        if cause is None:
            raise
        with contextlib.suppress(OSError):  # its log, on a full disk: the status says it still
            traceback.print_exc()
            print(f"not a fault of the compile ({cause}): a later run tries again", flush=True)
        return TEMPORARY
    print(f"compiled in {seconds:.1f} s ({source})", flush=True)
    return 0


def main(job: Path, parent: int, born: str | None = None) -> int:
    """The helper: wait for the run (process parent, started at born: see started) to end, lower its priority,
    compile the step in a process of its own (filling the cache), then again in another, as the next run will (timing
    that compile from the warm cache, and the step eagerly and compiled), and leave the folder tidy."""
    def end(signum: int, frame: object) -> None:  # kill, or a shutdown: the compile under way goes too (it went on,
        raise SystemExit(128 + signum)  # an orphan, and this job's file stayed), and the job's file is removed

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, end)
    try:
        # Once the run has ended its pid may go to another process (within a second in a container's small pid
        # space): the helper then waited on a daemon's pid for good, and its job kept every later run from warming.
        while alive(parent) and (born is None or started(parent) == born):
            time.sleep(1.0)
        lowest_priority()
        for remember in (False, True):
            subprocess.run([sys.executable, __file__, "--compile", str(job), *(["--remember"] if remember else [])],
                           cwd=ROOT, stdin=subprocess.DEVNULL, check=True, preexec_fn=ends_with(os.getpid()))
        with contextlib.suppress(OSError):  # the cache is warm regardless
            clear_temporary_failures(job)
        return 0
    except Exception as e:  # a fault of the compile's: said once, where later runs look
        if helper_failed(e):
            record_failure(job, e)
        else:  # counted, as a cause that looks passing may not pass; not at all where the disk that failed it is full
            with contextlib.suppress(OSError):
                record_temporary_failure(job, e)
        raise
    finally:
        job.unlink(missing_ok=True)


if __name__ == "__main__":
    if sys.argv[1] == "--compile":
        sys.exit(compile_main(Path(sys.argv[2]), "--remember" in sys.argv))
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2]), None if sys.argv[3:4] in ([], ["-"]) else sys.argv[3]))
