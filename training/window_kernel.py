"""The compiled sampler's pass over its window as one kernel of tinychar's own, on CPUs where the linear kernel's
products outrun PyTorch's (training/linear_kernel.py).

The compiled sampler (model/sampler.py) computes, for every character, the final state of the window's last position:
the embeddings, then each block's layer norm, attention projections, masked attention, output projection, second layer
norm and MLP on the window's rows (the last block on its last row alone). Compiled by inductor, that is dozens of
kernels and operator calls a character, each its own parallel region: on a 2-core Zen 4 EPYC, the block-64 CPU model
(4 layers of 128, sample.py --compile true), perf counted the second thread waiting in OpenMP for a third of its time
while the first ran what lay between the products, and the products themselves (the linear kernel's tiles) 45% of the
threads' time. Here the whole pass is one parallel region, with a barrier between its steps and nothing else: the
products shared six rows at a time with all their panels (under twelve rows, two panels at a time), the attention a
head at a time (the scores and the weighted sum through the same tiles, the keys and values turned into panels; a row
at a time where only the last row is wanted, or the heads are not sixteen wide), each taken by whichever thread comes
for it next; the layer norms' rows and the embeddings in fixed halves. The products are the linear kernel's tiles,
from weights packed once into one buffer (pack_weights); GELU is the GELU kernel's (erf as ATen computes it); the
attention is the notes' (scores scaled by 1/sqrt(head_size), softmax over the past, weighted sum of values); the layer
norms are PyTorch's (biased variance, eps 1e-5). The same arithmetic in float32 in another order of additions: the
state equals GPT.hidden_at's to about 1e-6 (the tests), and the characters drawn from it are the same. Measured:
docs/engine-record.md (2026-12-07, the Zen 4: the compiled sampler's window as one kernel).

It applies to a GPT in eval mode with pre-norm blocks and dot-product scores, in float32 on the CPU, whose width is a
multiple of 16 and head size a multiple of 8 (applies); the sampler then draws one character a pass (no span: the pass
is already one region). Compiled code calls it through the operator tinychar::window_hidden, whose kernel for CPU
tensors is C++ (c_kernels.operators) where torch has its stable C++ interface (elsewhere compiled code does without:
through Python each call would cost a round trip); the eager sampler calls it through Python (window_hidden_in_python),
in place of a few dozen operators a character. How it is built and loaded: training/c_kernels.py.
"""

from __future__ import annotations

import ctypes
import hashlib
import subprocess
from pathlib import Path

import torch

from model.config import GPTConfig
from model.gpt import GPT
from model.linear import own_gemm_wanted
from model.sampler import WindowPass

from .c_kernels import PairedKernel, define
from .gelu_kernel import SOURCE as GELU_SOURCE
from .linear_kernel import MAX_WEIGHTS, TILES, pack
from .memory import allocatable_bytes

# The most windows a call for which the sampler takes the kernel: it computes a batch's windows one after another,
# where the model's own layers multiply all their rows at once. Measured on a 2-core Zen 4 EPYC (the block-64 CPU
# model, 2 threads, compiled, in one process against the step without it, four rounds each): one window 1.17x as fast
# (1,844-1,892 characters a second against 1,557-1,602), four 0.83x (1,439-1,469 against 1,713-1,784), sixteen 1.08x
# (2,072-2,109 against 1,912-1,961); between them not measured, so batches keep the model's layers.
MAX_BATCH = 1
# The same for the eager sampler (sample.py when it does not compile), whose layers are each an operator call through
# Python: there the kernel outruns them at every batch measured (the Zen 4, one process, 600 characters, the eager
# slide's threads; docs/engine-record.md): block 8 (3 layers of 64) 3.5x for 4 windows and 1.8x for 16, the
# block-64 CPU model 1.8-2.0x for 4 and 1.17x for 16. Beyond that not measured.
EAGER_MAX_BATCH = 16

# The most a head may be wide (its weighted sum of values is held in registers' worth of accumulators on the stack).
MAX_HEAD_SIZE = 512

SOURCE = GELU_SOURCE.split("void gelu_forward")[0] + TILES + r"""
#include <math.h>
static inline float hsum(v8 v) {
    float t[8]; ST(t, v);
    return ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
}
/* y = layer_norm(x) (C values, C a multiple of 8): biased variance, eps 1e-5, weight w and bias b (or NULL) */
static void layer_norm(const float* x, float* y, const float* w, const float* b, long C) {
    v8 s = BC(0.0f), q = BC(0.0f);
    for (long c = 0; c < C; c += 8) s += LD(x + c);
    v8 mean = BC(hsum(s) / (float)C);
    for (long c = 0; c < C; c += 8) { v8 d = LD(x + c) - mean; q += d * d; }
    v8 r = BC(1.0f / sqrtf(hsum(q) / (float)C + 1e-5f));
    for (long c = 0; c < C; c += 8) {
        v8 v = (LD(x + c) - mean) * r * LD(w + c);
        ST(y + c, b ? v + LD(b + c) : v);
    }
}
/* Rows r0..r1 of y (rows ldy apart) = x (rows ldx apart, K wide) W^T, through W's panels q0..q1 (W packed: panel q
   holds W's rows 16q..16q+15 as K rows of sixteen), added to y where add, plus the panels' bias (or NULL), then GELU
   where gelu */
static void part(const float* x, long ldx, const float* p, const float* bias, float* y, long ldy, long r0, long r1,
                 long q0, long q1, long K, int add, int gelu) {
    for (long i = r0; i < r1; i += 6)
        for (long q = q0; q < q1; q++)
            tile(r1 - i < 6 ? r1 - i : 6, K, x + i * ldx, ldx, 1, p + q * K * 16, y + i * ldy + q * 16, ldy, add);
    for (long i = r0; i < r1; i++)
        for (long c = q0 * 16; c < q1 * 16; c += 8) {
            v8 d, v = LD(y + i * ldy + c);
            if (bias) v += LD(bias + c);
            ST(y + i * ldy + c, gelu ? v * cdf(v, &d) : v);
        }
}
/* part() for rows r0..r1 and panels q0..q1, shared out by the threads of the region: six rows at a time with all the
   panels (each thread's rows stay in its first-level cache while the panels stream by), or where there are fewer than
   twelve rows a few panels at a time. No barrier at the end. */
static void shared_part(const float* x, long ldx, const float* p, const float* bias, float* y, long ldy, long r0,
                        long r1, long q0, long q1, long K, int add, int gelu) {
    if (r1 - r0 >= 12) {
#pragma omp for schedule(dynamic, 1) nowait
        for (long i = r0; i < r1; i += 6)
            part(x, ldx, p, bias, y, ldy, i, i + 6 < r1 ? i + 6 : r1, q0, q1, K, add, gelu);
    } else {
#pragma omp for schedule(dynamic, 2) nowait
        for (long q = q0; q < q1; q++) part(x, ldx, p, bias, y, ldy, r0, r1, q, q + 1, K, add, gelu);
    }
}
/* Head h's attention at row i: o (hs values) = softmax over j <= i of (q_i . k_j) / sqrt(hs), applied to the v_j; q,
   k and v are the row's thirds of qkv (rows ld apart, C wide each); s holds i + 8 floats */
static void attend(const float* qkv, long ld, long C, long hs, long h, long i, float scale, float* s, float* o) {
    const float* q = qkv + i * ld + h * hs;
    const float *k0 = qkv + C + h * hs, *v0 = qkv + 2 * C + h * hs;
    long n = i + 1;
    float m = -INFINITY, t[64], u[64];
    for (long j0 = 0; j0 < n; j0 += 8) {  /* eight keys' dot products at once, summed across by a transpose */
        long jn = n - j0 < 8 ? n - j0 : 8;
        for (long jj = 0; jj < 8; jj++) {
            v8 acc = BC(0.0f);
            if (jj < jn)
                for (long c = 0; c < hs; c += 8) acc += LD(q + c) * LD(k0 + (j0 + jj) * ld + c);
            ST(t + 8 * jj, acc);
        }
        transpose8(t, 8, u, 8, BC(1.0f));
        v8 d = ((LD(u) + LD(u + 8)) + (LD(u + 16) + LD(u + 24)))
               + ((LD(u + 32) + LD(u + 40)) + (LD(u + 48) + LD(u + 56)));
        ST(s + j0, d * BC(scale));
        for (long jj = 0; jj < jn; jj++) m = s[j0 + jj] > m ? s[j0 + jj] : m;
    }
    v8 z8 = BC(0.0f);
    long j = 0;
    for (; j + 8 <= n; j += 8) { v8 e = vexp(LD(s + j) - BC(m)); ST(s + j, e); z8 += e; }
    float z = hsum(z8);
    for (; j < n; j++) { s[j] = expf(s[j] - m); z += s[j]; }
    v8 acc[64];
    long vs = hs / 8;
    for (long c = 0; c < vs; c++) acc[c] = BC(0.0f);
    for (j = 0; j < n; j++) {
        v8 p = BC(s[j]);
        const float* v = v0 + j * ld;
        for (long c = 0; c < vs; c++) acc[c] += p * LD(v + 8 * c);
    }
    v8 rz = BC(1.0f / z);
    for (long c = 0; c < vs; c++) ST(o + 8 * c, acc[c] * rz);
}

/* Head h's attention for rows 0..n-1 at once (hs a multiple of 16): the scores S = Q K^T / sqrt(hs) through the
   tiles (K turned into panels of sixteen keys, the tiles above the diagonal skipped), each row's softmax over its
   past, and O = P V through the tiles again (V's columns in panels). buf holds n16 (hs + n16) + hs n16 floats, n16
   being n rounded up to 16. */
static void attend_head(const float* qkv, long ld, long C, long hs, long h, long n, float scale, float* buf,
                        float* y, long ldy) {
    long n16 = (n + 15) / 16 * 16;
    float *kt = buf, *vp = kt + hs * n16, *S = vp + hs * n16;
    const float *q = qkv + h * hs, *k = qkv + C + h * hs, *v = qkv + 2 * C + h * hs;
    for (long j = 0; j < n16; j += 8)  /* kt: panel jp holds keys 16jp..16jp+15 as hs rows of sixteen, scaled */
        for (long c = 0; c < hs; c += 8) {
            float* dst = kt + ((j / 16) * hs + c) * 16 + j % 16;
            if (j + 8 <= n) { transpose8(k + j * ld + c, ld, dst, 16, BC(scale)); continue; }
            for (long cc = 0; cc < 8; cc++)  /* the last keys, and zeros after them */
                for (long jj = 0; jj < 8; jj++)
                    dst[cc * 16 + jj] = j + jj < n ? k[(j + jj) * ld + c + cc] * scale : 0.0f;
        }
    for (long j = 0; j < n16; j++)  /* vp: panel cp holds columns 16cp..16cp+15 of every key's value; zeros after */
        for (long cp = 0; cp < hs / 16; cp++) {
            float* dst = vp + (cp * n16 + j) * 16;
            ST(dst, j < n ? LD(v + j * ld + cp * 16) : BC(0.0f));
            ST(dst + 8, j < n ? LD(v + j * ld + cp * 16 + 8) : BC(0.0f));
        }
    for (long i = 0; i < n; i += 6) {
        long R = n - i < 6 ? n - i : 6, keys = (i + R + 15) / 16 * 16;  /* rows i..i+R-1 see keys below i+R */
        for (long jp = 0; jp < keys / 16; jp++)
            tile(R, hs, q + i * ld, ld, 1, kt + jp * hs * 16, S + i * n16 + jp * 16, n16, 0);
        for (long r = i; r < i + R; r++) {  /* the row's softmax over keys 0..r; zeros after them up to keys */
            float* row = S + r * n16;
            long whole = (r + 1) / 8 * 8;
            v8 m8 = BC(-INFINITY);
            for (long j = 0; j < whole; j += 8) { v8 e = LD(row + j); m8 = sel(e > m8, e, m8); }
            float t[8];
            ST(t, m8);
            float m = t[0];
            for (int e = 1; e < 8; e++) m = t[e] > m ? t[e] : m;
            for (long j = whole; j <= r; j++) m = row[j] > m ? row[j] : m;
            v8 z8 = BC(0.0f);
            for (long j = 0; j < whole; j += 8) { v8 e = vexp(LD(row + j) - BC(m)); ST(row + j, e); z8 += e; }
            float z = hsum(z8);
            for (long j = whole; j <= r; j++) { row[j] = expf(row[j] - m); z += row[j]; }
            for (long j = r + 1; j < keys; j++) row[j] = 0.0f;
            v8 rz = BC(1.0f / z);
            for (long j = 0; j < keys; j += 8) ST(row + j, LD(row + j) * rz);
        }
        for (long cp = 0; cp < hs / 16; cp++)
            tile(R, keys, S + i * n16, n16, 1, vp + cp * n16 * 16, y + i * ldy + h * hs + cp * 16, ldy, 0);
    }
}

/* The final-layer-norm state (C values, into out) of position n - 1 of the window ids[0..n) (n <= T), as
   GPT.hidden_at gives it, for a pre-norm GPT of L blocks of width C with H heads. w: the weights as pack_weights lays
   them out; first: the first block's projections looked up (GPT.first_projections, V x T x 3C), or NULL. 0, or -1
   out of memory. */
int window_hidden(const long* ids, long n, long V, long T, long C, long H, long L, int bias, const float* first,
                  const float* w, float* out) {
    static __thread float* work = NULL;
    static __thread long size = 0;
    long T16 = (T + 15) / 16 * 16, need = 10 * T * C + T + 16 + omp_get_max_threads() * T16 * (T16 + 2 * C / H);
    if (size < need) {
        free(work);
        work = aligned_alloc(64, sizeof(float) * ((need + 15) / 16 * 16));
        size = work ? need : 0;
        if (!work) return -1;
    }
    float *x = work, *h = x + T * C, *qkv = h + T * C, *y = qkv + 3 * T * C, *f = y + T * C;
    const float *wte = w, *wpe = wte + V * C, *layers = wpe + T * C;
    long per_layer = 12 * C * C + 2 * C + (bias ? 11 * C : 0), hs = C / H;
    float scale = 1.0f / sqrtf((float)hs);
    /* One parallel region: each step's work shared out (its implicit barrier ends it), the products' panels and
       the heads dealt one at a time as the threads come for them, so that a thread slowed by the machine takes
       fewer (with the shares fixed, the other waited for it at every step) */
#pragma omp parallel
    {
        int id = omp_get_thread_num();
        float s[T + 8];
        long T16 = (T + 15) / 16 * 16;
        float* heads = f + 4 * T * C + T + 16 + id * T16 * (T16 + 2 * hs);  /* this thread's attend_head buffer */
#pragma omp for schedule(static)
        for (long i = 0; i < n; i++)
            for (long c = 0; c < C; c += 8) ST(x + i * C + c, LD(wte + ids[i] * C + c) + LD(wpe + i * C + c));
        for (long l = 0; l < L; l++) {
            const float* p = layers + l * per_layer;
            const float *ln1w = p, *ln1b = bias ? p + C : NULL;
            p += bias ? 2 * C : C;
            const float *attn = p, *attn_b = bias ? p + 3 * C * C : NULL;
            p += 3 * C * C + (bias ? 3 * C : 0);
            const float *proj = p, *proj_b = bias ? p + C * C : NULL;
            p += C * C + (bias ? C : 0);
            const float *ln2w = p, *ln2b = bias ? p + C : NULL;
            p += bias ? 2 * C : C;
            const float *fc = p, *fc_b = bias ? p + 4 * C * C : NULL;
            p += 4 * C * C + (bias ? 4 * C : 0);
            const float *mp = p, *mp_b = bias ? p + 4 * C * C : NULL;
            long r0 = l == L - 1 ? n - 1 : 0;  /* the rows whose output is wanted: the last block's last row alone */
            if (l == 0 && first) {
#pragma omp for schedule(static)
                for (long i = 0; i < n; i++) memcpy(qkv + i * 3 * C, first + (ids[i] * T + i) * 3 * C, 12 * C);
            } else {
#pragma omp for schedule(static)
                for (long i = 0; i < n; i++) layer_norm(x + i * C, h + i * C, ln1w, ln1b, C);
                /* keys and values of every row (panels C/16 on), the queries of the rows wanted */
                shared_part(h, C, attn, attn_b, qkv, 3 * C, 0, n, C / 16, 3 * C / 16, C, 0, 0);
                shared_part(h, C, attn, attn_b, qkv, 3 * C, r0, n, 0, C / 16, C, 0, 0);
#pragma omp barrier
            }
            if (r0 == 0 && hs % 16 == 0) {  /* every row: a head at a time, through the tiles */
#pragma omp for schedule(dynamic, 1)
                for (long hh = 0; hh < H; hh++) attend_head(qkv, 3 * C, C, hs, hh, n, scale, heads, y, C);
            } else {  /* a (row, head) at a time */
#pragma omp for schedule(dynamic, 1)
                for (long k = 0; k < (n - r0) * H; k++)
                    attend(qkv, 3 * C, C, hs, k % H, r0 + k / H, scale, s, y + (r0 + k / H) * C + (k % H) * hs);
            }
            shared_part(y, C, proj, proj_b, x, C, r0, n, 0, C / 16, C, 1, 0);
#pragma omp barrier
#pragma omp for schedule(static)
            for (long i = r0; i < n; i++) layer_norm(x + i * C, h + i * C, ln2w, ln2b, C);
            shared_part(h, C, fc, fc_b, f, 4 * C, r0, n, 0, 4 * C / 16, C, 0, 1);
#pragma omp barrier
            shared_part(f, 4 * C, mp, mp_b, x, C, r0, n, 0, C / 16, 4 * C, 1, 0);
#pragma omp barrier
        }
    }
    const float* lnf = layers + L * per_layer;
    layer_norm(x + (n - 1) * C, out, lnf, bias ? lnf + C : NULL, C);
    return 0;
}

/* window_hidden for each of B windows (rows T apart) holding n characters each: out (B x C). 0; -1 out of memory; -2
   where n is not in 1..T or a character is not in 0..V-1 (nothing computed) */
int window_hidden_rows(const long* window, long B, long n, long V, long T, long C, long H, long L, int bias,
                       const float* first, const float* w, float* out) {
    if (n < 1 || n > T || H < 1 || C % H != 0) return -2;
    for (long r = 0; r < B; r++)
        for (long i = 0; i < n; i++)
            if (window[r * T + i] < 0 || window[r * T + i] >= V) return -2;
    for (long r = 0; r < B; r++)
        if (window_hidden(window + r * T, n, V, T, C, H, L, bias, first, w, out + r * C) != 0) return -1;
    return 0;
}
"""

# The operator's kernel for CPU tensors in C++ (c_kernels.operators), given the kernel's function once both are loaded.
OPERATORS = r"""
typedef int (*rows_fn)(const long*, long, long, long, long, long, long, long, int, const float*, const float*, float*);
static rows_fn rows = nullptr;

extern "C" void tinychar_window_set(void* f) { rows = (rows_fn)f; }

Tensor window_hidden(Tensor window, Tensor n, Tensor first, Tensor weights, int64_t vocab, int64_t width,
                     int64_t heads, int64_t layers, bool bias) {
    Tensor ids = torch::stable::contiguous(window), f = torch::stable::contiguous(first);
    Tensor w = torch::stable::contiguous(weights), count = torch::stable::contiguous(n);
    long B = ids.size(0), T = ids.size(1), C = width;
    long sizes = vocab * C + T * C + layers * (12 * C * C + 2 * C + (bias ? 11 * C : 0)) + (bias ? 2 * C : C);
    STD_TORCH_CHECK(w.numel() == sizes && (f.numel() == 0 || f.numel() == vocab * T * 3 * C),
                    "tinychar: weights or a table of another shape than the window kernel's");
    Tensor out = torch::stable::new_empty(w, {B, width});
    STD_TORCH_CHECK(rows != nullptr, "tinychar: the window kernel is not loaded");
    int status = rows((const long*)ids.data_ptr(), B, *(const long*)count.data_ptr(), vocab, T, width, heads, layers,
                      bias, f.numel() ? (const float*)f.data_ptr() : nullptr, (const float*)w.data_ptr(),
                      (float*)out.data_ptr());
    STD_TORCH_CHECK(status != -2, "tinychar: a window's count or characters out of range");
    STD_TORCH_CHECK(status == 0, "tinychar: the window kernel ran out of memory");
    return out;
}

STABLE_TORCH_LIBRARY_IMPL(tinychar, CPU, m) {
    m.impl("window_hidden", TORCH_BOX(&window_hidden));
}
"""

_KERNEL = PairedKernel("window", SOURCE, OPERATORS,
                       {"window_hidden_rows": [ctypes.c_void_p] + [ctypes.c_long] * 7 + [ctypes.c_int]
                        + [ctypes.c_void_p] * 3})

# The kernel (an OSError or subprocess.SubprocessError where it cannot be built), and its operator's C++ kernel (None
# where it cannot be: the Python one below runs then).
library, _operators = _KERNEL.library, _KERNEL.operators


def window_hidden_in_python(window: torch.Tensor, n: torch.Tensor, first: torch.Tensor, weights: torch.Tensor,
                            vocab: int, width: int, heads: int, layers: int, bias: bool) -> torch.Tensor:
    """The operator's kernel where its C++ one (OPERATORS) is not loaded: the final state (B, width) of position n - 1
    of each of window's rows (B, T), from the weights as pack_weights lays them out and first (empty: none)."""
    window, first, weights = window.contiguous(), first.contiguous(), weights.contiguous()
    B, T = window.shape
    if weights.numel() != packed_size(vocab, T, width, layers, bias) or first.numel() not in (0, vocab * T * 3 * width):
        raise ValueError("tinychar: weights or a table of another shape than the window kernel's")
    out = weights.new_empty(B, width)
    status = library().window_hidden_rows(window.data_ptr(), B, int(n[0]), vocab, T, width, heads, layers, int(bias),
                                          first.data_ptr() if first.numel() else None, weights.data_ptr(),
                                          out.data_ptr())
    if status == -2:
        raise ValueError("tinychar: a window's count or characters out of range")
    if status != 0:
        raise MemoryError("tinychar: the window kernel ran out of memory")
    return out


window_hidden = define("window_hidden", "(Tensor window, Tensor n, Tensor first, Tensor weights, int vocab, "
                       "int width, int heads, int layers, bool bias) -> Tensor", window_hidden_in_python,
                       lambda window, n, first, weights, vocab, width, heads, layers, bias:
                       weights.new_empty(window.size(0), width))


def shape_applies(cfg: GPTConfig) -> bool:
    """Whether the kernel takes a model of this shape: a GPT, pre-norm with dot-product scores, its width a multiple
    of 16 and head size a multiple of 8 (at most MAX_HEAD_SIZE), its matrices no larger than the linear kernel
    takes, on a CPU where that kernel's products are wanted (model.linear.own_gemm_wanted: TINYCHAR_GEMM=0 keeps
    PyTorch's here too)."""
    head_size = cfg.n_embd // cfg.n_head
    return (cfg.type == "gpt" and cfg.norm == "pre" and cfg.score == "dot" and cfg.n_embd % 16 == 0
            and cfg.n_embd % cfg.n_head == 0 and head_size % 8 == 0 and head_size <= MAX_HEAD_SIZE
            and 4 * cfg.n_embd * cfg.n_embd <= MAX_WEIGHTS and own_gemm_wanted())


def applies(model: torch.nn.Module) -> bool:
    """Whether the kernel computes model's window state here: a GPT of a shape it takes (shape_applies), in eval mode,
    its weights float32 on the CPU."""
    if not isinstance(model, GPT) or model.training or not shape_applies(model.config):
        return False
    weight = model.transformer.wte.weight
    return weight.dtype == torch.float32 and weight.device.type == "cpu"


def packed_size(vocab: int, block_size: int, width: int, layers: int, bias: bool) -> int:
    """How many floats pack_weights lays out for a model of these sizes."""
    C = width
    return vocab * C + block_size * C + layers * (12 * C * C + 2 * C + (11 * C if bias else 0)) + (2 * C if bias else C)


@torch.no_grad()
def pack_weights(model: GPT) -> torch.Tensor:
    """model's weights in one float32 buffer, as window_hidden reads them: the token and position embeddings, then each
    block's ln_1 (weight, bias), its attention projections packed into panels (linear_kernel.pack) and their bias, its
    output projection and bias, ln_2, the MLP's two matrices packed and their biases, then ln_f; the biases only where
    the model has them."""
    t = model.transformer
    parts = [t.wte.weight, t.wpe.weight]
    for block in t.h:
        for norm_or_linear in (block.ln_1, block.attn.c_attn, block.attn.c_proj, block.ln_2, block.mlp.c_fc,
                               block.mlp.c_proj):
            weight = norm_or_linear.weight
            parts.append(pack(weight) if weight.dim() == 2 else weight)
            if norm_or_linear.bias is not None:
                parts.append(norm_or_linear.bias)
    parts.append(t.ln_f.weight)
    if t.ln_f.bias is not None:
        parts.append(t.ln_f.bias)
    return torch.cat([p.detach().reshape(-1).float() for p in parts])


def source_digest() -> str:
    """A digest of the kernel's code, for keys of compiled steps that call it."""
    return hashlib.sha256((SOURCE + OPERATORS).encode()).hexdigest()[:16]


def window_pass(model: GPT, batch: int = 1, folder: Path | None = None, compiled: bool = True) -> WindowPass | None:
    """The kernel as model.sampler's window pass for batch windows at a time, with model's weights packed for it
    (pack_weights) and the kernel built (into folder, by default the compile cache) and loaded; for compiled code
    (compiled) through the operator tinychar::window_hidden, whose C++ kernel is built too, for the eager sampler
    through window_hidden_in_python, which calls the kernel itself (a second of g++ the less, and no dispatcher).
    None for a batch over MAX_BATCH (EAGER_MAX_BATCH eagerly), where it does not apply (applies), cannot be built,
    or the packed copy would take more than half of what the process may still allocate. A snapshot of the weights
    of the moment: make another after changing them."""
    if batch > (MAX_BATCH if compiled else EAGER_MAX_BATCH) or not applies(model):
        return None
    free = allocatable_bytes(torch.device("cpu"))
    if free is not None and 2 * 4 * sum(p.numel() for p in model.parameters()) > free:
        return None
    try:
        library(folder, with_operators=compiled)
    except (OSError, subprocess.SubprocessError):
        return None
    if compiled and _operators(folder) is None:
        return None
    return WindowPass(window_hidden if compiled else window_hidden_in_python, pack_weights(model), source_digest())
