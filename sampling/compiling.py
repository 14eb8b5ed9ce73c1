"""When sample.py compiles its sampling step (``--compile auto|true|false``), and the key by which it knows that
step's compiled code is cached already: training/engine.py's rule for the training step, drawn for sampling, whose
compile is the same trade of seconds once against time saved a character. Whether the eager sampler computes its
window with training/window_kernel.py's kernel (sampling_eager_pass) is decided here too, since it changes what
compiling would win."""

from __future__ import annotations

import platform
from dataclasses import asdict

import torch

from model import GPTConfig, span_for
from model.linear import onednn_min_macs, own_gemm_wanted
from training import window_kernel
from training.compile_cache import cache_key, cached_compile_seconds, cannot_compile, measured_saving, wanted_options
from training.engine import MEASURED_MARGIN

# sample.py --compile auto: the same trade for the sampling step. Compiling it took about 10 s cold and 4 s warm on a
# Zen 4 EPYC, when inductor's cache still declined its loop (see compile_cache.CACHEABLE_FUNCTIONS; the C++ alone came
# from the cache). What it saves per character depends on the machine:
# at block 8, 0.63 ms on one 2-core EPYC (1,400 -> 10,600 characters/s) and 0.3 ms on a faster one (2,650 -> 12,800),
# so compiling wins from 8,000-17,000 characters warm and 17,000-36,000 cold; at block 64, 1.8 ms (370 -> 1,075).
# Those counts hold until this machine has timed both: sample.py notes what a character took eagerly and compiled
# (sampling.writing.timed_steps), and from then on auto compiles where the characters asked for, times the time each
# saves, come to MEASURED_MARGIN times a compile from the warm cache. Measured on a 2-core Zen 1 EPYC (AVX2, whole
# sample.py processes, 2026-11-27), the counts were 2-3x too high there: compiling won from 8,500 characters warm and
# 14,000 cold at block 8 (2.0 -> 0.27 ms a character), from 5,800 and 9,500 at block 64 (4.5-5.2 -> 2.0-2.1 ms).
# Both with the loop declined by the cache; a compile from the warm cache now takes about WARM_SHARE of a cold one,
# as the training step's does (a Xeon with AMX, the block-64 model: 32.0 s cold, 6.5-6.6 s warm, against 13.8-15.9 s
# warm before), so the counts err further on the side of eager until this machine has timed both. The compiler's
# imports (1.2 s, Zen 5) make a warm compile WARM_SHARE of a cold one even with the step saved whole (step_file).
SAMPLE_COLD_MIN_STEPS = 30_000
SAMPLE_WARM_MIN_STEPS = 10_000
# Where the eager sampler computes its window with training/window_kernel.py's kernel (sampling_eager_pass), compiling
# wins far less a character. Measured on a 2-core Zen 4 EPYC (whole sample.py processes, 2,000 and 22,000 characters
# differenced, three rounds, 2026-12-07): block 8 (3L/4H/64) 95 us a character eager against 55 compiled, block 64
# (the CPU config) 565 against 510, where a compile cost 8.4-13.6 s cold and a run 2.4-2.9 s more warm (the step
# loaded whole, the compiler imported): compiling wins from about 60,000 characters warm and 150,000-360,000 cold.
SAMPLE_PASS_COLD_MIN_STEPS = 300_000
SAMPLE_PASS_WARM_MIN_STEPS = 60_000
# The compiled sampling step draws this many characters per call, in a loop compiled into the graph: Python and
# torch.compile's guards cost ~100 us per call, once per 32 characters instead of once per character (measured,
# block 8, one thread: 4,400 -> 10,600 characters/s; 64 is no faster). The loop body compiles once, so the compile
# time does not grow with it (unrolled, 4 characters per call took 33 s to compile and 16 took 342 s).
SAMPLE_CHUNK = 32
# A sampling window of at most this many batch x block_size x n_embd values runs faster on one thread: its operators
# are too small to share out (measured: block 8 x 64 wide, 1 thread 1.4x faster; block 64 x 128, 2 threads 1.5x).
SAMPLE_ONE_THREAD_MAX = 4096


def sampling_key(model_cfg: GPTConfig, batch: int, temperature: float, top_k: int | None, top_p: float | None,
                 device: torch.device) -> str:
    """compile_key's counterpart for model.sampler.WindowSampler's step (its sampling settings are constants in the
    compiled code)."""
    parts = {"torch": torch.__version__, "python": platform.python_version(), "device": device.type,
             "threads": torch.get_num_threads(), "onednn": onednn_min_macs(), "model": asdict(model_cfg),
             "batch": batch, "sampling": [temperature, top_k, top_p],
             "chunk": [SAMPLE_CHUNK, span_for(batch, model_cfg)], "checks": "finite",
             "options": wanted_options(device)}
    if device.type == "cpu" and own_gemm_wanted():  # a step with linear_kernel's packed products times apart
        parts["gemm"] = "own"
    if device.type == "cpu" and batch <= window_kernel.MAX_BATCH and window_kernel.shape_applies(model_cfg):
        parts["window"] = window_kernel.source_digest()  # and one through the window's kernel
    if sampling_eager_pass(model_cfg, batch, device):  # timed against the eager sampler with the window's kernel
        parts["eager"] = "window pass"
    return cache_key("sample", parts)


def sampling_eager_pass(model_cfg: GPTConfig, batch: int, device: torch.device) -> bool:
    """Whether sample.py's eager sampler (--compile auto, not compiling) computes the window with
    training/window_kernel.py's kernel here, for this model and batch, where the kernel can be built."""
    return (device.type == "cpu" and batch <= window_kernel.EAGER_MAX_BATCH
            and window_kernel.shape_applies(model_cfg))


def sampling_compiles(setting: str, steps: int, key: str, device: torch.device, eager_pass: bool = False
                      ) -> tuple[bool, str]:
    """sample.py --compile: (compile the sampling step?, why not, or ''); eager_pass: the eager sampler would take
    the window's kernel (sampling_eager_pass), which leaves compiling far less to win."""
    if setting == "false":
        return False, ""
    why_not = cannot_compile(device)
    if why_not is not None:
        return False, why_not if setting == "true" else ""
    if setting == "true":
        return True, ""
    if device.type != "cpu":
        # Measured on an H100 (torch 2.11, the 6-layer block-256 model, 2,000 characters, one stream): sample.py
        # took 12.7 s eager and 33.7 s compiled, 14.8 s of it compiling; the characters were the same.
        return False, ""
    measured = measured_saving(key)
    if measured is not None:
        eager_ms, compiled_ms, seconds = measured
        return steps * (eager_ms - compiled_ms) / 1000 >= MEASURED_MARGIN * seconds, ""
    warm, cold = (SAMPLE_PASS_WARM_MIN_STEPS, SAMPLE_PASS_COLD_MIN_STEPS) if eager_pass else (SAMPLE_WARM_MIN_STEPS,
                                                                                            SAMPLE_COLD_MIN_STEPS)
    return steps >= (warm if cached_compile_seconds(key) is not None else cold), ""


def sampling_graphs(device: torch.device) -> bool:
    """Does sampling on this device replay a CUDA graph (model.sampler.WindowSampler's graph=True)? On CUDA, where a
    character's forward pass is some hundred kernels too small to keep the GPU busy, so that launching them sets the
    pace. Measured on an H200 (torch 2.11, float32, one stream, the window full, 1,000 characters): the 6-layer
    block-256 model 533 -> 1,639 characters/s (nanoGPT's generate: 568), block 64 758 -> 4,738, block 8 1,078 ->
    7,428; compiled as well, 1,847, 6,012 and 12,298, for 10.5, 5.2 and 4.0 s of compiling: sample.py compiles
    only when asked (--compile true)."""
    return device.type == "cuda"
