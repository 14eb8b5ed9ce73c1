"""Helpers for the tests that run train.py, in this process or as a real process, and check what a run left behind:
shared by test_training_signals, test_training_checkpoints, test_training_loop and test_bad_input. The uninterrupted
run they compare with is conftest's `straight` fixture, trained by straight_run."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import yaml
from conftest import ROOT, SMALL_TEXT, tiny_overrides
from test_train import bitwise_equal, child_env, logged_losses

import train
from model import load_checkpoint, model_from_checkpoint

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


def straight_run(base: Path) -> tuple[Path, dict[int, str]]:
    """20 steps in one go (evaluations at 10 and 20, TensorBoard on) into base/out, with its per-step losses."""
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


def launch(args: list[str], log: Path) -> subprocess.Popen:
    """A real train.py whose stdout and stderr go to a file, read while it runs without ever blocking it."""
    with log.open("w", encoding="utf-8") as f:
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


def checkpoint_identity(out: Path) -> int | None:
    """The inode of out/ckpt.pt, or None: a save renames a new file into place, so a new checkpoint is a new inode."""
    try:
        return (out / "ckpt.pt").stat().st_ino
    except FileNotFoundError:
        return None


def wait_for_a_new_checkpoint(out: Path, before: int | None, log: Path, proc: subprocess.Popen,
                              timeout: float = 60.0) -> None:
    """Until the run has saved a checkpoint other than `before`: proof that it is training, however slow the machine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if checkpoint_identity(out) not in (None, before):
            return
        assert proc.poll() is None, log.read_text(encoding="utf-8")
        time.sleep(0.002)
    proc.kill()
    raise AssertionError(f"no new checkpoint in {timeout}s: {log.read_text(encoding='utf-8')}")


def check_after_a_crash(out: Path) -> int:
    """Whatever a killed run left: ckpt.pt and best.pt are whole (if there), nothing else passes for a checkpoint,
    and config.yaml is whole. Returns the step of ckpt.pt (0 if none)."""
    if not out.exists():
        return 0
    for path in out.iterdir():
        assert (path.name in ("ckpt.pt", "best.pt", "config.yaml", ".lock")
                or path.name.startswith("events.out.tfevents.")
                or TEMPORARY.match(path.name)), path.name
    for name in ("ckpt.pt", "best.pt"):
        if (out / name).exists():
            _, vocab = model_from_checkpoint(load_checkpoint(out / name), out / name)
            assert vocab == sorted(set(SMALL_TEXT))
    if (out / "config.yaml").exists():
        assert isinstance(yaml.safe_load((out / "config.yaml").read_text(encoding="utf-8")), dict)
    return load_checkpoint(out / "ckpt.pt")["step"] if (out / "ckpt.pt").exists() else 0


def one_line(err: str) -> str:
    """The one line on stderr (an error or a stop)."""
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]
