"""A closed terminal (SIGHUP: the window closed, an ssh session dropped) in real processes: train.py stops after the
step in flight with a checkpoint that resumes, and its lines, with nowhere to go, do not fail the save; sample.py
writes the samples drawn so far; torchrun passes the signal on and every process stops at one step; and a process
started ignoring SIGHUP (nohup) trains on. SIGHUP's default action ended a run on the spot, losing every step since
its last checkpoint, and sample.py's samples when they were not streamed."""

from __future__ import annotations

import errno
import fcntl
import io
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest
from conftest import ROOT, tiny_overrides, train_small_run
from test_train import child_env
from test_training_distributed import our_traceback, two_processes_at_step_5
from training_runs import TINY, check_after_a_crash, wait_for, write_corpus

from model import load_checkpoint
from training.signals import stop_signals
from training.streams import _ReaderMayLeave, reader_gone

LONG_RUN = {"train.max_iters": 100_000, "train.eval_interval": 50_000, "train.log_interval": 1}

# Starts the script given as a terminal's shell would: SIGHUP at its default action, whatever this process has (the
# suite may itself run under nohup) and, with --terminal, standard input as its controlling terminal (the process is
# the leader of a session of its own), so that closing the terminal's other end sends it SIGHUP, as a window closing
# does.
AS_FROM_A_SHELL = """
import fcntl, os, signal, sys, termios
args = sys.argv[1:]
if args[0] == "--terminal":
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    args = args[1:]
signal.signal(signal.SIGHUP, signal.SIG_IGN if args[0] == "--nohup" else signal.SIG_DFL)
os.execv(sys.executable, [sys.executable, *args[args[0] == "--nohup":]])
"""


def pseudo_terminal() -> tuple[int, int]:
    """(master, slave) descriptors of a new pseudo-terminal; the test is skipped where the system has none to give (a
    container without /dev/pts): a capability missing, not a behaviour."""
    try:
        return os.openpty()
    except OSError as e:
        pytest.skip(f"no pseudo-terminal here ({e.strerror})")


class Terminal:
    """A pseudo-terminal of 80 columns running `python *args` in the repository, read as it writes; close() hangs
    it up."""

    def __init__(self, *args: str) -> None:
        self.master, slave = pseudo_terminal()
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        self.proc = subprocess.Popen([sys.executable, "-c", AS_FROM_A_SHELL, "--terminal", *args], cwd=ROOT,
                                     env=child_env(), stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
        os.close(slave)
        self.shown = b""

    def wait_for(self, pattern: bytes, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.shown):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.shown[-3000:].decode(errors="replace")
            if select.select([self.master], [], [], 0.05)[0]:
                self.shown += os.read(self.master, 65536)

    def close(self) -> int:
        """Hang up (as a closed window does); the process's exit status, or -N for a signal N that ended it."""
        os.close(self.master)
        try:
            return self.proc.wait(timeout=60)
        finally:
            self.proc.kill()


@pytest.mark.slow
def test_closing_the_terminal_stops_training_with_a_checkpoint_that_resumes(tmp_path):
    out = tmp_path / "out"
    overrides = tiny_overrides(write_corpus(tmp_path), out, **LONG_RUN)
    terminal = Terminal("train.py", "--config", TINY, *overrides)
    terminal.wait_for(rb"\| *[1-9]\d+/100000 ")  # ten steps or more on the progress bar, shown on a terminal
    status = terminal.close()
    # it was -1: killed by the signal, with nothing saved since the last evaluation
    assert status == 128 + signal.SIGHUP, terminal.shown[-3000:].decode(errors="replace")
    step = check_after_a_crash(out)
    assert step >= 10
    resumed = subprocess.run([sys.executable, "train.py", "--out-dir", str(out), "--resume",
                              f"train.max_iters={step + 2}"], cwd=ROOT, env=child_env(), capture_output=True,
                             text=True, timeout=120, check=False)
    assert resumed.returncode == 0, resumed.stderr
    assert f"ckpt.pt' at step {step}" in resumed.stdout
    assert load_checkpoint(out / "ckpt.pt")["step"] == step + 2


@pytest.mark.slow
@pytest.mark.parametrize("nohup", [False, True], ids=["sighup", "nohup"])
def test_sighup_stops_training_as_sigterm_does_unless_started_by_nohup(tmp_path, nohup):
    out, log = tmp_path / "out", tmp_path / "log.txt"
    keys = {**LONG_RUN, "train.max_iters": 40} if nohup else LONG_RUN
    args = ["train.py", "--config", TINY, *tiny_overrides(write_corpus(tmp_path), out, **keys)]
    with log.open("w", encoding="utf-8") as f:
        proc = subprocess.Popen([sys.executable, "-c", AS_FROM_A_SHELL, *(["--nohup"] if nohup else []), *args],
                                cwd=ROOT, env=child_env(), stdout=f, stderr=subprocess.STDOUT)
    wait_for(log, r"^step 5/", proc)
    proc.send_signal(signal.SIGHUP)
    code = proc.wait(timeout=120)
    text = log.read_text(encoding="utf-8")
    assert "Traceback" not in text, text
    if nohup:  # asked to outlive its terminal: it trains on to its end
        assert code == 0 and "step 40/40" in text and load_checkpoint(out / "ckpt.pt")["step"] == 40, text
        return
    assert code == 128 + signal.SIGHUP, text
    stops = re.findall(r"^stopped at step (\d+): saved .*--resume$", text, re.MULTILINE)
    assert len(stops) == 1 and check_after_a_crash(out) == int(stops[0]) >= 5, text


@pytest.mark.slow
def test_sighup_stops_every_process_of_a_torchrun_launch_at_one_step(tmp_path):
    """torchrun passes SIGHUP on to its workers (each in a session of its own, out of reach of the terminal)."""
    out, log = tmp_path / "out", tmp_path / "log.txt"
    proc = two_processes_at_step_5(tmp_path, out, log)
    proc.send_signal(signal.SIGHUP)
    try:
        proc.wait(timeout=120)
    finally:
        proc.kill()
    text = log.read_text(encoding="utf-8")
    stops = re.findall(r"^stopped at step (\d+): saved .*--nproc-per-node 2 .*--resume$", text, re.MULTILINE)
    assert len(stops) == 1 and not our_traceback(text), text
    raw = load_checkpoint(out / "ckpt.pt")
    assert raw["step"] == int(stops[0]) >= 5 and raw["world_size"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("where", ["a file", "the terminal"])
def test_sample_py_on_a_closed_terminal_ends_with_129_and_keeps_the_samples_written_to_a_file(tmp_path, where):
    """Without --stream the samples are written at the end: `python sample.py ... > out.txt` in a terminal that
    closed left out.txt empty. Now a hang-up stops between characters and writes each sample as far as it got."""
    run = train_small_run(tmp_path)
    samples = tmp_path / "samples.txt"
    args = ["sample.py", "--out-dir", str(run), "--max-new-tokens", "10000000", "--prompt", "F", "--num-samples",
            "2", "--compile", "false", "--device", "cpu"]
    if where == "a file":  # stdout redirected by a shell that runs it: sh -c '... > samples.txt'
        terminal = Terminal("-c", "import os, sys; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT); "
                            "os.dup2(fd, 1); os.execv(sys.executable, [sys.executable, *sys.argv[2:]])",
                            str(samples), *args)
    else:
        terminal = Terminal(*args, "--stream")
    terminal.wait_for(rb"parameters")  # the checkpoint's line: loaded, sampling from here on
    # Into a file nothing shows how far it got: a second's sampling wrote 506 characters a sample, 0.3 s 73-97, of the
    # 100 asserted below (2-core AMD EPYC (Zen 3, AVX2), 2026-12-05). Streamed, 100 characters on the terminal say it.
    if where == "a file":
        time.sleep(1.0)
    else:
        terminal.wait_for(rb"parameters.*\n[\s\S]{100}")
    assert terminal.close() == 128 + signal.SIGHUP  # it was -1 (killed), and 1 once the hang-up was handled
    if where == "a file":
        first, second = samples.read_text(encoding="utf-8").split("-" * 40 + "\n")
        assert first.startswith("F") and len(first) > 100 and len(second) == len(first)


# sample.py whose writing of the samples fails with EIO, as a failing disk's does
EIO_WHILE_WRITING = """
import errno, sys
sys.path.insert(0, ".")
import sample, sampling.request, sampling.writing
sampling.request.prepare = lambda args, prompt=None: (None, None, None, None)
sample.checkpoint_to_read = lambda args: None  # the run folder, looked for before prepare
def write_samples(*args, **kwargs):
    raise OSError(errno.EIO, "Input/output error")
sampling.writing.write_samples = write_samples
sys.exit(sample.main(["--out-dir", "x"]))
"""


def test_eio_from_a_file_is_a_failing_disk_said_in_one_line_not_a_hung_up_terminal(tmp_path):
    """EIO means a closed terminal only on a terminal: asked once stdout had been pointed at /dev/null (a character
    device too), a failing disk under `sample.py > file` ended with 129 and no word."""
    with (tmp_path / "samples.txt").open("w") as out:
        result = subprocess.run([sys.executable, "-c", EIO_WHILE_WRITING], cwd=ROOT, env=child_env(), stdout=out,
                                stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    assert result.returncode == 1
    assert result.stderr == "error: cannot write the samples to stdout (Input/output error)\n"


def test_sighup_is_a_stop_signal_unless_the_process_started_ignoring_it(monkeypatch):
    previous = signal.getsignal(signal.SIGHUP)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        assert stop_signals() == (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup's way
        assert stop_signals() == (signal.SIGINT, signal.SIGTERM)
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_stderr_on_a_hung_up_terminal_goes_quiet_and_on_a_failing_disk_does_not(tmp_path):
    master, slave = pseudo_terminal()
    stream = open(slave, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    quiet = _ReaderMayLeave(stream)
    quiet.write("shown\n")
    quiet.flush()
    assert os.read(master, 100) == b"shown\r\n"
    os.close(master)  # hung up: every write to the terminal fails with EIO
    with pytest.raises(OSError) as failed:
        os.write(slave, b"x")
    assert failed.value.errno == errno.EIO and reader_gone(failed.value, stream)
    quiet.write("lost\n")  # went to /dev/null instead of raising
    quiet.flush()
    assert os.write(slave, b"x") == 1  # the descriptor is /dev/null's now: writes no longer fail
    stream.close()

    disk = (tmp_path / "err.txt").open("w", encoding="utf-8")
    with disk:  # EIO from a regular file is a failing disk, said as such
        assert not reader_gone(OSError(errno.EIO, "Input/output error"), disk)
        assert not reader_gone(OSError(errno.EIO, "Input/output error"), io.StringIO())
