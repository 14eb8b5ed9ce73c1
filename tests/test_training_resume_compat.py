"""Checkpoints written before the move into training/ still load, sample and resume.

tests/fixtures/ckpt_before_the_move.pt was saved by tinychar as it was before the training package existed (the
commit "README: Python 3.11 is the minimum"), in a folder holding corpus.txt = conftest.SMALL_TEXT:

    python train.py --config configs/tiny.yaml data.path=corpus.txt model.block_size=8 model.n_layer=2 \\
        model.n_head=2 model.n_embd=16 train.batch_size=8 train.warmup_iters=2 train.eval_interval=10 \\
        train.eval_iters=2 train.log_interval=5 train.sample_chars=0 train.tensorboard=false \\
        train.lr_decay_iters=30 seed=7 train.max_iters=20 out_dir=out

That code, resumed with `--resume --out-dir out train.max_iters=30`, printed training losses 2.8427 (step 25) and
2.9156 (step 30) and validation loss 3.0789; the code of today must continue the run the same way.
"""

from __future__ import annotations

import contextlib
import io
import shutil

import pytest
from conftest import ROOT, SMALL_TEXT
from test_train import logged_losses

import sample
import train
from model import load_checkpoint, model_from_checkpoint

FIXTURE = ROOT / "tests" / "fixtures" / "ckpt_before_the_move.pt"


def test_a_checkpoint_from_before_the_move_loads_and_samples(capsys) -> None:
    payload = load_checkpoint(FIXTURE)
    _, vocab = model_from_checkpoint(payload, FIXTURE)
    assert payload["step"] == 20 and vocab == sorted(set(SMALL_TEXT))
    assert sample.main(["--checkpoint", str(FIXTURE), "--prompt", "First", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("First") and len(out) == len("First") + 12 + 1


def test_a_checkpoint_from_before_the_move_resumes_as_that_code_would(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text(SMALL_TEXT, encoding="utf-8")
    (tmp_path / "out").mkdir()
    shutil.copyfile(FIXTURE, tmp_path / "out" / "ckpt.pt")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert train.main(["--resume", "--out-dir", "out", "train.max_iters=30"], progress=False) == 0
    losses = logged_losses(stdout.getvalue())
    assert sorted(losses) == [25, 30]
    # the same numbers to float32 rounding: another CPU's kernels may round differently in the last places
    assert float(losses[25]) == pytest.approx(2.8427, abs=2e-3)
    assert float(losses[30]) == pytest.approx(2.9156, abs=2e-3)
    resumed = load_checkpoint(tmp_path / "out" / "ckpt.pt")
    assert resumed["step"] == 30 and resumed["best_val_loss"] == pytest.approx(3.0789, abs=2e-3)


def test_a_checkpoint_without_a_model_type_is_a_gpt() -> None:
    from model import GPT, checkpoint_config

    payload = load_checkpoint(FIXTURE)
    assert "type" not in payload["model_config"]
    config, _ = checkpoint_config(payload, FIXTURE)
    assert config.type == "gpt" and isinstance(model_from_checkpoint(payload, FIXTURE)[0], GPT)
