"""Failures of a run told to a person: their kinds, the one line and exit status of each, and how the processes of a
torchrun launch agree on one so that none is left waiting."""

from __future__ import annotations

import contextlib
import glob
import math
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import torch

from configs import ConfigError
from configs.errors import UsageError
from configs.userinput import path_word, script_word, shown
from data import DataError
from model import CheckpointError

from . import distributed
from .config import RunConfig
from .devices import DeviceError
from .launch import Launch, LaunchError
from .signals import Interrupted, Stopped


class Diverged(RuntimeError):
    """The loss or gradient norm of a step stopped being finite; the step was not applied to the weights."""

    def __init__(self, step: int, loss: float, grad_norm: float, saved_step: int | None, compiled: bool = False,
                 dtype: str | None = None) -> None:
        super().__init__(f"step {step}: loss {loss:.4g}, gradient norm {grad_norm:.4g}")
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        self.saved_step = saved_step  # the step of out_dir/ckpt.pt, None when the run has written none
        self.compiled = compiled  # the step ran through the compiled engine
        self.dtype = dtype  # what train.dtype resolved to ("float32", "bfloat16", ...); None: unknown


class SaveError(RuntimeError):
    """A checkpoint could not be written (disk full, folder not writable); the message is one line."""


class LogError(SaveError):
    """TensorBoard's logs could not be written (disk full, folder gone); the message is one line."""


class SharedFailure(Exception):
    """Under torchrun, a failure of one process that every process has agreed on (see agree): all of them stop with
    its exit status, and rank 0 prints its line (None for a bug, whose traceback the failing process prints)."""

    def __init__(self, rank: int, status: int, line: str | None) -> None:
        super().__init__(f"rank {rank} failed with status {status}")
        self.rank, self.status, self.line = rank, status, line


class HelpAsked(Exception):
    """Under torchrun, --help given to the process of this rank: rank 0 prints the help, and each process so asked
    joins the others all the same, so that none waits for it (those not asked waited for their 30-minute timeout)."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"--help given to rank {rank}")
        self.rank = rank


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


def divergence_advice(e: Diverged, cfg: RunConfig) -> str:
    """One line: the step that went non-finite, what was kept, and what to change."""
    ckpt = Path(cfg.out_dir) / "ckpt.pt"
    kept = (f"the last good checkpoint '{shown(str(ckpt))}' (step {e.saved_step}) is untouched"
            if e.saved_step is not None else "no checkpoint had been written yet")
    tries = ["a lower train.learning_rate", "a longer train.warmup_iters"]
    if cfg.train.grad_clip == 0:
        tries.append("train.grad_clip=1.0")
    dtype = e.dtype or cfg.train.dtype
    why = ""
    if e.step == 1 and not math.isfinite(e.loss) and (e.compiled or dtype != "float32"):
        # The initial weights' loss: no update came before it, so no learning rate is to blame.
        why = " The loss was not finite before any update, so the learning rate is not the cause."
        tries = []
        if e.compiled:  # e.g. code that a compile cache holds for another CPU (see training.compile_cache.machine_tag)
            tries.append("train.compile=false")
    if dtype != "float32":
        tries.append("train.dtype=float32")
    advice = tries[0] if len(tries) == 1 else f"{', '.join(tries[:-1])} or {tries[-1]}"
    # The same state and batches would diverge again, and a resume may not change the learning rate: a new run.
    return (f"training diverged at step {e.step} (loss {e.loss:.4g}, gradient norm {e.grad_norm:.4g}) and stopped "
            f"before updating the weights; {kept}.{why} Try {advice}, in a new run (another out_dir, or --overwrite)")


# Bad input: the person running the command can fix it (exit status 2).
INPUT_ERRORS = (ConfigError, DataError, CheckpointError, DeviceError, UsageError, LaunchError)


def out_of_memory(e: Exception) -> str | None:
    """For an allocation that failed (the CPU's allocator, or CUDA's): ' (asking for N GB more)', or '' without the
    size; None for any other exception."""
    text = str(e)
    if _python_ran_out(e):
        return ""
    if not (isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "can't allocate memory" in text)):
        return None
    size = re.search(r"allocate (\d+) bytes", text)
    return f" (asking for {int(size.group(1)) / 1e9:.2f} GB more)" if size else ""


def _python_ran_out(e: BaseException | None) -> bool:
    """Python's own MemoryError, raised or behind what was raised: torch.save of a checkpoint that ran out of memory
    raised a RuntimeError as it closed the file ("unexpected pos"), its MemoryError only its context, and the run
    ended in a traceback."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, MemoryError):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def path_error(e: Exception) -> bool:
    """An OSError about a path a person gave (a name too long, a loop of links, no permission, not a folder):
    their input, said in one line, wherever in the code the path was first touched."""
    return isinstance(e, OSError) and e.filename is not None


def path_message(e: OSError) -> str:
    """The one line for a path_error."""
    return f"cannot use '{shown(str(e.filename))}' ({e.strerror or type(e).__name__}); give another path"


def exit_status(e: Exception) -> int:
    """2 for bad input, 128 + the signal for a stop (130 for Ctrl-C, 143 for SIGTERM, as shells report them), 1 for
    anything else."""
    if isinstance(e, INPUT_ERRORS) or path_error(e):
        return 2
    if isinstance(e, (Stopped, Interrupted)):
        return 128 + e.signum
    if isinstance(e, SharedFailure):
        return e.status
    if isinstance(e, HelpAsked):  # the help, which rank 0 printed; another rank's alone is a command line to fix
        return 0 if e.rank == 0 else 2
    return 1


def resume_command(out_dir: str, launch: Launch, data_path: str | None = None) -> str:
    """The command that continues this run, with as many processes (so that it continues exactly), and with
    TINYCHAR_DATA_DIR as it is now where the run's relative data.path was found only there."""
    tail = f"{script_word('train.py')} --out-dir {path_word(out_dir)} --resume"
    folder = os.environ.get("TINYCHAR_DATA_DIR")
    found_there = folder and data_path and not os.path.isabs(os.path.expanduser(data_path)) and not (
        os.path.lexists(data_path) or glob.glob(data_path))
    setting = f"TINYCHAR_DATA_DIR={path_word(folder)} " if found_there else ""
    if not launch.torchrun:
        return f"{setting}python {tail}"
    if launch.local_world_size == launch.world_size:
        return f"{setting}torchrun --standalone --nproc-per-node {launch.world_size} {tail}"
    return f"torchrun, with the options and the environment this run had, on every machine: {tail}"


def failure_line(e: Exception, cfg: RunConfig | None, launch: Launch) -> str | None:
    """The one line a failure is reported with; None for a bug (its traceback says more), '' for nothing to say."""
    if isinstance(e, SharedFailure):
        if e.line is None:  # a bug in another process, which prints its traceback
            return ""
        return e.line if e.rank == 0 else e.line.replace("error: ", f"error: rank {e.rank}: ", 1)
    if isinstance(e, HelpAsked):
        return "" if e.rank == 0 else ("error: --help was given to this process and not to rank 0, which prints it; "
                                       "give every process the same command line")
    if isinstance(e, (*INPUT_ERRORS, SaveError)):
        return f"error: {e}"
    if path_error(e):
        return f"error: {path_message(e)}"
    if isinstance(e, Diverged):  # not bad input: the run itself went wrong
        return f"error: {divergence_advice(e, cfg)}"
    if isinstance(e, Stopped):
        why = " (its output was closed)" if e.signum == signal.SIGPIPE else ""
        if not e.saved:
            return (f"stopped at step {e.step}{why}, before this --overwrite run's first checkpoint: nothing of it "
                    f"was saved, and the run it was replacing is back in '{shown(cfg.out_dir)}'")
        return (f"stopped at step {e.step}{why}: saved '{shown(Path(cfg.out_dir) / 'ckpt.pt')}'; continue with: "
                f"{resume_command(cfg.out_dir, launch, cfg.data.path)}")
    if isinstance(e, Interrupted):
        return f"interrupted ({signal.Signals(e.signum).name}) before training started; no checkpoint was saved"
    if (asked := out_of_memory(e)) is not None:  # past the estimate that let the run start: a traceback, before
        ckpt = Path(cfg.out_dir) / "ckpt.pt" if cfg is not None else None
        kept = (f"'{shown(str(ckpt))}' holds the last evaluation's step" if ckpt is not None and ckpt.is_file()
                else "no checkpoint was saved")
        return (f"error: out of memory{asked}; {kept}. Lower train.batch_size or train.eval_iters, train a smaller "
                f"model, or cap a vocabulary of very many characters with data.max_vocab")
    if launch.torchrun and (reason := distributed.lost_peer(e)):
        return (f"error: lost contact with another process of the run ({reason}); what ended it is in its own "
                f"output or torchrun's report")
    return None
