"""A bench's --json file, shared by bench.py (benchmark/report.py) and data/bench.py (data/bench_report.py): the check
made before anything runs, and the write when it is done. A regular file is only ever replaced by an earlier result
of the same bench; a pipe or a device (/dev/stdout) is written into, never read."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path

from configs.userinput import resolved
from training.atomic import write_atomic

# An earlier result is a few kilobytes: a larger file is something else, and is not read whole to find that out.
MAX_RESULT_BYTES = 1 << 20


def json_problem(name: str, example: str, is_result: Callable[[dict], bool], earlier: str) -> str | None:
    """Why the results could not be written to the file name (--json), in words, or None. example is a file name to
    suggest (bench.json); is_result tells an earlier result's JSON object; earlier names one in the message."""
    if name == "":
        return f"'' is empty; give a file name, such as {example}"
    path = Path(name)
    try:
        if path.is_dir():
            return f"'{name}' is a folder; give a file name, such as {example}"
        folder = resolved(path).parent
        if not folder.is_dir():
            if path.is_symlink():  # the file goes where the link points (write_json), a folder that is not there
                return (f"'{name}' is a link to '{os.readlink(path)}', in a folder '{folder}' that is not there; "
                        f"make that folder, or give another file name")
            return f"no folder '{path.parent}' to write '{name}' into"
    except OSError as e:  # a loop of links (resolved), or a name too long for the system: Path.is_dir raises it
        if e.errno == errno.ELOOP:
            return f"cannot use '{name}' (its links go round in a loop); give another file name"
        return f"cannot use '{name}' ({e.strerror or type(e).__name__}); give another file name"
    # A regular file is replaced by a new one made in its folder (write_json): the folder must take it. A pipe or a
    # device is written into.
    device = path.exists() and not path.is_file()
    if not os.access(path if device else folder, os.W_OK):
        return f"'{name}' cannot be written there; give another file name"
    if device:
        return None
    if path.exists():
        if any(same_file(path, fd) for fd in (1, 2)):
            return (f"'{name}' is the file this command's output is redirected to, which the results would "
                    f"replace; give --json a file of its own")
        if not os.access(path, os.R_OK):
            return (f"'{name}' cannot be read, so whether it holds an earlier result is not known; give another file "
                    f"name")
        if not holds_result(path, is_result):
            return (f"'{name}' holds something other than {earlier}, which the results would replace; give a new "
                    f"file name")
    return None


def same_file(path: Path, fd: int) -> bool:
    """Whether the file descriptor fd (stdout: 1) is open on the file at path."""
    try:
        return os.path.samestat(path.stat(), os.fstat(fd))
    except OSError:  # fd closed
        return False


def holds_result(path: Path, is_result: Callable[[dict], bool]) -> bool:
    """Whether the regular file at path holds a JSON object that is_result takes for an earlier result."""
    try:
        if path.stat().st_size > MAX_RESULT_BYTES:
            return False
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # unreadable, not UTF-8 or not JSON, or nested past Python's limit
        return False
    return isinstance(data, dict) and is_result(data)


def write_json(name: str, text: str, problem: Callable[[str], str | None]) -> None:
    """Write the results to the file name: a regular file is replaced whole once the new one is complete, so a full
    disk leaves an earlier result as it was; a pipe or a device (/dev/stdout) is written into as it is. problem is the
    bench's json_problem, asked again as the file may have changed while the bench ran."""
    path = Path(name)
    if path.exists() and not path.is_file():
        path.write_text(text, encoding="utf-8")
        return
    if (why := problem(name)) is not None:
        raise OSError(why)
    write_atomic(path.resolve(), lambda f: f.write(text.encode("utf-8")))
