"""Ending sample.py on a signal: Ctrl-C (SIGINT), SIGTERM and SIGHUP (the terminal closed) as exceptions, each said
in one line with its exit status, and noted between characters while sampling so that nothing drawn is lost."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from training.signals import STOP_SIGNALS


class Terminated(KeyboardInterrupt):
    """SIGTERM (kill, timeout) or SIGHUP (the terminal closed: the samples redirected to a file are kept), taken as a
    Ctrl-C is, so that every place that ends a Ctrl-C'd run in one line ends this one too (it ended without a word),
    and so that no library's `except Exception` takes it for a failure of its own (torch.compile's, while the
    sampler compiles)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__()
        self.signum = signum


def terminated(signum: int, _frame: object) -> None:
    raise Terminated(signum)


def interruption(signum: int) -> KeyboardInterrupt:
    """What a stop signal raises: KeyboardInterrupt for Ctrl-C, Terminated (with the signal) for the others."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def stopped(e: KeyboardInterrupt, what: str) -> int:
    """Say that the run was stopped by the signal e stands for, and what became of it; its exit status."""
    signum = getattr(e, "signum", signal.SIGINT)
    print(f"interrupted ({signal.Signals(signum).name}); {what}", file=sys.stderr)
    return 128 + signum


class Stops:
    """A stop signal (Ctrl-C, SIGTERM, SIGHUP) while sampling (see ctrl_c_between_characters): noted while characters
    are drawn, where the sampler asks between two of them (calling it gives the signal, or None); raised at once after
    a first one, and once at_once is set: when the drawing is over and the samples are being written, where a noted
    signal would stop nothing (and a write to a pipe nobody reads would hold the program there)."""

    def __init__(self) -> None:
        self.noted: list[int] = []
        self.at_once = False

    def __call__(self) -> int | None:
        return self.noted[0] if self.noted else None

    def note(self, signum: int, _frame: object) -> None:
        if self.noted or self.at_once:
            raise interruption(signum)
        self.noted.append(signum)


@contextmanager
def ctrl_c_between_characters() -> Iterator[Stops]:
    """Inside: a stop signal (Ctrl-C, SIGTERM, SIGHUP) is noted, and the caller asks between characters, where
    nothing can lose it (once, with compiled sampling streaming, a KeyboardInterrupt raised where the signal landed
    vanished and sampling went on); a second one raises at once, wherever it lands, as does any once the caller has
    set at_once. Outside the main thread, where signals cannot be handled, Python's own handling stays."""
    stops = Stops()
    try:
        previous = {sig: signal.signal(sig, stops.note) for sig in STOP_SIGNALS}
    except ValueError:  # not the main thread
        yield stops
        return
    try:
        yield stops
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
