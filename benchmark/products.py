"""What the machine's matrix multiplies allow: the matmul ceiling, and the float32 linear products of one training
step each timed alone, a floor under any float32 step on that BLAS."""

from __future__ import annotations

import math
import time

import torch

from model.linear import onednn_min_macs
from training.devices import onednn_linear_nobias

from .runs import Shape


def matmul_gflops(threads: int, seconds: float, n: int = 1024) -> dict[str, float]:
    """Best GFLOP/s of an n x n matrix multiply in float32 and bfloat16 (PyTorch's default path, which nanoGPT
    takes), and in float32 through oneDNN where tinychar's linear layers may take that (model/linear.py)."""
    torch.set_num_threads(threads)
    out = {}
    kinds = [("float32", torch.float32, torch.matmul), ("bfloat16", torch.bfloat16, torch.matmul)]
    if onednn_min_macs() is not None:
        kinds.append(("float32_onednn", torch.float32, onednn_linear_nobias))
    for name, dtype, multiply in kinds:
        gen = torch.Generator().manual_seed(0)
        a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
        multiply(a, b)  # oneDNN builds its kernel on the first call
        best, deadline = math.inf, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            multiply(a, b)
            best = min(best, time.perf_counter() - start)
        out[name] = 2 * n**3 / best / 1e9
    return out


VOCAB = 65  # tiny Shakespeare's characters, which both programs train on


def step_products(shape: Shape) -> list[tuple[int, int, int]]:
    """The matrix products (rows, inner, columns) of one training step of shape, as both programs run them: for each
    linear layer (per block: the q/k/v projection, the attention's output projection, the MLP's two; then the tied
    head) its forward x W^T, its input gradient dy W and its weight gradient dy^T x. Attention's own products (the
    scores and the weighted sums) are left out."""
    rows, c = shape.batch_size * shape.block_size, shape.n_embd
    layers = [(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)] * shape.n_layer + [(c, VOCAB)]
    return [p for k, n in layers for p in ((rows, k, n), (rows, n, k), (n, rows, k))]


def products_ms(shape: Shape, threads: int, seconds: float) -> float:
    """Milliseconds that one float32 step's step_products take through PyTorch's default BLAS (nanoGPT's path),
    each timed on its own, best of what `seconds` allows per product: what no float32 step on that BLAS can undercut.
    """
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    total = 0.0
    for m, k, n in sorted(set(step_products(shape))):
        a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
        torch.mm(a, b)
        best, deadline = math.inf, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        total += best * step_products(shape).count((m, k, n))
    return total * 1e3
