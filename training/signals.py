"""Stop signals: Ctrl-C, SIGTERM and SIGHUP (the terminal closed) end a training run at a step boundary with a
checkpoint, and end the work before the loop at once."""

from __future__ import annotations

import importlib
import logging
import os
import re
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Self


def stop_signals() -> tuple[int, ...]:
    """The signals that stop a run: Ctrl-C (SIGINT), SIGTERM (kill, a scheduler, timeout) and, where there is one,
    SIGHUP (the terminal closed, an ssh session dropped), which by default ended the run on the spot and lost every
    step since its last checkpoint. Unless the process was started ignoring SIGHUP, as `nohup` starts it, to outlive
    its terminal: that wish is kept. Read once, when this module is first imported, before anything of tinychar's
    sets a handler."""
    hangup = getattr(signal, "SIGHUP", None)  # not on Windows
    kept = hangup is not None and signal.getsignal(hangup) is not signal.SIG_IGN
    return (signal.SIGINT, signal.SIGTERM, *([hangup] if kept else []))


STOP_SIGNALS = stop_signals()


class ImportRefused(Exception):
    """torch would not load for a reason its environment gives (a TORCH_LOGS naming no log of torch's, a current
    folder that was removed): one line."""


class TorchLogsHelp(Exception):
    """TORCH_LOGS=help (or +help) asked torch for its list of logs, which torch gives as it loads, as the message of a
    ValueError: text is that list."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


class Stopped(Exception):
    """The run was asked to stop by a signal and has saved its state (saved=False: an --overwrite run stopped before
    its first checkpoint, which saves nothing, so that the run it was replacing comes back)."""

    def __init__(self, signum: int, step: int, saved: bool = True) -> None:
        super().__init__(f"signal {signum} at step {step}")
        self.signum, self.step, self.saved = signum, step, saved


class StopSignals:
    """While active, the stop signals (Ctrl-C, SIGTERM, SIGHUP) only ask the training loop to stop at the next step
    boundary, so the step in flight finishes and the checkpoint written after it is whole. A second signal while
    saving asks again and changes nothing. Outside the main thread (where handlers cannot be set) this does nothing."""

    SIGNALS = STOP_SIGNALS

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: object) -> None:
        self.request(signum)

    def request(self, signum: int) -> None:
        """Ask the loop to stop as a signal would (the first request counts): for events that are not signals,
        such as the reader of the run's output going away (SIGPIPE)."""
        self.signal = self.signal or signum

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            # every handler noted before any is replaced: a signal may land (and raise, in InterruptSignals) between
            # two of the replacements, and __exit__ must then put back all of them
            self._previous = {sig: signal.getsignal(sig) for sig in self.SIGNALS}
            for sig in self.SIGNALS:
                signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        # The loop has ended: stopped on a signal and saved, trained to its end, or failed with a line of its own to
        # say. A signal after this (a second Ctrl-C 10 ms behind the first, torchrun's SIGTERM, a Ctrl-C as the run
        # finishes), under an InterruptSignals still around it, must not end the run as one that never started
        InterruptSignals.loop_ended = True
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Interrupted(Exception):
    """A stop signal (Ctrl-C, SIGTERM, SIGHUP) outside the training loop, where there is nothing to save."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


class InterruptSignals(StopSignals):
    """While active, the stop signals (Ctrl-C, SIGTERM, SIGHUP) raise Interrupted at once. For the work before the
    training loop (reading the data, building the model), which has nothing to save and should not keep anyone
    waiting, and so that SIGTERM there ends the run with a line and status 143 as it does during training."""

    def _handle(self, signum: int, frame: object) -> None:
        if InterruptSignals.loop_ended:  # ("interrupted ... before training started; no checkpoint was saved")
            return  # what is left is the run's cleanup (its last line, the lock), seconds at most
        if InterruptSignals.received is None:
            # A library may log the exception on its way through, traceback and all, or warn of it, then let it go
            # on up: torch's fake tensors log "failed while attempting to run meta for aten.sub.Tensor" when the
            # signal lands in one of their kernels, and autograd's anomaly mode, which the compiler traces the
            # backward under, warns "Error detected in ...Backward0" with the forward's stack. The run still stops
            # with its one line; these would add a page above it about work the person called off. So once a signal
            # has come, logging is off (every logger, handler or none) and warnings are not shown, until __exit__.
            self._logging_was = logging.root.manager.disable
            logging.disable(logging.CRITICAL)
        InterruptSignals.received = signum
        raise Interrupted(signum)

    received: int | None = None  # the last signal that interrupted, for interrupting() to find behind a library
    loop_ended = False  # a training loop inside has ended, whichever way (StopSignals.__exit__)
    ended = 0  # how many times one has been left (insist_on_stop's watcher ends with the one it began under)

    def __enter__(self) -> Self:
        InterruptSignals.received, InterruptSignals.loop_ended = None, False
        self._logging_was: int | None = None
        # Raised inside a callback Python calls on its own (a weak reference's, as torch.compile's caches keep), the
        # exception cannot stop anything and Python prints it as "Exception ignored in ...", a traceback: leave it
        # unsaid, the signal is in `received`.
        self._unraisable = sys.unraisablehook
        sys.unraisablehook = self._quiet_about_interrupts
        self._showwarning = warnings.showwarning
        warnings.showwarning = self._warn_unless_interrupted
        try:
            return super().__enter__()
        except BaseException:  # a signal between the replacement of two handlers: nothing of this may stay behind
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: object) -> None:
        InterruptSignals.received = None  # what it received belongs to the work it guarded
        InterruptSignals.ended += 1
        sys.unraisablehook = self._unraisable
        warnings.showwarning = self._showwarning
        if self._logging_was is not None:
            logging.disable(self._logging_was)
        super().__exit__(*exc)
        InterruptSignals.loop_ended = False  # once its handlers are back (StopSignals.__exit__ may set it)

    def _quiet_about_interrupts(self, unraisable: sys.UnraisableHookArgs) -> None:
        if not isinstance(unraisable.exc_value, Interrupted):
            self._unraisable(unraisable)

    def _warn_unless_interrupted(self, *args: Any, **kwargs: Any) -> None:
        if InterruptSignals.received is None:
            self._showwarning(*args, **kwargs)


def _interrupt_in_chain(e: BaseException | None) -> BaseException | None:
    """e itself, or what it was raised from or while handling, when that is Interrupted or a KeyboardInterrupt."""
    seen: set[int] = set()
    link = e
    while link is not None and id(link) not in seen:
        if isinstance(link, Interrupted | KeyboardInterrupt):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


def wrapped_stop(e: BaseException) -> Interrupted | None:
    """The stop signal (Interrupted) that e stands for where e is a library's own error raised from it, or while
    handling it: an import the signal landed in may report it so (jinja2, compiling inductor's kernel templates as
    they are imported, as a TemplateSyntaxError). None where e is no such error."""
    link = _interrupt_in_chain(e)
    return link if isinstance(link, Interrupted) and link is not e else None


def interrupting(e: BaseException | None = None) -> BaseException | None:
    """The stop that e stands for, or None: e itself, or what it was raised from or while handling, when that is
    Interrupted or a KeyboardInterrupt. A library may catch the exception a signal raised inside it and raise its own
    (torch.compile reports "BackendCompilerFailed: ... Interrupted: signal 15"), which must not pass for a failure of
    that library: the person asked the program to stop. A library may also swallow it whole (inductor, waiting on its
    compiling processes when the signal came, compiled on and returned): so a signal InterruptSignals received since
    it was entered counts as well, with e or without."""
    if (link := _interrupt_in_chain(e)) is not None:
        return link
    if InterruptSignals.received is not None:
        return Interrupted(InterruptSignals.received)
    return None


# How long insist_on_stop lets the work it guards take to end on a stop signal before raising it again: ending on
# one takes well under a second (1.0-1.7 s from the signal to the process's exit, measured on a 2-core Zen 3 EPYC).
INSIST_AFTER = 3.0


@contextmanager
def insist_on_stop() -> Iterator[None]:
    """While inside (under InterruptSignals, in the main thread), a stop signal the work inside has not ended on
    within INSIST_AFTER seconds is raised in it again, as often as it takes: a library may catch the exception and
    carry on. Inductor did, once in a few busy test runs: a Ctrl-C two seconds into compiling the training step ended
    the run 35 s later, once the compile was done. The watching thread ends with the block, or with the
    InterruptSignals around it, should a signal cut the block's own ending short."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_kill"):
        yield  # (another thread cannot be sent a signal to raise; Windows has no pthread_kill)
        return
    done, main, guard = threading.Event(), threading.main_thread().ident, InterruptSignals.ended

    def guarded() -> bool:
        return not done.is_set() and InterruptSignals.ended == guard

    def insist() -> None:
        while guarded() and InterruptSignals.received is None:
            done.wait(0.1)
        while not done.wait(INSIST_AFTER) and guarded() and (signum := InterruptSignals.received) is not None:
            signal.pthread_kill(main, signum)  # the latest signal, as the run would have ended on it

    watcher = threading.Thread(target=insist, name="tinychar-insist-on-stop", daemon=True)
    try:  # started inside: a signal raised as it starts (or any time after) ends it here
        with _stop_signals_held():  # those sent to this thread; the thread keeps them blocked
            watcher.start()
        yield
    finally:
        done.set()  # first: the watcher ends on it even if a signal cuts the join short
        if watcher.is_alive():
            watcher.join()


@contextmanager
def _stop_signals_held() -> Iterator[None]:
    """The stop signals held back while inside, in this thread; one sent to it meanwhile is taken at the end. Those
    sent to the process (a terminal's Ctrl-C, kill) may still be taken by another thread and handled in this one."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, StopSignals.SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def start_or_status(names: tuple[str, ...], interrupted: str) -> int | None:
    """Import the modules named (import_holding_signals): None once they have loaded, else the status the command
    ends with, its one line said on stderr: 2 where torch cannot load for a reason the user can fix (ImportRefused; a
    requirement not installed for this Python), 128 + the stop signal that came meanwhile (interrupted: its line, with
    {} for the signal's name). TORCH_LOGS=help: torch's list of its logs on stdout, and 0, as for --help."""
    from .interpreter import missing_requirement

    try:
        signum = import_holding_signals(names)
    except TorchLogsHelp as e:  # what was asked for, not a failure: torch raised it as one, a traceback and status 1
        return _print_help(e.text)
    except ImportRefused as e:
        line, status = f"error: {e}", 2
    except ModuleNotFoundError as e:
        if (line := missing_requirement(e)) is None:
            raise
        status = 2
    else:
        if signum is None:
            return None
        line, status = interrupted.format(signal.Signals(signum).name), 128 + signum
    print(line, file=sys.stderr)
    return status


def _print_help(text: str) -> int:
    """The status of a command that prints text on stdout and ends: 0, or 1 with one line where stdout cannot be
    written (a full disk); a reader that has gone (`| head`) ends it quietly, as it ends --help's."""
    from .streams import discard_stdout

    try:
        print(text, flush=True)
    except OSError as e:
        discard_stdout()  # nor the flush at exit fails again
        if not isinstance(e, BrokenPipeError):
            print(f"error: cannot write to stdout ({e.strerror or e})", file=sys.stderr)
            return 1
    return 0


def import_holding_signals(names: tuple[str, ...]) -> int | None:
    """Import the modules named (torch among them: seconds); the stop signal that came meanwhile, if one did, for
    the caller to end on. The stop signals wait until the modules have loaded: raised inside an import, a
    KeyboardInterrupt can leave torch or numpy half-made (seen: an AttributeError from numpy instead) or be lost in
    their C code (seen: the run went on to the end). ImportRefused: torch would not load, for a reason the user can
    fix, said in its one line; TorchLogsHelp: TORCH_LOGS=help asked for torch's list of its logs instead."""
    missing = [name for name in names if name not in sys.modules]
    if not missing:
        return None
    try:
        os.getcwd()
    except FileNotFoundError:  # torch's MKL then ended the process as it loaded, in its own "FATAL ERROR" line
        raise ImportRefused("the current folder no longer exists (it was removed while the shell was in it); cd into "
                            "a folder that exists and run the command again") from None
    held: list[int] = []
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():  # elsewhere, signals are not this thread's to take
        for sig in StopSignals.SIGNALS:
            previous[sig] = signal.signal(sig, lambda signum, _frame: held.append(signum))
    try:
        for name in missing:
            importlib.import_module(name)
    except KeyboardInterrupt as e:  # raised inside an import all the same
        held.append(getattr(e, "signum", signal.SIGINT))
    except ValueError as e:  # torch reads TORCH_LOGS as it loads and refuses a value in a screenful of its names
        if "TORCH_LOGS" in os.environ and str(e).lstrip().startswith("TORCH_LOGS Info"):  # help: its list, raised
            raise TorchLogsHelp(str(e).strip("\n")) from None
        if "TORCH_LOGS" not in os.environ or "Invalid log settings" not in str(e):
            raise
        raise _not_torch_logs() from None
    except ModuleNotFoundError as e:
        # A dotted name whose package does not exist (TORCH_LOGS=foo.bar): torch looks for it as a module to log,
        # and importlib raises for it rather than say there is none, a traceback of torch's loading
        if e.name is None or not _named_in_torch_logs(e.name):
            raise
        raise _not_torch_logs() from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return held[0] if held else None


def _named_in_torch_logs(module: str) -> bool:
    """Whether TORCH_LOGS names module or a module inside it (+foo.bar, -foo), as torch reads its names."""
    names = re.sub(r"\s+", "", os.environ.get("TORCH_LOGS", "")).split(",")
    return any(name.lstrip("+-") == module or name.lstrip("+-").startswith(module + ".") for name in names)


def _not_torch_logs() -> ImportRefused:
    from configs.userinput import shown

    given = shown(os.environ["TORCH_LOGS"])
    return ImportRefused(f"TORCH_LOGS '{given}' is not a list of torch's logs; give comma-separated names "
                         "(dynamo,+inductor; TORCH_LOGS=help lists them) or unset it")
