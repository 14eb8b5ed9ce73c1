"""tinychar's own C kernels in the eager training step on a CPU: the compiled step's attention, GELU and linear-layer
kernels (training/attention_kernel.py, gelu_kernel.py, linear_kernel.py), called from eager autograd through Python,
and Muon's Newton-Schulz iteration's (training/muon_kernel.py), called by the optimizer.

A run that `train.compile: auto` keeps eager (a first run, its compile cache cold) otherwise takes the notes' attention
as a dozen operators a layer, torch's GELU and MKL's products, each through the dispatcher. Measured on a 2-core Zen 2
EPYC (AVX2, torch 2.13, float32, 2 threads; one process, the step with and without them interleaved, medians of 7
rounds of 40 steps): tiny.yaml's step 22.83 -> 19.34 ms with the attention kernel, 19.01 with GELU's too, 18.84 with
the linear layers' from EAGER_MIN_MACS as well; nanoGPT's CPU config (AdamW; 5 rounds of 20) 49.99 -> 43.24 ->
36.91 ms; tiny.yaml's model at batch 16 (the attention's least work, attention_kernel.MIN_WORK) 10.4-10.5 -> 9.0-9.1
(two runs of each, one after the other). Whole first runs of train.py (empty caches, the cache's helper off, the code
before and after in turns, two rounds): tiny.yaml 38.8-39.0 -> 33.5-33.6 s, configs/shakespeare_char_cpu.yaml
131.8-132.1 -> 109.2-110.8 s, the kernels built in 1.0-1.4 s of it; with Muon's iteration's too (0.2 s more of g++,
three rounds), 33.0-33.2 -> 31.5-32.3 s and 109.9-110.1 -> 99.9-100.5 s.

Through Python, the calls cost the eager step no more than through the operators' C++ kernels (tiny.yaml 23.60 ->
20.06 ms with those, 22.89 -> 19.37 without, the same process each), so these are not built for it: each parses
torch's headers, 1.3-1.5 s of g++, where the three C kernels take 0.1-1.0 s each, and build side by side here (once a
machine into the compile cache, the attention kernel once a shape). A run takes them with at least MIN_STEPS steps
left, on a CPU, in float32, in one process, unless train.compile=false (no compiler of any kind, the notes' code as
written); a resumed run as its checkpoint was trained (the "kernels" of its settled setup), whatever its length, so
that it goes on exactly. The kernels' arithmetic is the compiled step's: the same sums in another order, so the eager
run's losses move from PyTorch's by rounding (tests/test_training_eager_kernels.py bounds it).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from torch import nn

from model.attention import CausalSelfAttention
from model.gpt import MLP

from . import attention_kernel, gelu_kernel, linear_kernel, muon_kernel
from .c_kernels import give, side_by_side

# The fewest steps left for which a run builds the kernels it lacks: about a second of g++ on a 2-core Zen 2 the first
# time (the attention kernel 1.0 s, the linear layers' 0.7, GELU's 0.1, side by side), won back from 250 steps of
# tiny.yaml (3.8 ms a step saved) and 700 at batch 16 (1.4 ms).
MIN_STEPS = 500
# The fewest multiply-adds (rows x in x out) of a linear layer's product that takes the kernel eagerly: each call then
# costs the autograd of a Python function, and its bias a sum of its own. Measured as above: tiny.yaml's model at 512
# rows a step (4.2-8.4 million a product), 16.2 ms a step with MKL, 16.6-17.2 with the kernel in every layer; at 1,024
# rows (4.2-16.8 million), 19.01 -> 19.05 in every layer, 18.84 from 2^24 (two layers of four).
EAGER_MIN_MACS = 2**24
NAMES = ("attention", "GELU", "linear", "Muon")


def wanted(tc_compile: str, device: torch.device, dtype: torch.dtype, torchrun: bool, remaining_steps: int,
           saved: dict | None) -> bool:
    """Whether an eager run takes the kernels: saved is the settled setup of the checkpoint it resumes (None for a
    fresh run), whose "kernels" it follows."""
    if tc_compile == "false" or device.type != "cpu" or dtype != torch.float32 or torchrun:
        return False
    if saved is not None:
        return bool(saved.get("kernels"))
    return remaining_steps >= MIN_STEPS


def _attention(model: nn.Module, rows: int, folder: Path | None) -> bool:
    block = getattr(getattr(model, "config", None), "block_size", 0)
    layers = [m for m in model.modules() if isinstance(m, CausalSelfAttention) and attention_kernel.eligible(m, block)]
    if not layers or rows * block * layers[0].n_embd < attention_kernel.MIN_WORK[0]:
        return False
    shape = (block, layers[0].n_embd // layers[0].n_head, layers[0].n_head)
    return give(layers, lambda: attention_kernel.library(*shape, folder), attention_kernel.attend,
                attention_kernel.SOURCE, eager=True)


def _gelu(model: nn.Module, rows: int, folder: Path | None) -> bool:
    layers = [m for m in model.modules() if isinstance(m, MLP) and m.gelu.approximate == "none"
              and rows * m.c_fc.out_features >= gelu_kernel.MIN_VALUES[0]]
    return give(layers, lambda: gelu_kernel.library(folder, with_operators=False), gelu_kernel.activate,
                gelu_kernel.SOURCE, eager=True)


def _linear(model: nn.Module, rows: int, folder: Path | None) -> bool:
    layers = [m for m in linear_kernel.layers_taking(model) if rows * m.in_features * m.out_features >= EAGER_MIN_MACS]
    return give(layers, lambda: linear_kernel.library(folder, with_operators=False), linear_kernel.multiply,
                linear_kernel.SOURCE, eager=True)


def _muon(optimizer: torch.optim.Optimizer | None, folder: Path | None) -> bool:
    return optimizer is not None and muon_kernel.attach(optimizer, folder, with_operators=False)


def attach(model: nn.Module, rows: int, folder: Path | None = None,
           optimizer: torch.optim.Optimizer | None = None) -> list[str]:
    """Give model's layers the kernels that apply to a micro-batch of rows (batch x block) positions, for its eager
    training step, and its optimizer, where it is Muon, the Newton-Schulz iteration's (training/muon_kernel.py), each
    built first where it is not in folder (by default the compile cache) yet, side by side; the names of those it
    took (NAMES), none where none applies or can be built."""
    took = side_by_side([*(partial(attach_one, model, rows, folder) for attach_one in (_attention, _gelu, _linear)),
                         partial(_muon, optimizer, folder)])
    return [name for name, ok in zip(NAMES, took, strict=True) if ok]


def attached(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[str]:
    """The kernels that model's eager training step runs (attach), by name, its optimizer's included."""
    kinds = {"attention": CausalSelfAttention, "GELU": MLP, "linear": nn.Linear}
    layers = [name for name, kind in kinds.items() if any(isinstance(m, kind) and getattr(m, "kernel_eager", False)
                                                          and m.kernel is not None for m in model.modules())]
    return layers + (["Muon"] if getattr(optimizer, "iterate", None) is not None else [])
