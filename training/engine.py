"""The compiled engine: a whole optimizer step (forward and backward of every micro-batch, gradient clipping and
the AdamW update) as one compiled graph, and the rule that decides when compiling pays for itself.

Why the whole step: at block 8 a CPU step is operator overhead (MFU under 10%). Compiling the model alone still
leaves the autograd engine, gradient accumulation into .grad, the clipping norms and the optimizer as separate
operators; one graph removes them (measured on a 2-core AVX-512 EPYC, block 8, batch 32, 3 layers of 32: eager
4.0 ms/step, compiled model plus compiled optimizer 2.4 ms, the whole step 1.75 ms). Where the step is bound by
MKL's matrix multiplies (block 64, n_embd 128) compiling buys little; where they run through oneDNN
(model/linear.py) it does (29 -> 20.8 ms). It costs 15-25 s the first time (~3 s once its compile cache is warm),
so ``train.compile: auto`` compiles only where the run is long enough to win it back.

The step works on the optimizer's own state tensors (step, exp_avg, exp_avg_sq), in place, so checkpoints, resume
and the eager path see one optimizer. Under torchrun (DDP) and with float16's gradient scaler the model is compiled
instead, one block at a time: dynamo compiles the block's code once and reuses it for every layer. Where the
compiled code is kept, and how a run knows its cache is warm: training/compile_cache.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from data import get_batch
from model import GPTConfig
from model.linear import Linear, onednn_min_macs

from . import warm
from .compile_cache import (
    cache_key,
    cached_compile_seconds,
    cannot_compile,
    compile_cache_dir,
    compile_expectation,
    prepare_compile,
    remember_compile,
)
from .config import TrainConfig
from .devices import autocast_context
from .errors import UsageError
from .optim import muon_lr_scale, orthogonal_dtype, orthogonalize_each

if TYPE_CHECKING:
    from .loop import Trainer

# Steps a run must have left before `auto` compiles on a CPU, with the compile cache cold or warm. Measured on a 2-core
# AVX-512 EPYC, float32, 600-step runs of train.py side by side (compile 14-16 s cold, 2.2 s warm): tiny.yaml's
# step (batch 128) saves 2.6 ms, so compiling wins from about 5,900 steps cold and 1,000 warm; batch 32 of a 3 x 32
# model saves 1.4 ms and wins from 10,700 and 1,900. Cold: about twice the slowest crossover; warm: about it.
COLD_MIN_STEPS = 20_000
WARM_MIN_STEPS = 2_000
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
# wins from about 2,400 steps cold and 700 warm); tiny.yaml 12.8 -> 8.75 ms (15.5 s cold: about 3,900 steps).
OVERHEAD_BOUND_FLOPS = 2.5e9


# Inductor's C++ wrapper calls the step's kernels and matrix multiplies from compiled code instead of from Python:
# the same kernels, the same numbers, less overhead per call (measured on a CPU, block 8: a step 1.83 -> 1.58 ms,
# sampling 4,000 -> 5,000 characters/s), for a few more seconds of compiling the first time. Not on CUDA, where it
# builds a C++ file against CUDA's headers: measured on an H100 (torch 2.11, configs/shakespeare_char.yaml), cold
# compile 102.7 s with it, 29.3 s without, and the step no faster with it (2.0M vs 2.2-2.4M tokens/s).
COMPILE_OPTIONS = {"cpp_wrapper": True}


def compile_options(device: torch.device) -> dict:
    """Inductor's options for the compiled step and sampler on this device (see COMPILE_OPTIONS)."""
    return dict(COMPILE_OPTIONS) if device.type == "cpu" else {}


def compile_key(model_cfg: GPTConfig, tc: TrainConfig, device: torch.device, dtype: torch.dtype) -> str:
    """What the compiled step depends on: the same key means its compiled code is in the cache already."""
    parts = {"torch": torch.__version__, "python": platform.python_version(), "device": device.type,
             "dtype": str(dtype), "threads": torch.get_num_threads(), "onednn": onednn_min_macs(),
             "model": asdict(model_cfg),
             "batch": [tc.grad_accum_steps, tc.batch_size], "clip": tc.grad_clip > 0,
             "adamw": [tc.weight_decay, tc.beta1, tc.beta2], "kernels": "deterministic"}
    if tc.optimizer != "adamw":  # AdamW's key as it was before there was a choice
        parts["optimizer"] = tc.optimizer
    return cache_key("step", parts)


def sampling_key(model_cfg: GPTConfig, batch: int, temperature: float, top_k: int | None, top_p: float | None,
                 device: torch.device) -> str:
    """compile_key's counterpart for model.sampler.WindowSampler's step (its sampling settings are constants in the
    compiled code)."""
    parts = {"torch": torch.__version__, "python": platform.python_version(), "device": device.type,
             "threads": torch.get_num_threads(), "onednn": onednn_min_macs(), "model": asdict(model_cfg),
             "batch": batch,
             "sampling": [temperature, top_k, top_p], "chunk": SAMPLE_CHUNK}
    return cache_key("sample", parts)


# sample.py --compile auto: the same trade for the sampling step. Compiling it takes about 10 s cold and 4 s warm (its
# loop keeps inductor from caching the graph; the C++ is cached). What it saves per character depends on the machine:
# at block 8, 0.63 ms on one 2-core EPYC (1,400 -> 10,600 characters/s) and 0.3 ms on a faster one (2,650 -> 12,800),
# so compiling wins from 8,000-17,000 characters warm and 17,000-36,000 cold; at block 64, 1.8 ms (370 -> 1,075).
SAMPLE_COLD_MIN_STEPS = 30_000
SAMPLE_WARM_MIN_STEPS = 10_000
# The compiled sampling step draws this many characters per call, in a loop compiled into the graph: Python and
# torch.compile's guards cost ~100 us per call, once per 32 characters instead of once per character (measured,
# block 8, one thread: 4,400 -> 10,600 characters/s; 64 is no faster). The loop body compiles once, so the compile
# time does not grow with it (unrolled, 4 characters per call took 33 s to compile and 16 took 342 s).
SAMPLE_CHUNK = 32
# A sampling window of at most this many batch x block_size x n_embd values runs faster on one thread: its operators
# are too small to share out (measured: block 8 x 64 wide, 1 thread 1.4x faster; block 64 x 128, 2 threads 1.5x).
SAMPLE_ONE_THREAD_MAX = 4096


def sampling_compiles(setting: str, steps: int, key: str, device: torch.device) -> tuple[bool, str]:
    """sample.py --compile: (compile the sampling step?, why not, or '')."""
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
    need = SAMPLE_WARM_MIN_STEPS if cached_compile_seconds(key) is not None else SAMPLE_COLD_MIN_STEPS
    return steps >= need, ""


def auto_compiles(flops_per_step: float, remaining_steps: int, device: torch.device, warm: bool,
                  onednn: bool = False, micro_batches: int = 1) -> tuple[bool, str]:
    """train.compile=auto: (compile?, the reason, for the log). onednn: the step's matrix multiplies run through
    oneDNN (see OVERHEAD_BOUND_FLOPS). micro_batches: how many the compiled step unrolls, each one as much to compile
    again (see MAX_STEP_ACCUM)."""
    if device.type == "cpu" and flops_per_step > OVERHEAD_BOUND_FLOPS and not onednn:
        return False, (f"{flops_per_step / 1e9:.1f} GFLOP per step is bound by matrix multiplies, which compiling "
                       f"does not speed up on a CPU")
    need = WARM_MIN_STEPS if warm else COLD_MIN_STEPS
    if device.type == "cuda":
        need = CUDA_WARM_MIN_STEPS if warm else CUDA_MIN_STEPS
    need *= micro_batches
    state = "warm" if warm else "cold"
    if remaining_steps < need:
        each = f": {need // micro_batches:,} for each of {micro_batches} micro-batches a step" if micro_batches > 1 else ""
        return False, (f"{remaining_steps:,} steps are too few to win back compiling with a {state} cache "
                       f"(auto compiles from {need:,}{each}; train.compile=true forces it)")
    return True, f"{remaining_steps:,} steps win back compiling with a {state} cache"


class Setup(NamedTuple):
    """The constants of a compiled step."""

    device_type: str
    dtype: torch.dtype
    accum: int
    clip: float
    betas: tuple[float, float]
    eps: float
    same_steps: bool  # every parameter has taken as many steps (always so, unless a checkpoint says otherwise)
    momentum: float = 0.0  # Muon's, for the matrices at the end of the layout (train.optimizer=muon)
    matrix_decay: float = 0.0  # their weight decay
    module: str = ""  # module_settings of the model: what its traced code reads of it besides its parameters
    training: bool = True  # the model's mode when called


def module_settings(model: nn.Module) -> str:
    """Every setting of model and its submodules that its forward can read, other than tensors and the training
    mode: each module's type and plain attributes (sizes, dropout probabilities, eps, model/linear.py's oneDNN rows,
    ...) and how many hooks it has, as one digest. The compiled step is told it as a constant instead of guarding
    on the module (see step_guards): two models whose settings differ compile apart."""
    plain = (bool, int, float, str, type(None), torch.dtype)

    def is_setting(v: object) -> bool:
        return (isinstance(v, plain) or isinstance(v, tuple) and all(isinstance(x, plain) for x in v)
                or dataclasses.is_dataclass(v) and not isinstance(v, type))  # GPT.config

    parts = []
    for name, m in model.named_modules():
        attrs = sorted((k, repr(v)) for k, v in vars(m).items()
                       if not k.startswith("_") and k != "training" and is_setting(v))
        hooks = [len(getattr(m, h)) for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                              "_backward_pre_hooks")]
        parts.append(f"{name}:{type(m).__module__}.{type(m).__qualname__}{attrs}{hooks}")
    return hashlib.sha256(";".join(parts).encode()).hexdigest()


# What dynamo checks before each call of the compiled step: the tensors' shapes, dtypes and strides, the layout and
# the setup, and torch's global state (grad mode, autocast, deterministic algorithms...). Left alone it also checks
# every attribute of every submodule the trace read and the functions it called, about 600 checks in all for the
# block-8 step of bench.py, which cost that step 0.14 ms of its 1.64 (2-core Zen 4 EPYC, 2 threads, in one process,
# 30 interleaved rounds of 100 steps, medians). Setup.module holds the model's settings instead, and Setup.training
# its mode. A module changed after its CompiledStep was built (a setting, a hook) or a function of the model or of
# torch replaced at run time is not noticed: build a new CompiledStep.
#
# torch.compile takes a guard_filter_fn from torch 2.8 on; before that it refuses the option ("Unexpected
# optimization option"), and the step keeps every guard.
GUARD_FILTER = torch.__version__ >= "2.8"


def step_options(device: torch.device) -> dict:
    """torch.compile's options for the whole step: inductor's (compile_options) and the guards it keeps."""
    options = compile_options(device)
    if GUARD_FILTER:
        options["guard_filter_fn"] = step_guards
    return options


def step_guards(entries: list) -> list[bool]:
    """torch.compile's guard_filter_fn for the compiled step: which of dynamo's guards to keep (see above)."""
    keep = []
    for e in entries:
        source = e.orig_guard.name  # "" for torch's global state, L['...'] for an argument, G['...'] for a global
        if e.guard_type == "TENSOR_MATCH":  # inputs and buffers; parameters are replaced from the flat buffer
            keep.append(not isinstance(e.value, nn.Parameter))
        else:
            keep.append(source == "" or source.startswith("L[") and not source.startswith("L['model']"))
    return keep


class Layout(NamedTuple):
    """Where each parameter lies in the flat buffers: its name, number of values and shape, in optimizer order; the
    last `matrices` of them are Muon's (train.optimizer=muon), the others AdamW's."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    matrices: int = 0

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: t.view(s) for n, t, s in zip(self.names, flat.split(self.sizes), self.shapes, strict=True)}


def _whole_step(model: nn.Module, flat: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                steps: torch.Tensor, momentum: torch.Tensor, decay: torch.Tensor, owner: torch.Tensor, xs: torch.Tensor,
                ys: torch.Tensor, lr: torch.Tensor, layout: Layout, setup: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of every micro-batch, clipping, and the optimizer's update in place on the flat buffers:
    what CompiledStep compiles. AdamW updates the first exp_avg.numel() values of flat: steps holds a value per
    AdamW parameter, decay one per such value, and owner the parameter each belongs to. Muon updates the rest (the
    layout's last `matrices` parameters), whose momentum buffers lie end to end in momentum."""
    # Read here so that dynamo checks them before each call, in place of the model's attributes (see step_guards).
    if not setup.module or setup.training != model.training:
        raise ValueError("the compiled step's setup does not describe its model (see CompiledStep.constants)")

    def loss_of(flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast_context(torch.device(setup.device_type), setup.dtype):
            _, loss = torch.func.functional_call(model, layout.unflatten(flat), (x, y))
        return loss / setup.accum

    grad, loss_sum = None, None
    for micro in range(setup.accum):
        g, loss = torch.func.grad_and_value(loss_of)(flat, xs[micro], ys[micro])
        grad = g if grad is None else grad + g
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    norm = torch.linalg.vector_norm(grad.float())
    scale = torch.ones((), device=norm.device)
    if setup.clip > 0:  # as clip_grad_norm_ does it
        scale = torch.clamp(setup.clip / (norm + 1e-6), max=1.0)
    ok = torch.isfinite(loss_sum) & torch.isfinite(norm)
    beta1, beta2 = setup.betas
    g = grad * scale
    new_steps = steps + ok.float()
    # Each parameter's own step count, as AdamW keeps it. When all are equal (every run of this trainer: each step
    # updates every parameter) the bias corrections are two numbers; otherwise they are worked out per parameter and
    # read by each value through owner, a gather that keeps the update from vectorising (measured, the block-8 step
    # of bench.py: its update kernel 150 -> 80 us with this and decay read per value, of a 1.3 ms step). Either way
    # the same arithmetic on the same numbers: the same result to the bit.
    if setup.same_steps:
        step_size = lr / (1 - beta1 ** new_steps[:1])  # (1,): float32, as the per-parameter form computes it
        root_bias2 = torch.sqrt(1 - beta2 ** new_steps[:1])
    else:
        step_size = (lr / (1 - beta1**new_steps))[owner]
        root_bias2 = torch.sqrt(1 - beta2**new_steps)[owner]
    n = exp_avg.numel()
    g_adamw, weights = (g, flat) if layout.matrices == 0 else (g[:n], flat[:n])
    new_avg = exp_avg.lerp(g_adamw, 1 - beta1)
    new_avg_sq = exp_avg_sq * beta2 + g_adamw * g_adamw * (1 - beta2)
    denom = new_avg_sq.sqrt() / root_bias2 + setup.eps
    new = weights * (1 - lr * decay) - step_size * new_avg / denom
    if layout.matrices:  # Muon, as training.optim.Muon steps each matrix
        mu = setup.momentum
        new_momentum = momentum.lerp(g[n:], 1 - mu)
        ahead = g[n:].lerp(new_momentum, mu)
        sizes, shapes = layout.sizes[-layout.matrices:], layout.shapes[-layout.matrices:]
        updates = orthogonalize_each([d.view(shape) for d, shape in zip(ahead.split(sizes), shapes, strict=True)],
                                     orthogonal_dtype(setup.dtype))
        moved = [w * (1 - lr * setup.matrix_decay) - (lr * muon_lr_scale(shape)) * u.flatten()
                 for w, u, shape in zip(flat[n:].split(sizes), updates, shapes, strict=True)]
        new = torch.cat([new, *moved])
        momentum.copy_(torch.where(ok, new_momentum, momentum))
    # A step that is not finite changes nothing: the run stops and reports it with its weights intact.
    flat.copy_(torch.where(ok, new, flat))
    exp_avg.copy_(torch.where(ok, new_avg, exp_avg))
    exp_avg_sq.copy_(torch.where(ok, new_avg_sq, exp_avg_sq))
    steps.copy_(new_steps)
    return loss_sum, norm


_COMPILED_STEP: Callable | None = None


@contextmanager
def deterministic_kernels(device: torch.device) -> Iterator[None]:
    """On a CPU, PyTorch's deterministic algorithms for the compiled step, traced and run under them alike (dynamo
    guards on the setting). Without them inductor sums the token embedding's gradient with atomic adds from every
    thread, in whatever order the threads reach a row, and a compiled run did not repeat itself. Measured on a 2-core
    Zen 4 EPYC, 2 threads: six compiled steps of nanoGPT's CPU config from the same weights and batch gave five
    different embedding gradients; train.py with bench.py's block-8 step settings, 5,100 compiled steps, ended on
    seven different losses in seven runs (1.8737-1.9061), and now on one (1.9145) every time. Under them inductor
    calls PyTorch's own index_put, which adds in one order, at no cost measured (in one process, rounds interleaved,
    median ms a step: block 8 1.491 -> 1.496 over 12 rounds, and 3.65 -> 3.64 in a slow spell; block 64 33.99 ->
    33.78).
    Memory that PyTorch leaves uninitialised stays so (filling it finds bugs; determinism does not need it). CUDA
    keeps its kernels: not measured there."""
    if device.type != "cpu":
        yield
        return
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _concat(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One new contiguous buffer holding the tensors' values end to end, and its slices shaped as each tensor: the
    same values, now one block of memory that one compiled kernel updates."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    return flat, [part.view_as(t) for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True)]


class CompiledStep:
    """One optimizer step as one compiled function, updating the model's parameters and the optimizer's state in
    place. Call it with the micro-batches stacked, xs and ys (grad_accum_steps, batch, T), and the learning rate;
    it returns (summed mean loss, gradient norm before clipping). If either is not finite, nothing is updated.

    The parameters, and each of AdamW's state tensors, become views of one flat buffer apiece: the update is then
    one fused kernel over all the weights instead of one per parameter, which halves the time to compile the step
    (measured, tiny.yaml's model, 2-core AVX-512 EPYC: 60 -> 27 s cold) and speeds the step (12.8 -> 10.5 ms). The
    model, the optimizer, checkpoints and the eager path see the same tensors as before, views or not."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.AdamW, tc: TrainConfig, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.model, self.tc, self.device, self.dtype = model, tc, device, dtype
        named = {id(p): name for name, p in model.named_parameters()}  # a tied weight once, under its first name
        params: list[torch.Tensor] = []
        states: list[dict[str, torch.Tensor]] = []
        decay: list[float] = []
        matrices: list[torch.Tensor] = []  # Muon's (training.optim.Muon), laid out after AdamW's
        matrix_states: list[dict[str, torch.Tensor]] = []
        matrix_decay = 0.0
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state[p]
                if group.get("muon"):
                    if not state:
                        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    matrices.append(p)
                    matrix_states.append(state)
                    matrix_decay = group["weight_decay"]
                    continue
                if not state:  # the layout torch's fused AdamW uses, so that either can continue the other
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                states.append(state)
                decay.append(group["weight_decay"])
        if len({(p.dtype, p.device) for p in params + matrices}) > 1:
            raise RuntimeError("the compiled step needs every parameter in one dtype on one device")
        every = params + matrices
        self.layout = Layout(tuple(named[id(p)] for p in every), tuple(p.numel() for p in every),
                             tuple(tuple(p.shape) for p in every), len(matrices))
        self.flat, views = _concat(every)
        for p, view in zip(every, views, strict=True):
            p.data = view
        self.exp_avg, self.exp_avg_sq = (self._flat_state(states, key) for key in ("exp_avg", "exp_avg_sq"))
        self.momentum = (self._flat_state(matrix_states, "momentum_buffer") if matrices
                         else torch.zeros(0, dtype=self.flat.dtype, device=device))
        self.steps = torch.stack([s["step"].float() for s in states])  # (parameters,)
        for i, s in enumerate(states):
            s["step"] = self.steps[i]
        sizes = torch.tensor([p.numel() for p in params], device=device)
        self.owner = torch.arange(len(params), dtype=torch.int32, device=device).repeat_interleave(sizes)  # (values,)
        self.decay = torch.tensor(decay, dtype=self.flat.dtype, device=device)[self.owner]  # (values,)
        self.betas: tuple[float, float] = optimizer.defaults["betas"]
        self.eps: float = optimizer.defaults["eps"]
        # What the compiled code takes as constants (dynamo guards on their values).
        same_steps = bool((self.steps == self.steps[0]).all())
        self.setup = Setup(device.type, dtype, tc.grad_accum_steps, tc.grad_clip, self.betas, self.eps, same_steps,
                           optimizer.defaults.get("momentum", 0.0) if matrices else 0.0, matrix_decay,
                           module_settings(model))

    @staticmethod
    def _flat_state(states: list[dict[str, torch.Tensor]], key: str) -> torch.Tensor:
        flat, views = _concat([s[key] for s in states])
        for s, view in zip(states, views, strict=True):
            s[key] = view
        return flat

    @property
    def compiled(self) -> Callable:
        # One compiled function for every CompiledStep of the process: a model of the same shapes (a resumed run, a
        # second run in one process) reuses its compiled code instead of compiling again.
        global _COMPILED_STEP
        if _COMPILED_STEP is None:
            _COMPILED_STEP = torch.compile(_whole_step, fullgraph=True, dynamic=False,
                                           options=step_options(self.device))
        return _COMPILED_STEP

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.flat, self.exp_avg, self.exp_avg_sq, self.steps, self.momentum

    def constants(self) -> Setup:
        """The setup, with the model's mode now (the trainer's is always training)."""
        return self.setup if self.model.training else self.setup._replace(training=False)

    def __call__(self, xs: torch.Tensor, ys: torch.Tensor, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        lr_t = torch.tensor(lr, dtype=torch.float64, device=self.device)
        with torch.no_grad(), deterministic_kernels(self.device):  # the gradients are taken inside; the updates are in place
            return self.compiled(self.model, *self.buffers(), self.decay, self.owner, xs, ys, lr_t, self.layout,
                                 self.constants())

    def warm_up(self, xs: torch.Tensor, ys: torch.Tensor) -> float:
        """Compile now, on copies of the weights and state, so that a failure leaves the run untouched and the first
        real step is not the slow one; the seconds it took."""
        start = time.perf_counter()
        rng = torch.get_rng_state()
        copies = [t.clone() for t in self.buffers()]
        lr_t = torch.tensor(0.0, dtype=torch.float64, device=self.device)
        with torch.no_grad(), deterministic_kernels(self.device):
            self.compiled(self.model, *copies, self.decay, self.owner, xs, ys, lr_t, self.layout, self.constants())
        torch.set_rng_state(rng)  # dropout inside the warm-up must not shift the run's random stream
        return time.perf_counter() - start


def cache_releases(device: torch.device) -> int:
    """How often PyTorch's CUDA caching allocator has handed memory back to the driver in this process: its cudaFree
    calls (torch.cuda.empty_cache(), a CUDA graph's capture, which empties the cache first) and its allocations
    retried after freeing the cache because the GPU ran short. 0 off CUDA."""
    if device.type != "cuda":
        return 0
    stats = torch.cuda.memory_stats(device)
    # segments freed: in every torch version's stats; the cudaFree count where the version has it (they move together)
    return sum(int(stats.get(key, 0)) for key in ("num_device_free", "segment.all.freed", "num_alloc_retries"))


class CacheReleaseWatch:
    """Says once, in a line, that the cache was released (cache_releases) since the compiled CUDA step began.

    On a lent H200 (torch 2.11, configs/shakespeare_char.yaml) the compiled step's first update after such a release
    went wrong in every run that made one (the training loss from 2.07 to 3.5 in two steps; torch.cuda.empty_cache()
    alone was enough, eager training was not affected; see the README's "On a GPU"). Why is not yet known, so a run
    cannot avoid it; tinychar releases nothing during a run, and this line tells when something else did."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = cache_releases(device)
        self.said = False

    @classmethod
    def for_run(cls, device: torch.device, compiled: bool) -> CacheReleaseWatch | None:
        """A watch for a run whose whole step is compiled on CUDA; None for every other run."""
        return cls(device) if compiled and device.type == "cuda" else None

    def check(self, step: int) -> str | None:
        """The line to print, the first time a release is seen (by step `step`); None otherwise."""
        if self.said or cache_releases(self.device) == self.start:
            return None
        self.said = True
        return (f"engine: PyTorch released its cached GPU memory by step {step:,} (torch.cuda.empty_cache(), a CUDA "
                f"graph's capture, or the GPU running short of memory), after which the compiled step's next update "
                f"has gone wrong (README, \"On a GPU\"): if the loss jumped there, train with train.compile=false "
                f"(best.pt keeps the best weights so far)")


def sampling_graphs(device: torch.device) -> bool:
    """Does sampling on this device replay a CUDA graph (model.sampler.WindowSampler's graph=True)? On CUDA, where a
    character's forward pass is some hundred kernels too small to keep the GPU busy, so that launching them sets the
    pace. Measured on an H200 (torch 2.11, float32, one stream, the window full, 1,000 characters): the 6-layer
    block-256 model 533 -> 1,639 characters/s (nanoGPT's generate: 568), block 64 758 -> 4,738, block 8 1,078 ->
    7,428; compiled as well, 1,847, 6,012 and 12,298, for 10.5, 5.2 and 4.0 s of compiling: sample.py compiles
    only when asked (--compile true)."""
    return device.type == "cuda"


def compile_failed(e: Exception) -> str:
    """Forget what torch.compile began and say, in one bounded line, why it failed."""
    torch._dynamo.reset()
    return f"cannot compile here ({one_line(e)})"


def one_line(e: Exception) -> str:
    """An exception's type and the first line of its message, at most 300 characters of it."""
    detail = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    return f"{type(e).__name__}: {detail}"


def compile_blocks(model: nn.Module) -> None:
    """Compile each transformer block in place (the model itself stays a plain module, for checkpoints): dynamo
    compiles the block's code once and reuses it for every layer of the same shape."""
    blocks = getattr(getattr(model, "transformer", None), "h", None)
    if blocks is None:
        raise RuntimeError(f"{type(model).__name__} has no transformer blocks to compile")
    prepare_compile()
    for block in blocks:
        block.compile()


@dataclass(frozen=True)
class EngineChoice:
    """How a run takes its steps: 'step' (the whole step compiled), 'blocks' (the model compiled block by block,
    under DDP or float16's gradient scaler) or 'eager'; reason says why, for the log. warm_key: an eager run that
    `auto` would have compiled from a warm cache leaves a helper to warm it for the next run (training.warm)."""

    kind: str
    reason: str
    warm_key: str | None = None


def choose_engine(trainer: Trainer, payload: dict | None, device: torch.device) -> EngineChoice:
    """Resolve train.compile for this run. A resumed `auto` run takes the path its checkpoint was trained on, so
    that it goes on exactly as the uninterrupted run would have."""
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
        onednn = device.type == "cpu" and trainer.dtype == torch.float32 and multiplies_through_onednn(
            trainer.model, tc.batch_size * trainer.cfg.model.block_size)
        warm_now = cached_compile_seconds(key) is not None
        micro = tc.grad_accum_steps if kind == "step" else 1
        wanted, reason = auto_compiles(flops_per_step, tc.max_iters - trainer.step, device, warm=warm_now,
                                       onednn=onednn, micro_batches=micro)
        reason = f"auto: {reason}{unrolled}"
        if (not wanted and not warm_now and why_not is None and device.type == "cpu" and kind == "step"
                and trainer.launch.main and warm_later
                and auto_compiles(flops_per_step, tc.max_iters - trainer.step, device, warm=True, onednn=onednn,
                                  micro_batches=micro)[0]):
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
    why_not = warm.start(compile_cache_dir(), key, spec)
    if why_not is not None:
        return f"engine: the compile cache stays cold: {why_not}"
    return ("engine: once this run ends, a helper compiles its step into the cache at the lowest priority (about "
            "20 s), so that the next run of this model compiles in seconds (TINYCHAR_WARM_CACHE=0: never)")


def multiplies_through_onednn(model: nn.Module, rows: int) -> bool:
    """Whether a float32 CPU pass of rows (batch x block_size) positions multiplies through oneDNN: any of the model's
    Linear layers takes that many rows there."""
    return any(isinstance(m, Linear) and m.onednn_min_rows is not None and rows >= m.onednn_min_rows
               for m in model.modules())


def start_engine(trainer: Trainer, choice: EngineChoice, say: Callable[[str], None]) -> None:
    """Set the trainer on the chosen path, saying which and why; compile the whole step now (on copies), falling
    back to eager with one line should compiling fail. 'blocks' was applied before DDP wrapped the model."""
    if choice.kind == "eager":
        say(f"engine: eager ({choice.reason})")
        if choice.warm_key is not None:
            say(warm_in_background(trainer, choice.warm_key))
        return
    if choice.kind == "blocks":
        trainer.engine = "compiled"
        say(f"engine: model compiled block by block ({choice.reason}); the first steps compile")
        return
    folder = prepare_compile()
    key = compile_key(trainer.model.config, trainer.tc, trainer.device, trainer.dtype)
    before = cached_compile_seconds(key)
    say(f"engine: compiling the training step ({choice.reason}; {compile_expectation(key, trainer.device)})")
    step = CompiledStep(trainer.model, trainer.optimizer, trainer.tc, trainer.device, trainer.dtype)
    dummy = torch.Generator().manual_seed(0)
    xs, ys = [torch.stack([b] * trainer.tc.grad_accum_steps) for b in
              get_batch(trainer.splits["train"], trainer.cfg.model.block_size, trainer.tc.batch_size, dummy,
                        trainer.device)]
    try:
        seconds = step.warm_up(xs, ys)
    except Exception as e:  # noqa: BLE001 - any failure of the compiler stack means: train eagerly, say why
        say(f"engine: {compile_failed(e)}; training without compiling")
        return
    remember_compile(key, seconds, cold=before is None)
    trainer.compiled_step, trainer.engine = step, "compiled"
    say(f"engine: compiled in {seconds:.1f} s (compile cache: {folder})")
