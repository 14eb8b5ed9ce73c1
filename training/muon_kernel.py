"""Muon's Newton-Schulz iteration (training/optim.py, gram_newton_schulz) as a kernel of tinychar's own, on AMD CPUs
without full-width AVX-512, where the linear layers take tinychar's products too (training/linear_kernel.py).

The iteration works on the Gram matrices G of a model's matrices, d x d for a model d wide: each step makes
P = a + b G + c G^2, Q = P Q and G = P G P, seventeen d x d products a matrix in all. Every matrix of the iteration is
a polynomial in the first G, so all of them are symmetric and any two commute: each product is symmetric, and only
its tiles on and above the diagonal need computing, the rest copied across (56% of the multiply-adds at d = 128, 63%
at 64). PyTorch cannot know that, and multiplies whole (MKL's batched products). Here each thread takes whole matrices
of the batch, one after another, with all of a matrix's work in its core's own cache (five d x d buffers: 320 KB at
d = 128), through the linear kernel's tiles of six rows by sixteen columns.

Measured on a 2-core Zen 2 EPYC (AVX2, torch 2.13, 2 threads, float32): the iteration of tiny.yaml's twelve matrices
(d = 64) 1.18 -> 0.42 ms, the CPU config's sixteen (d = 128) 8.3 -> 3.7 ms, shakespeare_char.yaml's twenty-four
(d = 384) 337 -> 142 ms; on a 2-core Zen 4 EPYC (AVX-512 through 256-bit units), 0.97 -> 0.52, 8.13 -> 3.84 and
313 -> 128 ms. The same arithmetic in another order of additions; each matrix is one thread's, in one
order whatever the thread count, so a resumed run equals a straight one. Against float64, as close as PyTorch's
(tests/test_training_muon_kernel.py). Called by the compiled step (CompiledStep attaches it, through its operator's C++
kernel) and the eager step of a run long enough (training/eager_kernels.py), under TINYCHAR_GEMM's rule: `0` keeps
PyTorch's products, `1` takes the kernel on any CPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import subprocess
from pathlib import Path

import torch

from model.linear import own_gemm_wanted

from . import linear_kernel
from .c_kernels import PRELUDE, PairedKernel, define
from .optim import NEWTON_SCHULZ, NEWTON_SCHULZ_STEPS, newton_schulz_iteration

# The widest Gram matrix (d) that takes the kernel: measured up to 384 (the baby GPT's), 2.4x PyTorch's speed there.
MAX_SIZE = 384

# The linear kernel's tiles (tile) and per-thread buffers (scratch), and the iteration made of them.
_CONSTANTS = "".join(f"#define NS_{name} {value.hex()}f\n" for name, value in zip("ABC", NEWTON_SCHULZ, strict=True))
SOURCE = PRELUDE + linear_kernel.TILES + _CONSTANTS + f"#define NS_STEPS {NEWTON_SCHULZ_STEPS}\n" + r"""
/* c = a b for d x d matrices whose product is symmetric (a and b symmetric, and commuting), d a multiple of 16: b
   packed into panels of sixteen columns (bp, d x d floats), the tiles that reach the diagonal or lie above it, then
   every value below the diagonal copied from its mirror, so that c is exactly symmetric. */
static void symmetric_product(long d, const float* a, const float* b, float* bp, float* c) {
    for (long p = 0; p < d / 16; p++)
        for (long k = 0; k < d; k++) memcpy(bp + (p * d + k) * 16, b + k * d + p * 16, 64);
    for (long i = 0; i < d; i += 6) {
        long rows = d - i < 6 ? d - i : 6;
        for (long p = i / 16; p < d / 16; p++)
            tile(rows, d, a + i * d, d, 1, bp + p * d * 16, c + i * d + p * 16, d, 0);
    }
    for (long i0 = 0; i0 < d; i0 += 8) {  /* below the diagonal: 8 x 8 blocks turned in registers, then the rest */
        for (long j0 = 0; j0 < i0; j0 += 8) transpose8(c + j0 * d + i0, d, c + i0 * d + j0, d, BC(1.0f));
        for (long i = i0 + 1; i < i0 + 8; i++)
            for (long j = i0; j < i; j++) c[i * d + j] = c[j * d + i];
    }
}

/* q[m] = the product of the iteration's P for gram[m] (count matrices d x d, symmetric, d a multiple of 16): each
   step P = a + b G + c G^2, Q = P Q, G = P G P, as training/optim.py's newton_schulz_iteration. 0, or -1 out of
   memory. */
int newton_schulz(const float* gram, float* q, long count, long d) {
    long n = d * d;
    int failed = 0;
#pragma omp parallel for schedule(static) reduction(|: failed)
    for (long m = 0; m < count; m++) {
        float *g = scratch(0, 5 * n), *out = q + m * n;
        if (g == NULL) { failed = 1; continue; }
        float *g2 = g + n, *p = g + 2 * n, *pg = g + 3 * n, *bp = g + 4 * n;
        memcpy(g, gram + m * n, sizeof(float) * n);
        for (int step = 0; step < NS_STEPS; step++) {
            symmetric_product(d, g, g, bp, g2);
            for (long i = 0; i < n; i++) p[i] = NS_B * g[i] + NS_C * g2[i];
            for (long i = 0; i < d; i++) p[i * d + i] += NS_A;
            if (step == 0) memcpy(out, p, sizeof(float) * n);
            else { symmetric_product(d, p, out, bp, g2); memcpy(out, g2, sizeof(float) * n); }
            if (step + 1 < NS_STEPS) { symmetric_product(d, p, g, bp, pg); symmetric_product(d, pg, p, bp, g); }
        }
    }
    return failed ? -1 : 0;
}
"""

# The operator's kernel for CPU tensors in C++ (c_kernels.operators), loaded once the kernel is (library), whose
# function it is given then.
OPERATORS = r"""
typedef int (*iteration_fn)(const float*, float*, long, long);
static iteration_fn iteration = nullptr;

extern "C" void tinychar_muon_set(void* f) { iteration = (iteration_fn)f; }

Tensor newton_schulz(Tensor gram) {
    STD_TORCH_CHECK(gram.dim() == 3 && gram.size(1) == gram.size(2) && gram.size(1) % 16 == 0,
                    "tinychar: the Newton-Schulz kernel takes a stack of square matrices, sides a multiple of 16");
    Tensor g = torch::stable::contiguous(gram);
    Tensor q = torch::stable::empty_like(g);
    STD_TORCH_CHECK(iteration != nullptr, "tinychar: the Newton-Schulz kernel is not loaded");
    STD_TORCH_CHECK(iteration((const float*)g.data_ptr(), (float*)q.data_ptr(), g.size(0), g.size(1)) == 0,
                    "tinychar: the Newton-Schulz kernel ran out of memory");
    return q;
}

STABLE_TORCH_LIBRARY_IMPL(tinychar, CPU, m) {
    m.impl("newton_schulz", TORCH_BOX(&newton_schulz));
}
"""

_KERNEL = PairedKernel("muon", SOURCE, OPERATORS, {"newton_schulz": [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2})
library, _operators = _KERNEL.library, _KERNEL.operators
# Where a compiled step was traced with the kernel (step_update.Setup), so that it is keyed apart from one without.
DIGEST = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]


def newton_schulz_in_python(gram: torch.Tensor) -> torch.Tensor:
    """The iteration's Q for each matrix of gram (count, d, d): the operator's kernel where its C++ one is not
    loaded."""
    if gram.dim() != 3 or gram.size(1) != gram.size(2) or gram.size(1) % 16:
        raise ValueError("tinychar: the Newton-Schulz kernel takes a stack of square matrices, sides a multiple of 16")
    gram = gram.contiguous()
    q = torch.empty_like(gram)
    if library().newton_schulz(gram.data_ptr(), q.data_ptr(), gram.size(0), gram.size(1)) != 0:
        raise MemoryError("tinychar: the Newton-Schulz kernel ran out of memory")
    return q


newton_schulz = define("newton_schulz", "(Tensor gram) -> Tensor", newton_schulz_in_python,
                       lambda gram: torch.empty_like(gram, memory_format=torch.contiguous_format))


def fits(size: int) -> bool:
    """Whether Gram matrices size x size take the kernel."""
    return size % 16 == 0 and 0 < size <= MAX_SIZE


def iterate(gram: torch.Tensor) -> torch.Tensor:
    """newton_schulz_iteration of gram (count, d, d), float32 on a CPU, through the kernel where d fits it."""
    if gram.device.type == "cpu" and gram.dtype == torch.float32 and fits(gram.size(-1)):
        return newton_schulz(gram)
    return newton_schulz_iteration(gram)


def ready(optimizer: torch.optim.Optimizer, folder: Path | None = None, with_operators: bool = True) -> bool:
    """Whether the kernel applies to a Muon optimizer's iteration (training.optim.Muon), and is built (into folder, by
    default the compile cache, where it is not there yet): where TINYCHAR_GEMM's rule takes tinychar's products
    (model.linear.own_gemm_wanted) and a matrix of its fits it; with_operators as PairedKernel.library takes it (the
    eager step leaves the C++ unbuilt). The compiled step asks this (CompiledStep)."""
    matrices = [p for group in optimizer.param_groups if group.get("muon") for p in group["params"]]
    if not own_gemm_wanted() or not any(fits(min(p.shape)) for p in matrices):
        return False
    try:
        library(folder, with_operators)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def attach(optimizer: torch.optim.Optimizer, folder: Path | None = None, with_operators: bool = True) -> bool:
    """Give a Muon optimizer the kernel for its eager steps (its attribute iterate) where it is ready; False, and
    nothing given, where it is not."""
    if not hasattr(optimizer, "iterate") or not ready(optimizer, folder, with_operators):
        return False
    optimizer.iterate = iterate
    return True
