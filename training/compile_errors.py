"""What tinychar does when torch.compile fails or is noisy: one bounded line saying why (the run then goes on
eagerly), and torch's own logs of the failure, or of a damaged cache entry, kept out of the way."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch


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
