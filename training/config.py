"""The run config: TrainConfig (how to train) and RunConfig (one run: out_dir, seed, data, model, train), and
loading them from a YAML file plus dotted KEY=VALUE overrides."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from configs import (
    ConfigError,
    apply_overrides,
    build,
    check_keys,
    float_keys,
    int_keys,
    load_yaml,
    refusal,
    text_keys,
)
from configs.origins import as_typed
from configs.userinput import path_word, shown
from data import DataConfig
from data.paths import DataError, expand_home
from model import GPTConfig
from model.config import short_int, unused_setting

# The config train.py runs without --config, found from the current folder or else beside train.py.
DEFAULT_CONFIG = "configs/tiny.yaml"
_PROJECT = Path(__file__).resolve().parents[1]
DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "float32", "bfloat16", "float16")
COMPILE = ("auto", "true", "false")
BACKENDS = ("auto", "gloo", "nccl")
OPTIMIZERS = ("adamw", "muon")
# More than any CPU has: OpenMP would try to start as many threads as asked, and torch overflows at 2**63.
MAX_THREADS = 4096
# The most threads a run may ask for each core it may use: beyond the cores they only take turns (tiny.yaml on 2 cores:
# 8 threads trained at less than half the rate of 2), and OpenMP starts every one asked for with a stack of its own:
# train.threads=4096 on 2 cores ran about 100 times slower, and under an 8 GB limit of memory (RLIMIT_DATA) the
# stacks left none for the run, which ended in a MemoryError traceback while reading its corpus.
THREADS_PER_CORE = 4


def cores_here() -> int:
    """The cores this process may run on (its affinity, which a container or taskset narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
# The longest sample logged at each evaluation. GPT.generate holds it as 8-byte ids: 10**10 characters asked 80 GB at
# the first evaluation, and the run ended there in a traceback, its steps since the last checkpoint lost.
MAX_SAMPLE_CHARS = 100_000
# Past 64 bits a count is none a run can reach, and TensorBoard's hyperparameters and the learning-rate schedule (float
# arithmetic) take none past float's range: a YAML file's 400-digit max_iters was an OverflowError traceback after the
# run had written its config.yaml.
MAX_COUNT = 2**63 - 1


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How to train: optimisation, schedule, evaluation, logging, hardware."""

    batch_size: int = field(default=32, metadata={"help": "sequences per micro-batch"})
    max_iters: int = field(default=2000, metadata={"help": "optimizer steps in the whole run"})
    learning_rate: float = field(default=1e-3, metadata={"help": "peak learning rate (after warmup)"})
    min_lr: float = field(default=1e-4, metadata={"help": "learning rate at the end of the cosine decay"})
    warmup_iters: int = field(default=100, metadata={
        "help": "steps of linear warmup to learning_rate: step s (from 0) takes (s+1)/(warmup_iters+1) of it"})
    lr_decay_iters: int | None = field(default=None, metadata={
        "help": "step where the cosine decay reaches min_lr (null = max_iters)"})
    decay_lr: bool = field(default=True, metadata={"help": "cosine-decay the learning rate (false = constant)"})
    optimizer: str = field(default="adamw", metadata={
        "help": "adamw, or muon: Muon for the blocks' weight matrices and AdamW for the rest (embeddings, biases, "
                "norms), with one learning_rate and weight_decay (training/optim.py)"})
    weight_decay: float = field(default=0.1, metadata={"help": "weight decay, applied to matrices only"})
    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1"})
    beta2: float = field(default=0.99, metadata={"help": "AdamW beta2"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the gradient norm to this (0 = no clipping)"})
    grad_accum_steps: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    ema_decay: float = field(default=0.0, metadata={
        "help": "keep an exponential moving average of the weights with this decay, which evaluations, best.pt and "
                "sampling use (0 = none)"})
    eval_interval: int = field(default=250, metadata={"help": "evaluate and save a checkpoint every N steps"})
    eval_iters: int = field(default=20, metadata={"help": "batches per split averaged at each evaluation"})
    log_interval: int = field(default=50, metadata={"help": "log training loss, lr, grad norm, tokens/s every N steps"})
    sample_chars: int = field(default=200, metadata={
        "help": "characters of sample text logged to TensorBoard at each evaluation (0 = none)"})
    tensorboard: bool = field(default=True, metadata={"help": "write TensorBoard logs into out_dir"})
    device: str = field(default="auto", metadata={"help": "auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps"})
    dtype: str = field(default="auto", metadata={
        "help": "auto, float32, bfloat16 or float16 (autocast); auto = bfloat16 on CUDA if supported (else float16), "
                "and on a CPU with native bfloat16 (AVX-512 BF16 or AMX) from n_embd 128; else float32"})
    compile: bool | str = field(default="auto", metadata={
        "help": "torch.compile the training step: auto (where the run is long enough to win the compile time "
                "back), true or false"})
    threads: int = field(default=0, metadata={
        "help": "CPU threads for torch (0 = torch's default; under torchrun, the cores shared out among processes); at "
                "most 4 for each core the process may use"})
    backend: str = field(default="auto", metadata={
        "help": "process group backend under torchrun: auto (nccl on CUDA, else gloo), gloo or nccl"})

    def __post_init__(self) -> None:
        positive = ("batch_size", "grad_accum_steps", "eval_interval", "eval_iters", "log_interval")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_iters", "warmup_iters", "sample_chars", "threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_COUNT:
                raise ValueError(f"train.{f.name} must be at most 2**63 - 1, got {short_int(value)}")
        if self.threads > MAX_THREADS:
            raise ValueError(f"train.threads must be at most {MAX_THREADS} (0 = torch's default), got {self.threads}")
        if self.sample_chars > MAX_SAMPLE_CHARS:
            raise ValueError(f"train.sample_chars must be at most {MAX_SAMPLE_CHARS:,} (the characters logged at each "
                             f"evaluation; sample.py writes longer texts), got {self.sample_chars:,}")
        for name in ("learning_rate", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"train.{name} must be a finite number >= 0, got {value}")
        if self.min_lr > self.learning_rate:
            raise ValueError(f"train.min_lr ({self.min_lr}) must not exceed train.learning_rate ({self.learning_rate})")
        if self.lr_decay_iters is not None and self.lr_decay_iters < 1:
            raise ValueError(f"train.lr_decay_iters must be >= 1 or null, got {self.lr_decay_iters}")
        if self.decay_lr and self.lr_decay_iters is not None and self.lr_decay_iters <= self.warmup_iters:
            # the rate would warm up to near its peak, then drop straight to min_lr: the cosine has no steps left
            raise ValueError(f"train.lr_decay_iters ({self.lr_decay_iters:,}) must be above train.warmup_iters "
                             f"({self.warmup_iters:,}), or the rate drops from its warmup straight to min_lr")
        for name in ("beta1", "beta2", "ema_decay"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"train.{name} must be in [0, 1), got {getattr(self, name)}")
        base = self.device.split(":")[0]
        if base not in DEVICES or (":" in self.device and (base != "cuda" or not self.device[5:].isdigit())):
            raise ValueError(f"train.device must be one of auto, cpu, cuda, cuda:N, mps; got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"train.dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if isinstance(self.compile, bool):  # YAML's true/false, and configs saved before auto existed
            object.__setattr__(self, "compile", str(self.compile).lower())
        if self.compile not in COMPILE:
            raise ValueError(f"train.compile must be one of {', '.join(COMPILE)}; got {self.compile!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"train.optimizer must be one of {', '.join(OPTIMIZERS)}; got {self.optimizer!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"train.backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One training run: where it writes, its seed, and the data, model and train sections."""

    out_dir: str | None = field(default=None, metadata={"path": True,
        "help": "folder for checkpoints, config.yaml and TensorBoard logs (default runs/<config file name>)"})
    seed: int = field(default=1337, metadata={
        "help": "seed for initialisation, batches and dropout (torch keeps its low 32 bits: seeds 2**32 apart give "
                "the same run)"})
    data: DataConfig = field(default_factory=DataConfig)
    model: GPTConfig = field(default_factory=GPTConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        if self.out_dir is not None and not self.out_dir.strip():
            # '' would mean the current folder: checkpoints and logs strewn among whatever is there
            raise ValueError("out_dir is empty; give a folder name, or leave it unset for runs/<config file name>")
        if self.out_dir is not None and (problem := out_dir_problem(self.out_dir, self.train.tensorboard)):
            raise ValueError(problem)
        if not -(2**63) <= self.seed < 2**63:  # torch seeds are 64-bit; a larger one fails deep inside torch
            raise ValueError(f"seed must fit in a signed 64-bit integer, got {self.seed}")


def out_dir_problem(out_dir: str, tensorboard: bool) -> str | None:
    """What makes out_dir no folder name a run can write into, in words; None when nothing does. Each was a traceback
    as the run began: a NUL character (a YAML escape, "\\x00") at the run folder's lock, a lone surrogate ("\\ud800")
    there too, and a name whose bytes are not UTF-8 (a Latin-1 'café', which Python holds as "\\udce9") in
    TensorBoard's writer, which takes only UTF-8 names, once config.yaml had been written."""
    # (each message within the 160 characters a config check's may take: configs.errors.CHECK_LIMIT)
    if "\0" in out_dir:
        return f"out_dir '{shown(out_dir, 40)}' is not a usable path (it holds a NUL character); choose another"
    try:
        os.fsencode(out_dir)
    except UnicodeEncodeError:
        return f"out_dir '{shown(out_dir, 40)}' holds a lone surrogate (half of a UTF-16 pair); choose another"
    try:
        out_dir.encode("utf-8")
    except UnicodeEncodeError:
        if tensorboard:  # the name's bytes as the shell shows them: caf\xe9
            name = os.fsencode(out_dir).decode("utf-8", "backslashreplace")
            return (f"out_dir '{shown(name, 40)}' is not UTF-8, which TensorBoard needs; choose another, or set "
                    f"train.tensorboard=false")
    return None


def load_config(config_path: str | None, overrides: list[str], base: dict | None = None,
                origin: str | None = None, resuming: bool = False) -> RunConfig:
    """Config file (or ``base``, a saved run config, which origin names in messages) plus dotted overrides ->
    validated RunConfig. resuming: the config of a --resume, which goes on with the settings its run was saved with
    (a setting its model does not use among them: see unused_setting)."""
    if config_path == "":  # `--config "$CFG"` with CFG unset: not a request for the default config
        raise ConfigError(f"--config is empty; give a config file, such as {DEFAULT_CONFIG} (or leave --config out)")
    path = config_path or DEFAULT_CONFIG
    if config_path is None and not Path(path).exists():  # run from another folder: the one beside this script
        path = str(_PROJECT / DEFAULT_CONFIG)
    # The counts' numbers as written (1.0e+18 exactly), and the reals' (1.0e-400, which YAML reads as 0.0)
    mapping = base if base is not None else load_yaml(path, as_written=text_keys(RunConfig),
                                                         exact=int_keys(RunConfig) | float_keys(RunConfig))
    where = f" (in {path})" if base is None else f" (in {origin})" if origin else ""
    # A misspelt key or a wrong type in the file is the file's, whatever the overrides: reported before them. The
    # checks that tie values together run on the merged config only, since a file may leave a value to the command
    # line (data.path in a template) or have one fixed there (model.n_head); their messages say where each came from.
    check_keys(RunConfig, mapping, where)
    merged = apply_overrides(mapping, overrides, RunConfig)
    cfg = build(RunConfig, merged, where)
    if base is None and not resuming and (unused := unused_setting(cfg.model)) is not None:
        raise refusal(RunConfig, merged, unused, where)
    if cfg.out_dir is None:
        cfg = replace(cfg, out_dir=str(Path("runs") / Path(path).stem))
    elif cfg.out_dir.startswith("~"):  # as data.path and data.cache_dir are: not a folder named '~' (or '~nouser')
        try:
            cfg = replace(cfg, out_dir=str(expand_home(cfg.out_dir, "out_dir")))
        except DataError as e:  # a setting of the config: said as every other bad one is, whoever reads the config
            raise ConfigError(str(e)) from None
    return replace(cfg, data=one_text(cfg.data, merged.given))


def one_text(data: DataConfig, given: dict[str, str]) -> DataConfig:
    """data with only one of data.path and data.dataset set, the one the run reads, so that config.yaml records what
    was trained on. The command line wins over the file, in either direction (data.path=null unsets the path, and
    the dataset stays); where neither or both came from it, data.path wins."""
    if data.path is None or data.dataset is None:
        return data
    if "data.path" in given and "data.dataset" in given:
        raise ConfigError(f"data.path and data.dataset are both given on the command line "
                          f"({as_typed(given['data.path'])} {as_typed(given['data.dataset'])}); give one of them")
    if "data.dataset" in given:
        return replace(data, path=None)
    return replace(data, dataset=None)


# The first line of the config.yaml a run writes: a config.yaml without it, in a folder that holds no run, is a
# person's own (their experiment's config kept in its folder), and no run replaces it.
CONFIG_MARK = b"# tinychar: the resolved config of the run in this folder; train.py rewrites this file\n"


def copied_run(config: Path, out_dir: Path) -> str | None:
    """Why `--resume --config DIR/config.yaml` must not go on, or None: that file is the config a run wrote in DIR,
    a folder that holds a checkpoint, but its out_dir names another (the folder DIR was copied or moved from): the
    resume would continue that other run, writing into it, where the person most likely meant the run in DIR."""
    here = config.parent
    try:
        with config.open("rb") as f:
            ours = f.readline(len(CONFIG_MARK)) == CONFIG_MARK
        if not ours or not any((here / n).is_file() for n in ("ckpt.pt", "best.pt")):
            return None
        if out_dir.exists() and here.samefile(out_dir):
            return None
    except OSError:  # unreadable, or no out_dir there: loading the run says what is wrong
        return None
    ours = f"to continue the run in '{shown(str(here))}', use --resume --out-dir {path_word(str(here))}"
    if not out_dir.exists():  # moved, or named relative to the folder the run started in
        return (f"--config '{shown(str(config))}' is the config of the run in '{shown(str(here))}', but its out_dir "
                f"'{shown(str(out_dir))}' names no folder from here (the run's folder was moved, or that path is "
                f"relative to the folder the run started in): {ours}")
    return (f"--config '{shown(str(config))}' is the config of the run in '{shown(str(here))}', but its out_dir is "
            f"'{shown(str(out_dir))}', the folder it was copied or moved from: {ours}; to continue the other, add "
            f"--out-dir {path_word(str(out_dir))}")
