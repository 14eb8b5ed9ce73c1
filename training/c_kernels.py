"""C kernels of tinychar's own for the training step on a CPU, compiled or eager (training/attention_kernel.py,
training/gelu_kernel.py, training/linear_kernel.py; training/eager_kernels.py): built by the C compiler torch.compile
uses, with OpenMP (PyTorch's own threads: the loader finds its libgomp already in the process), once per kernel and
shape, kept in the compile cache beside inductor's code. Each is called by an operator of ours (define), whose kernel
for CPU tensors is C++ of ours where torch has its stable C++ interface (2.10 and later; see operators), which the
compiled step's C++ wrapper calls with no Python between, and otherwise Python, through ctypes (each call then a round
trip through Python, about 50 us). They are written with GCC's vector extension (eight floats, what AVX2 holds), which
GCC and Clang compile for any CPU; on x86 with AVX2 and FMA. A machine that cannot build one (no compiler, no OpenMP)
runs PyTorch's code instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from .compile_cache import cache_folder  # read TORCHINDUCTOR_CACHE_DIR before importing dynamo sets its default

# What every kernel starts from: eight floats as one value, loads, stores, broadcasts, a select, exp and a
# transpose of 8 x 8 floats.
PRELUDE = r"""
#include <string.h>
typedef float v8 __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));
#define LD(p) ({ v8 v_; __builtin_memcpy(&v_, (p), 32); v_; })
#define ST(p, v) do { v8 w_ = (v); __builtin_memcpy((p), &w_, 32); } while (0)
static inline v8 BC(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline v8 sel(v8i m, v8 a, v8 b) { /* a where m, else b */
#ifdef __AVX__  /* one instruction, where the bitwise form below is three (the GELU kernel 4% faster) */
    v8 mf; __builtin_memcpy(&mf, &m, 32); return __builtin_ia32_blendvps256(b, a, mf);
#else
    v8i ai, bi, r; v8 o; __builtin_memcpy(&ai, &a, 32); __builtin_memcpy(&bi, &b, 32);
    r = (ai & m) | (bi & ~m); __builtin_memcpy(&o, &r, 32); return o;
#endif
}
static inline v8 vexp_within(v8 x) { /* e^x for x in [-87, 0], as 2^n e^r, |r| <= ln2/2: Cephes' polynomial */
    v8 n = (x * BC(1.44269504f) + BC(12582912.0f)) - BC(12582912.0f);
    v8 r = x - n * BC(0.693359375f) + n * BC(2.12194440e-4f);
    v8 p = BC(1.9875691500e-4f);
    p = p * r + BC(1.3981999507e-3f); p = p * r + BC(8.3334519073e-3f); p = p * r + BC(4.1665795894e-2f);
    p = p * r + BC(1.6666665459e-1f); p = p * r + BC(5.0000001201e-1f);
    p = p * r * r + r + BC(1.0f);
    v8i e = (__builtin_convertvector(n, v8i) + 127) << 23; v8 s; __builtin_memcpy(&s, &e, 32);
    return p * s;
}
static inline v8 vexp(v8 x) { return vexp_within(sel(x < BC(-87.0f), BC(-87.0f), x)); } /* x <= 0; e^-87 below */
/* Lanes of two vectors picked by index (0-7 a's, 8-15 b's). */
#if defined(__clang__) || __GNUC__ >= 12
#define MIX(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define MIX(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif
/* dst[c * ldd + r] = src[r * lds + c] f, rows r and columns c in [0, 8): an 8 x 8 block turned in registers */
static inline void transpose8(const float* src, long lds, float* dst, long ldd, v8 f) {
    v8 r0 = LD(src) * f, r1 = LD(src + lds) * f, r2 = LD(src + 2 * lds) * f, r3 = LD(src + 3 * lds) * f;
    v8 r4 = LD(src + 4 * lds) * f, r5 = LD(src + 5 * lds) * f, r6 = LD(src + 6 * lds) * f, r7 = LD(src + 7 * lds) * f;
    v8 t0 = MIX(r0, r1, 0, 8, 1, 9, 4, 12, 5, 13), t1 = MIX(r0, r1, 2, 10, 3, 11, 6, 14, 7, 15);
    v8 t2 = MIX(r2, r3, 0, 8, 1, 9, 4, 12, 5, 13), t3 = MIX(r2, r3, 2, 10, 3, 11, 6, 14, 7, 15);
    v8 t4 = MIX(r4, r5, 0, 8, 1, 9, 4, 12, 5, 13), t5 = MIX(r4, r5, 2, 10, 3, 11, 6, 14, 7, 15);
    v8 t6 = MIX(r6, r7, 0, 8, 1, 9, 4, 12, 5, 13), t7 = MIX(r6, r7, 2, 10, 3, 11, 6, 14, 7, 15);
    v8 u0 = MIX(t0, t2, 0, 1, 8, 9, 4, 5, 12, 13), u1 = MIX(t0, t2, 2, 3, 10, 11, 6, 7, 14, 15);
    v8 u2 = MIX(t1, t3, 0, 1, 8, 9, 4, 5, 12, 13), u3 = MIX(t1, t3, 2, 3, 10, 11, 6, 7, 14, 15);
    v8 u4 = MIX(t4, t6, 0, 1, 8, 9, 4, 5, 12, 13), u5 = MIX(t4, t6, 2, 3, 10, 11, 6, 7, 14, 15);
    v8 u6 = MIX(t5, t7, 0, 1, 8, 9, 4, 5, 12, 13), u7 = MIX(t5, t7, 2, 3, 10, 11, 6, 7, 14, 15);
    ST(dst, MIX(u0, u4, 0, 1, 2, 3, 8, 9, 10, 11)); ST(dst + 4 * ldd, MIX(u0, u4, 4, 5, 6, 7, 12, 13, 14, 15));
    ST(dst + ldd, MIX(u1, u5, 0, 1, 2, 3, 8, 9, 10, 11)); ST(dst + 5 * ldd, MIX(u1, u5, 4, 5, 6, 7, 12, 13, 14, 15));
    ST(dst + 2 * ldd, MIX(u2, u6, 0, 1, 2, 3, 8, 9, 10, 11));
    ST(dst + 6 * ldd, MIX(u2, u6, 4, 5, 6, 7, 12, 13, 14, 15));
    ST(dst + 3 * ldd, MIX(u3, u7, 0, 1, 2, 3, 8, 9, 10, 11));
    ST(dst + 7 * ldd, MIX(u3, u7, 4, 5, 6, 7, 12, 13, 14, 15));
}
"""


def compiler() -> str | None:
    """The C compiler: torch.compile's (CXX, else g++, c++ or clang++), which also compiles C."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and (path := shutil.which(name)):
            return path
    return None


def flags() -> list[str]:
    """The compiler's flags: AVX2 and FMA where PyTorch runs its own AVX2 (or AVX-512) kernels, else the compiler's
    defaults for the machine (the vector extension lowered to what the target has)."""
    capability = torch.backends.cpu.get_cpu_capability()
    isa = ["-mavx2", "-mfma"] if platform.machine() in ("x86_64", "AMD64") and capability in ("AVX2", "AVX512") else []
    return ["-x", "c", "-std=gnu11", "-O3", "-fPIC", "-shared", "-fopenmp", *isa]


_BUILT: dict[str, ctypes.CDLL] = {}


def _compiled(name: str, command: list[str], source: str, folder: Path | None, link: tuple[str, ...] = ()) -> Path:
    """The library that command (the compiler and its flags) makes of source, linked with link: in folder (by
    default the compile cache) already, or compiled into it now, whole or not at all."""
    digest = hashlib.sha256("\\0".join([source, *command, *link]).encode()).hexdigest()[:24]
    folder = folder or cache_folder()
    path = folder / f"tinychar-{name}-{digest}.so"
    if not path.is_file():
        fd, scratch = tempfile.mkstemp(prefix=f".tinychar-{name}-", suffix=".so.tmp", dir=folder)
        os.close(fd)
        try:
            subprocess.run([*command, "-", "-o", scratch, *link], input=source, text=True, check=True,
                           capture_output=True, timeout=120)
            os.replace(scratch, path)  # whole or not at all: another process may be loading it
        finally:
            if os.path.exists(scratch):
                os.remove(scratch)
    return path


def build(name: str, source: str, macros: list[str], folder: Path | None = None) -> ctypes.CDLL:
    """The library of source compiled with macros: loaded already, from folder (by default the compile cache), or
    compiled into it now (about a second). OSError or subprocess.SubprocessError where it cannot be."""
    cc = compiler()
    if cc is None:
        raise OSError("no C compiler")
    command = [cc, *flags(), *macros]
    key = "\\0".join([source, *command])
    if key not in _BUILT:
        _BUILT[key] = ctypes.CDLL(str(_compiled(name, command, source, folder)))
    return _BUILT[key]


# What the operators' C++ starts from: PyTorch's stable C++ interface (2.10 and later), whose calls cross into
# libtorch through its C functions only, so one library serves any build of torch of that version and the compile
# reads none of libtorch's own C++ headers (about 2 s).
OPERATORS_PRELUDE = r"""
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <cmath>
#include <mutex>
#include <tuple>
#include <vector>
using torch::stable::Tensor;
"""

_OPERATORS: dict[str, ctypes.CDLL | None] = {}


def operators(name: str, source: str, folder: Path | None = None) -> ctypes.CDLL | None:
    """Operators' kernels in C++ (source, OPERATORS_PRELUDE first), registered with PyTorch's dispatcher for CPU
    tensors when loaded, in place of the operators' Python kernels (define's, registered for any
    device), so that the compiled step's C++ wrapper calls them without a round trip through Python: about 35 us a call
    less, measured, and 2.7% of the step of nanoGPT's CPU config (docs/engine-record.md). Built into folder
    (by default the compile cache) once, loaded once a process; None where they cannot be (a torch before 2.10, its
    headers missing, no compiler): the Python kernels run then, as they do for every call before this one."""
    if name in _OPERATORS:  # loaded, or failed: a second copy's registrations would clash with the first's
        return _OPERATORS[name]
    library = None
    cc = compiler()
    if cc is not None and torch.torch_version.TorchVersion(torch.__version__) >= "2.10":
        root = Path(torch.__file__).resolve().parent
        command = [cc, "-x", "c++", "-std=c++17", "-O2", "-fPIC", "-shared", f"-I{root / 'include'}"]
        link = (f"-L{root / 'lib'}", "-ltorch_cpu", f"-Wl,-rpath,{root / 'lib'}")
        try:
            code = f"// for torch {torch.__version__}\n{OPERATORS_PRELUDE}{source}"
            library = ctypes.CDLL(str(_compiled(name, command, code, folder, link)))
        except (OSError, subprocess.SubprocessError):
            library = None
    _OPERATORS[name] = library
    return library


class PairedKernel:
    """A kernel's library of C functions (linear_kernel's a forward and a backward, gelu_kernel's a forward that keeps
    the derivative), built once a process (build), and the C++ kernels of the operators that call them (operators),
    given the functions' addresses (through their library's tinychar_<name>_set) once both are loaded."""

    def __init__(self, name: str, source: str, operators_source: str, argtypes: dict[str, list]) -> None:
        self.name, self.source, self.operators_source, self.argtypes = name, source, operators_source, argtypes
        self.loaded: list[ctypes.CDLL] = []

    def library(self, folder: Path | None = None, with_operators: bool = True) -> ctypes.CDLL:
        """The kernel (build: an OSError or subprocess.SubprocessError where it cannot be built), given to the
        operators' C++ kernels where they load (with_operators; the eager step calls the kernel through Python
        as fast, and leaves them unbuilt: training/eager_kernels.py)."""
        if not self.loaded:
            lib = build(self.name, self.source, [], folder)
            for function, types in self.argtypes.items():
                getattr(lib, function).argtypes = types
            self.loaded.append(lib)
            if with_operators:
                self.operators(folder)
        return self.loaded[0]

    def operators(self, folder: Path | None = None) -> ctypes.CDLL | None:
        """The operators' C++ kernels, loaded (operators) and given the kernel once it is built, or None: their
        Python kernels run then."""
        ops = operators(f"{self.name}-operators", self.operators_source, folder)
        if ops is not None and self.loaded:
            addresses = [ctypes.cast(getattr(self.loaded[0], f), ctypes.c_void_p) for f in self.argtypes]
            getattr(ops, f"tinychar_{self.name}_set")(*addresses)
        return ops


# The namespace of the kernels' operators, defined here rather than by torch.library.custom_op: custom_op gives each
# operator an autograd kernel in Python, which the dispatcher runs on every call, the compiled step's C++ wrapper's
# included (it calls the dispatcher, which enters Python for that kernel and leaves it again for the C++ one). These
# operators take no gradient themselves (each kernel's are one torch.autograd.Function: attention_kernel, gelu_kernel,
# linear_kernel), so they are left to PyTorch's autograd fallback, in C++. See define.
_NAMESPACE = torch.library.Library("tinychar", "FRAGMENT")


def define(name: str, schema: str, kernel: Callable, fake: Callable) -> torch._ops.OpOverload:
    """The operator tinychar::name, its arguments and results as schema says ("(Tensor x) -> Tensor"): kernel, in
    Python, for tensors of any device (the C++ kernels of operators take its place for CPU tensors once loaded), and
    fake for torch.compile's shapes. Measured on a 2-core Zen 2 EPYC (torch 2.13, the C++ kernels loaded): the GELU
    operator on eight values, called from Python, 13.5 us a call as custom_op made it, 5.6 us defined so; the compiled
    step of nanoGPT's CPU config (48 calls) 32.2-32.4 -> 31.4-31.5 ms, tiny.yaml's in halves (24 calls a half, on two
    threads, each call taking Python's lock as custom_op made it) 13.1-13.5 -> 12.2-12.4 ms, the same bits (one
    process each, five rounds; docs/engine-record.md)."""
    _NAMESPACE.define(name + schema)
    _NAMESPACE.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"tinychar::{name}", fake, lib=_NAMESPACE)
    return getattr(torch.ops.tinychar, name).default


def side_by_side(calls: list[Callable[[], bool]]) -> list[bool]:
    """Each of calls (the kernels' attach functions, which build what they lack) at once, a thread each, and what
    each returned: g++ runs outside Python's lock, so their builds overlap. From an empty cache, the compiled step's
    three (tiny.yaml's model: three C kernels and three operator libraries) took 6.6 s one after another and 3.5 s
    side by side on a 2-core Zen 2 EPYC, two runs each; the eager step's three C kernels 1.0 s."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def worth_it(work: int, least: tuple[int, int], loaded: Callable[[], object]) -> bool:
    """Whether a kernel's calls win back what they cost on work: least is the least work that does where its operators
    are in C++ (loaded, which builds them if need be: not None) and where they are not, each call a round trip through
    Python."""
    return work >= least[1] or work >= least[0] and loaded() is not None


def give(layers: list[nn.Module], make: Callable[[], object], kernel: Callable, source: str, name: str = "kernel",
         eager: bool = False) -> bool:
    """Build a kernel (make), then give it to each of layers as its attribute name, with a digest of its source as
    name_source (a setting of the layer, so that a compiled step is keyed apart from one compiled without it) and, for
    the eager training step too (training/eager_kernels.py), eager as name_eager; False, and nothing given, where
    there are no layers or it cannot be built."""
    if not layers:
        return False
    try:
        make()
    except (OSError, subprocess.SubprocessError):
        return False
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    for layer in layers:
        setattr(layer, name, kernel)
        setattr(layer, f"{name}_source", digest)
        if eager:
            setattr(layer, f"{name}_eager", True)
    return True
