"""training.average: the weights' moving average (train.ema_decay) is the bias-corrected average of the steps'
weights; evaluating it leaves the trained weights as they were, views included; a run evaluates, saves and samples
the average and resumes both it and the trained weights (exact resume itself: test_train, test_training_engine)."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import SMALL_TEXT, train_small_run
from torch import nn

from data import CharTokenizer
from data.batches import split_ids
from model import GPT, GPTConfig, load_checkpoint, model_from_checkpoint
from training.average import WeightAverage
from training.evaluation import estimate_loss


def test_the_average_weighs_each_steps_weights_by_the_decay_corrected_for_its_start():
    layer = nn.Linear(3, 2)
    average = WeightAverage(layer, 0.5)
    seen = [torch.randn(2, 3, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    for step, w in enumerate(seen, start=1):
        with torch.no_grad():
            layer.weight.copy_(w)
        average.update(step)
        if step == 1:  # the first step replaces what the average held (its initial weights count for nothing)
            assert torch.equal(average.average[0], seen[0])
    t, d = len(seen), 0.5
    expected = sum((1 - d) * d ** (t - s) * w for s, w in enumerate(seen, start=1)) / (1 - d**t)
    torch.testing.assert_close(average.average[0], expected, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(average.average[0], seen[-1])  # an average, not the last weights


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.1])
def test_a_decay_outside_0_1_is_refused(decay):
    with pytest.raises(ValueError, match="decay must be in"):
        WeightAverage(nn.Linear(2, 2), decay)


def test_inside_in_model_the_model_holds_the_average_and_afterwards_its_own_weights_bit_for_bit():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))
    # as the compiled engine does: every parameter a view of one flat buffer, which must stay one
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for p, part in zip(model.parameters(), flat.split([p.numel() for p in model.parameters()]), strict=True):
        p.data = part.view_as(p)
    own = flat.clone()
    average = WeightAverage(model, 0.9)
    with torch.no_grad():
        for a in average.average:
            a.add_(1.0)
    with average.in_model():
        for p, a in zip(model.parameters(), average.average, strict=True):
            assert torch.equal(p, a)
    assert torch.equal(flat, own)
    assert all(p.data_ptr() == part.data_ptr()
               for p, part in zip(model.parameters(), flat.split([p.numel() for p in model.parameters()]), strict=True))


def test_over_parameters_in_one_buffer_an_update_is_one_lerp_and_the_same_average_to_the_bit(monkeypatch):
    """The compiled engine lays the parameters end to end in one buffer, in the optimizer's order: the average follows
    that layout and folds a step in with one lerp, with the bits of one lerp a parameter."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8)
    plain, laid_out = GPT(config), GPT(config)
    laid_out.load_state_dict(plain.state_dict())
    params = list(laid_out.parameters())
    order = params[1::2] + params[::2]  # not the model's order
    flat = torch.cat([p.detach().reshape(-1) for p in order])
    for p, part in zip(order, flat.split([p.numel() for p in order]), strict=True):
        p.data = part.view_as(p)
    averages = WeightAverage(plain, 0.9), WeightAverage(laid_out, 0.9)
    lerps = []
    foreach_lerp = torch._foreach_lerp_
    monkeypatch.setattr(torch, "_foreach_lerp_", lambda *a: lerps.append(len(a[0])) or foreach_lerp(*a))
    for step in range(1, 6):
        with torch.no_grad():
            for p, q in zip(plain.parameters(), laid_out.parameters(), strict=True):
                p.copy_(torch.randn_like(p))
                q.copy_(p)
        for average in averages:
            average.update(step)
    assert lerps == [len(params)] * 5  # the plain model's, one per parameter; none for the laid-out one
    assert all(torch.equal(a, b) for a, b in zip(averages[0].average, averages[1].average, strict=True))
    assert len({a.untyped_storage().data_ptr() for a in averages[1].average}) == 1
    assert all(torch.equal(a, b) for a, b in zip(averages[0].state_dict().values(), averages[1].state_dict().values(),
                                                  strict=True))


def test_the_state_dict_gives_a_tied_weight_under_both_names_and_loads_back():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))
    average = WeightAverage(model, 0.9)
    with torch.no_grad():
        for a in average.average:
            a.mul_(2.0)
    state = average.state_dict()
    assert state.keys() == model.state_dict().keys()
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    assert torch.equal(state["lm_head.weight"], 2 * model.lm_head.weight.detach())
    other = WeightAverage(model, 0.9)
    other.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(other.average, average.average, strict=True))


def test_a_run_evaluates_saves_and_samples_the_average_and_keeps_the_trained_weights_apart(tmp_path, capsys):
    out = train_small_run(tmp_path)  # configs/tiny.yaml: train.ema_decay 0.99
    logged = capsys.readouterr().out
    payload = load_checkpoint(out / "ckpt.pt")
    assert payload["config"]["train"]["ema_decay"] == 0.99
    averaged, trained = payload["model"], payload["training_weights"]
    assert averaged.keys() == trained.keys()
    assert not torch.equal(averaged["lm_head.weight"], trained["lm_head.weight"])
    # the val loss the run logged at its last step is the average's
    model, vocab = model_from_checkpoint(payload)  # what sample.py builds: the average
    assert torch.equal(model.lm_head.weight, averaged["lm_head.weight"])
    cfg = payload["config"]
    ids = CharTokenizer(vocab).encode_tensor(SMALL_TEXT)
    train_ids, val_ids = split_ids(ids, cfg["data"]["val_fraction"], cfg["model"]["block_size"])
    losses = estimate_loss(model, {"train": train_ids, "val": val_ids}, cfg["model"]["block_size"],
                           cfg["train"]["batch_size"], cfg["train"]["eval_iters"], cfg["seed"] + 1, torch.device("cpu"))
    last = re.findall(r"step 20: train loss ([0-9.]+), val loss ([0-9.]+)", logged)
    assert last == [(f"{losses['train']:.4f}", f"{losses['val']:.4f}")]
    # without the average: one set of weights, nothing apart, and the same training (averaging and evaluating the
    # average change nothing of what the optimizer does)
    (tmp_path / "plain").mkdir()
    plain = load_checkpoint(train_small_run(tmp_path / "plain", **{"train.ema_decay": 0}) / "ckpt.pt")
    assert "training_weights" not in plain
    assert all(torch.equal(plain["model"][k], trained[k]) for k in trained)
