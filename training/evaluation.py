"""Evaluating a run: the mean loss of each split over the same windows every time, in passes sized for the device."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from data import get_batch

from .devices import autocast_context


@torch.no_grad()
def estimate_loss(
    model: nn.Module,
    splits: dict[str, torch.Tensor],
    block_size: int,
    batch_size: int,
    eval_iters: int,
    seed: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    stop: Callable[[], bool] | None = None,
) -> dict[str, float] | None:
    """Mean loss over eval_iters batches of each split, the same windows at every evaluation (a fixed seed),
    so the curves compare like with like. Batches are stacked into larger forward passes for speed.

    stop is asked before every forward pass; when it says so, the evaluation ends at once and returns None (a long
    evaluation must not keep Ctrl-C, or a scheduler's SIGTERM before its SIGKILL, waiting)."""
    was_training = model.training
    model.eval()
    windows = eval_iters * batch_size
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", 0)
    per_pass = eval_pass_sequences(block_size, batch_size, eval_iters, device, vocab_size)
    out = {}
    for name, data in splits.items():
        gen = torch.Generator().manual_seed(seed)
        # summed where the losses are, in float64, and read once a split: on a GPU the passes queue up behind each
        # other instead of each waiting for the one before to come back
        total, count = torch.zeros((), dtype=torch.float64, device=device), 0
        while count < windows:
            if stop is not None and stop():
                model.train(was_training)
                return None
            n = min(per_pass, windows - count)
            x, y = get_batch(data, block_size, n, gen, device)
            with autocast_context(device, dtype):
                _, loss = model(x, y)
            total += loss.double() * n
            count += n
        out[name] = total.item() / count
    model.train(was_training)
    return out


# Tokens per forward pass of an evaluation. Measured (2-core Zen 4 EPYC, 2 threads, float32, median of 5 interleaved
# rounds, both splits): tiny.yaml's 4,096 windows of 8 in 335 ms by passes of 8,192 tokens against 491 ms in one pass
# of 32,768 (4,096 tokens: 318 ms); the CPU config's 240 windows of 64 in 536 ms against 575 in one pass of 15,360.
# Larger passes were slower, likely because their activations no longer fit the CPU's caches. A GPU has no such
# cache to fit and pays per kernel launched, so it takes passes of up to EVAL_PASS_TOKENS_CUDA tokens.
EVAL_PASS_TOKENS = 8192
EVAL_PASS_TOKENS_CUDA = 65536
# At most this many logits a pass (32 MiB of float32): a pass's logits, and the log-softmax made of them, are vocab_size
# values a token, and a corpus of many characters made them the run's largest memory by far. Measured (2-core Zen 1
# EPYC, 2 threads, float32, tiny.yaml's model with a vocabulary of 60,000 characters, its 2,560 windows of 8, best of
# 3): passes of 1,024 windows 7.95 s and 5,944 MiB at the peak, passes of 128 windows 7.49 s and 965 MiB; with 5,000
# characters 0.78 s and 734 MiB against 0.73 s and 325 MiB. Tiny Shakespeare's 65 characters never reach it.
EVAL_PASS_LOGITS = 2**23


def eval_pass_sequences(block_size: int, batch_size: int, eval_iters: int, device: torch.device | None = None,
                        vocab_size: int = 0) -> int:
    """Windows per forward pass of an evaluation: at least a batch, up to EVAL_PASS_TOKENS tokens
    (EVAL_PASS_TOKENS_CUDA on a CUDA device) and EVAL_PASS_LOGITS logits (for a vocabulary of vocab_size)."""
    tokens = EVAL_PASS_TOKENS_CUDA if device is not None and device.type == "cuda" else EVAL_PASS_TOKENS
    if vocab_size > 0:
        tokens = min(tokens, EVAL_PASS_LOGITS // vocab_size)
    return max(batch_size, min(eval_iters * batch_size, tokens // block_size))


def evaluation_note(max_iters: int, step: int, eval_interval: int, eval_iters: int, grad_accum_steps: int
                    ) -> str | None:
    """A note for a run from step to max_iters that would spend longer evaluating than training, or None: it
    evaluates eval_iters batches of each split at every eval_interval-th step and the last, a batch costing about a
    third of a trained one (a forward pass, no backward: measured 0.26 for tiny.yaml and 0.36 for the CPU config,
    eager float32 AdamW steps, 2-core Zen 2 EPYC), and trains grad_accum_steps batches a step (in each process, as
    each process evaluates). A run with eval_iters in the millions looked hung at its first evaluation, saying
    nothing of why."""
    steps = max_iters - step
    if steps <= 0:
        return None
    evaluations = max_iters // eval_interval - step // eval_interval + (max_iters % eval_interval != 0)
    ratio = (2 * eval_iters * evaluations) / (3 * grad_accum_steps * steps)
    if ratio <= 1:
        return None
    times = f"{ratio:,.0f}" if ratio >= 10 else f"{ratio:.1f}"
    at = "at its one evaluation" if evaluations == 1 else f"at each of its {evaluations:,} evaluations"
    # (eval_iters is at least 2 here: the ratio of one batch is at most 2/3, evaluating at most once a step)
    trained = f"{steps * grad_accum_steps:,} batch{'' if steps * grad_accum_steps == 1 else 'es'}"
    return (f"note: this run will spend about {times} times as long evaluating as training: train.eval_iters="
            f"{eval_iters:,} batches of each split {at} (train.eval_interval={eval_interval:,}), against "
            f"{trained} trained; a smaller train.eval_iters or a larger train.eval_interval trains sooner")


# A step that would take longer than this at the machine's matrix-multiply ceiling gets a note (step_note).
LONG_STEP_SECONDS = 3600.0


def spelled_duration(seconds: float) -> str:
    """seconds as a person reads a long time: minutes, hours, days or years."""
    for unit, size in (("year", 365.25 * 86400), ("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1)):
        if seconds >= size or unit == "second":
            n = seconds / size
            shown = f"{n:.1e}" if n >= 1e6 else f"{n:,.0f}" if n >= 100 else f"{n:.3g}"
            return f"{shown} {unit}{'' if shown == '1' else 's'}"
    raise AssertionError  # the loop returns at "second"


def step_note(flops_per_step: float, ceiling: float, grad_accum_steps: int, batch_size: int) -> str | None:
    """A note for a step that would take over LONG_STEP_SECONDS even if each of its FLOPs (of every process) ran at
    the measured matrix-multiply ceiling (FLOP/s, every process's), or None: train.grad_accum_steps=10**6 sat in its
    first step with no word of why."""
    if not 0 < ceiling < float("inf") or flops_per_step / ceiling <= LONG_STEP_SECONDS:
        return None
    sequences = f"{batch_size:,} sequence{'' if batch_size == 1 else 's'}"
    micro = f"{grad_accum_steps:,} micro-batches of {sequences}" if grad_accum_steps > 1 else sequences
    fewer = "train.grad_accum_steps" if grad_accum_steps > 1 else "train.batch_size"
    return (f"note: each step trains {micro}: at least {spelled_duration(flops_per_step / ceiling)} a step here (its "
            f"products alone at the machine's matrix-multiply ceiling); a smaller {fewer} steps sooner")
