"""When sample.py compiles its step (sampling.compiling): --compile auto's counts, cold and warm, with and without the
eager sampler's window pass, what this machine measured, and the keys its timings are kept under."""

from __future__ import annotations

import torch

from model import GPTConfig
from sampling.compiling import (
    SAMPLE_COLD_MIN_STEPS,
    SAMPLE_PASS_COLD_MIN_STEPS,
    SAMPLE_PASS_WARM_MIN_STEPS,
    SAMPLE_WARM_MIN_STEPS,
    sampling_compiles,
    sampling_eager_pass,
    sampling_key,
)
from training import compile_cache, window_kernel
from training.engine import MEASURED_MARGIN

CPU = torch.device("cpu")


def test_sampling_compiles_long_texts_only_and_sooner_once_compiled_here(a_compiler, monkeypatch, tmp_path):
    monkeypatch.setattr(compile_cache, "_USER_CACHE", str(tmp_path))
    key = sampling_key(GPTConfig(vocab_size=5), 1, 0.8, None, None, CPU)
    assert sampling_compiles("auto", SAMPLE_COLD_MIN_STEPS, key, CPU) == (True, "")
    assert sampling_compiles("auto", SAMPLE_COLD_MIN_STEPS - 1, key, CPU) == (False, "")
    compile_cache.remember_compile(key, 6.5)  # compiled once: the cache is warm
    assert sampling_compiles("auto", SAMPLE_WARM_MIN_STEPS, key, CPU) == (True, "")
    assert sampling_compiles("auto", SAMPLE_WARM_MIN_STEPS - 1, key, CPU) == (False, "")
    # another model, or other sampling settings, compiles other code: cold again
    other = sampling_key(GPTConfig(vocab_size=5), 1, 0.8, 3, None, CPU)
    assert sampling_compiles("auto", SAMPLE_WARM_MIN_STEPS, other, CPU) == (False, "")
    assert sampling_compiles("true", 1, key, CPU) == (True, "")
    assert sampling_compiles("false", 10**9, key, CPU)[0] is False
    # on CUDA the compiled sampler was slower than the eager one (H100): auto never compiles it, true still does
    cuda = torch.device("cuda")
    assert sampling_compiles("auto", 10**9, sampling_key(GPTConfig(vocab_size=5), 1, 0.8, None, None, cuda),
                             cuda) == (False, "")
    assert sampling_compiles("true", 1, key, cuda) == (True, "")


def test_sampling_compiles_far_longer_texts_only_where_the_eager_sampler_takes_the_window_pass(a_compiler, monkeypatch,
                                                                                             tmp_path):
    """Where the eager sampler computes its window with training/window_kernel.py's kernel, compiling saves a tenth of
    what it saved without (SAMPLE_PASS_COLD_MIN_STEPS): auto's counts are the pass's, and its timings are kept
    apart from those of the eager sampler without it."""
    monkeypatch.setattr(compile_cache, "_USER_CACHE", str(tmp_path))
    cfg = GPTConfig(vocab_size=5, n_embd=32, n_head=2)
    monkeypatch.setenv("TINYCHAR_GEMM", "1")
    assert sampling_eager_pass(cfg, window_kernel.EAGER_MAX_BATCH, CPU)
    assert not sampling_eager_pass(cfg, window_kernel.EAGER_MAX_BATCH + 1, CPU)
    assert not sampling_eager_pass(cfg, 1, torch.device("cuda"))
    assert not sampling_eager_pass(GPTConfig(vocab_size=5, n_embd=24, n_head=2), 1, CPU)  # not 16 wide
    key = sampling_key(cfg, 1, 0.8, None, None, CPU)
    assert SAMPLE_COLD_MIN_STEPS < SAMPLE_PASS_WARM_MIN_STEPS < SAMPLE_PASS_COLD_MIN_STEPS
    assert sampling_compiles("auto", SAMPLE_PASS_COLD_MIN_STEPS - 1, key, CPU, eager_pass=True) == (False, "")
    assert sampling_compiles("auto", SAMPLE_PASS_COLD_MIN_STEPS, key, CPU, eager_pass=True) == (True, "")
    compile_cache.remember_compile(key, 6.5)
    assert sampling_compiles("auto", SAMPLE_PASS_WARM_MIN_STEPS - 1, key, CPU, eager_pass=True) == (False, "")
    assert sampling_compiles("auto", SAMPLE_PASS_WARM_MIN_STEPS, key, CPU, eager_pass=True) == (True, "")
    assert sampling_compiles("true", 1, key, CPU, eager_pass=True) == (True, "")
    monkeypatch.setenv("TINYCHAR_GEMM", "0")  # no pass: the eager sampler times apart, under another key
    assert not sampling_eager_pass(cfg, 1, CPU) and sampling_key(cfg, 1, 0.8, None, None, CPU) != key


def test_sampling_compiles_once_the_time_it_saves_here_was_measured_wins_the_compile_back(a_compiler, monkeypatch,
                                                                                           tmp_path):
    monkeypatch.setattr(compile_cache, "_USER_CACHE", str(tmp_path))
    key = sampling_key(GPTConfig(vocab_size=5), 1, 0.8, None, None, CPU)
    compile_cache.remember_step_times(key, eager_ms=4.8)  # an eager sample alone: the counts still decide
    assert sampling_compiles("auto", SAMPLE_COLD_MIN_STEPS - 1, key, CPU) == (False, "")
    assert sampling_compiles("auto", SAMPLE_COLD_MIN_STEPS, key, CPU) == (True, "")
    # the block-64 model on the Zen 1: 4.8 ms a character eagerly, 2.0 compiled, after a cold compile of 21 s, which
    # from the warm cache takes about WARM_SHARE of that: 2.8 ms saved wins back 1.5 x 5.25 s from 2,813
    compile_cache.remember_compile(key, 21.0, cold=True)
    compile_cache.remember_step_times(key, compiled_ms=2.0)
    needed = MEASURED_MARGIN * 21.0 * compile_cache.WARM_SHARE / (2.8 / 1000)
    assert 2_800 < needed < 2_850 < SAMPLE_WARM_MIN_STEPS
    assert sampling_compiles("auto", 2_850, key, CPU) == (True, "")
    assert sampling_compiles("auto", 2_800, key, CPU) == (False, "")
    compile_cache.remember_compile(key, 30.0)  # a slower compile from the warm cache, as timed: 1.5 x 30 s
    assert sampling_compiles("auto", 16_000, key, CPU) == (False, "")
    assert sampling_compiles("auto", 16_200, key, CPU) == (True, "")
    # compiled no faster here: auto samples eagerly however long the text; true still compiles
    compile_cache.remember_step_times(key, compiled_ms=4.9)
    assert sampling_compiles("auto", 10**9, key, CPU) == (False, "")
    assert sampling_compiles("true", 1, key, CPU) == (True, "")
