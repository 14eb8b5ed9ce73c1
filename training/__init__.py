"""A training run of tinychar's GPT: its config, the loop, checkpoints and resume, signals, torchrun/DDP, devices,
memory checks and logs. ``from training import RunConfig, load_config, run``. Its names load
with their modules, on first use: reading a run's config (training.config) imports no torch, so that train.py refuses
a bad one at once.
"""

from __future__ import annotations

import importlib

# Each name's module, imported when the name is first used
_HOMES = {
    "RunConfig": "config",
    "TrainConfig": "config",
    "load_config": "config",
    "run": "runner",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
