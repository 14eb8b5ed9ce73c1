"""An exponential moving average of the weights (train.ema_decay): what a run evaluates, keeps as best.pt and is
sampled from, while the optimizer goes on stepping the weights themselves.

Averaging the last hundred or so steps' weights takes out much of the noise that a high learning rate leaves in
them, the way decaying the rate does, but at every step of the run. Measured with train.py on tiny Shakespeare
(2-core Zen 4 EPYC, float32, 2026-11-25, one run each, evaluated as the configs say): tiny.yaml read 1.916 at step
1,800 with a decay of 0.99 and 1.949 without (nanoGPT's best, 1.939, was reached at that evaluation instead of the
one at 2,100), and ended at 1.880 instead of 1.893; nanoGPT's CPU config with 0.98 read 1.856 at step 1,250 and
1.901 without (its final loss, 1.886, reached there instead of at 1,500), and ended at 1.779 instead of 1.787.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class WeightAverage:
    """The average of model's parameters over the optimizer steps, each step's weights weighing decay times less
    than the next step's. ``update(step)`` after every optimizer step; ``in_model()`` to evaluate it."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"the average's decay must be in (0, 1), got {decay}")
        self.model, self.decay = model, decay
        self.params = list(model.parameters())  # a tied weight once; the same objects for the whole run
        self.average = [p.detach().clone() for p in self.params]
        # Where the parameters are slices of one buffer end to end (the compiled step's, training/compiled_step.py):
        # that buffer and the average laid out as it is, so that an update is one lerp instead of one a parameter
        # (measured on a 2-core Zen 2, bench.py's block-8 step with the average folded in after each, 20 interleaved
        # rounds of 500 steps: 2.489 -> 2.429 ms a step, 19 faster, the same bits). Looked for at the first update
        # and whenever the first parameter has moved since: the compiled step moves them all at once.
        self.flat: tuple[torch.Tensor, torch.Tensor] | None = None
        self.first: int | None = None

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Fold in the weights of optimizer step ``step`` (1 for the first). Bias-corrected, as Adam's moments are:
        the average of t steps weighs step s by (1 - decay) decay^(t - s) / (1 - decay^t), as if it had begun from
        zeros and been divided by the weight it gathered; so step 1 replaces whatever the average held."""
        weight = (1.0 - self.decay) / (1.0 - self.decay**step)
        if self.params and self.params[0].data_ptr() != self.first:
            self.first = self.params[0].data_ptr()
            self.flat = self._one_buffer()
        if self.flat is not None:
            self.flat[1].lerp_(self.flat[0], weight)
        else:
            torch._foreach_lerp_(self.average, self.params, weight)

    def _one_buffer(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the buffer the parameters are slices of, end to end, and the average laid out alike, its slices now
        self.average's), or None where they are not."""
        p0 = self.params[0]
        storage = p0.untyped_storage()
        buffer = p0.new_empty(0).set_(storage)  # the whole of it, one dimension
        spans = []
        for p in self.params:
            if (p.dtype != p0.dtype or p.device != p0.device or not p.is_contiguous()
                    or p.untyped_storage().data_ptr() != storage.data_ptr()):
                return None
            spans.append(p.storage_offset())
        end = 0
        for start, p in sorted(zip(spans, self.params, strict=True), key=lambda sp: sp[0]):
            if start != end:
                return None
            end += p.numel()
        if end != buffer.numel():
            return None
        average = torch.empty_like(buffer)
        for i, (start, p) in enumerate(zip(spans, self.params, strict=True)):
            part = average[start:start + p.numel()].view_as(p)
            part.copy_(self.average[i])
            self.average[i] = part
        return buffer, average

    @contextmanager
    def in_model(self) -> Iterator[None]:
        """Inside, the model holds the averaged weights; afterwards its own again, bit for bit (copied in place, so
        that views of the parameters, such as the compiled engine's flat buffer, stay what they are)."""
        own = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, a in zip(self.params, self.average, strict=True):
                p.copy_(a)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, o in zip(self.params, own, strict=True):
                    p.copy_(o)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with the averaged weights for its parameters (a tied one under each of its names):
        what a checkpoint's "model" holds, and so what sample.py loads."""
        index = {id(p): i for i, p in enumerate(self.params)}
        return {name: (self.average[index[id(t)]] if id(t) in index else t).detach()
                for name, t in self.model.state_dict(keep_vars=True).items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take the average from a state dict of the model's (a checkpoint's "model"); KeyError or RuntimeError if
        it does not fit."""
        for a, (name, _) in zip(self.average, self.model.named_parameters(), strict=True):
            a.copy_(state[name])
