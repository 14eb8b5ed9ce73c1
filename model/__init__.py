"""tinychar's model: ``from model import GPT, GPTConfig``. Imports only torch."""

from .attention import CausalSelfAttention, KVCache, masked_attention
from .baselines import Bigram, GRUModel, build_model
from .checkpoint import CheckpointError, checkpoint_config, find_checkpoint, load_checkpoint, model_from_checkpoint
from .config import GPTConfig
from .gpt import GPT, NonFiniteLogits, sample_next

__all__ = [
    "GPT",
    "Bigram",
    "CausalSelfAttention",
    "CheckpointError",
    "GPTConfig",
    "GRUModel",
    "KVCache",
    "NonFiniteLogits",
    "build_model",
    "checkpoint_config",
    "find_checkpoint",
    "load_checkpoint",
    "masked_attention",
    "model_from_checkpoint",
    "sample_next",
]
