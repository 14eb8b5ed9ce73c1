"""Running the two programs as their users do: the shapes and lengths measured, nanoGPT's copied checkout with its
stand-in imports, tinychar's cache folders, and each process timed from launch, its evaluation and step lines stamped
as they arrive."""

from __future__ import annotations

import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository
CORPUS = ROOT / "data" / "tinyshakespeare.txt"
CLONE_HINT = "get a checkout with: git clone https://github.com/karpathy/nanoGPT"
# What bench.py runs of a nanoGPT checkout; its absence means the folder is not one.
NANOGPT_FILES = ("train.py", "sample.py", "model.py", "configurator.py", "config/train_shakespeare_char.py",
                 "data/shakespeare_char/prepare.py")
# What a file of nanoGPT's holds, its name alone would not: a folder of empty files or of another program's passed for a
# checkout, and processes doing nothing were timed as nanoGPT. train.py's is the evaluation line the races read
# (EVAL_LINE); sample.py is nanoGPT's if it calls GPT.generate.
NANOGPT_MARKS = {"model.py": b"class GPT(", "train.py": b"train loss {", "sample.py": b"model.generate("}
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
EVAL_LINE = re.compile(r"^step (\d+): train loss [-+.\deE]+, val loss ([-+.\deE]+|nan)")
# The lines each program prints every log_interval steps, which the step rows time the steps between: tinychar's
# `step N/M: loss X, ...` after N steps, nanoGPT's `iter N: loss X, ...` after N + 1 (it counts from 0).
TINYCHAR_STEP_LINE = re.compile(r"^step (\d+)/\d+: loss ")
NANOGPT_STEP_LINE = re.compile(r"^iter (\d+): loss ")
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

    def nanogpt(self, iters: int, log_every: int | None = None) -> list[str]:
        """nanoGPT flags for iters steps, evaluating (eval_iters=1) only at step 0, which it always does, and logging
        there and every log_every steps (default: nowhere else)."""
        shape = {k: getattr(self, k) for k in ("block_size", "batch_size", "n_layer", "n_head", "n_embd", "bias")}
        return ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--dtype=float32",
                "--dropout=0.0", *[f"--{k}={v!r}" for k, v in shape.items()], f"--max_iters={iters}",
                # no warmup: with warmup_iters = lr_decay_iters nanoGPT would divide by zero at the last step
                f"--lr_decay_iters={iters}", "--warmup_iters=0", f"--eval_interval={iters + 1}",
                f"--log_interval={log_every or iters + 1}",
                "--eval_iters=1", "--wandb_log=False"]

    def tinychar(self, iters: int, log_every: int | None = None) -> list[str]:
        """tinychar overrides for iters steps, evaluating once (eval_iters=1) at the end, as it always does, and
        logging every log_every steps (default: at the end); with nanoGPT's optimizer, AdamW, so that a step does the
        same work in both (the time-to-quality rows run the configs as they are, Muon included)."""
        shape = {f"model.{k}": getattr(self, k) for k in ("block_size", "n_layer", "n_head", "n_embd")}
        return ["--config", self.config, *[f"{k}={v}" for k, v in shape.items()],
                f"model.bias={str(self.bias).lower()}", f"train.batch_size={self.batch_size}",
                f"train.max_iters={iters}", f"train.eval_interval={iters}", f"train.log_interval={log_every or iters}",
                "train.eval_iters=1", "train.sample_chars=0", "train.tensorboard=false", "train.device=cpu",
                "train.optimizer=adamw"]


STEP_SHAPES = {"block8": Shape("configs/tiny.yaml", 8, 32, 3, 4, 32, False),
               "block64": Shape("configs/shakespeare_char_cpu.yaml", 64, 12, 4, 4, 128, False)}
SAMPLE_SHAPES = {"block8": Shape("configs/tiny.yaml", 8, 32, 3, 4, 64, True), "block64": STEP_SHAPES["block64"]}


@dataclass(frozen=True)
class Plan:
    """Lengths of the measured runs. A training-step row (and tinychar's compiled steps apart): (first, last), a run
    of last steps that logs every first steps, timed from its line at first steps to its line at last
    (Run.seconds_per_step). Sampling (and tinychar's compiled sampler apart): (short, long) characters, whose two whole
    runs are differenced. The compiled sampler's runs are longer: a compile from the cache takes a few seconds, give or
    take one or two, which must not swamp the difference of the two runs. The step rows once differenced two runs as
    well, and measured that noise with the steps (on a 2-core Zen 4 EPYC, 1,000 more compiled block-8 steps, about 1.8
    s, once took 7 ms longer than the short run: 820x nanoGPT for that round); their lengths are those runs'."""

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
# --quick: a smoke test of every row, whose cells must still be numbers. The sampling lengths differ by a few seconds of
# work per program (the process start-up and a compile from the cache vary by a second or two), and one warm-up run of
# each program goes first, or the short compiled run would pay the cold compile that the long one is spared, and come
# out slower (NaN, printed n/a). The time-to-quality runs are 60 steps with a 6-step warmup (see shortened). Measured
# on a 2-core Zen 4 EPYC, 2026-11-26: every cell a number, 6.5 minutes in all (5 vs 2 and 20 steps: n/a in most rows).
QUICK = Plan({"block8": (50, 850), "block64": (5, 65)}, {"block8": (50, 2050), "block64": (5, 205)}, (50, 850),
             (50, 8050), 60, 0.2, 1, True)

# One evaluation line of a run: (seconds from launch, step, val loss).
Eval = tuple[float, int, float]


@dataclass
class Run:
    """One finished process: its wall time from launch to exit, (seconds since launch, step, val loss) of each
    evaluation line it printed, the engine a tinychar train.py said it trained with (engine_of), and (seconds since
    launch, steps taken) of each step line a train.py printed (parse_steps_taken)."""

    seconds: float
    evals: list[Eval]
    engine: str | None = None
    marks: list[tuple[float, int]] = field(default_factory=list)

    def seconds_per_step(self, after: int) -> float:
        """The seconds a step took from the first step line at or past `after` steps to the last one: the steps of
        the run's middle and end alone, without its start-up, data loading, compiling or first steps, or the
        evaluation that ends it; NaN where fewer than two such lines came."""
        marks = [(t, n) for t, n in self.marks if n >= after]
        if len(marks) < 2 or marks[-1][1] <= marks[0][1]:
            return math.nan
        return (marks[-1][0] - marks[0][0]) / (marks[-1][1] - marks[0][1])


def engine_of(line: str) -> str | None:
    """The engine a line of tinychar's train.py settles on (training/engine.py's "engine: ..." lines): "compiled"
    (the whole step), "compiled block by block", "eager with its kernels" (training/eager_kernels.py) or "eager"; None
    for any other line, such as "engine: compiling the training step (...)", which a failed compile may still turn
    into "eager"."""
    if not line.startswith("engine: "):
        return None
    if line.startswith("engine: compiled in "):
        return "compiled"
    if line.startswith("engine: model compiled block by block"):
        return "compiled block by block"
    if line.startswith("engine: eager") and "; tinychar's kernels for " in line:
        return "eager with its kernels"
    if line.startswith("engine: eager") or "training without compiling" in line:
        return "eager"
    return None


def note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_eval(line: str) -> tuple[int, float] | None:
    """(step, val loss) of an evaluation line, which both programs print alike: `step N: train loss X, val loss Y`."""
    match = EVAL_LINE.match(line)
    return (int(match[1]), float(match[2])) if match else None


def parse_steps_taken(line: str) -> int | None:
    """How many steps a train.py had taken when it printed line, if it is a step line (TINYCHAR_STEP_LINE,
    NANOGPT_STEP_LINE)."""
    if (match := TINYCHAR_STEP_LINE.match(line)) is not None:
        return int(match[1])
    if (match := NANOGPT_STEP_LINE.match(line)) is not None:
        return int(match[1]) + 1
    return None


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
    """Run cmd to its end, timestamping each evaluation line and step line as it arrives. With stop_at, the run is
    stopped (SIGTERM) at its first val loss at or below it: the time to get there is all that is wanted of it."""
    evals: list[Eval] = []
    marks: list[tuple[float, int]] = []
    engine: str | None = None
    stopped = False
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                encoding="utf-8", errors="replace")
        try:
            for line in proc.stdout:
                arrived = time.perf_counter() - start
                if (taken := parse_steps_taken(line)) is not None:
                    marks.append((arrived, taken))
                engine = engine_of(line) or engine
                found = parse_eval(line)
                if found is not None and not stopped:
                    evals.append((arrived, *found))
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
    return Run(seconds, evals, engine, marks)
