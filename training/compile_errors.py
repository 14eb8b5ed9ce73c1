"""What tinychar does when torch.compile fails or is noisy: one bounded line saying why (the run then goes on
eagerly), and torch's own logs of the failure, or of a damaged cache entry, kept out of the way."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import torch

from configs.userinput import shown

from .compile_cache import cache_folder
from .signals import interrupting

T = TypeVar("T")


def compile_failed(e: Exception) -> str:
    """Forget what torch.compile began and say, in one bounded line, why it failed: the compiler's own error, and
    the one it wraps where that says more ("TorchRuntimeError: RuntimeError when making fake tensor call" alone
    does not say what the call met)."""
    torch._dynamo.reset()
    root = e
    for _ in range(20):  # the chain of errors each raised while handling the one before
        inner = root.__cause__ or root.__context__
        if not isinstance(inner, Exception):
            break
        root = inner
    head = one_line(e).rstrip(":")  # "BackendCompilerFailed: backend='inductor' raised:" ends where its cause begins
    cause = "" if root is e or one_line(root) in head else f"; from {one_line(root)}"
    return f"cannot compile here ({head}{cause})"


# What the dynamic loader says of a library it cannot load (dlopen's messages, as ImportError or OSError gives them:
# "<path>: file too short"): a library whose link was cut short (Ctrl-C or SIGTERM while inductor built it, a full
# disk) is empty or garbled, and inductor, finding it in its cache, loads it rather than building it again.
_UNLOADABLE = re.compile(r"(/[^\s:'\"]+): (file too short|invalid ELF header|cannot open shared object file|"
                         r"ELF load command past end of file|cannot read file data|failed to map segment)")


def unloadable_library(e: BaseException, folder: Path) -> tuple[Path, str] | None:
    """The file inside the compile cache folder that e, or an error it was raised from or while handling, says the
    loader cannot load, and what the loader said of it; None where it names none there (a file elsewhere is never
    the cache's to remove)."""
    link: BaseException | None = e
    for _ in range(20):
        if link is None:
            break
        for m in _UNLOADABLE.finditer(str(link)):
            path = Path(m.group(1))
            try:  # the folder the file is in, links resolved; the file itself may be a link (removing it removes that)
                inside = path.parent.resolve().is_relative_to(folder.resolve())
            except (OSError, RuntimeError):
                continue
            if inside and path.name not in ("", ".", ".."):
                return path, m.group(2)
        link = link.__cause__ or link.__context__
    return None


def compile_or_clear(attempt: Callable[[], T]) -> T:
    """Run attempt, a compile; where it fails on a library in the compile cache that cannot be loaded, left over
    from an interrupted compile (unloadable_library), remove that file, say so on stderr, and run it once more. A
    second failure is raised, for the caller to go on eagerly, saying why (compile_failed), as any other."""
    try:
        return attempt()
    except Exception as e:
        if interrupting(e) is not None:
            raise
        try:
            found = unloadable_library(e, cache_folder())
        except OSError:  # no cache folder (NoCacheFolder)
            found = None
        if found is None:
            raise
        path, said = found
        try:
            there: bool | None = path.is_file() or path.is_symlink()
            if there:
                path.unlink()
        except OSError:
            there = None
        if there is None:  # cannot be removed: the first failure is the one to say
            raise
        what = "it was removed, and is compiled again" if there else "it is compiled again"
        print(f"compile cache: '{shown(str(path), 300)}' in it could not be loaded ({said}), left over from an "
              f"interrupted compile: {what}", file=sys.stderr, flush=True)
        torch._dynamo.reset()
    return attempt()


@contextmanager
def compiler_log_quiet() -> Iterator[None]:
    """While compiling: torch's fake-tensor kernels log the traceback of an error and then raise it (fake_tensor.py:
    log.exception, then raise), and the raise reaches the caller, which says why in one line (compile_failed) and goes
    on eagerly; the log only put the same error before that line as a page of traceback. Left as it is when the user
    asked for torch's logs (TORCH_LOGS)."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    if os.environ.get("TORCH_LOGS") or log.disabled:
        yield
        return
    log.disabled = True
    damaged = _UnreadableEntries()
    cache_log = logging.getLogger("torch._inductor.codecache")
    cache_log.addFilter(damaged)
    # inductor logs an artifact it cannot load (a cache whose 'locks' is a file), then raises: said once, by the caller
    artifacts, unloadable = logging.getLogger("torch._inductor.output_code"), _Dropped("Failed to load artifact")
    artifacts.addFilter(unloadable)
    try:
        yield
    finally:
        log.disabled = False
        cache_log.removeFilter(damaged)
        artifacts.removeFilter(unloadable)
        if damaged.count:
            print(f"compile cache: {damaged.count} compiled graph(s) in it could not be read (damaged files?), and "
                  f"were compiled again", file=sys.stderr, flush=True)


class _UnreadableEntries(logging.Filter):
    """Counts, and keeps out of the log, inductor's warning that an entry of its cache cannot be read: a traceback
    for each damaged file (21 lines of them for one damaged cache), where the graph is simply compiled again."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("fx graph cache unable to load compiled graph"):
            self.count += 1
            return False
        return True


class _Dropped(logging.Filter):
    """Keeps out of the log the messages that begin with prefix."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def one_line(e: Exception) -> str:
    """An exception's type and the first line of its message, at most 300 characters of it."""
    detail = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    return f"{type(e).__name__}: {detail}"
