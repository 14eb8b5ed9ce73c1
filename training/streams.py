"""The process's own output streams: lines to stdout that outlive a reader who has gone or a full disk, stderr kept
open and quiet about its reader leaving, and stdout able to write any character. Plain Python: train.py sets them up
before it imports torch, so that a bad config is refused at once."""

from __future__ import annotations

import codecs
import errno
import os
import stat
import sys
from typing import TextIO


def say(line: str) -> None:
    """Print line to stdout; if its reader has gone, or it cannot be written, discard this and all later output
    instead of failing."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        discard_stdout()
    except OSError as e:
        stdout_lost(e)


def stdout_lost(e: OSError) -> None:
    """stdout cannot be written (`> file` on a full disk, a failing device): the run goes on without its lines, as
    with a closed stdout, and says so once on stderr. Unlike a pipe whose reader left, nobody asked it to stop."""
    discard_stdout()
    print(f"warning: cannot write to stdout ({e.strerror or e}); training goes on without its progress lines "
          f"(the checkpoints and TensorBoard logs are written as usual)", file=sys.stderr, flush=True)


def stderr_kept_open() -> None:
    """For a process started with stderr closed (`2>&-`): point descriptor 2 and sys.stderr at /dev/null. Python
    leaves sys.stderr None there, and print(file=None) writes to stdout: sample.py's messages went into the samples.
    Left closed, descriptor 2 would also be the next file opened (an attention map being written, say), and whatever
    the libraries write to stderr would go into it. So too where descriptor 2 is open for reading only (a launcher's
    script, as pyenv's shim leaves it after `2>&-`): every message failed, and the samples were never written.

    And once stderr's reader has gone (`2>&1 | head`) or its terminal has closed, what is written there later goes
    to /dev/null instead of failing: a message was a BrokenPipeError, the samples still to come were lost, and the
    exit status was 1."""
    closed = not _writable(2)
    if closed:
        devnull = os.open(os.devnull, os.O_WRONLY)
        if devnull != 2:
            os.dup2(devnull, 2)
            os.close(devnull)
    if closed or sys.stderr is None:
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115 - the process's own stderr, open until it ends
    if not isinstance(sys.stderr, _ReaderMayLeave):
        sys.stderr = _ReaderMayLeave(sys.stderr)


def _writable(fd: int) -> bool:
    """Whether descriptor fd is open, and for writing where the platform can tell."""
    try:
        os.fstat(fd)
    except OSError:
        return False
    try:
        import fcntl  # not on Windows
    except ImportError:
        return True
    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY


def reader_gone(e: OSError, stream: TextIO) -> bool:
    """Whether a write to stream failed because nobody is there to read any more: a pipe's reader has gone (`| head`),
    or a terminal has hung up (closed, its ssh session dropped), which fails with EIO. EIO from a file is a failing
    disk, and from a stream of no descriptor nothing to judge by."""
    if isinstance(e, BrokenPipeError):
        return True
    try:
        return e.errno == errno.EIO and stat.S_ISCHR(os.fstat(stream.fileno()).st_mode)
    except (OSError, ValueError):
        return False


class _ReaderMayLeave:
    """sys.stderr, less its failures: a reader that has gone (a BrokenPipeError, or EIO from a terminal that has
    closed), or a stream that cannot be written (`2> file` on a full disk, `2>/dev/full`), where there is nowhere to
    say so: from then on, descriptor 2 and what is written go to /dev/null. A message that failed had raised, and
    sample.py lost every sample, its first line to stderr coming before them. Everything else is the stream's own."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError:
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError:
            self._gone()

    def _gone(self) -> None:
        try:
            fd = self._stream.fileno()
        except (OSError, ValueError):  # a stream of no descriptor (a test's capture): only its lines are lost
            fd = None
        if fd is not None:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)  # what the old stream still holds is flushed there, harmlessly, at exit
            os.close(devnull)
        self._stream = open(os.devnull, "w")  # noqa: SIM115 - stands for stderr until the process ends

    def __getattr__(self, name: str) -> object:  # fileno, isatty, encoding, ...: the stream's
        return getattr(self._stream, name)


def stdout_encodes_any_text() -> None:
    """Make stdout write every character: in UTF-8 to a file or pipe whose encoding could not (`> out.txt` on Windows,
    cp1252; PYTHONIOENCODING=ascii), so that the samples are the model's text; on a terminal in its own encoding,
    a character it cannot show as '?'. Writing a Chinese sample or an out_dir with an umlaut there was a
    UnicodeEncodeError: a traceback, and the samples lost."""
    out = sys.stdout
    if out is None or not hasattr(out, "reconfigure") or codecs.lookup(out.encoding).name == "utf-8":
        return
    try:
        terminal = out.isatty()
    except (OSError, ValueError):
        terminal = False
    if terminal:
        out.reconfigure(errors="replace")
    else:
        out.reconfigure(encoding="utf-8")


def discard_stdout() -> None:
    """Point stdout at /dev/null, so that nothing written later, nor the flush at exit, fails on a closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def leave_now(status: int) -> None:
    """End the process with status at once, its output flushed, without the interpreter's shutdown (Python's exit
    handlers, then the C++ libraries' teardown): for a process whose work is done and saved."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone, or a stream closed
            pass
    os._exit(status)
