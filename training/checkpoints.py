"""Run checkpoints: what a run saves to continue exactly (payload, RNG states), atomic writes into out_dir, and the
checks and restore that a resume goes through."""

from __future__ import annotations

import filecmp
import math
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from configs import ConfigError, flatten, to_dict
from configs.userinput import shown
from data import CharTokenizer
from model import GPT, CheckpointError, checkpoint_config, holds_later_step, load_checkpoint, model_from_checkpoint
from model.checkpoint import (
    FINITE_CHUNK,
    FORMAT,
    VERSION,
    WholeCheckpoint,
    error_reasons,
    unlike_weights,
    unusable_weight,
)

from .atomic import write_atomic
from .config import RunConfig, load_config
from .devices import mps_available, random_state, set_random_state
from .distributed import BATCHES, DROPOUT, derived_seed
from .errors import UsageError
from .launch import Launch
from .lock import file_identity
from .memory import check_fits, model_need
from .optim import schedule_note
from .resuming import check_resume_config, config_changes, resume_target

# The key under which load_run keeps the file_identity of the ckpt.pt it read, in the payload it returns; and the
# one under which a checkpoint says that a stop cut its step's evaluation short.
LOADED_FROM, EVAL_PENDING = "_loaded_from", "eval_pending"
# What a checkpoint needs beyond the model and vocabulary (checked by load_checkpoint) for a run to continue from it.
TRAINING_STATE = ("config", "optimizer", "step", "best_val_loss", "rng")
# What a run saves beside that state, each of one type (a bool is no count of processes); a checkpoint may lack them.
BOOKKEEPING = {EVAL_PENDING: bool, "is_best": bool, "world_size": int, "engine": str, "data_fingerprint": str}


class IncompleteSave(OSError):
    """A save to several files that failed after the first of them were written: `written` names those, and errno and
    strerror are the failure's."""

    def __init__(self, cause: OSError, written: list[Path]) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.written = written


def save_checkpoint(payload: dict[str, Any], path: str | Path, *copies: str | Path) -> None:
    """Write payload to path, and to each of copies, so that a crash at any moment leaves either the old file or the
    new one. The payload is serialized once (its tensors copied off a GPU once), into path, and each copy is that
    file's bytes; a failure after the first is in place raises IncompleteSave, naming what was written.

    The copies are read back from path, not kept in memory: serialized into memory for them, best.pt's save held
    a second copy of the weights and the optimizer's state besides the run's own, past what the run's memory check
    counts (tiny.yaml's model made 151M parameters, batch 1, passed the check under a 4 GB limit and ended at its
    first checkpoint in a MemoryError traceback, with none saved)."""
    content = {"format": FORMAT, "version": VERSION, **payload}
    write_atomic(path, lambda f: torch.save(content, f))
    targets = [Path(p) for p in (path, *copies)]
    for i, where in enumerate(targets[1:], start=1):
        try:
            with open(targets[0], "rb") as saved:
                write_atomic(where, lambda f, saved=saved: shutil.copyfileobj(saved, f))
        except OSError as e:
            raise IncompleteSave(e, targets[:i]) from e


def restore_best(out_dir: Path, payload: dict) -> str | None:
    """Copy ckpt.pt into best.pt where the checkpoint a resume continues was the run's best (its "is_best") but
    best.pt does not hold it: a save that wrote ckpt.pt and then failed to write best.pt (a full disk). A line saying
    so, or None when best.pt is as it should be, or of a later step (an older ckpt.pt copied back by hand: kept)."""
    ckpt, best = out_dir / "ckpt.pt", out_dir / "best.pt"
    if payload.get("is_best") is not True or not ckpt.is_file():
        return None
    try:
        if best.is_file() and (filecmp.cmp(ckpt, best, shallow=False) or holds_later_step(best, payload["step"])):
            return None
    except OSError as e:  # best.pt unreadable (its permissions): a traceback-free line, and it is kept as it is
        return (f"best.pt: cannot read it ({e.strerror or e}) to check that it holds step {payload['step']}, the "
                f"best; left as it is")
    try:
        with open(ckpt, "rb") as source:
            write_atomic(best, lambda f: shutil.copyfileobj(source, f))
    except OSError as e:  # still no space, say: the run goes on, and its next save says the same if it fails too
        return (f"best.pt: cannot copy step {payload['step']}'s weights, the best, from ckpt.pt into it "
                f"({e.strerror or e}); it holds an earlier best, or is missing")
    return (f"best.pt: step {payload['step']}'s weights, the best, copied from ckpt.pt (the save that wrote ckpt.pt "
            f"could not write best.pt)")


def rank_rng_state(gen: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    """This process's random state: dropout's (random_state: torch's, and its device's on CUDA or MPS) and its batch
    generator's."""
    return {**random_state(device), "batches": gen.get_state()}


def set_rank_rng_state(state: dict[str, torch.Tensor], gen: torch.Generator, device: torch.device) -> None:
    """Put back what rank_rng_state returned."""
    set_random_state(state, device)
    gen.set_state(state["batches"])


def checkpoint_payload(model: GPT, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
                       tokenizer: CharTokenizer, cfg: RunConfig, step: int, best_val: float,
                       gen: torch.Generator, ranks: list[dict[str, torch.Tensor]] | None = None) -> dict[str, Any]:
    """Everything a run needs to continue. ranks: every process's rank_rng_state, in rank order, under torchrun; the
    top-level RNG states are this process's (rank 0's), where a one-process run keeps its own."""
    rng = {"torch": torch.get_rng_state(), "batches": gen.get_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    if mps_available():
        rng["mps"] = torch.mps.get_rng_state()
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
    config, vocab = checkpoint_config(payload, path)  # validated like a config file, vocabulary included
    if vocab != sorted(vocab):  # a run's ids are positions in its sorted vocabulary: this was a ValueError traceback
        raise CheckpointError(f"'{shown(str(path))}' has its vocabulary out of order (a run keeps it sorted, its ids "
                              f"being positions in it); it is damaged and cannot be resumed")
    check_fits(model_need(config), torch.device("cpu"), what=f"loading checkpoint '{shown(str(path))}'",
               advice="it describes a model too large for this machine")
    model_from_checkpoint(payload, path)  # and its weights fit the config
    missing = [key for key in TRAINING_STATE if key not in payload]
    if "config" in missing or "optimizer" in missing:
        raise CheckpointError(f"'{shown(str(path))}' holds weights only (no training state); it cannot be resumed")
    if missing:
        raise CheckpointError(f"'{shown(str(path))}' lacks {', '.join(missing)}; it is damaged and cannot be resumed")
    rng = payload["rng"]
    if not isinstance(payload["config"], dict) or not isinstance(rng, dict) or not {"torch", "batches"} <= set(rng):
        raise CheckpointError(f"'{shown(str(path))}' has a damaged run config or RNG state; it cannot be resumed")
    # An eval_pending tensor was a traceback from bool(); a data_fingerprint that is no string, "trained on two texts"
    if key := next((k for k, kind in BOOKKEEPING.items() if payload.get(k) is not None and (
            not isinstance(payload[k], kind) or isinstance(payload[k], bool) != (kind is bool))), None):
        raise CheckpointError(f"'{shown(str(path))}' has a damaged {key} ({type(payload[key]).__name__}, where a run "
                              f"saves {BOOKKEEPING[key].__name__}); it cannot be resumed")
    # The run config builds the resumed model, the model config the saved one: an edit to one alone (n_head, whose
    # weights are the same shapes) resumed a different model without a word
    model, built = payload["config"].get("model"), config.to_dict()
    # plain values only: anything else (a tensor, a list) is the run config's own check's to refuse, in one line
    if isinstance(model, dict) and (key := next((k for k, v in model.items() if k != "vocab_size" and k in built
                                                 and type(v) in (int, float, str, bool) and v != built[k]), None)):
        raise CheckpointError(f"'{shown(str(path))}' has a run config that says model.{shown(str(key))}="
                              f"{shown(repr(model[key]), 40)} where its model was built with "
                              f"{shown(repr(built[key]), 40)}; it is damaged and cannot be resumed")
    # Checked here, before anything is written: a step of -5 divided by zero in the weight average's warm-up after
    # restore_best had already copied the checkpoint over best.pt, and an optimizer state that is no dict was an
    # AttributeError from torch.
    step = payload["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"'{shown(str(path))}' has a damaged step ({shown(repr(step)[:40])}: not a count of "
                              f"steps); it cannot be resumed")
    # its "state" too, which Optimizer.load_state_dict calls .items() of: a string there was an AttributeError
    optimizer = payload["optimizer"]
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("state"), dict):
        raise CheckpointError(f"'{shown(str(path))}' has a damaged optimizer state (not a mapping); it cannot be "
                              f"resumed")
    # Read before torch loads them, as the training weights are: it casts each moment to its weight's type, so that
    # complex ones lost their imaginary part (with torch's warning on stderr) and booleans or integers were taken as
    # the numbers they are, all trained on
    odd = next((found for state in optimizer["state"].values() if isinstance(state, dict)
                and (found := unusable_weight(state)) is not None), None)
    if odd is not None:
        raise CheckpointError(f"'{shown(str(path))}' has a damaged optimizer state ({odd[1]} in its "
                              f"{shown(str(odd[0]))}); it cannot be resumed")
    trained, weights = payload.get("training_weights"), payload["model"]
    train = payload["config"].get("train") if trained is None else None
    if isinstance(train, dict) and isinstance(train.get("ema_decay"), float) and train["ema_decay"] > 0:
        raise CheckpointError(f"'{shown(str(path))}' holds the weights' average (train.ema_decay) without the weights "
                              f"it was taken of (training_weights); it is damaged and cannot be resumed")
    # Checked as the average's are: complex, integer or boolean weights were taken as numbers (booleans as 1.0) and
    # trained on without a word, and a tensor on the meta device was a traceback from the finite check
    if trained is not None and (problem := unlike_weights(trained, weights)) is not None:
        raise CheckpointError(f"'{shown(str(path))}' has damaged training weights (the weights its average was taken "
                              f"of: {problem}); it cannot be resumed")


# What a checkpoint that does not fit the run it describes makes torch or the code below raise.
DAMAGED = (RuntimeError, ValueError, TypeError, KeyError, IndexError)


def damaged(path: Path, e: Exception) -> CheckpointError:
    return CheckpointError(f"'{shown(str(path))}' does not fit the run it describes ({error_reasons(e)}); it is "
                           f"damaged and cannot be resumed")


def restore_training_state(payload: dict, model: GPT, optimizer, scaler, path: Path) -> tuple[int, float]:
    """Load weights, optimizer and scaler from a checkpoint into a freshly built run; (step, best_val). The weights are
    the trained ones: "training_weights" where the run kept an average of them in "model" (train.ema_decay)."""
    try:
        model.load_state_dict(payload.get("training_weights", payload["model"]))
        settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        optimizer.load_state_dict(payload["optimizer"])
        # The groups' settings are the run's, which its config fixes and a resume may not change: the checkpoint's
        # copies, when damaged, were tracebacks at the first step (betas that are no numbers, a group taken for Muon).
        for group, own in zip(optimizer.param_groups, settings, strict=True):
            group.update(own)
        if scaler is not None and payload.get("scaler"):
            scaler.load_state_dict(payload["scaler"])
        step, best_val = int(payload["step"]), float(payload["best_val_loss"])
    except DAMAGED as e:
        raise damaged(path, e) from None
    # torch loads an optimizer's state without looking at it: a moment of another shape crashed the process in the
    # fused AdamW kernel (a segmentation fault), and a NaN stopped the run as diverged, blaming the learning rate.
    problem = optimizer_state_problem(optimizer)
    if problem is None and step > 0 and not any(optimizer.state.get(p) for group in optimizer.param_groups
                                                for p in group["params"]):
        # Every weight's moments would start afresh, as at step 0: the run would go on, but not as it would have.
        problem = f"its optimizer state is empty at step {step}"
    if problem is None and (math.isnan(best_val) or best_val == -math.inf):  # no evaluation would ever beat it
        problem = f"its best validation loss is {best_val}"
    if problem is not None:
        raise CheckpointError(f"'{shown(str(path))}' has a damaged training state ({problem}); it cannot be resumed")
    return step, best_val


def optimizer_state_problem(optimizer: torch.optim.Optimizer) -> str | None:
    """What is wrong with an optimizer's loaded state, in words, or None: each weight's entries are those of its
    group's method (AdamW's step and moments, or Muon's momentum), tensors of the weight's shape (the step: one
    number), finite, and a step and second moment that are not negative."""
    for group in optimizer.param_groups:
        expected = {"momentum_buffer"} if group.get("muon") else {"step", "exp_avg", "exp_avg_sq"}
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:  # a weight that has not been stepped yet
                continue
            weight = f"the weight of shape {tuple(p.shape)}"
            if set(state) != expected:
                held = ", ".join(sorted(str(k) for k in state))[:80]
                return f"{weight} has optimizer entries {held}, not {', '.join(sorted(expected))}"
            for key, value in state.items():
                shape = () if key == "step" else p.shape
                if not isinstance(value, torch.Tensor) or value.shape != shape or not value.is_floating_point():
                    what = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    return f"the optimizer's {key} of {weight} is {what}"
                flat = value.detach().reshape(-1)
                if not all(bool(chunk.isfinite().all()) for chunk in flat.split(FINITE_CHUNK)):
                    return f"the optimizer's {key} of {weight} is not all finite numbers"
                if key in ("step", "exp_avg_sq") and not all(bool((chunk >= 0).all()) for chunk in
                                                             flat.split(FINITE_CHUNK)):
                    return f"the optimizer's {key} of {weight} is negative"
    return None


def restore_rng(payload: dict, gen: torch.Generator, launch: Launch, device: torch.device, seed: int,
                path: Path) -> bool:
    """Put this process's random state back as the checkpoint saved it, for a run with as many processes as the one
    that saved it (True). With another number, there is no such state to take: each process reseeds its batches and
    dropout from (seed, rank, step) instead, so the run goes on reproducibly but not as it would have (False)."""
    try:
        saved_world = int(payload.get("world_size", 1))
        if saved_world < 1:
            raise ValueError(f"saved by {saved_world} processes")
        rng = payload["rng"]
        if saved_world != launch.world_size:
            step = int(payload["step"])
            gen.manual_seed(derived_seed(seed, BATCHES, launch.rank, step))
            torch.manual_seed(derived_seed(seed, DROPOUT, launch.rank, step))
            return False
        if saved_world == 1:
            torch.set_rng_state(rng["torch"])
            gen.set_state(rng["batches"])
            if torch.cuda.is_available() and "cuda" in rng:  # the GPUs this machine has (it may have fewer)
                for index, state in enumerate(rng["cuda"][: torch.cuda.device_count()]):
                    torch.cuda.set_rng_state(state, index)
            if mps_available() and "mps" in rng:
                torch.mps.set_rng_state(rng["mps"])
            return True
        if len(rng["per_rank"]) != saved_world:
            raise ValueError(f"{len(rng['per_rank'])} per-process RNG states for {saved_world} processes")
        set_rank_rng_state(rng["per_rank"][launch.rank], gen, device)
        return True
    except DAMAGED as e:
        raise damaged(path, e) from None


def another_run(best: Path, payload: dict) -> str | None:
    """How the run's best.pt shows it is another run's than the checkpoint payload (another model or vocabulary,
    another text, another setting no resume changes: a seed, a learning rate), or None: the same run's, or no
    checkpoint to keep (missing, damaged: restore_best's to mend). A later best.pt of the same run (an older ckpt.pt
    copied back) gives payload its lower best loss, which the run's evaluations must then beat to replace it."""
    try:  # its settings alone are read (not a second copy of the weights), and checked before they are compared
        kept = load_checkpoint(best, mmap=True) if best.is_file() else {}
        (theirs, their_vocab), (ours, our_vocab) = checkpoint_config(kept, best), checkpoint_config(payload)
        load_config(None, [], base=kept["config"])  # as ckpt.pt's is: flattening a crafted one went on without end
        texts = (kept.get("data_fingerprint"), payload.get("data_fingerprint"))
        refused = config_changes(kept["config"], payload["config"], None not in texts)[3]
    except (CheckpointError, ConfigError, OSError, KeyError, TypeError, AttributeError):
        return None
    a, b = theirs.to_dict(), ours.to_dict()
    if (key := next((k for k in a if a[k] != b.get(k)), None)) is not None:
        return f"model.{key} is {shown(a[key])} in best.pt, {shown(b.get(key))} in ckpt.pt"
    if their_vocab != our_vocab:
        return "their vocabularies differ"
    if None not in texts and texts[0] != texts[1]:
        return "trained on two texts"
    if refused:
        old, new = flatten(kept["config"]), flatten(payload["config"])
        return f"{refused[0]} is {shown(old.get(refused[0]))} in best.pt, {shown(new.get(refused[0]))} in ckpt.pt"
    # best.pt's step and loss are read unchecked: a step that is no number (a string) was a TypeError traceback
    later, step, ours = kept.get("best_val_loss"), kept.get("step"), payload["best_val_loss"]
    if isinstance(later, float) and isinstance(step, int) and step > payload["step"] and isinstance(ours, float) and (
            later < ours):
        payload["best_val_loss"] = later
    return None


def resumable(path: Path) -> bool:
    """Whether a run could continue from the checkpoint at path (read whole: an error path's check)."""
    try:
        check_training_state(load_checkpoint(path), path)
    except CheckpointError:
        return False
    return True


def load_run(config: str | None, overrides: list[str], resume: bool) -> tuple[RunConfig, dict | None, list[str]]:
    """The run's config and, for a resume, the checkpoint it continues (checked) and what the resume changes, as
    'key: old -> new' lines to show."""
    if not resume:
        return load_config(config, overrides), None, []
    cfg, out_dir, ckpt, recovered = resume_target(config, overrides)
    loaded = file_identity(ckpt)  # before it is read: claim_out_dir checks that no other run replaced it since
    try:
        payload = load_checkpoint(ckpt)
        check_training_state(payload, ckpt)
    except WholeCheckpoint:  # for a later tinychar, or a machine of more memory: nothing is to replace it
        raise
    except CheckpointError as e:  # say what will do: the run's best step, if best.pt is whole, or a new run
        best = out_dir / "best.pt"
        way = ("to continue from the run's best step instead, copy best.pt over it (cp best.pt ckpt.pt, in "
               "out_dir)" if not recovered and resumable(best) else
               "start afresh with --overwrite, or choose another out_dir")
        raise CheckpointError(f"{e}; {way}") from None
    saved = f"the config saved in '{shown(str(ckpt))}'"
    if config is None:  # no config named: continue with the saved one, in the folder resumed (the run may have moved)
        cfg = replace(load_config(None, overrides, base=payload["config"], origin=saved), out_dir=str(out_dir))
    else:  # checked all the same before it is compared: comparing a crafted one went on without end
        load_config(None, [], base=payload["config"], origin=saved)
    if not recovered and (other := another_run(out_dir / "best.pt", payload)) is not None:
        raise UsageError(f"'{shown(str(ckpt))}' and the best.pt beside it are checkpoints of two runs ({other}): a "
                         f"ckpt.pt copied in from another run? Resuming would write over best.pt; move one of them out "
                         f"of '{shown(str(out_dir))}', or give the other run a folder of its own")
    changes = check_resume_config(payload["config"], cfg, fingerprinted=payload.get("data_fingerprint") is not None)
    # At it, the run would only evaluate and save the same step again (unless a stop cut that evaluation short)
    if cfg.train.max_iters < payload["step"] or (cfg.train.max_iters == payload["step"] and not payload.get(
            EVAL_PENDING)):
        where = "is below" if cfg.train.max_iters < payload["step"] else "is"
        done = "" if where == "is below" else ": the run is done"
        raise UsageError(f"train.max_iters={cfg.train.max_iters:,} {where} step {payload['step']:,}, where "
                         f"'{shown(str(ckpt))}' is{done}; to train on, give a larger train.max_iters")
    if note := schedule_note(payload["config"].get("train") or {}, cfg.train, payload["step"]):
        changes.append(note)
    if recovered:
        changes.insert(0, f"the run that an interrupted --overwrite left in {ckpt.parent.name}/ is put back and "
                          f"continued")
    payload[LOADED_FROM] = loaded
    return cfg, payload, changes
