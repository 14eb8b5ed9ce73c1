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

    # Four steps give two readings, each as steady as the twenty a longer run logs: 25-28% against 380-415% with the
    # ceiling measured by float16 matmul (2026-12-05, 2-core AMD EPYC (Zen 3, AVX2); 0.35 s of CPU against 1.2 s)
    keys = {"train.dtype": "float16", "model.n_embd": 64, "train.batch_size": 32, "train.max_iters": 4,
            "train.log_interval": 2}
    code, out, err = call(train_main, tiny_overrides(write_corpus(tmp_path), tmp_path / "out", **keys), capsys)
    assert code == 0, err
    mfu = [float(m) for m in re.findall(r"MFU (\d+\.\d+)%", out)]
    assert mfu and max(mfu) < 100, out
    assert ("note: this CPU has no fast float16 products" in out) is not fast


def test_a_process_measures_each_ceiling_once_and_again_for_other_threads_dtypes_or_onednn(monkeypatch):
    """Each run's MFU yardstick, measured once a process: the tests train 135 times in two processes, and each
    measurement took 0.22 s of a 0.58 s run. Another thread count, dtype or oneDNN setting is another ceiling."""
    monkeypatch.setattr(devices, "_CEILINGS", {})
    measured = []

    def measure(*args):
        measured.append(args[:2] + args[3:5])  # device, dtype, n, onednn
        return real(*args)

    real = devices._measure_ceiling
    monkeypatch.setattr(devices, "_measure_ceiling", measure)
    cpu, threads = torch.device("cpu"), torch.get_num_threads()
    monkeypatch.setenv("TINYCHAR_ONEDNN", "0")
    first = devices.matmul_ceiling(cpu, torch.float32, seconds=0.01, n=64)
    assert first > 0 and devices.matmul_ceiling(cpu, torch.float32, seconds=0.01, n=64) == first
    assert len(measured) == 1
    devices.matmul_ceiling(cpu, torch.bfloat16, seconds=0.01, n=64)
    monkeypatch.setenv("TINYCHAR_ONEDNN", "1")
    devices.matmul_ceiling(cpu, torch.float32, seconds=0.01, n=64)
    try:
        torch.set_num_threads(threads + 1)
        devices.matmul_ceiling(cpu, torch.float32, seconds=0.01, n=64)
    finally:
        torch.set_num_threads(threads)
    onednn = torch.backends.mkldnn.is_available()  # without it, TINYCHAR_ONEDNN=1 changes nothing: no new ceiling
    expected = [(cpu, torch.float32, 64, False), (cpu, torch.bfloat16, 64, False),
                *([(cpu, torch.float32, 64, True)] if onednn else []), (cpu, torch.float32, 64, onednn)]
    assert measured == expected
    assert devices.matmul_ceiling(cpu, torch.float32, seconds=0.01, n=64) > 0 and len(measured) == len(expected)


# After a real train.py in its process (train.main): how many of a million denormals does a 2-thread multiply leave
# non-zero? torch gives each thread half. The main thread prints what it finds of its own arithmetic too.
DENORMALS_LEFT = """
import sys, torch
sys.path.insert(0, {root!r})
import train
status = train.main({args!r}, progress=False)
torch.set_num_threads(2)
print(status, int((torch.full((1 << 20,), 1e-39) * 0.5 != 0).sum()), sys.float_info.min / 2 > 0)
"""


def denormals_left(args: list[str], flush: str | None, tmp_path) -> tuple[int, int, bool]:
    """(exit status, how many of a million denormals a 2-thread multiply left non-zero, whether Python's floats
    keep them) in a process, after train.main(args)."""
    from conftest import ROOT

    # The pool's second thread sleeps between parallel regions instead of spinning (OpenMP's default): on a machine
    # whose cores are all busy, as in the suite, its spinning doubled or tripled the process's CPU time (2.3-2.6 s
    # passive against 2.6-6.3 s, 2026-12-05, 2-core AMD EPYC (Zen 3, AVX2)). It copies its creator's setting either way.
    env = {**os.environ, "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("TINYCHAR_FLUSH_DENORMALS", None)
    if flush is not None:
        env["TINYCHAR_FLUSH_DENORMALS"] = flush
    script = DENORMALS_LEFT.format(root=str(ROOT), args=args)
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    status, left, kept = done.stdout.split()[-3:]
    return int(status), int(left), kept == "True"


@pytest.mark.slow
def test_training_treats_denormal_numbers_as_zero_on_every_thread_of_torch_and_gives_python_them_back(tmp_path):
    """train.py enters denormals_as_zero before torch makes its pool of threads, whose threads copy the setting and
    keep it; on leaving, the calling thread has IEEE's denormals back (Python's floats, here 2.2e-308 / 2, obey it
    too). TINYCHAR_FLUSH_DENORMALS=0 keeps them everywhere."""
    from conftest import ROOT, tiny_overrides
    from training_runs import write_corpus

    if not torch.set_flush_denormal(False):  # what this process had already
        pytest.skip("this CPU has no mode that treats denormal numbers as zero (x86 SSE3 and later have)")
    args = ["--config", str(ROOT / "configs" / "tiny.yaml"), *tiny_overrides(write_corpus(tmp_path), tmp_path / "run",
            **{"train.max_iters": 4, "train.eval_interval": 4, "train.threads": 2})]
    # The pool's thread flushed its half; the main thread's half is kept, as are Python's floats.
    assert denormals_left(args, None, tmp_path) == (0, 1 << 19, True)
    assert denormals_left([*args, "--overwrite"], "0", tmp_path) == (0, 1 << 20, True)


def test_in_this_process_a_run_leaves_python_its_denormals(tmp_path):
    """As a test or a notebook calls it: after train.main, Python's floats keep their denormals (left flushed, a
    top_p of 5e-324 compared as 0 and the sampler refused it, in a test of tests/test_model_sampler.py run after a
    training test in the same process), and the flag is back as it was."""
    from conftest import tiny_overrides
    from training_runs import train_main, write_corpus

    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU has no mode that treats denormal numbers as zero (x86 SSE3 and later have)")
    run = tmp_path / "run"
    assert devices.subnormals_kept()
    assert train_main(tiny_overrides(write_corpus(tmp_path), run, **{"train.max_iters": 2})) == 0
    assert devices.subnormals_kept() and 5e-324 > 0
    with devices.denormals_as_zero():
        assert not devices.subnormals_kept()
    assert devices.subnormals_kept()


@pytest.mark.parametrize(("variable", "line"), [
    ("TINYCHAR_FLUSH_DENORMALS", "error: TINYCHAR_FLUSH_DENORMALS must be 1 (treat denormal numbers as zero, the "
                                 "default) or 0 (keep them), got 'yes'"),
    ("TINYCHAR_KEEP_MEMORY", "error: TINYCHAR_KEEP_MEMORY must be 1 (keep the memory a training step frees for the "
                             "next, the default) or 0 (give it back to the system as the C library decides), got "
                             "'yes'"),  # training/heap.py
])
def test_a_bad_numerics_setting_is_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys, variable,
                                                                         line):
    from conftest import ROOT
    from test_train import one_error_line
    from training_runs import call, train_main

    monkeypatch.setenv(variable, "yes")
    out = tmp_path / "out"
    status, _, err = call(train_main, ["--config", str(ROOT / "configs" / "tiny.yaml"), f"out_dir={out}"], capsys)
    assert status == 2 and not out.exists()
    assert one_error_line(err) == line


class FakeDeviceGenerator:
    """A GPU's (or Apple GPU's) random state for a machine without one: get/set as torch.cuda and torch.mps have
    them, and a draw that moves it, as a compiled step's dropout drawing its seeds on the device does."""

    def __init__(self) -> None:
        self.state = torch.tensor([7], dtype=torch.uint8)

    def get(self, device: object = None) -> torch.Tensor:
        return self.state.clone()

    def set(self, state: torch.Tensor, device: object = None) -> None:
        self.state = state.clone()

    def draw(self) -> None:
        self.state += 1


@pytest.mark.parametrize("kind", ["cuda", "mps"])
def test_random_kept_puts_back_torchs_stream_and_the_devices_own(monkeypatch, kind):
    """On CUDA a compiled step's dropout takes its seeds from the GPU's generator: a warm-up that put back only the
    CPU's state left a resumed run one draw ahead of a straight one."""
    fake = FakeDeviceGenerator()
    monkeypatch.setattr(getattr(torch, kind), "get_rng_state", fake.get)
    monkeypatch.setattr(getattr(torch, kind), "set_rng_state", fake.set)
    torch.manual_seed(3)
    cpu_before, device_before = torch.get_rng_state(), fake.get()
    with devices.random_kept(torch.device(kind)):
        torch.nn.functional.dropout(torch.ones(100), 0.5)
        fake.draw()
    assert torch.equal(torch.get_rng_state(), cpu_before)
    assert torch.equal(fake.get(), device_before)
    # the helpers a checkpoint takes its per-process state with hold the device's state too
    state = devices.random_state(torch.device(kind))
    fake.draw()
    devices.set_random_state(state, torch.device(kind))
    assert torch.equal(fake.get(), device_before)
