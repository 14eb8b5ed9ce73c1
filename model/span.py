"""Several characters a pass of the sampling window, exactly: the rows of the coming windows that are already known
are computed together, in one batch, and only the new characters' rows one character at a time.

With a full window every character moves each earlier one to another position, so a window shares no work with the
one before it, and an exact sampler computes all of its rows for every character. But window t + j (the one that
draws the j-th character after the next) holds, besides the j characters still to be drawn, the last of the
characters known now, at positions 0, 1, ..., and under the triangular mask those rows depend on nothing after them.
So one pass computes the known rows of `span` coming windows as one batch (larger products, one call each instead of
`span`), keeping every layer's keys and values; then each window in turn adds the rows of the characters drawn since
(its tail: j rows), attending to those keys and values, and draws its character. Each window still computes all of
its rows once, the same arithmetic in other groupings (float32 rounding apart, the same characters: the tests).

Measured on a 2-core Zen 5 EPYC (torch 2.13, 2 threads, nanoGPT's CPU config, 4 layers of 128, block 64, compiled
alone, 2026-12-04): the known rows of 1, 4 and 8 windows took 566-571, 1,279-1,281 and 2,424-2,468 us a pass, the
tails of 1, 3 and 7 rows 142, 246 and 276 us; so a span pays where a window's products are small, and the tails,
one after another, bound what it saves (SAMPLE_SPAN).
"""

from __future__ import annotations

import torch

from .attention import KVCache
from .config import GPTConfig
from .gpt import GPT, filtered_probs, greedy_where_overflowed

# sample.py's compiled sampler on a CPU draws SAMPLE_SPAN characters a pass where a window is small (its batch x
# block_size x n_embd values at most SAMPLE_SPAN_MAX), whose products are too small to run at the machine's rate. On
# a 2-core Zen 5 EPYC (torch 2.13, compiled, interleaved rounds in one process, 2026-12-04), us a character with a
# span of 1, 2 and 4: block 8 (3 layers of 64, 1 thread, 6 rounds) medians 81, 75 and 80; block 64 (4 layers of 128,
# 2 threads, 10 rounds) 552, 475 and 465, every round of span 2 faster; block 256 (6 layers of 384, 2 threads, 4
# rounds) 15.6-18.3 ms with 1, 18.8-20.5 with 2. A span of 2 compiles for a few seconds longer from empty caches (3.4
# s at block 8, 4.6 at block 64), 4 for 14 s longer at block 64.
SAMPLE_SPAN = 2
SAMPLE_SPAN_MAX = 2**14


def span_for(batch: int, config: GPTConfig) -> int:
    """The characters a pass (draw_span) of the compiled CPU sampler for a batch of this model."""
    return SAMPLE_SPAN if batch * config.block_size * config.n_embd <= SAMPLE_SPAN_MAX else 1


def draw_span(model: GPT, first: torch.Tensor | None, temperature: float, top_k: int | None, top_p: float | None,
              span: int, k: torch.Tensor, window: torch.Tensor, n: torch.Tensor, drawn: torch.Tensor,
              noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """WindowSteps.draw for `span` characters (1 <= span <= block_size, the model in eval mode): the k-th to the
    (k + span - 1)-th of the chunk, drawn into those columns of drawn (B, chunk), from the window (B, block_size)
    holding n (a (1,) count) characters; the window and count after them."""
    cfg = model.config
    B, T = window.shape
    device = window.device
    *blocks, last = model.transformer.h
    cols = torch.arange(T, device=device)
    # Window j's known characters: the last `known[j]` of the n, at positions 0..known[j]-1; its rows after them
    # hold other characters, which no known row sees.
    known = torch.minimum(n, T - torch.arange(span, device=device))  # (span,)
    rows = window[:, ((n - known)[:, None] + cols).clamp(max=T - 1)].reshape(B * span, T)
    cache = KVCache(cfg, B * span, device, model.transformer.wte.weight.dtype)
    x = model.embed(rows)
    qkv = None if first is None else first[rows, cols]
    for layer, block in enumerate(blocks):
        x, _ = block(x, cache, layer, qkv=qkv)
        qkv = None
    # the last layer: keys and values of every row; the rest only where a character is drawn
    C = cfg.n_embd
    kv = last.attn.c_attn.part(last.attn_input(x), C, 3 * C) if qkv is None else qkv[..., C:]
    key, value = (last.attn.heads(t) for t in kv.split(C, dim=2))
    keys = [t.view(B, span, *t.shape[1:]) for t in [*cache.k[: len(blocks)], key]]  # (B, span, nh, T, hs) each
    values = [t.view(B, span, *t.shape[1:]) for t in [*cache.v[: len(blocks)], value]]
    here = n - 1
    inputs = x.view(B, span, T, C)[:, 0].index_select(1, here)  # window 0's last row, entering the last layer
    first_qkv = None if first is None or blocks else first[window.index_select(1, here), here]
    chars = []
    finite = []
    for j in range(span):
        if j:  # the tail: the rows of the j characters drawn since, at the positions after window j's known ones
            tail = torch.cat(chars, dim=1)  # (B, j)
            at = known[j] + torch.arange(j, device=device)  # (j,)
            inputs, first_qkv, key, value = _tail(model, first, tail, at, [t[:, j] for t in keys],
                                                  [t[:, j] for t in values])
            here = at[-1:]
        else:
            key, value = keys[-1][:, 0], values[-1][:, 0]
        h = _last_row(model, inputs, first_qkv, key, value, here)
        logits = model.lm_head(h).float()  # (B, vocab)
        finite.append(torch.isfinite(logits).all(dim=-1, keepdim=True))
        if noise is None:
            chars.append(logits.argmax(dim=-1, keepdim=True))
        else:
            probs = filtered_probs(greedy_where_overflowed(logits / temperature, logits), top_k, top_p, logits)
            chars.append((probs / noise.index_select(0, k + j).squeeze(0)).argmax(dim=-1, keepdim=True))
    new = torch.cat(chars, dim=1)  # (B, span)
    marked = torch.where(torch.cat(finite, dim=1), new, -1)
    drawn = drawn.index_copy(1, k + torch.arange(span, device=device), marked)
    # the window after them: the last min(n + span, T) characters of its n and the new ones, padding after
    count = torch.minimum(n + span, torch.full_like(n, T))
    at = n + span - count + cols  # (T,) where each position's character is in (the n known, then the new ones)
    joined = torch.cat([window, new], dim=1)  # (B, T + span)
    window = joined[:, torch.where(at < n, at, T + at - n).clamp(max=T + span - 1)]
    return k + span, window, count, drawn


def _tail(model: GPT, first: torch.Tensor | None, tail: torch.Tensor, at: torch.Tensor, keys: list[torch.Tensor],
          values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The rows of the characters tail (B, j) at positions at (j,) of their window, whose keys and values of each
    layer are keys[l] and values[l] (B, nh, T, hs), through every block but the last, attending to those. Returns the
    last row's input to the last block (B, 1, C), its projections there where first gives them (the last block is
    the first), and the last block's keys and values with the tail's rows written in."""
    x = model.transformer.wte(tail) + model.transformer.wpe(at)  # eval mode: no dropout
    C = x.size(-1)
    *blocks, last = model.transformer.h
    for layer, block in enumerate(blocks):
        attn = block.attn
        qkv = first[tail, at] if layer == 0 and first is not None else attn.c_attn(block.attn_input(x))
        q, k, v = (attn.heads(t) for t in qkv.split(C, dim=2))
        key, value = keys[layer].index_copy(2, at, k), values[layer].index_copy(2, at, v)
        x = block.add_mlp(block.add_attention(x, attn.attend(q, key, value, attn.mask.index_select(0, at))))
    qkv = first[tail, at] if not blocks and first is not None else None
    kv = last.attn.c_attn.part(last.attn_input(x), C, 3 * C) if qkv is None else qkv[..., C:]
    k, v = (last.attn.heads(t) for t in kv.split(C, dim=2))
    return (x[:, -1:], None if qkv is None else qkv[:, -1:], keys[-1].index_copy(2, at, k),
            values[-1].index_copy(2, at, v))


def _last_row(model: GPT, x: torch.Tensor, qkv: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor,
              here: torch.Tensor) -> torch.Tensor:
    """The final-layer-norm state (B, C) of one row at position here (a (1,) index) of a window, from its input to
    the last block x (B, 1, C) (and its projections qkv there, where first gives them) and the last block's keys and
    values of the window (B, nh, T, hs): what GPT.hidden_at computes for that row."""
    last = model.transformer.h[-1]
    attn = last.attn
    C = x.size(-1)
    q = attn.heads(attn.c_attn.part(last.attn_input(x), 0, C) if qkv is None else qkv[..., :C])  # (B, nh, 1, hs)
    x = last.add_mlp(last.add_attention(x, attn.attend(q, key, value, attn.mask.index_select(0, here))))
    return model.transformer.ln_f(x).squeeze(1)
