"""model.linear: the model's Linear layers multiply through oneDNN where that is faster (large float32 products on a
CPU), with the same results as nn.Linear to float32 rounding, forward and backward; which products go there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import needs_cpu_compile
from torch import nn

from model import GPT, GPTConfig
from model import linear as linear_module
from model.linear import ONEDNN_MIN_MACS, Linear, onednn_min_macs, onednn_outruns_blas
from training.compile_cache import compile_options
from training.devices import DeviceError, resolve_device

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


def forced(monkeypatch, value: str = "1") -> None:
    monkeypatch.setenv("TINYCHAR_ONEDNN", value)


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("fan_in", "fan_out"), [(24, 96), (96, 24)])  # wider out (x first for dW), and narrower
def test_a_onednn_linear_gives_nn_linears_outputs_and_gradients(monkeypatch, bias, fan_in, fan_out):
    forced(monkeypatch)
    torch.manual_seed(0)
    layer = Linear(fan_in, fan_out, bias=bias)
    assert layer.onednn_min_rows == 0
    x = torch.randn(3, 40, fan_in, requires_grad=True)  # (B, T, C): reshaped to rows inside
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    grads = (x.grad, layer.weight.grad, layer.bias.grad if bias else None)

    x_ref = x.detach().double().requires_grad_()
    w_ref = layer.weight.detach().double().requires_grad_()
    b_ref = layer.bias.detach().double().requires_grad_() if bias else None
    y_ref = F.linear(x_ref, w_ref, b_ref)
    y_ref.backward(dy.double())
    assert y.shape == (3, 40, fan_out) and y.dtype == torch.float32
    # float32 against float64: the rounding of sums of up to 120 products of values about 1 in size
    assert torch.allclose(y.double(), y_ref, atol=1e-4, rtol=1e-5)
    assert torch.allclose(grads[0].double(), x_ref.grad, atol=1e-4, rtol=1e-5)
    assert torch.allclose(grads[1].double(), w_ref.grad, atol=1e-4, rtol=1e-5)
    if bias:
        assert torch.allclose(grads[2].double(), b_ref.grad, atol=1e-4, rtol=1e-5)
    with torch.no_grad():  # inference calls the operator without autograd's bookkeeping: the same numbers
        assert torch.equal(layer(x), y)


@needs_onednn
def test_a_gpt_trained_through_onednn_follows_the_one_trained_through_the_default_blas(monkeypatch):
    """The same model and batches, ten AdamW steps each way: the losses agree to float32 rounding."""
    cfg = GPTConfig(block_size=8, vocab_size=11, n_layer=2, n_head=2, n_embd=16)
    # a rule to learn: each character's successor is the next id
    inputs = [torch.randint(0, 11, (4, 8), generator=torch.Generator().manual_seed(i)) for i in range(10)]
    batches = [(x, (x + 1) % 11) for x in inputs]
    losses = {}
    for setting in ("0", "1"):
        forced(monkeypatch, setting)
        torch.manual_seed(0)
        model = GPT(cfg)
        assert {m.onednn_min_rows for m in model.modules() if isinstance(m, Linear)} == {None if setting == "0" else 0}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[setting] = []
        for x, y in batches:
            _, loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[setting].append(loss.item())
    assert losses["0"][0] == pytest.approx(losses["1"][0], abs=1e-6)
    assert losses["0"] == pytest.approx(losses["1"], abs=1e-4)
    assert losses["1"][-1] < losses["1"][0] - 0.1  # it learns


def cpuinfo_text(vendor: str, family: int) -> str:
    block = (f"processor\t: {{}}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: 17\n"
             "flags\t\t: avx2 avx512f\n")
    return "\n".join(block.format(n) for n in range(2))


def test_onednn_outruns_the_blas_on_amds_full_width_avx512_only():
    assert onednn_outruns_blas(cpuinfo_text("AuthenticAMD", 26))  # Zen 5: measured 2x MKL
    assert onednn_outruns_blas(cpuinfo_text("AuthenticAMD", 27))
    assert not onednn_outruns_blas(cpuinfo_text("AuthenticAMD", 25))  # Zen 4: measured level, steps slower
    assert not onednn_outruns_blas(cpuinfo_text("GenuineIntel", 6))  # MKL's own AVX-512 code
    assert not onednn_outruns_blas("")  # no /proc/cpuinfo (macOS, Windows)
    assert not onednn_outruns_blas("vendor_id\t: AuthenticAMD\ncpu family\t: ?\n")


def test_which_products_go_to_onednn(monkeypatch):
    monkeypatch.delenv("TINYCHAR_ONEDNN", raising=False)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    monkeypatch.setattr(linear_module, "read_cpuinfo", lambda: cpuinfo_text("AuthenticAMD", 25))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert onednn_min_macs() is None  # Zen 4: AVX-512, but oneDNN no faster
    monkeypatch.setattr(linear_module, "read_cpuinfo", lambda: cpuinfo_text("AuthenticAMD", 26))
    for capability, expected in (("AVX512", ONEDNN_MIN_MACS["AVX512"]), ("AVX2", None), ("DEFAULT", None)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert onednn_min_macs() == expected
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    # nanoGPT's CPU config's c_fc (128 -> 512) goes from 32 rows (2**21 multiply-adds); a batch of 12 x 64 has 768
    assert Linear(128, 512).onednn_min_rows == 32
    assert Linear(100, 7).onednn_min_rows == 2996  # rounded up: 2,995 rows are 2,096,500 multiply-adds, 652 short
    forced(monkeypatch, "0")
    assert onednn_min_macs() is None and Linear(128, 512).onednn_min_rows is None
    forced(monkeypatch, " AUTO ")
    assert onednn_min_macs() == ONEDNN_MIN_MACS["AVX512"]
    forced(monkeypatch, "1")
    assert onednn_min_macs() == 0
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert onednn_min_macs() is None  # forcing cannot conjure a library this torch lacks


def test_a_bad_setting_is_one_line_for_a_person(monkeypatch):
    forced(monkeypatch, "yes please")
    with pytest.raises(ValueError, match="TINYCHAR_ONEDNN must be one of auto, 0, 1, got 'yes please'"):
        onednn_min_macs()
    with pytest.raises(DeviceError, match="TINYCHAR_ONEDNN must be one of"):
        resolve_device("cpu")


@needs_onednn
def test_small_products_other_dtypes_and_autocast_keep_nn_linear(monkeypatch):
    forced(monkeypatch)
    calls = []
    real = linear_module._linear_pointwise
    monkeypatch.setattr(linear_module, "_linear_pointwise", lambda *a: calls.append(1) or real(*a))
    layer = Linear(8, 4)
    layer(torch.randn(5, 8))
    assert calls == [1]
    layer.onednn_min_rows = 6  # below it: nn.Linear
    layer(torch.randn(5, 8))
    assert calls == [1]
    layer.onednn_min_rows = 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.randn(5, 8)).dtype == torch.bfloat16
    assert layer.to(torch.bfloat16)(torch.randn(5, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert calls == [1]
    assert isinstance(layer, nn.Linear) and set(layer.state_dict()) == {"weight", "bias"}


@needs_onednn
def test_torch_func_transforms_take_the_same_gradients_as_eager_autograd(monkeypatch):
    """Eager training uses autograd's older, cheaper form of the function, which torch.func cannot run; under
    torch.func.grad (what the compiled step traces) the layer takes the other form: the same gradients."""
    forced(monkeypatch)
    torch.manual_seed(0)
    layer = Linear(12, 20)
    x = torch.randn(7, 12)
    params = dict(layer.named_parameters())

    def loss_of(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(layer, p, (x,)).square().sum()

    grads = torch.func.grad(loss_of)(params)
    loss_of(params).backward()
    for name, p in params.items():
        assert torch.allclose(grads[name], p.grad, atol=1e-6, rtol=1e-6), name


@pytest.mark.parametrize("onednn", ["0", pytest.param("1", marks=needs_onednn)])
@pytest.mark.parametrize("bias", [True, False])
def test_part_of_a_layer_is_those_output_features_of_the_whole(monkeypatch, onednn, bias):
    forced(monkeypatch, onednn)
    calls = []
    real = linear_module._linear_pointwise
    monkeypatch.setattr(linear_module, "_linear_pointwise", lambda *a: calls.append(a[1].size(0)) or real(*a))
    torch.manual_seed(0)
    layer = Linear(16, 48, bias=bias)
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        whole = layer(x)
        for start, stop in [(0, 16), (16, 48), (5, 6)]:
            part = layer.part(x, start, stop)
            assert part.shape == (3, 5, stop - start)
            torch.testing.assert_close(part, whole[..., start:stop], rtol=0, atol=1e-6)
    # through the library the whole layer takes (oneDNN when forced), with only those rows of the weight
    assert calls == ([48, 16, 32, 1] if onednn == "1" else [])


@needs_onednn
def test_a_part_goes_to_onednn_at_the_whole_layers_multiply_adds(monkeypatch):
    forced(monkeypatch)
    calls = []
    real = linear_module._linear_pointwise
    monkeypatch.setattr(linear_module, "_linear_pointwise", lambda *a: calls.append(a[0].size(0)) or real(*a))
    layer = Linear(8, 12)
    layer.onednn_min_rows = 4  # 4 x 8 x 12 multiply-adds: a third of the features needs 12 rows for as many
    layer.part(torch.randn(11, 8), 0, 4)
    assert calls == []
    layer.part(torch.randn(12, 8), 0, 4)
    assert calls == [12]


@needs_onednn
@needs_cpu_compile
@pytest.mark.slow
@pytest.mark.parametrize("cpp_wrapper", [False, True], ids=["python wrapper", "C++ wrapper"])
def test_compiled_code_calls_onednn_itself_not_the_operators_python(monkeypatch, cpp_wrapper):
    """lower_onednn_linear: inductor's code calls oneDNN's linear for the custom operator, forward and backward, with
    the eager results (it once called back into the operator's Python for every product); a run's C++ wrapper
    (training.compile_cache.COMPILE_OPTIONS) calls PyTorch's C function for it, not the dispatcher, where there is
    one."""
    from torch._inductor.utils import run_and_get_code

    forced(monkeypatch)
    torch.manual_seed(0)
    layer = Linear(32, 48)
    x = torch.randn(16, 32, requires_grad=True)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return layer(x).square().sum()

    expected = loss(x)
    expected.backward()
    grads = (x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone())
    x.grad = layer.weight.grad = layer.bias.grad = None
    linear_module.lower_onednn_linear()
    # compiled now, with the lowering (inductor's cache would not know code compiled without it)
    # the C++ wrapper as a run builds it (and so with the precompiled headers of the suite's other compiles)
    options = compile_options(torch.device("cpu")) if cpp_wrapper else {"cpp_wrapper": False}
    compiled = torch.compile(loss, fullgraph=True, options={**options, "fx_graph_cache": False})

    def step() -> torch.Tensor:
        out = compiled(x)
        out.backward()
        return out.detach()

    got, code = run_and_get_code(step)
    assert torch.allclose(got, expected, rtol=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip((x.grad, layer.weight.grad,
                                                                           layer.bias.grad), grads, strict=True))
    code = "\n".join(code)
    if not cpp_wrapper:
        calls = code.count("= torch.ops.mkldnn._linear_pointwise.default(")
        assert calls == 3 and "= torch.ops.tinychar.onednn_linear.default(" not in code, code  # y, dx and dW
    elif linear_module.has_linear_shim():
        assert code.count(f"CHECK({linear_module.LINEAR_SHIM}(") == 3 and "findSchemaOrThrow" not in code, code
    else:
        assert code.count('findSchemaOrThrow("mkldnn::_linear_pointwise"') == 3, code
