"""tests/zygote.py, the forks that stand in for the tests' train.py and sample.py processes: a fork is the test
process's own child, and ends, says and writes what the exec'd process does."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import conftest
import pytest
import zygote
from conftest import ROOT, train_small_run
from test_train import child_env

pytestmark = pytest.mark.skipif(conftest._ZYGOTE is None, reason="the zygote is off (TINYCHAR_TEST_ZYGOTE=0, or "
                                                                 "not Linux): every process is exec'd")


def command_line(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def start(forked: bool, *args: str, **kwargs) -> subprocess.Popen:
    conftest._ZYGOTE.off = not forked
    try:
        return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, **kwargs)
    finally:
        conftest._ZYGOTE.off = False


def ended(forked: bool, *args: str) -> tuple[int, str, str]:
    proc = start(forked, *args)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


@pytest.mark.slow
def test_a_forked_sample_py_is_the_tests_child_and_ends_as_the_execd_one(tmp_path):
    run = train_small_run(tmp_path)
    endings = []
    limit = (3 << 30, 3 << 30)
    for forked in (True, False):
        # eager: auto would compile the sampler for ten million characters (seconds of each run, not the point here)
        proc = start(forked, "sample.py", "--out-dir", str(run), "--max-new-tokens", "10000000", "--stream",
                     "--prompt", "F", "--seed", "1", "--compile", "false",
                     preexec_fn=zygote.limits({resource.RLIMIT_DATA: limit}))
        assert "parameters" in proc.stderr.readline()  # loaded: streaming from here
        assert proc.stdout.read(50).startswith("F")
        stat = Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()
        assert int(stat[1]) == os.getpid() and int(stat[2]) == os.getpgrp()  # parent, process group
        assert ("tests/zygote.py" in " ".join(command_line(proc.pid))) == forked  # forked: the zygote's command line
        assert resource.prlimit(proc.pid, resource.RLIMIT_DATA) == limit
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        endings.append((proc.returncode, err.splitlines()[-1]))
    assert endings[0] == endings[1] == (130, "interrupted (SIGINT); stopped sampling")

    # to the end, and refused: the same status, text and lines
    for args, status in [(["sample.py", "--out-dir", str(run), "--max-new-tokens", "200", "--seed", "7"], 0),
                         (["sample.py", "--out-dir", str(tmp_path / "none")], 2),
                         (["train.py", "--config", "configs/tiny.yaml", f"out_dir={tmp_path}", "seed=x"], 2)]:
        forked = ended(True, *args)
        assert forked == ended(False, *args) and forked[0] == status, forked


def test_what_a_fork_cannot_stand_in_for_is_execd():
    z = conftest._ZYGOTE
    train = [sys.executable, "train.py"]
    plain = {"executable": None, "preexec_fn": None, "close_fds": True, "pass_fds": (), "cwd": ROOT, "env": None,
             "shell": False, "restore_signals": True, "gid": None, "gids": None, "uid": None, "umask": -1,
             "start_new_session": False, "process_group": -1}

    def job(args: list[str], **changed: object) -> dict | None:
        return z.job(args, **{**plain, **changed})

    assert job(train)["script"] == str(ROOT / "train.py")
    assert job([sys.executable, "sample.py", "--out-dir", "x"], env={**os.environ, "TINYCHAR_X": "1"})["argv"][2:] \
        == ["--out-dir", "x"]  # read by tinychar once it runs: may differ
    assert job(train, preexec_fn=zygote.limits({resource.RLIMIT_DATA: (1 << 30, 1 << 30)}))["rlimits"]
    assert job(train, start_new_session=True)["setsid"]
    for args, changed in [
        ([sys.executable, "-X", "importtime", "train.py"], {}),  # an option to the interpreter
        ([sys.executable, "-c", "import torch"], {}),
        ([sys.executable, "lab/__main__.py"], {}),  # not one of the scripts
        ([sys.executable, "train.py"], {"cwd": ROOT / "tests"}),  # not there
        (["python3", "train.py"], {}),  # another interpreter
        (train, {"env": {**os.environ, "OMP_NUM_THREADS": "2"}}),  # read as torch loads
        (train, {"env": {**os.environ, "PYTHONIOENCODING": "ascii"}}),  # read as the interpreter starts
        (train, {"preexec_fn": lambda: None}),
        (train, {"pass_fds": (5,)}),
        (train, {"close_fds": False}),
        (train, {"uid": os.getuid()}),
    ]:
        assert job(args, **changed) is None, (args, changed)
    z.off = True
    try:
        assert job(train) is None  # a test marked no_zygote
    finally:
        z.off = False


CACHE_CHECK = """
import importlib, os, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import zygote
path = os.path.join(sys.argv[2], "answer.py")
zygote._compile_ahead([path])
import answer
seen = [answer.VALUE]
stat = os.stat(path)
with open(path, "w") as f:  # the same size and times: taken for the file compiled
    f.write("VALUE = 2\\n")
os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
seen.append(importlib.reload(answer).VALUE)
os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # touched: read again
seen.append(importlib.reload(answer).VALUE)
with open(path, "w") as f:  # another size
    f.write("VALUE = 30\\n")
os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
seen.append(importlib.reload(answer).VALUE)
os.remove(path)
seen.append(zygote.cached_code(path))
print(seen)
"""


def test_a_fork_takes_the_code_compiled_ahead_only_while_its_file_is_unchanged(tmp_path):
    (tmp_path / "answer.py").write_text("VALUE = 1\n", encoding="utf-8")
    code = subprocess.run([sys.executable, "-c", CACHE_CHECK, str(ROOT / "tests"), str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert code.returncode == 0, code.stderr
    assert code.stdout.split("\n")[0] == "[1, 1, 2, 30, None]"
    # and what the zygote compiles is the project's own files, not the tests' or a virtual environment's
    files = zygote._project_files()
    assert str(ROOT / "train.py") in files and str(ROOT / "training" / "loop.py") in files
    assert not any("/tests/" in f or "venv" in f for f in files)
