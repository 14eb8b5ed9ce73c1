"""The model's linear layers, and which library multiplies their matrices on a CPU.

PyTorch runs a float32 ``F.linear`` on a CPU through MKL, whose single-precision GEMM on AMD processors takes its
AVX2 code even where the CPU has AVX-512: measured on a 2-core AMD EPYC (Zen 5, family 26, torch 2.13), MKL reached
about 200 GFLOP/s on the shapes of nanoGPT's CPU config (768 x 128 x 512) and oneDNN, which ships inside PyTorch
as well, about 440, with the same float32 arithmetic (only the order of the additions differs). So on such CPUs a
``Linear`` large enough for oneDNN's fixed cost (about 10 us a call) to pay multiplies through it, forward and
backward; elsewhere, and for small products, it is ``nn.Linear`` exactly.

Not on every AVX-512 CPU: AMD's Zen 4 (family 25) runs AVX-512 through 256-bit units, and there the two libraries
measured level (2-core EPYC, family 25 model 17, 2 threads: 768 x 128 x 512 in 521 us through MKL, 515 through
oneDNN; 64 x 128 x 384 58 against 71 us), so the autograd function's overhead made tiny.yaml's eager step about 10%
slower through oneDNN and the block-64 step no faster. Intel's CPUs get MKL's own AVX-512 code.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# Products of at least this many multiply-adds (rows x in x out) go to oneDNN, per PyTorch's CPU capability. Measured
# on the Zen 5 EPYC above, 2 threads, float32, MKL against oneDNN: with AVX-512, 64 x 128 x 384 (3.1M) 38 -> 28 us,
# 1024 x 64 x 256 (16.8M) 170 -> 86 us, but 256 x 32 x 128 (1.0M) 14 -> 17 us. Kept to AVX2 (ATEN_CPU_CAPABILITY,
# MKL_ENABLE_INSTRUCTIONS and ONEDNN_MAX_CPU_ISA at AVX2), oneDNN alone gained 8-13% on 1024-row products, but whole
# steps lost: nanoGPT's CPU config 36 -> 41 ms/step eager (the transposed products of the backward pass, the autograd
# function), and bench.py's block-64 and tiny.yaml rows fell by 15-20%; so AVX2 keeps MKL. So too on AVX2 hardware (a
# Zen 2, 2026-12-06: warm products alone 1.1-1.3x faster, nanoGPT's CPU config's compiled step 40.4 -> 42.5 ms; see
# docs/engine-record.md). Other capabilities (ARM, no vector unit) keep their BLAS: not measured.
ONEDNN_MIN_MACS = {"AVX512": 2**21}
ONEDNN_SETTINGS = ("auto", "0", "1")
# AMD's first family whose AVX-512 multiplies 512 bits at once (Zen 5); Zen 4 (25) splits them into two halves.
AMD_FULL_WIDTH_AVX512_FAMILY = 26


@functools.cache
def read_cpuinfo() -> str:
    """The text of /proc/cpuinfo, read once per process ("" where there is none: macOS, Windows)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The feature flags of the first processor in cpuinfo (/proc/cpuinfo's text; read here when None), empty where
    there are none to read."""
    for line in (read_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == "flags":
            return set(value.split())
    return set()


def first_processor(cpuinfo: str | None = None) -> dict[str, str]:
    """The fields of the first processor in cpuinfo (/proc/cpuinfo's text; read here when None)."""
    fields: dict[str, str] = {}
    for line in (read_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        name, sep, value = line.partition(":")
        if not sep:
            if fields:
                break  # the first processor's block is enough
            continue
        fields.setdefault(name.strip(), value.strip())
    return fields


def amd_family(cpuinfo: str | None = None) -> int | None:
    """The CPU family of the first processor in cpuinfo (/proc/cpuinfo's text; read here when None) where it is
    AMD's, else None (another vendor's, or none to read)."""
    fields = first_processor(cpuinfo)
    if fields.get("vendor_id") != "AuthenticAMD":
        return None
    try:
        return int(fields.get("cpu family", ""))
    except ValueError:
        return None


def onednn_outruns_blas(cpuinfo: str | None = None) -> bool:
    """Whether oneDNN multiplies float32 faster than PyTorch's BLAS here: on AMD processors of full-width AVX-512
    (family AMD_FULL_WIDTH_AVX512_FAMILY on), where MKL takes its AVX2 code. cpuinfo is /proc/cpuinfo's text."""
    family = amd_family(cpuinfo)
    return family is not None and family >= AMD_FULL_WIDTH_AVX512_FAMILY


GEMM_SETTINGS = ("auto", "0", "1")


def gemm_setting() -> str:
    """TINYCHAR_GEMM: whether the training step (compiled, or eager: training/eager_kernels.py) multiplies its linear
    layers with tinychar's own kernel (training/linear_kernel.py): 0 never, 1 wherever it applies, auto (or unset) where
    it was measured faster (own_gemm_outruns_blas). ValueError for another value."""
    setting = os.environ.get("TINYCHAR_GEMM", "auto").strip().lower() or "auto"
    if setting not in GEMM_SETTINGS:
        raise ValueError(f"TINYCHAR_GEMM must be one of {', '.join(GEMM_SETTINGS)}, got {setting!r}")
    return setting


def own_gemm_outruns_blas(cpuinfo: str | None = None) -> bool:
    """Whether training/linear_kernel.py's products outrun PyTorch's here: on AMD processors whose products go through
    MKL's AVX2 code for AMD, as measured on a Zen 2 (PyTorch running its AVX2 code) and on a Zen 4 (AVX-512 through
    256-bit units, which the kernel's AVX2 code keeps as busy: 768 x 128 x 512 at 205 GFLOP/s against MKL's 176). Not
    on AMD's full-width AVX-512 (oneDNN runs there at twice MKL's rate: onednn_outruns_blas), unless PyTorch is kept
    to AVX2; on Intel's CPUs MKL has code of its own for each, not measured against. cpuinfo is /proc/cpuinfo's
    text."""
    family, capability = amd_family(cpuinfo), torch.backends.cpu.get_cpu_capability()
    return family is not None and (capability == "AVX2"
                                   or capability == "AVX512" and family < AMD_FULL_WIDTH_AVX512_FAMILY)


def own_gemm_wanted() -> bool:
    """Whether TINYCHAR_GEMM asks for training/linear_kernel.py's products here: 1, or auto where they outrun the
    BLAS (own_gemm_outruns_blas). Which layers take them is the kernel's rule (linear_kernel.layers_taking)."""
    setting = gemm_setting()
    return setting == "1" or setting == "auto" and own_gemm_outruns_blas()


def onednn_min_macs() -> int | None:
    """The smallest float32 CPU product (multiply-adds) that a Linear sends to oneDNN here, or None for none.

    TINYCHAR_ONEDNN=0 keeps every product on PyTorch's default BLAS, 1 sends every one to oneDNN, auto (or unset)
    applies ONEDNN_MIN_MACS where oneDNN outruns the BLAS (onednn_outruns_blas)."""
    setting = os.environ.get("TINYCHAR_ONEDNN", "auto").strip().lower() or "auto"
    if setting not in ONEDNN_SETTINGS:
        raise ValueError(f"TINYCHAR_ONEDNN must be one of {', '.join(ONEDNN_SETTINGS)}, got {setting!r}")
    if setting == "0" or not torch.backends.mkldnn.is_available():
        return None
    if setting == "1":
        return 0
    if not onednn_outruns_blas():
        return None
    return ONEDNN_MIN_MACS.get(torch.backends.cpu.get_cpu_capability())


@torch.library.custom_op("tinychar::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, in) @ weight (out, in)^T + bias through oneDNN: (M, out). Either operand may be a transposed view.

    A custom operator, so that torch.compile calls it as it is (inductor lowers oneDNN's own linear only for weights
    frozen into constants, never for a weight that trains)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.size(0), weight.size(0))


# oneDNN's linear as a C function of PyTorch's library, which inductor's own lowering of it calls, and its header.
LINEAR_SHIM = "aoti_torch_cpu__linear_pointwise"
LINEAR_SHIM_HEADER = "torch/csrc/inductor/aoti_torch/c/shim_cpu.h"


def lower_onednn_linear() -> None:
    """Have inductor's generated code call oneDNN's linear for onednn_linear itself, not through the operator's Python
    (with inductor's C++ wrapper, a call back into Python for each product). Inductor's own lowering of oneDNN's
    linear takes only weights frozen into constants, so this makes the call one of its fallback kernels. Measured on a
    2-core Zen 5 EPYC (torch 2.13, 2 threads, 2026-12-04), the compiled sampling step of nanoGPT's CPU config, eight
    such products a character, each compiled into a cache of its own: 448-545 us a character against 524-781, four
    interleaved pairs, every pair faster, the same characters. Imports inductor: called before compiling
    (training.compile_cache.prepare_compile). Inductor's cache does not key on lowerings, so code it compiled before
    keeps the Python call (as fast as it was).

    The C++ wrapper calls oneDNN's linear as PyTorch's C function (LINEAR_SHIM), where this torch has one, rather than
    through PyTorch's dispatcher, whose headers took most of g++'s time for the wrapper. Measured on a 2-core Zen 2
    EPYC (torch 2.13, 2026-12-06), tests/test_training_engine.py's one-layer step (Muon, two micro-batches) with every
    product through oneDNN, from an empty cache: the wrapper's g++ 9.7 -> 2.2 s, the whole compile 35.8 -> 28.0 s.
    Inductor makes that call for an operator its settings name (aot_inductor.custom_ops_to_c_shims), but an operator
    in its settings keeps every compile out of its cache (it cannot key on one): so the setting is made only while
    the call is written, after the cache has taken its key."""
    from torch._inductor import config, ir, lowering
    from torch._inductor.virtualized import V

    op = torch.ops.tinychar.onednn_linear.default
    if op in lowering.lowerings:
        return
    linear = torch.ops.mkldnn._linear_pointwise.default
    fallback = lowering.fallback_handler(linear, add_to_fallback_set=False)

    class ThroughShim(ir.FallbackKernel):
        def codegen(self, wrapper: object) -> None:
            if not V.graph.cpp_wrapper:
                super().codegen(wrapper)
                return
            wrapper.include_extra_header(LINEAR_SHIM_HEADER)
            with config.patch({"aot_inductor.custom_ops_to_c_shims": {linear: []}}):
                super().codegen(wrapper)

    shim = has_linear_shim() and hasattr(ir.IRNode, "wrap_for_lowering")  # how torch 2.13 wraps a fallback

    @lowering.register_lowering(op, type_promotion_kind=None)
    def _(x: object, weight: object, bias: object) -> object:
        if not shim:
            return fallback(x, weight, bias, "none", [], "")
        return ThroughShim.create(linear, x, weight, bias, "none", [], "").wrap_for_lowering()


def has_linear_shim() -> bool:
    """Whether this torch has LINEAR_SHIM: declared in its headers and exported by its CPU library."""
    import ctypes

    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    if not os.path.isfile(os.path.join(os.path.dirname(lib), "include", LINEAR_SHIM_HEADER)):
        return False
    names = {"linux": "libtorch_cpu.so", "darwin": "libtorch_cpu.dylib", "win32": "torch_cpu.dll"}
    try:
        return hasattr(ctypes.CDLL(os.path.join(lib, names.get(sys.platform, "libtorch_cpu.so"))), LINEAR_SHIM)
    except OSError:
        return False


def _linear_pointwise(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear: through the custom operator while torch.compile traces, called directly otherwise (the
    operator's Python wrapper costs about 7 us a call, measured on 64 x 128 -> 512: 33 us direct, 40 wrapped)."""
    if torch.compiler.is_compiling():
        return onednn_linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _gradients(x: torch.Tensor, weight: torch.Tensor, has_bias: bool, dy: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dx = dy W, dW = dy^T x, db = the sum of dy's rows, each through oneDNN."""
    dx = _linear_pointwise(dy, weight.t(), None)  # (M, out) @ (out, in)
    # oneDNN copies a transposed first operand into rows, so the narrower of x and dy goes first (measured, 768 x
    # 128 -> 512, nanoGPT's CPU config's c_fc: 382 us with dy first, 286 us with x first; 562 us through MKL).
    if weight.size(0) > weight.size(1):
        dw = _linear_pointwise(x.t(), dy.t(), None).t()  # ((in, M) @ (M, out))^T
    else:
        dw = _linear_pointwise(dy.t(), x.t(), None)  # (out, M) @ (M, in)
    return dx, dw, dy.sum(0) if has_bias else None


class _OneDNNLinearFunction(torch.autograd.Function):
    """onednn_linear with its gradients through oneDNN too (see _gradients), in the form torch.compile and
    torch.func's transforms need (a separate setup_context)."""

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _linear_pointwise(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        x, weight, bias = inputs
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return _gradients(*ctx.saved_tensors, ctx.has_bias, dy)


class _EagerOneDNNLinearFunction(torch.autograd.Function):
    """The same function in autograd's older form, for plain eager training: the form with setup_context binds
    its arguments to forward's signature on every call, about 22 us (measured on 64 x 128 -> 512: 59 us a call
    against 37 us in this form). It cannot run under torch.func's transforms, which Linear checks for."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _linear_pointwise(x, weight, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return _gradients(*ctx.saved_tensors, ctx.has_bias, dy)


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters, state-dict names and initialisation) whose float32 CPU products of at
    least ``onednn_min_macs()`` multiply-adds run through oneDNN; see the module's docstring."""

    # The compiled training step's own product, x (M, in) and the weight -> x @ weight^T (training/linear_kernel.py),
    # and a digest of its code, where it applies (a CPU, float32); None where the products above run. kernel_eager: the
    # eager training step runs it too (training/eager_kernels.py), not only traced code.
    kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    kernel_source = ""
    kernel_eager = False
    # Compiled code's product without gradients (the compiled sampler's) from the weight packed ahead, x (M, in) and
    # packed -> x @ weight^T (training/linear_kernel.py's linear_packed, which packs the weight into the buffer
    # ``packed`` when it attaches), and a digest of its code; None where the products above run.
    packed_kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    packed_kernel_source = ""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        min_macs = onednn_min_macs()
        # The fewest rows a product needs to go to oneDNN (None: never): fixed when the layer is built, so that
        # torch.compile sees a constant.
        self.onednn_min_rows = None if min_macs is None else -(-min_macs // (in_features * out_features))
        self.register_buffer("packed", None, persistent=False)  # not in checkpoints: made from the weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes_kernel(x):
            return self._through(self.kernel, x, self.weight, self.bias)
        if self.takes_packed(x):
            return self._through(self.packed_kernel, x, self.packed, self.bias)
        return self._product(x, self.weight, self.bias, self.onednn_min_rows)

    @staticmethod
    def _through(kernel: Callable, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """kernel's product of x's rows (..., in) and weight (as that kernel takes it), plus bias: (..., out)."""
        y = kernel(x.reshape(-1, x.size(-1)), weight)
        y = y if bias is None else y + bias
        return y.view(*x.shape[:-1], y.size(-1))

    def takes_packed(self, x: torch.Tensor) -> bool:
        """Whether this pass runs the product from the packed weight (see packed_kernel): only in traced code without
        gradients, in float32 on the CPU."""
        return (self.packed_kernel is not None and torch.compiler.is_compiling() and not torch.is_grad_enabled()
                and x.dtype == torch.float32 and self.packed.dtype == torch.float32 and x.device.type == "cpu"
                and self.packed.device.type == "cpu")

    def takes_kernel(self, x: torch.Tensor) -> bool:
        """Whether this pass runs the training step's product (see kernel): only where the step is traced (or eager,
        with kernel_eager), computing gradients, in float32 on the CPU."""
        return (self.kernel is not None and (self.kernel_eager or torch.compiler.is_compiling())
                and torch.is_grad_enabled()
                and x.dtype == torch.float32 and self.weight.dtype == torch.float32 and x.device.type == "cpu")

    def part(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Output features start..stop-1 of forward(x) alone (..., stop - start), from those rows of the weight: for
        a caller that needs only some of them at some positions (sampling's last layer: keys and values everywhere,
        the query at one position)."""
        bias = None if self.bias is None else self.bias[start:stop]
        if start % 16 == 0 and stop % 16 == 0 and self.takes_packed(x):  # whole panels of the packed weight
            return self._through(self.packed_kernel, x, self.packed[start // 16 : stop // 16], bias)
        min_rows = self.onednn_min_rows
        if min_rows is not None:  # the same multiply-adds as the whole layer's threshold
            min_rows = -(-min_rows * self.out_features // (stop - start))
        return self._product(x, self.weight[start:stop], bias, min_rows)

    @staticmethod
    def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int | None
                 ) -> torch.Tensor:
        in_features, out_features = weight.size(1), weight.size(0)
        rows = x.numel() // in_features
        if (min_rows is None or rows < min_rows or x.device.type != "cpu"
                or x.dtype != torch.float32 or weight.dtype != torch.float32
                or torch.is_autocast_enabled("cpu")):
            return F.linear(x, weight, bias)
        x2 = x.reshape(rows, in_features)  # (rows, in)
        if not torch.is_grad_enabled():
            y = _linear_pointwise(x2, weight, bias)
        elif torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
            y = _OneDNNLinearFunction.apply(x2, weight, bias)
        else:
            y = _EagerOneDNNLinearFunction.apply(x2, weight, bias)
        return y.view(*x.shape[:-1], out_features)  # (..., out)
