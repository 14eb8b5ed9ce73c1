"""The optimizer and its learning-rate schedule: AdamW with decay on matrices only, warmup then cosine decay."""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, cosine decay, then min_lr."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
    decay_iters = cfg.lr_decay_iters if cfg.lr_decay_iters is not None else cfg.max_iters
    if step >= decay_iters:
        return cfg.min_lr
    progress = (step - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


def make_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (linear weights, embeddings) and none on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # The fused kernel updates every parameter in one call: fewer kernel launches on CPU and CUDA alike.
    fused = device.type in ("cpu", "cuda")
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=fused)
