"""Devices, dtypes and the matmul ceiling: where and in what precision the model runs, and what MFU is measured
against. Shared by training and sampling."""

from __future__ import annotations

import itertools
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from model.linear import cpu_flags, gemm_setting, onednn_min_macs


class DeviceError(ValueError):
    """A device or dtype that this machine cannot provide; the message is one line for a person."""


# TINYCHAR_FLUSH_DENORMALS: 1 (the default) or 0; see denormals_as_zero.
FLUSH_SETTINGS = ("1", "0")


def flush_wanted() -> bool:
    """TINYCHAR_FLUSH_DENORMALS: whether to treat denormal numbers as zero (1, unset or empty) or not (0); another
    value is a DeviceError."""
    setting = os.environ.get("TINYCHAR_FLUSH_DENORMALS", "1").strip() or "1"
    if setting not in FLUSH_SETTINGS:
        raise DeviceError(f"TINYCHAR_FLUSH_DENORMALS must be 1 (treat denormal numbers as zero, the default) or 0 "
                          f"(keep them), got {setting!r}")
    return setting == "1"


def subnormals_kept() -> bool:
    """Whether this thread's arithmetic keeps denormal numbers (IEEE's default), as Python's own floats show it."""
    return sys.float_info.min / 2 > 0


@contextmanager
def denormals_as_zero() -> Iterator[None]:
    """While inside, this process's CPU arithmetic treats numbers too small for a normal float (below 1.2e-38 in
    float32, "denormals") as zero, in and out, unless TINYCHAR_FLUSH_DENORMALS=0 (flush_wanted).

    Attention at block 64 makes them: in a model 500 steps into training with AdamW at 6e-3, 1.2% of the attention
    weights (those of positions scoring 87 or more below the highest) were denormal, and so was what the backward
    pass and the product with the values made of them. On an Intel CPU each one costs a microcode assist: a float32
    multiply over denormals took 11x as long (2.4 ms against 0.22 for a million values, 2-core Xeon with AMX, 2
    threads), and such a block-64 run trained 1.28x slower. What is thrown away is under 1.2e-38, beside sums of order
    1: far below float32's rounding of them.

    The CPU holds the setting per thread, and a thread starts with its creator's: enter this before torch first works
    in parallel, when it makes its pool of threads, or the pool's threads keep the default (measured: half of a
    2-thread multiply flushed). On leaving, the calling thread has IEEE's denormals back if it had them before, for
    the Python that goes on in the process (a test, a notebook): its floats obey the same setting, under which 5e-324
    > 0 is False. The pool's threads keep it."""
    if not flush_wanted() or not subnormals_kept():
        yield
        return
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def mps_available() -> bool:
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def random_state(device: torch.device) -> dict[str, torch.Tensor]:
    """What dropout draws from on this device: torch's CPU random state and, on CUDA or MPS, the device's own (a
    compiled step's dropout takes its seeds there)."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    elif device.type == "mps":
        state["mps"] = torch.mps.get_rng_state()
    return state


def set_random_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Put back what random_state(device) returned (a device's state that it does not hold is left as it is)."""
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    elif device.type == "mps" and "mps" in state:
        torch.mps.set_rng_state(state["mps"])


@contextmanager
def random_kept(device: torch.device) -> Iterator[None]:
    """Run the body without moving the random streams that dropout on this device draws from (random_state)."""
    state = random_state(device)
    try:
        yield
    finally:
        set_random_state(state, device)


def resolve_device(name: str, any_index: bool = False) -> torch.device:
    """'auto' picks cuda, then mps, then cpu; an explicit device must exist here (cuda:N, a GPU this machine has,
    unless any_index: under torchrun each process takes the GPU of its local rank). TINYCHAR_ONEDNN, which decides
    how the model multiplies on a CPU, and TINYCHAR_GEMM must be values model/linear.py knows, TINYCHAR_SPLIT_STEP
    one training/paired_step.py knows."""
    from .paired_step import split_setting

    try:
        onednn_min_macs()
        gemm_setting()
        split_setting()
    except ValueError as e:
        raise DeviceError(str(e)) from None
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps") if mps_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps") from None
    if device.index is not None and device.type != "cuda":  # torch takes cpu:1 as the CPU: not what was written
        raise DeviceError(f"unsupported device {name!r}: only cuda takes an index; use auto, cpu, cuda, cuda:N or mps")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device {name} asked for, but CUDA is not available here; use cpu or auto")
    if device.type == "cuda" and device.index is not None and not any_index:
        count = torch.cuda.device_count()  # cuda:7 on a one-GPU machine failed deep inside torch, in a traceback
        if device.index >= count:
            raise DeviceError(f"device {name} asked for, but this machine has {count} CUDA GPU(s), cuda:0 to "
                              f"cuda:{count - 1}; use one of them, or cuda")
    if device.type == "mps" and not mps_available():
        raise DeviceError("device mps asked for, but MPS is not available here; use cpu or auto")
    if device.type not in ("cpu", "cuda", "mps"):
        raise DeviceError(f"unsupported device {name!r}; use auto, cpu, cuda, cuda:N or mps")
    return device


# Below this width a CPU step is dominated by per-operation overhead, which autocast's casts only add to; from it
# on, native bfloat16 matrix multiplies win (measured on an AVX-512-bf16 CPU: block 8 / n_embd 32 is ~15% slower
# under bfloat16, block 64 / n_embd 128 about 2x faster).
CPU_BF16_MIN_WIDTH = 128


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX, from cpuinfo, /proc/cpuinfo's text,
    read when None) and torch may use it: ATEN_CPU_CAPABILITY or ONEDNN_MAX_CPU_ISA set below AVX-512 (as bench.py
    --isa avx2 does) rule it out."""
    return (bool(cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16"})
            and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_has_fast_float16() -> bool:
    """Whether oneDNN multiplies float16 on this CPU (AVX-512 FP16 or AMX-FP16). Elsewhere PyTorch's CPU float16
    products fall back to slow loops: measured on a Zen 4 EPYC (2 threads), tiny.yaml trained at about 5,500 tokens/s
    in float16 against 59,000 in float32 and bfloat16."""
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def resolve_dtype(name: str, device: torch.device, width: int | None = None) -> torch.dtype:
    """The autocast dtype for 'auto', 'float32', 'bfloat16' or 'float16'; float32 means no autocast.

    auto: bfloat16 on a CUDA GPU that supports it (float16 on older ones); on a CPU with native bfloat16,
    bfloat16 for models at least CPU_BF16_MIN_WIDTH wide (``width`` = n_embd); float32 otherwise.
    """
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "cpu" and width is not None and width >= CPU_BF16_MIN_WIDTH and cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def autocast_context(device: torch.device, dtype: torch.dtype) -> AbstractContextManager:
    """Mixed precision for the forward pass, or nothing for float32."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


# The ceilings this process has measured, by device, dtype, size, threads and whether float32 may take oneDNN: a
# process that trains more than once (the tests, in theirs: 135 runs in two processes, 0.22 s each) measures once.
_CEILINGS: dict[tuple, float] = {}


def matmul_ceiling(device: torch.device, dtype: torch.dtype, seconds: float = 0.3, n: int | None = None,
                   kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> float:
    """Measured FLOP/s of a large square matrix multiply in dtype on device: the best of a few short timings,
    the yardstick for model FLOPs utilisation (MFU). Measured once a process for each device, dtype, size, thread
    count, oneDNN setting (TINYCHAR_ONEDNN) and kernel; later calls take that measurement, whatever their
    ``seconds``. A kernel (a @ b^T, as training/linear_kernel.py's multiply) takes turns with PyTorch's products in
    those seconds, and the fastest is taken: where the model's layers multiply through it, faster than PyTorch's,
    MFU read over 100% without it (training/ceiling.py).

    n defaults to 8192 on CUDA, where 1024 is far too small to fill the chip (measured on an H100, bfloat16: 104
    TFLOP/s at 1024, 437 at 2048, 731 at 4096, 781 at 8192, so MFU read over 100%), and 1024 elsewhere."""
    cuda = device.type == "cuda"
    if n is None:
        n = 8192 if cuda else 1024
    onednn = device.type == "cpu" and dtype == torch.float32 and onednn_min_macs() is not None
    key = (str(device), dtype, n, torch.get_num_threads(), onednn, kernel is not None)
    if key not in _CEILINGS:
        _CEILINGS[key] = _measure_ceiling(device, dtype, seconds, n, onednn, kernel)
    return _CEILINGS[key]


def _measure_ceiling(device: torch.device, dtype: torch.dtype, seconds: float, n: int, onednn: bool,
                     kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> float:
    cuda = device.type == "cuda"
    # Its own generator (on the GPU there, where drawing 8192 x 8192 values is quick): drawing from torch's global
    # ones would shift a run's dropout masks and break exact resume.
    where = device if cuda else torch.device("cpu")
    gen = torch.Generator(device=where).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=where).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen, device=where).to(device=device, dtype=dtype)
    multiplies = [torch.matmul]
    if onednn:
        multiplies.append(onednn_linear_nobias)  # the model's large float32 products run there (model/linear.py)
    if device.type == "cpu" and dtype == torch.float16:
        # The CPU's matmul has no fast float16 kernel (measured on a Zen 4 EPYC, 2 threads: 1 GFLOP/s, so a run's MFU
        # read 440-570%); the model's linear layers, autocast to float16, take oneDNN's (35-40 GFLOP/s).
        multiplies = [torch.nn.functional.linear]
    if kernel is not None:
        multiplies.append(kernel)
    best = math.inf
    deadline = time.perf_counter() + seconds
    for turn in itertools.count():
        multiply = multiplies[turn % len(multiplies)]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        multiply(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            return 2 * n**3 / best


def onednn_linear_nobias(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b^T through oneDNN: as many multiply-adds as a @ b. Called as the model's Linear calls it outside
    torch.compile, not through the custom operator model.linear.onednn_linear, whose wrapper imports torch's compiler
    (torch._dynamo, 1.65 s) on its first call: the ceiling of an eager run measured here imported it."""
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
