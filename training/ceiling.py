"""MFU's yardstick: the fastest this machine has been seen to multiply, kept in the compile cache's folder.

A run's MFU is the model's FLOPs a second over a matrix multiply's (devices.matmul_ceiling: 1024 x 1024 on a CPU,
8192 on a GPU). Timed for 0.2 s as each run starts, that ceiling read what the machine's neighbours left of it: on a
2-core Zen 4 EPYC (2026-12-07), five processes in a row read 157-199 GFLOP/s, and four runs of one block-64 step,
at 27,600-32,100 tokens a second, MFU 74-117% (the ceiling 133-191). And where the model's layers multiply through
tinychar's own kernel (training/linear_kernel.py: 219 GFLOP/s on 1024 x 1024 there, PyTorch's 199-208 when calm), a
ceiling of PyTorch's products alone read below the step's own rate.

So each machine keeps its best: the first MEASURED_RUNS runs measure (the kernel taking turns with PyTorch's products
where the run's layers took it) and keep the largest reading; later runs read it from the cache and start 0.2 s
sooner, with an MFU that compares from run to run. A run that multiplies by a route the kept best has not timed (the
kernel, say) measures again. Kept per device (its model and vector flags), dtype, threads and torch; a cache that
cannot be read or written only costs each run its 0.2 s, as before. Nothing is timed before the engine has given the
layers their products, but for a step that might take an hour (early_ceiling), so a run measures once.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from model.linear import Linear, first_processor, onednn_min_macs

from . import evaluation
from .compile_cache import cache_key, read_marker, update_marker
from .devices import matmul_ceiling

# Runs that measure before the kept best stands for the machine: each a reading at its own moment, the largest kept.
MEASURED_RUNS = 3
SECONDS = 0.2  # each measurement

Multiply = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def layers_kernel(model: nn.Module) -> Multiply | None:
    """The product through which model's linear layers multiply in the training step, where it is tinychar's kernel
    (given by the engine: training/linear_kernel.attach, eager_kernels.attach); None where they keep PyTorch's."""
    return next((m.kernel for m in model.modules() if isinstance(m, Linear) and m.kernel is not None), None)


def device_words(device: torch.device) -> str:
    """What tells this device's multiplies from another's: a GPU's name and capability; a CPU's model (its vector
    flags are in the cache folder's name: compile_cache.machine_tag)."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} {torch.cuda.get_device_capability(device)}"
    cpu = first_processor()
    return " / ".join(cpu.get(field, "") for field in ("vendor_id", "cpu family", "model", "model name"))


def ceiling_key(device: torch.device, dtype: torch.dtype) -> str:
    """The kept ceiling's name in the cache: the device (its kind too: an Apple GPU is named by the CPU beside it),
    dtype, threads and torch it was measured with."""
    return cache_key("ceiling", {"kind": device.type, "device": device_words(device), "dtype": str(dtype),
                                 "threads": torch.get_num_threads(), "torch": torch.__version__})


def routes(device: torch.device, dtype: torch.dtype, kernel: Multiply | None) -> list[str]:
    """The products a ceiling times (devices.matmul_ceiling): PyTorch's matmul, oneDNN's where float32 layers may take
    it, tinychar's kernel where given."""
    onednn = device.type == "cpu" and dtype == torch.float32 and onednn_min_macs() is not None
    return ["matmul", *(["onednn"] if onednn else []), *(["kernel"] if kernel is not None else [])]


def _kept(entry: dict) -> tuple[float, int, set[str]]:
    """A marker's best FLOP/s (0 where it holds none that is finite and positive), its runs and its routes."""
    flops, runs, timed = entry.get("flops"), entry.get("runs"), entry.get("routes")
    best = float(flops) if isinstance(flops, int | float) and not isinstance(flops, bool) else 0.0
    best = best if 0 < best < math.inf else 0.0
    runs = runs if isinstance(runs, int) and not isinstance(runs, bool) and runs > 0 else 0
    timed = {r for r in timed if isinstance(r, str)} if isinstance(timed, list) else set()
    return best, runs, timed


def kept_ceiling(device: torch.device, dtype: torch.dtype) -> float | None:
    """The best FLOP/s kept for this machine, or None where none is: what a run says of its steps' length before its
    engine has started (evaluation.step_note)."""
    best, _, _ = _kept(read_marker(ceiling_key(device, dtype)))
    return best or None


# No ceiling is below this (a CPU's float16 matmul, the slowest product measured here, read 1 GFLOP/s): a step of
# fewer FLOPs than LONG_STEP_SECONDS' worth of it takes under that anywhere, and needs no ceiling for its note
# (evaluation.step_note), so none is measured for it before the engine has started.
SLOWEST = 1e8


def early_ceiling(device: torch.device, dtype: torch.dtype, flops_per_process: float) -> float:
    """What a step of flops_per_process is told by before the engine has started (evaluation.step_note: a step that
    would take over an hour): the kept best; else, for a step that could take that long, PyTorch's products timed now;
    else infinity, and no note (the yardstick is measured once, with the layers' products: machine_ceiling)."""
    if kept := kept_ceiling(device, dtype):
        return kept
    if flops_per_process / SLOWEST <= evaluation.LONG_STEP_SECONDS:
        return math.inf
    return matmul_ceiling(device, dtype, seconds=SECONDS)


def machine_ceiling(device: torch.device, dtype: torch.dtype, kernel: Multiply | None = None) -> tuple[float, str]:
    """MFU's yardstick for this run, in FLOP/s: the kept best, or a measurement now (SECONDS, kernel taking turns with
    PyTorch's products where given) that raises it; and, in words for the log, what it is."""
    key = ceiling_key(device, dtype)
    wanted = set(routes(device, dtype, kernel))
    best, runs, timed = _kept(read_marker(key))
    if not (best and runs >= MEASURED_RUNS and wanted <= timed):
        measured = matmul_ceiling(device, dtype, seconds=SECONDS, kernel=kernel)

        def raised(entry: dict) -> dict:
            best, runs, timed = _kept(entry)
            afresh = bool(timed) and not wanted <= timed  # a route not timed before: its measurements start over
            return {"flops": max(best, measured), "runs": 1 if afresh else runs + 1, "routes": sorted(timed | wanted)}

        kept = raised({"flops": best, "runs": runs, "routes": sorted(timed)})
        update_marker(key, raised)
        best, runs, timed = kept["flops"], kept["runs"], timed | wanted
    among = ", tinychar's linear kernel among the products" if "kernel" in timed else ""  # whichever this run takes
    return best, f"the best of {runs} measurement{'s' if runs > 1 else ''} on this machine{among}"
