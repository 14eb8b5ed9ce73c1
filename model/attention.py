"""Masked multi-head self-attention, as the notes build it, plus a KV cache for sampling.

The masked multi-head step (scores, triangular mask, softmax, dropout, weighted sum of values) lives in
``masked_attention`` so that the model and the attention lab share one piece of code.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import GPTConfig
from .linear import Linear


def dot_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product scores q k^T / sqrt(head_size): (..., Tq, hs) x (..., Tk, hs) -> (..., Tq, Tk)."""
    return (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """PyTorch's fused scaled dot-product attention. With dropout under a CPU's autocast it runs with autocast off,
    its inputs cast to autocast's type, which is what autocast does to this operator (the same numbers): the compiled
    training step (torch.func.grad_and_value under torch.compile) cannot trace the autocast form's backward there
    (torch 2.13: "expected scalar type torch.float32 but found torch.bfloat16"; 2.14.1 fails as it runs: "expected m1
    and m2 to have the same dtype"), so configs/shakespeare_char.yaml,
    whose dtype is bfloat16 on a CPU with AVX-512 BF16, trained eagerly after a page of torch's traceback."""
    if kwargs.get("dropout_p") and q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        low = torch.get_autocast_dtype("cpu")
        mask = kwargs.get("attn_mask")
        if mask is not None and mask.is_floating_point():  # autocast casts it too
            kwargs["attn_mask"] = mask.to(low)
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.to(low), k.to(low), v.to(low), **kwargs)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


class AdditiveScore(nn.Module):
    """Additive (Bahdanau) scoring, score(q, k) = v^T tanh(W1 q + W2 k), shared by the heads of one layer."""

    def __init__(self, head_size: int) -> None:
        super().__init__()
        self.W1 = nn.Linear(head_size, head_size, bias=False)
        self.W2 = nn.Linear(head_size, head_size, bias=False)
        self.v = nn.Linear(head_size, 1, bias=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        # (..., Tq, 1, hs) + (..., 1, Tk, hs) -> (..., Tq, Tk, hs) -> (..., Tq, Tk)
        hidden = torch.tanh(self.W1(q).unsqueeze(-2) + self.W2(k).unsqueeze(-3))
        return self.v(hidden).squeeze(-1)


def causal_bias(size: int) -> torch.Tensor:
    """The notes' triangular mask as a bias to add to the scores, (size, size) float32: 0 where position i may see
    position j (j <= i), -inf where it may not."""
    # Made in place, in the bias's own memory: a boolean triangle, its negation and the fill held 2.5 times as much at
    # once (block_size 16,384: a peak of 2.85 GB, against 1.27 GB so).
    return torch.full((size, size), float("-inf")).triu_(1)


def hide_future(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """scores (..., Tq, Tk) with what a query may not see set to -inf. visible is the mask, (Tq, Tk): bool, True where
    a query may look, or as a float bias (causal_bias), which is added: the same scores wherever they are finite.
    The model keeps the bias, because compiled CPU code reads it far faster than booleans (the masked softmax of
    nanoGPT's CPU config, 12 x 4 x 64 x 64, took 320 us compiled with a bool mask and 105 us with the bias; eager
    190 and 110; 2 threads, Zen 4, measured side by side)."""
    if visible.dtype == torch.bool:
        return scores.masked_fill(~visible, float("-inf"))
    return scores + visible.to(scores.dtype)


def masked_attention(
    scores: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    dropout: nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The masked step of the notes: hide the future, softmax, dropout, weighted sum of values.

    scores: (..., Tq, Tk) raw attention scores; v: (..., Tk, hs); visible: (Tq, Tk), where a query may look (the
    lower triangle), as booleans (True: may look) or as a float bias (see hide_future); or any shape of two or more
    dimensions, (..., Tq or 1, Tk), that broadcasts against the scores, such as the notes' padding mask (B, 1, 1, Tk),
    one row of keys a sequence. Returns the context vectors (..., Tq, hs) and the attention weights (..., Tq, Tk).
    """
    if scores.device.type == "cpu" and scores.size(-1) <= 8:
        # Same numbers, faster: PyTorch's CPU softmax over a last dimension this short pays ~0.1 us per row,
        # which at block_size 8 costs more than the attention maths; over dim -2 of the transpose a vectorised
        # kernel runs (forward and backward about 1.5x faster, measured). For longer rows the plain form wins.
        scores_t = hide_future(scores.transpose(-2, -1), visible.transpose(-2, -1))  # (..., Tk, Tq)
        weights = F.softmax(scores_t, dim=-2).transpose(-2, -1)  # (..., Tq, Tk)
    else:
        weights = F.softmax(hide_future(scores, visible), dim=-1)
    if dropout is not None:
        weights = dropout(weights)
    return weights @ v, weights


class KVCache:
    """Keys and values of the positions already seen, per layer, so each new character costs one position."""

    def __init__(self, config: GPTConfig, batch_size: int, device: torch.device, dtype: torch.dtype) -> None:
        shape = (batch_size, config.n_head, config.block_size, config.head_size)
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.length = 0  # positions filled, the same in every layer once a forward pass is complete
        self.capacity = config.block_size

    def reset(self) -> None:
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nh, T, hs) after the cached positions; return all keys and values so far."""
        start, end = self.length, self.length + k.size(2)
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions, asked for {end}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention under the triangular mask, with one fused q/k/v projection."""

    # The compiled training step's own kernel for the masked attention, qkv (B, T, 3C) -> (B, T, C), and a digest of
    # its code: set by training/attention_kernel.py where it applies (a CPU, float32), None where the notes' code runs.
    # kernel_eager: the eager training step runs it too (training/eager_kernels.py), not only traced code.
    kernel: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    kernel_source = ""
    kernel_eager = False

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout_p = config.dropout
        self.fused = config.attention == "fused"
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.additive = AdditiveScore(config.head_size) if config.score == "additive" else None
        # mask[i, j] is 0 where position i may see position j (j <= i), -inf where it may not: the notes' triangular
        # mask, as the bias masked_attention adds to the scores (see hide_future).
        self.register_buffer("mask", causal_bias(config.block_size), persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
        need_weights: bool = False,
        qkv: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, C) -> (the attention output (B, T, C), each head's weights if asked). qkv: c_attn(x) (B, T, 3C),
        where the caller has it already (GPT.first_projections); x is then read for its shape alone."""
        B, T, C = x.shape
        offset = cache.length if cache is not None else 0
        qkv = self.c_attn(x) if qkv is None else qkv
        if self.takes_kernel(qkv, cache, need_weights):
            return self.resid_dropout(self.c_proj(self.kernel(qkv, self.n_head))), None
        q, k, v = (self.heads(t) for t in qkv.split(C, dim=2))  # (B, nh, T, hs) each
        if cache is not None:
            k, v = cache.append(layer, k, v)  # (B, nh, offset + T, hs)
        visible = self.mask[offset : offset + T, : offset + T]  # (T, offset + T)

        weights = None
        if self.takes_fused_kernel(need_weights):
            dropout_p = self.dropout_p if self.training else 0.0
            if offset == 0:
                y = fused_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
            else:
                y = fused_attention(q, k, v, attn_mask=visible.to(q.dtype), dropout_p=dropout_p)
        else:
            scores = self.additive(q, k) if self.additive is not None else dot_scores(q, k)  # (B, nh, T, Tk)
            y, weights = masked_attention(scores, v, visible, self.attn_dropout)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.resid_dropout(self.c_proj(y)), weights

    def takes_kernel(self, qkv: torch.Tensor, cache: KVCache | None, need_weights: bool) -> bool:
        """Whether this pass runs the training step's kernel (see kernel): only where the step is traced (or eager, with
        kernel_eager), computing gradients, in float32 on the CPU, over the whole window (no cache), keeping no
        weights."""
        return (self.kernel is not None and cache is None and not need_weights
                and (self.kernel_eager or torch.compiler.is_compiling())
                and torch.is_grad_enabled() and qkv.dtype == torch.float32 and qkv.device.type == "cpu")

    def takes_fused_kernel(self, need_weights: bool = False) -> bool:
        """Whether this pass runs PyTorch's fused kernel: always with attention=fused, and with manual for eager
        inference (eval mode, no gradients: evaluation, sampling) that keeps no weights, where it computes the same
        softmax of scaled dot products to float32 rounding in one call instead of six (eager sampling at block 8:
        about 15% less a character, measured on one thread). Training, the attention maps and compiled code keep the
        notes' explicit steps (inductor fuses those itself: compiled sampling at block 8 ran 10,000 characters a
        second with them, 8,900 with the fused kernel); additive scores have no fused kernel."""
        if need_weights or self.additive is not None:
            return False
        return self.fused or not (self.training or torch.is_grad_enabled() or torch.compiler.is_compiling())

    def heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, nh, T, hs): each head's slice of the channels."""
        B, T, C = t.shape
        return t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)

    def forward_at(self, x: torch.Tensor, row: torch.Tensor | None = None, qkv: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """The attention output (B, 1, C) of position row (a (1,) index; None: the last) alone: keys and values of
        every position of x (B, T, C), the query of that one, which sees positions 0..row. For sampling, where only
        the last position of the last layer matters (inference: no dropout, no weights kept). qkv: c_attn(x), where
        the caller has it already (x is then read for its shape alone); otherwise the query is projected at that
        one position only."""
        B, T, C = x.shape
        if qkv is not None:
            q, k, v = qkv.split(C, dim=2)
            q = q[:, -1:] if row is None else q.index_select(1, row)
        else:
            k, v = self.c_attn.part(x, C, 3 * C).split(C, dim=2)
            q = self.c_attn.part(x[:, -1:] if row is None else x.index_select(1, row), 0, C)
        q, k, v = self.heads(q), self.heads(k), self.heads(v)  # (B, nh, 1 | T, hs)
        # (1, T): the row of the triangular mask; the last one sees every position
        visible = self.mask[T - 1 : T, :T] if row is None else self.mask.index_select(0, row)[:, :T]
        if self.takes_fused_kernel():
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if row is None else visible.to(q.dtype))
            return self.c_proj(y.transpose(1, 2).reshape(B, 1, C))
        return self.attend(q, k, v, visible)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """The output (B, Tq, C) of the heads' queries q (B, nh, Tq, hs) over keys and values k, v (B, nh, Tk, hs),
        each query seeing what visible (Tq, Tk; see hide_future) lets it: the notes' steps, no dropout, no weights
        kept (inference: forward_at, and sampling's several characters a pass, model.span)."""
        scores = self.additive(q, k) if self.additive is not None else dot_scores(q, k)  # (B, nh, Tq, Tk)
        y, _ = masked_attention(scores, v, visible)
        B, _, Tq, _ = q.shape
        return self.c_proj(y.transpose(1, 2).reshape(B, Tq, self.n_embd))
