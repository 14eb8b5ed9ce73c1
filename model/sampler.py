"""Sampling with fixed shapes: every character is one call of the same function on a (batch, block_size) window,
so it can be compiled once and never again, however long the text or however full the window.

The window holds the last block_size characters at positions 0..n-1 (the learned positions they would have in a
window of their own) and padding after them; under the triangular mask no position sees the padding, and the
logits are read at position n-1. The character is drawn the way torch.multinomial draws one (argmax of the
probabilities over Exp(1) noise), with the noise taken from the caller's generator outside the compiled code, so
the generator moves exactly as it does in ``GPT.generate`` and, for equal logits, the same characters come out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .gpt import GPT, filtered_probs

# Below this temperature logits / temperature may overflow, which sample_next meets by decoding greedily without a
# draw; such runs take GPT.generate so that the generator moves as it always did.
MIN_FAST_TEMPERATURE = 1e-4


class WindowSampler:
    """Draws the next character of every row of a batch from a fixed-shape window; see the module's docstring.

    ``compile=True`` runs the step through torch.compile, with inductor's ``options`` (the caller decides where
    that pays: it costs seconds once, then each character is one call of fused code).
    """

    def __init__(self, model: GPT, temperature: float, top_k: int | None, top_p: float | None,
                 compile: bool = False, options: dict | None = None) -> None:
        if 0.0 < temperature < MIN_FAST_TEMPERATURE:
            raise ValueError(f"temperature {temperature} is below {MIN_FAST_TEMPERATURE}: use GPT.generate")
        self.model, self.temperature, self.top_k, self.top_p = model, temperature, top_k, top_p
        self.step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] = self._step
        if compile:
            self.step = torch.compile(self._step, fullgraph=True, dynamic=False, options=options)

    def _step(self, window: torch.Tensor, last: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """window (B, block_size) ids, last (1,) the position to read, noise (B, vocab) Exp(1) or None (greedy)
        -> the next ids (B, 1)."""
        x, _ = self.model.hidden(window)
        logits = self.model.lm_head(x.index_select(1, last)).squeeze(1).float()  # (B, vocab)
        if noise is None:
            return logits.argmax(dim=-1, keepdim=True)
        probs = filtered_probs(logits / self.temperature, self.top_k, self.top_p)
        return (probs / noise).argmax(dim=-1, keepdim=True)

    @torch.inference_mode()
    def warm_up(self, batch: int, device: torch.device) -> None:
        """Run the step once on a blank window (compiling it, when compiled), without touching any generator."""
        window = torch.zeros(batch, self.model.config.block_size, dtype=torch.long, device=device)
        noise = torch.ones(batch, self.model.config.vocab_size, device=device) if self.temperature > 0 else None
        self.step(window, torch.zeros(1, dtype=torch.long, device=device), noise)

    @torch.inference_mode()
    def generate_iter(self, idx: torch.Tensor, max_new_tokens: int,
                      generator: torch.Generator | None = None) -> Iterator[torch.Tensor]:
        """Yield the next (B, 1) ids of idx's continuation one at a time; the window slides by one character, so
        every prediction sees the last block_size characters (GPT.generate's default)."""
        block_size = self.model.config.block_size
        B, T = idx.shape
        n = min(T, block_size)
        window = torch.zeros(B, block_size, dtype=idx.dtype, device=idx.device)
        window[:, :n] = idx[:, T - n :]
        positions = torch.arange(block_size, device=idx.device)
        vocab = self.model.config.vocab_size
        noise = torch.empty(B, vocab, device=idx.device) if self.temperature > 0 else None
        for _ in range(max_new_tokens):
            if noise is not None:
                noise.exponential_(1, generator=generator)
            next_id = self.step(window, positions[n - 1 : n], noise)
            yield next_id
            if n < block_size:
                window[:, n : n + 1] = next_id
                n += 1
            else:  # full: slide by one
                window = torch.cat([window[:, 1:], next_id], dim=1)
