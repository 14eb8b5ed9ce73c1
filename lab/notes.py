"""The notes' attention, step by step: each step of the attention notes as a small, documented function or module.

The notes build attention up on one worked example, six 3-d embeddings of "Your journey starts with one
step": attention without trainable weights, then with trainable query/key/value matrices (``SelfAttention_v1``
and ``SelfAttention_v2``), then the causal mask (two ways), dropout on the attention weights, a causal head
(``CausalAttention``) and multi-head attention (``MultiHeadAttentionWrapper``, ``MultiHeadAttention``). Additive
(Bahdanau) scoring sits beside the scaled dot product as in the notes' list of scoring functions.

Every masked step calls ``model.attention.masked_attention``, the code the GPT runs, so what the lab shows and
what its tests check is the model's own attention, not a second copy of it.
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

if not __package__:  # run as a file (python lab/notes.py): the project's packages are one folder up
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # functions, not a command: said at once, before the seconds of importing torch
    from lab import not_a_command

    raise SystemExit(not_a_command("lab/notes.py"))

import torch
from torch import nn

from model.attention import AdditiveScore, dot_scores, masked_attention

WORDS = ("Your", "journey", "starts", "with", "one", "step")
SCORE_KINDS = ("dot", "additive")


def journey_inputs() -> torch.Tensor:
    """The notes' embeddings of "Your journey starts with one step": row i is x^(i+1), shape (6, 3)."""
    return torch.tensor(
        [
            [0.43, 0.15, 0.89],  # Your     (x^1)
            [0.55, 0.87, 0.66],  # journey  (x^2)
            [0.57, 0.85, 0.64],  # starts   (x^3)
            [0.22, 0.58, 0.33],  # with     (x^4)
            [0.77, 0.25, 0.10],  # one      (x^5)
            [0.05, 0.80, 0.55],  # step     (x^6)
        ]
    )


# --- Simple self-attention without trainable weights -------------------------------------------------------


def attention_scores_for_query(inputs: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Attention scores w_i = x^i . query of one query against every input: (T, d), (d,) -> (T,).

    The dot product is the notes' measure of similarity: the more two embeddings point the same way, the larger.
    """
    return inputs @ query


def normalise_by_sum(scores: torch.Tensor) -> torch.Tensor:
    """The notes' first normalisation, scores / sum(scores): sums to 1 but, unlike softmax, keeps negative scores
    negative, which is why the notes move on to softmax."""
    return scores / scores.sum(dim=-1, keepdim=True)


def softmax_naive(scores: torch.Tensor) -> torch.Tensor:
    """exp(w) / sum(exp(w)) over the last dimension, written out as in the notes.

    It overflows for large scores (exp(100) is inf in float32); ``torch.softmax`` subtracts the maximum first and
    gives the same numbers where both are finite.
    """
    exp = torch.exp(scores)
    return exp / exp.sum(dim=-1, keepdim=True)


def context_vector(weights: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """Context vector z = sum_i alpha_i x^i, the attention-weighted sum of the inputs: (T,), (T, d) -> (d,).

    Batched over leading dimensions too: (Tq, T) weights give one context vector per query, (Tq, d).
    """
    return weights @ inputs


class SimpleAttention(NamedTuple):
    """Scores, weights and context vectors of one attention computation."""

    scores: torch.Tensor
    weights: torch.Tensor
    context: torch.Tensor


def simple_self_attention(inputs: torch.Tensor) -> SimpleAttention:
    """Attention without trainable weights for all inputs at once: scores X X^T (T, T), row softmax, weights @ X.

    Row i of each result is what the one-query functions give for query x^(i+1); no scaling, as in the notes.
    """
    scores = inputs @ inputs.T  # (T, T): scores[i, j] = x^i . x^j
    weights = torch.softmax(scores, dim=-1)  # each row sums to 1
    return SimpleAttention(scores, weights, context_vector(weights, inputs))


# --- Self-attention with trainable weights -----------------------------------------------------------------


def scaled_attention_weights(scores: torch.Tensor, d_k: int) -> torch.Tensor:
    """softmax(scores / sqrt(d_k)): scaling keeps large dot products from saturating the softmax, whose gradients
    would then vanish; it is the "scaled" in scaled dot-product attention."""
    return torch.softmax(scores / d_k**0.5, dim=-1)


class QueryAttention(NamedTuple):
    """One query's trip through trainable-weight attention, each step as the notes print it."""

    query: torch.Tensor  # q = x W_q, (d_out,)
    scores: torch.Tensor  # w_i = q . k^i, unscaled, (T,)
    weights: torch.Tensor  # softmax(w / sqrt(d_k)), (T,)
    context: torch.Tensor  # sum_i alpha_i v^i, (d_out,)


def trainable_attention_for_query(
    x: torch.Tensor,
    inputs: torch.Tensor,
    W_query: torch.Tensor,
    W_key: torch.Tensor,
    W_value: torch.Tensor,
) -> QueryAttention:
    """The notes' step-by-step computation of z^(2): project x to a query and every input to a key and a value
    with the (d_in, d_out) matrices, score the query against the keys, scale and softmax, weight the values."""
    query = x @ W_query  # (d_out,)
    keys = inputs @ W_key  # (T, d_out)
    values = inputs @ W_value  # (T, d_out)
    scores = keys @ query  # (T,)
    weights = scaled_attention_weights(scores, keys.shape[-1])
    return QueryAttention(query, scores, weights, weights @ values)


class SelfAttention_v1(nn.Module):
    """Self-attention with raw (d_in, d_out) parameter matrices drawn by ``torch.rand``, as the notes first write it.

    ``generator`` draws the three matrices (query, key, value, in that order); left out, the global generator is
    used, so ``torch.manual_seed(123)`` before construction gives the notes' numbers.
    """

    def __init__(self, d_in: int, d_out: int, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.d_out = d_out
        self.W_query = nn.Parameter(torch.rand(d_in, d_out, generator=generator))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out, generator=generator))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        queries = x @ self.W_query  # (T, d_out)
        keys = x @ self.W_key  # (T, d_out)
        values = x @ self.W_value  # (T, d_out)
        weights = torch.softmax(dot_scores(queries, keys), dim=-1)  # (T, T), no mask: every position sees all
        return weights @ values


class SelfAttention_v2(nn.Module):
    """Self-attention with ``nn.Linear`` projections: the same computation as v1 with Linear's initialisation
    (uniform in +-1/sqrt(d_in)) and an optional bias. The layers are built query, key, value, as in the book."""

    def __init__(self, d_in: int, d_out: int, qkv_bias: bool = False) -> None:
        super().__init__()
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        queries, keys, values = self.W_query(x), self.W_key(x), self.W_value(x)  # (T, d_out) each
        weights = torch.softmax(dot_scores(queries, keys), dim=-1)  # (T, T)
        return weights @ values


def copy_v2_weights_into_v1(v1: SelfAttention_v1, v2: SelfAttention_v2) -> None:
    """Give v1 the projections of v2 so both return the same context vectors (the notes' exercise).

    ``nn.Linear`` stores its weight as (d_out, d_in) and computes x W^T, while v1 computes x W with W (d_in, d_out):
    v1 needs the transpose. v1 has no bias, so a v2 built with ``qkv_bias=True`` cannot be copied.
    """
    for name in ("W_query", "W_key", "W_value"):
        linear: nn.Linear = getattr(v2, name)
        target: nn.Parameter = getattr(v1, name)
        if linear.bias is not None:
            raise ValueError(f"{name}: SelfAttention_v1 has no bias; build SelfAttention_v2 with qkv_bias=False")
        if linear.weight.T.shape != target.shape:
            raise ValueError(
                f"{name}: v1 is {tuple(target.shape)}, v2's transposed weight is {tuple(linear.weight.T.shape)}"
            )
        with torch.no_grad():
            target.copy_(linear.weight.T)


def v2_as_built_in_001(seed: int = 123) -> SelfAttention_v2:
    """The SelfAttention_v2(3, 2) whose weights 001 masks (001 In[58]): built after torch.manual_seed(seed) with its
    layers made key, value, query, where this class makes them query, key, value; the order decides which draws
    each layer gets, so 001's draws are made in its order and loaded into this class."""
    torch.manual_seed(seed)
    key, value, query = (nn.Linear(3, 2, bias=False) for _ in range(3))
    v2 = SelfAttention_v2(3, 2)
    with torch.no_grad():
        for name, layer in (("W_query", query), ("W_key", key), ("W_value", value)):
            getattr(v2, name).weight.copy_(layer.weight)
    return v2


# --- Causal masking ----------------------------------------------------------------------------------------


def causal_mask(T: int, device: torch.device | None = None) -> torch.Tensor:
    """(T, T) bool, True on and below the diagonal: position i may look at positions j <= i, never the future."""
    return torch.tril(torch.ones(T, T, dtype=torch.bool, device=device))


def renormalised_causal_weights(weights: torch.Tensor) -> torch.Tensor:
    """Causal mask, way (a) of the notes: zero the softmax weights above the diagonal, then divide each row by its
    new sum. Equal to way (b) because softmax restricted to the visible positions is exactly this renormalisation."""
    T = weights.size(-1)
    kept = weights * causal_mask(T, weights.device)  # (..., T, T)
    return kept / kept.sum(dim=-1, keepdim=True)


def causal_softmax_attention(
    scores: torch.Tensor,
    values: torch.Tensor,
    dropout: nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal mask, way (b) of the notes: scores above the diagonal become -inf, so softmax gives them exactly zero
    weight and one softmax normalises the rest. Runs the model's ``masked_attention``.

    scores: (..., T, T), already scaled as wanted; values: (..., T, hs). Returns (context, weights).
    """
    T = scores.size(-1)
    return masked_attention(scores, values, causal_mask(T, scores.device), dropout)


# --- Dropout on the attention weights ----------------------------------------------------------------------


def drop_attention_weights(weights: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout as training applies it to attention weights: each entry is zeroed with probability p and the kept
    ones are multiplied by 1/(1-p), so every weight keeps its expected value (p=0.5 doubles the survivors).

    Draws from the global generator, like ``nn.Dropout`` in the model: seed it with ``torch.manual_seed``.
    """
    dropout = nn.Dropout(p)  # a fresh module is in training mode, which is when dropout acts
    return dropout(weights)


# --- Causal and multi-head attention modules ---------------------------------------------------------------


def _check_score(score: str) -> None:
    if score not in SCORE_KINDS:
        raise ValueError(f"score must be one of {', '.join(SCORE_KINDS)}, got {score!r}")


class CausalAttention(nn.Module):
    """One causal head on a batch: project to q, k, v, score (scaled dot product or additive), hide the future,
    softmax, dropout on the weights, weighted sum of values. (B, T, d_in) -> (B, T, d_out).

    ``score="additive"`` swaps q k^T / sqrt(d_out) for Bahdanau's v^T tanh(W1 q + W2 k); the mask, softmax and
    dropout are unchanged, so future positions still get exactly zero weight.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        qkv_bias: bool = False,
        score: str = "dot",
    ) -> None:
        super().__init__()
        _check_score(score)
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.additive = AdditiveScore(d_out) if score == "additive" else None
        self.register_buffer("mask", causal_mask(context_length), persistent=False)

    def attend(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context vectors (B, T, d_out) and the attention weights (B, T, T) after dropout."""
        T = x.size(1)
        _check_length(T, self.mask.size(0))
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)  # (B, T, d_out) each
        scores = self.additive(q, k) if self.additive is not None else dot_scores(q, k)  # (B, T, T)
        return masked_attention(scores, v, self.mask[:T, :T], self.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(x)[0]


class MultiHeadAttentionWrapper(nn.Module):
    """``num_heads`` independent ``CausalAttention`` heads run side by side, their outputs concatenated:
    (B, T, d_in) -> (B, T, num_heads * d_out). The simple form of multi-head attention in the notes."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
        score: str = "dot",
    ) -> None:
        super().__init__()
        self.heads = nn.ModuleList(
            CausalAttention(d_in, d_out, context_length, dropout, qkv_bias, score) for _ in range(num_heads)
        )

    def attend(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Concatenated context vectors (B, T, num_heads * d_out) and every head's weights (B, num_heads, T, T)."""
        contexts, weights = zip(*(head.attend(x) for head in self.heads), strict=True)
        return torch.cat(contexts, dim=-1), torch.stack(weights, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(x)[0]


class MultiHeadAttention(nn.Module):
    """Multi-head causal attention with one set of projections split into heads, then an output projection:
    Concat(head_1, ..., head_h) W^O. (B, T, d_in) -> (B, T, d_out), head size d_out // num_heads.

    Computes what ``MultiHeadAttentionWrapper`` does (with W^O = identity) in one matrix product per projection.
    Additive scoring shares one ``AdditiveScore`` across the heads, as the GPT's attention does.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
        score: str = "dot",
    ) -> None:
        super().__init__()
        _check_score(score)
        if d_out % num_heads:
            raise ValueError(f"d_out must be divisible by num_heads, got {d_out} and {num_heads}")
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)  # W^O: mixes what the heads found
        self.dropout = nn.Dropout(dropout)
        self.additive = AdditiveScore(self.head_dim) if score == "additive" else None
        self.register_buffer("mask", causal_mask(context_length), persistent=False)

    def attend(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Output (B, T, d_out) and the attention weights of every head (B, num_heads, T, T)."""
        B, T, _ = x.shape
        _check_length(T, self.mask.size(0))
        nh, hs = self.num_heads, self.head_dim
        q = self.W_query(x).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.W_key(x).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = self.W_value(x).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        scores = self.additive(q, k) if self.additive is not None else dot_scores(q, k)  # (B, nh, T, T)
        context, weights = masked_attention(scores, v, self.mask[:T, :T], self.dropout)  # (B, nh, T, hs)
        context = context.transpose(1, 2).contiguous().view(B, T, self.d_out)  # (B, T, d_out): heads side by side
        return self.out_proj(context), weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(x)[0]


def _check_length(T: int, context_length: int) -> None:
    if T > context_length:
        raise ValueError(f"sequence of {T} positions is longer than context_length {context_length}")

