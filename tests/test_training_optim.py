"""training/optim.py: the learning-rate schedule, a linear warmup to the peak, then a cosine decay to min_lr at
lr_decay_iters (max_iters by default), or a constant rate when decay is off."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from training.config import TrainConfig
from training.optim import lr_at


def schedule(**kw) -> TrainConfig:
    base = {"learning_rate": 1e-3, "min_lr": 1e-4, "warmup_iters": 10, "max_iters": 100}
    return TrainConfig(**{**base, **kw})


def test_warmup_rises_to_the_learning_rate():
    cfg = schedule()
    rates = [lr_at(s, cfg) for s in range(cfg.warmup_iters + 1)]
    assert 0 < rates[0] < cfg.learning_rate
    assert all(a < b for a, b in itertools.pairwise(rates))
    assert rates[-1] == cfg.learning_rate  # warmup ends exactly at the peak


def test_cosine_reaches_min_lr_at_max_iters_by_default_and_stays():
    cfg = schedule()
    mid = (cfg.warmup_iters + cfg.max_iters) // 2
    assert lr_at(mid, cfg) == pytest.approx((cfg.learning_rate + cfg.min_lr) / 2)
    assert lr_at(cfg.max_iters - 1, cfg) > cfg.min_lr
    assert lr_at(cfg.max_iters, cfg) == pytest.approx(cfg.min_lr)
    assert all(lr_at(s, cfg) == cfg.min_lr for s in range(cfg.max_iters, cfg.max_iters + 50))


def test_lr_decay_iters_moves_the_end_of_the_decay():
    cfg = schedule(lr_decay_iters=50)
    assert lr_at(49, cfg) > cfg.min_lr
    assert lr_at(50, cfg) == pytest.approx(cfg.min_lr)
    assert lr_at(80, cfg) == cfg.min_lr
    assert lr_at(30, cfg) == pytest.approx((cfg.learning_rate + cfg.min_lr) / 2)
    assert lr_at(30, cfg) < lr_at(30, replace(cfg, lr_decay_iters=None))


def test_the_rate_never_rises_after_warmup():
    cfg = schedule(max_iters=300, warmup_iters=17)
    rates = [lr_at(s, cfg) for s in range(cfg.warmup_iters, 400)]
    assert all(a >= b for a, b in itertools.pairwise(rates))
    assert rates[0] == cfg.learning_rate and rates[-1] == cfg.min_lr


def test_no_warmup_starts_at_the_peak():
    cfg = schedule(warmup_iters=0)
    assert lr_at(0, cfg) == cfg.learning_rate


def test_a_constant_rate_when_decay_is_off():
    cfg = schedule(decay_lr=False)
    assert {lr_at(s, cfg) for s in (0, 5, 10, 50, 99, 100, 1000)} == {cfg.learning_rate}
