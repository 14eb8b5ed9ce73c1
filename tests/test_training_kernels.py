"""The compiled step's own kernels (training/attention_kernel.py, training/gelu_kernel.py): the notes' masked
attention and exact GELU, and their gradients, to float32's precision, for every shape they take; which layers take
them; a machine that cannot build them trains as before; and inside the compiled step it is the kernels that run,
with the losses of the notes' code."""

from __future__ import annotations

import math
import subprocess
import sys
from collections import Counter
from dataclasses import replace

import pytest
import torch
from conftest import needs_cpu_compile
from torch import nn
from torch.torch_version import TorchVersion

from model import GPT, GPTConfig
from model.attention import CausalSelfAttention, causal_bias
from model.gpt import MLP
from model.linear import Linear
from training import TrainConfig, attention_kernel, c_kernels, compiled_step, gelu_kernel, linear_kernel, muon_kernel
from training.compiled_step import CompiledStep
from training.optim import make_optimizer

CPU = torch.device("cpu")


def notes_attention(qkv: torch.Tensor, n_head: int) -> torch.Tensor:
    """The notes' steps, in float64: split into heads, scaled scores, the triangular mask, softmax, weighted sum."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in qkv.split(C, dim=2))
    scores = q @ k.transpose(-2, -1) / math.sqrt(C // n_head) + causal_bias(T).to(qkv.dtype)
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(B, T, C)


@needs_cpu_compile
@pytest.mark.parametrize(("batch", "block", "n_head", "head_size"),
                         [(2, 64, 4, 32), (3, 5, 2, 16), (1, 1, 1, 16), (2, 100, 3, 64), (1, 128, 2, 48),
                          (2, 17, 1, 16)])
def test_the_kernel_computes_the_notes_attention_and_its_gradient(batch, block, n_head, head_size):
    """Against the notes' steps in float64: blocks of one position, of a few, not a multiple of the kernel's 16-wide
    tiles, and the longest it takes; heads of 16 to 64. Measured errors of these: at most 6e-7 in the output and
    1.9e-6 in the gradient of values of about 1 (float32's step there is 1.2e-7)."""
    gen = torch.Generator().manual_seed(block * 100 + head_size)
    qkv = torch.randn(batch, block, 3 * n_head * head_size, dtype=torch.float64, generator=gen)
    dy = torch.randn(batch, block, n_head * head_size, dtype=torch.float64, generator=gen)
    expected, pullback = torch.func.vjp(lambda t: notes_attention(t, n_head), qkv)
    (expected_grad,) = pullback(dy)
    x = qkv.float().requires_grad_()
    y = attention_kernel.attend(x, n_head)
    y.backward(dy.float())
    assert (y.double() - expected).abs().max() < 2e-6
    assert (x.grad.double() - expected_grad).abs().max() < 5e-6


def layers_with_kernel(model: GPT) -> list[CausalSelfAttention]:
    return [m for m in model.modules() if isinstance(m, CausalSelfAttention) and m.kernel is not None]


@needs_cpu_compile
@pytest.mark.parametrize("size", [1, 8, 13, 4096 + 5])
def test_the_gelu_kernel_computes_exact_gelu_and_its_gradient(size):
    """Against GELU in float64 (x Phi(x), erf's), on values up to about 15, the few that are no vector's whole eight,
    and the edges: zeros, numbers near zero, far out on either side. Measured: 4.4e-7 and 3.7e-7 at most."""
    gen = torch.Generator().manual_seed(size)
    x = torch.randn(size, generator=gen, dtype=torch.float64) * 4
    edges = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 40.0, -40.0, 1e4, -1e4], dtype=torch.float64)
    x[: min(size, 8)] = edges[: min(size, 8)]
    g = torch.randn(size, generator=gen, dtype=torch.float64)
    expected, pullback = torch.func.vjp(torch.nn.functional.gelu, x)
    (expected_grad,) = pullback(g)
    x32 = x.float().requires_grad_()
    y = gelu_kernel.activate(x32)
    _, slope = gelu_kernel.gelu(x32.detach())
    (saved,) = y.grad_fn.saved_tensors  # the forward's derivative, kept, not its input: the backward is one product
    assert torch.equal(saved, slope)
    y.backward(g.float())
    assert (y.double() - expected).abs().max() < 1e-6
    assert (x32.grad.double() - expected_grad).abs().max() < 1e-6
    assert torch.equal(x32.grad, g.float() * slope)
    assert torch.isnan(gelu_kernel.activate(torch.tensor([float("nan")] * 9))).all()


@needs_cpu_compile
def test_every_exact_gelu_of_the_model_takes_the_gelu_kernel():
    model = GPT(GPTConfig(vocab_size=12, block_size=16, n_layer=3, n_head=4, n_embd=32))
    model.transformer.h[2].mlp.gelu = nn.GELU(approximate="tanh")  # another function
    assert gelu_kernel.attach(model)
    taken = [m.kernel is not None and bool(m.kernel_source) for m in model.modules() if isinstance(m, MLP)]
    assert taken == [True, True, False]


@needs_cpu_compile
def test_the_layers_the_kernel_computes_take_it_and_no_others():
    plain = dict(vocab_size=12, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    model = GPT(GPTConfig(**plain))
    assert attention_kernel.attach(model)
    assert len(layers_with_kernel(model)) == 2 and layers_with_kernel(model)[0].kernel_source
    for other in (dict(n_head=4), dict(dropout=0.1), dict(score="additive"), dict(attention="fused"),
                  dict(block_size=attention_kernel.MAX_BLOCK + 1)):
        model = GPT(GPTConfig(**{**plain, **other}))
        assert not attention_kernel.attach(model), other  # heads of 8, dropout, additive scores, fused, too long
        assert not layers_with_kernel(model)


@needs_cpu_compile
def test_the_kernels_go_only_to_steps_big_enough_to_win_their_calls_back(monkeypatch):
    """Each call of a kernel costs more than inductor's own code, and far more where it goes through Python: the
    compiled step takes them where a micro-batch (rows: batch times block) gives them enough work, as measured
    (nanoGPT's CPU config, 768 rows of block 64 and width 128, takes both; tiny.yaml's model, 1,024 rows of block 8 and
    width 64, both, and only the attention's through Python; bench.py's block-8 rows, 256, only the attention's)."""
    def taken(rows: int, block: int, width: int, heads: int) -> tuple[bool, bool]:
        model = GPT(GPTConfig(vocab_size=65, block_size=block, n_layer=1, n_head=heads, n_embd=width, dropout=0.0))
        return attention_kernel.attach(model, rows=rows), gelu_kernel.attach(model, rows=rows)

    assert taken(12 * 64, 64, 128, 4) == (True, True)
    assert taken(128 * 8, 8, 64, 4) == (True, True)
    assert taken(32 * 8, 8, 64, 4) == (True, False)
    assert taken(4 * 16, 16, 16, 1) == (False, False)  # 15% slower with the attention's, measured
    monkeypatch.setattr(attention_kernel, "_operators", lambda folder=None: None)  # a torch before 2.10, say
    monkeypatch.setattr(gelu_kernel, "_operators", lambda folder=None: None)
    assert taken(12 * 64, 64, 128, 4) == (True, True)
    assert taken(128 * 8, 8, 64, 4) == (True, False)
    assert taken(32 * 8, 8, 64, 4) == (False, False)
    monkeypatch.undo()
    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=1, n_head=4, n_embd=128, dropout=0.0))
    tc = replace(TrainConfig(), batch_size=12, grad_accum_steps=1)
    CompiledStep(model, make_optimizer(model, tc, CPU), tc, CPU, torch.float32)  # attaches what applies
    assert layers_with_kernel(model) and model.transformer.h[0].mlp.kernel is not None
    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=1, n_head=4, n_embd=128, dropout=0.0))
    CompiledStep(model, make_optimizer(model, tc, CPU), tc, CPU, torch.bfloat16)  # float32 only
    assert not layers_with_kernel(model) and model.transformer.h[0].mlp.kernel is None
    model = GPT(GPTConfig(vocab_size=65, block_size=8, n_layer=1, n_head=4, n_embd=64, dropout=0.0))
    tc = replace(tc, batch_size=32)
    CompiledStep(model, make_optimizer(model, tc, CPU), tc, CPU, torch.float32)  # a micro-batch of 256 rows
    assert layers_with_kernel(model) and model.transformer.h[0].mlp.kernel is None


def loaded_operators() -> None:
    """Load the operators' C++ kernels, and the kernels that GELU's and the linear layers' take (built, given to them),
    or skip where this torch has no stable C++ interface for them (before 2.10: their Python kernels run there, as
    every test of them above checks wherever the C++ ones are not loaded yet)."""
    gelu_kernel.library(), linear_kernel.library(), muon_kernel.library()
    cpp = all(k._operators() is not None for k in (attention_kernel, gelu_kernel, linear_kernel, muon_kernel))
    if TorchVersion(torch.__version__) < "2.10":
        assert not cpp
        pytest.skip("the operators' kernels are C++ from torch 2.10")
    assert cpp


@needs_cpu_compile
def test_the_operators_run_their_cpp_kernels_which_give_what_the_python_ones_give(monkeypatch):
    """Loaded, the operators' kernels for CPU tensors are C++: the compiled step calls them without a round trip
    through Python, so the Python kernels do not run, and each gives what its Python one gives, to the bit. A shape
    the attention's has not met is built once, through Python; a tensor not laid out row by row is copied first."""
    loaded_operators()
    python_calls = []
    loaded, library = attention_kernel._loaded, gelu_kernel.library
    monkeypatch.setattr(attention_kernel, "_loaded", lambda *a: python_calls.append(a) or loaded(*a))
    monkeypatch.setattr(gelu_kernel, "library", lambda *a: python_calls.append(a) or library(*a))
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 24, 3 * 2 * 32, generator=gen)  # block 24, 2 heads of 32: no other test's shape
    dy = torch.randn(2, 24, 2 * 32, generator=gen)
    y, weights = torch.ops.tinychar.causal_attention(qkv, 2)
    dqkv = torch.ops.tinychar.causal_attention_backward(qkv, weights, dy, 2)
    x = torch.randn(40, 30, generator=gen).t()
    h, slope = torch.ops.tinychar.gelu(x)
    wide = torch.randn(3, 32, 48, generator=gen)
    gram = wide @ wide.mT / 100
    q = torch.ops.tinychar.newton_schulz(gram)
    assert python_calls == [] and (24, 32, 2) in attention_kernel._LIBRARIES  # built for the operator on meeting it
    assert torch.equal(q, muon_kernel.newton_schulz_in_python(gram))
    expected_y, expected_weights = attention_kernel.causal_attention_in_python(qkv, 2)
    assert torch.equal(y, expected_y) and torch.equal(weights[..., :24].tril(), expected_weights[..., :24].tril())
    assert torch.equal(dqkv, attention_kernel.causal_attention_backward_in_python(qkv, weights, dy, 2))
    expected_h, expected_slope = gelu_kernel.gelu_in_python(x)
    assert torch.equal(h, expected_h) and h.is_contiguous() and torch.equal(slope, expected_slope)


@needs_cpu_compile
def test_a_call_of_an_operator_runs_no_python_past_its_own_call():
    """The compiled step calls the operators through PyTorch's dispatcher, dozens of times a step: nothing between the
    dispatcher and their C++ kernels is Python, an autograd kernel included (torch.library.custom_op gives one, about
    7 us a call; the operators' gradients are their autograd.Functions'). Each of the seven, traced: the only Python
    it runs is the operator's own __call__."""
    loaded_operators()
    gen = torch.Generator().manual_seed(5)
    qkv, dy = torch.randn(2, 16, 3 * 32, generator=gen), torch.randn(2, 16, 32, generator=gen)
    x, w, g = torch.randn(12, 32, generator=gen), torch.randn(16, 32, generator=gen), torch.randn(12, 16, generator=gen)
    _, weights = torch.ops.tinychar.causal_attention(qkv, 1)  # the kernel of this shape built, through Python
    ops = torch.ops.tinychar
    calls = [(ops.gelu, (x,)), (ops.linear, (x, w)), (ops.linear_backward, (x, w, g)),
             (ops.linear_packed, (x, linear_kernel.pack(w))), (ops.causal_attention, (qkv, 1)),
             (ops.causal_attention_backward, (qkv, weights, dy, 1)), (ops.newton_schulz, ((x.T @ x)[None, :16, :16],)),
             ]
    ran: list[str] = []
    for op, args in calls:
        ran.clear()
        sys.setprofile(lambda frame, event, _: ran.append(frame.f_code.co_name) if event == "call" else None)
        try:
            op(*args)
        finally:
            sys.setprofile(None)
        assert ran == ["__call__"], (op, ran)
    assert torch.equal(ops.linear(x, w), linear_kernel.linear_in_python(x, w))


@needs_cpu_compile
def test_an_attention_operator_whose_kernel_cannot_be_built_raises_naming_its_shape(monkeypatch):
    loaded_operators()
    monkeypatch.setattr(attention_kernel, "_LIBRARIES", {})
    monkeypatch.setattr(c_kernels, "_BUILT", {})
    monkeypatch.setattr(c_kernels, "compiler", lambda: "false")
    with pytest.raises(RuntimeError, match="no attention kernel for block 7, heads 1 of 16"):
        torch.ops.tinychar.causal_attention(torch.randn(1, 7, 48), 1)


def test_operators_that_cannot_be_built_leave_the_python_kernels_and_nothing_behind(monkeypatch, tmp_path):
    """Their C++ that does not compile (headers of another torch, say) is no error: None, once a process, the
    operators' Python kernels running as before, and nothing half-built in the cache."""
    monkeypatch.setattr(c_kernels, "_OPERATORS", {})
    monkeypatch.setattr(c_kernels, "OPERATORS_PRELUDE", "#include <torch/csrc/no_such_header.h>\n")
    assert c_kernels.operators("gelu-operators", gelu_kernel.OPERATORS, tmp_path) is None
    monkeypatch.setattr(c_kernels, "compiler", lambda: pytest.fail("a failed build is not tried again"))
    assert c_kernels.operators("gelu-operators", gelu_kernel.OPERATORS, tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_a_machine_that_cannot_build_the_kernels_keeps_the_notes_attention_and_torchs_code(monkeypatch, tmp_path):
    monkeypatch.setattr(attention_kernel, "_LIBRARIES", {})
    monkeypatch.setattr(c_kernels, "_BUILT", {})
    monkeypatch.setattr(c_kernels, "_OPERATORS", {})  # (this process's operators stay loaded, whatever fails here)
    model = GPT(GPTConfig(vocab_size=12, block_size=16, n_layer=1, n_head=1, n_embd=16, dropout=0.0))
    monkeypatch.setattr(c_kernels, "compiler", lambda: None)  # no compiler at all
    assert not attention_kernel.attach(model, tmp_path)
    monkeypatch.setattr(c_kernels, "compiler", lambda: "false")  # one that fails
    assert not attention_kernel.attach(model, tmp_path)
    monkeypatch.setattr(gelu_kernel._KERNEL, "loaded", [])
    assert not gelu_kernel.attach(model, tmp_path)
    monkeypatch.setattr(linear_kernel._KERNEL, "loaded", [])
    monkeypatch.setenv("TINYCHAR_GEMM", "1")
    assert not linear_kernel.attach(model, tmp_path)
    assert not layers_with_kernel(model) and all(m.kernel is None for m in model.modules() if isinstance(m, MLP))
    assert all(m.kernel is None for m in model.modules() if isinstance(m, Linear))  # PyTorch's products
    assert list(tmp_path.iterdir()) == []  # nothing half-built left behind


def test_a_failed_build_raises_what_the_compiler_said(monkeypatch, tmp_path):
    monkeypatch.setattr(attention_kernel, "_LIBRARIES", {})
    monkeypatch.setattr(c_kernels, "_BUILT", {})
    monkeypatch.setattr(c_kernels, "compiler", lambda: "false")
    with pytest.raises(subprocess.CalledProcessError):
        attention_kernel.library(16, 16, 1, tmp_path)


def operators_run(profile: torch.profiler.profile) -> dict[str, int]:
    """How many times each of tinychar's operators ran, as the profiler saw the dispatcher call them."""
    return dict(Counter(e.name.removeprefix("tinychar::") for e in profile.events()
                        if e.name.startswith("tinychar::")))


@needs_cpu_compile
def test_the_compiled_step_runs_the_kernels_with_the_losses_of_the_notes_code(monkeypatch):
    """Three compiled steps of a model the kernels take, with Muon, against the same steps run as plain PyTorch (the
    notes' attention, torch's GELU and Muon's iteration as PyTorch's products): the losses within 2e-6, and the
    weights within 2e-5, all but a few within 1e-6. Muon's orthogonalised step magnifies a gradient's weakest
    directions, and with them the rounding of the kernels' other order of additions: measured, 5.6e-6 at most and 107
    of the 3,760 weights beyond 1e-6 (67 with Muon's iteration through PyTorch's products in both; with AdamW alone,
    13). And the four kernels ran, the layers' forward and backward, the Newton-Schulz iteration once a step (the
    linear layers' and Muon's on any CPU, with TINYCHAR_GEMM=1)."""
    monkeypatch.setattr(attention_kernel, "MIN_WORK", (0, 0))  # a step this small takes them only here
    monkeypatch.setattr(gelu_kernel, "MIN_VALUES", (0, 0))
    monkeypatch.setattr(linear_kernel, "MIN_MACS", (0, 0))
    monkeypatch.setenv("TINYCHAR_GEMM", "1")  # on any CPU
    tc = replace(TrainConfig(), grad_accum_steps=1, optimizer="muon")
    cfg = GPTConfig(vocab_size=12, block_size=16, n_layer=1, n_head=1, n_embd=16, dropout=0.0)
    xs = torch.randint(0, 12, (1, 4, 16), generator=torch.Generator().manual_seed(0))
    lr = torch.tensor(1e-2, dtype=torch.float64)

    def three_steps(compiled: bool) -> tuple[list[float], torch.Tensor]:
        torch.manual_seed(0)
        model = GPT(cfg)
        step = CompiledStep(model, make_optimizer(model, tc, CPU), tc, CPU, torch.float32)
        assert layers_with_kernel(model) and model.transformer.h[0].mlp.kernel is not None
        assert model.transformer.h[0].mlp.c_fc.kernel is not None and step.setup.newton_schulz == muon_kernel.DIGEST
        plain = step.setup._replace(newton_schulz="")  # the iteration as PyTorch's products
        losses = []
        for _ in range(3):
            if compiled:
                losses.append(step(xs, xs.roll(1, -1), 1e-2)[0].item())
            else:
                with torch.no_grad():
                    args = (step.decay, step.owner, xs, xs.roll(1, -1), lr, step.layout, plain)
                    losses.append(compiled_step._whole_step(model, *step.buffers(), *args)[0].item())
        return losses, step.flat.clone()

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as eager:
        eager_losses, eager_weights = three_steps(compiled=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as compiled:
        compiled_losses, compiled_weights = three_steps(compiled=True)
    assert operators_run(eager) == {}
    ran = operators_run(compiled)  # forward and backward of each step (and the warm-up's)
    assert set(ran) == {"causal_attention", "causal_attention_backward", "gelu", "linear",
                        "linear_backward", "newton_schulz"}
    assert min(ran.values()) >= 3
    assert compiled_losses == pytest.approx(eager_losses, abs=2e-6)
    apart = (compiled_weights - eager_weights).abs()
    assert int((apart > 1e-6).sum()) <= apart.numel() // 20 and apart.max() < 2e-5
