"""Why the warm-cache helper (training/warm.py) could not warm a step's cache, and whether that keeps later runs from
trying again: a fault of the compile's own, which would fail again, is written down in tinychar-<key>.failed; a cause
from outside that passes (a full disk, a kill, too little memory) is not, and a later run tries again: up to
TEMPORARY_LIMIT times in a row (counted in tinychar-<key>.temporary), then once a day (TEMPORARY_PAUSE), as a cause
that looks passing may not pass.

Imports only the standard library (and training.atomic, which does too): the helper loads it while it waits for its
run to end, holding as little memory as it can.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from training.atomic import write_atomic

# The signals that end a compile from outside (kill, a shutdown, the OOM killer, a closed terminal), not by a fault of
# its own: a crash (SIGSEGV, SIGABRT) is a failure, and would crash again.
KILLED_BY = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", signal.SIGTERM)}
# A compile that failed for a cause outside it that passes (passing_cause) ends its process with this status
# (sysexits.h's EX_TEMPFAIL): the helper writes no failure for it, and a later run tries again.
TEMPORARY = 75
# The errors of the file system and the machine that pass: a full disk or quota, a cache folder made read-only,
# removed or taken from this user meanwhile, no memory or processes to spare.
EXHAUSTED = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EROFS, errno.ENOMEM}  # the compiler's too
PASSING_ERRNOS = {*EXHAUSTED, errno.ENOENT, errno.ESTALE, errno.EACCES, errno.EPERM, errno.EAGAIN, errno.EMFILE,
                  errno.ENFILE}
# What the C++ compiler and linker say of such causes, in the output that inductor's compile error holds (the OOM
# killer ends cc1plus, the largest process, more often than the compile's Python): a "C++ error" that would not recur.
PASSING_WORDS = (*sorted(os.strerror(n) for n in EXHAUSTED), "virtual memory exhausted", "out of memory allocating",
                 "Killed signal terminated program")

# A failure as the helper writes it (record_failure, and every tinychar before it): text that begins with the error's
# type and ends with a line break. A file that is not one whole (empty or cut short: its write met the full disk
# that failed the compile) records nothing.
RECORD = re.compile(r"[A-Za-z_]\w*: .*\n", re.DOTALL)
# The record of a compile killed from outside, which a tinychar before KILLED_BY wrote as a failure.
KILLED_RECORD = re.compile(r"^CalledProcessError: .* died with <Signals\.(?:{})(?:: \d+)?>\. \(its output: ".format(
    "|".join(sorted(s.name for s in KILLED_BY))), re.DOTALL)
RECORD_BYTES = 1 << 20  # a record is a line of some hundred bytes
# A cause that looks as if it passes may not: a file inductor needs that is missing, or a header folder this user
# may not read (ENOENT, EACCES) fails every compile the same way, and every later run left a helper that failed
# again, tens of seconds of CPU after each run, for good. So the helper counts such failures in
# tinychar-<key>.temporary (how many in a row, when the last was, and its cause); from TEMPORARY_LIMIT of them on, no
# run starts a helper for TEMPORARY_PAUSE after the last, then one more may try (a disk full three times in a row is
# not full for good): at most one such compile a day. A helper that warms the cache removes the file.
TEMPORARY_LIMIT = 3
TEMPORARY_PAUSE = 24 * 3600.0


def failed_file(folder: Path, key: str) -> Path:
    return folder / f"tinychar-{key}.failed"


def temporary_file(folder: Path, key: str) -> Path:
    return folder / f"tinychar-{key}.temporary"


def _key(job: Path) -> str:
    return job.name.removeprefix("tinychar-").removesuffix(".warming")


def passing_cause(e: BaseException) -> str | None:
    """What in e, or the errors it was raised from, says that the compile failed for a cause outside it that passes
    (PASSING_ERRNOS, PASSING_WORDS, no memory), in words; None where nothing does: a fault of the compile's own (a
    C++ error, an exception in the compiler, a bug), which would fail again. Only the errors it was raised from: one
    raised while handling another (a cache miss's FileNotFoundError, say) is no sign of that other's cause."""
    link: BaseException | None = e
    for _ in range(20):
        if link is None:
            break
        if isinstance(link, MemoryError):
            return "out of memory"
        if isinstance(link, OSError) and link.errno in PASSING_ERRNOS:
            return link.strerror or os.strerror(link.errno)
        if said := next((words for words in PASSING_WORDS if words in str(link)), None):
            return said
        link = link.__cause__
    return None


def helper_failed(e: Exception) -> bool:
    """Whether e, which ended the helper, is a fault of the compile's own, which would fail again: not where its
    compile's process was killed from outside (a shutdown, the OOM killer) or failed for a cause that passes
    (compile_main's TEMPORARY), nor where the helper itself had no memory, or no process, to spare for it."""
    if isinstance(e, subprocess.CalledProcessError):
        return -e.returncode not in KILLED_BY and e.returncode != TEMPORARY
    return passing_cause(e) is None


def record_failure(job: Path, e: Exception) -> None:
    """Write down why the helper of job failed, where later runs look (earlier_failure): whole or not at all."""
    text = f"{type(e).__name__}: {e} (its output: {job}.log)\n".encode()
    write_atomic(failed_file(job.parent, _key(job)), lambda f: f.write(text))


def temporary_failures(folder: Path, key: str) -> tuple[int, float]:
    """How many helpers of this step in a row failed for a cause that passes (TEMPORARY_LIMIT), and when the last did
    (seconds since the epoch); (0, 0.0) where the file holds no count (none there, garbled, or this user may not read
    it: the next such failure writes it anew)."""
    from configs.userinput import read_user_file  # in the helper only once the run has ended

    try:
        record = json.loads(read_user_file(temporary_file(folder, key), "temporary failures", RECORD_BYTES))
    except ValueError:  # UnicodeDecodeError and json's errors too
        return 0, 0.0
    count = record.get("failures") if isinstance(record, dict) else None
    if type(count) is not int or count <= 0:
        return 0, 0.0
    last = record.get("last")
    try:
        when = float(last) if type(last) in (int, float) else 0.0
    except OverflowError:  # an integer past a float's range
        when = 0.0
    # a time to come (a clock set back, a file written by hand) is none: it would keep every run from trying (the
    # minute allows for the rounding of the time written and for clocks of machines sharing the folder)
    return count, when if math.isfinite(when) and when <= time.time() + 60 else 0.0


def record_temporary_failure(job: Path, e: Exception) -> None:
    """Count one more failure of job's helper for a cause that passes, with when and why: whole or not at all."""
    folder, key = job.parent, _key(job)
    record = {"failures": temporary_failures(folder, key)[0] + 1, "last": round(time.time()),
              "cause": f"{type(e).__name__}: {e} (its output: {job}.log)"}
    text = (json.dumps(record) + "\n").encode()
    write_atomic(temporary_file(folder, key), lambda f: f.write(text))


def clear_temporary_failures(job: Path) -> None:
    """The helper of job warmed the cache: failures for causes that pass no longer count against the step."""
    temporary_file(job.parent, _key(job)).unlink(missing_ok=True)


def earlier_failure(folder: Path, key: str) -> Path | None:
    """The file that records why earlier helpers of this step could not warm its cache, which keeps later runs from
    trying again: a failure that would recur (recorded_failure), or TEMPORARY_LIMIT failures in a row for causes that
    should have passed, the last of them less than TEMPORARY_PAUSE ago; None where there is neither."""
    if (path := recorded_failure(folder, key)) is not None:
        return path
    count, last = temporary_failures(folder, key)
    if count >= TEMPORARY_LIMIT and time.time() - last < TEMPORARY_PAUSE:
        return temporary_file(folder, key)
    return None


def _refused(path: Path) -> bool:
    """Whether the system refuses this user the file for its permissions (another user's, in a shared folder)."""
    try:
        os.close(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)))  # a named pipe must not block
    except PermissionError:
        return True
    except OSError:
        pass
    return False


def recorded_failure(folder: Path, key: str) -> Path | None:
    """The file that records a failure of an earlier helper of this step, which would fail again; None where there is
    none. A file there that was read and records none is removed, and later runs warm the cache again: one that is
    not a whole record (empty or cut short, as an older tinychar left it when its write met the full disk that failed
    the compile; garbled, or not a regular file), or the record of a compile killed from outside, which an older
    tinychar took for a failure. One this user may not read (another user's, in a cache folder users share) is taken
    for the failure it most likely records, and kept: it was removed as garbled, by a user who could not know."""
    from configs.userinput import read_user_file  # not in the helper, which never reads one

    path = failed_file(folder, key)
    try:
        found = os.lstat(path)
    except OSError:  # none (or no folder to look in: starting the helper says why)
        return None
    try:
        text = read_user_file(path, "failure record", RECORD_BYTES).decode("utf-8")
    except ValueError:  # UnicodeDecodeError too
        if _refused(path):
            return path
        text = ""
    if RECORD.fullmatch(text) and not KILLED_RECORD.match(text):
        return path
    with contextlib.suppress(OSError):  # a folder, say, or a folder this user cannot change: warmed regardless
        now = os.lstat(path)
        if (now.st_ino, now.st_mtime_ns) == (found.st_ino, found.st_mtime_ns):  # not a helper's record written since
            path.unlink()
    return None
