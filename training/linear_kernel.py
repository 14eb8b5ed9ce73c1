"""The linear layers' matrix products as a kernel of tinychar's own, for the compiled training step and the compiled
sampler on AMD CPUs without full-width AVX-512 (Zen 1 to 4).

PyTorch multiplies float32 matrices on a CPU through MKL, whose AVX2 code on AMD processors spends a good part of each
product copying its operands into blocks (packing). On the products of nanoGPT's CPU config (768 rows, 128 wide) on a
2-core Zen 2 EPYC, the step's linear layers took 25.8 ms a step through MKL when timed alone, 29 ms inside the step (the
rest of it: 11 ms), so that its step could not reach 1.5x nanoGPT's. Here each product is tiles of six rows by sixteen
columns held in twelve vector registers; the right operand is copied into sixteen-column panels by each thread for
itself (a panel shared between the two cores cost 10-20%), and the left one is read where it lies, except in the weight
gradient, whose left operand (the output gradient, transposed) is copied six rows at a time, and whose sum over the rows
is split in two halves, one a thread, so that neither copies the other's rows. Timed alone, 20.6 ms a step against MKL's
25.8; in the step 35.0 ms against 41.0 (docs/engine-record.md). Alone and warm, the products run at 88-92% of the Zen
2's multiply-add peak forward, 78-83% backward; in the step about 75%, their operands and outputs come cold (all four
blocks' products alone, 32 MB written before each call: 24.4 ms against 19.7 warm), and each tile asks for the next
one's output rows while it multiplies: the CPU config's compiled step 31.69 -> 31.45 ms, tiny.yaml's 11.99 -> 11.90 (in
one process, eight rounds, 8 and 6 faster, the same bits). The weight gradient's sum over rows goes in blocks of 64
(KC; was 256) and its six rows are copied 24 bytes at a time: the CPU config's four backward products alone and warm
3,438 -> 3,286 us (82 -> 86% of peak), its compiled step 30.3-30.6 -> 29.7-29.8 ms (six processes alternated). The
forward's weight, whose rows are B's columns, is turned into panels by 8 x 8 blocks in registers (it was one float at
a time, 1.8% of the step): its four forward products 1,597 -> 1,556 us, the step 29.7-29.9 -> 29.2-29.7 ms.
Deterministic: each value of the output is summed in one order whatever the number of threads, so a resumed run equals
a straight one. The same arithmetic as PyTorch's (float32 products and sums, fused multiply-adds), in another order of
additions.

The compiled sampler's weights do not change while it runs, so there each weight is packed into panels once
(attach_packed) and every product reads them as they lie, copying nothing: on the 64 and 128 rows of a block-64
window, 1.4-2x MKL's speed, alone, and a block-64 character 1.2 ms -> 0.93 (sampling/writing.py attaches it).

Called by compiled code (CompiledStep attaches it, and sample.py), and by the eager step of a run long enough for its
largest products (training/eager_kernels.py), for layers whose sizes are multiples of 16, on AMD CPUs where MKL
runs its AVX2 code: without AVX-512, or with Zen 4's, whose 256-bit units the kernel's AVX2 code keeps as busy (768 x
128 x 512 at 205 GFLOP/s against MKL's 176 there). MKL's own AVX-512 code on Intel's, and oneDNN on AMD's full-width
AVX-512, are not matched here (model/linear.py, own_gemm_outruns_blas). Evaluation and eager sampling keep PyTorch's
products. TINYCHAR_GEMM=0 keeps MKL, 1 takes the kernel wherever it applies. How it is built, loaded and called:
training/c_kernels.py.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch
from torch import nn

from model.linear import Linear, gemm_setting, own_gemm_wanted

from .c_kernels import PRELUDE, PairedKernel, define, give, worth_it
from .memory import allocatable_bytes

# Fewest multiply-adds of a layer's product (rows x in x out) for which the layer takes the kernel: with the operators
# in C++, then where each call goes through Python (a torch before 2.10: not measured, so never). Measured on a
# 2-core Zen 2 EPYC through train.py (runs of two lengths differenced, interleaved, a compile cache each): nanoGPT's
# CPU config (12.6-50.3 million a product) 41.0 -> 35.0 ms a step, tiny.yaml (4.2-16.8 million; three layers of four
# take it) 16.6 -> 16.05 ms, bench.py's block-8 step (0.3-1.0 million; every layer) 2.69 -> 3.25 ms. Each call took
# about 7 us of Python more then (see c_kernels.define); without it, tiny.yaml's step in halves (512 rows a half,
# 2.1-8.4 million a product), in one process, alternated with the step at 2^23: 12.75 -> 12.39 ms with every layer
# taking the kernel (8 rounds of 8 faster), 12.43 -> 12.13 with three of four (2^22).
MIN_MACS = (2**21, math.inf)
# Most values a layer's weight may have to take the kernel: each thread copies all of it for the forward product.
# Measured alone (forward and both gradients, 2 threads, Zen 2): 768 rows of 256 -> 768 and 1,024 -> 256, 1.27-1.37x
# MKL's speed; the baby GPT's shapes (4,096 rows of 384 -> 1,152 and 1,536, 1,536 -> 384), 1.27-1.29x. Larger weights
# are not measured, and keep MKL.
MAX_WEIGHTS = 2**20

# The tiles of six rows by sixteen columns and the per-thread buffers that the products are made of (Muon's iteration
# is made of them too: training/muon_kernel.py).
TILES = r"""#include <omp.h>
#include <stdlib.h>
#define KC 64  /* the weight gradient's sum over rows, in blocks: all the panels of a block (128 KB where B is 512
                  wide) stay in the core's L2 while its tiles run over them; 256 took 2% longer in the step */
/* c[r][0:16) = (add ? c[r][0:16) : 0) + sum over k of A(r, k) b[k][0:16), rows r < R, A(r, k) = a[r*si + k*sk] */
#define TILE(R) \
static inline void tile##R(long K, const float* __restrict__ a, long si, long sk, const float* __restrict__ b, \
                           float* c, long ldc, int add) { \
    v8 acc[R][2]; \
    for (int r = 0; r < R; r++) { acc[r][0] = BC(0.0f); acc[r][1] = BC(0.0f); } \
    for (long k = 0; k < K; k++) { \
        v8 b0 = LD(b + k * 16), b1 = LD(b + k * 16 + 8); \
        for (int r = 0; r < R; r++) { v8 x = BC(a[r * si + k * sk]); acc[r][0] += x * b0; acc[r][1] += x * b1; } \
    } \
    for (int r = 0; r < R; r++) { \
        if (add) { acc[r][0] += LD(c + r * ldc); acc[r][1] += LD(c + r * ldc + 8); } \
        ST(c + r * ldc, acc[r][0]); ST(c + r * ldc + 8, acc[r][1]); \
    } \
}
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)

static void tile(long R, long K, const float* a, long si, long sk, const float* b, float* c, long ldc, int add) {
    switch (R) {
        case 6: tile6(K, a, si, sk, b, c, ldc, add); break;
        case 5: tile5(K, a, si, sk, b, c, ldc, add); break;
        case 4: tile4(K, a, si, sk, b, c, ldc, add); break;
        case 3: tile3(K, a, si, sk, b, c, ldc, add); break;
        case 2: tile2(K, a, si, sk, b, c, ldc, add); break;
        default: tile1(K, a, si, sk, b, c, ldc, add);
    }
}

/* The calling thread's own buffer number slot (0 or 1) of at least n floats, kept for its next call (NULL where memory
   runs out). */
static float* scratch(int slot, long n) {
    static __thread float* buffers[2] = {NULL, NULL};
    static __thread long sizes[2] = {0, 0};
    if (sizes[slot] < n) {
        free(buffers[slot]);
        sizes[slot] = (n + 15) / 16 * 16;
        buffers[slot] = aligned_alloc(64, sizeof(float) * sizes[slot]);
        if (buffers[slot] == NULL) sizes[slot] = 0;
    }
    return buffers[slot];
}
"""

SOURCE = PRELUDE + TILES + r"""
/* Rows t0 * 6 up to t1 * 6 of C (M x N, rows ldc apart) = A B, by the calling thread alone: A(i, k) = a[i*asi + k*ask],
   B(k, j) = b[k*bsk + j*bsj], N a multiple of 16. Where A's rows are contiguous (ask 1) they are read in place and B
   is packed whole; otherwise K goes in blocks of KC and A is packed six rows at a time. 0, or -1 out of memory. */
static int gemm_rows(long t0, long t1, long M, long N, long K, const float* a, long asi, long ask, const float* b,
                     long bsk, long bsj, float* c, long ldc) {
    long panels = N / 16, kc = ask == 1 || K < KC ? K : KC;
    float* bp = scratch(0, kc * N);  /* each thread packs all of B for itself: a panel crossing cores cost 10-20% */
    float ap[KC * 6] __attribute__((aligned(64)));
    if (bp == NULL) return -1;
    if (K == 0)
        for (long i = t0 * 6; i < t1 * 6 && i < M; i++) memset(c + i * ldc, 0, sizeof(float) * N);
    for (long k0 = 0; k0 < K; k0 += kc) {
        long kn = K - k0 < kc ? K - k0 : kc;
        for (long p = 0; p < panels; p++) {
            float* panel = bp + p * kn * 16;
            long whole = bsk == 1 ? kn / 8 * 8 : 0;  /* the forward's: B's columns (w's rows) contiguous */
            if (bsj == 1)
                for (long k = 0; k < kn; k++) memcpy(panel + k * 16, b + (k0 + k) * bsk + p * 16, 64);
            else {
                for (long k = 0; k < whole; k += 8)  /* 8 x 8 blocks turned in registers */
                    for (int h = 0; h < 16; h += 8)
                        transpose8(b + (p * 16 + h) * bsj + k0 + k, bsj, panel + k * 16 + h, 16, BC(1.0f));
                for (long k = whole; k < kn; k++)
                    for (int j = 0; j < 16; j++) panel[k * 16 + j] = b[(k0 + k) * bsk + (p * 16 + j) * bsj];
            }
        }
        for (long t = t0; t < t1; t++) {
            long i = t * 6, R = M - i < 6 ? M - i : 6, si = asi, sk = 1;
            const float* at = a + i * asi + k0;
            if (ask != 1) {
                if (asi == 1 && R == 6)  /* the weight gradient's: the six values lie side by side in each row */
                    for (long k = 0; k < kn; k++) memcpy(ap + k * 6, a + i + (k0 + k) * ask, 24);
                else
                    for (long k = 0; k < kn; k++)
                        for (long r = 0; r < R; r++) ap[k * 6 + r] = a[(i + r) * asi + (k0 + k) * ask];
                at = ap; si = 1; sk = 6;
            }
            for (long p = 0; p < panels; p++) {
                /* the next tile's rows of C, asked for while this one multiplies: in the step they come cold */
                const float* next = p + 1 < panels ? c + i * ldc + (p + 1) * 16 : c + (i + 6) * ldc;
                long rows = p + 1 < panels ? R : t + 1 < t1 ? (M - i - 6 < 6 ? M - i - 6 : 6) : 0;
                for (long r = 0; r < rows; r++) __builtin_prefetch(next + r * ldc, 1, 3);
                tile(R, kn, at, si, sk, bp + p * kn * 16, c + i * ldc + p * 16, ldc, k0 > 0);
            }
        }
    }
    return 0;
}

/* C = A B as gemm_rows, the threads taking C's rows in equal shares, each with no wait on the others. */
static int gemm(long M, long N, long K, const float* a, long asi, long ask, const float* b, long bsk, long bsj,
                float* c, long ldc) {
    long tiles = (M + 5) / 6;
    int failed = 0;
#pragma omp parallel reduction(|: failed)
    {
        long n = omp_get_num_threads(), id = omp_get_thread_num();
        failed |= gemm_rows(tiles * id / n, tiles * (id + 1) / n, M, N, K, a, asi, ask, b, bsk, bsj, c, ldc);
    }
    return failed ? -1 : 0;
}

/* y (M x N) = x (M x K) w^T, w (N x K); N a multiple of 16. */
int linear_forward(const float* x, const float* w, float* y, long M, long N, long K) {
    return gemm(M, N, K, x, K, 1, w, 1, K, y, N);
}

/* dx (M x K) = dy (M x N) w and dw (N x K) = dy^T x; K a multiple of 16. The weight gradient's sum over the M rows
   is taken in two halves, each by one thread that copies only its own rows of x and dy, and the halves are added in
   one order: the same bits on any number of threads. */
int linear_backward(const float* x, const float* w, const float* dy, float* dx, float* dw, long M, long N, long K) {
    float* second = scratch(1, N * K);
    if (second == NULL || gemm(M, K, N, dy, N, 1, w, K, 1, dx, K) != 0) return -1;
    int failed = 0;
#pragma omp parallel for schedule(static) reduction(|: failed)
    for (int half = 0; half < 2; half++) {
        long m0 = M * half / 2, m1 = M * (half + 1) / 2;
        failed |= gemm_rows(0, (N + 5) / 6, N, K, m1 - m0, dy + m0 * N, 1, N, x + m0 * K, K, 1, half ? second : dw, K);
    }
    if (failed) return -1;
#pragma omp parallel for schedule(static)
    for (long i = 0; i < N * K; i++) dw[i] += second[i];
    return 0;
}

/* y (M x N) = x (M x K) w^T with w packed ahead (pack): panel q holds w's rows 16q..16q+15 as K rows of sixteen,
   p[(q K + k) 16 + j] = w[16q + j][k]. Nothing is copied: the threads take y's rows in equal shares where there are
   two tiles or more for each, else its panels; a product under PACKED_SHARED multiply-adds runs on the calling
   thread alone. */
#define PACKED_SHARED (1L << 16)
int linear_packed(const float* x, const float* p, float* y, long M, long N, long K) {
    long tiles = (M + 5) / 6, panels = N / 16;
#pragma omp parallel if (M * N * K >= PACKED_SHARED)
    {
        long n = omp_get_num_threads(), id = omp_get_thread_num(), t0 = 0, t1 = tiles, q0 = 0, q1 = panels;
        if (tiles >= 2 * n) { t0 = tiles * id / n; t1 = tiles * (id + 1) / n; }
        else { q0 = panels * id / n; q1 = panels * (id + 1) / n; }
        for (long t = t0; t < t1; t++) {
            long i = t * 6, R = M - i < 6 ? M - i : 6;
            for (long q = q0; q < q1; q++) tile(R, K, x + i * K, K, 1, p + q * K * 16, y + i * N + q * 16, N, 0);
        }
    }
    return 0;
}
"""

# The two operators' kernels for CPU tensors in C++ (c_kernels.operators), loaded once the kernel is (library), whose
# functions they are given then.
OPERATORS = r"""
typedef int (*forward_fn)(const float*, const float*, float*, long, long, long);
typedef int (*backward_fn)(const float*, const float*, const float*, float*, float*, long, long, long);
static forward_fn forward = nullptr, packed_forward = nullptr;
static backward_fn backward = nullptr;

extern "C" void tinychar_linear_set(void* f, void* b, void* p) {
    forward = (forward_fn)f; backward = (backward_fn)b; packed_forward = (forward_fn)p;
}

Tensor linear(Tensor x, Tensor weight) {
    Tensor a = torch::stable::contiguous(x), w = torch::stable::contiguous(weight);
    long M = a.size(0), K = a.size(1), N = w.size(0);
    Tensor y = torch::stable::new_empty(a, {M, N});
    STD_TORCH_CHECK(forward != nullptr, "tinychar: the linear kernel is not loaded");
    STD_TORCH_CHECK(forward((const float*)a.data_ptr(), (const float*)w.data_ptr(), (float*)y.data_ptr(), M, N, K) == 0,
                    "tinychar: the linear kernel ran out of memory");
    return y;
}

std::tuple<Tensor, Tensor> linear_backward(Tensor x, Tensor weight, Tensor dy) {
    Tensor a = torch::stable::contiguous(x), w = torch::stable::contiguous(weight), g = torch::stable::contiguous(dy);
    long M = a.size(0), K = a.size(1), N = w.size(0);
    Tensor dx = torch::stable::empty_like(a);
    Tensor dw = torch::stable::empty_like(w);
    STD_TORCH_CHECK(backward != nullptr, "tinychar: the linear kernel is not loaded");
    STD_TORCH_CHECK(backward((const float*)a.data_ptr(), (const float*)w.data_ptr(), (const float*)g.data_ptr(),
                             (float*)dx.data_ptr(), (float*)dw.data_ptr(), M, N, K) == 0,
                    "tinychar: the linear kernel ran out of memory");
    return std::make_tuple(dx, dw);
}

Tensor linear_packed(Tensor x, Tensor packed) {
    Tensor a = torch::stable::contiguous(x), p = torch::stable::contiguous(packed);
    long M = a.size(0), K = a.size(1), N = p.size(0) * 16;
    STD_TORCH_CHECK(p.size(1) == K, "tinychar: a packed weight of another width");
    Tensor y = torch::stable::new_empty(a, {M, N});
    STD_TORCH_CHECK(packed_forward != nullptr, "tinychar: the linear kernel is not loaded");
    packed_forward((const float*)a.data_ptr(), (const float*)p.data_ptr(), (float*)y.data_ptr(), M, N, K);
    return y;
}

STABLE_TORCH_LIBRARY_IMPL(tinychar, CPU, m) {
    m.impl("linear", TORCH_BOX(&linear));
    m.impl("linear_backward", TORCH_BOX(&linear_backward));
    m.impl("linear_packed", TORCH_BOX(&linear_packed));
}
"""

_KERNEL = PairedKernel("linear", SOURCE, OPERATORS, {"linear_forward": [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3,
                                                   "linear_backward": [ctypes.c_void_p] * 5 + [ctypes.c_long] * 3,
                                                   "linear_packed": [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3})

# The kernel (an OSError or subprocess.SubprocessError where it cannot be built), and its operators' C++ kernels
# (None where they cannot be: the Python ones below run then).
library, _operators = _KERNEL.library, _KERNEL.operators


def _ran(status: int) -> None:
    if status != 0:
        raise MemoryError("tinychar: the linear kernel ran out of memory")


def linear_in_python(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (M, in) @ weight (out, in)^T, float32: the operator's kernel where its C++ one (OPERATORS) is not loaded."""
    x, weight = x.contiguous(), weight.contiguous()
    y = x.new_empty(x.size(0), weight.size(0))
    _ran(library().linear_forward(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.size(0), weight.size(0),
                                  x.size(1)))
    return y


linear = define("linear", "(Tensor x, Tensor weight) -> Tensor", linear_in_python,
                lambda x, weight: x.new_empty(x.size(0), weight.size(0)))


def linear_backward_in_python(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of x and weight from dy (M, out), the gradient of linear's output: the operator's kernel where
    its C++ one is not loaded."""
    x, weight, dy = x.contiguous(), weight.contiguous(), dy.contiguous()
    dx, dw = torch.empty_like(x), torch.empty_like(weight)
    _ran(library().linear_backward(x.data_ptr(), weight.data_ptr(), dy.data_ptr(), dx.data_ptr(), dw.data_ptr(),
                                   x.size(0), weight.size(0), x.size(1)))
    return dx, dw


linear_backward = define("linear_backward", "(Tensor x, Tensor weight, Tensor dy) -> (Tensor, Tensor)",
                         linear_backward_in_python,
                         lambda x, weight, dy: (torch.empty_like(x, memory_format=torch.contiguous_format),
                                                torch.empty_like(weight, memory_format=torch.contiguous_format)))


class _Linear(torch.autograd.Function):
    """The two operators as one differentiable function, in the form torch.func's transforms take."""

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return linear(x, weight)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return linear_backward(*ctx.saved_tensors, dy)


def multiply(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (M, in) @ weight (out, in)^T, differentiable, through the kernel."""
    return _Linear.apply(x.contiguous(), weight)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight (out, in), out a multiple of 16, as linear_packed reads it: (out / 16, in, 16), panel q holding rows
    16q..16q+15 as columns."""
    out_features, in_features = weight.shape
    return weight.detach().reshape(out_features // 16, 16, in_features).transpose(1, 2).contiguous()


def linear_packed_in_python(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x (M, in) @ weight^T, the weight packed (pack): the operator's kernel where its C++ one is not loaded."""
    x, packed = x.contiguous(), packed.contiguous()
    y = x.new_empty(x.size(0), packed.size(0) * 16)
    _ran(library().linear_packed(x.data_ptr(), packed.data_ptr(), y.data_ptr(), x.size(0), y.size(1), x.size(1)))
    return y


linear_packed = define("linear_packed", "(Tensor x, Tensor packed) -> Tensor", linear_packed_in_python,
                       lambda x, packed: x.new_empty(x.size(0), packed.size(0) * 16))


def layers_taking(model: nn.Module) -> list[Linear]:
    """model's linear layers that the kernel applies to, whatever their rows: none where TINYCHAR_GEMM keeps PyTorch's
    products (model.linear.gemm_setting); else those whose sizes are multiples of 16, whose weights have at most
    MAX_WEIGHTS values, multiplying by PyTorch's BLAS (not oneDNN, where that was chosen: model/linear.py)."""
    if not own_gemm_wanted():
        return []
    forced = gemm_setting() == "1"
    return [m for m in model.modules() if isinstance(m, Linear) and m.in_features % 16 == 0
            and m.out_features % 16 == 0 and m.in_features * m.out_features <= MAX_WEIGHTS
            and (forced or m.onednn_min_rows is None)]


def attach(model: nn.Module, folder: Path | None = None, rows: int | None = None) -> bool:
    """Give each of model's linear layers that the kernel applies to (layers_taking) the kernel (built into folder,
    by default the compile cache, if it is not there), for its compiled training forward, where its products on rows
    (a micro-batch's: batch size times block; None: any) are worth its calls (MIN_MACS); False where none could take
    it or it cannot be built."""
    layers = [m for m in layers_taking(model)
              if rows is None or worth_it(rows * m.in_features * m.out_features, MIN_MACS, lambda: _operators(folder))]
    return give(layers, lambda: library(folder), multiply, SOURCE)


def packed_copies_fit(layers: list[Linear]) -> bool:
    """Whether the layers' packed weights (one more copy of each) take at most half of what this process may still
    allocate on the CPU; True where that cannot be told."""
    free = allocatable_bytes(torch.device("cpu"))
    return free is None or 2 * sum(m.weight.numel() * m.weight.element_size() for m in layers) <= free


def attach_packed(model: nn.Module, folder: Path | None = None) -> bool:
    """Give each of model's linear layers that the kernel applies to (layers_taking) its weight packed now
    (``Linear.packed``) and the product from it (``Linear.packed_kernel``), for compiled code without gradients: the
    compiled sampler (sampling/writing.py). A weight changed afterwards is not seen: attach again. False where none
    could take it, or the kernel or its operators in C++ cannot be built (through Python each call would cost more
    than most of these products), or where the packed copies would take more than half of the memory the process
    may still allocate (allocatable_bytes: a model that barely fits samples through PyTorch's products instead)."""
    layers = layers_taking(model)
    if not layers or not packed_copies_fit(layers) or _operators(folder) is None:
        return False
    if not give(layers, lambda: library(folder), linear_packed, SOURCE, "packed_kernel"):
        return False
    for m in layers:
        m.packed = pack(m.weight)
    return True
