"""Tests for model/baselines.py: model.type=bigram, gru and lstm train, resume exactly, sample and save like the GPT,
through the same train.py, sample.py and checkpoints; options that mean nothing for them are refused."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from conftest import ROOT, SMALL_TEXT, tiny_overrides, train_small_run
from test_train import bitwise_equal, weights

import sample
import train
import training.config
from configs import ConfigError
from model import Bigram, GPTConfig, GRUModel, LSTMModel, build_model, load_checkpoint
from training.config import load_config
from training.memory import parameter_count

TINY = str(ROOT / "configs" / "tiny.yaml")
TYPES = ["bigram", "gru", "lstm"]


def quiet_train(args: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()):
        return train.main(args, progress=False)


@pytest.mark.parametrize("kind", TYPES)
def test_each_type_is_causal_and_counts_its_parameters(kind) -> None:
    cfg = GPTConfig(type=kind, vocab_size=20, n_layer=2, n_embd=16, n_head=2)
    model = build_model(cfg).eval()
    assert isinstance(model, {"bigram": Bigram, "gru": GRUModel, "lstm": LSTMModel}[kind])
    assert parameter_count(cfg) == model.num_params() == sum(p.numel() for p in model.parameters())
    idx = torch.randint(20, (2, 8), generator=torch.Generator().manual_seed(0))
    later = idx.clone()
    later[:, 5:] = (later[:, 5:] + 1) % 20
    a, _ = model(idx)
    b, _ = model(later)
    assert torch.equal(a[:, :5], b[:, :5])  # a position never sees what comes after it
    assert not torch.equal(a[:, 5:], b[:, 5:])
    with pytest.raises(ValueError, match="has no attention"):
        model(idx, return_attention=True)


@pytest.mark.parametrize("kind", TYPES)
def test_each_type_trains_saves_samples_and_resumes_exactly(kind, tmp_path, capsys) -> None:
    (tmp_path / "straight").mkdir()
    run = train_small_run(tmp_path / "straight", **{"model.type": kind, "train.lr_decay_iters": 20})
    payload = load_checkpoint(run / "ckpt.pt")
    assert payload["model_config"]["type"] == kind and payload["step"] == 20
    # tiny.yaml's optimizer is Muon, which steps linear layers' matrices: these types have none, and the log says so
    assert f"Muon steps the weight matrices of linear layers, and model.type={kind} has none" in capsys.readouterr().out
    assert sample.main(["--out-dir", str(run), "--prompt", "First", "--max-new-tokens", "15"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("First") and len(out) == len("First") + 15 + 1

    half = tmp_path / "half"
    half.mkdir()
    corpus = half / "corpus.txt"
    corpus.write_text(SMALL_TEXT, encoding="utf-8")
    keys = {"model.type": kind, "train.lr_decay_iters": 20, "train.max_iters": 10}
    assert quiet_train(["--config", TINY, *tiny_overrides(corpus, half / "out", **keys)]) == 0
    assert quiet_train(["--resume", "--out-dir", str(half / "out"), "train.max_iters=20"]) == 0
    assert bitwise_equal(weights(half / "out" / "ckpt.pt"), weights(run / "ckpt.pt"))


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_a_recurrent_model_carries_its_whole_state_from_character_to_character(kind) -> None:
    # what sampling does: the state after each character (the LSTM's hidden and cell states) continues the next
    model = build_model(GPTConfig(type=kind, vocab_size=20, n_layer=2, n_embd=16, n_head=2)).eval()
    idx = torch.randint(20, (3, 9), generator=torch.Generator().manual_seed(1))
    whole, _ = model(idx)
    state, steps = None, []
    for t in range(9):
        logits, state = model.step(idx[:, t : t + 1], state)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-5, atol=1e-6)
    gates = {"gru": 3, "lstm": 4}[kind]
    # the layers' weights are named by the type in checkpoints (gru.weight_hh_l1), one 16-row block a gate
    assert dict(model.named_parameters())[f"{kind}.weight_hh_l1"].shape == (gates * 16, 16)
    assert model.flops_per_token() == 6 * (2 * 2 * gates * 16 * 16 + 20 * 16)


def test_the_gpt_under_muon_hears_nothing_of_adamw_alone(tmp_path, capsys) -> None:
    train_small_run(tmp_path, **{"train.max_iters": 2})
    out = capsys.readouterr().out
    assert "engine:" in out and "optimizer:" not in out


def test_a_dropout_a_bigram_table_cannot_use_is_refused_in_one_line(tmp_path, capsys) -> None:
    # A bigram table has no layers to drop out of: model.dropout=0.5 trained without any, and config.yaml said 0.5
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SMALL_TEXT, encoding="utf-8")
    args = ["--config", TINY, *tiny_overrides(corpus, tmp_path / "out"), "model.type=bigram", "model.dropout=0.5"]
    assert train.main(args, progress=False) == 2
    assert capsys.readouterr().err == (
        "error: model.dropout=0.5 means nothing for model.type=bigram, whose table has no layers to drop out of; "
        "leave model.dropout at 0 (command line: model.dropout=0.5 model.type=bigram)\n")
    assert not (tmp_path / "out").exists()
    shipped = str(ROOT / "configs" / "shakespeare_char.yaml")  # its dropout: 0.2, for the gpt
    with pytest.raises(ConfigError, match=r"^model.dropout=0.2 means nothing for model.type=bigram, .* \(command "
                                          r"line: model.type=bigram; model.dropout in .*shakespeare_char.yaml\)$"):
        load_config(shipped, ["model.type=bigram", "model.attention=manual"])
    # what it does not refuse: dropout 0 (any config's sizes, as the README says), and dropout for the gru and lstm
    assert load_config(shipped, ["model.type=bigram", "model.attention=manual", "model.dropout=0"]).model.n_layer == 6
    assert load_config(shipped, ["model.type=gru", "model.attention=manual"]).model.dropout == 0.2


def test_a_bigram_run_saved_with_a_dropout_still_samples_and_resumes(tmp_path, capsys, monkeypatch) -> None:
    # saved before such a dropout was refused: nothing of it is lost
    with monkeypatch.context() as before:
        before.setattr(training.config, "unused_setting", lambda model: None)
        run = train_small_run(tmp_path, **{"model.type": "bigram", "model.dropout": 0.5})
    assert load_checkpoint(run / "ckpt.pt")["config"]["model"]["dropout"] == 0.5
    assert sample.main(["--out-dir", str(run), "--max-new-tokens", "5"]) == 0
    assert quiet_train(["--resume", f"out_dir={run}", "train.max_iters=22"]) == 0
    again = ["--resume", "--config", TINY, *tiny_overrides(tmp_path / "corpus.txt", run), "model.type=bigram",
             "model.dropout=0.5", "train.max_iters=24"]
    assert quiet_train(again) == 0, capsys.readouterr().err
    assert load_checkpoint(run / "ckpt.pt")["step"] == 24


def test_options_that_mean_nothing_for_a_type_are_refused_in_one_line(tmp_path, capsys) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SMALL_TEXT, encoding="utf-8")
    args = ["--config", TINY, *tiny_overrides(corpus, tmp_path / "out"), "model.type=gru", "model.score=additive"]
    assert train.main(args, progress=False) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model.score=additive means nothing for model.type=gru, which has no attention")
    assert len(err.splitlines()) == 1
    (tmp_path / "bigram").mkdir()
    run = train_small_run(tmp_path / "bigram", **{"model.type": "bigram"})
    capsys.readouterr()
    assert sample.main(["--out-dir", str(run), "--attention-map", str(tmp_path / "a.png")]) == 2
    assert capsys.readouterr().err.strip() == ("error: --attention-map: a bigram model has no attention to draw "
                                               "(model.type=gpt has)")
