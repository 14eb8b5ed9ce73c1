"""Train a character-level GPT.

    python train.py                                    # = --config configs/tiny.yaml
    python train.py --config configs/shakespeare_char_cpu.yaml train.max_iters=500 data.path=my.txt
    python train.py --resume                           # continue out_dir/ckpt.pt
    torchrun --standalone --nproc-per-node 2 train.py  # data-parallel over 2 processes (DDP)
    tensorboard --logdir runs

Config: a YAML file of sections (data, model, train) and top-level keys (out_dir, seed), then dotted
KEY=VALUE overrides. ``python train.py --help`` lists every key with its default and meaning.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import math
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Self

import torch
import yaml

from configs import ConfigError, apply_overrides, build, describe, flatten, load_yaml, to_dict
from data import CharTokenizer, DataConfig, DataError, get_batch, prepare_corpus, split_ids
from model import GPT, CheckpointError, GPTConfig, distributed, load_checkpoint, model_from_checkpoint, save_checkpoint
from model.checkpoint import write_atomic
from model.distributed import BACKENDS, Launch, LaunchError, derived_seed
from model.runtime import DeviceError, OneLineParser, autocast_context, matmul_ceiling, resolve_dtype

DEFAULT_CONFIG = "configs/tiny.yaml"
DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# More than any CPU has: OpenMP would try to start as many threads as asked, and torch overflows at 2**63.
MAX_THREADS = 4096
# What a checkpoint needs beyond the model and vocabulary (checked by load_checkpoint) for a run to continue from it.
TRAINING_STATE = ("config", "optimizer", "step", "best_val_loss", "rng")
# Temporary files that an atomic write killed midway leaves behind (see save_checkpoint and write_atomic).
STALE_TEMPORARY = (".ckpt.pt.*.tmp", ".best.pt.*.tmp", ".config.yaml.*.tmp")
# The streams of random numbers each process of a torchrun launch draws for itself (but rank 0, which uses the seed
# as a lone process does): derived_seed(seed, stream, rank), and derived_seed(seed, stream, rank, step) after a
# resume with another number of processes.
BATCHES, DROPOUT, EVALUATION = range(3)

# Keys a resumed run may change: they steer how long and how visibly it runs, not what it learns so far.
RESUMABLE_CHANGES = frozenset({
    "out_dir", "train.max_iters", "train.lr_decay_iters", "train.min_lr", "train.eval_interval",
    "train.eval_iters", "train.log_interval", "train.device", "train.dtype", "train.compile",
    "train.threads", "train.sample_chars", "train.tensorboard", "train.backend", "data.cache_dir",
})


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How to train: optimisation, schedule, evaluation, logging, hardware."""

    batch_size: int = field(default=32, metadata={"help": "sequences per micro-batch"})
    max_iters: int = field(default=2000, metadata={"help": "optimizer steps in the whole run"})
    learning_rate: float = field(default=1e-3, metadata={"help": "peak learning rate (after warmup)"})
    min_lr: float = field(default=1e-4, metadata={"help": "learning rate at the end of the cosine decay"})
    warmup_iters: int = field(default=100, metadata={"help": "steps of linear warmup from 0 to learning_rate"})
    lr_decay_iters: int | None = field(default=None, metadata={
        "help": "step where the cosine decay reaches min_lr (null = max_iters)"})
    decay_lr: bool = field(default=True, metadata={"help": "cosine-decay the learning rate (false = constant)"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay, applied to matrices only"})
    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1"})
    beta2: float = field(default=0.99, metadata={"help": "AdamW beta2"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the gradient norm to this (0 = no clipping)"})
    grad_accum_steps: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    eval_interval: int = field(default=250, metadata={"help": "evaluate and save a checkpoint every N steps"})
    eval_iters: int = field(default=20, metadata={"help": "batches per split averaged at each evaluation"})
    log_interval: int = field(default=50, metadata={"help": "log training loss, lr, grad norm, tokens/s every N steps"})
    sample_chars: int = field(default=200, metadata={
        "help": "characters of sample text logged to TensorBoard at each evaluation (0 = none)"})
    tensorboard: bool = field(default=True, metadata={"help": "write TensorBoard logs into out_dir"})
    device: str = field(default="auto", metadata={"help": "auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps"})
    dtype: str = field(default="auto", metadata={
        "help": "auto, float32, bfloat16 or float16 (autocast); auto = bfloat16 on CUDA if supported, else float32"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the model (slow start, faster steps)"})
    threads: int = field(default=0, metadata={
        "help": "CPU threads for torch (0 = torch's default; under torchrun, the cores shared out among processes)"})
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
        if self.threads > MAX_THREADS:
            raise ValueError(f"train.threads must be at most {MAX_THREADS} (0 = torch's default), got {self.threads}")
        for name in ("learning_rate", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"train.{name} must be a finite number >= 0, got {value}")
        if self.min_lr > self.learning_rate:
            raise ValueError(f"train.min_lr ({self.min_lr}) must not exceed train.learning_rate ({self.learning_rate})")
        if self.lr_decay_iters is not None and self.lr_decay_iters < 1:
            raise ValueError(f"train.lr_decay_iters must be >= 1 or null, got {self.lr_decay_iters}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"train.{name} must be in [0, 1), got {getattr(self, name)}")
        base = self.device.split(":")[0]
        if base not in DEVICES or (":" in self.device and (base != "cuda" or not self.device[5:].isdigit())):
            raise ValueError(f"train.device must be one of auto, cpu, cuda, cuda:N, mps; got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"train.dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"train.backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One training run: where it writes, its seed, and the data, model and train sections."""

    out_dir: str | None = field(default=None, metadata={
        "help": "folder for checkpoints, config.yaml and TensorBoard logs (default runs/<config file name>)"})
    seed: int = field(default=1337, metadata={"help": "seed for initialisation, batches and dropout"})
    data: DataConfig = field(default_factory=DataConfig)
    model: GPTConfig = field(default_factory=GPTConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        if self.out_dir is not None and not self.out_dir.strip():
            # '' would mean the current folder: checkpoints and logs strewn among whatever is there
            raise ValueError("out_dir is empty; give a folder name, or leave it unset for runs/<config file name>")
        if not -(2**63) <= self.seed < 2**63:  # torch seeds are 64-bit; a larger one fails deep inside torch
            raise ValueError(f"seed must fit in a signed 64-bit integer, got {self.seed}")


class UsageError(ValueError):
    """A request that cannot be carried out as asked; the message is one line for a person."""


class Diverged(RuntimeError):
    """The loss or gradient norm of a step stopped being finite; the step was not applied to the weights."""

    def __init__(self, step: int, loss: float, grad_norm: float, saved_step: int | None) -> None:
        super().__init__(f"step {step}: loss {loss:.4g}, gradient norm {grad_norm:.4g}")
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        self.saved_step = saved_step  # the step of out_dir/ckpt.pt, None when the run has written none


class SaveError(RuntimeError):
    """A checkpoint could not be written (disk full, folder not writable); the message is one line."""


class Stopped(Exception):
    """The run was asked to stop by a signal and has saved its state."""

    def __init__(self, signum: int, step: int) -> None:
        super().__init__(f"signal {signum} at step {step}")
        self.signum, self.step = signum, step


class StopSignals:
    """While active, Ctrl-C (SIGINT) and SIGTERM only ask the training loop to stop at the next step boundary,
    so the step in flight finishes and the checkpoint written after it is whole. A second signal while saving
    asks again and changes nothing. Outside the main thread (where handlers cannot be set) this does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: object) -> None:
        self.signal = self.signal or signum

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Interrupted(Exception):
    """Ctrl-C or SIGTERM outside the training loop, where there is nothing to save."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


class InterruptSignals(StopSignals):
    """While active, Ctrl-C (SIGINT) and SIGTERM raise Interrupted at once. For the work before the training loop
    (reading the data, building the model), which has nothing to save and should not keep anyone waiting, and so
    that SIGTERM there ends the run with a line and status 143 as it does during training."""

    def _handle(self, signum: int, frame: object) -> None:
        raise Interrupted(signum)


# ------------------------------------------------------------------------------------- several processes


class SharedFailure(Exception):
    """Under torchrun, a failure of one process that every process has agreed on (see agree): all of them stop with
    its exit status, and rank 0 prints its line (None for a bug, whose traceback the failing process prints)."""

    def __init__(self, rank: int, status: int, line: str | None) -> None:
        super().__init__(f"rank {rank} failed with status {status}")
        self.rank, self.status, self.line = rank, status, line


def agree(launch: Launch, error: Exception | None) -> None:
    """Collective under torchrun: every process learns whether any failed at this point and, if one did, all raise
    SharedFailure for the lowest failing rank, instead of some carrying on to wait for a partner that has gone. A bug
    is re-raised by the process that met it, for its traceback. Alone, a process simply raises its own error."""
    if not launch.torchrun:
        if error is not None:
            raise error
        return
    mine = None if error is None else (exit_status(error), failure_line(error, None, launch))
    failures = distributed.all_gather(mine)
    failed = next((rank for rank, failure in enumerate(failures) if failure is not None), None)
    if failed is None:
        return
    status, line = failures[failed]
    if line is None and failed == launch.rank:
        raise error
    raise SharedFailure(failed, status, line) from None


@contextlib.contextmanager
def agreeing(launch: Launch) -> Iterator[None]:
    """A block whose failure in any process stops every process when the block ends (see agree). Each process runs
    its own block, so there is one agreement per block in every process, whatever each one did inside it."""
    error = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every failure is shared, bugs included, so that no process is left waiting
        error = e
    agree(launch, error)


# ---------------------------------------------------------------------------------------------- config


def load_config(config_path: str | None, overrides: list[str], base: dict | None = None) -> RunConfig:
    """Config file (or ``base``, a saved run config) plus dotted overrides -> validated RunConfig."""
    path = config_path or DEFAULT_CONFIG
    if config_path is None and not Path(path).exists():  # run from another folder: the one beside this script
        path = str(Path(__file__).resolve().parent / DEFAULT_CONFIG)
    mapping = base if base is not None else load_yaml(path)
    where = "" if base is not None else f" (in {path})"
    build(RunConfig, mapping, where)  # report problems in the file before blaming the overrides
    cfg = build(RunConfig, apply_overrides(mapping, overrides, RunConfig), where)
    if cfg.out_dir is None:
        cfg = replace(cfg, out_dir=str(Path("runs") / Path(path).stem))
    cli_path = any(o.split("=", 1)[0].strip() == "data.path" for o in overrides)
    if cli_path and cfg.data.dataset is not None:
        # a data.path given on the command line wins over the config's built-in dataset
        cfg = replace(cfg, data=replace(cfg.data, dataset=None))
    return cfg


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, cosine decay, then min_lr."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
    decay_iters = cfg.lr_decay_iters if cfg.lr_decay_iters is not None else cfg.max_iters
    if step >= decay_iters:
        return cfg.min_lr
    progress = (step - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


# --------------------------------------------------------------------------------------------- hardware


def make_optimizer(model: GPT, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (linear weights, embeddings) and none on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # The fused kernel updates every parameter in one call: fewer kernel launches on CPU and CUDA alike.
    fused = device.type in ("cpu", "cuda")
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=fused)


# ------------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def estimate_loss(
    model: torch.nn.Module,
    splits: dict[str, torch.Tensor],
    block_size: int,
    batch_size: int,
    eval_iters: int,
    seed: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """Mean loss over eval_iters batches of each split, the same windows at every evaluation (a fixed seed),
    so the curves compare like with like. Batches are stacked into larger forward passes for speed."""
    was_training = model.training
    model.eval()
    windows = eval_iters * batch_size
    per_pass = max(batch_size, min(windows, 32768 // block_size))
    out = {}
    for name, data in splits.items():
        gen = torch.Generator().manual_seed(seed)
        total, count = 0.0, 0
        while count < windows:
            n = min(per_pass, windows - count)
            x, y = get_batch(data, block_size, n, gen, device)
            with autocast_context(device, dtype):
                _, loss = model(x, y)
            total += loss.item() * n
            count += n
        out[name] = total / count
    model.train(was_training)
    return out


# -------------------------------------------------------------------------------------------- logging


class Logger:
    """Progress to the terminal (a tqdm bar, or plain lines when output is not a terminal) and TensorBoard. A quiet
    Logger (every process of a torchrun launch but rank 0) shows and writes nothing."""

    def __init__(self, out_dir: Path, start: int, total: int, tensorboard: bool, progress: bool | None,
                 quiet: bool = False) -> None:
        self.quiet = quiet
        tensorboard = tensorboard and not quiet
        self.progress = False if quiet else sys.stderr.isatty() if progress is None else progress
        self.bar = None
        if self.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # TensorBoard hides every earlier event at or after purge_step: those a killed or stopped run logged
            # past its last checkpoint, which this run logs again. Events at `start` itself were written before
            # that checkpoint (see flush) and stay, unless this run logs `start` again (nothing left to train); a
            # fresh run owns every step, so a run that died before its first checkpoint leaves nothing behind.
            first = 0 if start == 0 else start + 1 if start < total else start
            self.writer = SummaryWriter(log_dir=str(out_dir), purge_step=first)

    def info(self, line: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def step(self, step: int, n: int, postfix: dict[str, str] | None = None) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def text(self, step: int, tag: str, text: str) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, step)

    def attention(self, step: int, model: GPT, ids: list[int], tokenizer: CharTokenizer) -> None:
        """The attention maps of every layer and head for a fixed prompt, as one image per evaluation."""
        if self.writer is None:
            return
        from model.attention_map import attention_grid_tensor, attention_weights, render_attention_grid

        chars = [tokenizer.chars[i] for i in ids]
        image = render_attention_grid(attention_weights(model, ids), chars, title=f"step {step}")
        self.writer.add_image("attention/layers_x_heads", attention_grid_tensor(image), step, dataformats="CHW")

    def hparams(self, cfg: RunConfig, params: int) -> None:
        if self.writer is None:
            return
        from torch.utils.tensorboard.summary import hparams

        flat = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in flatten(to_dict(cfg)).items()}
        flat["params"] = params
        for summary in hparams(flat, {"hparam/best_val_loss": float("nan")}):
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("config", "```\n" + yaml.safe_dump(to_dict(cfg), sort_keys=False) + "```", 0)

    def flush(self) -> None:
        """Put every event logged so far into the file (not only the writer's queue)."""
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()


def sample_text(model: GPT, tokenizer: CharTokenizer, n_chars: int, seed: int, device: torch.device) -> str:
    """A short sample from the model for the logs, from a newline prompt, reproducible by seed."""
    start = "\n" if "\n" in tokenizer.chars else tokenizer.chars[0]
    idx = torch.tensor([tokenizer.encode(start)], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    out = model.generate(idx, n_chars, temperature=1.0, top_k=None, generator=gen)
    model.train(was_training)
    return tokenizer.decode(out[0].tolist())


# ------------------------------------------------------------------------------------------ the run


def prepare_out_dir(out_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to clobber a finished run; clear an old one only when asked to."""
    existing = [p for p in (out_dir / "ckpt.pt", out_dir / "best.pt") if p.exists()]
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"out_dir '{out_dir}' exists and is not a folder; choose another out_dir")
    if resume:
        return
    if existing and not overwrite:
        raise UsageError(f"'{out_dir}' already holds a run ({existing[0].name}); continue it with --resume, "
                         f"choose another out_dir=..., or start afresh with --overwrite")


def rank_rng_state(gen: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    """This process's random state: dropout's (torch's, and its GPU's on CUDA) and its batch generator's."""
    state = {"torch": torch.get_rng_state(), "batches": gen.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def checkpoint_payload(model: GPT, optimizer, scaler, tokenizer, cfg: RunConfig, step: int, best_val: float,
                       gen: torch.Generator, ranks: list[dict[str, torch.Tensor]] | None = None) -> dict[str, Any]:
    """Everything a run needs to continue. ranks: every process's rank_rng_state, in rank order, under torchrun; the
    top-level RNG states are this process's (rank 0's), where a one-process run keeps its own."""
    rng = {"torch": torch.get_rng_state(), "batches": gen.get_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    world_size = len(ranks) if ranks else 1
    if world_size > 1:
        rng["per_rank"] = ranks
    return {
        "model": model.state_dict(),
        "model_config": model.config.to_dict(),
        "vocab": list(tokenizer.chars),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "step": step,
        "best_val_loss": best_val,
        "config": to_dict(cfg),
        "rng": rng,
        "world_size": world_size,  # for information: a run resumes with any number of processes
    }


def check_training_state(payload: dict, path: Path) -> None:
    """Refuse, in one line, a checkpoint that cannot be continued: weights only, or damaged in a way that would
    otherwise surface as a traceback halfway through setting the run up."""
    model_from_checkpoint(payload, path)  # vocabulary, model config and weights fit together
    missing = [key for key in TRAINING_STATE if key not in payload]
    if "config" in missing or "optimizer" in missing:
        raise CheckpointError(f"{path} holds weights only (no training state); it cannot be resumed")
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}; it is damaged and cannot be resumed")
    rng = payload["rng"]
    if not isinstance(payload["config"], dict) or not isinstance(rng, dict) or not {"torch", "batches"} <= set(rng):
        raise CheckpointError(f"{path} has a damaged run config or RNG state; it cannot be resumed")


# What a checkpoint that does not fit the run it describes makes torch or the code below raise.
DAMAGED = (RuntimeError, ValueError, TypeError, KeyError, IndexError)


def damaged(path: Path, e: Exception) -> CheckpointError:
    first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
    return CheckpointError(f"{path} does not fit the run it describes ({first}); it is damaged and cannot be resumed")


def restore_training_state(payload: dict, model: GPT, optimizer, scaler, path: Path) -> tuple[int, float]:
    """Load weights, optimizer and scaler from a checkpoint into a freshly built run; (step, best_val)."""
    try:
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
        if scaler is not None and payload.get("scaler"):
            scaler.load_state_dict(payload["scaler"])
        return int(payload["step"]), float(payload["best_val_loss"])
    except DAMAGED as e:
        raise damaged(path, e) from None


def restore_rng(payload: dict, gen: torch.Generator, launch: Launch, device: torch.device, seed: int,
                path: Path) -> bool:
    """Put this process's random state back as the checkpoint saved it, for a run with as many processes as the one
    that saved it (True). With another number, there is no such state to take: each process reseeds its batches and
    dropout from (seed, rank, step) instead, so the run goes on reproducibly but not as it would have (False)."""
    try:
        saved_world = int(payload.get("world_size", 1))
        rng = payload["rng"]
        if saved_world != launch.world_size:
            step = int(payload["step"])
            gen.manual_seed(derived_seed(seed, BATCHES, launch.rank, step))
            torch.manual_seed(derived_seed(seed, DROPOUT, launch.rank, step))
            return False
        if saved_world == 1:
            torch.set_rng_state(rng["torch"])
            gen.set_state(rng["batches"])
            if torch.cuda.is_available() and "cuda" in rng:
                torch.cuda.set_rng_state_all(rng["cuda"])
            return True
        if len(rng["per_rank"]) != saved_world:
            raise ValueError(f"{len(rng['per_rank'])} per-process RNG states for {saved_world} processes")
        mine = rng["per_rank"][launch.rank]
        torch.set_rng_state(mine["torch"])
        gen.set_state(mine["batches"])
        if device.type == "cuda" and "cuda" in mine:
            torch.cuda.set_rng_state(mine["cuda"], device)
        return True
    except DAMAGED as e:
        raise damaged(path, e) from None


def check_resume_config(saved: dict, cfg: RunConfig) -> list[str]:
    """Keys whose change a resume accepts are returned as 'key: old -> new'; any other change is refused."""
    old, new = flatten(saved), flatten(to_dict(cfg))
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    refused = [k for k in changed if k not in RESUMABLE_CHANGES]
    if refused:
        shown = ", ".join(f"{k} ({old.get(k)!r} -> {new.get(k)!r})" for k in refused[:4])
        raise UsageError(f"cannot resume with a changed {shown}: these define the model, data or optimisation of "
                         f"the saved run; start a new run in another out_dir instead")
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed if k != "out_dir"]


def run(cfg: RunConfig, *, resume: bool = False, overwrite: bool = False, progress: bool | None = None,
        payload: dict | None = None, launch: Launch | None = None) -> dict[str, float]:
    """Train as cfg says; returns the final losses. Raises UsageError/DataError/... for bad input.

    launch: this process's place among the processes of a torchrun launch, whose group it has joined (None: alone).
    Every process runs this function; where one of them could fail alone, they agree before going on (agreeing).
    """
    t_start = time.perf_counter()
    launch = launch or Launch()
    out_dir = Path(cfg.out_dir)
    tc, block_size = cfg.train, cfg.model.block_size

    def read_corpus() -> Any:
        # Encoded once into a cache and memory-mapped; a resumed run encodes with the vocabulary its model knows.
        return prepare_corpus(cfg.data, min_chars=block_size + 1, progress=progress is not False and launch.main,
                              vocab=payload["vocab"] if payload is not None else None)

    # The first process on each machine reads the corpus (downloading or encoding it into the cache if need be)
    # while the others wait, then they map the cached file: not every process encoding the same text at once.
    with agreeing(launch):
        prepare_out_dir(out_dir, resume, overwrite)  # every process checks; rank 0 alone writes, further down
        device = distributed.rank_device(tc.device, launch)
        dtype = resolve_dtype(tc.dtype, device, cfg.model.n_embd)
        if tc.threads:
            torch.set_num_threads(tc.threads)
        elif launch.torchrun:  # torchrun gives each process one thread unless OMP_NUM_THREADS says otherwise
            torch.set_num_threads(distributed.threads_per_process(launch))
        corpus = read_corpus() if launch.local_rank == 0 else None
    with agreeing(launch):
        if corpus is None:
            corpus = read_corpus()
        tokenizer = corpus.tokenizer()
        ids = corpus.ids_on(device) if device.type == "cuda" else corpus.ids  # uint8/16/32; get_batch widens windows
        train_ids, val_ids = split_ids(ids, cfg.data.val_fraction, block_size)

        torch.manual_seed(cfg.seed)  # the same initial weights in every process (and DDP broadcasts rank 0's)
        model_cfg = replace(cfg.model, vocab_size=tokenizer.vocab_size)
        model = GPT(model_cfg).to(device)
        optimizer = make_optimizer(model, tc, device)
        scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
        # Each process draws its own batches and dropout masks; rank 0 uses the seed itself, as a lone process does.
        gen = torch.Generator().manual_seed(cfg.seed if launch.main else derived_seed(cfg.seed, BATCHES, launch.rank))
        if not launch.main:
            torch.manual_seed(derived_seed(cfg.seed, DROPOUT, launch.rank))
        step, best_val, reseeded = 0, float("inf"), False
        if payload is not None:
            step, best_val = restore_training_state(payload, model, optimizer, scaler, out_dir / "ckpt.pt")
            reseeded = not restore_rng(payload, gen, launch, device, cfg.seed, out_dir / "ckpt.pt")

    # Everything is checked in every process: from here on rank 0 writes into out_dir.
    with agreeing(launch):
        if launch.main:
            try:
                out_dir.mkdir(parents=True, exist_ok=True)
                for pattern in STALE_TEMPORARY:  # this run owns out_dir now; no other writer can be midway
                    for stale in out_dir.glob(pattern):
                        stale.unlink(missing_ok=True)
                if overwrite and not resume:
                    for old in [out_dir / "ckpt.pt", out_dir / "best.pt", *out_dir.glob("events.out.tfevents.*")]:
                        old.unlink(missing_ok=True)
                resolved = yaml.safe_dump(to_dict(cfg), sort_keys=False).encode("utf-8")
                write_atomic(out_dir / "config.yaml", lambda f: f.write(resolved))
            except (OSError, ValueError) as e:  # ValueError: a NUL character in the path
                reason = e.strerror if isinstance(e, OSError) and e.strerror else e
                raise UsageError(f"cannot write into out_dir '{out_dir}' ({reason}); choose another out_dir") from None

    fwd = torch.compile(model) if tc.compile else model
    if launch.torchrun:
        fwd = distributed.data_parallel(fwd, device)
    splits = {"train": train_ids, "val": val_ids}
    params = model.num_params()
    log = Logger(out_dir, step, tc.max_iters, tc.tensorboard, progress, quiet=not launch.main)
    log.info(f"data: {corpus.description}")
    for note in corpus.notes:
        log.info(note)
    log.info(f"model: {params / 1e6:.2f}M parameters; device {device}, {str(dtype).replace('torch.', '')}"
             + (", compiled" if tc.compile else ""))
    world = launch.world_size
    tokens_per_step = tc.batch_size * block_size * tc.grad_accum_steps * world
    # MFU: the model's FLOPs per second over what this machine's matrix multiply does in the run's dtype
    # (measured here in a fraction of a second, as in bench.py), summed over the processes.
    flops_per_token = model.flops_per_token()
    ceiling = matmul_ceiling(device, dtype, seconds=0.2) * world
    log.info(f"matrix-multiply ceiling {ceiling / 1e9:,.0f} GFLOP/s ({str(dtype).replace('torch.', '')}), "
             f"{flops_per_token / 1e3:,.0f} kFLOP per trained token")
    log.info(f"global batch: {world} process{'es' if world > 1 else ''} x {tc.batch_size} sequences x "
             f"{tc.grad_accum_steps} micro-batch{'es' if tc.grad_accum_steps > 1 else ''} = "
             f"{tc.batch_size * tc.grad_accum_steps * world:,} sequences ({tokens_per_step:,} tokens) per step")
    if resume:
        log.info(f"resuming {out_dir / 'ckpt.pt'} at step {step}")
    if reseeded:
        saved = int(payload.get("world_size", 1))
        log.info(f"resume: the checkpoint was saved by {saved} process{'es' if saved > 1 else ''} and this run has "
                 f"{world}: each process draws its batches afresh from (seed, rank, step), so the batch order "
                 f"differs from that of an uninterrupted run")
    if step == 0:
        log.hparams(cfg, params)
    # A fixed stretch of validation text whose attention maps TensorBoard shows at every evaluation.
    attention_prompt = val_ids[:block_size].tolist()

    timing = {"eval": 0.0}
    val_history: list[tuple[float, float]] = []  # (seconds since start, validation loss)
    last_losses: dict[str, float] = {}
    saved_step = step if payload is not None else None  # the step out_dir/ckpt.pt holds
    eval_seed = cfg.seed + 1 if launch.main else derived_seed(cfg.seed, EVALUATION, launch.rank)

    def save(step: int, improved: bool) -> None:
        nonlocal saved_step
        ranks = distributed.all_gather(rank_rng_state(gen, device)) if launch.torchrun else None
        with agreeing(launch):  # rank 0 writes; should that fail, every process stops
            if not launch.main:
                return
            state = checkpoint_payload(model, optimizer, scaler, tokenizer, cfg, step, best_val, gen, ranks)
            # The curves up to this step reach the disk before the checkpoint does, so a run killed after saving
            # and resumed from here shows no gap in TensorBoard (the resumed run logs only the steps after this one).
            log.flush()
            try:
                save_checkpoint(state, out_dir / "ckpt.pt")
                saved_step = step
                if improved:
                    save_checkpoint(state, out_dir / "best.pt")
            except OSError as e:
                raise SaveError(f"cannot write a checkpoint into '{out_dir}' ({e.strerror or e}); the previous "
                                f"checkpoint there is intact. Free some space or choose another out_dir") from None

    def evaluate_and_save(step: int) -> None:
        nonlocal best_val
        t0 = time.perf_counter()
        losses = estimate_loss(model, splits, block_size, tc.batch_size, tc.eval_iters, eval_seed, device, dtype)
        if launch.torchrun:  # each process evaluated windows of its own; the run's loss is the mean over them
            losses = dict(zip(losses, distributed.mean(list(losses.values()), device), strict=True))
        improved = losses["val"] < best_val
        best_val = min(best_val, losses["val"])
        log.scalars(step, {"loss/train": losses["train"], "loss/val": losses["val"], "hparam/best_val_loss": best_val})
        log.info(f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
                 + (" (best)" if improved else ""))
        if log.writer is not None:  # rank 0 alone, on the model itself: nothing here may wait for the others
            if tc.sample_chars:
                sample = sample_text(model, tokenizer, tc.sample_chars, cfg.seed, device)
                log.text(step, "sample", "```\n" + sample + "\n```")
            log.attention(step, model, attention_prompt, tokenizer)
        save(step, improved)
        last_losses.update(losses)
        val_history.append((time.perf_counter() - t_start, losses["val"]))
        timing["eval"] += time.perf_counter() - t0

    t_log, steps_since_log = time.perf_counter(), 0
    stop = StopSignals()
    agreed_stop = False  # under torchrun: whether the processes agreed, at the end of the last step, to stop

    def stopping() -> bool:
        # Under torchrun only the agreement counts: a process that saw a signal after it must not stop a step before
        # the others, who would then wait for it in vain.
        return agreed_stop if launch.torchrun else stop.signal is not None

    model.train()
    # The handlers stay until the end of the run, so a signal while the logs are closed cannot cut that short.
    with stop:
        try:
            while step < tc.max_iters and not stopping():
                lr = lr_at(step, tc)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                loss_sum = 0.0
                for micro in range(tc.grad_accum_steps):
                    x, y = get_batch(train_ids, block_size, tc.batch_size, gen, device)
                    # Under DDP, backward all-reduces the gradients only on the last micro-batch of a step: the
                    # earlier ones accumulate in each process, and the last all-reduce carries their sum.
                    with distributed.local_only(fwd, micro < tc.grad_accum_steps - 1):
                        with autocast_context(device, dtype):
                            _, loss = fwd(x, y)
                        loss = loss / tc.grad_accum_steps
                        loss_sum += loss.detach()
                        (scaler.scale(loss) if scaler is not None else loss).backward()
                if scaler is not None:
                    scaler.unscale_(optimizer)
                max_norm = tc.grad_clip if tc.grad_clip > 0 else math.inf
                # Under DDP the gradients are already averaged over the processes: the same norm in every one.
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if launch.torchrun:  # the mean loss (so all judge divergence alike) and whether to stop after this step
                    loss_sum, agreed_stop = distributed.step_consensus(loss_sum, stop.signal is not None)
                # Checked before the update, so a non-finite step never reaches the weights. (With float16 the
                # gradient scaler skips such steps itself and lowers its scale.)
                if scaler is None and not (torch.isfinite(loss_sum) and torch.isfinite(grad_norm)):
                    raise Diverged(step + 1, float(loss_sum), float(grad_norm), saved_step)
                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                steps_since_log += 1
                if step % tc.log_interval == 0 or step == tc.max_iters:
                    now = time.perf_counter()
                    tok_s = tokens_per_step * steps_since_log / max(now - t_log, 1e-9)
                    loss_value = float(loss_sum)
                    mfu = flops_per_token * tok_s / ceiling
                    log.scalars(step, {"loss/train_step": loss_value, "lr": lr, "grad_norm": float(grad_norm),
                                       "tokens_per_sec": tok_s, "mfu": mfu})
                    log.step(step, steps_since_log, {"loss": f"{loss_value:.4f}", "lr": f"{lr:.2e}",
                                                     "tok/s": f"{tok_s:,.0f}", "mfu": f"{mfu:.1%}"})
                    if not log.progress:
                        log.info(f"step {step}/{tc.max_iters}: loss {loss_value:.4f}, lr {lr:.2e}, "
                                 f"{tok_s:,.0f} tokens/s, MFU {mfu:.1%}")
                    t_log, steps_since_log = time.perf_counter(), 0
                if step % tc.eval_interval == 0 or step == tc.max_iters:
                    evaluate_and_save(step)
                    t_log = time.perf_counter()  # evaluation time is not training throughput
            if stopping():
                if not last_losses or step % tc.eval_interval:  # not saved at this step yet
                    save(step, improved=False)
                # a process that saw no signal itself stops because another did: as if sent SIGTERM
                raise Stopped(stop.signal or signal.SIGTERM, step)
            if not last_losses:  # nothing to train (resumed at the end, or max_iters=0): still report
                evaluate_and_save(step)
        finally:
            log.close()
            if launch.torchrun:
                # DDP goes before the process group does: left to the interpreter's exit, it sometimes aborts the
                # process ("terminate called without an active exception"; seen with torch 2.13 and gloo).
                fwd = None
                gc.collect()
        elapsed = time.perf_counter() - t_start
        if launch.main:
            print(f"done: step {step}, val loss {last_losses['val']:.4f} (best {best_val:.4f}) in {elapsed:.1f}s; "
                  f"sample with: python sample.py --out-dir {shlex.quote(str(out_dir))}", flush=True)
    return {**last_losses, "best_val": best_val, "seconds": elapsed, "eval_seconds": timing["eval"],
            "val_history": val_history, "step": step}


# ------------------------------------------------------------------------------------------ command line


def help_epilog() -> str:
    rows = describe(RunConfig)
    shown = ["null" if d is None else str(d).lower() if isinstance(d, bool) else str(d) for _, d, _ in rows]
    key_width, value_width = max(len(key) for key, _, _ in rows), max(len(v) for v in shown)
    lines = ["config keys (set in the YAML file or as KEY=VALUE overrides):"]
    for (key, _, meaning), value in zip(rows, shown, strict=True):
        lines.append(f"  {key:<{key_width}}  {value:<{value_width}}  {meaning}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(
        prog="train.py",
        description="Train a character-level GPT on a text file.",
        epilog=help_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", default=None, help=f"YAML config file (default {DEFAULT_CONFIG})")
    parser.add_argument("--resume", action="store_true", help="continue the run saved in out_dir/ckpt.pt")
    parser.add_argument("--overwrite", action="store_true", help="start afresh even if out_dir holds a run")
    parser.add_argument("--out-dir", default=None, help="same as the override out_dir=DIR")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.max_iters=500")
    args = parser.parse_intermixed_args(argv)  # overrides may come before and after the flags
    if args.resume and args.overwrite:
        parser.error("--resume and --overwrite contradict each other; choose one")
    if args.out_dir is not None:
        args.overrides = [*args.overrides, f"out_dir={args.out_dir}"]
    return args


def divergence_advice(e: Diverged, cfg: RunConfig) -> str:
    """One line: the step that went non-finite, what was kept, and what to change."""
    ckpt = Path(cfg.out_dir) / "ckpt.pt"
    kept = (f"the last good checkpoint {ckpt} (step {e.saved_step}) is untouched" if e.saved_step is not None
            else "no checkpoint had been written yet")
    tries = ["a lower train.learning_rate", "a longer train.warmup_iters"]
    if cfg.train.grad_clip == 0:
        tries.append("train.grad_clip=1.0")
    if cfg.train.dtype != "float32":
        tries.append("train.dtype=float32")
    # The same state and batches would diverge again, and a resume may not change the learning rate: a new run.
    return (f"training diverged at step {e.step} (loss {e.loss:.4g}, gradient norm {e.grad_norm:.4g}) and stopped "
            f"before updating the weights; {kept}. Try {', '.join(tries[:-1])} or {tries[-1]}, in a new run "
            f"(another out_dir, or --overwrite)")


# Bad input: the person running the command can fix it (exit status 2).
INPUT_ERRORS = (ConfigError, DataError, CheckpointError, DeviceError, UsageError, LaunchError)


def exit_status(e: Exception) -> int:
    """2 for bad input, 128 + the signal for a stop (130 for Ctrl-C, 143 for SIGTERM, as shells report them), 1 for
    anything else."""
    if isinstance(e, INPUT_ERRORS):
        return 2
    if isinstance(e, (Stopped, Interrupted)):
        return 128 + e.signum
    if isinstance(e, SharedFailure):
        return e.status
    return 1


def resume_command(out_dir: str, launch: Launch) -> str:
    """The command that continues this run, with as many processes (so that it continues exactly)."""
    tail = f"train.py --out-dir {shlex.quote(out_dir)} --resume"
    if not launch.torchrun:
        return f"python {tail}"
    if launch.local_world_size == launch.world_size:
        return f"torchrun --standalone --nproc-per-node {launch.world_size} {tail}"
    return f"torchrun, with the options this run had, on every machine: {tail}"


def failure_line(e: Exception, cfg: RunConfig | None, launch: Launch) -> str | None:
    """The one line a failure is reported with; None for a bug (its traceback says more), '' for nothing to say."""
    if isinstance(e, SharedFailure):
        if e.line is None:  # a bug in another process, which prints its traceback
            return ""
        return e.line if e.rank == 0 else e.line.replace("error: ", f"error: rank {e.rank}: ", 1)
    if isinstance(e, (*INPUT_ERRORS, SaveError)):
        return f"error: {e}"
    if isinstance(e, Diverged):  # not bad input: the run itself went wrong
        return f"error: {divergence_advice(e, cfg)}"
    if isinstance(e, Stopped):
        return (f"stopped at step {e.step}: saved {Path(cfg.out_dir) / 'ckpt.pt'}; continue with: "
                f"{resume_command(cfg.out_dir, launch)}")
    if isinstance(e, Interrupted):
        return f"interrupted ({signal.Signals(e.signum).name}) before training started; nothing was saved"
    if launch.torchrun and (reason := distributed.lost_peer(e)):
        return (f"error: lost contact with another process of the run ({reason}); what ended it is in its own "
                f"output or torchrun's report")
    return None


def load_run(args: argparse.Namespace, announce: bool) -> tuple[RunConfig, dict | None]:
    """The run's config and, for --resume, the checkpoint it continues (checked); announce prints what a resume
    changes."""
    cfg = load_config(args.config, args.overrides)
    payload = None
    if args.resume:
        ckpt = Path(cfg.out_dir) / "ckpt.pt"
        if not ckpt.exists():
            raise UsageError(f"nothing to resume: no {ckpt}; start the run without --resume")
        payload = load_checkpoint(ckpt)
        check_training_state(payload, ckpt)
        if args.config is None:  # no config named: continue with the saved one
            cfg = load_config(None, args.overrides, base=payload["config"])
        for change in check_resume_config(payload["config"], cfg):
            if announce:
                print(f"resume: {change}", flush=True)
    return cfg, payload


def main(argv: list[str] | None = None, progress: bool | None = None) -> int:
    try:
        launch = distributed.launch_from_env()
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as quiet:
        if not launch.main:  # every process has the same command line: rank 0 answers --help or refuses a bad one
            quiet.enter_context(contextlib.redirect_stdout(io.StringIO()))
            quiet.enter_context(contextlib.redirect_stderr(io.StringIO()))
        args = parse_args(argv)
    cfg = None
    try:
        with InterruptSignals():
            failure, payload, backend, device = None, None, "gloo", torch.device("cpu")
            try:
                cfg, payload = load_run(args, announce=launch.main)
                if launch.torchrun:
                    device = distributed.rank_device(cfg.train.device, launch)
                    backend = distributed.resolve_backend(cfg.train.backend, device)
            except Exception as e:
                if not launch.torchrun:
                    raise
                failure = e  # said once, by rank 0, when the processes have joined and agree on it
            with distributed.joined(launch, backend, device):
                agree(launch, failure)
                run(cfg, resume=args.resume, overwrite=args.overwrite, progress=progress, payload=payload,
                    launch=launch)
    except Exception as e:
        line = failure_line(e, cfg, launch)
        if line is None:
            raise  # a bug
        # Under torchrun every process gets here for a shared failure, a stop or a divergence; one line is enough.
        if line and launch.main:
            print(line, file=sys.stderr)
        return exit_status(e)
    return 0


if __name__ == "__main__":
    # Outside main's own handlers, Ctrl-C and SIGTERM are ignored: main has then either not begun (it is reading its
    # arguments) or said all it has to say, and a second Ctrl-C while the interpreter shuts down (torch's exit
    # handlers take a moment) would only print a traceback from inside one of them.
    for sig in StopSignals.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(main())
