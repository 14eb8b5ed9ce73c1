"""training/loop.py: a step whose loss or gradient is not finite stops the run before the update, in one line that
says what to try, and the last checkpoint stays as it was."""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import ROOT, tiny_overrides
from test_train import bitwise_equal, snapshot
from training_runs import TINY, call, one_line, train_main, write_corpus

from configs import to_dict
from configs.userinput import shown
from model import GPT, GPTConfig, load_checkpoint


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
        assert f"the last good checkpoint '{shown(out / 'ckpt.pt')}' (step 10) is untouched" in line
        assert load_checkpoint(out / "ckpt.pt")["step"] == load_checkpoint(out / "best.pt")["step"] == 10
    else:
        assert "no checkpoint had been written yet" in line
        assert not (out / "ckpt.pt").exists()


@pytest.mark.parametrize("poison", ["loss", "gradient"])
def test_a_float16_run_stops_where_its_gradient_scaler_cannot_help(tmp_path, capsys, monkeypatch, poison):
    """float16's gradient scaler skips a step whose gradients overflow, and lowers its scale. A loss that overflows
    (weights grown too large) it cannot mend: the run skipped every step to the end, logged NaN losses and exited 0.
    Gradients that overflow at every scale end the run once the scale falls below 1."""
    import training.loop

    real_forward = GPT.forward
    seen: dict = {"calls": 0}

    def forward(self, *args, **kwargs):
        result = real_forward(self, *args, **kwargs)
        if not self.training or result[1] is None:
            return result
        seen["calls"] += 1
        if seen["calls"] < 3:
            return result
        loss = result[1] * math.nan if poison == "loss" else InfiniteGradient.apply(result[1])
        return (result[0], loss, *result[2:])

    monkeypatch.setattr(GPT, "forward", forward)
    out = tmp_path / "out"
    keys = {"train.dtype": "float16", "train.max_iters": 40, "train.eval_interval": 40}
    code, stdout, err = call(train_main, ["--config", TINY, *tiny_overrides(write_corpus(tmp_path), out, **keys)],
                             capsys)
    assert code == 1, err
    line = one_line(err)
    # the scale starts at 2**16 and halves at each skipped step: 17 skips take it below 1
    at_step = 3 if poison == "loss" else 3 + 16
    assert training.loop.MIN_FLOAT16_SCALE == 1.0
    assert f"training diverged at step {at_step} " in line, line
    assert "train.dtype=float32" in line and "no checkpoint had been written yet" in line
    assert not (out / "ckpt.pt").exists()


@pytest.mark.parametrize(("step", "loss", "compiled", "dtype", "advice"), [
    (1, math.nan, True, "float32", "train.compile=false"),  # the first loss of compiled code: the code, not the rate
    (1, math.nan, True, "auto", "train.compile=false"),  # auto that resolved to float32: nothing to say of the dtype
    (1, math.inf, False, "bfloat16", "train.dtype=float32"),
    (1, math.nan, False, "float32", "train.learning_rate"),  # nothing else to suggest
    (1, 2.5, True, "float32", "train.learning_rate"),  # a finite first loss: its gradients may overflow
    (7, math.nan, True, "float32", "train.learning_rate"),  # updates came before it
], ids=["compiled-first", "auto-first", "bfloat16-first", "eager-first", "finite-first", "later"])
def test_a_first_step_that_is_not_finite_blames_the_code_or_dtype_not_the_learning_rate(step, loss, compiled, dtype,
                                                                                          advice):
    from training.config import load_config
    from training.errors import Diverged, divergence_advice

    cfg = load_config(TINY, [f"train.dtype={dtype}", "out_dir=runs/x"])
    resolved = "float32" if dtype == "auto" else dtype  # as the trainer reports it
    line = divergence_advice(Diverged(step, loss, math.nan, None, compiled=compiled, dtype=resolved), cfg)
    assert line.startswith(f"training diverged at step {step} ") and "\n" not in line
    assert advice in line and line.endswith("in a new run (another out_dir, or --overwrite)")
    blamed_code = advice != "train.learning_rate"
    assert ("the learning rate is not the cause" in line) is blamed_code
    assert ("train.learning_rate" in line) is not blamed_code and ("train.warmup_iters" in line) is not blamed_code
    assert ("train.compile=false" in line) is (blamed_code and compiled)
    assert ("train.dtype=float32" in line) is (resolved != "float32")


def test_an_evaluation_on_a_gpu_takes_longer_passes():
    from training.evaluation import EVAL_PASS_TOKENS, EVAL_PASS_TOKENS_CUDA, eval_pass_sequences

    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device named, not used: no GPU needed
    # configs/shakespeare_char.yaml: batches of 64 windows of 256, 200 of them a split
    assert EVAL_PASS_TOKENS // 256 < 64 and eval_pass_sequences(256, 64, 200, cpu) == 64  # never less than a batch
    assert eval_pass_sequences(256, 64, 200, cuda) == EVAL_PASS_TOKENS_CUDA // 256 == 256
    assert eval_pass_sequences(256, 64, 2, cuda) == 128  # never more than the evaluation's windows
    assert eval_pass_sequences(8, 32, 20) == eval_pass_sequences(8, 32, 20, cpu) == 640


def test_a_large_vocabulary_takes_shorter_evaluation_passes_and_the_memory_check_counts_them():
    """A pass's logits are vocab_size values a token: with 60,000 characters tiny.yaml's passes of 1,024 windows
    peaked at 5.8 GiB (128 windows: 0.94 GiB, and no slower), and the memory check refused machines that had room."""
    from training.evaluation import EVAL_PASS_LOGITS, eval_pass_sequences
    from training.memory import training_need

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert eval_pass_sequences(8, 128, 20, cpu, 65) == 1024  # tiny.yaml on Tiny Shakespeare: as before
    assert eval_pass_sequences(8, 128, 20, cuda, 65) == 2560
    assert eval_pass_sequences(8, 128, 20, cpu, 5_000) == EVAL_PASS_LOGITS // 5_000 // 8 == 209
    assert eval_pass_sequences(8, 128, 20, cpu, 60_000) == 128  # never less than a batch
    assert eval_pass_sequences(8, 128, 20, cuda, 60_000) == 128
    model = GPTConfig(vocab_size=60_000, block_size=8, n_layer=3, n_head=4, n_embd=64)
    passes = eval_pass_sequences(8, 128, 20, cpu, 60_000)
    before, now = training_need(model, 128, 1024), training_need(model, 128, passes)
    # measured: a peak of 5.8 GiB before, 0.94 GiB now; counted from above, five vocabulary-wide floats a trained
    # position (training/memory.py: a vocabulary of 1,112,032 characters peaked at 3.9), 1.22 GiB
    assert before.total > 5 * 2**30 and now.total < 1.25 * 2**30


def test_a_step_that_cannot_end_soon_says_how_long_it_takes_at_least(tmp_path, capsys, monkeypatch):
    """train.grad_accum_steps=10**18 (or 10**6) sat in its first step with no word of why."""
    import training.evaluation
    from training.config import load_config
    from training.evaluation import step_note

    assert step_note(3.6e14, 1e11, 1000, 64) is None  # an hour at the ceiling: no note
    assert step_note(1e18, 1e11, 10**6, 128) == (
        "note: each step trains 1,000,000 micro-batches of 128 sequences: at least 116 days a step here (its products "
        "alone at the machine's matrix-multiply ceiling); a smaller train.grad_accum_steps steps sooner")
    assert "trains 1,000,000,000,000,000,000 micro-batches of 1 sequence: at least 3.2e+07 years a step" in step_note(
        1e29, 1e14, 10**18, 1)
    assert "trains 1,000,000,000 sequences: at least 1 hour a step here" in step_note(3.61e14, 1e11, 1, 10**9)
    assert "at least 1,000 years" in step_note(365.25 * 86400 * 1000, 1, 2, 2)  # not 1e+03
    assert "a smaller train.batch_size" in step_note(1e18, 1e11, 1, 10**9)
    assert step_note(1e18, float("inf"), 10**6, 1) is None  # no ceiling measured
    for config in sorted((ROOT / "configs").glob("*.yaml")):  # the shipped configs' steps take well under an hour
        cfg = load_config(str(config), [])
        flops = GPT(GPTConfig(**{**to_dict(cfg.model), "vocab_size": 65})).flops_per_token() * \
            cfg.train.batch_size * cfg.model.block_size * cfg.train.grad_accum_steps
        assert step_note(flops, 1e10, cfg.train.grad_accum_steps, cfg.train.batch_size) is None, config
    monkeypatch.setattr(training.evaluation, "LONG_STEP_SECONDS", 0.0)  # every step is long: the run says so
    overrides = tiny_overrides(write_corpus(tmp_path), tmp_path / "out", **{"train.max_iters": 2,
                                                                              "train.grad_accum_steps": 3})
    code, out, err = call(train_main, ["--config", TINY, *overrides], capsys)
    assert code == 0, err
    assert out.count("note: each step trains 3 micro-batches of ") == 1


def test_a_run_that_would_evaluate_longer_than_it_trains_says_so(tmp_path, capsys):
    """train.eval_iters in the millions was taken without a word, and the run looked hung at its first evaluation."""
    from training.config import load_config
    from training.evaluation import evaluation_note

    for config in sorted((ROOT / "configs").glob("*.yaml")):  # the shipped configs spend far less on evaluating
        tc = load_config(str(config), []).train
        assert evaluation_note(tc.max_iters, 0, tc.eval_interval, tc.eval_iters, tc.grad_accum_steps) is None, config
    # 2 x 1,000 batches at each of 10 evaluations, a third of a trained batch each, against 1,000 batches trained
    assert evaluation_note(1000, 0, 100, 1000, 1).startswith("note: this run will spend about 6.7 times as long "
                                                             "evaluating as training: train.eval_iters=1,000 ")
    assert evaluation_note(1000, 0, 100, 1000, 8) is None  # 8 micro-batches a step: 8,000 batches trained
    assert "at its one evaluation" in evaluation_note(25, 20, 10, 100, 1)  # resumed at 20: step 25's alone
    assert evaluation_note(20, 20, 10, 10**9, 1) is None  # nothing left to train
    assert "(train.eval_interval=10), against 1 batch trained;" in evaluation_note(1, 0, 10, 32, 1)  # "1 batches"
    overrides = tiny_overrides(write_corpus(tmp_path), tmp_path / "out", **{"train.max_iters": 4,
                                                                              "train.eval_iters": 50})
    code, out, err = call(train_main, ["--config", TINY, *overrides], capsys)
    assert code == 0, err
    assert ("note: this run will spend about 8.3 times as long evaluating as training: train.eval_iters=50 batches "
            "of each split at its one evaluation (train.eval_interval=10), against 4 batches trained") in out


def test_an_evaluation_split_into_passes_reads_what_one_pass_reads(monkeypatch):
    """estimate_loss's passes (EVAL_PASS_TOKENS tokens at most, the last one shorter) see the windows one pass would
    and weigh each window alike: the loss is the same up to the order of the additions."""
    import training.evaluation
    from data import get_batch
    from training.evaluation import estimate_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16))
    ids = torch.randint(0, 11, (500,), generator=torch.Generator().manual_seed(1))
    splits = {"train": ids[:400], "val": ids[400:]}
    losses = {}
    for tokens in (10**6, 7 * 8):  # one pass of 5 x 6 = 30 windows; passes of 7, 7, 7, 7 and 2
        monkeypatch.setattr(training.evaluation, "EVAL_PASS_TOKENS", tokens)
        losses[tokens] = estimate_loss(model, splits, 8, 5, 6, 3, torch.device("cpu"))
    monkeypatch.setattr(training.evaluation, "EVAL_PASS_TOKENS", 10**6)
    monkeypatch.setattr(training.evaluation, "EVAL_PASS_LOGITS", 11 * 7 * 8)  # the model's 11 characters: 7 windows
    passes: list[int] = []  # the windows of each pass, as drawn
    monkeypatch.setattr(training.evaluation, "get_batch", lambda *a: passes.append(a[2]) or get_batch(*a))
    assert estimate_loss(model, splits, 8, 5, 6, 3, torch.device("cpu")) == losses[56]  # the same passes
    assert passes == [7, 7, 7, 7, 2] * 2  # each split's
    assert losses[10**6].keys() == {"train", "val"}
    for split in ("train", "val"):
        assert losses[56][split] == pytest.approx(losses[10**6][split], rel=1e-6, abs=0)
    # the mean over the 30 windows that the seed draws, in one forward pass here
    x, y = get_batch(splits["val"], 8, 30, torch.Generator().manual_seed(3), torch.device("cpu"))
    with torch.no_grad():
        assert losses[56]["val"] == pytest.approx(model(x, y)[1].item(), rel=1e-6, abs=0)


@pytest.mark.parametrize("clip", [1e-3, 0.0], ids=["clipped", "unclipped"])
def test_the_gradients_the_optimizer_steps_with_are_clipped_to_grad_clip(tmp_path, capsys, monkeypatch, clip):
    """train.grad_clip limits the norm of the gradients the eager step hands the optimizer (0: no limit). Nothing else
    saw it: Adam's updates hardly change when all gradients shrink alike, so a run that never clipped trained as one
    that did, and the compiled step's tests clip on both sides of their comparison."""
    from training import optim

    norms: list[float] = []
    for cls in (optim.AdamW, optim.Muon):  # tiny.yaml's optimizer, and the other

        def step(self, closure=None, real=cls.step):
            grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
            norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())
            return real(self, closure)

        monkeypatch.setattr(cls, "step", step)
    keys = {"train.grad_clip": clip, "train.max_iters": 3, "train.eval_interval": 3}
    code, _, err = call(train_main, ["--config", TINY, *tiny_overrides(write_corpus(tmp_path), tmp_path / "out",
                                                                       **keys)], capsys)
    assert code == 0, err
    assert len(norms) == 3
    if clip:
        assert all(n <= clip * (1 + 1e-4) for n in norms), norms
    else:  # the control: these gradients are far above the limit the other run sets
        assert all(n > 100 * 1e-3 for n in norms), norms
