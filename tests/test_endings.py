"""Ends that are not crashes, in real processes: a reader that goes away (`| head`), and Ctrl-C while torch loads or
while sample.py streams. Each ends with at most one line on stderr, no traceback, and the run's checkpoint kept."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, needs_cpu_compile, tiny_overrides, train_small_run
from test_train import child_env, copy_run

from model import load_checkpoint

TINY = str(ROOT / "configs" / "tiny.yaml")

# train.py or sample.py run as __main__, with a Ctrl-C (KeyboardInterrupt) raised at the moment torch starts to load:
# where a real Ctrl-C lands when it comes during the second or more that the import takes.
CTRL_C_WHILE_TORCH_LOADS = """
import runpy, sys

class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise KeyboardInterrupt

sys.meta_path.insert(0, CtrlC())
script, sys.argv = sys.argv[1], sys.argv[1:]
sys.path.insert(0, ".")  # the repository, as when the script is run there: its own modules import before torch
runpy.run_path(script, run_name="__main__")
"""


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny trained run for the sample.py tests, trained once (0.3 s each time): each test samples from a copy of
    its own (copy_run), which its sample.py may change as it likes."""
    return train_small_run(tmp_path_factory.mktemp("small_run"))


def start(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env or child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.mark.slow
def test_train_py_piped_into_head_stops_at_a_step_boundary_with_a_checkpoint(small_corpus, tmp_path):
    out = tmp_path / "out"
    overrides = tiny_overrides(small_corpus, out, **{"train.max_iters": 100_000, "train.log_interval": 1,
                                                      "train.eval_interval": 50_000})
    proc = start("train.py", "--config", TINY, *overrides)
    first = [proc.stdout.readline() for _ in range(3)]  # `| head -3`
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 128 + signal.SIGPIPE, err
    assert all(first) and first[0].startswith("data: ")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "(its output was closed): saved" in err and "--resume" in err
    saved = load_checkpoint(out / "ckpt.pt")
    assert 0 <= saved["step"] < 100_000  # stopped long before the end, with its state


@pytest.mark.slow
def test_train_py_whose_stdout_is_a_full_disk_trains_on_and_says_so_once(small_corpus, tmp_path):
    out = tmp_path / "out"
    with open("/dev/full", "w") as full:  # every write fails with ENOSPC
        result = subprocess.run([sys.executable, "train.py", "--config", TINY, *tiny_overrides(small_corpus, out)],
                                check=False, cwd=ROOT, env=child_env(), stdout=full, stderr=subprocess.PIPE,
                                text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "warning: cannot write to stdout (No space left on device); training goes on without its progress lines "
        "(the checkpoints and TensorBoard logs are written as usual)"]
    assert load_checkpoint(out / "ckpt.pt")["step"] == 20  # the whole run, not stopped at the first line


@pytest.mark.slow
def test_sample_py_piped_into_head_ends_quietly(small_run, tmp_path):
    run = copy_run(small_run, tmp_path)
    # eager: the pipe is the subject here (the Ctrl-C test below ends a compiled stream)
    proc = start("sample.py", "--out-dir", str(run), "--max-new-tokens", "200000", "--stream", "--compile", "false")
    assert len(proc.stdout.read(10)) == 10  # `| head -c 10`
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0
    assert "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train.py", "sample.py"])
def test_ctrl_c_while_torch_loads_is_one_line_and_status_130(tmp_path, script):
    hook = tmp_path / "ctrl_c.py"
    hook.write_text(CTRL_C_WHILE_TORCH_LOADS, encoding="utf-8")
    result = subprocess.run([sys.executable, str(hook), script, "--out-dir", str(run_folder(tmp_path, script))],
                            check=False, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 130
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("interrupted (SIGINT) while starting; nothing was")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == sorted(
        ["ctrl_c.py", *(["run", "run/best.pt"] if script == "sample.py" else [])])


def run_folder(tmp_path: Path, script: str) -> Path:
    """The --out-dir: for train.py a folder that is not there yet, for sample.py one holding a best.pt (which
    sample.py looks for before it imports torch, and reads after; here never)."""
    if script == "train.py":
        return tmp_path / "out"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "best.pt").write_bytes(b"read only once torch has loaded")
    return tmp_path / "run"


# train.py or sample.py as __main__, a signal sent to itself as torch starts to load: since both read their command
# line (train.py its config too) before they import torch, a signal then lands in main, past the scripts' own imports
SIGNAL_WHILE_TORCH_LOADS = """
import os, runpy, signal, sys

class Signal:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            os.kill(os.getpid(), getattr(signal, os.environ["SIGNAL"]))

sys.meta_path.insert(0, Signal())
script, sys.argv = sys.argv[1], sys.argv[1:]
sys.path.insert(0, ".")
runpy.run_path(script, run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.parametrize(("script", "lost", "name"), [("train.py", "saved", "SIGINT"), ("train.py", "saved", "SIGTERM"),
                                                      ("sample.py", "sampled", "SIGTERM")])  # as train.py holds it
def test_a_signal_while_torch_loads_after_the_options_ends_the_command_once_torch_has_loaded(
        small_corpus, tmp_path, script, lost, name):
    hook = tmp_path / "send_signal.py"  # not signal.py, which would stand for the module
    hook.write_text(SIGNAL_WHILE_TORCH_LOADS, encoding="utf-8")
    args = (["--config", TINY, *tiny_overrides(small_corpus, tmp_path / "out")] if script == "train.py" else
            ["--out-dir", str(run_folder(tmp_path, script))])
    result = subprocess.run([sys.executable, str(hook), script, *args], check=False, cwd=ROOT,
                            env={**child_env(), "SIGNAL": name}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 128 + getattr(signal, name)
    assert result.stderr == f"interrupted ({name}) while starting; nothing was {lost}\n"
    assert result.stdout == "" and not (tmp_path / "out").exists()


def with_torch_logs(command: list[str], logs: str, corpus: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """command (train.py, sample.py or -m lab notes) with TORCH_LOGS=logs, on a run of its own where it needs one."""
    script = command[0]
    args = (["--config", TINY, *tiny_overrides(corpus, tmp_path / "out")] if script == "train.py" else
            ["--out-dir", str(run_folder(tmp_path, script))] if script == "sample.py" else [])
    return subprocess.run([sys.executable, *command, *args], check=False, cwd=ROOT,
                          env={**child_env(), "TORCH_LOGS": logs}, capture_output=True, text=True, timeout=120)


# Each command, and each of torch's two refusals, once: every command loads torch through the same start_or_status,
# whose handling of each refusal is the same whichever command calls it, and each process costs an import of torch
# (1.5 s of CPU; the whole matrix of six was 10 s). A command that loaded torch any other way fails here whichever
# refusal it meets; a refusal handled wrongly fails whichever command meets it.
@pytest.mark.no_zygote  # torch reads TORCH_LOGS as it loads: a process forked with torch loaded never would
# nothere.logs: a module whose package does not exist, which torch looks for with importlib's find_spec, and that
# raised ModuleNotFoundError, a traceback of torch's loading
@pytest.mark.parametrize(("command", "logs"), [(["train.py"], "POSIX"), (["sample.py"], "+nothere.logs"),
                                               (["-m", "lab", "notes"], "POSIX")],
                         ids=["POSIX-train", "+nothere.logs-sample", "POSIX-lab"])
def test_a_torch_logs_naming_no_log_is_one_line_and_status_2(small_corpus, tmp_path, command, logs):
    """torch refuses such a TORCH_LOGS as it loads, in a ValueError listing every log it has: that was a traceback
    of a hundred lines and exit status 1, for a documented variable given a wrong value."""
    result = with_torch_logs(command, logs, small_corpus, tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"error: TORCH_LOGS '{logs}' is not a list of torch's logs; give comma-separated names "
                             "(dynamo,+inductor; TORCH_LOGS=help lists them) or unset it\n")
    assert result.stdout == "" and not (tmp_path / "out").exists()


@pytest.mark.no_zygote  # torch reads TORCH_LOGS as it loads: a process forked with torch loaded never would
# each command once, +help (torch's full list) on one of them: as above, the list is printed by the same code for all
@pytest.mark.parametrize(("command", "asked"), [(["train.py"], "help"), (["sample.py"], "+help"),
                                                (["-m", "lab", "notes"], "help")],
                         ids=["train", "sample-all", "lab"])
def test_torch_logs_help_prints_torchs_list_of_logs_and_ends_with_status_0(small_corpus, tmp_path, command, asked):
    """TORCH_LOGS=help asks torch for its list of logs, which torch gives as it loads, as the message of a ValueError:
    that was the list at the end of a traceback, and exit status 1. Asked for, it is printed as --help's text is (on
    stdout, status 0), and nothing else is done."""
    result = with_torch_logs(command, asked, small_corpus, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.startswith("TORCH_LOGS Info\n") and "TORCH_LOGS=\"+dynamo,aot\"" in result.stdout
    assert ("All registered names" in result.stdout) == (asked == "+help")  # +help: the full list
    assert not (tmp_path / "out").exists()


@pytest.mark.no_zygote  # what failed was torch's loading: a process forked with torch loaded never loads it
@pytest.mark.parametrize("command", [["train.py"], ["sample.py"], ["lab/__main__.py", "notes"]],
                         ids=["train", "sample", "lab"])
def test_a_current_folder_that_was_removed_is_one_line_and_status_2(small_corpus, tmp_path, command):
    """A shell left in a folder another removed: torch's MKL ended the process as it loaded, its one line saying
    "Intel oneMKL FATAL ERROR: Cannot load .../libtorch_cpu.so", which named neither cause nor cure."""
    script = str(ROOT / command[0])
    args = (["--config", TINY, *tiny_overrides(small_corpus, tmp_path / "out")] if command[0] == "train.py" else
            ["--out-dir", str(run_folder(tmp_path, "sample.py"))] if command[0] == "sample.py" else command[1:])
    gone = tmp_path / "gone"
    gone.mkdir()
    result = subprocess.run(["sh", "-c", 'rmdir "$PWD" && exec "$0" "$@"', sys.executable, script, *args],
                            check=False, cwd=gone, env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr == ("error: the current folder no longer exists (it was removed while the shell was in it); "
                             "cd into a folder that exists and run the command again\n")
    assert result.stdout == "" and not gone.exists() and not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.no_zygote  # among the places it lands: torch's import
def test_a_real_ctrl_c_soon_after_launch_is_one_line_and_status_130(small_corpus, tmp_path):
    """Wherever the signal lands (the imports, the arguments, reading the data), one line and 130. On a loaded
    machine it can land before the interpreter has set up its own Ctrl-C handling: then the process ends as any
    program does on SIGINT (a shell shows 130 too), with nothing printed."""
    proc = start("train.py", "--config", TINY, *tiny_overrides(small_corpus, tmp_path / "out"))
    time.sleep(0.6)  # past the interpreter's own start-up (its site module), which no script can guard
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err, err
    if proc.returncode == -signal.SIGINT:  # killed before Python's own handler existed
        assert err == ""
    else:
        assert proc.returncode == 130 and len(err.strip().splitlines()) == 1, err


# sample.py as __main__ with a Ctrl-C landing while torch reads the checkpoint (which takes seconds for a large one)
CTRL_C_WHILE_THE_CHECKPOINT_LOADS = """
import runpy, sys
import torch

def ctrl_c(*args, **kwargs):
    raise KeyboardInterrupt

torch.load = ctrl_c
script, sys.argv = sys.argv[1], sys.argv[1:]
sys.path.insert(0, ".")  # the repository, as when sample.py is run as a script there
runpy.run_path(script, run_name="__main__")
"""


@pytest.mark.slow
def test_ctrl_c_while_sample_py_loads_the_checkpoint_is_one_line_and_status_130(small_run, tmp_path):
    run = copy_run(small_run, tmp_path)
    hook = tmp_path / "ctrl_c.py"
    hook.write_text(CTRL_C_WHILE_THE_CHECKPOINT_LOADS, encoding="utf-8")
    result = subprocess.run([sys.executable, str(hook), "sample.py", "--out-dir", str(run)], check=False, cwd=ROOT,
                            env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 130 and result.stdout == ""
    assert result.stderr == "interrupted (SIGINT); nothing was sampled\n"


@pytest.mark.slow
def test_a_stop_while_sample_py_samples_writes_the_text_so_far(small_run, tmp_path):
    """Without --stream the samples are written at the end: `timeout 60 python sample.py ... > out.txt` wrote
    nothing of the minute it sampled. Now a stop between characters writes each sample as far as it got."""
    run = copy_run(small_run, tmp_path)
    # on the CPU: on a GPU, CUDA's start and the graph's capture can outlast the second below, and the stop comes
    # before the first character (nothing drawn, nothing written)
    proc = start("sample.py", "--out-dir", str(run), "--max-new-tokens", "10000000", "--prompt", "F",
                 "--num-samples", "2", "--compile", "false", "--device", "cpu")
    assert "parameters" in proc.stderr.readline()  # the checkpoint's line: loaded, sampling from here on
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "interrupted (SIGTERM); stopped sampling" and "Traceback" not in err
    first, second = out.split("-" * 40 + "\n")
    assert first.startswith("F") and first.endswith("\n") and len(first) > 100
    assert second.startswith("F") and len(second) == len(first)  # drawn as one batch: as far, each


@needs_cpu_compile
@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_while_sample_py_compiles_ends_it_without_waiting_for_the_compiler(small_run, tmp_path, signum):
    """A Ctrl-C while the sampler compiled (seconds with a cold cache) was only noted: the compile ran to its end, and
    the run stopped after the first character. Now it stops the compile, as in train.py."""
    run = copy_run(small_run, tmp_path)
    cache = tmp_path / "cache"  # cold: seconds of compiling
    proc = start("sample.py", "--out-dir", str(run), "--max-new-tokens", "1000000", "--compile", "true",
                 env={**child_env(), "XDG_CACHE_HOME": str(cache), "TINYCHAR_CACHE_DIR": str(cache)})
    assert "parameters" in proc.stderr.readline()  # loaded: compiling from here
    time.sleep(1.5)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err
    assert err.strip().splitlines()[-1] == f"interrupted ({signal.Signals(signum).name}); stopped sampling", err
    assert "compiled in" not in err and "Traceback" not in err and out == ""


def loading_torch(proc: subprocess.Popen) -> None:
    """Return once proc has begun to load torch's libraries (on Linux, where /proc shows what a process has mapped;
    elsewhere a second after its start). A fixed second was too long where torch loads fast: sample.py had loaded it
    and was sampling by then."""
    maps = Path(f"/proc/{proc.pid}/maps")
    if not maps.exists():
        time.sleep(1.0)
        return
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if "libtorch_cpu" in maps.read_text():
                return
        except OSError:  # between its fork and its exec
            pass
        time.sleep(0.005)
    raise AssertionError(f"sample.py did not begin to load torch (exit status {proc.poll()})")


@pytest.mark.slow
@pytest.mark.no_zygote  # its signal must land while torch loads
def test_sigterm_while_sample_py_starts_is_one_line_and_status_143(small_run, tmp_path):
    """kill or timeout while torch loads (a second or more) ended sample.py without a word."""
    run = copy_run(small_run, tmp_path)
    proc = start("sample.py", "--out-dir", str(run))
    loading_torch(proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert out == "" and re.fullmatch(r"interrupted \(SIGTERM\)( while starting)?; nothing was sampled\n", err), err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_while_sample_py_imports_its_first_modules_is_one_line(tmp_path, signum):
    """The signal lands while sample.py imports its own modules, before torch: a hang-up there ended it without a
    word (exit 129), where SIGTERM got its line. An import hook sends it, at the first of those modules."""
    script = (
        "import os, runpy, signal, sys\n"
        "class Stop:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'configs':\n"
        "            sys.meta_path.remove(self)\n"
        f"            os.kill(os.getpid(), {int(signum)})\n"
        "sys.meta_path.insert(0, Stop())\n"
        f"sys.argv = ['sample.py', '--out-dir', {str(tmp_path / 'none')!r}]\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        f"runpy.run_path({str(ROOT / 'sample.py')!r}, run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=60, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))  # not nohup's
    name = signal.Signals(signum).name
    assert (done.returncode, done.stdout, done.stderr) == (
        128 + signum, "", f"interrupted ({name}) while starting; nothing was sampled\n")


@pytest.mark.slow
def test_sample_py_writing_to_a_full_disk_or_a_closed_stdout_is_one_line(small_run, tmp_path):
    run = copy_run(small_run, tmp_path)
    # 200 characters, eager (--compile auto compiles from 10,000): written at the end, or each flushed as it comes with
    # --stream, the first write to fail is the same as with 2,000 (0.5 s more of sampling a run)
    args = [sys.executable, "sample.py", "--out-dir", str(run), "--max-new-tokens", "200"]
    for extra in ([], ["--stream"]):
        with open("/dev/full", "w") as full:  # every write fails with ENOSPC
            result = subprocess.run([*args, *extra], check=False, cwd=ROOT, env=child_env(), stdout=full,
                                    stderr=subprocess.PIPE, text=True, timeout=120)
        assert result.returncode == 1, result.stderr
        assert result.stderr.splitlines()[-1] == "error: cannot write the samples to stdout (No space left on device)"
        assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr
    closed = subprocess.run(args, check=False, cwd=ROOT, env=child_env(), stderr=subprocess.PIPE, text=True,
                            timeout=120, preexec_fn=lambda: os.close(1))  # `>&-`
    assert closed.returncode == 2
    assert closed.stderr.startswith("error: stdout is closed") and len(closed.stderr.splitlines()) == 1
    # stderr a full disk (`2> log` on a full file system): its first line, the checkpoint's, raised, and every sample
    # was lost in a traceback nobody could read, with exit status 1
    with open("/dev/full", "w") as full:
        result = subprocess.run([*args, "--max-new-tokens", "50", "--seed", "3"], check=False, cwd=ROOT,
                                env=child_env(), stdout=subprocess.PIPE, stderr=full, text=True, timeout=120)
    assert result.returncode == 0
    assert len(result.stdout) == 1 + 50 + 1 and result.stdout.startswith("\n")  # the prompt (a newline), the text...


@pytest.mark.slow
def test_one_sigterm_ends_sample_py_streaming_into_a_reader_that_does_not_read(small_run, tmp_path):
    """`timeout 60 python sample.py --stream ... | less`: one SIGTERM, while a streamed write waited on a full pipe,
    was noted for after the write, which waited as long as the reader did."""
    run = copy_run(small_run, tmp_path)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("a" * 200_000, encoding="utf-8")  # more than a pipe holds: the first write waits
    proc = start("sample.py", "--out-dir", str(run), "--prompt-file", str(prompt), "--max-new-tokens", "1000000",
                 "--stream", "--compile", "false")
    wchan = Path(f"/proc/{proc.pid}/wchan")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "pipe" not in (wchan.read_text() if wchan.exists() else ""):
        time.sleep(0.1)  # until it waits on the pipe (Linux says so; elsewhere, a minute)
    proc.send_signal(signal.SIGTERM)
    try:
        status = proc.wait(timeout=20)
    finally:
        proc.kill()
        _, err = proc.communicate()
    assert status == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "interrupted (SIGTERM); stopped sampling"


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_while_sample_py_streams_keeps_what_was_printed(small_run, tmp_path, signum):
    """SIGTERM (kill, timeout) ended sample.py without a word; it now ends as a Ctrl-C does, with 128 + 15."""
    run = copy_run(small_run, tmp_path)
    # Eager: the signal is acted on between characters whichever path draws them (10 million would compile first)
    proc = start("sample.py", "--out-dir", str(run), "--max-new-tokens", "10000000", "--stream", "--prompt", "F",
                 "--compile", "false")
    assert proc.stdout.read(50).startswith("F")
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == f"interrupted ({name}); stopped sampling"
    assert Path(run / "ckpt.pt").exists()
