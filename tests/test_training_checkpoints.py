"""training/checkpoints.py: writing checkpoints atomically, so that kill -9 at any moment leaves the previous one whole
and the resumed run ends as if never killed; a save that fails is one line with the previous checkpoint intact; and a
resume takes changed schedule and logging keys and says so."""

from __future__ import annotations

import contextlib
import errno
import io
import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, tiny_overrides
from test_model_checkpoint import VOCAB, payload_for, tiny_model
from test_train import bitwise_equal, child_env, logged_losses, snapshot
from training_runs import (
    RESUME_KEYS,
    TINY,
    assert_continues_the_straight_run,
    call,
    check_after_a_crash,
    checkpoint_identity,
    launch,
    one_line,
    temporary_files,
    train_main,
    wait_for_a_new_checkpoint,
    write_corpus,
)

import training.checkpoints
import training.loop
from configs.errors import UsageError
from configs.userinput import shown
from data import CharTokenizer
from model import GPT, find_checkpoint, load_checkpoint
from training.checkpoints import save_checkpoint
from training.config import load_config
from training.launch import Launch
from training.optim import lr_at


def copy_of_straight(straight: tuple[Path, dict[int, str]], tmp_path: Path) -> Path:
    """A run for a test to change: a copy of conftest's straight run, in tmp_path/out. The tests that use it read its
    checkpoints or replace the run, whichever run it is; training one of their own took 0.3 s of CPU each."""
    return Path(shutil.copytree(straight[0], tmp_path / "out"))


@pytest.fixture
def saved(tmp_path) -> tuple[GPT, Path]:
    """As in test_model_checkpoint: a tiny model saved at step 7."""
    model = tiny_model()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(payload_for(model, step=7, best_val_loss=1.25), path)
    return model, path


# ------------------------------------------------------------------------------------------- atomic save


def test_saving_leaves_no_temporary_files(saved):
    _, path = saved
    save_checkpoint(payload_for(tiny_model(), step=8), path)  # over an existing file
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt.pt"]
    assert load_checkpoint(path)["step"] == 8


def test_a_save_that_fails_midway_keeps_the_old_file(saved, monkeypatch):
    _, path = saved
    before = path.read_bytes()

    def half_then_crash(obj, f, *args, **kwargs):
        f.write(before[: len(before) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", half_then_crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(payload_for(tiny_model(), step=99), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt.pt"]


def test_a_checkpoint_saved_with_copies_is_serialized_once_and_the_same_in_each_file(saved, monkeypatch):
    # ckpt.pt and best.pt when the validation loss improved: one torch.save (the tensors copied off a GPU once)
    _, path = saved
    calls = []
    real_save = torch.save

    def counted(obj, f, *args, **kwargs):
        calls.append(obj["step"])
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", counted)
    best = path.parent / "best.pt"
    save_checkpoint(payload_for(tiny_model(), step=9), path, best)
    assert calls == [9]
    assert path.read_bytes() == best.read_bytes()
    assert load_checkpoint(best)["step"] == 9
    assert sorted(p.name for p in path.parent.iterdir()) == ["best.pt", "ckpt.pt"]



def test_a_checkpoint_s_copy_is_not_held_in_memory(tmp_path):
    # best.pt's bytes serialized into memory were a second copy of the weights and the optimizer's state, which the
    # run's memory check does not count: a run that fitted ran out of memory at its first checkpoint
    import tracemalloc

    payload = payload_for(tiny_model(), step=9)
    payload["optimizer"] = {"state": {0: {"exp_avg": torch.zeros(2**21)}}}  # 8 MiB
    tracemalloc.start()
    try:
        save_checkpoint(payload, tmp_path / "ckpt.pt", tmp_path / "best.pt")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**21, peak
    assert (tmp_path / "ckpt.pt").read_bytes() == (tmp_path / "best.pt").read_bytes()


# ------------------------------------------------------------------------------------------ resume


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


def test_a_resume_steps_with_the_runs_own_optimizer_settings_not_the_checkpoints_copies(straight, tmp_path, capsys):
    # The groups' settings come from the config, which a resume may not change; torch took the checkpoint's copies,
    # and damaged ones were tracebacks at the first step (betas that are no numbers; a group taken for Muon's, a
    # KeyError) or silently another optimizer (eps of -1).
    out = Path(shutil.copytree(straight[0], tmp_path / "out"))
    payload = load_checkpoint(out / "ckpt.pt")
    own = [{k: v for k, v in g.items() if k != "params"} for g in payload["optimizer"]["param_groups"]]
    for group in payload["optimizer"]["param_groups"]:
        group.update(betas=(5.0, "x"), weight_decay="x", eps=-1.0, muon=True)
    save_checkpoint({k: v for k, v in payload.items() if k not in ("format", "version")}, out / "ckpt.pt")
    code, _, err = call(train_main, ["--resume", "--out-dir", str(out), "train.max_iters=21"], capsys)
    assert code == 0, err
    groups = load_checkpoint(out / "ckpt.pt")["optimizer"]["param_groups"]
    assert [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in groups] == [
        {k: v for k, v in g.items() if k != "lr"} for g in own]


INEXACT = "resume: the run goes on, no longer bit-identical to one that never stopped"


@pytest.fixture
def torch_threads():
    """The worker's torch threads, given back after a test whose in-process run set them."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_a_resume_naming_what_auto_came_to_goes_on_exactly_and_says_no_more(straight, tmp_path, capsys,
                                                                              torch_threads):
    # `train.dtype=float32` after a run of train.dtype=auto that came to float32 (and so threads, or train.device=cpu
    # after auto on a CPU) changes no sum: the resume said it went on "no longer bit-identical", and it went on bit
    # for bit.
    out = tmp_path / "out"
    first = tiny_overrides(write_corpus(tmp_path), out, **RESUME_KEYS, **{"train.max_iters": 10})
    assert call(train_main, ["--config", TINY, *first], capsys)[0] == 0
    assert load_checkpoint(out / "ckpt.pt")["settled"]["threads"] == str(torch_threads)
    same = ["train.dtype=float32", f"train.threads={torch_threads}"]
    code, stdout, err = call(train_main, ["--resume", "--out-dir", str(out), "train.max_iters=20", *same], capsys)
    assert code == 0, err
    assert {"resume: train.dtype: 'auto' -> 'float32'", f"resume: train.threads: 0 -> {torch_threads}"} <= set(
        stdout.splitlines())
    assert INEXACT not in stdout
    assert_continues_the_straight_run(out, straight)


def test_a_resume_whose_settled_setup_differs_says_what_differs(straight, tmp_path, capsys, torch_threads):
    out = Path(shutil.copytree(straight[0], tmp_path / "out"))
    payload = load_checkpoint(out / "ckpt.pt")
    settled = payload["settled"]
    assert settled["torch"] == torch.__version__ and settled["engine"] == "eager" and settled["dtype"] == "float32"
    assert settled["device"] == f"cpu ({torch.backends.cpu.get_cpu_capability()})"
    # as if saved by another torch, on a CPU of other vector instructions: the config alike, the sums not
    payload["settled"] = {**settled, "torch": "2.0.0", "device": "cpu (NO AVX)"}
    save_checkpoint({k: v for k, v in payload.items() if k not in ("format", "version")}, out / "ckpt.pt")
    code, stdout, err = call(train_main, ["--resume", "--out-dir", str(out), "train.max_iters=21"], capsys)
    assert code == 0, err
    assert (f"{INEXACT}: its setup differs from the saved run's (torch 2.0.0 -> {torch.__version__}; device cpu "
            f"(NO AVX) -> {settled['device']})") in stdout.splitlines()
    # a run on other threads says so too; the config's own change is its line, as before
    other = 1 if torch_threads != 1 else 2
    code, stdout, err = call(train_main, ["--resume", "--out-dir", str(out), "train.max_iters=22",
                                          f"train.threads={other}"], capsys)
    assert code == 0, err
    assert f"resume: train.threads: 0 -> {other}" in stdout.splitlines()
    assert f"{INEXACT}: its setup differs from the saved run's (threads {torch_threads} -> {other})" in stdout


def test_a_checkpoint_from_before_the_settled_record_is_judged_by_its_config(straight, tmp_path, capsys,
                                                                             torch_threads):
    out = Path(shutil.copytree(straight[0], tmp_path / "out"))
    payload = load_checkpoint(out / "ckpt.pt")
    del payload["settled"]
    save_checkpoint({k: v for k, v in payload.items() if k not in ("format", "version")}, out / "ckpt.pt")
    code, stdout, err = call(train_main, ["--resume", "--out-dir", str(out), "train.max_iters=21",
                                          f"train.threads={torch_threads}"], capsys)
    assert code == 0, err
    # not known to be what the saved run's 0 (all the cores) came to: said as it always was
    assert f"{INEXACT}: its setup differs from the saved run's (train.threads 0 -> {torch_threads})" in stdout
    code, stdout, err = call(train_main, ["--resume", "--out-dir", str(out), "train.max_iters=22"], capsys)
    assert code == 0, err
    assert INEXACT not in stdout  # the saved run's setup, recorded now: nothing differs


# ------------------------------------------------------------------------------------------ kill -9


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
    for attempt in range(5):
        resume = ["--resume"] if (out / "ckpt.pt").exists() else []
        log = tmp_path / f"log{attempt}.txt"
        before = checkpoint_identity(out)
        proc = launch([*resume, *args], log)
        if attempt % 5 == 2:  # now and then anywhere in start-up: imports, reading the data, building the model
            time.sleep(rng.uniform(0.2, 1.2))
        else:  # otherwise while it trains: a step and a checkpoint take a few milliseconds each
            # after its first save, not a fixed time after start-up, which a loaded machine may not have finished
            wait_for_a_new_checkpoint(out, before, log, proc)
            time.sleep(rng.uniform(0.0, 0.2))
        proc.kill()
        assert proc.wait(timeout=30) == -signal.SIGKILL
        steps.append(check_after_a_crash(out))
        assert steps[-1] >= steps[-2], steps  # never further back than the last checkpoint
        left_midway += bool(temporary_files(out)) if out.exists() else 0
    assert sum(b > a for a, b in itertools.pairwise(steps)) >= 3, steps  # most kills came while it trained

    proc = launch(["--resume", *args], tmp_path / "final.txt")
    code, final = proc.wait(timeout=120), (tmp_path / "final.txt").read_text(encoding="utf-8")
    if steps[-1] == KILL_KEYS["train.max_iters"]:
        # the last kill came after the run's last save, as it ended (a fast machine trains the 120 steps in under
        # a second): resumed, the finished run says so and changes nothing
        assert code == 2 and "the run is done" in final, final
    else:
        assert code == 0, final
        assert temporary_files(out) == []  # the resumed run cleared what the kills left midway
    killed = load_checkpoint(out / "ckpt.pt")
    assert killed["step"] == 120

    # The same steps in one go: five kills and resumes changed nothing. Evaluating and saving change nothing the steps
    # use (the weights came out bit for bit the same either way), so the run in one go evaluates and saves once, at its
    # end, not at every step: 0.6 s of CPU against 2.3 s (2026-12-05, 2-core AMD EPYC (Zen 3, AVX2)).
    with contextlib.redirect_stdout(io.StringIO()):
        assert train_main(["--config", TINY, *tiny_overrides(corpus, tmp_path / "straight",
                                                              **{**KILL_KEYS, "train.eval_interval": 120})]) == 0
    assert bitwise_equal(killed["model"], load_checkpoint(tmp_path / "straight" / "ckpt.pt")["model"])
    print(f"kill -9 after steps {steps[1:]}; {left_midway} kill(s) landed while a checkpoint was being written")


# Runs train.py with its checkpoint writer patched to SIGKILL the process at one chosen moment of one save.
KILL_WHILE_SAVING = """
import io, os, signal, sys
from pathlib import Path
import torch
sys.path.insert(0, os.getcwd())
import train
import training.checkpoints as checkpoints

moment, at_step = sys.argv[1], int(sys.argv[2])
real_save, real_replace, real_write_atomic = torch.save, os.replace, checkpoints.write_atomic
saving = {}

def save(obj, f, *args, **kwargs):
    saving["step"] = obj.get("step")
    return real_save(obj, f, *args, **kwargs)

def write_atomic(path, write):
    # each file's bytes made as the saver makes them, then written; at the step, half of them, then the kill
    def written(f):
        buffer = io.BytesIO()
        write(buffer)
        data = buffer.getvalue()
        if moment == "mid-write" and Path(path).name == "ckpt.pt" and saving.get("step") == at_step:
            f.write(data[: len(data) // 2])
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        f.write(data)
    return real_write_atomic(path, written)

def replace(src, dst):
    if moment == "before-rename" and Path(dst).name == "ckpt.pt" and saving.get("step") == at_step:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(src, dst)

checkpoints.write_atomic = write_atomic
torch.save, os.replace = save, replace
sys.exit(train.main(sys.argv[3:], progress=False))
"""


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["mid-write", "before-rename"])
def test_kill_9_while_writing_a_checkpoint_keeps_the_previous_one_and_resumes_exactly(straight, tmp_path, capsys,
                                                                                     moment):
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

    # the resume in this process, as the straight run was: what the kill left is the subject, not the resume's process
    # (a train.py of its own cost 0.6 s more CPU)
    code, stdout, err = call(train_main, ["--resume", "--out-dir", str(out)], capsys)
    assert code == 0, err
    assert temporary_files(out) == []
    assert logged_losses(stdout) == {s: straight[1][s] for s in range(11, 21)}
    assert_continues_the_straight_run(out, straight)


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
    assert line == (f"error: cannot write a checkpoint into '{shown(out)}' ({os.strerror(code)}); ckpt.pt (step 10) "
                    f"and best.pt there are intact. Free some space or choose another out_dir")
    assert snapshot(out)["ckpt.pt"] == before["ckpt.pt"] and snapshot(out)["best.pt"] == before["best.pt"]
    assert check_after_a_crash(out) == 10
    assert temporary_files(out) == []


@pytest.mark.parametrize("overwrite", [False, True], ids=["new-run", "overwrite"])
def test_a_best_pt_that_cannot_be_written_is_named_and_the_line_says_what_out_dir_holds(tmp_path, capsys, monkeypatch,
                                                                                        straight, overwrite):
    """ckpt.pt is written before best.pt: when best.pt fails, ckpt.pt is already this step's, and the line says so;
    an --overwrite whose first save fails so keeps nothing of itself and gives the old run back."""
    out = copy_of_straight(straight, tmp_path) if overwrite else tmp_path / "out"
    before = snapshot(out) if overwrite else {}
    real_write = training.checkpoints.write_atomic

    def full_at_best_pt(path, write):
        if Path(path).name == "best.pt":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(path, write)

    monkeypatch.setattr(training.checkpoints, "write_atomic", full_at_best_pt)
    args = ["--config", TINY, *(["--overwrite"] if overwrite else []), *tiny_overrides(write_corpus(tmp_path), out)]
    status, _, err = call(train_main, args, capsys)
    assert status == 1
    if overwrite:
        assert one_line(err) == (f"error: cannot write a checkpoint into '{shown(out)}' (No space left on device); "
                                 f"nothing of this --overwrite run is kept, and the run it was replacing is back. Free "
                                 f"some space or choose another out_dir")
        assert {k: v[0] for k, v in snapshot(out).items()} == {k: v[0] for k, v in before.items()}
    else:
        assert one_line(err) == (f"error: cannot write best.pt into '{shown(out)}' (No space left on device); ckpt.pt "
                                 f"there holds step 10, the best, and there is no best.pt (--resume copies ckpt.pt "
                                 f"into it). Free some space or choose another out_dir")
        assert load_checkpoint(out / "ckpt.pt")["step"] == 10 and not (out / "best.pt").exists()
        # the space is back: the resume puts step 10, the best, into best.pt before training on
        monkeypatch.undo()
        saved = snapshot(out)["ckpt.pt"]
        repaired: list[bytes] = []
        real_fit = training.loop.Trainer.fit
        monkeypatch.setattr(training.loop.Trainer, "fit",
                            lambda self: repaired.append((out / "best.pt").read_bytes()) or real_fit(self))
        status, stdout, err = call(train_main, ["--resume", "--out-dir", str(out)], capsys)
        assert status == 0, err
        assert repaired == [saved[0]]  # best.pt as fit() found it: step 10's checkpoint
        assert "best.pt: step 10's weights, the best, copied from ckpt.pt" in stdout + err


def test_a_best_pt_that_holds_its_checkpoint_is_left_alone(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    payload = {"step": 10, "is_best": True}
    for name in ("ckpt.pt", "best.pt"):
        (out / name).write_bytes(b"the same bytes")
    inode = (out / "best.pt").stat().st_ino  # a write replaces the file (write_atomic): a new inode
    assert training.checkpoints.restore_best(out, payload) is None
    assert training.checkpoints.restore_best(out, {**payload, "is_best": False}) is None
    assert (out / "best.pt").stat().st_ino == inode
    (out / "best.pt").write_bytes(b"an earlier best")
    assert training.checkpoints.restore_best(out, {**payload, "is_best": False}) is None  # step 10 was not the best
    assert (out / "best.pt").read_bytes() == b"an earlier best"

    def disk_full(path, write):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(training.checkpoints, "write_atomic", disk_full)
    assert training.checkpoints.restore_best(out, payload) == (
        "best.pt: cannot copy step 10's weights, the best, from ckpt.pt into it (No space left on device); it holds "
        "an earlier best, or is missing")
    monkeypatch.undo()
    assert "copied from ckpt.pt" in training.checkpoints.restore_best(out, payload)
    assert (out / "best.pt").read_bytes() == b"the same bytes"


def test_a_best_pt_of_a_later_step_than_a_checkpoint_copied_back_is_kept(straight, tmp_path):
    """An older ckpt.pt (the best at its step) copied back over the newer one, to go on from there: the resume copied
    it over the newer, better best.pt, saying "the save that wrote ckpt.pt could not write best.pt"."""
    run = copy_of_straight(straight, tmp_path)
    payload = load_checkpoint(run / "ckpt.pt")
    later = {**payload, "step": payload["step"] + 20}
    torch.save(later, run / "best.pt")
    kept = (run / "best.pt").read_bytes()
    assert training.checkpoints.restore_best(run, {**payload, "is_best": True}) is None
    assert (run / "best.pt").read_bytes() == kept
    torch.save({**payload, "step": payload["step"] - 10}, run / "best.pt")  # an earlier best: the failed save's case
    assert "copied from ckpt.pt" in training.checkpoints.restore_best(run, {**payload, "is_best": True})
    assert (run / "best.pt").read_bytes() == (run / "ckpt.pt").read_bytes()


def test_a_best_pt_that_is_whole_but_unreadable_here_is_kept(straight, tmp_path, monkeypatch):
    """A best.pt that this process cannot load though it is whole (a later tinychar's format; too little memory left
    to load it beside the resumed checkpoint) read as "no checkpoint", and the resume copied its older ckpt.pt over
    it."""
    import model.checkpoint
    from model.checkpoint import NoMemoryToLoad

    run = copy_of_straight(straight, tmp_path)
    payload = load_checkpoint(run / "ckpt.pt")
    later = {k: v for k, v in payload.items() if k != "format"}
    torch.save({"format": "tinychar-checkpoint", **later, "version": 99}, run / "best.pt")
    kept = (run / "best.pt").read_bytes()
    assert training.checkpoints.restore_best(run, {**payload, "is_best": True}) is None
    assert (run / "best.pt").read_bytes() == kept
    torch.save({**payload, "step": payload["step"] - 10}, run / "best.pt")  # an earlier best, whole and readable
    kept = (run / "best.pt").read_bytes()
    real = model.checkpoint.load_checkpoint
    monkeypatch.setattr(model.checkpoint, "load_checkpoint", lambda path, *a, **k: (_ for _ in ()).throw(
        NoMemoryToLoad("out of memory")) if Path(path).name == "best.pt" else real(path, *a, **k))
    assert training.checkpoints.restore_best(run, {**payload, "is_best": True}) is None  # not known to be older
    assert (run / "best.pt").read_bytes() == kept
    monkeypatch.undo()
    assert "copied from ckpt.pt" in training.checkpoints.restore_best(run, {**payload, "is_best": True})


def unreadable(monkeypatch: pytest.MonkeyPatch, *paths: Path) -> None:
    """Opening these files fails as `chmod 000` makes it fail for a user without root's override (the tests may run
    as root, whom permissions do not stop)."""
    import builtins

    real, refused = builtins.open, {p.resolve() for p in paths}

    def guarded(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and Path(file).resolve() in refused:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded)


def test_checkpoints_this_user_may_not_read_are_not_called_damaged(straight, tmp_path, monkeypatch, capsys):
    """ckpt.pt made unreadable was "truncated or not a checkpoint", with the advice to copy best.pt over it, which
    throws away every step since the best; an unreadable best.pt stopped a resume with "give another path" (a
    traceback's OSError, said in one line) once the resume had rewritten config.yaml."""
    from model.checkpoint import Unreadable
    from model.runs import quoted

    run = copy_of_straight(straight, tmp_path)
    saved = {p.name: p.read_bytes() for p in run.iterdir() if p.suffix == ".pt"}
    unreadable(monkeypatch, run / "ckpt.pt")
    with pytest.raises(Unreadable) as e:
        load_checkpoint(run / "ckpt.pt")
    assert str(e.value) == (f"cannot read checkpoint {quoted(run / 'ckpt.pt')} (Permission denied); check that this "
                            f"user may read it")
    status, _, err = call(train_main, ["--resume", "--out-dir", str(run), "train.max_iters=30"], capsys)
    assert status == 2 and err == f"error: {e.value}\n"  # no advice to replace it
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.suffix == ".pt"} == saved

    monkeypatch.undo()
    payload = load_checkpoint(run / "ckpt.pt")
    unreadable(monkeypatch, run / "best.pt")
    assert training.checkpoints.restore_best(run, {**payload, "is_best": True}) == (
        f"best.pt: cannot read it (Permission denied) to check that it holds step {payload['step']}, the best; left "
        f"as it is")
    monkeypatch.undo()
    assert (run / "best.pt").read_bytes() == saved["best.pt"]


def test_a_run_folder_moved_or_copied_resumes_where_it_is_now(tmp_path, monkeypatch, capsys):
    """A plain --resume of a run copied into runs/tiny took its out_dir from the saved config: it made the old
    folder again, locked it and said the run had been "replaced by another run while this one was starting"."""
    from conftest import train_small_run

    run = train_small_run(tmp_path)
    work = tmp_path / "work"
    shutil.copytree(run, work / "runs" / "tiny")
    run.rename(tmp_path / "moved")
    monkeypatch.chdir(work)
    status, _, err = call(train_main, ["--resume", "train.max_iters=30"], capsys)
    assert status == 0, err
    assert not run.exists()  # nothing made where the run was
    assert load_checkpoint(work / "runs" / "tiny" / "ckpt.pt")["step"] == 30
    assert "out_dir: runs/tiny\n" in (work / "runs" / "tiny" / "config.yaml").read_text(encoding="utf-8")


def test_a_lock_this_user_may_not_open_is_said_to_be_the_lock(tmp_path, monkeypatch):
    from training.lock import RunLock

    (tmp_path / ".lock").write_text("")
    real = os.open

    def refused(path, *args, **kwargs):
        if Path(path).name == ".lock":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refused)
    for attempt in (RunLock(tmp_path).busy, RunLock(tmp_path).acquire):
        with pytest.raises(UsageError) as e:
            attempt()
        assert str(e.value) == (f"cannot open '{shown(str(tmp_path / '.lock'))}' (Permission denied), the lock that "
                                f"keeps two runs out of one folder; let this user read and write it, or choose another "
                                f"out_dir")


def test_a_resume_on_text_that_changed_since_the_checkpoint_is_refused(tmp_path, capsys):
    from conftest import train_small_run

    run = train_small_run(tmp_path)
    corpus = tmp_path / "corpus.txt"
    assert load_checkpoint(run / "ckpt.pt")["data_fingerprint"]
    text = corpus.read_text(encoding="utf-8")
    corpus.write_text(text.replace("Citizen", "Citizan"), encoding="utf-8")  # same path, same characters
    refused_as_other_text(run, corpus, capsys)
    corpus.write_text(text, encoding="utf-8")  # the same text again: the run goes on
    assert call(train_main, ["--resume", "--out-dir", str(run), "train.max_iters=30"], capsys)[0] == 0


def refused_as_other_text(run: Path, corpus: Path, capsys: pytest.CaptureFixture) -> None:
    """The resume of run on corpus is refused in one line as not its text, and nothing in run changes."""
    before = snapshot(run)
    code, _, err = call(train_main, ["--resume", "--out-dir", str(run), "train.max_iters=30"], capsys)
    assert code == 2
    assert err.strip() == (f"error: cannot resume: the text of data.path '{shown(corpus)}' is not the text this run "
                           f"was trained on (it changed since '{shown(run / 'ckpt.pt')}' was saved); resume with that "
                           f"text, or start a new run in another out_dir")
    assert snapshot(run) == before


@pytest.mark.parametrize("kept", [60, 5])
def test_a_resume_on_text_cut_too_short_to_split_is_told_it_is_other_text(tmp_path, capsys, kept):
    """It was told to change data.val_fraction (60 characters: too few to split) or model.block_size (5: not one
    window), which the resume then refused: the text is compared with the run's first."""
    from conftest import train_small_run

    run = train_small_run(tmp_path)
    corpus = tmp_path / "corpus.txt"
    text = corpus.read_text(encoding="utf-8")
    corpus.write_text(text[:kept], encoding="utf-8")
    refused_as_other_text(run, corpus, capsys)


def test_weights_that_do_not_fit_the_resumed_run_are_refused_with_the_reason():
    """torch's first line says only "Error(s) in loading state_dict"; the line keeps the reason after it."""
    from model import CheckpointError, GPTConfig
    from training.checkpoints import restore_training_state

    model = GPT(GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=16))
    optimizer = torch.optim.AdamW(model.parameters())
    weights = model.state_dict()
    weights.pop("transformer.ln_f.weight")
    payload = {"model": weights, "optimizer": optimizer.state_dict(), "step": 3, "best_val_loss": 2.0}
    with pytest.raises(CheckpointError) as info:
        restore_training_state(payload, model, optimizer, None, Path("runs/x/ckpt.pt"))
    message = str(info.value)
    assert message.startswith("'runs/x/ckpt.pt' does not fit the run it describes (Missing key(s) in state_dict: ")
    assert '"transformer.ln_f.weight"' in message and "\n" not in message


def test_a_one_process_resume_restores_the_gpus_this_machine_has_and_the_apple_gpus_state(monkeypatch, tmp_path):
    """A checkpoint saved where there were two GPUs resumes where there is one: torch.cuda.set_rng_state_all would
    ask for the second GPU and the resume would call the checkpoint damaged. The Apple GPU's state (dropout on mps)
    is saved and restored as CUDA's is. No GPU is needed: torch's device calls are faked."""
    cuda_set, mps_state = {}, {"now": torch.tensor([1], dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.tensor([10]), torch.tensor([11])])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, index: cuda_set.update({index: int(state)}))
    monkeypatch.setattr(training.checkpoints, "mps_available", lambda: True)
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda: mps_state["now"].clone())
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda state: mps_state.update(now=state.clone()))
    model, tokenizer = tiny_model(), CharTokenizer(VOCAB)
    cfg = load_config(None, ["data.path=x.txt"])
    optimizer = torch.optim.AdamW(model.parameters())
    gen = torch.Generator().manual_seed(1)
    payload = training.checkpoints.checkpoint_payload(model, optimizer, None, tokenizer, cfg, 5, 2.0, gen)
    assert [int(s) for s in payload["rng"]["cuda"]] == [10, 11]
    assert torch.equal(payload["rng"]["mps"], torch.tensor([1], dtype=torch.uint8))
    mps_state["now"] = torch.tensor([9], dtype=torch.uint8)  # dropout on the Apple GPU moved it since
    assert training.checkpoints.restore_rng(payload, gen, Launch(), torch.device("cuda", 0), cfg.seed,
                                            tmp_path / "ckpt.pt")
    assert cuda_set == {0: 10}
    assert torch.equal(mps_state["now"], torch.tensor([1], dtype=torch.uint8))


@pytest.mark.parametrize("other", ["another model", "another text", "another seed"])
def test_a_ckpt_pt_copied_in_from_another_run_is_refused_before_best_pt_is_touched(tmp_path, capsys, other):
    """A resume on another run's ckpt.pt copied into a folder copied it over the folder's best.pt at once, saying
    that "the save that wrote ckpt.pt could not write best.pt", and trained the other run on."""
    from conftest import train_small_run

    import train

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    run = train_small_run(tmp_path / "a")
    if other == "another model":
        donor = train_small_run(tmp_path / "b", **{"model.n_layer": 1})
    elif other == "another seed":  # the same model and text: a sweep's sibling, whose best.pt was replaced silently
        donor = train_small_run(tmp_path / "b", seed=7)
    else:  # the same model and characters, another text
        corpus = tmp_path / "b" / "corpus.txt"
        corpus.write_text("".join(reversed((tmp_path / "a" / "corpus.txt").read_text(encoding="utf-8"))),
                          encoding="utf-8")
        donor = tmp_path / "b" / "out"
        assert train.main(["--config", str(ROOT / "configs" / "tiny.yaml"), *tiny_overrides(corpus, donor)],
                          progress=False) == 0
    shutil.copyfile(donor / "ckpt.pt", run / "ckpt.pt")
    kept = {name: (run / name).read_bytes() for name in ("best.pt", "config.yaml")}
    capsys.readouterr()
    assert train.main(["--resume", "--out-dir", str(run), "train.max_iters=30"], progress=False) == 2
    seed = load_checkpoint(run / "best.pt")["config"]["seed"]
    why = {"another model": "model.n_layer is 2 in best.pt, 1 in ckpt.pt", "another text": "trained on two texts",
           "another seed": f"seed is {seed} in best.pt, 7 in ckpt.pt"}[other]
    assert capsys.readouterr().err == (
        f"error: '{shown(str(run / 'ckpt.pt'))}' and the best.pt beside it are checkpoints of two runs ({why}): a "
        f"ckpt.pt copied in from another run? Resuming would write over best.pt; move one of them out of "
        f"'{shown(str(run))}', or give the other run a folder of its own\n")
    assert {name: (run / name).read_bytes() for name in kept} == kept
    shutil.copyfile(run / "best.pt", run / "ckpt.pt")  # the run's own checkpoint (its best) resumes as ever
    assert train.main(["--resume", "--out-dir", str(run), "train.max_iters=30"], progress=False) == 0


def test_a_later_best_pt_is_kept_through_the_evaluations_of_an_older_ckpt_pt_copied_back(tmp_path):
    """restore_best kept it, but the run judged each evaluation against the older ckpt.pt's best loss, and its first
    evaluation wrote a worse step over the later, better best.pt."""
    from conftest import train_small_run

    import train

    run = train_small_run(tmp_path, **{"train.max_iters": 10})
    older = (run / "ckpt.pt").read_bytes()
    assert train.main(["--resume", "--out-dir", str(run), "train.max_iters=40"], progress=False) == 0
    best = load_checkpoint(run / "best.pt")
    assert best["step"] > 20  # the setup: the run's best came after step 20, where the copied-back run will be
    kept = (run / "best.pt").read_bytes()
    (run / "ckpt.pt").write_bytes(older)
    assert train.main(["--resume", "--out-dir", str(run), "train.max_iters=20"], progress=False) == 0
    assert (run / "best.pt").read_bytes() == kept
    assert load_checkpoint(run / "ckpt.pt")["best_val_loss"] == best["best_val_loss"]


def test_a_best_pt_whose_step_is_no_number_does_not_stop_a_resume_with_a_traceback(tmp_path, capsys):
    """best.pt's step and loss were compared unchecked with the resumed checkpoint's: a step that is a string was a
    TypeError traceback. Damaged so, best.pt is not known to be later: the run goes on, and mends it as its best."""
    from conftest import train_small_run

    run = train_small_run(tmp_path, **{"train.max_iters": 10})
    payload = load_checkpoint(run / "best.pt")
    torch.save({**payload, "step": "later", "best_val_loss": 0.5}, run / "best.pt")
    code, _, err = call(train_main, ["--resume", "--out-dir", str(run), "train.max_iters=20"], capsys)
    assert code == 0, err
    assert load_checkpoint(run / "best.pt")["step"] in (10, 20)
