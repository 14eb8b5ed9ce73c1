"""The sorting task: random sequences, their sorted copies, and how a model's answers are scored.

Sequences of mixed lengths share a batch by padding: each one ends in the token ``digits`` up to the batch's
length. The padding sorts after every digit, so a padded sequence's sorted copy is its digits sorted and then the
same padding, and the loss and the accuracy leave those positions out.
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

if not __package__:  # run as a file (python lab/sort_task.py): the project's packages are one folder up
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # functions, not a command: said at once, before the seconds of importing torch
    from lab import not_a_command

    raise SystemExit(not_a_command("lab/sort_task.py"))

import torch
import torch.nn.functional as F

from lab.seq2seq import GRUSeq2Seq, TransformerSeq2Seq, source_lengths


class Batch(NamedTuple):
    src: torch.Tensor  # (B, T) digits as drawn, then the padding (the token ``digits``) of a shorter sequence
    tgt_in: torch.Tensor  # (B, T) the start token, then the sorted digits but the last: what teacher forcing feeds
    tgt: torch.Tensor  # (B, T) the sorted digits, then the same padding


def sorting_batch(
    n: int, length: int, digits: int, generator: torch.Generator, min_length: int | None = None
) -> Batch:
    """n random sequences and their sorted versions; the start token is ``digits``. With min_length below length,
    each sequence holds from min_length to length digits (uniformly) and the rest of its row is padding, the token
    ``digits`` too: the start token of the outputs, the padding of the inputs."""
    src = torch.randint(0, digits, (n, length), generator=generator)
    if min_length is not None and min_length < length:
        lengths = torch.randint(min_length, length + 1, (n, 1), generator=generator)
        src = src.masked_fill(torch.arange(length) >= lengths, digits)
    tgt = src.sort(dim=-1).values  # the padding, the largest token, stays at the end
    start = torch.full((n, 1), digits, dtype=torch.long)
    return Batch(src, torch.cat([start, tgt[:, :-1]], dim=1), tgt)


def sorting_loss(logits: torch.Tensor, tgt: torch.Tensor, digits: int) -> torch.Tensor:
    """Mean cross-entropy over the positions that hold a digit: logits (B, T, digits), tgt (B, T)."""
    return F.cross_entropy(logits.reshape(-1, digits), tgt.reshape(-1), ignore_index=digits)


def right_answers(out: torch.Tensor, tgt: torch.Tensor, digits: int) -> torch.Tensor:
    """(B,) True where the answer out (B, T) has every digit of tgt right; what it says over the padding is no part
    of the answer."""
    return ((out == tgt) | (tgt == digits)).all(dim=-1)


def evaluate(model: GRUSeq2Seq | TransformerSeq2Seq, batch: Batch) -> tuple[float, torch.Tensor | None]:
    """Exact-sequence accuracy of greedy decoding (every digit right), and its attention (B, T_out, T_in)."""
    accuracy, _, weights = decode(model, batch)
    return accuracy, weights


def decode(model: GRUSeq2Seq | TransformerSeq2Seq, batch: Batch) -> tuple[float, torch.Tensor, torch.Tensor | None]:
    """Greedy decoding of the batch: its exact-sequence accuracy, its answers (B, T) and its attention (B, T_out,
    T_in), row t of which is taken while writing answer digit t."""
    model.eval()
    out, weights = model.greedy(batch.src)
    return right_answers(out, batch.tgt, model.config.digits).float().mean().item(), out, weights


class PaddingCheck(NamedTuple):
    """What the padding does to a model's answers: decoded in the padded batch and each sequence alone."""

    changed: int  # answers that differ (on their digits) between the two
    accuracy_alone: float  # exact-sequence accuracy of the answers decoded alone


@torch.no_grad()
def decoded_alone(model: GRUSeq2Seq | TransformerSeq2Seq, src: torch.Tensor) -> torch.Tensor:
    """Greedy answers (B, T) to the padded sequences src (B, T), each decoded without its padding (the sequences of
    one length as one batch of that length), the token ``digits`` after each answer's end."""
    model.eval()
    lengths = source_lengths(model.config, src)
    out = torch.full_like(src, model.config.digits)
    for n in lengths.unique().tolist():
        rows = lengths == n
        out[rows, :n] = model.greedy(src[rows, :n])[0]
    return out


def padding_check(model: GRUSeq2Seq | TransformerSeq2Seq, batch: Batch) -> PaddingCheck:
    """The held-out batch decoded as it is, padded, and each sequence alone: with the padding mask the answers are
    the same, as the mask promises; without it, whatever the padding in view changed."""
    model.eval()
    digits = model.config.digits
    padded, alone = model.greedy(batch.src)[0], decoded_alone(model, batch.src)
    changed = ((padded != alone) & (batch.tgt != digits)).any(dim=-1)
    return PaddingCheck(int(changed.sum()), right_answers(alone, batch.tgt, digits).float().mean().item())
