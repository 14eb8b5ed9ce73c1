"""training.linear_kernel: the linear layers' products by a kernel of tinychar's own in the compiled training step,
where it applies (sizes multiples of 16, float32 on a CPU) and was measured faster (AMD without AVX-512)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import needs_cpu_compile, tiny_overrides
from test_train import bitwise_equal, logged_losses
from training_runs import call, train_main, write_corpus

from model import GPT, GPTConfig, load_checkpoint
from model import linear as linear_module
from model.linear import Linear, gemm_setting, own_gemm_outruns_blas
from training import linear_kernel
from training.devices import DeviceError, resolve_device

AMD = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\n\nprocessor\t: 1\nvendor_id\t: GenuineIntel\n"
INTEL = AMD.replace("AuthenticAMD", "GenuineIntel", 1)


@needs_cpu_compile  # a C compiler, which builds the kernel
@pytest.mark.parametrize(("rows", "fan_in", "fan_out"),
                         [(768, 128, 384), (7, 32, 48), (13, 512, 128), (1, 16, 16), (300, 48, 80), (700, 272, 16)])
def test_the_kernel_multiplies_as_torch_does_forward_and_backward(tmp_path: Path, rows, fan_in, fan_out):
    """x W^T, dy W and dy^T x against float64 products, on shapes that leave partial tiles of six rows and, for the
    weight's gradient, a partial block of its sum over rows (700: halves of 350 = 5 x 64 + 30): within float32's
    rounding of sums of up to 700 terms. The C++ operators and the Python ones give the same bits."""
    torch.manual_seed(0)
    linear_kernel.library(tmp_path)
    x = torch.randn(rows, fan_in, requires_grad=True)
    w = torch.randn(fan_out, fan_in, requires_grad=True)
    y = linear_kernel.multiply(x, w)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
    for got, want in [(y, x64 @ w64.T), (x.grad, dy64 @ w64), (w.grad, dy64.T @ x64)]:
        torch.testing.assert_close(got.detach().double(), want, rtol=0, atol=2e-6 * want.abs().max().item() + 1e-6)
    assert torch.equal(linear_kernel.linear_in_python(x.detach(), w.detach()), y.detach())
    dx, dw = linear_kernel.linear_backward_in_python(x.detach(), w.detach(), dy)
    assert torch.equal(dx, x.grad) and torch.equal(dw, w.grad)


@needs_cpu_compile
def test_the_kernel_gives_the_same_bits_on_one_thread_and_on_two(tmp_path: Path):
    """Each output value is one thread's sum in one order: the number of threads changes nothing (a resumed run on
    another thread count equals a straight one)."""
    torch.manual_seed(1)
    linear_kernel.library(tmp_path)
    x, w, dy = torch.randn(301, 64), torch.randn(96, 64), torch.randn(301, 96)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append((linear_kernel.linear(x, w), *linear_kernel.linear_backward(x, w, dy)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@needs_cpu_compile
@pytest.mark.parametrize(("rows", "fan_in", "fan_out"),
                         [(1, 128, 384), (5, 32, 48), (11, 100, 64), (13, 512, 128), (128, 128, 512), (0, 16, 16)])
def test_the_product_from_a_packed_weight_is_torchs_on_any_number_of_threads(tmp_path: Path, rows, fan_in, fan_out):
    """x W^T from W packed ahead (the compiled sampler's), against a float64 product: rows split between the threads
    (128), panels split (5, 11: fewer than two tiles of six rows a thread), one thread (1 x 128 x 384, under 2^16
    multiply-adds), a width that is no multiple of 16, no rows at all. The same bits on one thread and two, through
    the C++ operator and the Python one, and for a slice of the packed panels (Linear.part)."""
    torch.manual_seed(2)
    linear_kernel.library(tmp_path)
    x, w = torch.randn(rows, fan_in), torch.randn(fan_out, fan_in)
    packed = linear_kernel.pack(w)
    assert packed.shape == (fan_out // 16, fan_in, 16) and torch.equal(packed[-1, :, 3], w[-13])
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(linear_kernel.linear_packed(x, packed))
    finally:
        torch.set_num_threads(threads)
    want = x.double() @ w.double().T
    scale = want.abs().max().item() if rows else 0.0
    torch.testing.assert_close(results[0].double(), want, rtol=0, atol=2e-6 * scale + 1e-6)
    assert torch.equal(results[0], results[1])
    assert torch.equal(linear_kernel.linear_packed_in_python(x, packed), results[0])
    assert torch.equal(linear_kernel.linear_packed(x, packed[-1:]), results[0][:, -16:])


def test_auto_takes_the_kernel_on_amd_processors_without_full_width_avx512(monkeypatch):
    zen4, zen5 = (AMD.replace("cpu family\t: 23", f"cpu family\t: {family}", 1) for family in (25, 26))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert own_gemm_outruns_blas(AMD)
    assert own_gemm_outruns_blas(zen5)  # kept to AVX2 (bench.py --isa avx2): MKL's AVX2 code
    assert not own_gemm_outruns_blas(INTEL)  # MKL's own AVX2 code, not measured against
    assert not own_gemm_outruns_blas("")  # no /proc/cpuinfo
    assert not own_gemm_outruns_blas("vendor_id\t: AuthenticAMD\ncpu family\t: ?\n")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert own_gemm_outruns_blas(zen4)  # AVX-512 through 256-bit units: the kernel's AVX2 code outran MKL's
    assert not own_gemm_outruns_blas(zen5)  # full width: oneDNN at twice MKL's rate
    assert not own_gemm_outruns_blas(INTEL.replace("cpu family\t: 23", "cpu family\t: 6", 1))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert not own_gemm_outruns_blas(AMD)  # no vector code to build for


def model(width: int = 128, vocab: int = 65) -> GPT:
    return GPT(GPTConfig(vocab_size=vocab, block_size=64, n_layer=1, n_head=4, n_embd=width, dropout=0.0))


def taken(m: GPT) -> list[str]:
    return [name for name, layer in m.named_modules() if isinstance(layer, Linear) and layer.kernel is not None]


@needs_cpu_compile
def test_the_layers_that_take_the_kernel(monkeypatch):
    """With TINYCHAR_GEMM=1: every linear layer of sizes multiples of 16 whose products on a micro-batch's rows reach
    MIN_MACS (nanoGPT's CPU config, 768 rows of 128 wide, and tiny.yaml's halves, 512 of 64: all four of a block's); not
    the head over 65 characters, nor bench.py's block-8 step (256 rows of 32 wide, measured slower). 0 gives it to none,
    and auto to none where it was not measured faster. Only the compiled step's traced forward runs it: eager passes
    keep PyTorch's."""
    monkeypatch.setenv("TINYCHAR_GEMM", "1")
    block = ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
             "transformer.h.0.mlp.c_proj"]
    m = model()
    assert linear_kernel.attach(m, rows=12 * 64) and taken(m) == block
    assert m.transformer.h[0].mlp.c_fc.kernel_source  # a setting of the layer: the step compiles apart
    m = model(vocab=96)  # the tied head's sizes are multiples of 16 too (768 x 128 x 96 = 9.4 million)
    assert linear_kernel.attach(m, rows=12 * 64) and taken(m) == [*block, "lm_head"]
    m = model(width=32)
    assert not linear_kernel.attach(m, rows=32 * 8) and not taken(m)
    m = model(width=64)  # tiny.yaml's step in halves: 512 rows; the attention's c_proj, 512 x 64 x 64, at MIN_MACS
    assert linear_kernel.attach(m, rows=512) and taken(m) == block
    m = model(width=64)
    assert linear_kernel.attach(m, rows=511) and taken(m) == [block[0], *block[2:]]
    m = model(width=512)  # c_fc's and the MLP's c_proj's weights have 2^20 values: over this limit, they keep MKL
    monkeypatch.setattr(linear_kernel, "MAX_WEIGHTS", 2**20 - 1)
    assert linear_kernel.attach(m, rows=12 * 64) and taken(m) == block[:2]
    m = model()
    x = torch.randn(2, 64, 128)
    linear_kernel.attach(m)
    layer = m.transformer.h[0].mlp.c_fc
    assert not layer.takes_kernel(x) and torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    monkeypatch.setenv("TINYCHAR_GEMM", "0")
    m = model()
    assert not linear_kernel.attach(m, rows=12 * 64) and not taken(m)
    monkeypatch.setenv("TINYCHAR_GEMM", "auto")
    monkeypatch.setattr(linear_module, "read_cpuinfo", lambda: INTEL)
    m = model()
    assert not linear_kernel.attach(m, rows=12 * 64) and not taken(m)


@needs_cpu_compile
def test_the_layers_that_take_the_packed_weights_and_only_compiled_code_without_gradients_reads_them(monkeypatch):
    """attach_packed (the compiled sampler's): every layer the kernel applies to, whatever its rows (a window's are
    few), gets its weight packed, as a buffer that no checkpoint holds; not the head over 65 characters. Eager passes,
    and any with gradients, keep PyTorch's products."""
    monkeypatch.setenv("TINYCHAR_GEMM", "1")
    m = model(width=32).eval()
    assert linear_kernel.attach_packed(m)
    packed = [name for name, layer in m.named_modules() if isinstance(layer, Linear) and layer.packed is not None]
    assert packed == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
                      "transformer.h.0.mlp.c_proj"]
    layer = m.transformer.h[0].mlp.c_fc
    assert torch.equal(layer.packed, linear_kernel.pack(layer.weight)) and layer.packed_kernel_source
    assert not any("packed" in key for key in m.state_dict())
    assert torch.equal(copy.deepcopy(m).transformer.h[0].mlp.c_fc.packed, layer.packed)  # copied with its model
    x = torch.randn(2, 64, 32)
    with torch.no_grad():
        assert not layer.takes_packed(x) and torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
    monkeypatch.setenv("TINYCHAR_GEMM", "0")
    m = model(width=32).eval()
    assert not linear_kernel.attach_packed(m) and m.transformer.h[0].mlp.c_fc.packed is None


@needs_cpu_compile
def test_packed_copies_that_would_crowd_the_memory_left_are_not_made(monkeypatch):
    """A model that barely fits samples through PyTorch's products: attach_packed packs nothing where the copies would
    take more than half of what the process may still allocate, and packs where they take half exactly."""
    monkeypatch.setenv("TINYCHAR_GEMM", "1")
    m = model(width=32).eval()
    copies = sum(layer.weight.numel() * 4 for layer in linear_kernel.layers_taking(m))
    assert copies == (96 + 32 + 128 + 32 * 4) * 32 * 4
    monkeypatch.setattr(linear_kernel, "allocatable_bytes", lambda device: 2 * copies - 1)
    assert not linear_kernel.attach_packed(m)
    assert all(layer.packed is None for layer in m.modules() if isinstance(layer, Linear))
    monkeypatch.setattr(linear_kernel, "allocatable_bytes", lambda device: 2 * copies)
    assert linear_kernel.attach_packed(m) and m.transformer.h[0].mlp.c_fc.packed is not None


def test_a_bad_gemm_setting_is_one_line_for_a_person(monkeypatch):
    monkeypatch.setenv("TINYCHAR_GEMM", " AUTO ")
    assert gemm_setting() == "auto"
    monkeypatch.setenv("TINYCHAR_GEMM", "fast")
    with pytest.raises(ValueError, match="TINYCHAR_GEMM must be one of auto, 0, 1, got 'fast'"):
        gemm_setting()
    with pytest.raises(DeviceError, match="TINYCHAR_GEMM must be one of"):
        resolve_device("cpu")


@needs_cpu_compile
@pytest.mark.slow
def test_a_compiled_run_with_the_kernel_resumes_exactly(tmp_path: Path, capsys, monkeypatch):
    """train.py compiled with the kernel on every linear layer (tiny.yaml's optimizers, biases and two micro-batches a
    step): stopped at step 10 and resumed, it ends bit for bit where the straight run did, weights and optimizer
    state; and the kernel was traced into the step."""
    monkeypatch.setenv("TINYCHAR_GEMM", "1")
    monkeypatch.setattr(linear_kernel, "MIN_MACS", (0, 0))  # this model's products are far under the threshold
    traced = []
    multiply = linear_kernel.multiply
    monkeypatch.setattr(linear_kernel, "multiply", lambda x, w: traced.append(w.shape) or multiply(x, w))
    corpus = write_corpus(tmp_path)
    keys = {"model.n_layer": 1, "train.lr_decay_iters": 20, "train.log_interval": 1, "train.grad_accum_steps": 2,
            "train.sample_chars": 0, "train.tensorboard": "false", "train.compile": "true"}

    def run(out: str, *extra: str, **more: object) -> dict[int, str]:
        code, stdout, err = call(train_main, [*tiny_overrides(corpus, tmp_path / out, **{**keys, **more}), *extra],
                                 capsys)
        assert code == 0, err
        return logged_losses(stdout)

    straight = run("straight")
    assert {torch.Size([48, 16]), torch.Size([64, 16]), torch.Size([16, 64])} <= set(traced)
    run("resumed", **{"train.max_iters": 10})
    resumed = run("resumed", "--resume")
    assert {s: resumed[s] for s in range(11, 21)} == {s: straight[s] for s in range(11, 21)}
    final, expected = (load_checkpoint(tmp_path / name / "ckpt.pt") for name in ("resumed", "straight"))
    assert bitwise_equal(final["model"], expected["model"])
    assert all(bitwise_equal(final["optimizer"]["state"][i], state)
               for i, state in expected["optimizer"]["state"].items())
