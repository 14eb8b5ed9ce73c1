"""What a long run relies on: exact resume after a signal, curves without gaps, checkpoints that survive kill -9 at
any moment, Ctrl-C and SIGTERM that stop with a saved state, divergence and a full disk stopped in one line, a table
of bad inputs refused in one line with out_dir left alone, and nothing loaded or parsed that could run code."""

from __future__ import annotations

import ast
import contextlib
import errno
import io
import itertools
import math
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, SMALL_TEXT, tiny_overrides
from test_checkpoint import WritesAFile
from test_train import bitwise_equal, child_env, logged_losses, one_error_line, snapshot, weights

import sample
import train
import training.checkpoints
import training.loop
import training.runner
from model import GPT, find_checkpoint, load_checkpoint, model_from_checkpoint
from training.checkpoints import save_checkpoint
from training.config import TrainConfig, load_config
from training.optim import lr_at
from training.signals import StopSignals

TINY = str(ROOT / "configs" / "tiny.yaml")
# As in test_train: a schedule that does not depend on max_iters, and dropout so that the torch RNG matters.
RESUME_KEYS = {"model.dropout": 0.1, "train.lr_decay_iters": 20, "train.log_interval": 1}
TEMPORARY = re.compile(r"^\.(ckpt\.pt|best\.pt|config\.yaml)\..+\.tmp$")


def write_corpus(folder: Path) -> Path:
    path = folder / "corpus.txt"
    path.write_text(SMALL_TEXT, encoding="utf-8")
    return path


def call(main: Callable[[list[str]], int], args: list[str], capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of an in-process main; argparse's own exits count as statuses too."""
    capsys.readouterr()
    try:
        code = main(args)
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def train_main(args: list[str]) -> int:
    return train.main(args, progress=False)


def temporary_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


# Scalars that measure speed, not the run: their values differ between any two runs, so only their steps compare.
TIMED = ("tokens_per_sec", "mfu")


def timeline(out_dir: Path) -> dict[str, list]:
    """Every TensorBoard series in out_dir as TensorBoard's own reader shows it, after it has hidden what a restart
    superseded: scalars as (step, value), everything else (text, images, hparams) as steps. Throughput is timing,
    so only its steps count."""
    from tensorboard.backend.event_processing import plugin_event_accumulator as tb
    from tensorboard.util.tensor_util import make_ndarray

    events = tb.EventAccumulator(str(out_dir), size_guidance={tb.TENSORS: 0})
    events.Reload()
    series: dict[str, list] = {}
    for tag in events.Tags()[tb.TENSORS]:
        points = events.Tensors(tag)
        if events.SummaryMetadata(tag).plugin_data.plugin_name == "scalars" and tag not in TIMED:
            series[tag] = [(e.step, make_ndarray(e.tensor_proto).item()) for e in points]
        else:
            series[tag] = [e.step for e in points]
    return series


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
    return (f"stopped at step {step}: saved {out / 'ckpt.pt'}; continue with: python train.py "
            f"--out-dir {shlex.quote(str(out))} --resume")


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, dict[int, str]]:
    """20 steps in one go (evaluations at 10 and 20, TensorBoard on), with its per-step losses."""
    base = tmp_path_factory.mktemp("straight")
    out = base / "out"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert train_main(["--config", TINY, *tiny_overrides(write_corpus(base), out, **RESUME_KEYS)]) == 0
    return out, logged_losses(stdout.getvalue())


def assert_continues_the_straight_run(out: Path, straight: tuple[Path, dict[int, str]]) -> None:
    """Final weights, optimizer state and every TensorBoard series are those of the uninterrupted run."""
    straight_out, _ = straight
    mine, theirs = load_checkpoint(out / "ckpt.pt"), load_checkpoint(straight_out / "ckpt.pt")
    assert mine["step"] == theirs["step"] == 20
    assert bitwise_equal(mine["model"], theirs["model"])
    for a, b in zip(mine["optimizer"]["state"].values(), theirs["optimizer"]["state"].values(), strict=True):
        assert bitwise_equal(a, b)
    assert torch.equal(mine["rng"]["batches"], theirs["rng"]["batches"])
    assert torch.equal(mine["rng"]["torch"], theirs["rng"]["torch"])
    # no gap where the run stopped, no step logged twice, the same values as the straight run
    assert timeline(out) == timeline(straight_out)


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


def test_resume_takes_changed_schedule_and_logging_keys_and_says_so(straight, tmp_path, capsys):
    out = Path(shutil.copytree(straight[0], tmp_path / "out"))
    changes = {"train.max_iters": 24, "train.eval_interval": 2, "train.eval_iters": 3, "train.log_interval": 4,
               "train.min_lr": 2e-4, "train.lr_decay_iters": 22, "train.sample_chars": 0}
    code, stdout, err = call(train_main, ["--resume", "--out-dir", str(out), *(f"{k}={v}" for k, v in changes.items())],
                             capsys)
    assert code == 0, err
    saved = load_config(str(straight[0] / "config.yaml"), [])
    for key, value in changes.items():
        assert f"resume: {key}: {getattr(saved.train, key.split('.')[1])!r} -> {value!r}" in stdout.splitlines()
    assert "resume: out_dir" not in stdout  # where the run lives now is no change to report
    new = load_config(str(out / "config.yaml"), [])
    assert new.train.max_iters == 24 and new.train.min_lr == 2e-4 and new.out_dir == str(out)
    raw = load_checkpoint(out / "ckpt.pt")
    assert raw["step"] == 24
    # the new schedule's end was used for the last step, the new eval_interval for when to save
    assert raw["optimizer"]["param_groups"][0]["lr"] == lr_at(23, new.train) == 2e-4
    assert sorted(logged_losses(stdout)) == [24]  # log_interval 4 from step 20


# ------------------------------------------------------------------------------------------ kill -9


def launch(args: list[str], log: Path) -> subprocess.Popen:
    """A real train.py whose stdout and stderr go to a file, read while it runs without ever blocking it."""
    with log.open("w") as f:
        return subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, env=child_env(), stdout=f,
                                stderr=subprocess.STDOUT)


def wait_for(log: Path, pattern: str, proc: subprocess.Popen, timeout: float = 60.0) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(encoding="utf-8"), re.MULTILINE)
        if found:
            return found
        assert proc.poll() is None, log.read_text(encoding="utf-8")
        time.sleep(0.005)
    proc.kill()
    raise AssertionError(f"no {pattern!r} in {timeout}s: {log.read_text(encoding='utf-8')}")


def check_after_a_crash(out: Path) -> int:
    """Whatever a killed run left: ckpt.pt and best.pt are whole (if there), nothing else passes for a checkpoint,
    and config.yaml is whole. Returns the step of ckpt.pt (0 if none)."""
    if not out.exists():
        return 0
    for path in out.iterdir():
        assert (path.name in ("ckpt.pt", "best.pt", "config.yaml") or path.name.startswith("events.out.tfevents.")
                or TEMPORARY.match(path.name)), path.name
    for name in ("ckpt.pt", "best.pt"):
        if (out / name).exists():
            _, vocab = model_from_checkpoint(load_checkpoint(out / name), out / name)
            assert vocab == sorted(set(SMALL_TEXT))
    if (out / "config.yaml").exists():
        assert isinstance(yaml.safe_load((out / "config.yaml").read_text(encoding="utf-8")), dict)
    return load_checkpoint(out / "ckpt.pt")["step"] if (out / "ckpt.pt").exists() else 0


KILL_KEYS = {**RESUME_KEYS, "train.max_iters": 120, "train.lr_decay_iters": 120, "train.eval_interval": 1,
             "train.eval_iters": 1, "train.log_interval": 50, "train.tensorboard": "false", "train.warmup_iters": 10}


@pytest.mark.slow
def test_kill_9_at_random_moments_never_breaks_a_checkpoint_and_the_run_ends_as_if_never_killed(tmp_path):
    """A checkpoint at every step (so saving is much of the time), killed again and again, resumed each time."""
    corpus = write_corpus(tmp_path)
    args = ["--config", TINY, *tiny_overrides(corpus, tmp_path / "killed", **KILL_KEYS)]
    rng = random.Random(20260501)
    out = tmp_path / "killed"
    steps, left_midway = [0], 0
    for attempt in range(10):
        resume = ["--resume"] if (out / "ckpt.pt").exists() else []
        log = tmp_path / f"log{attempt}.txt"
        proc = launch([*resume, *args], log)
        if attempt % 5 == 2:  # now and then anywhere in start-up: imports, reading the data, building the model
            time.sleep(rng.uniform(0.2, 1.2))
        else:  # otherwise while it trains: a step and a checkpoint take a few milliseconds each
            wait_for(log, r"^global batch: ", proc)  # printed just before the first step
            time.sleep(rng.uniform(0.03, 0.25))
        proc.kill()
        assert proc.wait(timeout=30) == -signal.SIGKILL
        steps.append(check_after_a_crash(out))
        assert steps[-1] >= steps[-2], steps  # never further back than the last checkpoint
        left_midway += bool(temporary_files(out)) if out.exists() else 0
    assert sum(b > a for a, b in itertools.pairwise(steps)) >= 5, steps  # most kills came while it trained

    proc = launch(["--resume", *args], tmp_path / "final.txt")
    assert proc.wait(timeout=120) == 0, (tmp_path / "final.txt").read_text(encoding="utf-8")
    assert temporary_files(out) == []  # the resumed run cleared what the kills left midway
    killed = load_checkpoint(out / "ckpt.pt")
    assert killed["step"] == 120

    # The same steps in one go: ten kills and resumes changed nothing.
    with contextlib.redirect_stdout(io.StringIO()):
        assert train_main(["--config", TINY, *tiny_overrides(corpus, tmp_path / "straight", **KILL_KEYS)]) == 0
    assert bitwise_equal(killed["model"], load_checkpoint(tmp_path / "straight" / "ckpt.pt")["model"])
    print(f"kill -9 after steps {steps[1:]}; {left_midway} kill(s) landed while a checkpoint was being written")


# Runs train.py with its checkpoint writer patched to SIGKILL the process at one chosen moment of one save.
KILL_WHILE_SAVING = """
import io, os, signal, sys
from pathlib import Path
import torch
sys.path.insert(0, os.getcwd())
import train

moment, at_step = sys.argv[1], int(sys.argv[2])
real_save, real_replace = torch.save, os.replace
saving = {}

def save(obj, f, *args, **kwargs):
    saving["step"] = obj.get("step")
    if moment == "mid-write" and saving["step"] == at_step:
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, f, *args, **kwargs)

def replace(src, dst):
    if moment == "before-rename" and Path(dst).name == "ckpt.pt" and saving.get("step") == at_step:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(src, dst)

torch.save, os.replace = save, replace
sys.exit(train.main(sys.argv[3:], progress=False))
"""


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["mid-write", "before-rename"])
def test_kill_9_while_writing_a_checkpoint_keeps_the_previous_one_and_resumes_exactly(straight, tmp_path, moment):
    out = tmp_path / "out"
    args = ["--config", TINY, *tiny_overrides(write_corpus(tmp_path), out, **RESUME_KEYS)]
    killed = subprocess.run([sys.executable, "-c", KILL_WHILE_SAVING, moment, "20", *args], cwd=ROOT,
                            env=child_env(), capture_output=True, text=True, timeout=120, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "step 20: train loss" in killed.stdout  # it died saving step 20, after the evaluation
    assert check_after_a_crash(out) == 10  # the previous checkpoint, whole
    assert load_checkpoint(out / "best.pt")["step"] == 10
    left = temporary_files(out)
    assert len(left) == 1 and left[0].startswith(".ckpt.pt.")  # the write that was cut short ...
    assert find_checkpoint(out) == out / "best.pt"  # ... is no checkpoint

    resumed = subprocess.run([sys.executable, "train.py", "--resume", "--out-dir", str(out)], cwd=ROOT,
                             env=child_env(), capture_output=True, text=True, timeout=120, check=False)
    assert resumed.returncode == 0, resumed.stderr
    assert temporary_files(out) == []
    assert logged_losses(resumed.stdout) == {s: straight[1][s] for s in range(11, 21)}
    assert_continues_the_straight_run(out, straight)


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
    assert one_line(err) == f"interrupted ({signal.Signals(signum).name}) before training started; nothing was saved"
    assert not out.exists()
    assert {sig: signal.getsignal(sig) for sig in StopSignals.SIGNALS} == handlers  # left as it found them


# ------------------------------------------------------------------------------------------ divergence


class InfiniteGradient(torch.autograd.Function):
    """The identity forward; backward sends an infinite gradient: a finite loss whose gradient norm is not."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * math.inf


@pytest.mark.parametrize(
    ("poison", "at_step"), [("loss", 13), ("gradient", 13), ("loss", 3)], ids=["nan-loss", "inf-gradient", "early"]
)
def test_a_non_finite_step_stops_the_run_before_the_update_and_keeps_the_last_checkpoint(
    tmp_path, capsys, monkeypatch, poison, at_step
):
    out = tmp_path / "out"
    real_forward = GPT.forward
    seen: dict = {"calls": 0}

    def forward(self, *args, **kwargs):
        result = real_forward(self, *args, **kwargs)
        if not self.training or result[1] is None:  # evaluation and sampling run in eval mode
            return result
        seen["calls"] += 1
        if seen["calls"] != at_step:
            return result
        seen["model"], seen["weights"] = self, {k: v.clone() for k, v in self.state_dict().items()}
        seen["files"] = snapshot(out)
        loss = result[1] * math.nan if poison == "loss" else InfiniteGradient.apply(result[1])
        return (result[0], loss, *result[2:])

    monkeypatch.setattr(GPT, "forward", forward)
    code, _, err = call(train_main, ["--config", TINY, *tiny_overrides(write_corpus(tmp_path), out)], capsys)
    assert code == 1
    line = one_line(err)
    assert f"training diverged at step {at_step} " in line
    if poison == "loss":
        assert "(loss nan, gradient norm nan)" in line
    else:  # a finite loss, whose gradients are not
        assert re.search(r"\(loss \d\.\d+, gradient norm (inf|nan)\)", line), line
    assert "train.learning_rate" in line  # what to try
    # the poisoned step never reached the weights, and nothing was saved after it
    assert bitwise_equal(seen["model"].state_dict(), seen["weights"])
    assert {k: v for k, v in snapshot(out).items() if k.endswith(".pt")} == {
        k: v for k, v in seen["files"].items() if k.endswith(".pt")}
    if at_step > 10:
        assert f"the last good checkpoint {out / 'ckpt.pt'} (step 10) is untouched" in line
        assert load_checkpoint(out / "ckpt.pt")["step"] == load_checkpoint(out / "best.pt")["step"] == 10
    else:
        assert "no checkpoint had been written yet" in line
        assert not (out / "ckpt.pt").exists()


# ------------------------------------------------------------------------------------------ a full disk


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES], ids=["disk-full", "not-writable"])
def test_a_save_that_fails_is_one_line_and_the_previous_checkpoint_stays_whole(tmp_path, capsys, monkeypatch, code):
    out = tmp_path / "out"
    real_save = torch.save
    before: dict = {}

    def save_failing_at_step_20(obj, f, *args, **kwargs):
        if obj.get("step") != 20:
            return real_save(obj, f, *args, **kwargs)
        before.update(snapshot(out))
        f.write(b"PK\x03\x04 the first bytes of a checkpoint")
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(torch, "save", save_failing_at_step_20)
    status, _, err = call(train_main, ["--config", TINY, *tiny_overrides(write_corpus(tmp_path), out)], capsys)
    assert status == 1
    line = one_line(err)
    assert f"cannot write a checkpoint into '{out}' ({os.strerror(code)})" in line and "intact" in line
    assert snapshot(out)["ckpt.pt"] == before["ckpt.pt"] and snapshot(out)["best.pt"] == before["best.pt"]
    assert check_after_a_crash(out) == 10
    assert temporary_files(out) == []


# ------------------------------------------------------------------------------------------ bad input


@dataclass
class Case:
    tmp: Path
    run: Path  # a copy of a finished run: --overwrite would replace it, so any early write would show
    corpus: Path

    def file(self, name: str, content: str | bytes) -> Path:
        path = self.tmp / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
        return path

    def train(self, *extra: str, config: str | Path = TINY, corpus: Path | None = None, **keys: object) -> list[str]:
        return ["--config", str(config), "--overwrite", *tiny_overrides(corpus or self.corpus, self.run, **keys),
                *extra]

    def yaml(self, text: str) -> list[str]:
        return self.train(config=self.file("run.yaml", text))

    def data(self, path: Path) -> list[str]:
        return self.train(corpus=path)

    def resume(self, change: Callable[[dict], None] | None = None, *extra: str) -> list[str]:
        if change is not None:
            payload = load_checkpoint(self.run / "ckpt.pt")
            change(payload)
            save_checkpoint({k: v for k, v in payload.items() if k not in ("format", "version")},
                            self.run / "ckpt.pt")
        return ["--resume", "--out-dir", str(self.run), *extra]

    def replace_checkpoint(self, write: Callable[[Path], object]) -> list[str]:
        write(self.run / "ckpt.pt")
        return ["--resume", "--out-dir", str(self.run)]

    def sample(self, *extra: str, checkpoint: Path | None = None) -> list[str]:
        where = ["--checkpoint", str(checkpoint)] if checkpoint else ["--out-dir", str(self.run)]
        return [*where, "--device", "cpu", "--max-new-tokens", "20", *extra]


def _latin1(c: Case) -> Path:
    return c.file("latin1.txt", ("Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e. " * 40).encode("latin-1"))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _shrink_vocab(payload: dict) -> None:
    payload["vocab"] = payload["vocab"][:-1]


def _weights_only(payload: dict) -> None:
    for key in ("optimizer", "config", "rng", "step", "best_val_loss", "scaler"):
        payload.pop(key)


def _foreign(path: Path) -> None:
    torch.save({"state_dict": {"weight": torch.zeros(2, 2)}, "epoch": 3}, path)


def _copy(path: Path, folder: Path, change: Callable[[Path], None]) -> Path:
    copy = Path(shutil.copy(path, folder / "copy.pt"))
    change(copy)
    return copy


def _unseen_vocab(c: Case) -> Path:
    """A copy of the run's checkpoint whose vocabulary and config agree with each other but not with the weights."""
    payload = load_checkpoint(c.run / "best.pt")
    payload["vocab"] = payload["vocab"][:-1]
    payload["model_config"] = {**payload["model_config"], "vocab_size": len(payload["vocab"])}
    path = c.tmp / "other_vocab.pt"
    save_checkpoint({k: v for k, v in payload.items() if k not in ("format", "version")}, path)
    return path


def _folder(c: Case, name: str = "a_folder") -> Path:
    (c.tmp / name).mkdir()
    return c.tmp / name


TEMPERATURE_ZERO = "temperature-0-is-greedy"  # the documented exception: not refused, it means greedy decoding

BAD_INPUTS: list[tuple[str, str, Callable[[Case], list[str]], str]] = [
    # id, program, arguments, a fragment of the one-line error
    # --- config files
    ("yaml-a-list", "train", lambda c: c.yaml("- data\n- model\n"), "must hold a mapping of sections"),
    ("yaml-a-number", "train", lambda c: c.yaml("42\n"), "must hold a mapping of sections"),
    ("yaml-python-tag", "train", lambda c: c.yaml(f"seed: !!python/object/apply:os.system ['touch {c.tmp}/pwned']\n"),
     "is not valid YAML"),
    ("yaml-python-object", "train", lambda c: c.yaml("train: !!python/object:collections.OrderedDict {}\n"),
     "could not determine a constructor for the tag"),
    ("yaml-syntax", "train", lambda c: c.yaml("model: [1, 2\n"), "is not valid YAML"),
    ("yaml-impossible-date", "train", lambda c: c.yaml("seed: 2024-13-45\n"), "month must be in 1..12"),
    ("yaml-unknown-section", "train", lambda c: c.yaml("optimiser:\n  lr: 0.1\n"), "unknown config key 'optimiser'"),
    ("yaml-unknown-key", "train", lambda c: c.yaml("train:\n  lr: 0.1\n"), "unknown config key 'train.lr'"),
    ("yaml-section-not-a-mapping", "train", lambda c: c.yaml("train: 5\n"), "section 'train'"),
    ("yaml-wrong-type", "train", lambda c: c.yaml("model:\n  n_layer: two\n"), "model.n_layer must be an integer"),
    ("config-missing", "train", lambda c: c.train(config=c.tmp / "nope.yaml"), "config file not found"),
    ("config-a-folder", "train", lambda c: c.train(config=_folder(c)), "is a directory"),
    ("config-binary", "train", lambda c: c.train(config=c.file("bin.yaml", b"\xff\xfe\x00\x01")),
     "cannot read config file"),
    # --- command-line overrides
    ("override-without-value", "train", lambda c: c.train("train.max_iters"), "must look like KEY=VALUE"),
    ("override-unknown-key", "train", lambda c: c.train("model.n_embed=32"), "did you mean 'model.n_embd'"),
    ("override-wrong-type", "train", lambda c: c.train(**{"train.compile": "maybe"}), "must be true/false"),
    ("override-negative-rate", "train", lambda c: c.train(**{"train.learning_rate": -0.1}), "finite number >= 0"),
    ("override-dropout-1", "train", lambda c: c.train(**{"model.dropout": 1.0}), "model.dropout must be in [0, 1)"),
    ("override-seed-too-big", "train", lambda c: c.train(seed=2**64), "seed must fit"),
    ("override-threads-absurd", "train", lambda c: c.train(**{"train.threads": 10**6}), "must be at most 4096"),
    ("n_embd-not-divisible-by-n_head", "train", lambda c: c.train(**{"model.n_embd": 30, "model.n_head": 4}),
     "must be divisible by model.n_head, got 30 and 4"),
    ("flags-contradict", "train", lambda c: c.train("--resume"), "contradict"),
    ("out_dir-under-a-file", "train",
     lambda c: c.train(f"out_dir={c.file('plain.txt', 'x')}/run"), "cannot write into out_dir"),
    # --- data files
    ("data-empty", "train", lambda c: c.data(c.file("empty.txt", "")), "is empty"),
    ("data-one-character", "train", lambda c: c.data(c.file("one.txt", "a")), "has 1 characters"),
    ("data-shorter-than-a-window", "train", lambda c: c.data(c.file("short.txt", "abcdefg")), "block_size + 1 = 9"),
    ("data-binary", "train", lambda c: c.data(c.file("noise.bin", bytes(range(256)) * 8)), "is a binary file"),
    ("data-latin-1", "train", lambda c: c.data(_latin1(c)), "is not UTF-8"),
    ("data-a-folder", "train", lambda c: c.data(_folder(c)), "is a folder"),
    ("data-missing", "train", lambda c: c.data(c.tmp / "corpus.tx"), "did you mean"),
    ("data-a-checkpoint", "train", lambda c: c.data(c.run / "best.pt"), "is a binary file"),
    ("data-nul-in-path", "train", lambda c: ["--overwrite", "--config", str(c.file("nul.yaml", f'out_dir: {c.run}\n'
     'data:\n  path: "a\\0b"\n'))], "not a usable path"),
    # --- checkpoints, resumed
    ("resume-truncated", "train", lambda c: c.replace_checkpoint(_truncate), "truncated or not a checkpoint"),
    ("resume-another-program", "train", lambda c: c.replace_checkpoint(_foreign), "not a tinychar checkpoint"),
    ("resume-vocab-not-the-weights", "train", lambda c: c.resume(_shrink_vocab), "is inconsistent"),
    ("resume-weights-only", "train", lambda c: c.resume(_weights_only), "holds weights only"),
    ("resume-lost-rng", "train", lambda c: c.resume(lambda p: p.pop("rng")), "lacks rng"),
    ("resume-changed-data", "train", lambda c: c.resume(None, "data.val_fraction=0.2"), "data.val_fraction"),
    ("resume-changed-model", "train", lambda c: c.resume(None, "model.dropout=0.3"), "model.dropout"),
    # --- prompts and sampling options
    ("prompt-unseen-characters", "sample", lambda c: c.sample("--prompt", "Zebra \u20ac"), "never saw"),
    ("prompt-empty", "sample", lambda c: c.sample("--prompt", ""), "prompt is empty"),
    ("prompt-file-latin-1", "sample", lambda c: c.sample("--prompt-file", str(_latin1(c))), "as UTF-8"),
    ("max-new-tokens-negative", "sample", lambda c: c.sample("--max-new-tokens", "-1"), "must be >= 0"),
    ("max-new-tokens-absurd", "sample", lambda c: c.sample("--max-new-tokens", str(10**15)), "at most"),
    (TEMPERATURE_ZERO, "sample", lambda c: c.sample("--prompt", "All:", "--temperature", "0"), ""),
    ("top-k-zero", "sample", lambda c: c.sample("--top-k", "0"), "--top-k must be >= 1"),
    ("top-p-above-one", "sample", lambda c: c.sample("--top-p", "1.5"), "--top-p must be in (0, 1]"),
    ("seed-too-big", "sample", lambda c: c.sample("--seed", str(2**64)), "--seed must fit"),
    # --- checkpoints, sampled
    ("checkpoint-truncated", "sample", lambda c: c.sample(checkpoint=_copy(c.run / "best.pt", c.tmp, _truncate)),
     "truncated or not a checkpoint"),
    ("checkpoint-another-program", "sample", lambda c: c.sample(checkpoint=_copy(c.run / "best.pt", c.tmp, _foreign)),
     "not a tinychar checkpoint"),
    ("checkpoint-vocab-not-the-weights", "sample", lambda c: c.sample(checkpoint=_unseen_vocab(c)),
     "weights do not match"),
    ("checkpoint-is-text", "sample", lambda c: c.sample(checkpoint=c.corpus), "not a file that torch.save wrote"),
    ("checkpoint-a-folder", "sample", lambda c: c.sample(checkpoint=_folder(c)), "is a directory"),
]


def test_the_bad_input_table_covers_what_it_promises():
    assert len(BAD_INPUTS) >= 30
    assert len({case[0] for case in BAD_INPUTS}) == len(BAD_INPUTS)
    assert {program for _, program, _, _ in BAD_INPUTS} == {"train", "sample"}


@pytest.mark.parametrize(("program", "make", "fragment"), [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_out_dir_is_left_as_it_was(
    straight, tmp_path, capsys, request, program, make, fragment
):
    run = Path(shutil.copytree(straight[0], tmp_path / "run"))
    case = Case(tmp=tmp_path, run=run, corpus=write_corpus(tmp_path))
    args = make(case)
    before = snapshot(run)
    code, out, err = call(train_main if program == "train" else sample.main, args, capsys)
    assert snapshot(run) == before  # not a byte written, not a file touched
    assert not (tmp_path / "pwned").exists()
    if request.node.callspec.id == TEMPERATURE_ZERO:
        assert code == 0, err
        assert out == greedy(run / "best.pt", "All:", 20) + "\n"
        return
    assert code == 2, err
    assert fragment in one_error_line(err)
    if program == "sample":
        assert out == ""


def greedy(path: Path, prompt: str, n: int) -> str:
    """The prompt and the n likeliest next characters, one at a time, computed here from the checkpoint."""
    model, vocab = model_from_checkpoint(load_checkpoint(path))
    model.eval()
    idx = torch.tensor([[vocab.index(c) for c in prompt]])
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(idx[:, -model.config.block_size :])
            idx = torch.cat([idx, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    return "".join(vocab[i] for i in idx[0].tolist())


def one_line(err: str) -> str:
    """The one line on stderr (an error or a stop)."""
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------------------------------ security


def unsafe_calls(source: str) -> list[str]:
    """Calls that could run code from a file: exec/eval/compile, yaml loaders other than safe_load, pickle loads,
    and torch.load without weights_only=True."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else None
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else None
        attr = func.attr if isinstance(func, ast.Attribute) else None
        safe_torch_load = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                              for k in node.keywords)
        if (name in ("exec", "eval", "compile", "__import__")
                or (owner == "yaml" and attr in ("load", "load_all", "unsafe_load", "full_load", "full_load_all"))
                or (owner in ("pickle", "dill", "marshal") and attr in ("load", "loads"))
                or (owner == "torch" and attr == "load" and not safe_torch_load)):
            found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_the_unsafe_call_finder_finds_what_it_looks_for():
    source = ("import torch, yaml, pickle\nexec('1')\neval('1')\nyaml.load(s)\npickle.loads(b)\ntorch.load(p)\n"
              "torch.load(p, weights_only=False)\nmodel.eval()\ntorch.load(p, weights_only=True)\nyaml.safe_load(s)\n")
    assert [f.split(":")[0] for f in unsafe_calls(source)] == [f"line {n}" for n in (2, 3, 4, 5, 6, 7)]


def test_no_source_file_loads_anything_in_a_way_that_could_run_code():
    skip = {"tests", ".git", ".ci-venv", ".venv", "venv", "runs", "out"}
    files = [p for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts[:-1])]
    assert {"train.py", "sample.py", "checkpoint.py", "__init__.py"} <= {p.name for p in files}
    found = {str(p.relative_to(ROOT)): calls for p in files if (calls := unsafe_calls(p.read_text(encoding="utf-8")))}
    assert found == {}
    # and the one place that loads checkpoints does so with weights_only=True
    assert "weights_only=True" in (ROOT / "model" / "checkpoint.py").read_text(encoding="utf-8")


@pytest.fixture
def booby_trapped(tmp_path) -> tuple[Path, Path]:
    """A checkpoint whose unpickling would create a marker file, shown to be live by loading it unsafely once."""
    marker = tmp_path / "marker"
    path = tmp_path / "run" / "ckpt.pt"
    path.parent.mkdir()
    payload = {"format": "tinychar-checkpoint", "model": WritesAFile(marker), "model_config": {}, "vocab": [],
               "optimizer": {}, "config": {}}
    torch.save(payload, path)
    torch.load(path, weights_only=False)["model"].close()  # the control: an unsafe load runs it
    assert marker.exists()
    marker.unlink()
    return path, marker


@pytest.mark.slow
@pytest.mark.parametrize("command", ["sample.py --checkpoint", "train.py --resume"])
def test_a_checkpoint_that_would_run_code_is_refused_by_the_real_commands(booby_trapped, command):
    path, marker = booby_trapped
    script, flag = command.split()
    args = [flag, str(path)] if script == "sample.py" else [flag, "--out-dir", str(path.parent)]
    before = snapshot(path.parent)
    result = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=child_env(), capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert "refusing to load" in one_error_line(result.stderr) and result.stdout == ""
    assert not marker.exists()
    assert snapshot(path.parent) == before
