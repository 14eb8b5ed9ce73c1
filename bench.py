"""Measure tinychar next to nanoGPT on this machine's CPU, each program run as its users run it.

    python bench.py --nanogpt ../nanoGPT                  # every row, ~25-30 minutes on 2 cores
    python bench.py --nanogpt ../nanoGPT --isa avx2       # as on a CPU without AVX-512 (libraries kept to AVX2)
    python bench.py --nanogpt ../nanoGPT --skip-quality   # training steps and sampling only
    python bench.py --nanogpt ../nanoGPT --quick          # a smoke test of every row, short step counts
    python bench.py --nanogpt ../nanoGPT --gpu            # on a CUDA GPU: the baby GPT to nanoGPT's best loss

Get nanoGPT with: git clone https://github.com/karpathy/nanoGPT

Both programs run their own train.py and sample.py as subprocesses of this Python (same torch), on tiny Shakespeare,
with the same thread count, model shape and batch. Speeds come from whole-process wall times taken at two lengths
(steps, or characters) and differenced, so start-up, data loading and compilation cancel; rounds alternate the two
programs so machine noise falls on both. The table goes to stdout (markdown), progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from configs.userinput import OneLineParser, shown
from model.linear import onednn_min_macs
from training.checkpoints import write_atomic
from training.config import MAX_THREADS
from training.devices import onednn_linear_nobias
from training.signals import Interrupted, InterruptSignals

ROOT = Path(__file__).resolve().parent
CORPUS = ROOT / "data" / "tinyshakespeare.txt"
CLONE_HINT = "get a checkout with: git clone https://github.com/karpathy/nanoGPT"
# What bench.py runs of a nanoGPT checkout; its absence means the folder is not one.
NANOGPT_FILES = ("train.py", "sample.py", "model.py", "configurator.py", "config/train_shakespeare_char.py",
                 "data/shakespeare_char/prepare.py")
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
EVAL_LINE = re.compile(r"^step (\d+): train loss [-+.\deE]+, val loss ([-+.\deE]+|nan)")
# nanoGPT's README command for CPUs; bench.py adds only out_dir and float32 (dtype picks nothing on a CPU there, but its
# default, float16, makes nanoGPT build a CUDA GradScaler that warns on every CPU-only machine).
NANOGPT_CPU_RUN = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
                   "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
                   "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0", "--dtype=float32"]
# Stand-ins put on PYTHONPATH for nanoGPT's processes only: nanoGPT imports these at the top of a file but, as bench.py
# runs it, never calls them. input.txt is in place, so prepare.py downloads nothing with requests; meta.pkl is there, so
# sample.py decodes characters without tiktoken, which is not a tinychar requirement.
STUB_NAMES = ("tiktoken", "requests")
STUB = '''"""Stand-in for {name} from tinychar's bench.py: nanoGPT imports it, but as bench.py runs nanoGPT,
never uses it."""


def __getattr__(attr):
    raise RuntimeError(f"bench.py's stand-in {name} has no {{attr}}")
'''


class BenchError(Exception):
    """A program failed or the machine refused something: one line for the user."""


@dataclass(frozen=True)
class Shape:
    """A model and batch, as both programs are told them; config is the tinychar file whose other settings apply."""

    config: str
    block_size: int
    batch_size: int
    n_layer: int
    n_head: int
    n_embd: int
    bias: bool

    def label(self) -> str:
        return f"block {self.block_size}, batch {self.batch_size}, {self.n_layer}L/{self.n_head}H/{self.n_embd}"

    def nanogpt(self, iters: int) -> list[str]:
        """nanoGPT flags for iters steps, evaluating (eval_iters=1) and logging only at step 0, which it always does."""
        shape = {k: getattr(self, k) for k in ("block_size", "batch_size", "n_layer", "n_head", "n_embd", "bias")}
        return ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--dtype=float32",
                "--dropout=0.0", *[f"--{k}={v!r}" for k, v in shape.items()], f"--max_iters={iters}",
                # no warmup: with warmup_iters = lr_decay_iters nanoGPT would divide by zero at the last step
                f"--lr_decay_iters={iters}", "--warmup_iters=0", f"--eval_interval={iters + 1}",
                f"--log_interval={iters + 1}",
                "--eval_iters=1", "--wandb_log=False"]

    def tinychar(self, iters: int) -> list[str]:
        """tinychar overrides for iters steps, evaluating once (eval_iters=1) at the end, as it always does; with
        nanoGPT's optimizer, AdamW, so that a step does the same work in both (the time-to-quality rows run the
        configs as they are, Muon included)."""
        shape = {f"model.{k}": getattr(self, k) for k in ("block_size", "n_layer", "n_head", "n_embd")}
        return ["--config", self.config, *[f"{k}={v}" for k, v in shape.items()],
                f"model.bias={str(self.bias).lower()}", f"train.batch_size={self.batch_size}",
                f"train.max_iters={iters}", f"train.eval_interval={iters}", f"train.log_interval={iters}",
                "train.eval_iters=1", "train.sample_chars=0", "train.tensorboard=false", "train.device=cpu",
                "train.optimizer=adamw"]


STEP_SHAPES = {"block8": Shape("configs/tiny.yaml", 8, 32, 3, 4, 32, False),
               "block64": Shape("configs/shakespeare_char_cpu.yaml", 64, 12, 4, 4, 128, False)}
SAMPLE_SHAPES = {"block8": Shape("configs/tiny.yaml", 8, 32, 3, 4, 64, True), "block64": STEP_SHAPES["block64"]}


@dataclass(frozen=True)
class Plan:
    """Lengths of the measured runs: (short, long) steps per training-step row (and for tinychar's compiled steps),
    characters for sampling (and for tinychar's compiled sampler). The compiled runs are longer: a compile from the
    cache takes a few seconds, give or take one or two, which must not swamp the difference of the two runs (measured
    on a 2-core Zen 4 EPYC: 1,000 more compiled block-8 steps, about 1.8 s, once took 7 ms longer than the short run,
    a ratio of 820x for that round)."""

    steps: dict[str, tuple[int, int]]
    compiled_steps: dict[str, tuple[int, int]]
    chars: tuple[int, int]
    compiled_chars: tuple[int, int]
    quality_iters: int | None  # None: each config's own run; a number shortens both programs' runs to it (--quick)
    ceiling_seconds: float
    rounds: int
    warm_up: bool  # one run of each program before the measured rounds (page cache, tinychar's compile cache)


FULL = Plan({"block8": (100, 1100), "block64": (20, 220)}, {"block8": (100, 5100), "block64": (20, 620)},
            (500, 5000), (1000, 40000), None, 1.0, 3, True)
# --quick: a smoke test of every row, whose cells must still be numbers. The lengths differ by a few seconds of work per
# program (the process start-up and a compile from the cache vary by a second or two), and one warm-up run of each
# program goes first, or the short compiled run would pay the cold compile that the long one is spared, and come out
# slower (NaN, printed n/a). The time-to-quality runs are 60 steps with a 6-step warmup (see shortened). Measured on a
# 2-core Zen 4 EPYC, 2026-11-26: every cell a number, 6.5 minutes in all (5 vs 2 and 20 steps: n/a in most rows).
QUICK = Plan({"block8": (50, 850), "block64": (5, 65)}, {"block8": (50, 2050), "block64": (5, 205)}, (50, 850),
             (50, 8050), 60, 0.2, 1, True)

# One evaluation line of a run: (seconds from launch, step, val loss).
Eval = tuple[float, int, float]


@dataclass
class Run:
    """One finished process: its wall time from launch to exit, and (seconds since launch, step, val loss) of each
    evaluation line it printed."""

    seconds: float
    evals: list[Eval]


def note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_eval(line: str) -> tuple[int, float] | None:
    """(step, val loss) of an evaluation line, which both programs print alike: `step N: train loss X, val loss Y`."""
    match = EVAL_LINE.match(line)
    return (int(match[1]), float(match[2])) if match else None


def per_unit(t_short: float, t_long: float, n_short: int, n_long: int) -> float:
    """Seconds per step (or character) from two whole runs; NaN when noise swamped the difference."""
    return (t_long - t_short) / (n_long - n_short) if t_long > t_short else math.nan


def cpu_info(cpuinfo: str) -> tuple[str, list[str]]:
    """The CPU's model name (with its family and model numbers, which tell apart CPUs of one name: an "AMD EPYC" of
    family 25 is a Zen 3 or Zen 4, of 26 a Zen 5) and which of CPU_FLAGS it has, from the text of /proc/cpuinfo."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    name = fields.get("model name", platform.processor() or platform.machine())
    if "cpu family" in fields and "model" in fields:
        name += f", family {fields['cpu family']} model {fields['model']}"
    return name, [f for f in CPU_FLAGS if f in flags]


# --isa avx2: every library of both programs kept to AVX2, as on a CPU without AVX-512 (and so without bfloat16):
# PyTorch's own kernels, inductor's generated code, MKL's and oneDNN's matrix multiplies. An emulation, not the
# real thing: such a CPU also has its own caches and clocks.
ISA_LIMITS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}


def usable_flags(flags: list[str], isa: str) -> list[str]:
    """The CPU's flags that the programs may use under --isa."""
    return [f for f in flags if not f.startswith(("avx512", "amx"))] if isa in ISA_LIMITS else flags


def median(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def compare(label: str, unit: str, nano: list[float], tiny: list[float]) -> dict:
    """A table row from per-round figures. The ratio is nanoGPT's time over tinychar's, so for a rate (chars/s) it is
    tinychar's figure over nanoGPT's; spread is the lowest and highest of the per-round ratios."""

    def ratio(n: float, t: float) -> float:
        a, b = (t, n) if unit.endswith("/s") else (n, t)
        return a / b if math.isfinite(a) and math.isfinite(b) and b > 0 else math.nan

    rounds = [r for r in (ratio(n, t) for n, t in zip(nano, tiny, strict=True)) if math.isfinite(r)]
    return {"label": label, "unit": unit, "nanogpt": median(nano), "tinychar": median(tiny),
            "ratio": ratio(median(nano), median(tiny)),
            "spread": [min(rounds), max(rounds)] if len(rounds) > 1 else None,
            "rounds": {"nanogpt": nano, "tinychar": tiny}}


class Programs:
    """How each program is started: command lines, working folders, environments, fresh output folders."""

    def __init__(self, nanogpt: Path, scratch: Path, threads: int) -> None:
        self.scratch, self.threads, self.count = scratch, threads, 0
        self.work = scratch / "nanogpt"
        self.cache = self.fresh("cache")  # tinychar's caches for the speed rows, warmed by their warm-up runs
        self.base = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        for name in ("TINYCHAR_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):  # so that XDG_CACHE_HOME decides
            self.base.pop(name, None)
        stubs = self.fresh("stubs")
        stubs.mkdir()
        for name in STUB_NAMES:
            (stubs / f"{name}.py").write_text(STUB.format(name=name), encoding="utf-8")
        path = [str(stubs), *filter(None, [os.environ.get("PYTHONPATH")])]
        self.nano_env = {**self.base, "PYTHONPATH": os.pathsep.join(path)}
        self.prepare_nanogpt(nanogpt)

    def fresh(self, name: str) -> Path:
        self.count += 1
        return self.scratch / f"{name}{self.count}"

    def prepare_nanogpt(self, checkout: Path) -> None:
        """The files nanoGPT runs, copied into a work folder, with our corpus as its input.txt, prepared."""
        for name in NANOGPT_FILES:
            (self.work / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(checkout / name, self.work / name)
        shutil.copyfile(CORPUS, self.work / "data/shakespeare_char/input.txt")
        self.nanogpt("data/shakespeare_char/prepare.py", [])

    def nanogpt(self, script: str, args: list[str], out_dir: Path | None = None) -> Run:
        if script == "train.py":
            args = [*args, f"--out_dir={out_dir or self.fresh('nanogpt')}"]
        return launch([sys.executable, "-u", script, *args], self.work, self.nano_env)

    def tinychar(self, script: str, args: list[str], cache: Path | None = None, stop_at: float | None = None,
                 out_dir: Path | None = None) -> Run:
        env = {**self.base, "XDG_CACHE_HOME": str(cache or self.cache)}
        if script == "train.py":
            args = [*args, f"train.threads={self.threads}", f"out_dir={out_dir or self.fresh('tinychar')}"]
        return launch([sys.executable, "-u", str(ROOT / script), *args], ROOT, env, stop_at)


def launch(cmd: list[str], cwd: Path, env: dict[str, str], stop_at: float | None = None) -> Run:
    """Run cmd to its end, timestamping each evaluation line as it arrives. With stop_at, the run is stopped (SIGTERM)
    at its first val loss at or below it: the time to get there is all that is wanted of it."""
    evals: list[Eval] = []
    stopped = False
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                encoding="utf-8", errors="replace")
        try:
            for line in proc.stdout:
                found = parse_eval(line)
                if found is not None and not stopped:
                    evals.append((time.perf_counter() - start, *found))
                    if stop_at is not None and found[1] <= stop_at:
                        proc.terminate()
                        stopped = True
            code = proc.wait()
        except BaseException:  # bench.py stopped (Ctrl-C, SIGTERM): the program must not run on without it
            proc.kill()
            proc.wait()
            raise
        seconds = time.perf_counter() - start
        if code != 0 and not stopped:
            err.seek(0)
            last = next((s for s in reversed(err.read().splitlines()) if s.strip()), "no message")
            raise BenchError(f"{Path(cmd[2]).name} {' '.join(cmd[3:6])} ... (in {cwd}) exited with status {code}: "
                             f"{last.strip()}")
    return Run(seconds, evals)


def step_rows(p: Programs, name: str, plan: Plan, rounds: int, bf16: bool) -> list[dict]:
    """ms per training step of one shape, float32 for both; with bf16, tinychar's train.dtype=auto as well."""
    shape = STEP_SHAPES[name]
    tiny = {"eager": ["train.dtype=float32", "train.compile=false"],
            "compiled": ["train.dtype=float32", "train.compile=true"]}
    if bf16:
        tiny["auto"] = ["train.dtype=auto", "train.compile=true"]
    contenders = {"nanoGPT": lambda n: p.nanogpt("train.py", shape.nanogpt(n))}
    for who, extra in tiny.items():
        contenders[who] = lambda n, extra=extra: p.tinychar("train.py", [*shape.tinychar(n), *extra])
    lengths = {who: plan.steps[name] if who in ("nanoGPT", "eager") else plan.compiled_steps[name]
               for who in contenders}
    for who, go in contenders.items() if plan.warm_up else ():
        note(f"  warm-up: {who}")
        go(lengths[who][0])
    ms: dict[str, list[float]] = {who: [] for who in contenders}
    for r in range(rounds):
        note(f"  round {r + 1}/{rounds}")
        seconds = {(who, i): go(lengths[who][i]).seconds for i in (0, 1) for who, go in contenders.items()}
        for who in contenders:
            ms[who].append(1e3 * per_unit(seconds[who, 0], seconds[who, 1], *lengths[who]))
    label = f"train step, {shape.label()}"
    if name == "block64":
        label += " (nanoGPT's CPU config)"
    rows = [compare(f"{label}, float32, tinychar eager (train.compile=false)", "ms/step", ms["nanoGPT"], ms["eager"]),
            compare(f"{label}, float32, tinychar compiled (train.compile=true)", "ms/step", ms["nanoGPT"],
                    ms["compiled"])]
    if bf16:
        rows.append(compare(f"{label}, tinychar compiled with train.dtype=auto (bfloat16 from n_embd 128)", "ms/step",
                            ms["nanoGPT"], ms["auto"]))
    return rows


def sample_rows(p: Programs, name: str, plan: Plan, rounds: int) -> list[dict]:
    """Characters per second of one sample stream with each program's sample.py, from a checkpoint of the shape."""
    shape, (m1, m2) = SAMPLE_SHAPES[name], plan.chars
    nano_out, tiny_out = p.fresh("nanogpt-out"), p.fresh("tinychar-out")
    # Two steps make a checkpoint of the shape (its weights do not change the speed); nanoGPT saves only at an
    # evaluation after step 0, and only an improved one unless always_save_checkpoint.
    p.nanogpt("train.py", [*shape.nanogpt(2), "--eval_interval=2", "--always_save_checkpoint=True"], out_dir=nano_out)
    p.tinychar("train.py", shape.tinychar(2), out_dir=tiny_out)
    # One sample at temperature 0.8, each program's default top-k (nanoGPT 200, tinychar none) and context handling.
    contenders = {
        "nanoGPT": lambda m: p.nanogpt("sample.py", [
            f"--out_dir={nano_out}", "--device=cpu", "--dtype=float32", "--compile=False", "--num_samples=1",
            f"--max_new_tokens={m}", "--temperature=0.8", "--seed=1337"]),
    }
    for who, compile_ in (("tinychar", "auto"), ("compiled", "true")):
        contenders[who] = lambda m, compile_=compile_: p.tinychar("sample.py", [
            "--out-dir", str(tiny_out), "--device", "cpu", "--num-samples", "1", "--max-new-tokens", str(m),
            "--temperature", "0.8", "--seed", "1337", "--compile", compile_])
    lengths = {who: plan.compiled_chars if who == "compiled" else (m1, m2) for who in contenders}
    for go in contenders.values() if plan.warm_up else ():
        go(m1)
    rate: dict[str, list[float]] = {who: [] for who in contenders}
    for r in range(rounds):
        note(f"  round {r + 1}/{rounds}")
        seconds = {(who, i): go(lengths[who][i]).seconds for i in (0, 1) for who, go in contenders.items()}
        for who in contenders:
            rate[who].append(1 / per_unit(seconds[who, 0], seconds[who, 1], *lengths[who]))
    label = (f"sampling, one stream, exact context, block {shape.block_size}, "
             f"{shape.n_layer}L/{shape.n_head}H/{shape.n_embd}")
    return [compare(f"{label}, tinychar's default (--compile auto)", "chars/s", rate["nanoGPT"], rate["tinychar"]),
            compare(f"{label}, tinychar --compile true", "chars/s", rate["nanoGPT"], rate["compiled"])]


def nanogpt_flags(cfg: dict) -> list[str]:
    """nanoGPT flags for the model, batch, schedule and evaluation a tinychar YAML config describes. nanoGPT takes
    a value only of the type of its default, hence the conversions; keys the file leaves out keep nanoGPT's own."""
    values = {**cfg.get("model", {}), **cfg.get("train", {})}
    if values.get("lr_decay_iters") is None:  # tinychar's null: decay over the whole run
        values["lr_decay_iters"] = values["max_iters"]
    kinds = {int: ("block_size", "n_layer", "n_head", "n_embd", "batch_size", "max_iters", "lr_decay_iters",
                   "warmup_iters", "eval_interval", "eval_iters", "log_interval"),
             float: ("dropout", "learning_rate", "min_lr", "weight_decay", "beta2", "grad_clip"), bool: ("bias",)}
    return [f"--{key}={kind(values[key])!r}" for kind, keys in kinds.items() for key in keys if key in values]


# nanoGPT's block-8 reference run: tiny.yaml's model, trained with the recipe tiny.yaml had when nanoGPT was first
# measured against it (batch 256, 1300 steps, lr 1.2e-2; its best val is about 1.94). Fixed here, so that tuning
# tiny.yaml for time to quality moves only tinychar's side of the comparison.
NANOGPT_BLOCK8_RUN = {
    "model": {"block_size": 8, "n_layer": 3, "n_head": 4, "n_embd": 64, "dropout": 0.0, "bias": True},
    "train": {"batch_size": 256, "max_iters": 1300, "learning_rate": 1.2e-2, "min_lr": 1.2e-3, "warmup_iters": 100,
              "weight_decay": 0.1, "beta2": 0.99, "grad_clip": 1.0, "eval_interval": 325, "eval_iters": 8,
              "log_interval": 100},
}


# What a race times the programs to: a function that picks the target evaluation from nanoGPT's first run, and the
# row's words for it ("{step}": that evaluation's step).
Goal = tuple[Callable[[list[Eval]], Eval], str]
WHENS = ("empty caches", "repeated run")


def nanogpt_best(evals: list[Eval]) -> Eval:
    return min(evals, key=lambda e: e[2])


def nanogpt_final(evals: list[Eval]) -> Eval:
    return evals[-1]


# The GPU race's second target: the best loss lies at the bottom of both programs' curves, where a run's evaluations
# differ by a few thousandths from one run to the next, so whether a run gets below it at all is partly chance (H100,
# 2026-11-26: tinychar's four runs' best 1.4648-1.4698 against nanoGPT's 1.4674). Within 2% of it the curves still
# fall by about 0.01-0.06 an evaluation, so the time to it measures speed rather than luck.
NEAR_BEST = 0.02


def nanogpt_near_best(evals: list[Eval]) -> Eval:
    """nanoGPT's first evaluation within NEAR_BEST of its best val."""
    bar = (1 + NEAR_BEST) * nanogpt_best(evals)[2]
    return next(e for e in evals if e[2] <= bar)


def quality_rows(p: Programs, iters: int | None, bf16: bool = False, rounds: int = 1) -> list[dict]:
    """Time from launch to nanoGPT's best val on the block-8 reference run, and to its final val on its README's CPU
    run: nanoGPT's first run sets each target, then tinychar runs the matching config with its defaults, from empty
    caches and again; with rounds, the two programs alternate, each round timing nanoGPT to the same target. With
    bf16 (where the CPU config's dtype=auto trains in bfloat16), the CPU config in float32 as well."""
    common = ["--device=cpu", "--compile=False", "--dtype=float32", "--always_save_checkpoint=False",
              "--wandb_log=False"]
    block8 = ["config/train_shakespeare_char.py", *common, *nanogpt_flags(NANOGPT_BLOCK8_RUN)]
    what = "nanoGPT's best (step {step}) training tiny.yaml's model, block 8"
    rows = race(p, "nanoGPT on tiny.yaml's model, the reference recipe", [*block8, *shortened(iters, "--{}={}")],
                [(nanogpt_best, what)], [("configs/tiny.yaml", [], "")], iters, rounds)
    in_float32 = ", tinychar in float32 (train.dtype=float32)"
    float32 = [("configs/shakespeare_char_cpu.yaml", ["train.dtype=float32"], in_float32)] if bf16 else []
    rows += race(p, "nanoGPT's CPU config", [*NANOGPT_CPU_RUN, *shortened(iters, "--{}={}")],
                 [(nanogpt_final, "nanoGPT's final (step {step}) on its CPU config, block 64")],
                 [("configs/shakespeare_char_cpu.yaml", [], ""), *float32], iters, rounds)
    return rows


def gpu_quality_rows(p: Programs, iters: int | None, rounds: int = 1) -> list[dict]:
    """--gpu: time from launch to nanoGPT's best val on its baby GPT recipe (config/train_shakespeare_char.py, as its
    README runs it on a GPU: compiled, bfloat16), and to its first val within NEAR_BEST of that, against
    configs/shakespeare_char.yaml as it is (compiled) and trained eagerly, each from empty caches and repeated."""
    nano = ["config/train_shakespeare_char.py", "--always_save_checkpoint=False", "--wandb_log=False",
            *shortened(iters, "--{}={}")]
    contenders = [("configs/shakespeare_char.yaml", [], ""),
                  ("configs/shakespeare_char.yaml", ["train.compile=false"], ", tinychar eager (train.compile=false)")]
    where = "on its baby GPT, block 256, on the GPU"
    goals = [(nanogpt_best, f"nanoGPT's best (step {{step}}) {where}"),
             (nanogpt_near_best, f"nanoGPT's first within {NEAR_BEST:.0%} of its best (step {{step}}) {where}")]
    return race(p, "nanoGPT's baby GPT on the GPU", nano, goals, contenders, iters, rounds, device="cuda")



def race(p: Programs, name: str, nano_args: list[str], goals: list[Goal], contenders: list[tuple[str, list[str], str]],
         iters: int | None, rounds: int, device: str = "cpu") -> list[dict]:
    """Rows for each goal and each tinychar (config, overrides, label suffix) in contenders reaching the val that the
    goal picks from nanoGPT's first run, from empty caches and repeated, over rounds that alternate the two programs:
    nanoGPT's time in each round is when that round's run first reached the target. tinychar's runs stop at the
    lowest target; the others are read from the same runs' evaluations."""
    nano: dict[int, list[float]] = {}
    tiny: dict[tuple[int, int, str], list[float]] = {}
    best: dict[tuple[int, int, str], float] = {}
    targets: list[Eval] = []
    for r in range(rounds):
        note(f"time to quality: {name}, round {r + 1}/{rounds} ...")
        evals = evaluations(p.nanogpt("train.py", nano_args))
        if r == 0:
            targets = [pick(evals) for pick, _ in goals]
        for g, (_, _, target) in enumerate(targets):
            nano.setdefault(g, []).append(first_at(evals, target))
        lowest = min(val for _, _, val in targets)
        for i, (config, extra, _) in enumerate(contenders):
            for when, run in tinychar_to(p, config, lowest, iters, extra, device):
                low = min((val for _, _, val in run), default=math.nan)
                for g, (_, _, target) in enumerate(targets):
                    tiny.setdefault((g, i, when), []).append(first_at(run, target))
                    best[g, i, when] = min(best.get((g, i, when), math.inf), low)
    rows = []
    for g, i, when in sorted(tiny, key=lambda k: (k[0], k[1], WHENS.index(k[2]))):
        _, step, target = targets[g]
        label = f"launch to val <= {target:.4f}, {goals[g][1].format(step=step)}{contenders[i][2]}; tinychar {when}"
        rows.append({**compare(label, "s", nano[g], tiny[g, i, when]), "target": target,
                     "tinychar_best": best[g, i, when]})
    return rows


def first_at(evals: list[Eval], target: float) -> float:
    """Seconds from launch to the first evaluation at or below target; NaN if none got there."""
    return next((t for t, _, val in evals if val <= target), math.nan)


def wait_for_helpers(cache: Path, limit: float = 600.0) -> None:
    """Wait until no helper left by a run (training.warm) is still compiling into the cache folder: a repeated run,
    as a person starts it later, finds the cache as the helper leaves it."""
    start = time.perf_counter()
    while any(cache.glob("tinychar/compiled/*/tinychar-*.warming")) and time.perf_counter() - start < limit:
        time.sleep(0.5)
    if time.perf_counter() - start > 1:
        note(f"  the compile cache's helper finished {time.perf_counter() - start:.0f} s after the run")


def shortened(iters: int | None, form: str) -> list[str]:
    """--quick's short quality runs: max_iters, lr_decay_iters, eval_interval and warmup_iters, each written as form
    says. The configs' 100-step warmups would outlast such a run, and leave the learning rate near zero throughout."""
    if iters is None:
        return []
    return [form.format(k, v) for k, v in (("max_iters", iters), ("lr_decay_iters", iters),
                                           ("eval_interval", max(1, iters // 2)), ("warmup_iters", iters // 10))]


def evaluations(run: Run) -> list[Eval]:
    if not run.evals:
        raise BenchError("nanoGPT's train.py printed no evaluation line")
    return run.evals


def tinychar_to(p: Programs, config: str, target: float, iters: int | None, extra: list[str],
               device: str = "cpu") -> list[tuple[str, list[Eval]]]:
    """tinychar's config (with the overrides in extra) run to val <= target from empty caches, then repeated: (when,
    the run's evaluations) for each."""
    cache, out = p.fresh("cache"), []
    for when in WHENS:
        if when == "repeated run":
            wait_for_helpers(cache)
        note(f"time to quality: tinychar {config}, {when} ...")
        # --quick: tinychar may take three times nanoGPT's steps, evaluating as often (it stops at the target): a
        # config tuned for its full length (tiny.yaml's weight average spans ~100 steps) lags in so short a race,
        # which would leave the row "not reached" on any machine and so test nothing.
        quick = [] if iters is None else [f"train.max_iters={3 * iters}", f"train.lr_decay_iters={3 * iters}",
                                          f"train.eval_interval={iters // 2}", f"train.warmup_iters={iters // 10}"]
        run = p.tinychar("train.py", ["--config", config, f"train.device={device}", *quick, *extra], cache=cache,
                         stop_at=target)
        out.append((when, run.evals))
    return out


def matmul_gflops(threads: int, seconds: float, n: int = 1024) -> dict[str, float]:
    """Best GFLOP/s of an n x n matrix multiply in float32 and bfloat16 (PyTorch's default path, which nanoGPT
    takes), and in float32 through oneDNN where tinychar's linear layers may take that (model/linear.py)."""
    torch.set_num_threads(threads)
    out = {}
    kinds = [("float32", torch.float32, torch.matmul), ("bfloat16", torch.bfloat16, torch.matmul)]
    if onednn_min_macs() is not None:
        kinds.append(("float32_onednn", torch.float32, onednn_linear_nobias))
    for name, dtype, multiply in kinds:
        gen = torch.Generator().manual_seed(0)
        a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
        multiply(a, b)  # oneDNN builds its kernel on the first call
        best, deadline = math.inf, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            multiply(a, b)
            best = min(best, time.perf_counter() - start)
        out[name] = 2 * n**3 / best / 1e9
    return out


VOCAB = 65  # tiny Shakespeare's characters, which both programs train on


def step_products(shape: Shape) -> list[tuple[int, int, int]]:
    """The matrix products (rows, inner, columns) of one training step of shape, as both programs run them: for each
    linear layer (per block: the q/k/v projection, the attention's output projection, the MLP's two; then the tied
    head) its forward x W^T, its input gradient dy W and its weight gradient dy^T x. Attention's own products (the
    scores and the weighted sums) are left out."""
    rows, c = shape.batch_size * shape.block_size, shape.n_embd
    layers = [(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)] * shape.n_layer + [(c, VOCAB)]
    return [p for k, n in layers for p in ((rows, k, n), (rows, n, k), (n, rows, k))]


def products_ms(shape: Shape, threads: int, seconds: float) -> float:
    """Milliseconds that one float32 step's step_products take through PyTorch's default BLAS (nanoGPT's path),
    each timed on its own, best of what `seconds` allows per product: what no float32 step on that BLAS can undercut.
    """
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    total = 0.0
    for m, k, n in sorted(set(step_products(shape))):
        a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
        torch.mm(a, b)
        best, deadline = math.inf, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        total += best * step_products(shape).count((m, k, n))
    return total * 1e3


def cell(value: float, unit: str) -> str:
    if not math.isfinite(value):
        return "n/a"
    return {"ms/step": f"{value:.2f}", "chars/s": f"{value:,.0f}"}.get(unit, f"{value:.1f}")


def ratio_cell(value: float | None) -> str:
    """A ratio as the table prints it; n/a where it could not be measured (NaN, or None as JSON holds it)."""
    return f"{value:.2f}x" if value is not None and math.isfinite(value) else "n/a"


NOTES = ("Ratio: nanoGPT's time over tinychar's (above 1: tinychar is faster); spread: the lowest and highest ratio of "
         "the rounds. Training steps and sampling: whole-process wall time of each program's train.py or sample.py at "
         "two lengths, differenced, so start-up, data loading and compilation cancel (after one warm-up run of each; "
         "tinychar's compiled runs are longer, so that the few seconds' noise of a compile from the cache cancels "
         "too). "
         "nanoGPT runs with compile=False, as its README's CPU command; tinychar with its config's defaults, but for "
         "what the row names. Time to quality: from launch to the evaluation line, as the line arrives, the programs "
         "alternating over the rounds, nanoGPT's first run setting the target that every round times it to; tinychar's "
         "empty-cache run starts with a fresh cache folder, the repeated run reuses it once the helper that the first "
         "run may leave has warmed it (training.warm; it starts when the run has ended); nanoGPT's data is prepared "
         "beforehand.")

GPU_NOTES = ("Ratio: nanoGPT's time over tinychar's (above 1: tinychar is faster); spread: the lowest and highest "
             "ratio of the rounds. --gpu: time from launch to the evaluation line, as the line arrives. nanoGPT runs "
             "its baby GPT recipe as its README does on a GPU (compile=True, bfloat16), and its first run sets the "
             "targets: its best val, and its first val within 2% of that (the best lies where runs differ by "
             "chance; the curves still fall steeply there); tinychar runs configs/shakespeare_char.yaml as it is "
             "(compile: true, dtype auto: bfloat16) and with train.compile=false, each from a fresh cache folder and "
             "again with that folder as the first run left it, each stopped at the lower target.")


def markdown(report: dict) -> str:
    """The report as the README shows it: a header line, the matmul ceiling, the table, and how it was measured."""
    flags = ", ".join(report["cpu_flags"]) or "none of " + ", ".join(CPU_FLAGS)
    limits = ISA_LIMITS.get(report.get("isa"))
    lines = [f"tinychar vs nanoGPT, {report['date']}: {report['cpu']} ({flags}), {report['cores']} cores, "
             f"torch {report['torch']}, {report['threads']} threads, rounds: {report['rounds']}"
             + (f"; limited to {report['isa'].upper()} (" + ", ".join(f"{k}={v}" for k, v in limits.items()) + ")"
                if limits else "")
             + (f"; GPU: {report['gpu']}" if report.get("gpu") else "")
             + (" (--quick: smoke-test lengths, not figures to quote; n/a: the longer run was not the slower, the "
                "difference lost in the machine's noise)" if report.get("quick") else ""), ""]
    if "matmul_gflops" in report:
        c = report["matmul_gflops"]
        ceiling = f"float32 {c['float32']:.0f} GFLOP/s, bfloat16 {c['bfloat16']:.0f} GFLOP/s"
        if "float32_onednn" in c:
            ceiling += f"; float32 through oneDNN {c['float32_onednn']:.0f} GFLOP/s"
        lines += [f"Matmul ceiling (1024x1024): {ceiling}.", ""]
    if report.get("products"):
        parts = [f"{p['label']} {p['ms']:.2f} ms ({ratio_cell(p['bound'])})" for p in report["products"].values()]
        lines += ["Float32 linear products of one training step, each timed alone through PyTorch's default BLAS, and "
                  "nanoGPT's float32 step over them, the most a step on that BLAS can gain on it: "
                  + "; ".join(parts) + ".", ""]
    lines += ["| measure | unit | nanoGPT | tinychar | ratio | spread |", "|---|---|---:|---:|---:|---:|"]
    for row in report["rows"]:
        tiny = cell(row["tinychar"], row["unit"])
        if "target" in row and not math.isfinite(row["tinychar"]):
            tiny = f"not reached (best {row['tinychar_best']:.4f})"
        ratio = ratio_cell(row["ratio"])
        spread = f"{row['spread'][0]:.2f}-{row['spread'][1]:.2f}x" if row["spread"] else "-"
        lines.append(f"| {row['label']} | {row['unit']} | {cell(row['nanogpt'], row['unit'])} | {tiny} | {ratio} | "
                     f"{spread} |")
    return "\n".join([*lines, "", GPU_NOTES if report.get("gpu") else NOTES])


def plain(value: object) -> object:
    """value with NaN as None, which JSON can hold."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def measure(args: argparse.Namespace, plan: Plan, scratch: Path) -> dict:
    """Every row, in the table's order, with the machine they were measured on; scratch holds all the runs' files."""
    cpuinfo = Path("/proc/cpuinfo")
    cpu, flags = cpu_info(cpuinfo.read_text(encoding="utf-8", errors="replace") if cpuinfo.exists() else "")
    flags = usable_flags(flags, args.isa)
    rounds = args.rounds or (1 if args.gpu else plan.rounds)  # --gpu: each round is minutes of the GPU's time
    report = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu, "cpu_flags": flags, "isa": args.isa,
              "cores": os.cpu_count(),
              "torch": torch.__version__, "threads": args.threads, "rounds": rounds, "quick": args.quick,
              "lengths": {"steps": plan.steps, "compiled_steps": plan.compiled_steps, "chars": plan.chars,
                          "compiled_chars": plan.compiled_chars, "quality_iters": plan.quality_iters}}
    if args.gpu:
        report["gpu"] = torch.cuda.get_device_name()
        note("nanoGPT: copying and preparing its data ...")
        p = Programs(Path(args.nanogpt).resolve(), scratch, args.threads)
        report["rows"] = gpu_quality_rows(p, plan.quality_iters, rounds)
        return report
    note("matmul ceilings ...")
    report["matmul_gflops"] = matmul_gflops(args.threads, plan.ceiling_seconds)
    note("nanoGPT: copying and preparing its data ...")
    p = Programs(Path(args.nanogpt).resolve(), scratch, args.threads)
    bf16 = "avx512_bf16" in flags or "amx_bf16" in flags  # where tinychar's dtype=auto may choose bfloat16
    rows, auto_rows = [], []
    report["products"] = {}
    for name in plan.steps:
        note(f"training steps, {name} ...")
        float32, *auto = step_rows(p, name, plan, rounds, bf16)
        rows.append(float32)
        auto_rows += auto
        ms = products_ms(STEP_SHAPES[name], args.threads, plan.ceiling_seconds / 4)
        report["products"][name] = {"label": STEP_SHAPES[name].label(), "ms": ms, "bound": float32["nanogpt"] / ms}
    rows += auto_rows
    if not args.skip_quality:
        rows += quality_rows(p, plan.quality_iters, bf16, rounds)
    for name in SAMPLE_SHAPES:
        note(f"sampling, {name} ...")
        rows.extend(sample_rows(p, name, plan, rounds))
    report["rows"] = rows
    return report


def checkout_problem(folder: Path) -> str | None:
    """Why folder cannot be used as a nanoGPT checkout, or None."""
    try:
        if not folder.is_dir():
            return f"--nanogpt: no such folder '{shown(str(folder))}'; {CLONE_HINT}"
        missing = [name for name in NANOGPT_FILES if not (folder / name).is_file()]
    except OSError as e:  # a name too long for the system, say: Path.is_dir raises it rather than answer False
        return f"--nanogpt: cannot use '{shown(str(folder))}' ({e.strerror or type(e).__name__}); give another folder"
    if missing:
        return f"--nanogpt: '{shown(str(folder))}' is not a nanoGPT checkout (it has no {missing[0]}); {CLONE_HINT}"
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    p = OneLineParser(prog="bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt", metavar="DIR", help=f"a nanoGPT checkout to measure against ({CLONE_HINT})")
    p.add_argument("--threads", type=int, default=threads, help=f"threads for both programs (default all: {threads})")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds per row (default 3; --quick 1)")
    p.add_argument("--skip-quality", action="store_true", help="skip the time-to-quality rows (minutes)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the results to this JSON file")
    p.add_argument("--quick", action="store_true", help="short step counts: a smoke test of every row")
    p.add_argument("--gpu", action="store_true",
                   help="on a CUDA GPU, only the time from launch to nanoGPT's best loss on its baby GPT (one round "
                        "unless --rounds; minutes: nanoGPT's whole run and four of tinychar's to its loss)")
    p.add_argument("--isa", choices=["native", *ISA_LIMITS], default="native",
                   help="avx2: keep both programs' libraries to AVX2, to measure as on a CPU without AVX-512 "
                        "(default native: all the CPU offers)")
    args = p.parse_args(argv)
    if not 1 <= args.threads <= MAX_THREADS:  # torch.set_num_threads(10**20) was a traceback
        p.error(f"--threads must be from 1 to {MAX_THREADS}, got {args.threads}")
    if args.rounds is not None and args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.gpu and not torch.cuda.is_available():
        p.error("--gpu needs a CUDA GPU, and PyTorch finds none here; run without --gpu for the CPU rows")
    if args.gpu and args.isa != "native":
        p.error("--isa limits the CPU's libraries; it has no meaning with --gpu")
    if args.gpu and args.skip_quality:
        p.error("--gpu runs only the time-to-quality race, which --skip-quality leaves out; use one of them")
    if args.json is not None and (why := json_problem(args.json)) is not None:  # else found only at the end
        p.error(f"--json: {why}")
    return args


def json_problem(name: str) -> str | None:
    """Why the results could not be written to the file name (--json), in words, or None."""
    if name == "":
        return "'' is empty; give a file name, such as bench.json"
    path = Path(name)
    try:
        if path.is_dir():
            return f"'{name}' is a folder; give a file name, such as bench.json"
        folder = path.resolve().parent
        if not folder.is_dir():
            if path.is_symlink():  # the file goes where the link points (write_json), a folder that is not there
                return (f"'{name}' is a link to '{os.readlink(path)}', in a folder '{folder}' that is not there; "
                        f"make that folder, or give another file name")
            return f"no folder '{path.parent}' to write '{name}' into"
    except OSError as e:  # a name too long for the system, say: Path.is_dir raises it rather than answer False
        return f"cannot use '{name}' ({e.strerror or type(e).__name__}); give another file name"
    # A regular file is replaced by a new one made in its folder (write_json): the folder must take it. A pipe or a
    # device is written into.
    device = path.exists() and not path.is_file()
    if not os.access(path if device else folder, os.W_OK):
        return f"'{name}' cannot be written there; give another file name"
    if device:
        return None
    if path.exists():
        if any(same_file(path, fd) for fd in (1, 2)):
            return (f"'{name}' is the file this command's output is redirected to, which the results would "
                    f"replace; give --json a file of its own")
        if not os.access(path, os.R_OK):
            return (f"'{name}' cannot be read, so whether it holds an earlier result is not known; give another file "
                    f"name")
        if not is_bench_result(path):
            return (f"'{name}' holds something other than an earlier bench.py result, which the results would "
                    f"replace; give a new file name")
    return None


def same_file(path: Path, fd: int) -> bool:
    """Whether the file descriptor fd (stdout: 1) is open on the file at path."""
    try:
        return os.path.samestat(path.stat(), os.fstat(fd))
    except OSError:  # fd closed
        return False


# An earlier result is a few kilobytes: a larger file is something else, and is not read whole to find that out.
MAX_RESULT_BYTES = 1 << 20


def is_bench_result(path: Path) -> bool:
    """Whether the regular file at path holds what --json wrote before (a file --json may replace)."""
    try:
        if path.stat().st_size > MAX_RESULT_BYTES:
            return False
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # unreadable, not UTF-8 or not JSON, or nested past Python's limit
        return False
    return isinstance(data, dict) and {"cpu_flags", "rows"} <= data.keys()


def write_json(name: str, text: str) -> None:
    """Write the results to the file name: a regular file is replaced whole once the new one is complete, so a full
    disk leaves an earlier result as it was; a pipe or a device (/dev/stdout) is written into as it is."""
    path = Path(name)
    if path.exists() and not path.is_file():
        path.write_text(text, encoding="utf-8")
        return
    if (why := json_problem(name)) is not None:  # the file was changed while the rows ran
        raise OSError(why)
    write_atomic(path.resolve(), lambda f: f.write(text.encode("utf-8")))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if sys.stdout is None and not args.json:  # started with stdout closed (`>&-`): the table would go nowhere
        print("error: stdout is closed, and the table is written there; redirect it to a file (> bench.md) or give "
              "--json FILE", file=sys.stderr)
        return 2
    problem = checkout_problem(Path(args.nanogpt)) if args.nanogpt else f"--nanogpt DIR is required; {CLONE_HINT}"
    try:
        onednn_min_macs()  # TINYCHAR_ONEDNN, which the matmul ceilings read after the checkout is copied
    except ValueError as e:
        problem = problem or str(e)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    limits = ISA_LIMITS.get(args.isa, {})
    if any(os.environ.get(k) != v for k, v in limits.items()):
        # torch reads these when it loads, and it is loaded: start again with them set (children inherit them)
        script = [str(Path(__file__).resolve()), *(sys.argv[1:] if argv is None else argv)]
        os.execve(sys.executable, [sys.executable, *script], {**os.environ, **limits})
    try:
        # SIGTERM (`timeout`, `kill`) as Ctrl-C: the program running now is stopped and the scratch folder (a copy of
        # nanoGPT and the runs) removed; before, both were left behind, the program training on for minutes.
        with InterruptSignals(), tempfile.TemporaryDirectory(prefix="tinychar-bench-") as scratch:
            report = measure(args, QUICK if args.quick else FULL, Path(scratch))
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Interrupted) as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        print(f"interrupted ({signal.Signals(signum).name}); nothing measured is printed", file=sys.stderr)
        return 128 + signum
    print(markdown(report))
    if args.json:
        try:
            write_json(args.json, json.dumps(plain(report), indent=2) + "\n")
        except OSError as e:  # a full disk, or a folder made read-only while the rows ran
            print(f"error: cannot write --json '{shown(args.json)}' ({e.strerror or e}); the table above holds the "
                  f"results", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
