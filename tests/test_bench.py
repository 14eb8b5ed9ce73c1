"""bench.py's own reading, arithmetic and output: the parts that need neither nanoGPT nor a measurement."""

from __future__ import annotations

import argparse
import builtins
import errno
import json
import math
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

import bench
import training.atomic
from benchmark.products import VOCAB, products_ms, step_products
from benchmark.quality import (
    NANOGPT_BLOCK8_RUN,
    gpu_quality_rows,
    nanogpt_best,
    nanogpt_final,
    nanogpt_flags,
    race,
    shortened,
)
from benchmark.report import is_bench_result, json_problem, markdown, write_json
from benchmark.runs import (
    FULL,
    NANOGPT_FILES,
    NANOGPT_MARKS,
    QUICK,
    SAMPLE_SHAPES,
    STEP_SHAPES,
    Run,
    Shape,
    cpu_info,
    launch,
    parse_eval,
    parse_steps_taken,
    per_unit,
    usable_flags,
)
from benchmark.speed import compare, step_rows
from configs.userinput import shown
from model import GPT, GPTConfig
from training.config import THREADS_PER_CORE, cores_here, load_config

BUILTIN_PRINT = builtins.print

ROOT = Path(__file__).resolve().parents[1]


def test_evaluation_lines_of_both_programs_are_read_and_nothing_else():
    assert parse_eval("step 325: train loss 1.9012, val loss 1.9321 (best)\n") == (325, 1.9321)  # tinychar
    assert parse_eval("step 2000: train loss 1.7601, val loss 1.8823\n") == (2000, 1.8823)  # nanoGPT
    for other in ("step 20/1300: loss 3.5373, lr 2.38e-03, 4,801 tokens/s, MFU 1.7%",  # tinychar's log line
                  "iter 5: loss 4.1828, time 76.72ms, mfu -100.00%",  # nanoGPT's
                  "done: step 1300, val loss 1.9300 (best 1.9300) in 30.1s; sample with: ...",
                  "saving checkpoint to out"):
        assert parse_eval(other) is None


def test_step_lines_of_both_programs_count_the_steps_taken_and_nothing_else_does():
    assert parse_steps_taken("step 20/1300: loss 3.5373, lr 2.38e-03, 4,801 tokens/s, MFU 1.7%\n") == 20  # tinychar
    assert parse_steps_taken("iter 20: loss 4.1828, time 76.72ms, mfu -100.00%\n") == 21  # nanoGPT counts from 0
    for other in ("step 325: train loss 1.9012, val loss 1.9321 (best)", "step 2000: train loss 1.7601, val loss 1.8",
                  "done: step 1300, val loss 1.9300 (best 1.9300) in 30.1s; sample with: ...", "iter 5 of 10",
                  "engine: compiled in 3.1 s (compile cache: /c)"):
        assert parse_steps_taken(other) is None


@pytest.mark.slow
def test_a_real_tinychar_run_as_the_step_rows_start_it_logs_the_steps_they_time(tmp_path):
    args = [*STEP_SHAPES["block8"].tinychar(6, 2), "train.dtype=float32", "train.compile=false", "train.threads=1",
            f"out_dir={tmp_path / 'out'}"]
    run = launch([sys.executable, "-u", str(ROOT / "train.py"), *args], ROOT, dict(os.environ))
    assert [n for _, n in run.marks] == [2, 4, 6]
    assert [step for _, step, _ in run.evals] == [6]  # the one evaluation, after the last step line
    assert run.marks[-1][0] <= run.evals[0][0] and 0 < run.seconds_per_step(2) < 1.0


def test_a_runs_steps_are_timed_between_its_step_lines_past_the_first_count():
    # start-up, compiling and the first steps before the line at 100 steps; the closing evaluation after the last
    run = Run(30.0, [], marks=[(5.0, 1), (9.0, 100), (9.4, 200), (13.0, 1100)])
    assert run.seconds_per_step(100) == pytest.approx(0.004)
    assert run.seconds_per_step(101) == pytest.approx(3.6 / 900)
    for short in (Run(30.0, [], marks=[(9.0, 100)]), Run(30.0, [], marks=[(9.0, 100), (9.0, 100)]), Run(1.0, [])):
        assert math.isnan(short.seconds_per_step(100))  # a run cut short, or one that logged no steps: no figure


def test_differencing_cancels_what_both_runs_share():
    # 2 s of start-up in each, then 100 and 1100 steps of 4 ms
    assert per_unit(2.0 + 0.4, 2.0 + 4.4, 100, 1100) == pytest.approx(0.004)
    assert math.isnan(per_unit(5.0, 4.9, 100, 1100))  # noise larger than the difference: no figure


def test_ratio_is_nanogpt_time_over_tinychar_time_with_per_round_spread():
    steps = compare("step", "ms/step", [4.0, 5.0, 6.0], [2.0, 2.0, 3.0])
    assert (steps["nanogpt"], steps["tinychar"], steps["ratio"]) == (5.0, 2.0, 2.5)
    assert steps["spread"] == [2.0, 2.5]
    rate = compare("sampling", "chars/s", [500.0, 600.0], [1000.0, 1800.0])  # a rate: tinychar's over nanoGPT's
    assert rate["ratio"] == pytest.approx(1400 / 550)
    assert rate["spread"] == [2.0, 3.0]
    lost = compare("step", "ms/step", [math.nan], [2.0])
    assert math.isnan(lost["ratio"]) and lost["spread"] is None
    assert compare("step", "ms/step", [4.0, math.nan], [2.0, 1.0])["spread"] is None  # one usable round


def test_cpu_model_and_relevant_flags_from_proc_cpuinfo():
    text = ("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512vl\n\n"
            "processor\t: 1\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu\n")
    assert cpu_info(text) == ("AMD EPYC 9R14", ["avx2", "avx512f", "avx512_bf16"])
    # family and model tell apart CPUs of one name (a Zen 4 and a Zen 5 EPYC both read "AMD EPYC")
    text = "vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\nflags\t\t: avx2\n"
    assert cpu_info(text) == ("AMD EPYC, family 25 model 17", ["avx2"])
    name, flags = cpu_info("")  # no /proc/cpuinfo (macOS): the platform's name, no flags
    assert name and flags == []


def test_table_has_header_rows_and_says_when_tinychar_missed_the_target():
    speed = compare("train step, block 8", "ms/step", [4.0, 4.2], [2.0, 2.0])
    missed = {"label": "launch to val <= 1.9300", "unit": "s", "nanogpt": 41.25, "tinychar": math.nan,
              "ratio": math.nan, "spread": None, "target": 1.93, "tinychar_best": 1.95}
    report = {"date": "2025-01-02", "cpu": "AMD EPYC", "cpu_flags": ["avx2"], "cores": 2, "torch": "2.13.0",
              "threads": 2, "rounds": 2, "matmul_gflops": {"float32": 75.4, "bfloat16": 239.0}, "rows": [speed, missed]}
    lines = markdown(report).splitlines()
    assert lines[0] == "tinychar vs nanoGPT, 2025-01-02: AMD EPYC (avx2), 2 cores, torch 2.13.0, 2 threads, rounds: 2"
    assert "float32 75 GFLOP/s, bfloat16 239 GFLOP/s" in lines[2]
    assert "| train step, block 8 | ms/step | 4.10 | 2.00 | 2.05x | 2.00-2.10x |" in lines
    assert "| launch to val <= 1.9300 | s | 41.2 | not reached (best 1.9500) | n/a | - |" in lines
    assert not any("linear products" in line for line in lines)  # a report without them (older JSON) has no line
    assert not any("engine" in line for line in lines)  # nor one without the races' engines
    report["products"] = {"block8": {"label": "block 8, batch 32, 3L/4H/32", "ms": 0.512, "bound": 3.4567}}
    assert markdown(report).splitlines()[4] == (
        "Float32 linear products of one training step, each timed alone through PyTorch's default BLAS, and nanoGPT's "
        "float32 step over them, the most a step on that BLAS can gain on it: block 8, batch 32, 3L/4H/32 0.51 ms "
        "(3.46x).")
    del report["products"]
    # where tinychar's linear layers may multiply through oneDNN, its ceiling is in the header too
    report["matmul_gflops"]["float32_onednn"] = 440.4
    assert markdown(report).splitlines()[2] == ("Matmul ceiling (1024x1024): float32 75 GFLOP/s, bfloat16 239 "
                                                      "GFLOP/s; float32 through oneDNN 440 GFLOP/s.")


@pytest.mark.parametrize("name", sorted(STEP_SHAPES))
def test_a_steps_products_are_its_linear_layers_three_times_over(name):
    """Forward, input gradient and weight gradient of every linear layer: 6 FLOPs per weight per position, the
    model's own count less attention's scores and sums."""
    shape = STEP_SHAPES[name]
    cfg = GPTConfig(block_size=shape.block_size, vocab_size=VOCAB, n_layer=shape.n_layer, n_head=shape.n_head,
                    n_embd=shape.n_embd, bias=shape.bias)
    rows = shape.batch_size * shape.block_size
    attention = 12 * shape.n_layer * shape.block_size * shape.n_embd
    products = sum(2 * m * k * n for m, k, n in step_products(shape))
    assert products == (GPT(cfg).flops_per_token() - attention) * rows
    assert len(step_products(shape)) == 3 * (4 * shape.n_layer + 1)
    small = Shape(shape.config, 4, 2, 1, 1, 8, False)
    assert 0 < products_ms(small, threads=1, seconds=0.001) < 1e3


def test_isa_avx2_hides_avx512_from_the_flags_and_says_so_in_the_header():
    flags = ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]
    assert usable_flags(flags, "native") == flags
    assert usable_flags(flags, "avx2") == ["avx2"]  # so no bfloat16 rows either
    report = {"date": "2025-01-02", "cpu": "AMD EPYC", "cpu_flags": ["avx2"], "isa": "avx2", "cores": 2,
              "torch": "2.13.0", "threads": 2, "rounds": 2, "rows": []}
    assert markdown(report).splitlines()[0].endswith(
        "rounds: 2; limited to AVX2 (ATEN_CPU_CAPABILITY=avx2, MKL_ENABLE_INSTRUCTIONS=AVX2, ONEDNN_MAX_CPU_ISA=AVX2)")


def test_nanogpt_is_told_tiny_yaml_in_the_types_its_configurator_demands():
    cfg = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text(encoding="utf-8"))
    assert NANOGPT_BLOCK8_RUN["model"] == {k: cfg["model"][k] for k in NANOGPT_BLOCK8_RUN["model"]}
    flags = dict(flag.removeprefix("--").split("=") for flag in nanogpt_flags(cfg))
    model, train = cfg["model"], cfg["train"]
    assert flags["block_size"] == str(model["block_size"]) and flags["n_embd"] == str(model["n_embd"])
    assert flags["bias"] == str(bool(model["bias"]))  # True/False, which nanoGPT's literal_eval reads as a bool
    assert float(flags["learning_rate"]) == float(train["learning_rate"]) and "." in flags["learning_rate"]
    assert flags["lr_decay_iters"] == str(train.get("lr_decay_iters") or train["max_iters"])


def test_quick_quality_runs_are_shortened_alike_for_both_programs():
    assert shortened(None, "--{}={}") == []
    assert shortened(20, "--{}={}") == ["--max_iters=20", "--lr_decay_iters=20", "--eval_interval=10",
                                              "--warmup_iters=2"]
    assert shortened(1, "train.{}={}") == ["train.max_iters=1", "train.lr_decay_iters=1", "train.eval_interval=1",
                                                 "train.warmup_iters=0"]


# Each shape the bench runs, once: the sampling rows' block64 is the training rows' own (it ran twice, as shape1 and
# shape3, testing the same thing)
BENCH_SHAPES = {shape: f"{kind} {name}" for kind, shapes in (("sample", SAMPLE_SHAPES), ("step", STEP_SHAPES))
                for name, shape in shapes.items()}


@pytest.mark.parametrize("shape", list(BENCH_SHAPES), ids=list(BENCH_SHAPES.values()))
def test_overrides_given_to_tinychar_are_keys_it_knows(shape: Shape):
    args = shape.tinychar(10)
    assert args[:2] == ["--config", shape.config]
    cfg = load_config(str(ROOT / shape.config), [*args[2:], "train.threads=2", "out_dir=unused"])
    assert (cfg.model.block_size, cfg.model.n_embd, cfg.train.batch_size) == (shape.block_size, shape.n_embd,
                                                                               shape.batch_size)
    assert (cfg.train.max_iters, cfg.train.eval_interval, cfg.train.eval_iters) == (10, 10, 1)
    assert cfg.train.optimizer == "adamw"  # nanoGPT's: a step does the same work in both programs


def nanogpt_checkout(folder: Path, marked: bool = True) -> Path:
    """A folder that passes for a nanoGPT checkout: its files, empty but for the lines that tell nanoGPT's (marked)."""
    for name in NANOGPT_FILES:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(NANOGPT_MARKS.get(name, b"") + b"\n" if marked else b"")
    return folder


def test_without_a_nanogpt_checkout_one_line_and_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert bench.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "git clone https://github.com/karpathy/nanoGPT" in err
    assert bench.main(["--nanogpt", str(tmp_path / "missing")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert bench.main(["--nanogpt", str(tmp_path)]) == 2
    assert "is not a nanoGPT checkout" in capsys.readouterr().err
    # nanoGPT's file names alone (empty files, another program's) passed, and processes doing nothing were timed
    empty = nanogpt_checkout(tmp_path / "empty", marked=False)
    assert bench.main(["--nanogpt", str(empty)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a nanoGPT checkout (its model.py is not nanoGPT's" in err
    (empty / "model.py").write_text("class GPT(nn.Module):\n", encoding="utf-8")
    assert bench.main(["--nanogpt", str(empty)]) == 2
    assert "(its train.py is not nanoGPT's" in capsys.readouterr().err
    # a newline in the folder's name split the line; a name too long for the system was a traceback
    for folder, says in ((tmp_path / "new\nline", "no such folder"), (tmp_path / ("x" * 300), "File name too long")):
        assert bench.main(["--nanogpt", str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err and len(err) < 300
    with pytest.raises(SystemExit) as exited:
        bench.main(["--nanogpt", str(tmp_path), "--threads", "0"])
    assert exited.value.code == 2 and capsys.readouterr().err.count("\n") == 1
    # measured only after a checkout is copied, or written at the end of the run: a traceback there
    # above train.py's train.threads limit: refused by train.py after the ceilings and nanoGPT's warm-up, status 1
    too_many = THREADS_PER_CORE * cores_here() + 1
    for extra, says in ((["--threads", str(10**20)], "--threads must be from 1 to"),
                        (["--threads", str(too_many)], f"--threads {too_many} is more than {THREADS_PER_CORE} threads"),
                        (["--threads", "9" * 4000], "got 9.999e+3999 (see"), (["--rounds", "-" + "9" * 4000],
                                                                             "--rounds must be >= 1, got -9.999e+3999"),
                        (["--json", str(tmp_path)], "is a folder"), (["--json", ""], "is empty"),
                        (["--json", str(tmp_path / ("x" * 300 + ".json"))], "File name too long")):
        with pytest.raises(SystemExit) as exited:
            bench.main(["--nanogpt", str(tmp_path), *extra])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.count("\n") == 1 and says in err and "99999" not in err


@pytest.mark.parametrize("variable", ["TINYCHAR_ONEDNN", "TINYCHAR_GEMM", "TINYCHAR_SPLIT_STEP"])
def test_a_bad_multiply_setting_is_one_line_before_anything_runs(tmp_path: Path, capsys, monkeypatch, variable):
    # read first by the matmul ceilings (TINYCHAR_ONEDNN) or the compiled step (TINYCHAR_GEMM, _SPLIT_STEP), once the
    # run had begun: a ValueError traceback
    nanogpt_checkout(tmp_path)
    monkeypatch.setenv(variable, "garbage")
    monkeypatch.setattr(bench, "measure", lambda *a: pytest.fail(f"measured with a bad {variable}"))
    assert bench.main(["--nanogpt", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {variable} must be one of auto, 0, 1")


def test_a_json_file_that_cannot_be_written_is_one_line_beside_the_table(tmp_path: Path, capsys, monkeypatch):
    # refused before anything runs where the folder cannot be written; a disk that fills up is found only at the end,
    # where it was a traceback after the whole run
    checkout = str(nanogpt_checkout(tmp_path))
    monkeypatch.setattr(bench, "measure", lambda *a: pytest.fail("measured with a --json that cannot be written"))
    with monkeypatch.context() as read_only:
        read_only.setattr(bench.os, "access", lambda path, mode: False)
        with pytest.raises(SystemExit) as exited:
            bench.main(["--nanogpt", checkout, "--json", str(tmp_path / "bench.json")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and "cannot be written there" in err
    monkeypatch.setattr(bench, "measure", lambda *a: {"cpu_flags": [], "rows": [], "new": True})
    monkeypatch.setattr(bench, "markdown", lambda report: "| the table |")
    earlier = tmp_path / "bench.json"
    earlier.write_text('{"cpu_flags": ["avx2"], "rows": [], "earlier": true}\n', encoding="utf-8")

    def full_disk(fd: int) -> None:  # the new file's bytes reach the disk only here
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as full:
        full.setattr(training.atomic.os, "fsync", full_disk)
        assert bench.main(["--nanogpt", checkout, "--json", str(earlier)]) == 1
    out, err = capsys.readouterr()
    assert out == "| the table |\n" and err.count("\n") == 1
    assert err.startswith("error: cannot write --json") and "(No space left on device)" in err
    # the earlier result was written over in place, so a full disk lost it too; now it stays whole, with no part beside
    assert json.loads(earlier.read_text(encoding="utf-8"))["earlier"] is True
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert bench.main(["--nanogpt", checkout, "--json", str(earlier)]) == 0  # an earlier result is replaced
    assert json.loads(earlier.read_text(encoding="utf-8")) == {"cpu_flags": [], "rows": [], "new": True}


def test_a_stdout_that_fails_at_the_end_loses_no_json(tmp_path: Path, capsys, monkeypatch):
    # `> /dev/full` or `| true`: the table was printed first, its OSError was a traceback, and the JSON never written
    checkout = str(nanogpt_checkout(tmp_path))
    monkeypatch.setattr(bench, "measure", lambda *a: {"cpu_flags": [], "rows": [], "new": True})
    monkeypatch.setattr(bench, "markdown", lambda report: "| the table |")
    monkeypatch.setattr(bench, "discard_stdout", lambda: None)
    for error, status in ((OSError(errno.ENOSPC, "No space left on device"), 1), (BrokenPipeError(), 0)):
        def failing_print(*args, error=error, **kwargs):
            if kwargs.get("file") is None:
                raise error
            BUILTIN_PRINT(*args, **kwargs)

        result = tmp_path / f"r{status}.json"
        monkeypatch.setattr(builtins, "print", failing_print)
        try:
            assert bench.main(["--nanogpt", checkout, "--json", str(result)]) == status
        finally:
            monkeypatch.setattr(builtins, "print", BUILTIN_PRINT)
        assert json.loads(result.read_text(encoding="utf-8"))["new"] is True
        err = capsys.readouterr().err
        assert err == ("" if status == 0 else "error: cannot write the table to stdout (No space left on device); "
                       f"the results are in '{shown(result)}'\n")


def test_json_through_links_in_a_loop_is_one_line(tmp_path: Path, capsys):
    (tmp_path / "loop").symlink_to("loop")
    assert json_problem(str(tmp_path / "loop")) == (f"cannot use '{tmp_path / 'loop'}' (its links go round in a "
                                                    "loop); give another file name")


@pytest.mark.parametrize("held", ["notes\n", '{"rows": []}', "[1, 2]", "[" * 100_000, "\udcff",
                                  '{"cpu_flags": [], "rows": ["' + "x" * (2 << 20) + '"]}'],
                         ids=["text", "other JSON", "a JSON list", "nested past the limit", "not UTF-8", "large"])
def test_json_refuses_before_anything_runs_to_replace_a_file_that_is_no_earlier_result(tmp_path, capsys, monkeypatch,
                                                                                        held):
    """--json replaced whatever file it named, at the end of a half-hour run: a README, another program's results."""
    monkeypatch.setattr(bench, "measure", lambda *a: pytest.fail("measured with a --json that holds something else"))
    kept = tmp_path / "notes.md"
    kept.write_bytes(held.encode("utf-8", "surrogateescape"))
    with pytest.raises(SystemExit) as exited:
        bench.main(["--nanogpt", str(nanogpt_checkout(tmp_path)), "--json", str(kept)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and len(err) < 400
    assert "holds something other than an earlier bench.py result" in err and "give a new file name" in err
    assert kept.read_bytes() == held.encode("utf-8", "surrogateescape")


def test_json_to_a_device_is_written_into_not_replaced(tmp_path, capsys, monkeypatch):
    """/dev/stdout is a link to a pipe or a terminal: renamed over, it would have been a regular file in /dev."""
    monkeypatch.setattr(bench, "measure", lambda *a: {"cpu_flags": [], "rows": []})
    monkeypatch.setattr(bench, "markdown", lambda report: "| the table |")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    assert bench.main(["--nanogpt", str(nanogpt_checkout(tmp_path)), "--json", str(fifo)]) == 0
    reader.join(timeout=30)
    assert json.loads(got[0]) == {"cpu_flags": [], "rows": []} and stat.S_ISFIFO(fifo.stat().st_mode)


def test_the_real_command_refuses_without_a_traceback(tmp_path: Path):
    done = subprocess.run([sys.executable, str(ROOT / "bench.py")], capture_output=True, text=True, cwd=tmp_path,
                          timeout=60, check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: --nanogpt DIR is required") and "Traceback" not in done.stderr


# Each of the two places bench.py loads torch (main's, and --gpu's, which looks for CUDA among the options) with one
# of the two values: both load it through load_torch, whose start_or_status handles each value the same whichever
# place calls it; each run is an import of torch (1.5 s of CPU), and the whole matrix of four was 6.4 s.
@pytest.mark.parametrize(("logs", "gpu"), [("POSIX", []), ("help", ["--gpu"])], ids=["POSIX-cpu", "help-gpu"])
def test_a_torch_logs_torch_will_not_load_under_is_one_line_or_its_list(tmp_path: Path, logs: str, gpu: list[str]):
    # torch reads TORCH_LOGS as it loads: a value naming no log of torch's, and help (its list of logs, raised as an
    # error), were a traceback from inside torch's import and status 1, as they were for train.py
    (tmp_path / "nanoGPT").mkdir()
    checkout = nanogpt_checkout(tmp_path / "nanoGPT")
    done = subprocess.run([sys.executable, str(ROOT / "bench.py"), "--nanogpt", str(checkout), "--quick", *gpu],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False,
                          env={**os.environ, "TORCH_LOGS": logs})
    if logs == "help":
        assert done.returncode == 0 and done.stderr == ""
        assert done.stdout.startswith("TORCH_LOGS Info\n")
    else:
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr == ("error: TORCH_LOGS 'POSIX' is not a list of torch's logs; give comma-separated names "
                               "(dynamo,+inductor; TORCH_LOGS=help lists them) or unset it\n")
    assert [p.name for p in tmp_path.iterdir()] == ["nanoGPT"]  # nothing written


def test_a_closed_stdout_without_json_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    """`python bench.py --nanogpt DIR >&-` ran the whole benchmark (half an hour) and printed its table nowhere."""
    monkeypatch.setattr(bench, "measure", lambda *args: pytest.fail("measured with nowhere to print"))
    monkeypatch.setattr(sys, "stdout", None)
    assert bench.main(["--nanogpt", str(nanogpt_checkout(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: stdout is closed") and "--json FILE" in err


class FakePrograms:
    """Programs that replay recorded runs: nanoGPT's evaluations, slower each round by `drift`, and tinychar reaching
    val `reach` at `seconds`."""

    def __init__(self, drift: float) -> None:
        self.drift, self.nano_runs, self.tiny_runs, self.count = drift, 0, [], 0

    def fresh(self, name: str) -> Path:
        self.count += 1
        return Path(f"/nonexistent/{name}{self.count}")

    def nanogpt(self, script: str, args: list[str]) -> Run:
        slow = 1 + self.drift * self.nano_runs
        self.nano_runs += 1
        return Run(50 * slow, [(10 * slow, 0, 4.2), (30 * slow, 650, 1.98), (50 * slow, 1300, 1.95)])

    def tinychar(self, script: str, args: list[str], cache: Path, stop_at: float) -> Run:
        self.tiny_runs.append((args, stop_at))
        engine = "eager" if len(self.tiny_runs) % 2 else "compiled"  # as auto: eager from empty caches, then compiled
        return Run(20.0, [(10.0, 400, 1.97), (20.0, 800, stop_at - 0.01)], engine)


def test_time_to_quality_alternates_the_programs_and_times_nanogpt_to_its_first_target_every_round():
    fake = FakePrograms(drift=0.5)
    rows = race(fake, "test", ["--x"], [(nanogpt_best, "best (step {step})")],
                      [("configs/tiny.yaml", [], ""), ("configs/tiny.yaml", ["train.dtype=float32"], ", float32")],
                      None, rounds=3)
    assert fake.nano_runs == 3 and len(fake.tiny_runs) == 3 * 2 * 2  # each round: nanoGPT, then two runs of each
    assert all(stop == 1.95 for _, stop in fake.tiny_runs)  # the first round's target, every round
    assert [r["label"] for r in rows] == [
        "launch to val <= 1.9500, best (step 1300); tinychar empty caches",
        "launch to val <= 1.9500, best (step 1300); tinychar repeated run",
        "launch to val <= 1.9500, best (step 1300), float32; tinychar empty caches",
        "launch to val <= 1.9500, best (step 1300), float32; tinychar repeated run"]
    row = rows[0]
    assert row["rounds"]["nanogpt"] == [50.0, 75.0, 100.0]  # each round's own time to the target
    assert row["nanogpt"] == 75.0 and row["tinychar"] == 20.0 and row["ratio"] == 3.75
    assert row["spread"] == [2.5, 5.0]
    assert row["target"] == 1.95 and row["tinychar_best"] == pytest.approx(1.94)
    # what each run trained with, round by round, under the table
    assert [(r["runs"], r["tinychar_engines"]) for r in rows] == [
        ("tiny.yaml, empty caches", ["eager"] * 3), ("tiny.yaml, repeated run", ["compiled"] * 3),
        ("tiny.yaml, float32, empty caches", ["eager"] * 3), ("tiny.yaml, float32, repeated run", ["compiled"] * 3)]
    report = {"date": "2026-12-02", "cpu": "Intel Xeon", "cpu_flags": ["avx2"], "cores": 2, "torch": "2.13.0",
              "threads": 2, "rounds": 3, "rows": rows}
    assert ("tinychar's engine in the races' runs, round by round, as train.py said: tiny.yaml, empty caches: eager "
            "in all 3; tiny.yaml, repeated run: compiled in all 3; tiny.yaml, float32, empty caches: eager in all 3; "
            "tiny.yaml, float32, repeated run: compiled in all 3.") in markdown(report).splitlines()
    rows[1]["tinychar_engines"] = ["eager", "compiled", "unknown"]  # rounds that differ are listed one by one
    assert "tiny.yaml, repeated run: eager, compiled, unknown;" in markdown(report)


def test_a_launch_reads_which_engine_a_tinychar_run_settled_on(tmp_path):
    """The engine lines of tinychar's train.py (training/engine.py; tests/test_training_engine.py checks these words
    against real runs' output): the last one that settles it counts; nanoGPT prints none."""
    cases = {
        "compiled": ["engine: compiling the training step (train.compile=true; 15-60 s)",
                     "engine: compiled in 3.1 s (compile cache: /c)"],
        "compiled block by block": ["engine: compiling the model block by block (torchrun)",
                                    "engine: model compiled block by block (torchrun; compiled in 9.0 s)"],
        "eager": ["engine: eager (train.compile=auto, but the compile cache is cold)",
                  "engine: once this run ends, a helper compiles its step into the cache at the lowest priority"],
        None: ["iter 0: loss 4.2, time 10.0ms"],
    }
    cases["eager, the compile having failed"] = ["engine: compiling the training step (train.compile=true; 15-60 s)",
                                                 "engine: cannot compile here (RuntimeError: x); training without "
                                                 "compiling"]
    for want, lines in cases.items():
        script = f"for line in {[*lines, 'step 0: train loss 4.2000, val loss 4.1000']!r}: print(line)"
        run = launch([sys.executable, "-c", script], tmp_path, dict(os.environ))
        assert run.engine == (want and want.split(",")[0]) and run.evals[0][1:] == (0, 4.1), want


def test_the_gpu_rows_race_nanogpts_gpu_recipe_against_the_baby_gpt_compiled_and_eager(monkeypatch):
    fake = FakePrograms(drift=0.0)
    nano_args: list[list[str]] = []
    real = fake.nanogpt
    monkeypatch.setattr(fake, "nanogpt", lambda script, args: nano_args.append(args) or real(script, args))
    rows = gpu_quality_rows(fake, None)
    assert nano_args == [["config/train_shakespeare_char.py", "--always_save_checkpoint=False", "--wandb_log=False"]]
    assert not any(a.startswith(("--device", "--compile", "--dtype")) for a in nano_args[0])  # its GPU defaults
    runs = [args for args, _ in fake.tiny_runs]
    assert len(runs) == 4 and all(args[:3] == ["--config", "configs/shakespeare_char.yaml", "train.device=cuda"]
                                  for args in runs)
    assert [args[3:] for args in runs] == [[], [], ["train.compile=false"], ["train.compile=false"]]
    assert all(stop == 1.95 for _, stop in fake.tiny_runs)  # the runs stop at the lower of the two targets
    where = "on its baby GPT, block 256, on the GPU"
    best = f"launch to val <= 1.9500, nanoGPT's best (step 1300) {where}"
    near = f"launch to val <= 1.9800, nanoGPT's first within 2% of its best (step 650) {where}"
    assert [r["label"] for r in rows] == [
        f"{target}{eager}; tinychar {when}" for target in (best, near)
        for eager in ("", ", tinychar eager (train.compile=false)") for when in ("empty caches", "repeated run")]
    assert [r["tinychar"] for r in rows] == [20.0] * 4 + [10.0] * 4  # each target read from the same runs
    assert [r["nanogpt"] for r in rows] == [50.0] * 4 + [30.0] * 4
    assert all(r["tinychar_best"] == pytest.approx(1.94) for r in rows)
    assert [r["runs"] for r in rows[:4]] == [  # as the line under the table names them
        f"shakespeare_char.yaml{eager}, {when}" for eager in ("", " eager (train.compile=false)")
        for when in ("empty caches", "repeated run")]
    report = {"date": "2026-11-26", "cpu": "AMD EPYC", "cpu_flags": ["avx2"], "cores": 16, "torch": "2.11.0+cu130",
              "threads": 16, "rounds": 1, "gpu": "NVIDIA H200", "rows": rows}
    table = markdown(report)
    assert table.splitlines()[0].endswith("rounds: 1; GPU: NVIDIA H200")
    assert "compile=True, bfloat16" in table and "compile=False, as its README's CPU command" not in table


def test_gpu_mode_runs_one_round_unless_told_and_its_header_says_how_many(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H100")
    monkeypatch.setattr(bench, "Programs", lambda *args: FakePrograms(drift=0.0))
    for given, rounds in ((None, 1), (2, 2)):
        args = argparse.Namespace(gpu=True, rounds=given, isa="native", quick=False, threads=16, nanogpt=str(tmp_path))
        report = bench.measure(args, FULL, tmp_path)
        assert report["rounds"] == rounds
        assert all(len(row["rounds"]["nanogpt"]) == rounds for row in report["rows"])
        assert f"rounds: {rounds}; GPU: NVIDIA H100" in markdown(report).splitlines()[0]


def test_gpu_mode_needs_a_cuda_gpu_and_says_so_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exited:
        bench.main(["--nanogpt", str(tmp_path), "--gpu"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and "--gpu needs a CUDA GPU" in err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for extra, says in ((["--skip-quality"], "which --skip-quality leaves out"), (["--isa", "avx2"], "--isa limits")):
        with pytest.raises(SystemExit) as exited:
            bench.main(["--nanogpt", str(tmp_path), "--gpu", *extra])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.count("\n") == 1 and says in err


SECONDS_PER_STEP = {"nanoGPT": 0.005, "eager": 0.004, "compiled": 0.002}


class StepPrograms:
    """Programs whose train.py takes `start` seconds to start (a compiled one: plus a compile from the cache that
    alternates between 2 and 4 s), then a fixed time per step, its first ten steps three times as long, and 1.5 s to
    evaluate at the end; each logs its steps as it was told (nanoGPT: `iter N` at N % log_interval == 0, after N + 1
    steps, N from 0 to max_iters; tinychar: `step N/M` at N % log_interval == 0, after N steps). Records each run's
    steps and logging interval."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, int, int]] = []

    def nanogpt(self, script: str, args: list[str]) -> Run:
        flags = dict(a.removeprefix("--").split("=", 1) for a in args if a.startswith("--"))
        iters, every = int(flags["max_iters"]), int(flags["log_interval"])
        return self.run("nanoGPT", iters + 1, every, 1.0, [n + 1 for n in range(0, iters + 1, every)])

    def tinychar(self, script: str, args: list[str]) -> Run:
        flags = dict(a.split("=", 1) for a in args if a.startswith("train."))
        steps, every = int(flags["train.max_iters"]), int(flags["train.log_interval"])
        logged = [n for n in range(1, steps + 1) if n % every == 0 or n == steps]
        if "train.compile=true" in args:
            compiles = sum(who == "compiled" for who, _, _ in self.runs)
            return self.run("compiled", steps, every, 1.0 + (2.0 if compiles % 2 else 4.0), logged)
        return self.run("eager", steps, every, 1.0, logged)

    def run(self, who: str, steps: int, every: int, start: float, logged: list[int]) -> Run:
        self.runs.append((who, steps, every))
        per_step = SECONDS_PER_STEP[who]
        # the first ten steps take three times as long as the others: the page cache, the allocator, the CPU's clock
        at = {n: start + (3 * min(n, 10) + max(n - 10, 0)) * per_step for n in range(1, steps + 1)}
        return Run(at[steps] + 1.5, [], marks=[(at[n], n) for n in logged])


def test_step_rows_time_the_steps_between_two_lines_of_one_run_whatever_its_start_up_cost():
    programs = StepPrograms()
    plan = FULL
    rows = step_rows(programs, "block8", plan, rounds=2, bf16=False)
    for who in ("nanoGPT", "eager", "compiled"):
        first, last = (plan.compiled_steps if who == "compiled" else plan.steps)["block8"]
        warm_up, *measured = [(steps, every) for w, steps, every in programs.runs if w == who]
        # nanoGPT runs iterations 0 to max_iters: one step more than it is told, as on every row before
        assert measured == [(last + (who == "nanoGPT"), first)] * 2, who
    eager, compiled = rows
    # the compiles from the cache took 2 and 4 s, the first steps longer, the evaluation at the end 1.5 s: none counts
    assert eager["rounds"] == {"nanogpt": pytest.approx([5.0, 5.0]), "tinychar": pytest.approx([4.0, 4.0])}
    assert compiled["rounds"]["tinychar"] == pytest.approx([2.0, 2.0])
    assert compiled["ratio"] == pytest.approx(2.5)


class ColdCompilePrograms(StepPrograms):
    """StepPrograms whose first compiled run finds tinychar's compile cache empty and compiles for 20 s."""

    def run(self, who: str, steps: int, every: int, start: float, logged: list[int]) -> Run:
        cold = who == "compiled" and not any(w == "compiled" for w, _, _ in self.runs)
        return super().run(who, steps, every, start + (20.0 if cold else 0.0), logged)


@pytest.mark.parametrize("name", sorted(STEP_SHAPES))
def test_quick_step_rows_are_numbers_though_the_first_compile_is_cold(name):
    """--quick used to difference its first, cold-compiling run against a warm one: the longer run came out faster,
    and the cell read n/a on every machine."""
    rows = step_rows(ColdCompilePrograms(), name, QUICK, rounds=1, bf16=True)
    for row in rows:
        assert math.isfinite(row["nanogpt"]) and math.isfinite(row["tinychar"]) and math.isfinite(row["ratio"]), row


def test_quick_lengths_outlast_the_noise_of_starting_a_process():
    """The quick sampling rows' extra characters take seconds, so that the second or so by which a process start or a
    compile from the cache varies cannot make the longer run the faster one; the step rows time seconds of steps."""
    for who, per_step in SECONDS_PER_STEP.items():
        first, last = (QUICK.compiled_steps if who == "compiled" else QUICK.steps)["block8"]
        assert (last - first) * per_step >= 3.0, who
    short, long = QUICK.chars
    assert long - short >= 500  # sampling runs at hundreds to thousands of characters a second


def test_quick_quality_races_let_tinychar_run_three_times_nanogpts_steps():
    fake = FakePrograms(drift=0.0)
    race(fake, "test", ["--x"], [(nanogpt_final, "final (step {step})")], [("configs/tiny.yaml", [], "")],
               60, rounds=1)
    for args, _ in fake.tiny_runs:
        assert {"train.max_iters=180", "train.lr_decay_iters=180", "train.eval_interval=30",
                "train.warmup_iters=6"} <= set(args), args


def test_a_ratio_that_could_not_be_measured_reads_n_a_never_nanx():
    report = {"date": "2025-01-02", "cpu": "AMD EPYC", "cpu_flags": ["avx2"], "cores": 2, "torch": "2.13.0",
              "threads": 2, "rounds": 1, "quick": True, "rows": [],
              "products": {"block64": {"label": "block 64", "ms": 18.46, "bound": math.nan},
                           "block8": {"label": "block 8", "ms": 0.5, "bound": None}}}  # None: NaN read back from JSON
    text = markdown(report)
    assert "block 64 18.46 ms (n/a); block 8 0.50 ms (n/a)." in text
    assert "nan" not in text.lower().replace("nanogpt", "")
    assert "n/a: the longer run was not the slower" in text.splitlines()[0]


def test_json_refuses_what_it_could_only_find_out_at_the_end(tmp_path, capsys, monkeypatch):
    """An earlier result in a folder that takes no new file (the result is replaced by a new file made there), one
    that cannot be read, and the file stdout is redirected to: refused before anything runs, each in its own words."""
    monkeypatch.setattr(bench, "measure", lambda *a: pytest.fail("measured with a --json that cannot be written"))
    checkout = str(nanogpt_checkout(tmp_path))
    earlier = tmp_path / "runs" / "bench.json"
    earlier.parent.mkdir()
    earlier.write_text('{"cpu_flags": [], "rows": []}', encoding="utf-8")
    real_access = os.access
    for denied, says in ((lambda p, m: Path(p) == earlier.parent and m == os.W_OK, "cannot be written there"),
                         (lambda p, m: Path(p) == earlier and m == os.R_OK, "cannot be read, so whether it holds")):
        with monkeypatch.context() as m:  # as root, os.access allows everything: what a user without the right sees
            m.setattr(bench.os, "access", lambda p, mode, denied=denied: not denied(p, mode) and real_access(p, mode))
            with pytest.raises(SystemExit) as exited:
                bench.main(["--nanogpt", checkout, "--json", str(earlier)])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.count("\n") == 1 and says in err
    out = tmp_path / "out.md"
    with out.open("w") as f:
        done = subprocess.run([sys.executable, str(ROOT / "bench.py"), "--nanogpt", checkout, "--json", str(out)],
                              stdout=f, stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "is the file this command's output is redirected to" in done.stderr


def test_json_through_a_link_names_the_folder_the_link_points_into(tmp_path, capsys, monkeypatch):
    """A link whose folder is not there was refused as "no folder '<the link's own folder>'", which is there; a link
    into a folder that is there gets the results at its target, and stays a link."""
    monkeypatch.setattr(bench, "measure", lambda *a: pytest.fail("measured with a --json that cannot be written"))
    # named from their folder: the line is cut past 400 characters, which three paths in a long temp folder (macOS's
    # /var/folders/...) passed, and the expected line below was cut away from it
    monkeypatch.chdir(tmp_path)
    dangling = Path("bench.json")
    dangling.symlink_to(Path("gone", "bench.json"))
    with pytest.raises(SystemExit) as exited:
        bench.main(["--nanogpt", str(nanogpt_checkout(tmp_path)), "--json", str(dangling)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: --json: 'bench.json' is a link to 'gone/bench.json', in a folder "
                          f"'{(tmp_path / 'gone').resolve()}' that is not there; make that folder, or give another "
                          f"file name"), err
    (tmp_path / "gone").mkdir()
    assert json_problem(str(dangling)) is None
    write_json(str(dangling), '{"cpu_flags": [], "rows": []}')
    assert dangling.is_symlink() and is_bench_result(tmp_path / "gone" / "bench.json")


def test_a_stopped_launch_leaves_no_program_running(tmp_path):
    """SIGTERM to bench.py (`timeout`, `kill`) ended it and left the program it was timing training on for minutes."""
    from training.signals import Interrupted, InterruptSignals

    pid_file = tmp_path / "pid"
    script = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); print('up', flush=True); " \
             "time.sleep(120)"
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        with pytest.raises(Interrupted), InterruptSignals():
            launch([sys.executable, "-c", script], tmp_path, dict(os.environ))
    finally:
        timer.cancel()
    with pytest.raises(ProcessLookupError):  # killed and waited for: no such process any more
        os.kill(int(pid_file.read_text()), 0)


def test_sigterm_ends_the_bench_in_one_line_and_removes_its_scratch_folder(tmp_path, capsys, monkeypatch):
    scratch: list[Path] = []

    def measuring(args, plan, folder):
        scratch.append(folder)
        (folder / "nanoGPT").mkdir()  # the copy it works in
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)

    monkeypatch.setattr(bench, "measure", measuring)
    assert bench.main(["--nanogpt", str(nanogpt_checkout(tmp_path))]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "interrupted (SIGTERM); nothing measured is printed\n"
    assert scratch and not scratch[0].exists()
