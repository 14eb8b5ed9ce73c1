"""The later notes' attention modules under their names: the fourth note's ``ScaledDotProductAttention`` and
``MultiHeadAttention`` (queries and keys of size d_k, values of size d_v, a mask, Add & Norm), and the fifth note's
single head on a batch of random tokens, with what its scaling does to the scores' variance.

The first notes' modules, built on the six-word example, are in ``lab.notes``. These too run the GPT's own
``masked_attention`` for the mask and the softmax, and they are checked against the model
(``tests/test_lab_notes_modules.py``: the fourth note's module, given a GPT block's weights, is that block's
post-norm attention).
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

if not __package__:  # run as a file (python lab/notes_modules.py): the project's packages are one folder up
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # functions, not a command: said at once, before the seconds of importing torch
    from lab import not_a_command

    raise SystemExit(not_a_command("lab/notes_modules.py"))

import torch
from torch import nn

from model.attention import masked_attention


class ScaledDotProductAttention(nn.Module):
    """softmax(q k^T / temperature) v, the fourth note's core: temperature is sqrt(d_k), and dropout falls on the
    weights. q (B, h, len_q, d_k), k (B, h, len_k, d_k), v (B, h, len_k, d_v) -> the output (B, h, len_q, d_v) and
    the weights (B, h, len_q, len_k).

    mask says where a query may look (True or 1) and broadcasts against the weights: the padding mask
    (B, 1, 1, len_k), the triangle (len_q, len_k), or both combined. The note fills the hidden scores with -1e9;
    this fills them with -inf, which gives the same weights (exp(-1e9 - max) is 0 in float32 too) and, when a row
    hides every key, no weights at all (NaN) rather than a silent uniform average over what it should not see.
    """

    def __init__(self, temperature: float, attn_dropout: float = 0.1) -> None:
        super().__init__()
        self.temperature = temperature
        self.dropout = nn.Dropout(attn_dropout)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = (q / self.temperature) @ k.transpose(-2, -1)  # (B, h, len_q, len_k)
        visible = torch.ones(1, 1, dtype=torch.bool, device=q.device) if mask is None else mask != 0
        return masked_attention(scores, v, visible, self.dropout)


class MultiHeadAttention(nn.Module):
    """The fourth note's multi-head attention: n_head heads whose queries and keys are d_k wide and values d_v wide,
    concatenated (n_head * d_v) and projected back to d_model by fc, then dropout, the residual (the queries' input)
    and a layer norm: the note's Add & Norm, LayerNorm(q + MHA(q, k, v)). No biases, as the note has none.

    q (B, len_q, d_model), k and v (B, len_k, d_model): the same tensor for self-attention, the encoder's output for
    cross-attention. mask, as the note takes it, has a row of keys for each sequence and query, and a head dimension
    is put in for it: (B, 1, len_k) the keys each sequence may look at (False or 0: padding), (1, len_q, len_k) the
    triangle, or (B, len_q, len_k) both. Returns the output (B, len_q, d_model) and the weights (B, n_head, len_q,
    len_k).
    """

    def __init__(self, n_head: int, d_model: int, d_k: int, d_v: int, dropout: float = 0.1) -> None:
        super().__init__()
        if min(n_head, d_model, d_k, d_v) < 1:
            raise ValueError(f"n_head, d_model, d_k and d_v must be at least 1, got {n_head}, {d_model}, {d_k}, {d_v}")
        self.n_head, self.d_k, self.d_v = n_head, d_k, d_v
        self.w_qs = nn.Linear(d_model, n_head * d_k, bias=False)
        self.w_ks = nn.Linear(d_model, n_head * d_k, bias=False)
        self.w_vs = nn.Linear(d_model, n_head * d_v, bias=False)
        self.fc = nn.Linear(n_head * d_v, d_model, bias=False)
        self.attention = ScaledDotProductAttention(temperature=d_k**0.5, attn_dropout=dropout)
        self.dropout = nn.Dropout(dropout)
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, len_q, len_k = q.size(0), q.size(1), k.size(1)
        if mask is not None and mask.dim() != 3:  # a (len_q, len_k) triangle would line up with batch and heads
            raise ValueError(f"mask must be (B or 1, len_q or 1, len_k), as the note takes it, got "
                             f"{tuple(mask.shape)}; give the triangle as (1, len_q, len_k)")
        residual = q
        heads = self.n_head
        q = self.w_qs(q).view(B, len_q, heads, self.d_k).transpose(1, 2)  # (B, h, len_q, d_k)
        k = self.w_ks(k).view(B, len_k, heads, self.d_k).transpose(1, 2)  # (B, h, len_k, d_k)
        v = self.w_vs(v).view(B, len_k, heads, self.d_v).transpose(1, 2)  # (B, h, len_k, d_v)
        mask = None if mask is None else mask.unsqueeze(1)  # the same for every head
        out, weights = self.attention(q, k, v, mask)  # (B, h, len_q, d_v)
        out = out.transpose(1, 2).reshape(B, len_q, heads * self.d_v)  # the heads side by side
        return self.layer_norm(residual + self.dropout(self.fc(out))), weights


class SingleHead(NamedTuple):
    """The fifth note's head on x (B, T, C): its masked weights and output, and its scores' variance."""

    weights: torch.Tensor  # (B, T, T)
    out: torch.Tensor  # (B, T, head_size)
    variance_unscaled: float  # of q k^T, for q and k of unit variance: about head_size
    variance_scaled: float  # of q k^T / sqrt(head_size): about 1
    peak_unscaled: float  # the largest weight of the last row (every key in view), on average, without the scaling
    peak_scaled: float  # the same with it


# Random sequences the variances and peaks are measured over: 1,000 of T x T scores put the variance within about 2%.
VARIANCE_SEQUENCES = 1000


def single_head(x: torch.Tensor, head_size: int = 16, seed: int = 1337) -> SingleHead:
    """The fifth note's one head: key, query and value layers (C -> head_size, no bias, drawn in that order from
    torch's global generator, as the note's code draws them right after x) on x, scores q k^T / sqrt(head_size) under
    the triangular mask, softmax, weighted sum of the values. The variances and peaks are measured on q and k drawn
    with unit variance (torch.randn from a generator of its own, seeded with seed, VARIANCE_SEQUENCES of them), as the
    note states its claim: scaling keeps the scores at unit variance, so the softmax stays diffuse rather than near
    one-hot."""
    T, C = x.size(-2), x.size(-1)
    generator = torch.Generator().manual_seed(seed)
    key, query, value = (nn.Linear(C, head_size, bias=False) for _ in range(3))
    with torch.no_grad():
        k, q, v = key(x), query(x), value(x)
        triangle = torch.ones(T, T, dtype=torch.bool).tril()
        out, weights = masked_attention(q @ k.transpose(-2, -1) * head_size**-0.5, v, triangle)
    unit_q = torch.randn(VARIANCE_SEQUENCES, T, head_size, generator=generator)
    unit_k = torch.randn(VARIANCE_SEQUENCES, T, head_size, generator=generator)
    raw = unit_q @ unit_k.transpose(-2, -1)  # (N, T, T)
    scaled = raw * head_size**-0.5

    def peak(scores: torch.Tensor) -> float:
        return scores[:, -1].softmax(dim=-1).max(dim=-1).values.mean().item()

    return SingleHead(weights, out, raw.var().item(), scaled.var().item(), peak(raw), peak(scaled))
