"""training.warm's failures (training/warm_failures.py): what tinychar-<key>.failed records keeps later runs from
warming the cache only where it is the whole record of a failure that would recur."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import ROOT

from training import warm

# What an older tinychar's helper left, and whether a later run takes it for a failure that would recur
RECORDED = "CalledProcessError: Command '['python', 'warm.py', '--compile']' {} (its output: {}.log)\n"
LEFT = {
    "empty": (b"", False),  # its write met the full disk that had failed the compile
    "cut short": (b"CalledProcessError: Command '['python', 'wa", False),
    "garbled": (b"\xff\xfe\x00\x00\x9c\x00\x01", False),
    "not a record": (b"\n\n", False),
    "killed": (RECORDED.format("died with <Signals.SIGKILL: 9>.", "j").encode(), False),  # by the OOM killer, say
    "shut down": (RECORDED.format("died with <Signals.SIGTERM: 15>.", "j").encode(), False),
    "failed": (RECORDED.format("returned non-zero exit status 1.", "j").encode(), True),
    "crashed": (RECORDED.format("died with <Signals.SIGSEGV: 11>.", "j").encode(), True),  # would crash again
    "in the helper": (b"RuntimeError: this process would compile another step (its output: j.log)\n", True),
}


@pytest.mark.parametrize("left", [*LEFT, "a named pipe", "a folder"])
def test_a_failure_file_that_records_no_lasting_failure_keeps_no_run_from_warming(tmp_path, monkeypatch, left):
    """An older tinychar wrote tinychar-<key>.failed for a compile killed from outside, or met a full disk, and then
    often wrote it empty (its write met the same full disk): start() said "an earlier attempt failed" in every later
    run, until the person removed the file."""
    spawned = []
    monkeypatch.setattr(warm.subprocess, "Popen", lambda args, **kw: spawned.append(args) or SimpleNamespace(pid=-1))
    failed = warm.failed_file(tmp_path, "j")
    if left == "a named pipe":  # never waited on
        os.mkfifo(failed)
    elif left == "a folder":
        failed.mkdir()
    else:
        failed.write_bytes(LEFT[left][0])
    lasting = LEFT.get(left, (b"", False))[1]
    why = warm.start(tmp_path, "j", {"threads": 1})
    if lasting:
        assert why == f"an earlier attempt failed (see {failed})" and not spawned
        assert failed.read_bytes() == LEFT[left][0]  # kept, for the person to read
        return
    assert why is None and len(spawned) == 1
    assert failed.is_dir() if left == "a folder" else not os.path.lexists(failed)  # a folder is not removed


# The helper, its run ended, whose compile fails (status 1, a fault of its own), in a process whose files can grow to
# sys.argv[2] bytes at most: as a disk that fills while the helper writes its record
FAILING_HELPER = """import resource, signal, subprocess, sys
sys.path.insert(0, sys.argv[3])
from pathlib import Path
from training import warm
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk (ENOSPC)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
warm.alive, warm.lowest_priority = (lambda pid: False), (lambda: None)
def compile_child(args, **kwargs):
    raise subprocess.CalledProcessError(1, args)
warm.subprocess.run = compile_child
try:
    warm.main(Path(sys.argv[1]), 2**22 + 1)
except BaseException as e:
    print(type(e).__name__, e)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="no file size limit here (not POSIX)")
def test_a_failure_the_helper_records_is_whole_or_not_there(tmp_path, monkeypatch):
    """An older helper whose record met the full disk left it empty or cut short; it is written whole or not at all
    now (training.atomic), so that a run never reads a real failure's record half-written, and a record written whole
    is read back as a failure."""
    job = warm.job_file(tmp_path, "k")
    failed = warm.failed_file(tmp_path, "k")
    for limit, status in ((16, "OSError [Errno 27] File too large"), (1 << 20, "CalledProcessError")):
        job.write_text(json.dumps({"helper": os.getpid()}))
        done = subprocess.run([sys.executable, "-c", FAILING_HELPER, str(job), str(limit), str(ROOT)],
                              capture_output=True, text=True, timeout=60)
        assert done.stdout.startswith(status), done.stdout + done.stderr
        assert not job.exists()
        if limit == 16:  # nothing half-written, nor a temporary file
            assert list(tmp_path.iterdir()) == []
    assert failed.read_text().endswith(f"returned non-zero exit status 1. (its output: {job}.log)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == [failed.name]
    monkeypatch.setattr(warm.subprocess, "Popen", lambda args, **kw: pytest.fail("a helper started"))
    assert warm.start(tmp_path, "k", {"threads": 1}) == f"an earlier attempt failed (see {failed})"
