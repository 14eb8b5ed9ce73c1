"""training.devices: when dtype=auto may take bfloat16 on a CPU."""

from __future__ import annotations

import pytest
import torch

from model import linear as linear_module
from training import devices

BF16_CPU = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"


@pytest.fixture
def cpuinfo(monkeypatch: pytest.MonkeyPatch):
    """Make /proc/cpuinfo read as the given text."""
    def use(text: str) -> None:
        monkeypatch.setattr(linear_module, "read_cpuinfo", lambda: text)
    return use


def test_bfloat16_needs_the_hardware_and_torch_allowed_to_use_it(cpuinfo, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    cpuinfo(BF16_CPU)
    assert devices.cpu_has_native_bf16()
    assert devices.resolve_dtype("auto", torch.device("cpu"), width=128) == torch.bfloat16
    cpuinfo("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n")  # AVX-512 without BF16
    assert not devices.cpu_has_native_bf16()
    assert devices.resolve_dtype("auto", torch.device("cpu"), width=128) == torch.float32


@pytest.mark.parametrize("limit", ["aten", "onednn"])
def test_bfloat16_is_not_chosen_where_avx512_is_turned_off(cpuinfo, monkeypatch, limit):
    # ATEN_CPU_CAPABILITY=avx2 or ONEDNN_MAX_CPU_ISA=AVX2 (bench.py --isa avx2) on a bf16 CPU: float32
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2" if limit == "aten" else "AVX512")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: limit != "onednn")
    cpuinfo(BF16_CPU)
    assert not devices.cpu_has_native_bf16()


def test_cpu_flags_come_from_the_first_processor_and_are_empty_without_any():
    text = BF16_CPU + "\nprocessor\t: 1\nflags\t\t: fpu sse2\n"
    assert linear_module.cpu_flags(text) == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    assert linear_module.cpu_flags("") == set()
    assert linear_module.cpu_flags("processor\t: 0\nvendor_id\t: AuthenticAMD\n") == set()
    assert not devices.cpu_has_native_bf16("")  # no /proc/cpuinfo (macOS, Windows): no bfloat16 by default


def test_a_cuda_index_must_be_a_gpu_of_this_machine(monkeypatch):
    # cuda:7 on a one-GPU machine passed to torch, which failed in a traceback when the run measured free memory
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert devices.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert devices.resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(devices.DeviceError, match=r"device cuda:2 asked for, but this machine has 2 CUDA GPU\(s\)"):
        devices.resolve_device("cuda:2")
    assert devices.resolve_device("cuda:7", any_index=True) == torch.device("cuda", 7)  # torchrun picks the GPU


@pytest.mark.parametrize("name", ["cpu:0", "cpu:1", "mps:0"])
def test_only_cuda_takes_an_index(name):
    # torch takes cpu:1 as the CPU: sample.py --device cpu:1 sampled on the CPU, where train.device=cpu:1 is refused
    with pytest.raises(devices.DeviceError, match="only cuda takes an index"):
        devices.resolve_device(name)


@pytest.mark.parametrize("fast", [False, True])
def test_a_float16_cpu_run_measures_its_mfu_against_the_products_it_runs(tmp_path, capsys, monkeypatch, fast):
    """The ceiling was torch.matmul's on float16 tensors, which the CPU runs at about 1 GFLOP/s, while the model's
    linear layers, autocast to float16, multiply through oneDNN at tens of GFLOP/s: MFU read 440-570%. Where oneDNN
    has no float16 products (no AVX-512 FP16 or AMX), the log says that float16 is slow there."""
    import training.runner

    monkeypatch.setattr(training.runner, "cpu_has_fast_float16", lambda: fast)
    import re

    from conftest import tiny_overrides
    from training_runs import call, train_main, write_corpus

    keys = {"train.dtype": "float16", "model.n_embd": 64, "train.batch_size": 32, "train.log_interval": 2}
    code, out, err = call(train_main, tiny_overrides(write_corpus(tmp_path), tmp_path / "out", **keys), capsys)
    assert code == 0, err
    mfu = [float(m) for m in re.findall(r"MFU (\d+\.\d+)%", out)]
    assert mfu and max(mfu) < 100, out
    assert ("note: this CPU has no fast float16 products" in out) is not fast
