"""The compiled CPU step with its batch in two halves, one a core: each half's forward and backward on one thread,
both at once, then one update from their gradients added.

Why: a small model's step is the time of many small operators, and each one that two threads share hands its data
from core to core and waits for the slower thread at its end. Measured on a 2-core Zen 2 EPYC (AVX2, torch 2.13,
float32, compiled, the step loaded whole): bench.py's block-8 step (3 layers of 32, batch 32, AdamW) took 2.3-2.4 ms
on two threads and 2.35-2.44 ms on one, so the second core bought nothing; two halves of 16 on one thread each ran
at once in 1.4 ms. Split, the step took 1.61-1.71 ms (medians of four processes in turn with four of the whole
batch, which took 2.29-2.43 in three and 1.54 in one: the machine's fast and slow spells, docs/engine-record.md,
which the halves do not see, as they meet once a step); whole train.py runs, 1.77-1.83 ms against 2.41-2.62. Wider
models share their products out well, and keep the whole batch (parts_for), unless Muon steps them: its update comes
in two parts as well (compiled_step.CompiledStep.part_args): tiny.yaml's step 13.64 -> 13.12 ms.

The halves run one compiled function (compiled_step._gradients, each loss divided by two), the second on this
module's worker thread while the caller's computes the first; code from the step saved whole (training/step_file.py)
lets go of Python's lock while it runs. Both threads, the update after them, and the trainer's drawing of the batch
and its weights' average around the step (training/loop.py) have one OpenMP thread: a team of two for the update left
its second thread spinning into the next step's halves (bench.py's block-8 step 2.88 ms split, against 1.68 with the
update on one thread; in train.py the average did the same, 2.83-2.95 ms). The update adds the two gradients in one
order and steps as for the whole batch: the same sums in another order, deterministic, so a resumed run equals a
straight one.

TINYCHAR_SPLIT_STEP: auto (or unset) splits where parts_for says it pays, 0 never, 1 wherever it can.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

import torch
from torch import nn

from . import step_file

SPLIT_SETTINGS = ("auto", "0", "1")
# The widest model (n_embd) that auto splits. Measured on the Zen 2 below, AdamW, float32, two compiled steps in one
# process taking turns (six rounds; median ms a step, whole batch on two threads -> halves): bench.py's block-8 step
# (3 layers of 32, batch 32) 2.36 -> 1.68; the same at batch 64 3.71 -> 2.79; of 64 wide 4.32 -> 3.64; tiny.yaml's
# model (64 wide, batch 128) 13.66 -> 12.00, and 96 wide 23.23 -> 20.48; block 32, 64 wide, 12.49 -> 11.56; block
# 16 6.44 -> 6.19. At 128 wide the products share out, and through tinychar's own kernel (training/linear_kernel.py)
# two threads beat the halves: block 8 9.35 -> 10.48, nanoGPT's CPU config (block 64, batch 12) 33.33 -> 33.57, at
# batch 4 14.15 -> 15.28; through MKL level (11.33 -> 11.31). Block 64 at 64 wide: level (12.95 -> 12.92).
# On a 2-core Zen 4 EPYC the CPU config was level as well: 29,855 tokens a second whole against 29,700 split (medians
# of ten whole train.py processes each, alternated; docs/engine.md).
SPLIT_MAX_WIDTH = 96
# The widest model that auto splits where Muon steps the matrices: the update's orthogonalisation, d x d products for
# a model d wide, goes in two parts too (compiled_step.CompiledStep.part_args), one a thread, and gains beside the
# halves at every width measured (the Zen 2, float32, as above with denormals flushed as train.py does, 3 layers,
# tiny.yaml's settings, six rounds): block 8, batch 32, 32 wide 3.02 -> 2.22; tiny.yaml (64 wide, batch 128) 13.64
# -> 13.12; 96 wide 29.28 -> 26.45; 128 wide 49.63 -> 43.42; configs/shakespeare_char_cpu.yaml (block 64, batch 12,
# 4 layers of 128) 50.13 -> 47.64; that 256 wide 205.43 -> 202.15. Wider: not measured.
SPLIT_MAX_WIDTH_MUON = 256


def split_setting() -> str:
    """TINYCHAR_SPLIT_STEP: auto (or unset), 0 or 1; ValueError for another value."""
    setting = os.environ.get("TINYCHAR_SPLIT_STEP", "auto").strip().lower() or "auto"
    if setting not in SPLIT_SETTINGS:
        raise ValueError(f"TINYCHAR_SPLIT_STEP must be one of {', '.join(SPLIT_SETTINGS)}, got {setting!r}")
    return setting


def has_dropout(model: nn.Module) -> bool:
    """Whether model draws random numbers in training: each half would draw from one generator at once."""
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()) or (
        getattr(getattr(model, "config", None), "dropout", 0) > 0)


def parts_for(width: int | None, dropout: bool, muon: bool, batch: int, device: torch.device,
              dtype: torch.dtype) -> int:
    """Into how many parts the compiled step splits each micro-batch of batch rows: 2, or 1 (the whole batch).

    Never with dropout (each half would draw from one generator at once), an odd batch, another dtype than float32
    or device than a CPU, or a torch whose step is not saved whole (dynamo's guards are not for two threads at once).
    auto splits where torch runs two threads and the model (width: n_embd; None for a model without a GPT's config:
    not split) is at most SPLIT_MAX_WIDTH wide, or SPLIT_MAX_WIDTH_MUON where Muon steps its matrices."""
    setting = split_setting()
    if (setting == "0" or device.type != "cpu" or dtype != torch.float32 or batch % 2 or dropout
            or not step_file.used_on(device)):
        return 1
    if setting == "1":
        return 2
    small = width is not None and width <= (SPLIT_MAX_WIDTH_MUON if muon else SPLIT_MAX_WIDTH)
    return 2 if small and torch.get_num_threads() == 2 else 1


def paired_rule(model: nn.Module, batch: int, device: torch.device, dtype: torch.dtype, muon: bool) -> int:
    """parts_for, for a model that CompiledStep steps."""
    width = getattr(getattr(model, "config", None), "n_embd", None)
    return parts_for(width, has_dropout(model), muon, batch, device, dtype)


class one_thread:  # lower case: a context, used as torch.no_grad is
    """This thread's OpenMP and MKL threads (torch's per-thread settings) at one meanwhile."""

    __slots__ = ("threads",)

    def __enter__(self) -> None:
        self.threads = torch.get_num_threads()
        if self.threads != 1:
            torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        if self.threads != 1:
            torch.set_num_threads(self.threads)


class _Worker:
    """A thread that runs one function call at a time for both(), under no_grad on one thread."""

    def __init__(self) -> None:
        self.given = threading.Semaphore(0)
        self.done = threading.Semaphore(0)
        self.call: tuple[Callable, tuple] | None = None
        self.result: object = None
        self.error: BaseException | None = None
        threading.Thread(target=self._serve, name="tinychar-half-step", daemon=True).start()

    def _serve(self) -> None:
        torch.set_num_threads(1)
        while True:
            self.given.acquire()
            fn, args = self.call
            try:
                with torch.no_grad():
                    self.result, self.error = fn(*args), None
            except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
                self.result, self.error = None, e
            self.call = None
            self.done.release()

    def give(self, fn: Callable, args: tuple) -> None:
        self.call = (fn, args)
        self.given.release()

    def take(self) -> object:
        try:
            self.done.acquire()
        except BaseException:  # a signal's exception in the caller: the half on the worker ends within the step
            while not self.done.acquire(timeout=0.05):
                pass
            raise
        if self.error is not None:
            raise self.error
        return self.result


_WORKER: _Worker | None = None
_WORKER_LOCK = threading.Lock()


def _forget_the_worker() -> None:
    """In a forked child: the worker thread was not copied (only the forking thread is), so both() starts another."""
    global _WORKER, _WORKER_LOCK
    _WORKER, _WORKER_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_the_worker)


def both(fn: Callable, first: tuple, second: tuple, other: Callable | None = None) -> tuple[object, object]:
    """fn(*first) on this thread and fn(*second) (other's, where given) on the worker, at once; both results, or the
    first error (after the other call has ended)."""
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = _Worker()
        worker = _WORKER
        worker.give(other or fn, second)
        try:
            a = fn(*first)
        except BaseException:
            with contextlib.suppress(Exception):  # the worker's own error, if any, says less than this one
                worker.take()
            raise
        return a, worker.take()
