"""Data-parallel training over the processes that torchrun starts: where this process sits among them, joining and
leaving the process group, and the few collective operations the trainer needs. Imports only torch.

torchrun gives every process it starts RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE (and MASTER_ADDR and
MASTER_PORT, which ``init_process_group`` reads itself). A script started without torchrun has none of them and is
rank 0 of 1, with no process group: then nothing here communicates.

Every function marked *collective* must be called by every process of the group, in the same order, or the ones
that called it wait for the others until the group's timeout.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from configs.userinput import shown

from .config import BACKENDS, THREADS_PER_CORE, cores_here
from .devices import DeviceError, resolve_device
from .launch import Launch, LaunchError, cut_short
from .signals import STOP_SIGNALS

# How long a collective waits for the slowest process before it fails rather than hang. Generous, because some waits
# are long and legitimate: the other processes wait while the first one on each machine encodes a large corpus.
TIMEOUT = datetime.timedelta(minutes=30)
# After this many seconds of waiting for the others to join, a process says what it is waiting for: torchrun starts
# its processes together, so a longer wait means one of them is not coming (it failed, or was never started).
JOIN_NOTICE_S = 5.0
# Settings that may differ between the processes of one run: where each machine keeps its files (the text itself is
# compared by its fingerprint), each machine's hardware, and what only rank 0 does (the logs). Every other setting
# changes the weights, the batches or the order of the collectives, and must be the same everywhere.
PER_PROCESS_KEYS = frozenset({"out_dir", "data.path", "data.dataset", "data.cache_dir", "train.device",
                              "train.threads", "train.tensorboard", "train.log_interval", "train.sample_chars"})
_MASK64 = 2**64 - 1
# The streams of random numbers each process of a torchrun launch draws for itself (but rank 0, which uses the seed
# as a lone process does): derived_seed(seed, stream, rank), and derived_seed(seed, stream, rank, step) after a
# resume with another number of processes.
BATCHES, DROPOUT, EVALUATION = range(3)
def rank_device(name: str, launch: Launch) -> torch.device:
    """The device this process trains on. Under torchrun, one process per GPU: a CUDA run uses GPU LOCAL_RANK of its
    machine whatever index train.device names; auto means CUDA if there is a GPU, else the CPU (DDP has no MPS)."""
    if not launch.torchrun:
        return resolve_device(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = resolve_device(name, any_index=True)
    if device.type == "mps":
        raise DeviceError("multi-process training runs on CPUs or CUDA GPUs, not mps; set train.device=cpu")
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if launch.local_rank >= count:
            raise DeviceError(f"torchrun started {launch.local_world_size} processes on this machine, which has "
                              f"{count} GPU(s); use --nproc-per-node {count} (one process per GPU)")
        return torch.device("cuda", launch.local_rank)
    return device


def resolve_backend(name: str, device: torch.device) -> str:
    """The process group backend: auto is nccl for CUDA devices and gloo for CPUs; nccl needs CUDA."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    if name == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if name == "nccl" and (device.type != "cuda" or not dist.is_nccl_available()):
        raise DeviceError(f"train.backend=nccl needs CUDA GPUs and a torch built with NCCL, and this run is on "
                          f"{device}; use train.backend=gloo (or auto)")
    return name


def threads_per_process(launch: Launch) -> int:
    """A fair share of this machine's cores: processes x threads never exceeds them (at least one thread each)."""
    return max(1, cores_here() // launch.local_world_size)


def too_many_threads(threads: int) -> str | None:
    """The line that refuses train.threads above THREADS_PER_CORE for each core this process may use, or None."""
    cores = cores_here()
    if threads <= THREADS_PER_CORE * cores:
        return None
    return (f"train.threads={threads} is more than {THREADS_PER_CORE} threads for each of the {cores} "
            f"core{'s' if cores > 1 else ''} this process may use; threads beyond the cores take turns and slow every "
            f"step: train.threads=0 takes one a core, or give at most {THREADS_PER_CORE * cores}")


def oversubscribed(threads: int, launch: Launch) -> str | None:
    """A note where train.threads, over this machine's processes, asks for more threads than it has cores: they
    take turns, and each operator waits for its slowest thread (tiny.yaml eagerly on 2 cores: 17,500-18,000
    tokens/s with train.threads=8 against 40,500-41,400 with 2)."""
    cores, n = cores_here(), launch.local_world_size
    if not threads or threads * n <= cores:
        return None
    asked = f"train.threads={threads} x {n} processes = {threads * n} threads" if n > 1 else f"train.threads={threads}"
    fix = "train.threads=0 shares the cores out among them" if n > 1 else "train.threads=0 takes one a core"
    return f"note: {asked} on {cores} core{'s' if cores > 1 else ''}: threads beyond the cores take turns and slow " \
           f"every step; {fix}"


@contextmanager
def signals_deferred() -> Iterator[None]:
    """The stop signals (Ctrl-C, SIGTERM, SIGHUP) during the block take effect when it ends. For collectives that run
    Python between their steps (all_gather_object, DDP's construction): a handler that raises there would cut one
    process's collective short and leave the others waiting for its second half. Outside the main thread this does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            signal.raise_signal(caught[0])  # now for the handler the block held back


@contextmanager
def joined(launch: Launch, backend: str, device: torch.device) -> Iterator[None]:
    """Collective: the process group for the block, under torchrun (nothing otherwise). It is torn down on the way
    out however the block ends, so an error or Ctrl-C leaves no half-open connections behind."""
    if not launch.torchrun:
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the collectives on objects (all_gather_object) use the current device
    try:
        join_group(launch, backend, device)
    except LaunchError:  # already one line for a person
        raise
    except (RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise LaunchError(f"cannot join the other {launch.world_size - 1} process(es) of the run with backend "
                          f"{backend} ({first})") from None
    try:
        yield
    finally:
        dist.destroy_process_group()


def join_group(launch: Launch, backend: str, device: torch.device) -> None:
    """Collective: init_process_group, waited for in a way that Ctrl-C and SIGTERM can end at once.

    The rendezvous blocks in C++ for up to TIMEOUT and takes no signal meanwhile, so it runs in a helper thread while
    this one waits, and the signal handlers run here as usual. Cutting the wait short leaves nothing half-done: there
    is no group yet (one that forms just then is torn down). After JOIN_NOTICE_S a line on stderr says what the
    process is waiting for, such as a partner that failed before joining, or RANK and WORLD_SIZE left over in the
    environment of a plain `python train.py`."""
    outcome: list[BaseException | None] = []

    def join() -> None:
        try:
            check_master_addr(os.environ)
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread
            dist.init_process_group(backend, timeout=TIMEOUT, device_id=device if device.type == "cuda" else None)
            outcome.append(None)
        except BaseException as e:  # handed to the waiting thread, which raises it
            outcome.append(e)

    helper = threading.Thread(target=join, name="join-process-group", daemon=True)
    helper.start()
    notice_at = time.monotonic() + JOIN_NOTICE_S
    try:
        while helper.is_alive():
            helper.join(0.25)  # short waits: the signal handlers run between them
            if notice_at is not None and time.monotonic() >= notice_at and helper.is_alive():
                notice_at = None
                print(f"rank {launch.rank}: {join_wait_line(launch, os.environ)}", file=sys.stderr, flush=True)
    except BaseException:
        if not helper.is_alive() and outcome == [None]:
            dist.destroy_process_group()  # formed as the signal came
        raise
    if outcome[0] is not None:
        raise outcome[0]


def check_master_addr(environ: Mapping[str, str]) -> None:
    """LaunchError unless MASTER_PORT, when set, is a port number, and MASTER_ADDR, when set, names a host this
    machine can find. The rendezvous would otherwise retry a name that never resolves until TIMEOUT, 30 minutes,
    saying only that it waits. Unset, it is left to
    init_process_group, which says so itself. Runs in join_group's helper thread: a slow name server is waited for
    there, where Ctrl-C can end the wait."""
    port = environ.get("MASTER_PORT")
    if port is not None and not (port.strip().isdecimal() and int(port) < 65536):
        # it was "cannot join the other 1 process(es) ... (invalid literal for int() with base 10: 'abc')"
        raise LaunchError(f"MASTER_PORT={cut_short(port)} is not a port number (0-65535); set MASTER_PORT to the "
                          f"port rank 0 listens on, or unset RANK and WORLD_SIZE to run one process")
    host = environ.get("MASTER_ADDR")
    if host is None:
        return
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:  # UnicodeError: not a name DNS can carry (a label over 63 characters)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
        raise LaunchError(f"MASTER_ADDR={cut_short(host)} is not a host name or address this machine can resolve "
                          f"({reason}); set MASTER_ADDR to the address of the machine of rank 0, or unset RANK and "
                          f"WORLD_SIZE to run one process") from None


def join_wait_line(launch: Launch, environ: Mapping[str, str]) -> str:
    """What a process that has waited JOIN_NOTICE_S to join the others is waiting for, and what the person can do."""
    where = f"{shown(environ.get('MASTER_ADDR', '?'), 60)}:{shown(environ.get('MASTER_PORT', '?'), 20)}"
    if "TORCHELASTIC_RUN_ID" in environ:  # started by torchrun, which starts them all: one has failed or is slow
        hint = "a process that failed before joining says why in its own output; Ctrl-C stops"
    else:
        hint = "Ctrl-C stops; to train in one process, unset RANK and WORLD_SIZE"
    return (f"waiting for the other {launch.world_size - 1} process(es) of the run to join at {where} "
            f"(RANK={launch.rank}, WORLD_SIZE={launch.world_size}); {hint}")


def lost_peer(e: BaseException) -> str | None:
    """If e is a collective failing because another process has gone (killed, crashed) or cannot be reached, a short
    reason; else None. gloo reports a vanished peer as a plain RuntimeError whose text names gloo and the peer."""
    text = str(e).strip()
    if not (isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and "gloo" in text and "peer" in text)):
        return None
    first = text.splitlines()[0] if text else type(e).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # gloo's source file and line
    return first.split(". ")[0][:160]


def all_gather(obj: Any) -> list[Any]:
    """Collective: every process's obj (small, picklable), in rank order, in every process."""
    out: list[Any] = [None] * dist.get_world_size()
    with signals_deferred():
        dist.all_gather_object(out, obj)
    return out


def settings_of(config: Any, prefix: str = "") -> dict[str, Any]:
    """A run's config (nested frozen dataclasses) as {dotted key: value}: {'train.learning_rate': 0.001, ...}."""
    flat: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            flat.update(settings_of(value, f"{prefix}{f.name}."))
        else:
            flat[f"{prefix}{f.name}"] = value
    return flat




def check_same_run(launch: Launch, config: Any, resume: bool, fingerprint: str, payload: dict | None = None) -> None:
    """Collective under torchrun: refuse, in every process alike, a run whose processes were given different
    settings (a stale config file on one machine, an override typed on one only), read different text, or resume from
    different checkpoints (each reads its own out_dir's, and only rank 0 writes one: a copy on another machine may be
    an older step's, and the two then paired their collectives wrongly and saved the result as done). Unchecked, such
    replicas drift apart while the run reports success, or fail inside DDP with a traceback. PER_PROCESS_KEYS may
    differ; the text is compared by the fingerprint of its token ids, a checkpoint by its step and best loss."""
    if not launch.torchrun:
        return
    mine = {**settings_of(config), "--resume": resume}
    saved = None if payload is None else (payload.get("step"), payload.get("best_val_loss"))
    everyone = all_gather((mine, fingerprint, saved))
    first, first_text, first_saved = everyone[0]
    for rank, (theirs, text, their_saved) in enumerate(everyone[1:], start=1):
        for key in [*first, *(k for k in theirs if k not in first)]:  # in the config's order, the same in every process
            if key not in PER_PROCESS_KEYS and first.get(key) != theirs.get(key):
                raise LaunchError(f"the processes of this run were given different settings: {key} is "
                                  f"{cut_short(first.get(key))} in rank 0 and {cut_short(theirs.get(key))} in "
                                  f"rank {rank}; give every process the same command line and config file")
        if text != first_text:
            raise LaunchError(f"the processes of this run read different text: {_text_source(theirs)} in rank {rank} "
                              f"is not the text of {_text_source(first)} in rank 0; give every machine the same corpus")
        if their_saved != first_saved:
            (step, best), (their_step, their_best) = first_saved, their_saved
            also = f" (best losses {cut_short(best)} and {cut_short(their_best)})" if step == their_step else ""
            raise LaunchError(f"the processes of this run resume from different checkpoints: step {cut_short(step)} in "
                              f"rank 0's out_dir/ckpt.pt, step {cut_short(their_step)} in rank {rank}'s{also}; copy "
                              f"rank 0's ckpt.pt to every machine's out_dir, or give the processes one shared out_dir")


def _text_source(settings: Mapping[str, Any]) -> str:
    if settings.get("data.path") is not None:
        return f"data.path {cut_short(settings['data.path'])}"
    return f"data.dataset={settings.get('data.dataset')}"


def step_consensus(loss: torch.Tensor, stop: bool) -> tuple[torch.Tensor, bool]:
    """Collective, once per optimizer step: the mean of the processes' losses, and whether any process was asked to
    stop. One all-reduce of two numbers, so it costs next to nothing beside the gradients'."""
    both = torch.stack([loss.detach().float().reshape(()), torch.tensor(float(stop), device=loss.device)])
    dist.all_reduce(both)  # a sum: gloo has no average
    return both[0] / dist.get_world_size(), bool(both[1] > 0)


def any_process(flag: bool, device: torch.device) -> bool:
    """Collective: whether flag is true in any process."""
    total = torch.tensor(float(flag), device=device)
    dist.all_reduce(total)
    return bool(total > 0)


def mean(values: list[float], device: torch.device) -> list[float]:
    """Collective: the element-wise mean of values over the processes."""
    total = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def data_parallel(model: torch.nn.Module, device: torch.device) -> DistributedDataParallel:
    """Collective: model wrapped so that backward averages its gradients over the processes. Construction broadcasts
    rank 0's weights, so every process starts from the same ones."""
    with signals_deferred():
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    # The causal mask is the model's only buffer and never changes: broadcasting it before every forward is waste.
    # Set as an attribute, which every torch version reads: torch 2.13 renamed the keyword and warns about the old one.
    ddp.broadcast_buffers = False
    return ddp


def local_only(model: torch.nn.Module, local: bool) -> AbstractContextManager:
    """While active, backward on a DDP model accumulates its gradients in this process only (no all-reduce): for
    all but the last micro-batch of an accumulated step. Does nothing for any other model or when local is False."""
    if local and isinstance(model, DistributedDataParallel):
        return model.no_sync()
    return nullcontext()


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derived_seed(seed: int, *parts: int) -> int:
    """A seed for one stream of a run's random numbers, such as (seed, rank) or (seed, rank, step): SplitMix64 over
    the parts, so that neighbouring inputs give unrelated seeds. In [0, 2**64), which torch.Generator takes."""
    x = _splitmix64(seed & _MASK64)
    for part in parts:
        x = _splitmix64(x ^ (part & _MASK64))
    return x
