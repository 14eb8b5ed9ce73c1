"""GELU as a kernel of tinychar's own, for the compiled training step on a CPU.

Inductor compiles GELU from ATen's erf, a division and Sleef's exp for each value, and its gradient with erf again and
a second exp for the density: on the 768 x 512 values of a layer of nanoGPT's CPU config, 293 us forward and 509 us
backward on a 2-core Zen 3 EPYC (2 threads), against 74 us for an elementwise product of two such tensors: about 3 ms
of that step's 37. Here erf(x / sqrt 2) is the same formula as ATen's (Abramowitz and Stegun 7.1.26, error under
1.5e-7), but its exp(-x^2 / 2) is the normal density's too, so one exp gives GELU and its derivative, which the
forward keeps for the backward (a product), and the exp is a polynomial of eight floats at a time
(training/c_kernels.py). The forward's output equals exact GELU to 5e-7 and its gradient to 7e-7 on values up to 15,
as ATen's does to 4e-7 and 7e-7. Called by the compiled step (CompiledStep attaches it) and the eager step of a run
long enough (training/eager_kernels.py); everything else keeps torch's GELU.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import nn

from model.gpt import MLP

from .c_kernels import PRELUDE, PairedKernel, define, give, worth_it

SOURCE = PRELUDE + r"""
/* erf(z) for z >= 0, given e = exp(-z^2): Abramowitz and Stegun 7.1.26, as ATen computes it */
static inline v8 erf_positive(v8 z, v8 e) {
    v8 t = BC(1.0f) / (BC(1.0f) + BC(0.3275911f) * z);
    v8 p = BC(1.061405429f);
    p = p * t + BC(-1.453152027f); p = p * t + BC(1.421413741f); p = p * t + BC(-0.284496736f);
    p = p * t + BC(0.254829592f);
    return BC(1.0f) - p * t * e;
}
/* Phi(x) = (1 + erf(x / sqrt 2)) / 2, the standard normal's distribution, and *density = its density phi(x) */
static inline v8 cdf(v8 x, v8* density) {
    v8 half_square = BC(0.5f) * x * x;
    v8i inside = half_square < BC(87.0f);  /* e^-87 is float32's least normal number: 0 beyond */
    v8 e = sel(inside, vexp_within(-sel(inside, half_square, BC(87.0f))), BC(0.0f));
    v8 a = sel(x < BC(0.0f), -x, x);
    v8 f = erf_positive(a * BC(0.70710678118654752f), e);
    *density = e * BC(0.3989422804014327f);
    return BC(0.5f) + BC(0.5f) * sel(x < BC(0.0f), -f, f);
}
static inline v8 load_tail(const float* p, long n) { float t[8] = {0}; memcpy(t, p, n * sizeof(float)); return LD(t); }
static inline void store_tail(float* p, v8 v, long n) { float t[8]; ST(t, v); memcpy(p, t, n * sizeof(float)); }

void gelu_forward(const float* x, float* y, float* slope, long n) {
    /* y = GELU(x) = x Phi(x), and slope = its derivative Phi(x) + x phi(x), for the backward to multiply by */
    long whole = n / 8 * 8;
#pragma omp parallel for schedule(static)
    for (long i = 0; i < whole; i += 8) {
        v8 d, v = LD(x + i), c = cdf(v, &d);
        ST(y + i, v * c); ST(slope + i, c + v * d);
    }
    if (whole < n) {
        long rest = n - whole;
        v8 d, v = load_tail(x + whole, rest), c = cdf(v, &d);
        store_tail(y + whole, v * c, rest); store_tail(slope + whole, c + v * d, rest);
    }
}
"""

# Fewest values a call for which the kernel is attached: with the operators in C++, then where each call goes through
# Python (about 50 us, two a layer: a torch before 2.10). Measured on the 2-core Zen 3 (interleaved in one process,
# medians of 12-16 rounds), in C++: 6.8% faster at 262,144 values (tiny.yaml's model, 1,024 rows of 256), 2.4% at
# 131,072, 2.4% slower at 65,536 and 3.2% at 32,768 (bench.py's block-8 step, 256 rows of 128); through Python: 3.4%
# faster at 393,216 (nanoGPT's CPU config, 768 rows of 512), 2.5% slower at 262,144, 15% slower at 32,768.
MIN_VALUES = (100_000, 300_000)

# The operator's kernel for CPU tensors in C++ (c_kernels.operators), loaded once the kernel is (library), whose
# function it is given then.
OPERATORS = r"""
typedef void (*forward_fn)(const float*, float*, float*, long);
static forward_fn forward = nullptr;

extern "C" void tinychar_gelu_set(void* f) { forward = (forward_fn)f; }

std::tuple<Tensor, Tensor> gelu(Tensor x) {
    Tensor c = torch::stable::contiguous(x);
    Tensor y = torch::stable::empty_like(c), slope = torch::stable::empty_like(c);
    STD_TORCH_CHECK(forward != nullptr, "tinychar: the GELU kernel is not loaded");
    forward((const float*)c.data_ptr(), (float*)y.data_ptr(), (float*)slope.data_ptr(), c.numel());
    return std::make_tuple(y, slope);
}

STABLE_TORCH_LIBRARY_IMPL(tinychar, CPU, m) {
    m.impl("gelu", TORCH_BOX(&gelu));
}
"""

_KERNEL = PairedKernel("gelu", SOURCE, OPERATORS, {"gelu_forward": [ctypes.c_void_p] * 3 + [ctypes.c_long]})

# The kernel (an OSError or subprocess.SubprocessError where it cannot be built), and its operators' C++ kernels
# (None where they cannot be: the Python ones below run then).
library, _operators = _KERNEL.library, _KERNEL.operators


def gelu_in_python(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact GELU, x Phi(x), of a float32 tensor, and its derivative there, Phi(x) + x phi(x): the operator's kernel
    where its C++ one (OPERATORS) is not loaded."""
    x = x.contiguous()
    y, slope = torch.empty_like(x), torch.empty_like(x)
    library().gelu_forward(x.data_ptr(), y.data_ptr(), slope.data_ptr(), x.numel())
    return y, slope


gelu = define("gelu", "(Tensor x) -> (Tensor, Tensor)", gelu_in_python,
              lambda x: (torch.empty_like(x, memory_format=torch.contiguous_format),
                         torch.empty_like(x, memory_format=torch.contiguous_format)))


class _GELU(torch.autograd.Function):
    """The operator as a differentiable function, in the form torch.func's transforms take. The forward keeps GELU's
    derivative (the slope) rather than its input, so that the backward is one product, g times the slope: the
    kernel already has Phi and phi in registers (the slope costs about 17 us more on 768 x 512 values, where a
    backward computing them again took 165 us against 28 for the product; a 2-core Zen 4 EPYC, 2 threads), and the
    same bits as computing them again. The saved tensor is as large as the input it replaces."""

    @staticmethod
    def forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gelu(x)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(output[1])

    @staticmethod
    def backward(ctx, g: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        (slope,) = ctx.saved_tensors
        return g * slope


def activate(x: torch.Tensor) -> torch.Tensor:
    """GELU of x, differentiable, through the kernel."""
    return _GELU.apply(x)[0]


def attach(model: nn.Module, folder: Path | None = None, rows: int | None = None) -> bool:
    """Give each of model's feed-forward layers the kernel for its compiled training forward (built into folder, by
    default the compile cache, if it is not there); False where there are none, it cannot be built, or rows (a
    micro-batch's: batch size times block; None: any) give too few values a call to win its calls back."""
    layers = [m for m in model.modules() if isinstance(m, MLP) and m.gelu.approximate == "none"
              and (rows is None or worth_it(rows * m.c_fc.out_features, MIN_VALUES, lambda: _operators(folder)))]
    return give(layers, lambda: library(folder), activate, SOURCE)
