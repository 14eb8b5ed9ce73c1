"""A training run from its config: check out_dir, read the corpus, check that the run fits in memory, build or
restore the model and optimizer, claim out_dir, and hand the state to a Trainer."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from configs import flatten, to_dict
from configs.userinput import path_word, script_word, shell_word, shown
from data import Corpus, DataError, prepare_corpus, split_ids
from data.paths import quoted
from model import build_model
from model.config import parameters_text
from model.linear import onednn_min_macs

from . import distributed, eager_kernels
from .ceiling import early_ceiling, layers_kernel, machine_ceiling
from .checkpoints import LOADED_FROM, restore_best
from .compile_cache import user_cache_problem
from .config import RunConfig
from .devices import cpu_has_fast_float16, resolve_dtype
from .distributed import BATCHES, DROPOUT, derived_seed
from .engine import choose_engine, compile_blocks, start_engine, warm_enabled
from .errors import UsageError, agreeing
from .evaluation import eval_pass_sequences, evaluation_note, step_note
from .launch import Launch
from .logger import Logger
from .loop import Trainer
from .memory import check_fits, training_need, vocabulary_advice
from .optim import make_optimizer, muon_matrices
from .outdir import claim_out_dir, drop_aside, prepare_out_dir, restore_aside


@dataclass(frozen=True)
class Start:
    """What a run starts from: the corpus, and where the model and its numbers live."""

    corpus: Corpus
    device: torch.device
    dtype: torch.dtype


def run(cfg: RunConfig, *, resume: bool = False, overwrite: bool = False, progress: bool | None = None,
        payload: dict | None = None, launch: Launch | None = None) -> dict[str, float]:
    """Train as cfg says; returns the final losses and timings. Raises UsageError/DataError/... for bad input.

    payload: the checkpoint a resume continues (checked by load_run). launch: this process's place among the
    processes of a torchrun launch, whose group it has joined (None: alone). Every process runs this function;
    where one of them could fail alone, they agree before going on (agreeing).
    """
    started = time.perf_counter()
    launch = launch or Launch()
    out_dir = Path(cfg.out_dir)
    start = prepare(cfg, resume=resume, overwrite=overwrite, progress=progress, payload=payload, launch=launch)
    distributed.check_same_run(launch, cfg, resume, start.corpus.fingerprint, payload)  # before DDP, out_dir's claim
    trainer = build_trainer(cfg, start, payload, launch)
    # Everything is checked in every process: from here on rank 0 holds out_dir's lock and writes into it.
    lock, replaced = None, None
    with agreeing(launch):
        if launch.main:
            lock, replaced = claim_out_dir(out_dir, cfg, resume=resume, overwrite=overwrite,
                                           loaded=payload.get(LOADED_FROM) if payload else None)
    if replaced is not None:
        trainer.after_first_save = partial(drop_aside, out_dir)
    # rank 0 alone moved the old run aside; a stop must end every process alike (saving is collective)
    trainer.replacing = distributed.all_gather(replaced is not None)[0] if launch.torchrun else replaced is not None
    try:
        stats = train_prepared(trainer, start, payload, resume=resume, progress=progress, started=started,
                               replaced=replaced)
    finally:
        try:
            if trainer.log is not None:
                trainer.log.close()
        finally:
            if replaced is not None and trainer.saved_step is None:  # ended before its first checkpoint
                restore_aside(out_dir)
            if lock is not None:
                lock.release()
    if launch.main:
        trainer.log.info(f"done: step {trainer.step}, val loss {stats['val']:.4f} (best {trainer.best_val:.4f}) in "
                         f"{stats['seconds']:.1f}s; sample with: python {script_word('sample.py')} --out-dir "
                         f"{path_word(cfg.out_dir)}")
    return stats


def train_prepared(trainer: Trainer, start: Start, payload: dict | None, *, resume: bool, progress: bool | None,
                   started: float, replaced: str | None) -> dict[str, float]:
    """Compile and wrap the model as asked, give the trainer its logger and yardstick, say how the run starts, and
    train."""
    cfg, launch = trainer.cfg, trainer.launch
    engine = choose_engine(trainer, payload, start.device)
    if engine.kind == "blocks":  # compiled by start_engine, on one batch; DDP wraps the compiled blocks after that
        compile_blocks(trainer.model)
    log = Logger(Path(cfg.out_dir), trainer.step, cfg.train.max_iters, cfg.train.tensorboard, progress,
                 quiet=not launch.main, on_closed=partial(trainer.stop.request, signal.SIGPIPE),
                 resumed=payload is not None)
    trainer.attach(log, start.corpus.tokenizer(), started)
    # What the step's length is told by (announce's step note) until the engine has given the layers their products
    # and MFU's yardstick is settled (settle_ceiling): the machine's kept best, or for a step that might take an hour,
    # PyTorch's products timed now.
    per_process = trainer.flops_per_token * trainer.tokens_per_step / launch.world_size
    trainer.ceiling = early_ceiling(start.device, start.dtype, per_process) * launch.world_size
    if replaced is not None:
        log.info(replaced)
    if launch.main and payload is not None and (repaired := restore_best(Path(cfg.out_dir), payload)):
        log.info(repaired)
    announce(trainer, start, payload, resume)
    start_engine(trainer, engine, log.info)
    settle_ceiling(trainer, start)
    trainer.settled = settled_setup(trainer, engine.kind)
    if launch.main and payload is not None and (inexact := inexact_resume(payload, trainer)):
        log.info(inexact)
    if launch.torchrun:  # after the blocks' compile, whose trial backward must not reduce
        trainer.fwd = distributed.data_parallel(trainer.fwd, start.device)
    return trainer.fit()


def settle_ceiling(trainer: Trainer, start: Start) -> None:
    """MFU's yardstick: the model's FLOPs a second are measured against the fastest matrix multiply this machine was
    seen to run in the run's dtype (training/ceiling.py; tinychar's linear kernel among the products where the engine
    gave it to the layers), summed over the processes; and the line that says it."""
    float32_cpu = start.device.type == "cpu" and start.dtype == torch.float32
    flops, words = machine_ceiling(start.device, start.dtype, layers_kernel(trainer.model) if float32_cpu else None)
    trainer.ceiling = flops * trainer.launch.world_size
    dtype = str(start.dtype).replace("torch.", "")
    trainer.log.info(f"matrix-multiply ceiling {trainer.ceiling / 1e9:,.0f} GFLOP/s ({dtype}; {words}), "
                     f"{trainer.flops_per_token / 1e3:,.0f} kFLOP per trained token")


def prepare(cfg: RunConfig, *, resume: bool, overwrite: bool, progress: bool | None, payload: dict | None,
            launch: Launch) -> Start:
    """Check out_dir, choose the device, dtype and threads, and read the corpus, in every process."""
    tc, block_size = cfg.train, cfg.model.block_size

    def read_corpus() -> Corpus:
        # Encoded once into a cache and read from it; a resumed run encodes with the vocabulary its model knows.
        try:
            return prepare_corpus(cfg.data, min_chars=block_size + 1, progress=progress is not False and launch.main,
                                  vocab=payload["vocab"] if payload is not None else None,
                                  trained_on=payload.get("data_fingerprint") if payload is not None else None,
                                  out_dir=cfg.out_dir)
        except DataError as e:
            path = cfg.data.path
            # '~' starts a home folder, not a path relative to the folder the run started in (pathlib's expanduser
            # raised RuntimeError for '~nouser'); os.path.exists never raises (Path.exists: ValueError for NUL)
            if payload is None or path is None or os.path.exists(os.path.expanduser(path)):
                raise
            trained = ((payload.get("config") or {}).get("data") or {}).get("path")
            if path.startswith("~") or os.path.isabs(path) or path != trained:  # gone from there, or a new path
                raise DataError(f"data.path: no such file {quoted(path)}; to resume, put back the text this run "
                                "trained on, or give where it is now (data.path=...), which a resume takes") from None
            # A run started on a relative data.path, resumed from another folder: say how to name the file from here
            found_in = " (or with TINYCHAR_DATA_DIR as it was, if found there)"
            found_in = "" if os.environ.get("TINYCHAR_DATA_DIR") else found_in
            raise DataError(f"{e}; this run was started on that path relative to the folder it ran in: resume from "
                            f"that folder{found_in}, the text put back if it is gone, or give its full path "
                            f"(data.path=/.../{shell_word(Path(path).name)}), which a resume takes") from None

    # The first process on each machine reads the corpus (encoding it into the cache if need be) while the others
    # wait, then they read the cached file: not every process encoding the same text at once.
    with agreeing(launch):
        prepare_out_dir(Path(cfg.out_dir), resume, overwrite)  # every process checks; rank 0 alone writes, later
        device = distributed.rank_device(tc.device, launch)
        dtype = resolve_dtype(tc.dtype, device, cfg.model.n_embd)
        warm_enabled()  # a bad TINYCHAR_WARM_CACHE is one line before out_dir is touched
        if (why := user_cache_problem()) is not None:  # and so is a TORCHINDUCTOR_CACHE_DIR that names no folder
            raise UsageError(why)
        if (why := distributed.too_many_threads(tc.threads)) is not None:
            raise UsageError(why)
        if tc.threads:
            torch.set_num_threads(tc.threads)
        elif launch.torchrun:  # torchrun gives each process one thread unless OMP_NUM_THREADS says otherwise
            torch.set_num_threads(distributed.threads_per_process(launch))
        corpus = read_corpus() if launch.local_rank == 0 else None
    with agreeing(launch):
        if corpus is None:
            corpus = read_corpus()
    return Start(corpus, device, dtype)


def build_trainer(cfg: RunConfig, start: Start, payload: dict | None, launch: Launch) -> Trainer:
    """The model, optimizer and random state, fresh or restored from payload, in a Trainer (every process)."""
    tc, block_size, device = cfg.train, cfg.model.block_size, start.device
    with agreeing(launch):
        if payload is not None:  # first: other text too short to split would be told to change what a resume refuses
            check_same_text(payload, start.corpus, cfg)
        ids = start.corpus.ids_on(device) if device.type == "cuda" else start.corpus.ids  # get_batch widens them
        train_ids, val_ids = split_ids(ids, cfg.data.val_fraction, block_size)
        model_cfg = replace(cfg.model, vocab_size=start.corpus.vocab_size)
        # Before the first allocation: a run that cannot fit is refused in one line, not killed by the kernel.
        evaluated = eval_pass_sequences(block_size, tc.batch_size, tc.eval_iters, device, start.corpus.vocab_size)
        averaged = tc.ema_decay > 0
        need = training_need(model_cfg, tc.batch_size, evaluated, averaged, device)
        small = training_need(replace(model_cfg, vocab_size=2), tc.batch_size, evaluated, averaged, device)
        check_fits(need, device, launch.local_world_size if device.type == "cpu" else 1,
                   advice=vocabulary_advice(model_cfg, need, small))

        torch.manual_seed(cfg.seed)  # the same initial weights in every process (and DDP broadcasts rank 0's)
        model = build_model(model_cfg).to(device)
        optimizer = make_optimizer(model, tc, device, start.dtype)
        scaler = torch.amp.GradScaler(device.type) if start.dtype == torch.float16 else None
        # Each process draws its own batches and dropout masks; rank 0 uses the seed itself, as a lone process does.
        gen = torch.Generator().manual_seed(cfg.seed if launch.main else derived_seed(cfg.seed, BATCHES, launch.rank))
        if not launch.main:
            torch.manual_seed(derived_seed(cfg.seed, DROPOUT, launch.rank))
        trainer = Trainer(cfg, model, optimizer, {"train": train_ids, "val": val_ids}, device=device,
                          dtype=start.dtype, gen=gen, scaler=scaler, launch=launch)
        trainer.data_fingerprint = start.corpus.fingerprint
        if payload is not None:
            trainer.restore(payload, Path(cfg.out_dir) / "ckpt.pt")
    return trainer


def check_same_text(payload: dict, corpus: Corpus, cfg: RunConfig) -> None:
    """A resume goes on with the text the run was trained on: the checkpoint's fingerprint of its token ids (and so
    of the train/validation split) must be this corpus's. Checkpoints from before fingerprints pass unchecked."""
    saved = payload.get("data_fingerprint")
    if saved is not None and saved != corpus.fingerprint:
        path, trained = cfg.data.path, ((payload.get("config") or {}).get("data") or {}).get("path")
        where = f"data.path '{shown(path)}'" if path else f"data.dataset={cfg.data.dataset}"
        why = f"it changed since '{shown(Path(cfg.out_dir) / 'ckpt.pt')}' was saved"
        if isinstance(trained, str) and trained != path:  # another path given: not known to be the same file changed
            why = f"the run was trained on data.path '{shown(trained)}'"
        elif path and not os.path.isabs(os.path.expanduser(path)):
            why += ", or from this folder the relative path names another file than from the one the run started in"
        raise UsageError(f"cannot resume: the text of {where} is not the text this run was trained on ({why}); "
                         f"resume with that text, or start a new run in another out_dir")


def announce(trainer: Trainer, start: Start, payload: dict | None, resume: bool) -> None:
    """The lines a run starts with: its data, model, device, throughput yardstick, global batch, and resume."""
    log, tc, world = trainer.log, trainer.tc, trainer.launch.world_size
    params = trainer.model.num_params(non_embedding=False)  # every parameter, as the README counts them
    dtype = str(start.dtype).replace("torch.", "")
    log.info(f"data: {start.corpus.description}")
    for note in start.corpus.notes:
        log.info(note)
    log.info(f"model: {parameters_text(params)}; device {start.device}, {dtype}")
    if start.device.type == "cpu" and (busy := distributed.oversubscribed(tc.threads, trainer.launch)):
        log.info(busy)
    if start.device.type == "cpu" and start.dtype == torch.float16 and not cpu_has_fast_float16():
        log.info("note: this CPU has no fast float16 products (PyTorch multiplies float16 in slow loops here: about "
                 "10x slower than float32); train.dtype=auto takes the fastest this CPU has")
    if tc.optimizer == "muon" and not muon_matrices(trainer.model):
        log.info(f"optimizer: Muon steps the weight matrices of linear layers, and model.type={trainer.cfg.model.type} "
                 f"has none: AdamW steps every parameter (train.optimizer=adamw says so)")
    log.info(f"global batch: {world} process{'es' if world > 1 else ''} x {tc.batch_size} sequences x "
             f"{tc.grad_accum_steps} micro-batch{'es' if tc.grad_accum_steps > 1 else ''} = "
             f"{tc.batch_size * tc.grad_accum_steps * world:,} sequences ({trainer.tokens_per_step:,} tokens) per step")
    # the FLOPs of all processes over the ceiling of all of them (trainer.ceiling: the processes' summed)
    if note := step_note(trainer.flops_per_token * trainer.tokens_per_step, trainer.ceiling, tc.grad_accum_steps,
                         tc.batch_size):
        log.info(note)
    if note := evaluation_note(tc.max_iters, trainer.step, tc.eval_interval, tc.eval_iters, tc.grad_accum_steps):
        log.info(note)
    if resume:
        log.info(f"resuming '{shown(Path(trainer.cfg.out_dir) / 'ckpt.pt')}' at step {trainer.step}")
    if trainer.reseeded:
        saved = int(payload.get("world_size", 1))
        per_process = tc.batch_size * tc.grad_accum_steps
        log.info(f"resume: the checkpoint was saved by {saved} process{'es' if saved > 1 else ''} and this run has "
                 f"{world}: the global batch goes from {saved * per_process:,} to {world * per_process:,} sequences "
                 f"a step (train.batch_size and train.grad_accum_steps are per process), and each process draws its "
                 f"batches afresh from (seed, rank, step), so the batch order differs from that of an uninterrupted "
                 f"run")
    if payload is None:  # a resumed run's are in its first event file, which the purge keeps (step 0)
        log.hparams(trainer.cfg, params)


# The keys whose change orders a step's sums otherwise: what a checkpoint saved before it recorded its settled setup
# (settled_setup) is judged by.
INEXACT_KEYS = ("train.device", "train.dtype", "train.threads", "train.compile")


def settled_setup(trainer: Trainer, kind: str) -> dict[str, str]:
    """What decides the run's arithmetic beyond its config, as it came out on this machine: torch's version, the
    device (a CPU's vector instructions, a GPU's model), the dtype, a CPU's threads and the library that multiplies
    its float32 products, and the engine (kind: the one chosen, "step" or "blocks" compiled, unless compiling failed).
    A checkpoint records it for resumes to compare (inexact_resume): `train.device=auto` that came to the CPU is
    `train.device=cpu`, but the same config on another machine may order its sums otherwise."""
    device, dtype = trainer.device, trainer.dtype_name
    engine = f"compiled {kind}" if trainer.engine == "compiled" else "eager"
    # str(): torch.__version__ is a str subclass, which torch.load(weights_only=True) refuses as a Python object
    setup = {"torch": str(torch.__version__), "device": device.type, "dtype": dtype, "engine": engine}
    if device.type == "cpu":
        setup["device"] = f"cpu ({torch.backends.cpu.get_cpu_capability()})"
        setup["threads"] = str(torch.get_num_threads())
        if dtype == "float32":
            least = onednn_min_macs()
            setup["products"] = "BLAS" if least is None else f"oneDNN from {least:,} multiply-adds"
        if trainer.engine == "eager" and (kernels := eager_kernels.attached(trainer.model, trainer.optimizer)):
            setup["kernels"] = ", ".join(kernels)  # tinychar's own, in the eager step (training/eager_kernels.py)
    elif device.type == "cuda":
        setup["device"] = f"cuda ({torch.cuda.get_device_name(device)})"
    return setup


def inexact_resume(payload: dict, trainer: Trainer) -> str | None:
    """The line for a resume whose arithmetic differs from the saved run's, or None: it goes on, but its weights
    drift from those of the run that never stopped, by rounding."""
    before = payload.get("settled")
    if isinstance(before, dict):
        now = trainer.settled  # a key of one setup alone differs too (tinychar's kernels in an eager step, or none)
        keys = [*now, *(k for k in before if k not in now)]
        differ = [f"{k} {shown(before.get(k), 60)} -> {now.get(k)}" for k in keys if before.get(k) != now.get(k)]
    else:  # saved before checkpoints recorded their setup: what the configs say
        old, new = flatten(payload.get("config") or {}), flatten(to_dict(trainer.cfg))
        differ = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in INEXACT_KEYS if old.get(k) != new.get(k)]
    if not differ:
        return None
    return (f"resume: the run goes on, no longer bit-identical to one that never stopped: its setup differs from the "
            f"saved run's ({'; '.join(differ)})")
