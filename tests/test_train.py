"""train.py end to end: what a run leaves in out_dir, refusing to clobber a run, exact resume, bad input in one
line, --help, and the learning-rate schedule a run used (the schedule itself: test_training_optim)."""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from conftest import ROOT, SMALL_TEXT, refused_with_imports, tiny_overrides, train_small_run

import train
import training.checkpoints
from configs import describe, to_dict, valid_keys
from configs.userinput import path_word, shown
from data.batches import split_ids
from data.paths import quoted
from model import GPT, GPTConfig, load_checkpoint, model_from_checkpoint
from training.config import RunConfig, load_config
from training.optim import lr_at, schedule_note

TINY = str(ROOT / "configs" / "tiny.yaml")
TAGS = ("loss/train", "loss/val", "lr", "grad_norm", "tokens_per_sec", "mfu")


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    # train.py's default config is configs/tiny.yaml relative to the working folder, as for a person at the prompt
    monkeypatch.chdir(ROOT)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 20-step run, trained once for the module; tests that change it work on a copy."""
    return train_small_run(tmp_path_factory.mktemp("finished"))


def child_env() -> dict[str, str]:
    """The environment for a real train.py (the session's cache folder and all), on one thread as in this process."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def copy_run(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "out"))


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err
    return lines[0]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path)["model"]


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def logged_losses(stdout: str) -> dict[int, str]:
    """Per-step training losses from the plain progress lines: 'step 7/20: loss 3.4132, ...'."""
    return {int(m[1]): m[2] for m in re.finditer(r"^step (\d+)/\d+: loss ([0-9.]+)", stdout, re.MULTILINE)}


def read_events(out_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out_dir))
    events.Reload()
    return events


# ------------------------------------------------------------------------------------------ a real run


def test_names_whose_bytes_are_not_utf8_train_or_are_one_line(small_corpus, tmp_path):
    """A Latin-1 file name (caf\\xe9: Python holds the byte as "\\udce9"), a valid name on Linux. As data.path it was
    a traceback at TensorBoard's hyperparameters, which write only UTF-8; as out_dir a traceback at TensorBoard's
    writer, with the folder made and config.yaml in it. Now the text trains, its name logged as the shell shows it,
    and such an out_dir is one line before anything is made, unless the run writes no TensorBoard logs."""
    latin1 = os.fsdecode(b"caf\xe9")
    corpus = tmp_path / f"{latin1}.txt"
    shutil.copyfile(small_corpus, corpus)

    def train_py(*overrides: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "train.py", *overrides], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, check=False, env=child_env())

    done = train_py(*tiny_overrides(corpus, tmp_path / "run", **{"train.max_iters": 5}))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    (events,) = (tmp_path / "run").glob("events.out.tfevents.*")
    assert b"caf\\xe9.txt" in events.read_bytes()  # data.path among the hyperparameters

    folder = tmp_path / latin1
    done = train_py(*tiny_overrides(small_corpus, folder, **{"train.max_iters": 5}))
    line = one_error_line(done.stderr)
    assert done.returncode == 2 and line.startswith("error: out_dir '") and (
        "/caf\\xe9' is not UTF-8, which TensorBoard needs; choose another, or set train.tensorboard=false (command "
        "line: 'out_dir=") in line
    assert not folder.exists()
    done = train_py(*tiny_overrides(small_corpus, folder, **{"train.max_iters": 5, "train.tensorboard": "false"}))
    assert done.returncode == 0 and (folder / "best.pt").is_file(), done.stderr


@pytest.mark.slow
def test_a_real_run_writes_checkpoints_config_and_tensorboard_logs(small_corpus, tmp_path):
    out = tmp_path / "run"
    overrides = tiny_overrides(small_corpus, out)
    result = subprocess.run(
        [sys.executable, "train.py", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=child_env(),
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "done: step 20" in result.stdout
    for name in ("ckpt.pt", "best.pt", "config.yaml"):
        assert (out / name).is_file(), name
    assert list(out.glob("events.out.tfevents.*"))

    # config.yaml is the resolved config: loading it gives exactly what the command line asked for
    cfg = load_config(None, overrides)
    assert load_config(str(out / "config.yaml"), []) == cfg

    events = read_events(out)
    scalars = events.Tags()["scalars"]
    assert set(TAGS) <= set(scalars)
    series = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in TAGS}
    vocab = len(set(SMALL_TEXT))
    assert sorted(series["loss/val"]) == [10, 20]
    for value in series["loss/val"].values():
        assert math.isfinite(value) and 0 < value < math.log(vocab) + 0.5
    assert all(math.isfinite(v) and 0 < v < math.log(vocab) + 0.5 for v in series["loss/train"].values())
    assert sorted(series["lr"]) == [5, 10, 15, 20]
    for step, value in series["lr"].items():  # the rate used for the step that ended there
        assert value == pytest.approx(lr_at(step - 1, cfg.train), rel=1e-6)
    assert all(math.isfinite(v) and v > 0 for v in series["grad_norm"].values())
    assert all(v > 0 for v in series["tokens_per_sec"].values())

    texts = [tag for tag in events.Tags()["tensors"] if tag.startswith("sample")]
    assert texts, events.Tags()
    logged = events.Tensors(texts[0])
    assert [e.step for e in logged] == [10, 20]
    sample = logged[-1].tensor_proto.string_val[0].decode("utf-8")
    # fenced as a code block: the start character and train.sample_chars=20 sampled ones
    assert sample.startswith("```\n") and sample.endswith("\n```") and len(sample) == 4 + 1 + 20 + 4


def test_a_finished_run_checkpoint_describes_itself(finished_run):
    raw = torch.load(finished_run / "ckpt.pt", weights_only=True)
    for key in ("model", "model_config", "vocab", "optimizer", "step", "best_val_loss", "config", "rng"):
        assert key in raw, key
    assert raw["vocab"] == sorted(set(SMALL_TEXT))
    assert raw["model_config"]["vocab_size"] == len(raw["vocab"])
    assert raw["step"] == 20
    assert math.isfinite(raw["best_val_loss"])
    assert raw["config"]["train"]["max_iters"] == 20 and raw["config"]["out_dir"] == str(finished_run)
    assert {"state", "param_groups"} <= set(raw["optimizer"])
    assert isinstance(raw["rng"]["torch"], torch.Tensor) and isinstance(raw["rng"]["batches"], torch.Tensor)
    best = torch.load(finished_run / "best.pt", weights_only=True)
    assert best["best_val_loss"] == raw["best_val_loss"]
    # a checkpoint alone rebuilds the model
    model, vocab = model_from_checkpoint(raw)
    assert vocab == raw["vocab"] and model.config.n_embd == 16


# ------------------------------------------------------------------------------------- refusing to clobber


def test_a_new_run_into_a_finished_run_is_refused_and_changes_nothing(finished_run, tmp_path, capsys):
    out = copy_run(finished_run, tmp_path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SMALL_TEXT, encoding="utf-8")
    before = snapshot(out)
    assert train.main(["--config", TINY, *tiny_overrides(corpus, out)], progress=False) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--resume" in line and "--overwrite" in line
    assert snapshot(out) == before


def test_overwrite_starts_afresh(finished_run, tmp_path, capsys):
    out = copy_run(finished_run, tmp_path)
    old_events = {p.name for p in out.glob("events.out.tfevents.*")}
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SMALL_TEXT, encoding="utf-8")
    args = ["--config", TINY, "--overwrite", *tiny_overrides(corpus, out, **{"train.max_iters": 10})]
    assert train.main(args, progress=False) == 0
    assert load_checkpoint(out / "ckpt.pt")["step"] == 10  # from step 0, not continued from 20
    assert load_checkpoint(out / "best.pt")["step"] == 10
    events = {p.name for p in out.glob("events.out.tfevents.*")}
    assert len(events) == 1 and not events & old_events
    assert "max_iters: 10" in (out / "config.yaml").read_text(encoding="utf-8")


def test_resume_without_a_checkpoint_is_refused(tmp_path, capsys):
    assert train.main(["--resume", "--out-dir", str(tmp_path / "empty")], progress=False) == 2
    assert "nothing to resume" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "empty").exists()


@pytest.mark.slow
@pytest.mark.parametrize(("args", "fragment"), [
    (["--resume", "--out-dir", "no_such_run"], "nothing to resume: no 'no_such_run/ckpt.pt'; start the run without"),
    (["--resume"], "nothing to resume: no 'runs/tiny/ckpt.pt'"),  # the default config's out_dir
    (["--resume", "--config", str(ROOT / "configs" / "tiny.yaml"), "out_dir=kept"],
     "nothing to resume: no 'kept/ckpt.pt', only best.pt, the run's best step; to continue from that step, copy it"),
], ids=["missing", "default", "only-best"])
def test_a_resume_with_nothing_to_resume_is_said_before_torch_is_imported(tmp_path, args, fragment):
    """A --resume of a folder that holds no ckpt.pt (mistyped, or a run that never saved) was said once torch had
    loaded, 2.03-2.06 s after the command (2-core Zen 2 EPYC); now in 0.17-0.18 s, by a process that never imports
    torch."""
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "best.pt").write_bytes(b"a run's best step")
    said, imported = refused_with_imports("train.py", args, tmp_path)
    assert fragment in said, said
    assert "training.resuming" in imported and not any(name.split(".")[0] == "torch" for name in imported)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]


@pytest.mark.slow
@pytest.mark.parametrize(("args", "fragment"), [
    (["data.path=nope.txt"], "data.path: no such file 'nope.txt' (looked for from "),
    (["data.path=dangling.txt"], "data.path: 'dangling.txt' is a symbolic link to "),
    (["out_dir=done"], "'done' already holds a run (ckpt.pt); continue it with --resume, choose another out_dir"),
    (["out_dir=a_file"], "out_dir 'a_file' exists and is not a folder; choose another out_dir"),
    (["data.path=texts/*.md"], "data.path: no text file matches 'texts/*.md'; check the pattern"),
    (["data.path=text/**/*.txt"], "data.path: no text file matches 'text/**/*.txt'; check the pattern"),
    (["data.path=empty"], "data.path: 'empty' is a folder with no text files in it"),
], ids=["missing-data", "dangling-data-link", "a-second-run", "out-dir-a-file", "glob-no-match", "glob-no-folder",
        "empty-folder"])
def test_a_new_run_that_cannot_start_is_said_before_torch_is_imported(tmp_path, args, fragment):
    """A mistyped data.path, or a second `python train.py` into the folder of the first, was said once torch had
    loaded, 1.79-2.12 s after the command (2-core Zen 2 EPYC); now in 0.18-0.20 s, by a process that never imports
    torch, and nothing in the folder is touched. So is a glob that matches nothing or a folder with no file in it."""
    (tmp_path / "texts" / "sub").mkdir(parents=True)
    (tmp_path / "texts" / "a.txt").write_text("alpha\n", encoding="utf-8")
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / ".keep").write_text("", encoding="utf-8")
    (tmp_path / "dangling.txt").symlink_to(tmp_path / "gone.txt")
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "ckpt.pt").write_bytes(b"the first run's")
    (tmp_path / "a_file").write_text("not a folder\n", encoding="utf-8")
    before = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    said, imported = refused_with_imports("train.py", ["out_dir=run", *args], tmp_path)
    assert fragment in said, said
    assert "training.outdir" in imported and not any(name.split(".")[0] == "torch" for name in imported)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "done" / "ckpt.pt").read_bytes() == b"the first run's"


# ------------------------------------------------------------------------------------------ exact resume

# Both halves and the straight run share one schedule: lr_decay_iters defaults to max_iters, so a run planned
# for 10 steps decays faster than one planned for 20, and no resume could match the straight run then.
# Dropout makes the torch RNG state matter as well as the batch generator's.
RESUME_KEYS = {"model.dropout": 0.1, "train.lr_decay_iters": 20, "train.log_interval": 1}


@pytest.fixture
def straight_run(straight) -> tuple[Path, dict[int, str]]:
    """20 steps in one go, with the per-step losses it logged: the session's run (conftest's straight), trained once
    for every file of a worker that compares with it."""
    return straight


def half_then_resume(tmp_path: Path, capsys) -> tuple[Path, dict[int, str]]:
    """10 steps, then --resume (no --config: the saved one) to 20; the per-step losses of the resumed half."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SMALL_TEXT, encoding="utf-8")
    out = tmp_path / "out"
    first = tiny_overrides(corpus, out, **RESUME_KEYS, **{"train.max_iters": 10})
    assert train.main(["--config", TINY, *first], progress=False) == 0
    assert load_checkpoint(out / "ckpt.pt")["step"] == 10
    capsys.readouterr()
    assert train.main(["--resume", "--out-dir", str(out), "train.max_iters=20"], progress=False) == 0
    captured = capsys.readouterr()
    assert "resume: train.max_iters: 10 -> 20" in captured.out
    return out, logged_losses(captured.out)


def test_resume_continues_the_run_exactly(straight_run, tmp_path, capsys):
    straight, straight_losses = straight_run
    out, resumed_losses = half_then_resume(tmp_path, capsys)
    assert sorted(resumed_losses) == list(range(11, 21))
    assert resumed_losses == {s: straight_losses[s] for s in range(11, 21)}
    resumed = load_checkpoint(out / "ckpt.pt")
    assert resumed["step"] == 20
    assert bitwise_equal(resumed["model"], weights(straight / "ckpt.pt"))
    # tiny.yaml keeps the weights' moving average in "model" (train.ema_decay): the trained weights resume exactly too
    assert bitwise_equal(resumed["training_weights"], load_checkpoint(straight / "ckpt.pt")["training_weights"])
    assert torch.equal(resumed["rng"]["batches"], load_checkpoint(straight / "ckpt.pt")["rng"]["batches"])


@pytest.mark.parametrize("forgotten", ["batches", "torch"])
def test_a_resume_that_forgot_an_rng_state_would_differ(straight_run, tmp_path, capsys, monkeypatch, forgotten):
    """The negative control: without the saved batch generator (or dropout's RNG) the weights come out different,
    so the equality above cannot hold by accident."""
    straight, _ = straight_run
    real_load = training.checkpoints.load_checkpoint

    def load_forgetting(path, *args, **kwargs):
        payload = real_load(path, *args, **kwargs)
        # as if never restored: a freshly seeded state, which for the batch generator is exactly what a resume that
        # skipped gen.set_state would leave (torch.Generator is a C type, so set_state itself cannot be patched)
        payload["rng"][forgotten] = torch.Generator().manual_seed(payload["config"]["seed"]).get_state()
        return payload

    first = tiny_overrides(tmp_path / "corpus.txt", tmp_path / "out", **RESUME_KEYS, **{"train.max_iters": 10})
    (tmp_path / "corpus.txt").write_text(SMALL_TEXT, encoding="utf-8")
    assert train.main(["--config", TINY, *first], progress=False) == 0
    monkeypatch.setattr(training.checkpoints, "load_checkpoint", load_forgetting)
    assert train.main(["--resume", "--out-dir", str(tmp_path / "out"), "train.max_iters=20"], progress=False) == 0
    assert not bitwise_equal(weights(tmp_path / "out" / "ckpt.pt"), weights(straight / "ckpt.pt"))


@pytest.mark.parametrize(
    ("override", "key"),
    [("model.n_embd=32", "model.n_embd"), ("train.learning_rate=0.02", "train.learning_rate"), ("seed=7", "seed"),
     ("train.optimizer=adamw", "train.optimizer")],
)
def test_resume_with_a_changed_key_that_defines_the_run_is_refused(finished_run, tmp_path, capsys, override, key):
    out = copy_run(finished_run, tmp_path)
    before = snapshot(out)
    assert train.main(["--resume", "--out-dir", str(out), override], progress=False) == 2
    line = one_error_line(capsys.readouterr().err)
    assert key in line
    assert snapshot(out) == before


def test_a_resume_that_stretches_the_decay_says_what_the_learning_rate_does_and_how_to_keep_it(tmp_path, capsys):
    # A finished 20-step run (warmup 2, learning rate 0.01 down to 0.001) resumed to 40 steps: lr_decay_iters follows
    # max_iters, so the rate went from 0.001 back up to 0.0059 with no word but "train.max_iters: 20 -> 40"
    run = train_small_run(tmp_path)
    kept = tmp_path / "kept"
    shutil.copytree(run, kept)
    stretched = lr_at(20, load_config(TINY, ["train.warmup_iters=2", "train.max_iters=40"]).train)
    assert 0.0058 < stretched < 0.0059
    capsys.readouterr()
    assert train.main(["--resume", "--out-dir", str(run), "train.max_iters=40"], progress=False) == 0
    assert (f"resume: the learning rate at step 20 goes from 0.001 to {stretched:.3g}: train.lr_decay_iters follows "
            f"train.max_iters; to keep the saved run's decay, add train.lr_decay_iters=20\n") in capsys.readouterr().out
    assert train.main(["--resume", "--out-dir", str(kept), "train.max_iters=40", "train.lr_decay_iters=20"],
                      progress=False) == 0
    assert "the learning rate at step" not in capsys.readouterr().out
    assert load_checkpoint(kept / "ckpt.pt")["step"] == 40


def test_a_resume_within_the_warmup_that_stretches_the_decay_says_so_too():
    """Within the warmup both schedules agree at the resumed step: a 400-step run stopped at step 169 of a 300-step
    warmup, resumed to 800, said only "train.max_iters: 400 -> 800", and its rate at step 400 was 9.05e-03, not
    the saved run's 1e-03."""
    saved = load_config(TINY, ["train.warmup_iters=300", "train.max_iters=400"]).train
    longer = replace(saved, max_iters=800)
    assert lr_at(169, saved) == lr_at(169, longer) and lr_at(400, saved) == saved.min_lr
    assert lr_at(400, longer) > 9e-3  # where the saved run had decayed to min_lr (1e-3)
    assert schedule_note(asdict(saved), longer, 169) == (  # 0.00999991 and 0.00999778, in the digits that part them
        "the learning rate's schedule changes from step 301, where it will be 0.01, not 0.009998: "
        "train.lr_decay_iters follows train.max_iters; to keep the saved run's decay, add train.lr_decay_iters=400")
    for shorter in (replace(saved, max_iters=350), replace(saved, lr_decay_iters=320), replace(saved, min_lr=5e-3)):
        assert schedule_note(asdict(saved), shorter, 169).startswith("the learning rate's schedule changes from step "
                                                                     "301, ")
    assert schedule_note(asdict(saved), replace(longer, lr_decay_iters=400), 169) is None
    assert schedule_note(asdict(saved), saved, 169) is None


def test_a_small_change_of_the_rate_is_written_with_the_digits_that_show_it():
    saved = load_config(TINY, []).train  # 1,500 steps, decayed to min_lr 1e-3
    for max_iters, will in ((1510, "0.001001"), (1501, "0.00100001"), (1600, "0.0011")):
        assert schedule_note(asdict(saved), replace(saved, max_iters=max_iters), 1500).startswith(
            f"the learning rate at step 1,500 goes from 0.001 to {will}: ")


def test_a_resume_without_a_config_checks_its_overrides_against_the_saved_run(tmp_path, capsys):
    # tiny.yaml's learning rate is 0.01: min_lr=0.05 is valid for this run alone, which the resume continues (to 22:
    # at step 20, where it ended, it would have nothing to train)
    run = train_small_run(tmp_path, **{"train.learning_rate": 0.1, "train.min_lr": 0.01})
    capsys.readouterr()
    assert train.main(["--resume", "--out-dir", str(run), "train.min_lr=0.05", "train.max_iters=22"],
                      progress=False) == 0
    assert "resume: train.min_lr: 0.01 -> 0.05" in capsys.readouterr().out
    assert load_checkpoint(run / "ckpt.pt")["config"]["train"]["min_lr"] == 0.05
    # checked against the saved run, a bad value is blamed on the command line and the saved config
    assert train.main(["--resume", "--out-dir", str(run), "train.min_lr=0.5"], progress=False) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "(command line: train.min_lr=0.5; train.learning_rate in the config saved in '" in line
    assert line.endswith("/out/ckpt.pt')")
    # and a misspelt key is refused before anything is looked for
    assert train.main(["--resume", "--out-dir", str(tmp_path / "none"), "train.min_l=0.5"], progress=False) == 2
    assert "did you mean 'train.min_lr'" in one_error_line(capsys.readouterr().err)


def test_resume_on_text_with_characters_the_model_never_saw_is_refused(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SMALL_TEXT, encoding="utf-8")
    out = tmp_path / "out"
    assert train.main(["--config", TINY, *tiny_overrides(corpus, out, **{"train.max_iters": 10})], progress=False) == 0
    before = snapshot(out)
    corpus.write_text(SMALL_TEXT + "Zebra\u20ac\n", encoding="utf-8")
    capsys.readouterr()
    assert train.main(["--resume", "--out-dir", str(out), "train.max_iters=20"], progress=False) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "never saw" in line and "Z" in line and "\u20ac" in line
    assert snapshot(out) == before


# ------------------------------------------------------------------------------------------- bad input


def _latin1(tmp_path: Path) -> Path:
    path = tmp_path / "latin1.txt"
    path.write_bytes(("Caf\u00e9 cr\u00e8me, na\u00efve r\u00e9sum\u00e9. " * 40).encode("latin-1"))
    return path


def _named(name: str, content: str | None = None):
    def make(tmp_path: Path) -> Path:
        path = tmp_path / name
        if content is not None:
            path.write_text(content, encoding="utf-8")
        return path

    return make


def _folder(tmp_path: Path) -> Path:
    path = tmp_path / "a_folder"
    path.mkdir()
    return path


BAD_INPUT = [
    # id, makes data.path, extra overrides, fragment of the error line
    ("missing-file", _named("corpsu.txt"), {}, "did you mean"),
    ("empty-file", _named("empty.txt", ""), {}, "is empty"),
    ("a-directory", _folder, {}, "is a folder"),
    ("latin-1", _latin1, {}, "is not UTF-8"),
    ("shorter-than-a-window", _named("short.txt", "abcde"), {}, "block_size + 1 = 9"),
    ("too-short-to-split", _named("split.txt", "abcdefghijklmnopqrst"), {}, "too short for block_size 8"),
    ("unknown-key", _named("corpus.txt"), {"train.learning_rat": 1}, "did you mean 'train.learning_rate'"),
    ("bad-value", _named("corpus.txt"), {"model.n_head": 3}, "divisible"),
    ("bad-type", _named("corpus.txt"), {"train.batch_size": "many"}, "must be an integer"),
]


@pytest.mark.parametrize(("make_path", "extra", "fragment"), [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_one_line_exit_2_and_leaves_a_previous_run_alone(
    finished_run, tmp_path, capsys, make_path, extra, fragment
):
    (tmp_path / "corpus.txt").write_text(SMALL_TEXT, encoding="utf-8")  # a near name for the missing-file case
    out = copy_run(finished_run, tmp_path)
    before = snapshot(out)
    # --overwrite: the run would be replaced, so nothing in out_dir may go before the input is known to be good
    args = ["--config", TINY, "--overwrite", *tiny_overrides(make_path(tmp_path), out, **extra)]
    assert train.main(args, progress=False) == 2
    line = one_error_line(capsys.readouterr().err)
    assert fragment in line
    if fragment == "did you mean":
        assert "corpus.txt" in line
    assert snapshot(out) == before


@pytest.mark.slow
def test_bad_input_in_a_real_process_is_one_line_on_stderr(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "train.py", *tiny_overrides(_latin1(tmp_path), out)],
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert "is not UTF-8" in one_error_line(result.stderr)
    assert not out.exists()


# ---------------------------------------------------------------------------------------------- --help


def test_help_lists_every_key_with_its_default_and_meaning(capsys):
    with pytest.raises(SystemExit) as info:
        train.main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    listed = text.split("config keys", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert [row.split()[0] for row in listed if row.strip()] == valid_keys(RunConfig)
    for (key, default, meaning), row in zip(describe(RunConfig), listed, strict=True):
        shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
        assert row.split()[:2] == [key, shown.split()[0]]
        assert meaning and row.rstrip().endswith(meaning)


def environment_read_by_the_code() -> set[str]:
    """The TINYCHAR_ variables (and XDG_CACHE_HOME) that tinychar's own modules read (those of the tests aside)."""
    read = re.compile(r"environ(?:\.get)?[(\[]\s*\"(TINYCHAR_[A-Z_]+|XDG_CACHE_HOME)\"")
    found = set()
    for source in [ROOT / "train.py", ROOT / "sample.py", *ROOT.glob("*/*.py")]:
        if source.parent.name != "tests":
            found.update(read.findall(source.read_text(encoding="utf-8")))
    return found


def test_help_and_readme_name_every_environment_variable_the_code_reads(capsys):
    read = environment_read_by_the_code()
    assert {"TINYCHAR_DATA_DIR", "TINYCHAR_ONEDNN", "TINYCHAR_KEEP_MEMORY", "XDG_CACHE_HOME"} <= read  # found
    with pytest.raises(SystemExit):
        train.main(["--help"])
    listed = capsys.readouterr().out.split("\nenvironment:\n", 1)[1]
    assert {line.split()[0] for line in listed.splitlines() if line.strip()} >= read
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert {row.split("`")[1] for row in readme.splitlines() if row.startswith("| `") and "_" in row} >= read


# ------------------------------------------------------------------------------- the schedule a run used


def test_the_run_uses_the_schedule_it_was_given(finished_run):
    # the optimizer's stored rate is the one lr_at gave for the last step taken
    raw = load_checkpoint(finished_run / "ckpt.pt")
    cfg = load_config(str(finished_run / "config.yaml"), [])
    assert raw["config"] == to_dict(cfg)
    for group in raw["optimizer"]["param_groups"]:
        assert group["lr"] == lr_at(cfg.train.max_iters - 1, cfg.train)


def test_the_logged_attention_picture_shows_at_most_64_characters(small_corpus, tmp_path):
    """A long context is logged through its first ATTENTION_LOG_CHARS validation characters: the picture grows as
    the square of its length (256 characters of a 6x6 model: 9,571 x 9,573 pixels, seconds per evaluation)."""
    from lab.heatmap import grid_layout
    from training.loop import ATTENTION_LOG_CHARS

    out = tmp_path / "run"
    block_size = ATTENTION_LOG_CHARS + 16
    overrides = tiny_overrides(small_corpus, out, **{"model.block_size": block_size, "train.max_iters": 10})
    assert train.main(overrides, progress=False) == 0
    (picture,) = read_events(out).Images("attention/layers_x_heads")
    text = small_corpus.read_text(encoding="utf-8")
    _, val = split_ids(torch.arange(len(text)), 0.1, block_size)  # positions in the text, not ids
    shown = [text[i] for i in val[:ATTENTION_LOG_CHARS].tolist()]
    layout = grid_layout(2, 2, shown, title="step 10")
    assert (picture.width, picture.height) == (layout.width, layout.height)
    longer = grid_layout(2, 2, [text[i] for i in val[:block_size].tolist()], title="step 10")
    assert longer.width > layout.width  # the cap is what kept it small


def test_out_dir_given_twice_alike_is_one_out_dir():
    assert train.parse_args(["--out-dir", "runs/a", "out_dir=runs/a"]).overrides == ["out_dir=runs/a", "out_dir=runs/a"]


def test_a_run_saved_with_both_data_path_and_dataset_resumes_on_its_data_path():
    from training.checkpoints import check_resume_config

    cfg = load_config(TINY, ["data.path=my_text.txt"])  # resolved: the path alone
    saved = to_dict(cfg)
    saved["data"]["dataset"] = "shakespeare_char"  # as a run given data.dataset= over a file's data.path once saved
    assert check_resume_config(saved, cfg) == []


def test_a_resume_on_a_data_path_in_an_unknown_users_home_is_one_line(tmp_path):
    # The hint for a run started on a relative data.path asked pathlib whether the path was absolute, and its
    # expanduser raised RuntimeError for '~nouser': `--resume data.path=~nouser/corpus.txt` was a traceback.
    from data import DataError
    from training.launch import Launch
    from training.runner import prepare

    cfg = load_config(TINY, ["data.path=~no_such_user_of_tinychar/corpus.txt", f"out_dir={tmp_path / 'out'}"])
    with pytest.raises(DataError, match=r"^data.path: no such file '~no_such_user_of_tinychar/corpus.txt'; to resume, "
                                        r"put back the text"):
        prepare(cfg, resume=True, overwrite=False, progress=False, payload={"vocab": ["a", "b"]}, launch=Launch())


def test_resuming_a_copied_run_by_its_config_yaml_is_refused_rather_than_continuing_the_original(tmp_path, capsys):
    """`--resume --config copy/config.yaml` continued the run the copy was made from (the file's out_dir), writing its
    checkpoints over that run's, without a word."""
    run = train_small_run(tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    before = snapshot(run)
    assert train.main(["--config", str(copy / "config.yaml"), "--resume", "train.max_iters=22"], progress=False) == 2
    assert capsys.readouterr().err == (
        f"error: --config '{shown(str(copy / 'config.yaml'))}' is the config of the run in '{shown(str(copy))}', but "
        f"its out_dir is '{shown(str(run))}', the folder it was copied or moved from: to continue the run in "
        f"'{shown(str(copy))}', use --resume --out-dir {path_word(str(copy))}; to continue the other, add "
        f"--out-dir {path_word(str(run))}\n")
    assert snapshot(run) == before
    for out in (copy, run):  # either, named
        assert train.main(["--config", str(copy / "config.yaml"), "--resume", "--out-dir", str(out),
                           "train.max_iters=22"], progress=False) == 0
        assert load_checkpoint(out / "ckpt.pt")["step"] == 22
    assert train.main(["--config", str(run / "config.yaml"), "--resume", "train.max_iters=24"], progress=False) == 0


def test_resuming_by_a_config_yaml_whose_relative_out_dir_names_nothing_from_here_says_so(tmp_path, capsys,
                                                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text(SMALL_TEXT, encoding="utf-8")
    assert train.main(["--config", TINY, *tiny_overrides(tmp_path / "corpus.txt", Path("runs/a"))],
                      progress=False) == 0  # started here, on a relative out_dir
    monkeypatch.chdir(tmp_path / "runs" / "a")
    capsys.readouterr()
    assert train.main(["--config", "config.yaml", "--resume", "train.max_iters=22"], progress=False) == 2
    assert capsys.readouterr().err == (
        "error: --config 'config.yaml' is the config of the run in '.', but its out_dir 'runs/a' names no folder "
        "from here (the run's folder was moved, or that path is relative to the folder the run started in): to "
        "continue the run in '.', use --resume --out-dir .\n")
    assert train.main(["--config", "config.yaml", "--resume", "--out-dir", ".", "train.max_iters=22"],
                      progress=False) == 0


def test_out_dir_given_twice_as_one_folder_is_no_contradiction(capsys):
    # runs/a and runs/a/ were refused as contradicting each other, and so was runs/a given by its full path
    args = train.parse_args(["--out-dir", "runs/a", "out_dir=runs/a/", "out_dir=./runs/a",
                             f"out_dir={os.getcwd()}/runs/a"])
    assert args.overrides[-1] == "out_dir=runs/a"
    with pytest.raises(SystemExit):
        train.parse_args(["--out-dir", "runs/a", "out_dir=runs/b"])
    assert "contradict each other" in capsys.readouterr().err



@pytest.mark.parametrize("argv", [["--config", "configs/tiny.yaml", "--config", "configs/shakespeare_char_cpu.yaml"],
                                  ["--config=configs/tiny.yaml", "--conf", "configs/shakespeare_char_cpu.yaml"]])
def test_config_given_twice_with_two_files_is_refused(argv, capsys):
    # argparse keeps the last value: --config a --config b, which may read as layered configs, trained on b alone
    with pytest.raises(SystemExit) as e:
        train.parse_args(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "error: argument --config: given twice, as 'configs/tiny.yaml' and 'configs/shakespeare_char_cpu.yaml'; give "
        "it once (configs do not add up: give the other's settings as KEY=VALUE overrides) (see train.py --help)\n")
    assert train.parse_args(["--config", "configs/tiny.yaml", "--config=./configs/tiny.yaml"]).config == \
        "./configs/tiny.yaml"  # one file named twice is one request
    assert train.parse_args(["--out-dir", "runs/a", "--out-dir", "runs/b"]).out_dir == "runs/b"  # the last, as ever

def run_started_on_a_relative_path(tmp_path: Path, monkeypatch, capsys) -> tuple[Path, Path, Path]:
    """(started, elsewhere, out): a 4-step run trained in started on data.path=corpus.txt into out, and the current
    folder now elsewhere, another folder."""
    started, elsewhere, out = tmp_path / "started", tmp_path / "elsewhere", tmp_path / "out"
    started.mkdir()
    elsewhere.mkdir()
    (started / "corpus.txt").write_text(SMALL_TEXT, encoding="utf-8")
    monkeypatch.chdir(started)
    assert train.main(["--config", TINY, *tiny_overrides(Path("corpus.txt"), out, **{"train.max_iters": 4})],
                      progress=False) == 0
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    return started, elsewhere, out


def test_a_stopped_run_whose_text_was_found_in_tinychar_data_dir_is_told_to_resume_with_it(tmp_path, monkeypatch):
    """The line a stop ends with is pasted back as it is: without TINYCHAR_DATA_DIR, the resume found no text and
    said the path was relative to the folder the run started in, where the user already was."""
    from configs.userinput import script_word
    from training.errors import failure_line
    from training.launch import Launch
    from training.signals import Stopped

    corpora, here = tmp_path / "my corpora", tmp_path / "here"
    corpora.mkdir()
    here.mkdir()
    (corpora / "c.txt").write_text(SMALL_TEXT, encoding="utf-8")
    monkeypatch.chdir(here)
    monkeypatch.setenv("TINYCHAR_DATA_DIR", str(corpora))
    cfg = load_config(TINY, ["data.path=c.txt", "out_dir=runs/dd"])
    stop, resume = Stopped(signal.SIGINT, 5), f"python {script_word('train.py')} --out-dir runs/dd --resume"
    assert failure_line(stop, cfg, Launch()) == (
        f"stopped at step 5: saved 'runs/dd/ckpt.pt'; continue with: TINYCHAR_DATA_DIR='{corpora}' {resume}")
    (here / "c.txt").write_text(SMALL_TEXT, encoding="utf-8")  # found here, as a resume from here would find it
    assert failure_line(stop, cfg, Launch()).endswith(f"continue with: {resume}")
    cfg = load_config(TINY, [f"data.path={corpora / 'c.txt'}", "out_dir=runs/dd"])  # a full path needs no folder
    assert failure_line(stop, cfg, Launch()).endswith(f"continue with: {resume}")


def test_a_run_on_a_relative_data_path_resumes_from_another_folder_by_the_texts_full_path(tmp_path, capsys,
                                                                                          monkeypatch):
    # The advice was a dead end: from another folder the relative path names no file, and its full path was refused
    # as "a changed data.path". The text's fingerprint is what a resume must keep, and it is checked.
    started, elsewhere, out = run_started_on_a_relative_path(tmp_path, monkeypatch, capsys)
    assert train.main(["--resume", "--out-dir", str(out), "train.max_iters=6"], progress=False) == 2
    assert one_error_line(capsys.readouterr().err).endswith(
        "this run was started on that path relative to the folder it ran in: resume from that folder (or with "
        "TINYCHAR_DATA_DIR as it was, if found there), the text put back if it is gone, or give its full path "
        "(data.path=/.../corpus.txt), which a resume takes")
    full = str(started / "corpus.txt")
    assert train.main(["--resume", "--out-dir", str(out), "train.max_iters=6", f"data.path={full}"],
                      progress=False) == 0
    assert f"resume: data.path: 'corpus.txt' -> '{full}'" in capsys.readouterr().out
    (elsewhere / "other.txt").write_text(SMALL_TEXT[::-1], encoding="utf-8")  # the same characters, another text
    assert train.main(["--resume", "--out-dir", str(out), "train.max_iters=8", f"data.path={elsewhere / 'other.txt'}"],
                      progress=False) == 2
    assert "is not the text this run was trained on" in one_error_line(capsys.readouterr().err)


def test_a_resume_on_other_text_says_why_as_far_as_it_can_tell(tmp_path, capsys, monkeypatch):
    """Each refusal said "it changed since ... was saved", though from another folder a relative data.path may name
    another file, and another data.path is another file; and a mistyped relative path on a run started on a full one
    got the hint for a run started on a relative path."""
    started, elsewhere, out = run_started_on_a_relative_path(tmp_path, monkeypatch, capsys)
    (elsewhere / "corpus.txt").write_text(SMALL_TEXT[::-1], encoding="utf-8")  # the same characters, another text
    assert train.main(["--resume", "--out-dir", str(out), "train.max_iters=6"], progress=False) == 2
    assert (f"(it changed since '{shown(out / 'ckpt.pt')}' was saved, or from this folder the relative path names "
            f"another file than from the one the run started in); resume") in one_error_line(capsys.readouterr().err)
    other = str(elsewhere / "corpus.txt")
    assert train.main(["--resume", "--out-dir", str(out), "train.max_iters=6", f"data.path={other}"],
                      progress=False) == 2
    assert "(the run was trained on data.path 'corpus.txt'); resume" in one_error_line(capsys.readouterr().err)

    (tmp_path / "full").mkdir()
    run = train_small_run(tmp_path / "full")  # started on a full data.path
    assert train.main(["--resume", "--out-dir", str(run), "train.max_iters=22", "data.path=corpus.txt.orig"],
                      progress=False) == 2
    assert one_error_line(capsys.readouterr().err) == (
        "error: data.path: no such file 'corpus.txt.orig'; to resume, put back the text this run trained on, or give "
        "where it is now (data.path=...), which a resume takes")


def test_a_resume_from_a_damaged_ckpt_pt_says_how_to_go_on(tmp_path, capsys):
    # it said what was wrong, and no more
    run = train_small_run(tmp_path, **{"train.max_iters": 4, "train.eval_interval": 2})
    (run / "ckpt.pt").write_text("junk\n", encoding="utf-8")
    capsys.readouterr()
    assert train.main(["--resume", "--out-dir", str(run)], progress=False) == 2
    assert one_error_line(capsys.readouterr().err).endswith(
        "(truncated or not a checkpoint): it is not a whole file that torch.save wrote; to continue from the run's "
        "best step instead, copy best.pt over it (cp best.pt ckpt.pt, in out_dir)")
    (run / "best.pt").unlink()
    assert train.main(["--resume", "--out-dir", str(run)], progress=False) == 2
    assert one_error_line(capsys.readouterr().err).endswith(
        "it is not a whole file that torch.save wrote; start afresh with --overwrite, or choose another out_dir")


def test_the_printed_commands_run_from_where_the_run_was_started_and_for_a_folder_named_like_an_option(
        tmp_path, capsys, monkeypatch):
    # `out_dir=-dash` printed `python sample.py --out-dir -dash` ("expected one argument"); a run started as
    # `python tinychar/train.py` printed `python sample.py`, which is no file where the person is
    from configs.userinput import path_word, script_word

    assert (path_word("-dash"), path_word("runs/x"), path_word("my runs")) == ("./-dash", "runs/x", "'my runs'")
    monkeypatch.chdir(ROOT)
    assert script_word("sample.py") == "sample.py"
    monkeypatch.chdir(ROOT.parent)
    assert script_word("sample.py") == path_word(f"{ROOT.name}/sample.py")
    monkeypatch.chdir(tmp_path)  # no way down from here: the full path
    assert script_word("train.py") == path_word(str(ROOT / "train.py"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SMALL_TEXT, encoding="utf-8")
    capsys.readouterr()
    assert train.main(["--config", TINY, *tiny_overrides(corpus, Path("-dash"), **{"train.max_iters": 4})],
                      progress=False) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    command = line.partition("sample with: ")[2]
    assert command == f"python {script_word('sample.py')} --out-dir ./-dash"
    done = subprocess.run([sys.executable, *shlex.split(command)[1:], "--max-new-tokens", "3", "--device", "cpu"],
                          cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr


def test_a_resume_on_a_data_path_of_a_run_trained_on_a_dataset_names_both(tmp_path, capsys):
    # "cannot resume with a changed data.dataset ('shakespeare_char' -> None)": a key the person never typed
    out = tmp_path / "out"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SMALL_TEXT, encoding="utf-8")
    args = [*tiny_overrides(corpus, out, **{"train.max_iters": 2, "train.eval_iters": 1}), "data.path=null"]
    assert train.main(["--config", TINY, *args], progress=False) == 0
    capsys.readouterr()
    assert train.main(["--resume", "--out-dir", str(out), f"data.path={corpus}", "train.max_iters=4"],
                      progress=False) == 2
    assert one_error_line(capsys.readouterr().err) == (
        f"error: cannot resume on data.path={str(corpus)!r}: this run was trained on data.dataset=shakespeare_char; "
        f"start a new run in another out_dir for another text")


LOWER = ("; no checkpoint was saved. Lower train.batch_size or train.eval_iters, train a smaller model, or cap a "
         "vocabulary of very many characters with data.max_vocab")


def line_when_evaluation_fails(tmp_path: Path, capsys, monkeypatch, fails) -> str:
    """The one error line of a tiny run whose first evaluation raises what fails() raises (train.py exits 1)."""
    import training.loop

    monkeypatch.setattr(training.loop.Trainer, "evaluate", lambda self: fails())
    corpus, out = tmp_path / "corpus.txt", tmp_path / "out"
    corpus.write_text(SMALL_TEXT, encoding="utf-8")
    capsys.readouterr()
    assert train.main(["--config", TINY, *tiny_overrides(corpus, out)], progress=False) == 1
    return one_error_line(capsys.readouterr().err)


def test_running_out_of_memory_past_the_estimate_is_one_line_naming_what_to_lower(tmp_path, capsys, monkeypatch):
    # 70,000 distinct characters under `ulimit -v 2500000`: the estimate let the run start, and the first
    # evaluation's logits failed to allocate in a traceback
    def allocation_fails():
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 573440000 bytes. Error code 12 (Cannot allocate memory)")

    assert line_when_evaluation_fails(tmp_path, capsys, monkeypatch, allocation_fails) == (
        f"error: out of memory (asking for 0.57 GB more){LOWER}")


def _save_runs_out() -> None:
    try:
        raise MemoryError
    except MemoryError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0") from None


def _python_runs_out() -> None:
    raise MemoryError


@pytest.mark.parametrize("fails", [_python_runs_out, _save_runs_out], ids=["MemoryError", "a save's RuntimeError"])
def test_python_running_out_of_memory_is_the_same_one_line(tmp_path, capsys, monkeypatch, fails):
    """Python's MemoryError (a picture's pixels, a checkpoint pickled), and torch.save's RuntimeError with one behind
    it (it closes the file on the way out: "unexpected pos"), were tracebacks."""
    assert line_when_evaluation_fails(tmp_path, capsys, monkeypatch, fails) == f"error: out of memory{LOWER}"


def test_a_resume_is_pointed_at_best_pt_only_where_best_pt_would_do(tmp_path, capsys):
    # A checkpoint a later tinychar wrote, whole, was to be replaced by best.pt (cp best.pt ckpt.pt), which lost the
    # newest steps and helped nothing where best.pt was of that version too; a damaged best.pt was offered as well.
    from model.checkpoint import VERSION

    run = train_small_run(tmp_path, **{"train.max_iters": 4, "train.eval_interval": 2})
    for name in ("ckpt.pt", "best.pt"):
        payload = load_checkpoint(run / name)
        payload["version"] = VERSION + 1
        torch.save(payload, run / name)
    before = snapshot(run)
    capsys.readouterr()
    assert train.main(["--resume", "--out-dir", str(run), "train.max_iters=6"], progress=False) == 2
    assert one_error_line(capsys.readouterr().err).endswith(
        f"is in format version {VERSION + 1}, newer than this tinychar reads ({VERSION}); load it with the tinychar "
        f"that wrote it, or a later one")
    assert snapshot(run) == before
    (run / "ckpt.pt").write_text("junk\n", encoding="utf-8")
    assert train.main(["--resume", "--out-dir", str(run), "train.max_iters=6"], progress=False) == 2
    assert one_error_line(capsys.readouterr().err).endswith(  # best.pt, of the later version, would not do either
        "it is not a whole file that torch.save wrote; start afresh with --overwrite, or choose another out_dir")


def test_a_resume_whose_text_is_gone_from_its_full_path_says_how_to_go_on(tmp_path, capsys):
    # It said only "no such file", with no way forward for a resume.
    corpus, out = tmp_path / "corpus.txt", tmp_path / "out"
    corpus.write_text(SMALL_TEXT, encoding="utf-8")
    assert train.main(["--config", TINY, *tiny_overrides(corpus, out, **{"train.max_iters": 4})], progress=False) == 0
    moved = corpus.rename(tmp_path / "moved.txt")
    capsys.readouterr()
    assert train.main(["--resume", "--out-dir", str(out), "train.max_iters=6"], progress=False) == 2
    assert one_error_line(capsys.readouterr().err) == (
        f"error: data.path: no such file {quoted(corpus)}; to resume, put back the text this run trained on, or give "
        "where it is now (data.path=...), which a resume takes")
    assert train.main(["--resume", "--out-dir", str(out), "train.max_iters=6", f"data.path={moved}"],
                      progress=False) == 0


# A script run as a person runs it, with what it imported listed at the end
IMPORTED = """
import runpy, sys
script, sys.argv = sys.argv[1], sys.argv[1:]
sys.path.insert(0, ".")
try:
    runpy.run_path(script, run_name="__main__")
finally:
    print(" ".join(sorted(name for name in ("torch", "numpy") if name in sys.modules)) or "-", file=sys.stderr)
"""


@pytest.mark.slow
@pytest.mark.parametrize(("args", "status", "said"), [
    (["train.py", "model.n_layr=3"], 2,
     "error: unknown config key 'model.n_layr' (command line); did you mean 'model.n_layer'?"),
    (["train.py", "--config", "configs/nothing.yaml"], 2, "error: config file: no such file 'configs/nothing.yaml'"),
    (["train.py", "model.n_head=3"], 2, "error: model.n_embd must be divisible by model.n_head, got 64 and 3 "
                                        "(command line: model.n_head=3; model.n_embd in configs/tiny.yaml)"),
    (["train.py", "--help"], 0, None),
    (["train.py", "--resume", "train.max_iter=9"], 2,
     "error: unknown config key 'train.max_iter' (command line); did you mean 'train.max_iters'?"),
    (["sample.py", "--temperature", "-1"], 2,
     "error: --temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
    (["sample.py", "--top-k", "0"], 2, "error: --top-k must be >= 1, got 0"),
    (["sample.py", "--help"], 0, None),
    (["bench.py", "--rounds", "0"], 2, "error: --rounds must be >= 1, got 0 (see bench.py --help)"),
    (["bench.py"], 2, "error: --nanogpt DIR is required; get a checkout with: git clone "
                      "https://github.com/karpathy/nanoGPT"),
    (["bench.py", "--help"], 0, None)])
def test_a_bad_config_or_option_or_help_comes_before_torch_is_imported(tmp_path, args, status, said):
    """Reading the options and config takes milliseconds, importing torch seconds: train.py refuses a new run's bad
    config, sample.py and bench.py a bad option, and all three answer --help, without torch (or numpy)."""
    hook = tmp_path / "imported.py"
    hook.write_text(IMPORTED, encoding="utf-8")
    result = subprocess.run([sys.executable, str(hook), *args], check=False, cwd=ROOT, env=child_env(),
                            capture_output=True, text=True, timeout=120)
    lines = result.stderr.splitlines()
    assert result.returncode == status
    assert lines[-1] == "-"  # neither was imported
    assert lines[:-1] == ([said] if said else [])
    if said is None:
        assert "usage:" in result.stdout


def test_a_run_and_sample_py_count_every_parameter_as_the_readme_does(tmp_path, capsys):
    """They printed GPT.num_params(), which leaves out the position table (nanoGPT's count): 10.65M for
    shakespeare_char.yaml, whose 10,745,088 parameters the README calls 10.7M."""
    import sample

    out = train_small_run(tmp_path, **{"model.block_size": 256, "model.n_embd": 64, "train.max_iters": 1})
    model = GPT(GPTConfig(**load_checkpoint(out / "ckpt.pt")["model_config"]))
    total = sum(p.numel() for p in model.parameters())
    assert f"{total / 1e6:.2f}" != f"{model.num_params() / 1e6:.2f}"  # the two counts differ in what is printed
    printed = re.findall(r"model: ([\d.]+)M parameters", capsys.readouterr().out)
    assert printed == [f"{total / 1e6:.2f}"]
    assert sample.main(["--out-dir", str(out), "--max-new-tokens", "1", "--device", "cpu"]) == 0
    assert f": {total / 1e6:.2f}M parameters, step 1, " in capsys.readouterr().err
