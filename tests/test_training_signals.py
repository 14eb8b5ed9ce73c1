"""training/signals.py: Ctrl-C and SIGTERM stop a run after the step in flight with a saved state and a resume line,
resuming after such a stop is exact, a second and third Ctrl-C while the checkpoint is written change nothing, and a
signal before training starts writes nothing."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from conftest import ROOT, needs_cpu_compile, tiny_overrides
from test_train import bitwise_equal, child_env, logged_losses, weights
from training_runs import (
    RESUME_KEYS,
    TINY,
    assert_continues_the_straight_run,
    call,
    check_after_a_crash,
    launch,
    one_line,
    temporary_files,
    train_main,
    wait_for,
    write_corpus,
)

import training.checkpoints
import training.compiled_step
import training.engine
import training.loop
import training.runner
import training.signals
from configs.userinput import shown
from model import GPT, load_checkpoint
from training.config import TrainConfig
from training.signals import Interrupted, InterruptSignals, StopSignals, start_or_status


def send(signum: int) -> None:
    """A real signal to this process, sent only while tinychar's handler holds it: were the handler missing, the
    signal would stop pytest itself instead of failing the test."""
    handler = signal.getsignal(signum)
    assert isinstance(getattr(handler, "__self__", None), StopSignals), f"no tinychar handler for {signum}"
    signal.raise_signal(signum)


def signal_at(step: int, signum: int) -> Callable:
    """train.lr_at, sending signum as step (0-based) begins: that step finishes, and the run stops after it."""
    real = training.loop.lr_at

    def lr_at(at: int, cfg: TrainConfig) -> float:
        if at == step:
            send(signum)
        return real(at, cfg)

    return lr_at


def stop_line(out: Path, step: int) -> str:
    return (f"stopped at step {step}: saved '{shown(out / 'ckpt.pt')}'; continue with: python train.py "
            f"--out-dir {shlex.quote(str(out))} --resume")


# ------------------------------------------------------------------------------------------ exact resume


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_between_evaluations_saves_and_resuming_is_exact(straight, tmp_path, capsys, monkeypatch, signum):
    out = tmp_path / "out"
    args = ["--config", TINY, *tiny_overrides(write_corpus(tmp_path), out, **RESUME_KEYS)]
    monkeypatch.setattr(training.loop, "lr_at", signal_at(6, signum))
    code, stdout, err = call(train_main, args, capsys)
    assert code == 128 + signum
    assert one_line(err) == stop_line(out, 7)
    assert sorted(logged_losses(stdout)) == list(range(1, 8))  # the step in flight finished, no later one began
    assert load_checkpoint(out / "ckpt.pt")["step"] == 7  # between evaluations (every 10): saved for the stop
    assert not (out / "best.pt").exists()  # nothing evaluated yet, so nothing is best

    monkeypatch.undo()
    # TensorBoard reads a folder's event files in name order, and the name holds the time in whole seconds and a
    # per-process counter (so "10" sorts before "9"): a resume in the same second and process could be read first.
    time.sleep(1.02 - time.time() % 1)
    code, stdout, err = call(train_main, ["--resume", "--out-dir", str(out)], capsys)
    assert code == 0, err
    assert logged_losses(stdout) == {s: straight[1][s] for s in range(8, 21)}
    assert_continues_the_straight_run(out, straight)


def test_resuming_without_the_batch_generator_state_changes_the_losses(straight, tmp_path, capsys, monkeypatch):
    """The negative control for the test above: a resume that restored everything but the sampler's generator."""
    out = tmp_path / "out"
    monkeypatch.setattr(training.loop, "lr_at", signal_at(6, signal.SIGINT))
    args = ["--config", TINY, *tiny_overrides(write_corpus(tmp_path), out, **RESUME_KEYS)]
    assert call(train_main, args, capsys)[0] == 130
    monkeypatch.undo()
    real_load = training.checkpoints.load_checkpoint

    def load_without_sampler_state(path, *a, **kw):
        payload = real_load(path, *a, **kw)
        payload["rng"]["batches"] = torch.Generator().manual_seed(payload["config"]["seed"]).get_state()
        return payload

    monkeypatch.setattr(training.checkpoints, "load_checkpoint", load_without_sampler_state)
    code, stdout, err = call(train_main, ["--resume", "--out-dir", str(out)], capsys)
    assert code == 0, err
    losses = logged_losses(stdout)
    assert sorted(losses) == list(range(8, 21))
    assert sum(losses[s] != straight[1][s] for s in losses) >= 10  # other batches: nearly every loss differs
    assert not bitwise_equal(weights(out / "ckpt.pt"), weights(straight[0] / "ckpt.pt"))


def test_a_signal_between_micro_batches_leaves_the_step_untaken_and_resuming_is_exact(tmp_path, capsys, monkeypatch):
    # The step in flight used to finish first: one of train.grad_accum_steps=10**18 micro-batches never did, and
    # neither Ctrl-C nor SIGTERM ended the run. Now the step stops between two micro-batches, untaken, its random
    # state put back, so that the resumed run ends on the weights of the run that never stopped.
    corpus = write_corpus(tmp_path)
    keys = {**RESUME_KEYS, "train.grad_accum_steps": 3, "train.max_iters": 8, "train.eval_interval": 10}
    whole = tmp_path / "whole"
    assert call(train_main, ["--config", TINY, *tiny_overrides(corpus, whole, **keys)], capsys)[0] == 0
    out = tmp_path / "out"
    real, drawn = training.loop.get_batch, []

    def get_batch(*args, **kwargs):  # no evaluation before step 8: every batch until then is a step's
        drawn.append(1)
        if len(drawn) == 5 * 3 + 2:  # the second micro-batch of step 6
            send(signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(training.loop, "get_batch", get_batch)
    code, stdout, err = call(train_main, ["--config", TINY, *tiny_overrides(corpus, out, **keys)], capsys)
    assert code == 143 and one_line(err) == stop_line(out, 5)
    assert len(drawn) == 17 and load_checkpoint(out / "ckpt.pt")["step"] == 5
    monkeypatch.undo()
    code, stdout, err = call(train_main, ["--resume", "--out-dir", str(out)], capsys)
    assert code == 0, err
    for key in ("model", "training_weights"):
        assert bitwise_equal(load_checkpoint(out / "ckpt.pt")[key], load_checkpoint(whole / "ckpt.pt")[key])


# ------------------------------------------------------------------------------------------ Ctrl-C, SIGTERM

SIGNAL_KEYS = {"train.max_iters": 100_000, "train.eval_interval": 1000, "train.log_interval": 1}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "gap"),
    [(signal.SIGTERM, None), (signal.SIGINT, 0.0), (signal.SIGINT, 0.03)],
    ids=["SIGTERM", "SIGINT-twice-at-once", "SIGINT-twice-30ms-apart"],
)
def test_a_signal_stops_a_real_run_promptly_with_a_checkpoint_and_a_resume_line(tmp_path, signum, gap):
    out = tmp_path / "out"
    log = tmp_path / "log.txt"
    proc = launch(["--config", TINY, *tiny_overrides(write_corpus(tmp_path), out, **SIGNAL_KEYS)], log)
    wait_for(log, r"^step 5/", proc)
    sent = time.monotonic()
    proc.send_signal(signum)
    if gap is not None:  # a second Ctrl-C, likely while the checkpoint is being written
        time.sleep(gap)
        proc.send_signal(signum)
    code = proc.wait(timeout=60)
    elapsed = time.monotonic() - sent
    assert code == 128 + signum, log.read_text(encoding="utf-8")
    assert elapsed < 10, elapsed  # a step is milliseconds; most of this is the interpreter shutting down
    text = log.read_text(encoding="utf-8")  # stdout and stderr together
    stops = [line for line in text.splitlines() if line.startswith("stopped at step")]
    assert len(stops) == 1 and "Traceback" not in text and "error" not in text, text
    step = int(re.match(r"stopped at step (\d+):", stops[0])[1])
    assert stops[0] == stop_line(out, step)
    assert step >= 5 and f"step {step}/" in text and f"step {step + 1}/" not in text  # the last step finished
    assert check_after_a_crash(out) == step
    assert temporary_files(out) == []

    if gap:  # the printed command continues the run
        command = shlex.split(stops[0].split("continue with: ", 1)[1])
        assert command[:2] == ["python", "train.py"]
        resumed = subprocess.run([sys.executable, *command[1:], f"train.max_iters={step + 2}"], cwd=ROOT,
                                 env=child_env(), capture_output=True, text=True, timeout=120, check=False)
        assert resumed.returncode == 0, resumed.stderr
        assert load_checkpoint(out / "ckpt.pt")["step"] == step + 2


@needs_cpu_compile
@pytest.mark.slow
@pytest.mark.parametrize(("signum", "into"), [(signal.SIGINT, 0.5), (signal.SIGTERM, 2.0)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_step_compiles_stops_the_run_instead_of_training_on(tmp_path, signum, into):
    # Raised inside torch.compile, the signal's exception came back as a compiler failure ("cannot compile here
    # (InductorError: Interrupted: signal 15); training without compiling") and the run trained to its last step,
    # exit 0; or inductor swallowed it whole (raised in a weak reference's callback, printed as "Exception ignored")
    # and went on compiling and training. The signal comes `into` seconds into a cold compile of 15-60 s: Ctrl-C while
    # dynamo traces the step's bytecode, SIGTERM deeper in, where its graph is traced for autograd on fake tensors. A
    # run that took either for a compiler failure trained on (at 0.2, 0.5 and 2 s alike); half a second in, the test
    # takes 3.3 s of CPU, 5.0 s two seconds in (2026-12-05, 2-core AMD EPYC (Zen 3, AVX2)).
    out, log, cache = tmp_path / "out", tmp_path / "log.txt", tmp_path / "cache"
    env = {**child_env(), "XDG_CACHE_HOME": str(cache), "TINYCHAR_CACHE_DIR": str(cache)}  # cold: seconds to compile
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    args = ["--config", TINY, *tiny_overrides(write_corpus(tmp_path), out, **SIGNAL_KEYS), "train.compile=true"]
    with log.open("w", encoding="utf-8") as f:
        proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT)
    wait_for(log, r"^engine: compiling the training step", proc)
    time.sleep(into)
    proc.send_signal(signum)
    code = proc.wait(timeout=120)  # at the latest when compiling ends (if the compiler swallowed the signal)
    text = log.read_text(encoding="utf-8")
    assert code == 128 + signum, text
    name = signal.Signals(signum).name
    assert text.splitlines()[-1] == f"interrupted ({name}) before training started; no checkpoint was saved", text
    assert "Traceback" not in text and "Exception ignored" not in text and "cannot compile" not in text, text
    assert not (out / "ckpt.pt").exists() and not (out / "best.pt").exists()


def swallowing_compile(caught: list[BaseException], swallowed: int) -> None:
    """A stand-in compile of a minute that sends a Ctrl-C, then catches it and as many more as `swallowed`, as a
    library's `except Exception` would, into caught."""
    deadline, sent = time.monotonic() + 60, False
    while time.monotonic() < deadline:
        try:
            if not sent:
                sent = True
                send(signal.SIGINT)
            time.sleep(0.01)
        except Exception as e:  # noqa: BLE001 - the library's
            if len(caught) == swallowed:
                raise
            caught.append(e)


@pytest.mark.parametrize("swallowed", [1, 3])
def test_a_signal_the_compiler_swallows_is_raised_again_until_the_run_stops(tmp_path, capsys, monkeypatch, swallowed):
    # Inductor caught a Ctrl-C two seconds into compiling the step, once in a few busy runs of the suite, and compiled
    # on: the run stopped 35 s later, when the compile was done. Here a stand-in compile catches the signal (and as
    # many more as `swallowed`), as a library's `except Exception` would, then compiles on for a minute.
    monkeypatch.setattr(training.engine, "cannot_compile", lambda device: None)
    monkeypatch.setattr(training.engine, "prepare_compile", lambda: tmp_path / "compiled")
    monkeypatch.setattr(training.signals, "INSIST_AFTER", 0.5)
    caught: list[BaseException] = []

    def compiling(self, xs: torch.Tensor, ys: torch.Tensor) -> float:
        swallowing_compile(caught, swallowed)
        return 60.0

    monkeypatch.setattr(training.compiled_step.CompiledStep, "warm_up", compiling)
    begun = time.monotonic()
    code, out, err = call(train_main, ["--config", TINY, *tiny_overrides(write_corpus(tmp_path), tmp_path / "out"),
                                       "train.compile=true"], capsys)
    assert code == 130 and time.monotonic() - begun < 30, err
    assert one_line(err) == "interrupted (SIGINT) before training started; no checkpoint was saved"
    assert len(caught) == swallowed and all(isinstance(e, Interrupted) for e in caught)
    assert "engine: compiling the training step" in out and "compiled in" not in out
    assert not (tmp_path / "out" / "ckpt.pt").exists()


def test_a_signal_the_compiler_swallows_while_the_blocks_compile_is_raised_again(tmp_path, capsys, monkeypatch):
    # As above, on the path that compiles the model block by block (more micro-batches than the whole step unrolls):
    # the stand-in catches the signal inside the blocks' trial forward and backward, and works on for a minute.
    monkeypatch.setattr(training.engine, "cannot_compile", lambda device: None)
    monkeypatch.setattr(training.signals, "INSIST_AFTER", 0.5)
    caught: list[BaseException] = []

    @contextlib.contextmanager
    def compiling() -> Iterator[None]:
        swallowing_compile(caught, 1)
        yield

    monkeypatch.setattr(training.engine, "compiler_log_quiet", compiling)
    begun = time.monotonic()
    code, out, err = call(train_main, ["--config", TINY, *tiny_overrides(write_corpus(tmp_path), tmp_path / "out"),
                                       "train.compile=true", "train.grad_accum_steps=9"], capsys)
    assert code == 130 and time.monotonic() - begun < 30, err
    assert one_line(err) == "interrupted (SIGINT) before training started; no checkpoint was saved"
    assert len(caught) == 1 and isinstance(caught[0], Interrupted)
    assert "engine: compiling the model block by block" in out and "compiled block by block" not in out
    assert not (tmp_path / "out" / "ckpt.pt").exists()


@pytest.mark.parametrize("signalled", [False, True])
def test_the_watcher_that_insists_ends_with_its_guard_even_if_the_block_never_ended(monkeypatch, signalled):
    """A signal landing as insist_on_stop's block ends could cut its ending short, and the watcher then went on
    sending the signal, to handlers that no longer expected it, or waited for the next run's signal."""
    from training.signals import insist_on_stop

    # long enough that a stall of the loaded machine between the raise below and the InterruptSignals' end does not
    # let the watcher raise it once more in the test's own code
    monkeypatch.setattr(training.signals, "INSIST_AFTER", 0.5)
    strays: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: strays.append(signum))
    try:
        with InterruptSignals():
            block = insist_on_stop()
            block.__enter__()  # and never left, as a signal at the right moment could leave it
            assert watchers() == 1
            if signalled:
                with pytest.raises(Interrupted):
                    send(signal.SIGINT)
                with pytest.raises(Interrupted):  # raised again while the block goes on
                    time.sleep(10)
        wait_until(lambda: watchers() == 0)  # the InterruptSignals is gone: nothing more may come
        time.sleep(0.2)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert strays == [] and watchers() == 0
    del block  # (its generator, closed now, ends nothing that is still running)


def watchers() -> int:
    """How many of insist_on_stop's watching threads are running."""
    return [t.name for t in threading.enumerate()].count("tinychar-insist-on-stop")


def wait_until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert condition()


def test_a_signal_as_the_watcher_starts_ends_it_with_the_block_that_never_began(monkeypatch):
    """A signal held while insist_on_stop started its watcher came out just after, before the block's try: the
    watcher outlived it, raising the signal again every few seconds into the cleanup that followed (a log's close,
    the lock's release) until the InterruptSignals ended."""
    from training.signals import insist_on_stop

    monkeypatch.setattr(training.signals, "INSIST_AFTER", 0.05)
    real_start = threading.Thread.start

    def start_then_signal(self: threading.Thread) -> None:
        real_start(self)
        if self.name == "tinychar-insist-on-stop":
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # held by the start: taken after it

    monkeypatch.setattr(threading.Thread, "start", start_then_signal)
    with InterruptSignals():
        with pytest.raises(Interrupted), insist_on_stop():
            pytest.fail("the block began")
        monkeypatch.setattr(threading.Thread, "start", real_start)
        wait_until(lambda: watchers() == 0, 2.0)
        time.sleep(0.3)  # six of the watcher's turns, had it lived on: nothing is raised in the cleanup here


def ctrl_c_as_the_loop_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C the moment the training loop has given its handlers back to the InterruptSignals around it."""
    real_exit = StopSignals.__exit__

    def exit_then_ctrl_c(self, *exc):
        real_exit(self, *exc)
        if type(self) is StopSignals:  # the loop's, not the InterruptSignals around it
            send(signal.SIGINT)

    monkeypatch.setattr(StopSignals, "__exit__", exit_then_ctrl_c)


def test_a_second_ctrl_c_just_after_the_stop_was_saved_changes_nothing(tmp_path, capsys, monkeypatch):
    """A second Ctrl-C 10 ms behind the first (1 in 20 tries, `kill -INT` twice) landed after the loop had saved and
    given the handlers back, and the run ended saying "interrupted (SIGINT) before training started; no checkpoint
    was saved", its checkpoint saved all the same."""
    out = tmp_path / "out"
    monkeypatch.setattr(training.loop, "lr_at", signal_at(6, signal.SIGINT))
    ctrl_c_as_the_loop_ends(monkeypatch)
    code, _, err = call(train_main, ["--config", TINY, *tiny_overrides(write_corpus(tmp_path), out)], capsys)
    assert code == 130
    assert one_line(err) == stop_line(out, 7)
    assert check_after_a_crash(out) == 7


def test_a_ctrl_c_as_a_finished_run_gives_its_handlers_back_changes_nothing(tmp_path, capsys, monkeypatch):
    """A Ctrl-C just after the loop had trained to its end and saved (its handlers given back to the
    InterruptSignals around it, the cleanup and the last line to come) ended the run with status 130 saying
    "interrupted (SIGINT) before training started; no checkpoint was saved"."""
    out = tmp_path / "out"
    ctrl_c_as_the_loop_ends(monkeypatch)
    code, out_text, err = call(train_main, ["--config", TINY, *tiny_overrides(write_corpus(tmp_path), out)], capsys)
    assert code == 0, err
    assert "done: step 20," in out_text
    assert check_after_a_crash(out) == 20


def test_a_second_and_third_ctrl_c_in_the_middle_of_the_save_change_nothing(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(training.loop, "lr_at", signal_at(6, signal.SIGINT))
    real_save = torch.save

    def save_between_two_ctrl_c(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        send(signal.SIGINT)
        send(signal.SIGINT)
        f.write(data[len(data) // 2 :])

    monkeypatch.setattr(torch, "save", save_between_two_ctrl_c)
    code, _, err = call(train_main, ["--config", TINY, *tiny_overrides(write_corpus(tmp_path), out)], capsys)
    assert code == 130
    assert one_line(err) == stop_line(out, 7)
    assert check_after_a_crash(out) == 7
    assert temporary_files(out) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_before_training_starts_stops_at_once_and_writes_nothing(tmp_path, capsys, monkeypatch, signum):
    out = tmp_path / "out"
    handlers = {sig: signal.getsignal(sig) for sig in StopSignals.SIGNALS}

    def reading_the_data(*args, **kwargs):  # a long read of a big corpus, cut short
        send(signum)
        raise AssertionError("the signal should have ended the run before the data was read")

    monkeypatch.setattr(training.runner, "prepare_corpus", reading_the_data)
    code, _, err = call(train_main, ["--config", TINY, *tiny_overrides(write_corpus(tmp_path), out)], capsys)
    assert code == 128 + signum
    assert one_line(err) == (f"interrupted ({signal.Signals(signum).name}) before training started; no checkpoint "
                             "was saved")
    assert not out.exists()
    assert {sig: signal.getsignal(sig) for sig in StopSignals.SIGNALS} == handlers  # left as it found them


def test_torch_logging_the_interrupt_on_its_way_up_prints_no_traceback(monkeypatch, caplog):
    """CI caught it: a Ctrl-C landing in a fake-tensor kernel while the step compiled went up as it should, but torch
    logged it first ("failed while attempting to run meta for aten.sub.Tensor" and a page of traceback). The signal is
    sent from inside that kernel here, and torch's own logger is read; other errors it logs still show."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch_log, logged = logging.getLogger("torch._subclasses.fake_tensor"), io.StringIO()
    reader = logging.StreamHandler(logged)  # beside torch's own handler, whose stream pytest may have swapped
    monkeypatch.setattr(torch_log, "handlers", [*torch_log.handlers, reader])
    real = torch.empty_permuted  # what the elementwise kernels' shape function calls

    def interrupted_inside(*args, **kwargs):
        send(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "empty_permuted", interrupted_inside)
    handlerless = logging.getLogger("tinychar.test.no_handler")  # to the root's handlers, or Python's last resort
    with pytest.raises(Interrupted), InterruptSignals():
        try:
            with FakeTensorMode():
                torch.empty(3) - torch.empty(3)
        finally:
            handlerless.error("after the signal, through no handler of its own")
            torch_log.addHandler(later := logging.StreamHandler(logged))  # a handler made since the block began
            torch_log.error("after the signal, through a handler made after the block began")
            torch_log.removeHandler(later)
    assert logged.getvalue() == "" and caplog.records == []

    monkeypatch.setattr(torch, "empty_permuted", real)
    with InterruptSignals():
        try:
            raise ValueError("a real failure")
        except ValueError:
            torch_log.exception("failed while attempting to run meta for %s", "something")
    assert "Traceback" in logged.getvalue() and "ValueError: a real failure" in logged.getvalue()
    torch_log.error("after it, an interrupt is torch's to log again", exc_info=Interrupted(signal.SIGINT))
    assert "Interrupted: signal 2" in logged.getvalue()
    handlerless.error("and a logger of no handler of its own is heard again")
    heard = [r.getMessage() for r in caplog.records if r.name == handlerless.name]  # torch's may propagate here too
    assert heard == ["and a logger of no handler of its own is heard again"]


def test_a_signal_while_interrupt_signals_is_entered_leaves_nothing_of_it_behind(monkeypatch):
    """A signal landing between the replacement of SIGINT's handler and SIGTERM's raised out of __enter__, so
    __exit__ never ran: the raising handler, the quiet warnings and the unraisable hook stayed for the process."""
    before = ({sig: signal.getsignal(sig) for sig in StopSignals.SIGNALS}, warnings.showwarning, sys.unraisablehook)
    real_signal, replaced = signal.signal, []

    def a_signal_after_the_first(sig, handler):
        previous = real_signal(sig, handler)
        replaced.append(sig)
        if len(replaced) == 1:
            signal.raise_signal(signal.SIGINT)  # lands at once, in the handler just set
        return previous

    monkeypatch.setattr(signal, "signal", a_signal_after_the_first)
    with pytest.raises(Interrupted):
        with InterruptSignals():
            pytest.fail("the block ran")
    monkeypatch.setattr(signal, "signal", real_signal)
    assert ({sig: signal.getsignal(sig) for sig in StopSignals.SIGNALS}, warnings.showwarning,
            sys.unraisablehook) == before
    assert InterruptSignals.received is None and logging.root.manager.disable == logging.NOTSET


def test_autograd_warning_of_the_interrupt_on_its_way_up_is_not_shown():
    """CI's stress of the compiling run: a signal that landed in the backward the compiler traces under anomaly mode
    came out as a UserWarning, "Error detected in ...Backward0. Traceback of forward call that caused the error",
    above the run's one line. A warning before any signal is still shown."""

    class SignalledInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            send(signal.SIGTERM)
            return grad * 2

    shown_warnings: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", "Anomaly Detection has been enabled")  # entering it says so
        warnings.showwarning = lambda message, *args, **kwargs: shown_warnings.append(str(message))
        with InterruptSignals():
            warnings.warn("before any signal", UserWarning, stacklevel=1)
            x = torch.ones(3, requires_grad=True)
            with pytest.raises(Interrupted), torch.autograd.detect_anomaly(check_nan=False):
                SignalledInBackward.apply(x).sum().backward()
            warnings.warn("after the signal", UserWarning, stacklevel=1)
        warnings.warn("once the work it guarded is over", UserWarning, stacklevel=1)
    assert shown_warnings == ["before any signal", "once the work it guarded is over"]


def test_an_interrupt_raised_where_python_cannot_raise_it_is_not_reported(monkeypatch):
    """A signal that lands in a callback Python runs on its own (a weak reference's, as torch.compile's caches keep)
    cannot stop anything there: Python hands the exception to sys.unraisablehook, which prints "Exception ignored in"
    and a traceback above the run's one line. Inside InterruptSignals an Interrupted goes unreported (the signal is in
    `received`), any other exception is still reported, and the hook is the one before once it ends."""
    reported: list[str] = []

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        reported.append(type(unraisable.exc_value).__name__)

    monkeypatch.setattr(sys, "unraisablehook", hook)

    class Cached:
        pass

    def dropped_while(callback: Callable[[weakref.ref], None]) -> None:
        held = Cached()
        ref = weakref.ref(held, callback)
        del held  # the callback runs here, and what it raises goes to sys.unraisablehook
        assert ref() is None

    with InterruptSignals():
        dropped_while(lambda ref: send(signal.SIGTERM))
        assert InterruptSignals.received == signal.SIGTERM
        dropped_while(lambda ref: 1 / 0)
    assert sys.unraisablehook is hook
    dropped_while(lambda ref: 1 / 0)
    assert reported == ["ZeroDivisionError", "ZeroDivisionError"]


@pytest.mark.slow
@pytest.mark.parametrize("at", [10, 20], ids=["midway", "the-last-step"])
def test_an_evaluation_a_signal_cut_short_is_run_by_the_resume_first(straight, tmp_path, capsys, monkeypatch, at):
    """Stopped during the last step's evaluation, the run printed a resume command that was refused (nothing left to
    train), and its best.pt and last points were never made; stopped during one midway, the resume trained on from
    the next step, and TensorBoard had a gap there for good."""
    out = tmp_path / "out"
    args = ["--config", TINY, *tiny_overrides(write_corpus(tmp_path), out, **RESUME_KEYS)]
    real = training.loop.estimate_loss

    def cut_short_at(model, *rest, **kwargs):
        if trainer_step[0] == at:
            send(signal.SIGTERM)  # the evaluation sees it before its first batch, and returns no result
        return real(model, *rest, **kwargs)

    trainer_step = [0]
    real_evaluate = training.loop.Trainer.evaluate
    monkeypatch.setattr(training.loop.Trainer, "evaluate",
                        lambda self: trainer_step.__setitem__(0, self.step) or real_evaluate(self))
    monkeypatch.setattr(training.loop, "estimate_loss", cut_short_at)
    code, _, err = call(train_main, args, capsys)
    assert code == 143 and f"stopped at step {at}" in err
    assert load_checkpoint(out / "ckpt.pt")["eval_pending"] is True
    monkeypatch.undo()
    code, stdout, err = call(train_main, ["--resume", "--out-dir", str(out)], capsys)
    assert code == 0, err
    assert stdout.count(f"step {at}: train loss") == 1  # evaluated first, and once
    assert_continues_the_straight_run(out, straight)
    mine, theirs = load_checkpoint(out / "best.pt"), load_checkpoint(straight[0] / "best.pt")
    assert (mine["step"], mine["best_val_loss"]) == (theirs["step"], theirs["best_val_loss"])
    assert load_checkpoint(out / "ckpt.pt")["eval_pending"] is False


def test_a_signal_during_a_long_evaluation_stops_it_at_once_without_logging_it(tmp_path):
    """An evaluation of 10**8 batches (or the GPU config's on a CPU) stops between two batches: a scheduler's
    SIGTERM-then-SIGKILL grace period is enough, and the cut-short evaluation is not logged as a result."""
    out = tmp_path / "out"
    keys = {"train.max_iters": 10, "train.eval_interval": 3, "train.eval_iters": 10**8, "train.log_interval": 1}
    proc = subprocess.Popen([sys.executable, "train.py", "--config", TINY, *tiny_overrides(write_corpus(tmp_path),
                            out, **keys)], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 3/10"):  # logged just before the evaluation of step 3 begins
            break
    time.sleep(0.2)  # some hundred batches into it: a second in, as before, cost the test 0.8 s more CPU
    sent = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert time.perf_counter() - sent < 10
    assert "step 3: train loss" not in "".join(lines) + rest  # no result for the evaluation that was cut short
    assert load_checkpoint(out / "ckpt.pt")["step"] == 3 and "stopped at step 3" in err


def sigterm_at_character(monkeypatch, n: int) -> list:
    """The characters GPT.generate_iter draws (the logged sample's), in a list, with SIGTERM sent as the nth comes."""
    drawn, real = [], GPT.generate_iter

    def generate_iter(self, *args, **kwargs):
        for next_id in real(self, *args, **kwargs):
            drawn.append(next_id)
            if len(drawn) == n:
                send(signal.SIGTERM)
            yield next_id

    monkeypatch.setattr(GPT, "generate_iter", generate_iter)
    return drawn


def test_a_signal_while_the_logged_sample_is_drawn_stops_it_at_the_next_character(tmp_path, capsys, monkeypatch):
    """The sample logged at each evaluation was drawn to its end whatever came: train.sample_chars=30000 at block 512
    kept a SIGTERM waiting 442 s, past a scheduler's grace period. It now stops after the character in flight, the
    state is saved, and the cut-short sample is not logged."""
    out, drawn = tmp_path / "out", sigterm_at_character(monkeypatch, 50)
    keys = {"train.max_iters": 10, "train.eval_interval": 5, "train.sample_chars": 100_000}
    code, _, err = call(train_main, ["--config", TINY, *tiny_overrides(write_corpus(tmp_path), out, **keys)], capsys)
    assert code == 143 and one_line(err) == stop_line(out, 5)
    assert len(drawn) == 50  # not one more character
    assert load_checkpoint(out / "ckpt.pt")["step"] == 5


def test_a_signal_after_the_last_step_was_evaluated_and_saved_ends_the_run_as_done(tmp_path, capsys, monkeypatch):
    """A signal while the last evaluation's sample was drawn (the losses logged, the checkpoint saved) said "stopped at
    step 10: ... continue with: ... --resume", exit 143, and that resume was refused: the run was done."""
    out, drawn = tmp_path / "out", sigterm_at_character(monkeypatch, 50)
    keys = {"train.max_iters": 10, "train.eval_interval": 10, "train.sample_chars": 100_000}
    code, out_text, err = call(train_main, ["--config", TINY, *tiny_overrides(write_corpus(tmp_path), out, **keys)],
                               capsys)
    assert code == 0 and err == "" and "stopped" not in out_text, err
    assert re.search(r"^done: step 10, val loss", out_text, re.MULTILINE), out_text
    assert len(drawn) == 50  # the sample stopped all the same
    saved = load_checkpoint(out / "ckpt.pt")
    assert saved["step"] == 10 and not saved["eval_pending"]


def pasted(word: str) -> bytes:
    """What bash makes of a word of a suggested command: the bytes it would pass on."""
    return subprocess.run(["bash", "-c", f"printf %s {word}"], capture_output=True, check=True).stdout


def test_a_newline_in_out_dir_keeps_the_done_and_stop_lines_whole_and_their_commands_exact(tmp_path, capsys,
                                                                                           monkeypatch):
    out = tmp_path / "a\nrun's"
    args = ["--config", TINY, *tiny_overrides(write_corpus(tmp_path), out, **{"train.max_iters": 5})]
    code, stdout, err = call(train_main, args, capsys)
    assert code == 0, err
    done = [line for line in stdout.splitlines() if line.startswith("done: ")]
    assert len(done) == 1 and done[0].endswith("sample with: python sample.py --out-dir $'" + str(tmp_path) +
                                               "/a\\nrun\\'s'")
    assert pasted(done[0].split("--out-dir ", 1)[1]) == bytes(out)
    monkeypatch.setattr(training.loop, "lr_at", signal_at(6, signal.SIGINT))
    code, _, err = call(train_main, ["--resume", "--out-dir", str(out), "train.max_iters=20"], capsys)
    assert code == 130
    line = one_line(err)
    assert line.startswith(f"stopped at step 7: saved '{shown(out / 'ckpt.pt')}'; continue with: python train.py "
                           f"--out-dir $'")
    assert pasted(line.split("--out-dir ", 1)[1].removesuffix(" --resume")) == bytes(out)


# A module that fails to import as torch does under TORCH_LOGS=help: its list of logs in a ValueError
TORCH_LOGS_HELP_LIKE = 'raise ValueError("\\nTORCH_LOGS Info\\n\\nExamples:\\n  TORCH_LOGS=\\"+dynamo,aot\\" ...\\n")\n'


@pytest.mark.parametrize("stdout", ["pipe", "full"])
def test_torch_logs_help_on_a_stdout_that_cannot_take_it_is_quiet_or_one_line(stdout, tmp_path, monkeypatch,
                                                                                capsys):
    # `TORCH_LOGS=help python train.py | head -3` ends quietly, as --help does; `> /dev/full` says so in one line
    (tmp_path / "logs_help_like.py").write_text(TORCH_LOGS_HELP_LIKE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TORCH_LOGS", "help")
    if stdout == "pipe":  # a pipe whose reader has gone
        read_end, write_end = os.pipe()
        os.close(read_end)
        out = open(write_end, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    else:
        out = open("/dev/full", "w", encoding="utf-8")  # noqa: SIM115 - closed below
    try:
        monkeypatch.setattr(sys, "stdout", out)
        status = start_or_status(("logs_help_like",), "interrupted ({})")
    finally:
        monkeypatch.undo()
        out.close()
    assert status == (1 if stdout == "full" else 0)
    said = capsys.readouterr().err
    assert said == ("error: cannot write to stdout (No space left on device)\n" if stdout == "full" else "")


def test_a_stop_that_an_import_wraps_while_the_compiler_is_readied_ends_the_run_in_one_line(tmp_path, capsys,
                                                                                            monkeypatch):
    """SIGTERM landing while prepare_compile imports inductor's lowering, whose kernel modules have jinja2 compile
    their templates: jinja2 reports the signal as a TemplateSyntaxError, inductor wraps that in its own, and the run
    ended in a traceback, status 1, where a stop says so in one line (sample.py met it in a CI run of the suite)."""

    class TemplateSyntaxError(Exception):
        pass

    def preparing() -> None:
        try:
            raise training.signals.Interrupted(signal.SIGTERM)
        except training.signals.Interrupted as e:
            raise TemplateSyntaxError("signal 15") from e

    monkeypatch.setattr(training.engine, "prepare_compile", preparing)
    out = tmp_path / "out"
    args = ["--config", TINY, *tiny_overrides(write_corpus(tmp_path), out, **{"train.compile": "true"})]
    code, stdout, err = call(train_main, args, capsys)
    assert code == 143 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "interrupted (SIGTERM) before training started; no checkpoint was saved"
    assert not (out / "ckpt.pt").exists()
