"""training.devices: when dtype=auto may take bfloat16 on a CPU."""

from __future__ import annotations

import os
import subprocess
import sys

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


# Run after a real train.py or sample.py in its process: does every thread of torch's pool, two of them, treat denormal
# numbers as zero? One multiply of a million denormals, which torch splits between the two threads.
DENORMALS_LEFT = """
import sys, torch
sys.path.insert(0, {root!r})
import {program}
status = {program}.main({args!r})
torch.set_num_threads(2)
print()  # after any sample text
print(status, int((torch.full((1 << 20,), 1e-39) * 0.5 != 0).sum()))
"""


def denormals_left(program: str, args: list[str], flush: str | None, tmp_path) -> tuple[int, int]:
    """(exit status, how many of a million denormals a 2-thread multiply left non-zero) after program.main(args)."""
    from conftest import ROOT

    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    env.pop("TINYCHAR_FLUSH_DENORMALS", None)
    if flush is not None:
        env["TINYCHAR_FLUSH_DENORMALS"] = flush
    script = DENORMALS_LEFT.format(root=str(ROOT), program=program, args=args)
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    status, left = done.stdout.split()[-2:]
    return int(status), int(left)


@pytest.mark.slow
def test_training_and_sampling_treat_denormal_numbers_as_zero_on_every_thread(tmp_path):
    """flush_denormals, called by train.py and sample.py before torch's pool of threads exists, so that the pool's
    threads copy it; TINYCHAR_FLUSH_DENORMALS=0 keeps IEEE's denormals."""
    from conftest import ROOT, tiny_overrides
    from training_runs import write_corpus

    if not torch.set_flush_denormal(True):  # this process's main thread only: conftest has set it already
        pytest.skip("this CPU has no mode that treats denormal numbers as zero (x86 SSE3 and later have)")
    run = tmp_path / "run"
    train_args = ["--config", str(ROOT / "configs" / "tiny.yaml"), *tiny_overrides(write_corpus(tmp_path), run, **{
        "train.max_iters": 4, "train.eval_interval": 4, "train.threads": 2})]
    assert denormals_left("train", train_args, None, tmp_path) == (0, 0)
    # 40 rows of the 8 x 16 window: more values than sample.py keeps to one thread (SAMPLE_ONE_THREAD_MAX)
    sample_args = ["--out-dir", str(run), "--device", "cpu", "--compile", "false", "--num-samples", "40",
                   "--max-new-tokens", "5"]
    assert denormals_left("sample", sample_args, None, tmp_path) == (0, 0)
    assert denormals_left("sample", sample_args, "0", tmp_path) == (0, 1 << 20)


@pytest.mark.parametrize("program", ["train", "sample"])
def test_a_bad_flush_denormals_setting_is_one_line_before_anything_is_written(program, tmp_path, monkeypatch,
                                                                              capsys):
    from conftest import ROOT
    from test_train import one_error_line
    from training_runs import call, train_main

    import sample

    monkeypatch.setenv("TINYCHAR_FLUSH_DENORMALS", "yes")
    out = tmp_path / "out"
    if program == "train":
        status, _, err = call(train_main, ["--config", str(ROOT / "configs" / "tiny.yaml"), f"out_dir={out}"], capsys)
        assert not out.exists()
    else:
        status, _, err = call(sample.main, ["--out-dir", str(out)], capsys)
    assert status == 2
    assert one_error_line(err) == ("error: TINYCHAR_FLUSH_DENORMALS must be 1 (treat denormal numbers as zero, the "
                                   "default) or 0 (keep them), got 'yes'")
