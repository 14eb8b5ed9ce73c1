"""A training run of tinychar's GPT: its config, the loop, checkpoints and resume, signals, torchrun/DDP, devices,
memory checks and logs. ``from training import RunConfig, load_config, run``."""

from .config import RunConfig, TrainConfig, load_config
from .runner import run

__all__ = ["RunConfig", "TrainConfig", "load_config", "run"]
