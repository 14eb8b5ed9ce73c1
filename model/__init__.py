"""tinychar's model: ``from model import GPT, GPTConfig``. Imports only torch. Its names load
with their modules, on first use: GPTConfig alone (model.config) imports no torch.
"""

from __future__ import annotations

import importlib

# Each name's module, imported when the name is first used
_HOMES = {
    "Bigram": "baselines",
    "CausalSelfAttention": "attention",
    "CheckpointError": "runs",
    "GPT": "gpt",
    "GPTConfig": "config",
    "GRUModel": "baselines",
    "KVCache": "attention",
    "LSTMModel": "baselines",
    "NonFiniteLogits": "gpt",
    "build_model": "baselines",
    "checkpoint_config": "checkpoint",
    "find_checkpoint": "runs",
    "holds_later_step": "checkpoint",
    "load_checkpoint": "checkpoint",
    "masked_attention": "attention",
    "model_from_checkpoint": "checkpoint",
    "sample_next": "gpt",
    "span_for": "span",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
