"""The compiled engine: which path a run takes (the whole step compiled, the model compiled block by block, or
eager), the rule that decides when compiling pays for itself, and the keys by which a run knows its compiled code is
cached already.

The whole step compiled (training/compiled_step.py) is the fast path. Where the step is bound by MKL's matrix
multiplies (block 64, n_embd 128) compiling buys little; where they run through oneDNN (model/linear.py) it does (29
-> 20.8 ms). It costs 15-60 s the first time (then 1.5-2 s to load the step saved whole, training/step_file.py, or
3-9 s from the warm compile cache), so ``train.compile: auto`` compiles only where the run is long enough to win it
back. Under torchrun (DDP) and with float16's gradient scaler the model is compiled instead, one block at a time:
dynamo compiles the block's code once and reuses it for every layer. Where the compiled code is kept, and how a run
knows its cache is warm: training/compile_cache.py. The same trade for sample.py's step: sampling/compiling.py.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from data import get_batch
from model import GPTConfig
from model.linear import Linear, onednn_min_macs, own_gemm_wanted

from . import eager_kernels, step_file, warm
from .compile_cache import (
    NoCacheFolder,
    cache_folder,
    cache_key,
    cached_compile_seconds,
    cannot_compile,
    compile_expectation,
    measured_saving,
    prepare_compile,
    remember_compile,
    wanted_options,
)
from .compile_errors import compile_failed, compile_or_clear, compiler_log_quiet
from .compiled_step import CompiledStep
from .config import TrainConfig
from .devices import autocast_context, random_kept
from .errors import UsageError
from .paired_step import parts_for
from .signals import insist_on_stop, interrupting

if TYPE_CHECKING:
    from .loop import Trainer

# Steps a run must have left before `auto` compiles on a CPU, with the compile cache cold or warm. Measured on a 2-core
# AVX-512 EPYC, float32, 600-step runs of train.py side by side (compile 14-16 s cold, 2.2 s warm): tiny.yaml's
# step (batch 128) saves 2.6 ms, so compiling wins from about 5,900 steps cold and 1,000 warm; batch 32 of a 3 x 32
# model saves 1.4 ms and wins from 10,700 and 1,900. Cold: about twice the slowest crossover; warm: about it.
COLD_MIN_STEPS = 20_000
WARM_MIN_STEPS = 2_000
# Those counts are one CPU's: on a 2-core Zen 1 EPYC (AVX2) tiny.yaml's step saves 11-20 ms compiled, not 2.6, and a
# compile from the warm cache takes 8.3 s, so its 1,500 steps win from a warm cache there and not on the Zen 4. So the
# helper that warms the cache (training.warm) also times the step eagerly and compiled, side by side, and with that
# measurement auto compiles from a warm cache where the steps left times the saving come to this many times the
# compile. The helper times the bare step, yet what it measures is what a whole run gains: tiny.yaml on the Zen 1,
# 42.6 ms eager against 30.4 compiled (12.2 ms), and whole runs 11.6 ms a step faster compiled (two interleaved
# pairs, compile time taken out); the margin covers the noise of either.
MEASURED_MARGIN = 1.5
# The shortest run that leaves such a helper: a shorter one would need more than 3.3 ms saved a step to win back the
# fastest compile from a warm cache measured (2.2 s, Zen 4) with that margin, 12.5 ms for the Zen 1's 8.3 s.
WARM_HELPER_MIN_STEPS = 1_000
# On CUDA compiling fuses the elementwise work that dominates a GPU step at any size. Measured on an H100 (torch
# 2.11, configs/shakespeare_char.yaml, bfloat16): 14.6-16.9 ms/step eager, 7.2-8.4 ms compiled, compile 29-36 s
# cold and 9.5 s warm, so compiling wins from about 4,500 steps cold and 1,200 warm. On an H200 whose host compiled
# more slowly: 12.2 ms eager, 6.5 compiled, compile 52.5 s cold and 5.4 s warm: from about 9,200 steps cold and 950
# warm. The cold threshold takes the slower host's.
CUDA_MIN_STEPS = 10_000
CUDA_WARM_MIN_STEPS = 1_500
# The compiled step unrolls its micro-batches, and compiling grows with them: tiny.yaml's model at batch 16, cold
# cache, 2-core Zen 4 EPYC: 26 s for 1 micro-batch a step, 38 for 2, 77 for 4, 171 for 8, the compiling process
# 70 MB larger for each (0.5 GB at 1, 1.0 GB at 8). auto weighs the cost by the micro-batches; above this many, a
# compiled run compiles the model block by block instead, which costs the same whatever train.grad_accum_steps.
MAX_STEP_ACCUM = 8
# Above this many training FLOPs per step a CPU step whose matrix multiplies run through PyTorch's default BLAS is
# bound by them, and compiling does not speed it up (measured as above: 0.06 GFLOP/step 2.2x faster compiled, 0.95
# GFLOP 1.3x, 1.9 GFLOP 1.1x, 4.0 GFLOP (nanoGPT's CPU config, float32) 1.0x). Through oneDNN (model/linear.py)
# the multiplies take half the time and compiling removes most of the rest, whatever the size: on a 2-core Zen 5
# EPYC, float32, nanoGPT's CPU config 29 ms/step eager, 20.8 ms compiled (cold compile about 20 s, warm 3-6 s: it
# wins from about 2,400 steps cold and 700 warm); tiny.yaml 12.8 -> 8.75 ms (15.5 s cold: about 3,900 steps). So too
# under bfloat16 autocast, which sends every CPU product to oneDNN (multiplies_outside_blas).
# The rule is the AMD CPUs': on a Xeon with AMX (MKL's own AVX-512 code), nanoGPT's CPU config in float32 took 42-46
# ms a step eager and 30-33 compiled (2026-12-01, one process). So a bound step leaves the helper too, and once it
# has timed the step here, the measurement decides, as for any step (auto_compiles).
OVERHEAD_BOUND_FLOPS = 2.5e9


def compile_key(model_cfg: GPTConfig, tc: TrainConfig, device: torch.device, dtype: torch.dtype) -> str:
    """What the compiled step depends on: the same key means its compiled code is in the cache already."""
    parts = {"torch": torch.__version__, "python": platform.python_version(), "device": device.type,
             "dtype": str(dtype), "threads": torch.get_num_threads(), "onednn": onednn_min_macs(),
             "model": asdict(model_cfg),
             "batch": [tc.grad_accum_steps, tc.batch_size], "clip": tc.grad_clip > 0,
             "adamw": [tc.weight_decay, tc.beta1, tc.beta2], "kernels": "deterministic",
             "options": wanted_options(device)}
    if device.type == "cpu" and own_gemm_wanted():  # timed with training/linear_kernel.py's products (TINYCHAR_GEMM)
        parts["gemm"] = "own"
    if device.type == "cpu" and dtype == torch.float32:  # the eager step timed with tinychar's kernels (eager_kernels)
        parts["eager"] = "kernels"
    split = parts_for(model_cfg.n_embd, model_cfg.dropout > 0, tc.optimizer == "muon", tc.batch_size, device, dtype)
    if split > 1:  # the batch's halves each a thread's (training/paired_step.py), and Muon's update in two parts
        parts["split"] = split
        if tc.optimizer == "muon":
            parts["update"] = "two parts"
    if tc.optimizer != "adamw":  # AdamW's key as it was before there was a choice
        parts["optimizer"] = tc.optimizer
        parts["newton_schulz"] = "gram"  # Muon's float32 iteration on the Gram matrices (optim.gram_newton_schulz)
        if device.type == "cpu" and dtype == torch.float32 and own_gemm_wanted():
            parts["newton_schulz"] = "gram, tinychar's kernel"  # where it fits (training/muon_kernel.py)
    return cache_key("step", parts)


def bound_by_multiplies(flops_per_step: float, device: torch.device, onednn: bool) -> bool:
    """Whether a CPU step is bound by its matrix multiplies, which compiling does not speed up (see
    OVERHEAD_BOUND_FLOPS)."""
    return device.type == "cpu" and flops_per_step > OVERHEAD_BOUND_FLOPS and not onednn


def auto_compiles(flops_per_step: float, remaining_steps: int, device: torch.device, warm: bool,
                  onednn: bool = False, micro_batches: int = 1,
                  measured: tuple[float, float, float] | None = None) -> tuple[bool, str]:
    """train.compile=auto: (compile?, the reason, for the log). onednn: the step's matrix multiplies run through
    oneDNN (see OVERHEAD_BOUND_FLOPS). micro_batches: how many the compiled step unrolls, each one as much to compile
    again (see MAX_STEP_ACCUM). measured: (ms a step eager, ms compiled, seconds of a compile from the warm cache),
    as the warm-cache helper timed them here (compile_cache.measured_saving); with a warm cache it decides
    in place of the counts of steps and of the bound of multiplies (see MEASURED_MARGIN, OVERHEAD_BOUND_FLOPS)."""
    if warm and measured is not None and device.type == "cpu":  # what this machine measured outweighs the rules
        eager_ms, compiled_ms, seconds = measured
        won = remaining_steps * (eager_ms - compiled_ms) / 1000
        said = f"measured here, a step takes {eager_ms:.1f} ms eager and {compiled_ms:.1f} ms compiled"
        if won < MEASURED_MARGIN * seconds:
            return False, (f"{said}: {remaining_steps:,} steps would win back {max(won, 0):.1f} s, less than "
                           f"{MEASURED_MARGIN:g}x the {seconds:.1f} s of a compile from the warm cache "
                           f"(train.compile=true forces it)")
        return True, (f"{said}: {remaining_steps:,} steps win back {won:.1f} s, over {MEASURED_MARGIN:g}x the "
                      f"{seconds:.1f} s of a compile from the warm cache")
    if bound_by_multiplies(flops_per_step, device, onednn):
        return False, (f"{flops_per_step / 1e9:.1f} GFLOP per step is likely bound by matrix multiplies, which "
                       f"compiling seldom speeds up on a CPU (not timed here yet; train.compile=true forces it)")
    need = WARM_MIN_STEPS if warm else COLD_MIN_STEPS
    if device.type == "cuda":
        need = CUDA_WARM_MIN_STEPS if warm else CUDA_MIN_STEPS
    need *= micro_batches
    state = "warm" if warm else "cold"
    if remaining_steps < need:
        each = ""
        if micro_batches > 1:
            each = f": {need // micro_batches:,} for each of {micro_batches} micro-batches a step"
        return False, (f"{remaining_steps:,} steps are too few to win back compiling with a {state} cache "
                       f"(auto compiles from {need:,}{each}; train.compile=true forces it)")
    return True, f"{remaining_steps:,} steps win back compiling with a {state} cache"


def compile_blocks(model: nn.Module) -> None:
    """Compile each transformer block in place (the model itself stays a plain module, for checkpoints): dynamo
    compiles the block's code once and reuses it for every layer of the same shape."""
    blocks = getattr(getattr(model, "transformer", None), "h", None)
    if blocks is None:
        raise RuntimeError(f"{type(model).__name__} has no transformer blocks to compile")
    prepare_compile()
    for block in blocks:
        block.compile()


def trial_batch(trainer: Trainer) -> tuple[torch.Tensor, torch.Tensor]:
    """A training batch of the run's shape to compile on, drawn with a generator of its own: the run's are untouched."""
    return get_batch(trainer.splits["train"], trainer.cfg.model.block_size, trainer.tc.batch_size,
                     torch.Generator().manual_seed(0), trainer.device)


def warm_blocks(trainer: Trainer, choice: EngineChoice) -> EngineChoice:
    """Compile the blocks (compile_blocks) now, on one batch of the training shape, forward and backward, rather than
    in the first step, where a compiler failure ended the run in a traceback; if it fails, the blocks run eagerly
    again and the choice says why, as a failed whole step does. Called before DDP wraps the model (whose backward
    would reduce), with the random streams kept and the gradients cleared after: the run goes on as if it never ran."""
    model, (x, y) = trainer.model, trial_batch(trainer)
    start = time.perf_counter()
    def trial() -> None:  # the backward is compiled on its first call
        with autocast_context(trainer.device, trainer.dtype):
            _, loss = model(x, y)
        loss.backward()
    try:
        with random_kept(trainer.device), insist_on_stop(), compiler_log_quiet():
            compile_or_clear(trial)
    except Exception as e:  # noqa: BLE001 - any failure of the compiler stack means: train eagerly, say why
        if (stop := interrupting(e)) is not None:  # Ctrl-C or SIGTERM while compiling: stop, as asked
            raise stop from None
        for block in model.transformer.h:
            block._compiled_call_impl = None  # nn.Module.compile undone: the block's own forward again
        return EngineChoice("eager", f"{choice.reason}, but {compile_failed(e)}: training without compiling")
    finally:
        for p in model.parameters():
            p.grad = None
    if (stop := interrupting()) is not None:  # a signal the compiler swallowed: it compiled to the end regardless
        raise stop
    return replace(choice, reason=f"{choice.reason}; compiled in {time.perf_counter() - start:.1f} s")


@dataclass(frozen=True)
class EngineChoice:
    """How a run takes its steps: 'step' (the whole step compiled), 'blocks' (the model compiled block by block,
    under DDP or float16's gradient scaler) or 'eager'; reason says why, for the log. warm_key: an eager run that
    `auto` would have compiled from a warm cache leaves a helper to warm it for the next run (training.warm)."""

    kind: str
    reason: str
    warm_key: str | None = None
    kernels: bool = False  # an eager run's step takes tinychar's C kernels (training/eager_kernels.py)


def choose_engine(trainer: Trainer, payload: dict | None, device: torch.device) -> EngineChoice:
    """Resolve train.compile for this run. A resumed `auto` run takes the path its checkpoint was trained on, so
    that it goes on exactly as the uninterrupted run would have; an eager one, with or without tinychar's kernels,
    as its checkpoint was trained too."""
    choice = _resolve(trainer, payload, device)
    if choice.kind != "eager":
        return choice
    saved = None if payload is None else payload.get("settled")
    if payload is not None and not isinstance(saved, dict):  # saved before checkpoints recorded their setup
        saved = {}
    kernels = eager_kernels.wanted(trainer.tc.compile, device, trainer.dtype, trainer.launch.torchrun,
                                   trainer.tc.max_iters - trainer.step, saved)
    return replace(choice, kernels=kernels and trainer.cfg.model.type == "gpt" and cannot_compile(device) is None)


def _resolve(trainer: Trainer, payload: dict | None, device: torch.device) -> EngineChoice:
    tc = trainer.tc
    warm_later = warm_enabled()  # read first: a bad value is one line, whatever the run
    if tc.compile == "false":
        return EngineChoice("eager", "train.compile=false")
    kind = "step" if not trainer.launch.torchrun and trainer.scaler is None else "blocks"
    unrolled = ""
    if kind == "step" and tc.grad_accum_steps > MAX_STEP_ACCUM:
        kind = "blocks"
        unrolled = (f"; {tc.grad_accum_steps} micro-batches a step are more than the compiled step unrolls "
                    f"({MAX_STEP_ACCUM})")
    why_not = cannot_compile(device)
    if why_not is None and (rnn := trainer.cfg.model.type) in ("gru", "lstm"):  # "Attempted to wrap RNN"
        why_not = f"torch.compile does not compile a {rnn} model (PyTorch's {rnn.upper()})"
    if tc.compile == "true":
        if why_not is not None:
            return EngineChoice("eager", f"train.compile=true, but {why_not}: training without compiling")
        return EngineChoice(kind, f"train.compile=true{unrolled}")
    saved = payload.get("engine") if payload is not None else None
    if saved is not None:
        wanted, reason = saved != "eager", f"auto: as the checkpoint was trained ({saved})"
    elif trainer.cfg.model.type != "gpt":
        wanted, reason = False, f"auto compiles only the GPT, not model.type={trainer.cfg.model.type}"
    else:
        key = compile_key(trainer.model.config, tc, device, trainer.dtype)
        flops_per_step = trainer.flops_per_token * trainer.tokens_per_step / trainer.launch.world_size
        onednn = multiplies_outside_blas(trainer.model, tc.batch_size * trainer.cfg.model.block_size, device,
                                         trainer.dtype)
        warm_now = cached_compile_seconds(key) is not None
        micro = tc.grad_accum_steps if kind == "step" else 1
        remaining = tc.max_iters - trainer.step
        saving = measured_saving(key, step_file.warm_share(device)) if kind == "step" else None
        wanted, reason = auto_compiles(flops_per_step, remaining, device, warm=warm_now, onednn=onednn,
                                       micro_batches=micro, measured=saving)
        reason = f"auto: {reason}{unrolled}"
        if (not wanted and not warm_now and why_not is None and device.type == "cpu" and kind == "step"
                and trainer.launch.main and warm_later and remaining >= WARM_HELPER_MIN_STEPS * micro):
            return EngineChoice("eager", reason, warm_key=key)
    if wanted and why_not is not None:
        return EngineChoice("eager", f"auto: {why_not}")
    return EngineChoice(kind if wanted else "eager", reason)


def warm_enabled() -> bool:
    """TINYCHAR_WARM_CACHE (see training.warm), with a bad value a one-line UsageError."""
    try:
        return warm.enabled()
    except ValueError as e:
        raise UsageError(str(e)) from None


def warm_in_background(trainer: Trainer, key: str) -> str:
    """Start the helper that warms the compile cache once this run has ended; what to tell the person."""
    dtype = str(trainer.dtype).removeprefix("torch.")
    spec = {"model": asdict(trainer.model.config), "train": asdict(trainer.tc), "dtype": dtype,
            "threads": torch.get_num_threads()}
    try:
        folder = cache_folder()
    except NoCacheFolder as e:  # since the run chose its engine (cannot_compile)
        return f"engine: the compile cache stays cold: {e}"
    why_not = warm.start(folder, key, spec)
    if why_not is not None:
        return f"engine: the compile cache stays cold: {why_not}"
    return ("engine: once this run ends, a helper compiles its step into the cache at the lowest priority (15-60 s "
            "of CPU) and times it, so that the next run of this model compiles in seconds where that pays "
            "(TINYCHAR_WARM_CACHE=0: never)")


def multiplies_outside_blas(model: nn.Module, rows: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a CPU step's matrix multiplies run through oneDNN rather than PyTorch's default BLAS, so that compiling
    the rest pays at any size (see OVERHEAD_BOUND_FLOPS): all of them under bfloat16 autocast, which sends them there
    (measured on a 2-core Xeon with AMX, 2026-12-01: shakespeare_char_cpu.yaml's step 31-33 ms eager, 20-22.5 ms
    compiled, its 2,000 steps 68.3-71.0 s against 55.3-58.8 s with a compile of 10 s from the warm cache), float32
    ones where model/linear.py sends them (multiplies_through_onednn)."""
    if device.type != "cpu":
        return False
    return dtype == torch.bfloat16 or dtype == torch.float32 and multiplies_through_onednn(model, rows)


def multiplies_through_onednn(model: nn.Module, rows: int) -> bool:
    """Whether a float32 CPU pass of rows (batch x block_size) positions multiplies through oneDNN: any of the model's
    Linear layers takes that many rows there."""
    return any(isinstance(m, Linear) and m.onednn_min_rows is not None and rows >= m.onednn_min_rows
               for m in model.modules())


def start_engine(trainer: Trainer, choice: EngineChoice, say: Callable[[str], None]) -> None:
    """Set the trainer on the chosen path, saying which and why; compile the whole step now (on copies), falling
    back to eager with one line should compiling fail. 'blocks' (compile_blocks, applied before) compiles here too,
    on one batch (warm_blocks), before DDP wraps the model."""
    if choice.kind == "blocks":
        say(f"engine: compiling the model block by block ({choice.reason})")
        choice = warm_blocks(trainer, choice)
        if choice.kind == "blocks":
            trainer.engine = "compiled"
            say(f"engine: model compiled block by block ({choice.reason})")
            return
    if choice.kind == "eager":
        kernels = ""
        if choice.kernels:
            begun = time.perf_counter()
            rows = trainer.tc.batch_size * trainer.cfg.model.block_size
            if took := eager_kernels.attach(trainer.model, rows, optimizer=trainer.optimizer):
                kernels = (f"; tinychar's kernels for {', '.join(took)} ({time.perf_counter() - begun:.1f} s to "
                           f"build or load)")
        say(f"engine: eager ({choice.reason}){kernels}")
        if choice.warm_key is not None:
            say(warm_in_background(trainer, choice.warm_key))
        return
    begun = time.perf_counter()  # what auto weighs includes the compiler's imports, which only a compile needs
    folder = prepare_compile()
    key = compile_key(trainer.model.config, trainer.tc, trainer.device, trainer.dtype)
    before = cached_compile_seconds(key)
    expected = compile_expectation(key, trainer.device, trainer.model.config.n_layer, trainer.tc.grad_accum_steps)
    say(f"engine: compiling the training step ({choice.reason}; {expected})")
    step = CompiledStep(trainer.model, trainer.optimizer, trainer.tc, trainer.device, trainer.dtype)
    xs, ys = [torch.stack([b] * trainer.tc.grad_accum_steps) for b in trial_batch(trainer)]
    try:
        with compiler_log_quiet(), insist_on_stop():
            compile_or_clear(lambda: step.warm_up(xs, ys))
    except Exception as e:  # noqa: BLE001 - any failure of the compiler stack means: train eagerly, say why
        if (stop := interrupting(e)) is not None:  # Ctrl-C or SIGTERM while compiling: stop, as asked
            raise stop from None
        say(f"engine: {compile_failed(e)}; training without compiling")
        return
    if (stop := interrupting()) is not None:  # a signal the compiler swallowed: it compiled to the end regardless
        raise stop
    seconds = time.perf_counter() - begun
    remember_compile(key, seconds, cold=before is None)
    trainer.compiled_step, trainer.engine = step, "compiled"
    whole = "the step saved whole, loaded from " if step.source == "loaded" else ""
    halves = "; each batch in two halves, one a core" if step.parts > 1 else ""  # training/paired_step.py
    if step.parts > 1 and step.layout.matrices:
        halves += ", and Muon's update in two parts"
    say(f"engine: compiled in {seconds:.1f} s ({whole}compile cache: {folder}){halves}")
