"""Masked self-attention as one kernel of our own, for the compiled training step on a CPU.

The notes' attention, compiled by inductor, is six batched products through the BLAS (two forward, four backward),
the copies that split q, k and v into heads and join their gradients, and the masked softmax: for nanoGPT's CPU config
(batch 12, block 64, 4 heads of 32) about 1 ms a layer forward and backward on a 2-core Zen 3 EPYC, where each
batched product (48 of 64 x 32 x 64) runs at a fraction of the BLAS's rate and skips nothing above the diagonal. The
kernel below does one (batch, head) pair at a time, start to end, in the core's own cache: the scores and the softmax
of the positions each query may see, the weighted sum of values, and in the backward the four products, reading q, k
and v where the projection wrote them and writing the output and the gradients where the next layer reads them.
Measured there (torch 2.13, 2 threads, float32): 0.46-0.53 ms a layer against 1.0, and the whole compiled step of
that config 36.16 ms against 37.11 (medians of 16 rounds of 20 steps, interleaved in one process), the same losses
to 1e-6; with training/gelu_kernel.py as well, 35.05. On a 2-core Zen 2 EPYC (2026-12-06), alone and warm, the
layer took 218 us forward and 311 backward; then, its products in tiles of six rows (twelve registers, not eight), q's
and k's and v's heads turned by 8 x 8 blocks in registers, the softmax's sums and maxima in three steps of a tree, the
outputs written where they go (no copy), and the next pair's rows asked for ahead: 164 and 241 us, and the CPU
config's compiled step 30.9 -> 30.4 ms (docs/engine-record.md).

The same arithmetic as the notes' (scores scaled by 1/sqrt(head_size), the triangular mask, softmax, weighted sum), in
another order of additions, with exp computed by a polynomial to float32's precision. Deterministic: each pair is one
thread's, so a resumed run equals a straight one. Built once per shape by the C compiler torch.compile uses, kept in the
compile cache, and called by the compiled step (CompiledStep attaches it) and the eager step of a run long enough
(training/eager_kernels.py): evaluation, sampling and the attention maps keep the notes' code. Where it cannot be built
or does not apply (another dtype, dropout, additive scores, a head size not a multiple of 16, blocks over MAX_BLOCK),
the notes' code runs. How it is built, loaded and called: training/c_kernels.py.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch
from torch import nn

from model.attention import CausalSelfAttention

from .c_kernels import PRELUDE, build, define, give, operators, worth_it

# Longest block the kernel takes: its buffers for one (batch, head) pair live on the thread's stack (under 200 KB).
MAX_BLOCK = 128
# Least work (a micro-batch's rows times block times width: the attention's multiply-adds scale so) for which the
# kernel is attached: with the operators in C++, then where its two calls a layer go through Python (about 50 us each:
# a torch before 2.10). Measured on the 2-core Zen 3, interleaved in one process, medians of 12 rounds, width 64 at
# block 8: in C++, 4.2% faster at 131,072 (bench.py's rows), 1.5% at 32,768, 15% slower at 16,384 (64 rows of block 16,
# one head of 16); through Python, 1.1% faster at 524,288 (tiny.yaml's model); nanoGPT's CPU config, 6.3 million,
# gains most.
MIN_WORK = (65_536, 524_288)
VECTOR = 16  # the head size must be a multiple of this: the products' tiles are two vectors of 8 wide

SOURCE = PRELUDE + r"""
#define C (NH * HS)
#define C3 (3 * C)
#define TP ((T + 15) / 16 * 16)
/* every lane the max, or the sum, of v's eight: three steps of a tree, not seven in a row */
static inline v8 vmax(v8 a, v8 b) { return sel(a > b, a, b); }
static inline v8 allmax(v8 v) {
    v = vmax(v, MIX(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
    v = vmax(v, MIX(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
    return vmax(v, MIX(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
}
static inline v8 allsum(v8 v) {
    v += MIX(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += MIX(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    return v + MIX(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
}

/* The products: out[i][0:n) = sum over k of A(i, k) b[k][0:n). mode 0: k in [0, K), A(i, k) = a[i][k]; 1: k in [0,
   i]; 2: k in [i, K), A(i, k) = a[k][i] (a transposed). */
#define AT(i, k) (mode == 2 ? a[(k) * lda + (i)] : a[(i) * lda + (k)])
#define TAKES(i, k) ((mode != 1 || (k) <= (i)) && (mode != 2 || (k) >= (i)))
/* Rows i0 to i0 + R - 1 by columns j0 to j0 + 15, in 2R vector registers (R = 6: twelve, which Zen 2's two FMA
   units of five cycles each want in flight): first the k every row takes, then the few where the triangle cuts some
   rows off. */
#define MMTILE(R) \
static inline __attribute__((always_inline)) void mm##R(const float* __restrict__ a, int lda, \
        const float* __restrict__ b, int ldb, float* __restrict__ out, int ldo, int i0, int j0, int K, int mode) { \
    int klo = mode == 2 ? i0 : 0, khi = mode == 1 ? i0 + R : K; \
    int all_lo = mode == 2 ? i0 + R - 1 : klo, all_hi = mode == 1 ? i0 + 1 : khi; \
    v8 acc[R][2]; \
    for (int r = 0; r < R; r++) { acc[r][0] = BC(0.0f); acc[r][1] = BC(0.0f); } \
    for (int k = all_lo; k < all_hi; k++) { \
        v8 b0 = LD(b + k * ldb + j0), b1 = LD(b + k * ldb + j0 + 8); \
        for (int r = 0; r < R; r++) { v8 x = BC(AT(i0 + r, k)); acc[r][0] += x * b0; acc[r][1] += x * b1; } \
    } \
    for (int k = klo; k < khi; k++) { \
        if (k >= all_lo && k < all_hi) continue; \
        v8 b0 = LD(b + k * ldb + j0), b1 = LD(b + k * ldb + j0 + 8); \
        for (int r = 0; r < R; r++) { \
            v8 x = BC(TAKES(i0 + r, k) ? AT(i0 + r, k) : 0.0f); acc[r][0] += x * b0; acc[r][1] += x * b1; \
        } \
    } \
    for (int r = 0; r < R; r++) { \
        ST(out + (i0 + r) * ldo + j0, acc[r][0]); ST(out + (i0 + r) * ldo + j0 + 8, acc[r][1]); \
    } \
}
MMTILE(1) MMTILE(2) MMTILE(3) MMTILE(4) MMTILE(5) MMTILE(6)
/* The product for rows i in [0, m), n a multiple of 16, in tiles of six rows (the last m mod 6 in one of its own);
   causal_n: only the columns up to each tile's last diagonal. Each value is summed in one order, on any thread. */
static inline __attribute__((always_inline)) void mm(const float* __restrict__ a, int lda, const float* __restrict__ b,
        int ldb, float* __restrict__ out, int ldo, int m, int K, int n, int mode, int causal_n) {
    for (int i0 = 0; i0 < m; i0 += 6) {
        int rows = m - i0 < 6 ? m - i0 : 6;
        int nn = causal_n ? (i0 + rows + 15) / 16 * 16 : n;
        if (nn > n) nn = n;
        for (int j0 = 0; j0 < nn; j0 += 16)
            switch (rows) {
                case 6: mm6(a, lda, b, ldb, out, ldo, i0, j0, K, mode); break;
                case 5: mm5(a, lda, b, ldb, out, ldo, i0, j0, K, mode); break;
                case 4: mm4(a, lda, b, ldb, out, ldo, i0, j0, K, mode); break;
                case 3: mm3(a, lda, b, ldb, out, ldo, i0, j0, K, mode); break;
                case 2: mm2(a, lda, b, ldb, out, ldo, i0, j0, K, mode); break;
                default: mm1(a, lda, b, ldb, out, ldo, i0, j0, K, mode);
            }
    }
}

/* t (HS x TP) = the first T rows of x (rows ld apart, HS wide) transposed and times f, zero past column T */
static inline void transposed(const float* x, long ld, float* t, float f) {
    int whole = T / 8 * 8;
    for (int j = 0; j < whole; j += 8)
        for (int d = 0; d < HS; d += 8) transpose8(x + j * ld + d, ld, t + d * TP + j, TP, BC(f));
    for (int d = 0; d < HS; d++)
        for (int j = whole; j < TP; j++) t[d * TP + j] = j < T ? x[j * ld + d] * f : 0.0f;
}

/* n floats from x asked for, a cache line at a time: each pair asks for the next pair's rows (the next head's, or the
   next sequence's first) as it goes, which in the step come from memory. The CPU config's shape alone, 32 MB written
   before each call (two runs): forward 291-319 -> 237-248 us, backward 463-508 -> 427-453; in its compiled step
   about 0.1 ms of 30 (the kernel's share of perf's samples 7.3% -> 6.9%). */
static inline void ask_for(const float* x, int n) { for (int j = 0; j < n; j += 16) __builtin_prefetch(x + j, 0, 3); }

/* One (batch, head) pair: q, k, v rows of qkv (B, T, 3C), y (B, T, C), P its softmax (T, TP), 0 past the diagonal. */
static void forward_pair(const float* __restrict__ qkv, float* __restrict__ y, float* __restrict__ P, int bh,
                         int pairs, float scale) {
    int b = bh / NH, h = bh % NH;
    const float* q = qkv + (long)b * T * C3 + h * HS;
    const float* k = q + C;
    const float* v = q + 2 * C;
    int after = bh + 1 < pairs ? bh + 1 : bh;  /* the last pair asks for its own rows again */
    const float* next = qkv + (long)(after / NH) * T * C3 + after % NH * HS;
    float kt[HS * TP] __attribute__((aligned(32)));
    transposed(k, C3, kt, scale);
    float* p = P + (long)bh * T * TP;
    mm(q, C3, kt, TP, p, TP, T, HS, TP, 0, 1);
    const v8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    for (int i = 0; i < T; i++) {
        float* row = p + i * TP;
        int nv = (i + 8) / 8 * 8;  /* the vectors that hold columns 0..i */
        v8 mv = BC(-3.0e38f), sv = BC(0.0f);
        for (int j = 0; j < nv; j += 8) {
            v8 s = sel(lane + BC(j) <= BC(i), LD(row + j), BC(-3.0e38f));
            mv = sel(s > mv, s, mv);
        }
        v8 m = allmax(mv);
        for (int j = 0; j < nv; j += 8) {
            v8 e = sel(lane + BC(j) <= BC(i), vexp(LD(row + j) - m), BC(0.0f));
            ST(row + j, e); sv += e;
        }
        v8 inv = BC(1.0f) / allsum(sv);
        for (int j = 0; j < nv; j += 8) ST(row + j, LD(row + j) * inv);
        for (int c = 0; c < C3; c += C) ask_for(next + i * C3 + c, HS);
        for (int j = nv; j < TP; j += 8) ST(row + j, BC(0.0f));
    }
    mm(p, TP, v, C3, y + (long)b * T * C + h * HS, C, T, T, HS, 1, 0);
}

void attention_forward(const float* qkv, float* y, float* P, int B, float scale) {
#pragma omp parallel for schedule(static)
    for (int bh = 0; bh < B * NH; bh++) forward_pair(qkv, y, P, bh, B * NH, scale);
}

/* The gradients of q, k and v of one pair, written into dqkv (B, T, 3C), from dy (B, T, C) and the saved softmax. */
static void backward_pair(const float* __restrict__ qkv, const float* __restrict__ P, const float* __restrict__ dy,
                          float* __restrict__ dqkv, int bh, int pairs, float scale) {
    int b = bh / NH, h = bh % NH;
    const float* q = qkv + (long)b * T * C3 + h * HS;
    const float* k = q + C;
    const float* v = q + 2 * C;
    const float* p = P + (long)bh * T * TP;
    const float* g = dy + (long)b * T * C + h * HS;
    float* dq = dqkv + (long)b * T * C3 + h * HS;
    float* dk = dq + C;
    float* dv = dq + 2 * C;
    int after = bh + 1 < pairs ? bh + 1 : bh;
    const float* next = qkv + (long)(after / NH) * T * C3 + after % NH * HS;
    const float* pnext = P + (long)after * T * TP;
    const float* gnext = dy + (long)(after / NH) * T * C + after % NH * HS;
    float vt[HS * TP] __attribute__((aligned(32)));
    float ds[T * TP] __attribute__((aligned(32)));
    transposed(v, C3, vt, 1.0f);
    mm(g, C, vt, TP, ds, TP, T, HS, TP, 0, 1);  /* dP = dy v^T */
    for (int i = 0; i < T; i++) {  /* dS = P (dP - rowsum(P dP)) scale */
        float* row = ds + i * TP;
        const float* pr = p + i * TP;
        int nv = (i + 8) / 8 * 8;
        v8 acc = BC(0.0f);
        for (int j = 0; j < nv; j += 8) acc += LD(pr + j) * LD(row + j);
        v8 dot = allsum(acc);
        for (int j = 0; j < nv; j += 8) ST(row + j, LD(pr + j) * (LD(row + j) - dot) * BC(scale));
        for (int j = nv; j < TP; j += 8) ST(row + j, BC(0.0f));
        for (int c = 0; c < C3; c += C) ask_for(next + i * C3 + c, HS);
        ask_for(pnext + i * TP, TP);
        ask_for(gnext + i * C, HS);
    }
    mm(ds, TP, k, C3, dq, C3, T, T, HS, 1, 0);  /* dq = dS k */
    mm(ds, TP, q, C3, dk, C3, T, T, HS, 2, 0);  /* dk = dS^T q */
    mm(p, TP, g, C, dv, C3, T, T, HS, 2, 0);  /* dv = P^T dy */
}

void attention_backward(const float* qkv, const float* P, const float* dy, float* dqkv, int B, float scale) {
#pragma omp parallel for schedule(static)
    for (int bh = 0; bh < B * NH; bh++) backward_pair(qkv, P, dy, dqkv, bh, B * NH, scale);
}
"""

# The two operators' kernels for CPU tensors in C++ (c_kernels.operators), calling the kernel of the tensors' shape.
# That kernel's functions are given to them by Python the first time they meet the shape (find), through add.
OPERATORS = r"""
typedef void (*forward_fn)(const float*, float*, float*, int, float);
typedef void (*backward_fn)(const float*, const float*, const float*, float*, int, float);
typedef int (*finder_fn)(long block, long head, long heads);
struct Kernel { long block, head, heads; forward_fn forward; backward_fn backward; };
static std::mutex kernels_lock;
static std::vector<Kernel> kernels;
static finder_fn finder = nullptr;

extern "C" void tinychar_attention_finder(finder_fn f) { finder = f; }
extern "C" void tinychar_attention_add(long block, long head, long heads, void* forward, void* backward) {
    std::lock_guard<std::mutex> hold(kernels_lock);
    kernels.push_back({block, head, heads, (forward_fn)forward, (backward_fn)backward});
}

static Kernel kernel_for(long block, long head, long heads) {
    for (int asked = 0;; asked++) {
        {
            std::lock_guard<std::mutex> hold(kernels_lock);
            for (const Kernel& k : kernels)
                if (k.block == block && k.head == head && k.heads == heads) return k;
        }
        /* not under the lock: Python takes the GIL, which another thread may hold while it waits for the lock */
        STD_TORCH_CHECK(asked == 0 && finder != nullptr && finder(block, head, heads) == 0,
                        "tinychar: no attention kernel for block ", block, ", heads ", heads, " of ", head);
    }
}

static double scale_of(long head) { return 1.0 / std::sqrt((double)head); }  /* as Python's 1.0 / math.sqrt */

std::tuple<Tensor, Tensor> causal_attention(Tensor qkv, int64_t n_head) {
    Tensor x = torch::stable::contiguous(qkv);
    long B = x.size(0), T = x.size(1), C = x.size(2) / 3, head = C / n_head;
    Kernel k = kernel_for(T, head, n_head);
    Tensor y = torch::stable::new_empty(x, {B, T, C});
    Tensor weights = torch::stable::new_empty(x, {B, n_head, T, (T + 15) / 16 * 16});
    k.forward((const float*)x.data_ptr(), (float*)y.data_ptr(), (float*)weights.data_ptr(), (int)B,
              (float)scale_of(head));
    return std::make_tuple(y, weights);
}

Tensor causal_attention_backward(Tensor qkv, Tensor weights, Tensor dy, int64_t n_head) {
    Tensor x = torch::stable::contiguous(qkv), g = torch::stable::contiguous(dy);
    long B = x.size(0), T = x.size(1), head = x.size(2) / 3 / n_head;
    Kernel k = kernel_for(T, head, n_head);
    Tensor dx = torch::stable::empty_like(x);
    k.backward((const float*)x.data_ptr(), (const float*)weights.data_ptr(), (const float*)g.data_ptr(),
               (float*)dx.data_ptr(), (int)B, (float)scale_of(head));
    return dx;
}

STABLE_TORCH_LIBRARY_IMPL(tinychar, CPU, m) {
    m.impl("causal_attention", TORCH_BOX(&causal_attention));
    m.impl("causal_attention_backward", TORCH_BOX(&causal_attention_backward));
}
"""


def eligible(module: CausalSelfAttention, block_size: int) -> bool:
    """Whether the kernel computes what module's training forward does: dot-product scores, the notes' explicit
    attention, no dropout, a head size it tiles and a block it holds."""
    head = module.n_embd // module.n_head
    return (module.additive is None and not module.fused and module.dropout_p == 0.0 and head % VECTOR == 0
            and 0 < block_size <= MAX_BLOCK)


_LIBRARIES: dict[tuple[int, int, int], ctypes.CDLL] = {}


def library(block_size: int, head_size: int, n_head: int, folder: Path | None = None) -> ctypes.CDLL:
    """The kernel for this shape (c_kernels.build: an OSError or subprocess.SubprocessError where it cannot be)."""
    shape = (block_size, head_size, n_head)
    if shape not in _LIBRARIES:
        lib = build("attention", SOURCE, [f"-DT={block_size}", f"-DHS={head_size}", f"-DNH={n_head}"], folder)
        pointer = ctypes.c_void_p
        lib.attention_forward.argtypes = [pointer, pointer, pointer, ctypes.c_int, ctypes.c_float]
        lib.attention_backward.argtypes = [pointer, pointer, pointer, pointer, ctypes.c_int, ctypes.c_float]
        _LIBRARIES[shape] = lib
    return _LIBRARIES[shape]


@ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_long, ctypes.c_long, ctypes.c_long)
def _find(block_size: int, head_size: int, n_head: int) -> int:
    """For the C++ operators, the first time they meet a shape: its kernel's functions, given to them; 0, or 1 where
    it cannot be built (they raise then)."""
    try:
        lib = library(block_size, head_size, n_head)
    except Exception:  # noqa: BLE001 - whatever stops the build, the operator raises, naming the shape
        return 1
    address = ctypes.cast(lib.attention_forward, ctypes.c_void_p), ctypes.cast(lib.attention_backward, ctypes.c_void_p)
    _operators().tinychar_attention_add(block_size, head_size, n_head, *address)
    return 0


def _operators(folder: Path | None = None) -> ctypes.CDLL | None:
    """The operators' C++ kernels, loaded (c_kernels.operators), or None: the Python ones below run then."""
    ops = operators("attention-operators", OPERATORS, folder)
    if ops is not None and not _FINDING:
        ops.tinychar_attention_add.argtypes = [ctypes.c_long] * 3 + [ctypes.c_void_p] * 2
        ops.tinychar_attention_finder(_find)
        _FINDING.append(ops)
    return ops


_FINDING: list[ctypes.CDLL] = []


def _padded(block_size: int) -> int:
    return (block_size + 15) // 16 * 16


def _loaded(qkv: torch.Tensor, n_head: int) -> tuple[ctypes.CDLL, float]:
    B, T, C3 = qkv.shape
    head = C3 // 3 // n_head
    # (built here for a step loaded whole from the cache, in a process that has not attached the kernel)
    return library(T, head, n_head), 1.0 / math.sqrt(head)


def causal_attention_in_python(qkv: torch.Tensor, n_head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv (B, T, 3C) float32, contiguous -> (the attention's output (B, T, C), its softmax (B, n_head, T, T padded to
    a multiple of 16), which the backward reads): the operator's kernel where its C++ one (OPERATORS) is not loaded."""
    B, T, C3 = qkv.shape
    lib, scale = _loaded(qkv, n_head)
    y = qkv.new_empty(B, T, C3 // 3)
    weights = qkv.new_empty(B, n_head, T, _padded(T))
    lib.attention_forward(qkv.data_ptr(), y.data_ptr(), weights.data_ptr(), B, scale)
    return y, weights


def _shapes(qkv: torch.Tensor, n_head: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, C3 = qkv.shape
    return qkv.new_empty(B, T, C3 // 3), qkv.new_empty(B, n_head, T, _padded(T))


causal_attention = define("causal_attention", "(Tensor qkv, int n_head) -> (Tensor, Tensor)",
                          causal_attention_in_python, _shapes)


def causal_attention_backward_in_python(qkv: torch.Tensor, weights: torch.Tensor, dy: torch.Tensor, n_head: int
                                        ) -> torch.Tensor:
    """The gradient of qkv (B, T, 3C), from the gradient dy (B, T, C) of causal_attention's output: the operator's
    kernel where its C++ one is not loaded."""
    lib, scale = _loaded(qkv, n_head)
    dy = dy.contiguous()
    dqkv = torch.empty_like(qkv)
    lib.attention_backward(qkv.data_ptr(), weights.data_ptr(), dy.data_ptr(), dqkv.data_ptr(), qkv.size(0), scale)
    return dqkv


causal_attention_backward = define("causal_attention_backward",
                                   "(Tensor qkv, Tensor weights, Tensor dy, int n_head) -> Tensor",
                                   causal_attention_backward_in_python,
                                   lambda qkv, weights, dy, n_head: torch.empty_like(qkv))


class _CausalAttention(torch.autograd.Function):
    """The two operators as one differentiable function, in the form torch.func's transforms take (the compiled
    step's gradient is torch.func.grad_and_value's)."""

    @staticmethod
    def forward(qkv: torch.Tensor, n_head: int) -> tuple[torch.Tensor, torch.Tensor]:
        return causal_attention(qkv, n_head)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple) -> None:
        ctx.save_for_backward(inputs[0], output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.n_head = inputs[1]

    @staticmethod
    def backward(ctx, dy: torch.Tensor, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        qkv, weights = ctx.saved_tensors
        return causal_attention_backward(qkv, weights, dy, ctx.n_head), None


def attend(qkv: torch.Tensor, n_head: int) -> torch.Tensor:
    """The masked multi-head attention of qkv (B, T, 3C): its output (B, T, C)."""
    return _CausalAttention.apply(qkv.contiguous(), n_head)[0]


def attach(model: nn.Module, folder: Path | None = None, rows: int | None = None) -> bool:
    """Give each of model's attention layers that the kernel applies to the kernel (built into folder, by default the
    compile cache, if it is not there), for its compiled training forward; False where none could take it, it cannot
    be built, or rows (a micro-batch's: batch size times block; None: any) give too little work to win its calls back
    (MIN_WORK; the notes' attention runs then, as before)."""
    block_size = getattr(getattr(model, "config", None), "block_size", 0)
    layers = [m for m in model.modules() if isinstance(m, CausalSelfAttention) and eligible(m, block_size)]
    if not layers or rows is not None and not worth_it(rows * block_size * layers[0].n_embd, MIN_WORK,
                                                       lambda: _operators(folder)):
        return False
    head = layers[0].n_embd // layers[0].n_head
    return give(layers, lambda: (library(block_size, head, layers[0].n_head, folder), _operators(folder)), attend,
                SOURCE)


