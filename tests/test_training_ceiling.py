"""training.ceiling: MFU's yardstick, the fastest this machine was seen to multiply, kept in the compile cache."""

from __future__ import annotations

import json
import math
import re
import time
import uuid

import pytest
import torch
from conftest import tiny_overrides
from training_runs import call, train_main, write_corpus

from training import ceiling, compile_cache, devices, eager_kernels

CPU = torch.device("cpu")


@pytest.fixture
def readings(monkeypatch):
    """A key of the test's own, and matmul_ceiling replaced by the given readings in turn; returns the kernels each
    measurement was asked to time."""
    key = f"ceiling-test-{uuid.uuid4().hex}"
    monkeypatch.setattr(ceiling, "ceiling_key", lambda device, dtype: key)
    asked: list = []

    def use(*values: float) -> list:
        left = iter(values)

        def measure(device, dtype, seconds=0.3, kernel=None):
            asked.append(kernel)
            return next(left)

        monkeypatch.setattr(ceiling, "matmul_ceiling", measure)
        return asked
    use.key = key
    return use


def test_the_first_runs_measure_and_later_ones_take_the_machines_best(readings):
    """A reading at each start moved with the machine's neighbours (157-199 GFLOP/s in five processes in a row on a
    Zen 4), so the first MEASURED_RUNS runs keep the largest, and later ones take it without measuring (0.2 s)."""
    asked = readings(150e9, 190e9, 170e9)
    got = [ceiling.machine_ceiling(CPU, torch.float32) for _ in range(ceiling.MEASURED_RUNS + 2)]
    assert [flops for flops, _ in got] == [150e9, 190e9, 190e9, 190e9, 190e9]
    assert len(asked) == ceiling.MEASURED_RUNS == 3
    assert got[0][1] == "the best of 1 measurement on this machine"
    assert got[-1][1] == "the best of 3 measurements on this machine"
    assert ceiling.kept_ceiling(CPU, torch.float32) == 190e9


def test_a_run_whose_layers_take_the_kernel_measures_it_and_keeps_the_faster(readings):
    """Where the layers multiply through tinychar's kernel, faster than PyTorch's products, a ceiling of PyTorch's
    alone read below the step's own rate (MFU 117%): a route the kept best has not timed is measured, its runs anew."""
    def kernel(a, b):
        return a

    asked = readings(150e9, 160e9, 155e9, 220e9, 150e9)
    for _ in range(3):
        ceiling.machine_ceiling(CPU, torch.float32)
    flops, words = ceiling.machine_ceiling(CPU, torch.float32, kernel)
    assert flops == 220e9 and words == "the best of 1 measurement on this machine, tinychar's linear kernel among " \
                                       "the products"
    assert asked == [None, None, None, kernel]
    # one yardstick, whatever a run multiplies by, and its words say what it was timed with
    assert ceiling.machine_ceiling(CPU, torch.float32) == (220e9, "the best of 2 measurements on this machine, "
                                                                  "tinychar's linear kernel among the products")
    assert asked[-1] is None and len(asked) == 5


def test_each_device_kind_dtype_and_thread_count_keeps_its_own():
    keys = {ceiling.ceiling_key(torch.device(kind), dtype) for kind in ("cpu", "mps") for dtype in (torch.float32,
                                                                                                   torch.bfloat16)}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        keys.add(ceiling.ceiling_key(CPU, torch.float32))
    finally:
        torch.set_num_threads(threads)
    assert len(keys) == 5 and ceiling.ceiling_key(CPU, torch.float32) in keys


@pytest.mark.parametrize("kept", [{"flops": "x"}, {"flops": -1.0}, {"flops": True}, {"flops": 0},
                                  {"runs": "3"}, {"runs": True}, {"routes": "matmul"}, {"routes": [1, 2]}])
def test_a_damaged_kept_ceiling_is_measured_again(readings, kept):
    entry = {"flops": 300e9, "runs": 3, "routes": ["matmul", "onednn"], **kept}
    compile_cache._marker(readings.key).write_text(json.dumps(entry), encoding="utf-8")
    asked = readings(150e9)
    flops, _ = ceiling.machine_ceiling(CPU, torch.float32)
    assert len(asked) == 1
    assert flops == (300e9 if "flops" not in kept else 150e9)  # a kept best that reads right still counts


def test_a_cache_that_cannot_be_used_costs_each_run_its_measurement(readings, monkeypatch):
    def no_folder(say: bool = False):
        raise compile_cache.NoCacheFolder("no folder for compiled code")

    monkeypatch.setattr(compile_cache, "cache_folder", no_folder)
    asked = readings(150e9, 140e9, 160e9, 130e9)
    assert [ceiling.machine_ceiling(CPU, torch.float32)[0] for _ in range(4)] == [150e9, 140e9, 160e9, 130e9]
    assert len(asked) == 4 and ceiling.kept_ceiling(CPU, torch.float32) is None


def test_a_kernel_takes_turns_with_pytorchs_products_and_the_fastest_is_taken(monkeypatch):
    monkeypatch.setattr(devices, "_CEILINGS", {})
    pytorchs = devices.matmul_ceiling(CPU, torch.float32, seconds=0.02, n=64)
    instant = devices.matmul_ceiling(CPU, torch.float32, seconds=0.02, n=64, kernel=lambda a, b: a)
    assert instant > 5 * pytorchs  # a kernel that returns at once reads as the fastest
    monkeypatch.setattr(devices, "_CEILINGS", {})

    def slow(a, b):
        time.sleep(0.002)
        return a

    # a kernel far slower than PyTorch's products leaves their reading (2 x 64^3 FLOPs in 2 ms: 0.26 GFLOP/s)
    assert devices.matmul_ceiling(CPU, torch.float32, seconds=0.02, n=64, kernel=slow) > 10 * 2 * 64**3 / 0.002


def test_before_the_engine_only_a_step_that_might_take_an_hour_is_measured_for_its_note(readings, monkeypatch):
    """The step note (over an hour a step at the ceiling) needs a ceiling before the engine starts; none is below
    SLOWEST FLOP/s, so for a smaller step none is timed then, and the run measures once, with its layers' products."""
    asked = readings(150e9, 120e9)
    hour = ceiling.SLOWEST * 3600
    assert ceiling.early_ceiling(CPU, torch.float32, hour) == math.inf and asked == []
    assert ceiling.early_ceiling(CPU, torch.float32, 1.01 * hour) == 150e9 and len(asked) == 1
    assert ceiling.kept_ceiling(CPU, torch.float32) is None  # the note's reading is not kept: the yardstick's is
    ceiling.machine_ceiling(CPU, torch.float32, lambda a, b: a)
    assert ceiling.early_ceiling(CPU, torch.float32, 1e30) == 120e9 == ceiling.kept_ceiling(CPU, torch.float32)
    assert len(asked) == 2


def test_a_run_says_its_ceiling_once_its_engine_has_given_the_layers_their_products(tmp_path, capsys, monkeypatch,
                                                                                    readings):
    """The line comes after the engine's: an eager run with tinychar's linear kernel (TINYCHAR_GEMM=1, its layers 16
    wide) times the kernel too, and keeps it with the machine's best; a run after the kept best is settled measures
    nothing, and its MFU is against that best."""
    monkeypatch.setattr(eager_kernels, "MIN_STEPS", 10)
    monkeypatch.setattr(eager_kernels, "EAGER_MIN_MACS", 0)
    monkeypatch.setenv("TINYCHAR_GEMM", "1")
    monkeypatch.setenv("TINYCHAR_WARM_CACHE", "0")
    asked = readings(*[1e9] * ceiling.MEASURED_RUNS)
    corpus = write_corpus(tmp_path)
    for run in range(ceiling.MEASURED_RUNS + 1):
        args = tiny_overrides(corpus, tmp_path / f"out{run}", **{"train.compile": "auto", "train.sample_chars": 0})
        code, out, err = call(train_main, args, capsys)
        assert code == 0, err
        lines = out.splitlines()
        engine = max(i for i, line in enumerate(lines) if line.startswith("engine: eager"))
        said = [i for i, line in enumerate(lines) if line.startswith("matrix-multiply ceiling")]
        assert "tinychar's kernels for" in lines[engine] and "linear" in lines[engine]
        assert len(said) == 1 and said[0] > engine
        runs = min(run + 1, ceiling.MEASURED_RUNS)
        assert lines[said[0]].startswith(f"matrix-multiply ceiling 1 GFLOP/s (float32; the best of {runs} "
                                         f"measurement{'s' if runs > 1 else ''} on this machine, tinychar's linear "
                                         f"kernel among the products), ")
        mfu = [float(m) for m in re.findall(r"MFU (\d+\.\d+)%", out)]
        tokens = [float(t.replace(",", "")) for t in re.findall(r"([\d,]+) tokens/s", out)]
        flops = float(re.search(r"([\d,]+) kFLOP per trained token", out)[1].replace(",", "")) * 1e3
        # MFU against the 1 GFLOP/s kept (the kFLOP are rounded: 5%)
        assert mfu and all(m == pytest.approx(100 * t * flops / 1e9, rel=0.05, abs=0.06)
                           for m, t in zip(mfu, tokens, strict=True))
    assert len(asked) == ceiling.MEASURED_RUNS and all(kernel is not None for kernel in asked)
