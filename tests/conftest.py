"""Shared test fixtures: tiny corpora and tiny configs. The tests stand alone: they read nothing outside the clone and
their own temporary folders, write nothing into the user's home or cache, and reach no other machine."""

from __future__ import annotations

import compileall
import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Encoded corpora, and anything else that honours the XDG cache folder, go to a folder of this test session, which is
# removed at its end; the processes the tests start inherit it, those that import this file too (a torchrun worker
# that imports a test module): they would otherwise make a folder of their own, which nothing removes. Each of
# pytest-xdist's workers (pytest.ini) is a session of its own, with its own folder: two workers sharing one compile
# cache would see each other's markers come and go. A user's TINYCHAR_DATA_DIR is not the tests' business.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_INHERITED_CACHE = (os.environ.get("TINYCHAR_TEST_SESSION_CACHE")
                    if os.environ.get("TINYCHAR_TEST_SESSION_WORKER", "") == _WORKER else None)
_TEMP = os.environ.setdefault("TINYCHAR_TEST_TEMP", tempfile.gettempdir())  # the system's, not a session's TMPDIR
_SESSION_CACHE = _INHERITED_CACHE or tempfile.mkdtemp(prefix="tinychar-test-cache-", dir=_TEMP)
os.environ["TINYCHAR_TEST_SESSION_CACHE"] = _SESSION_CACHE
os.environ["TINYCHAR_TEST_SESSION_WORKER"] = _WORKER
os.environ["TINYCHAR_CACHE_DIR"] = os.path.join(_SESSION_CACHE, "encoded")
# The processes the tests start keep their temporary files there too: torchrun leaves a folder per launch behind.
os.makedirs(os.path.join(_SESSION_CACHE, "tmp"), exist_ok=True)
os.environ["TMPDIR"] = os.path.join(_SESSION_CACHE, "tmp")
os.environ["XDG_CACHE_HOME"] = _SESSION_CACHE
os.environ.pop("TINYCHAR_DATA_DIR", None)
# Inductor's precompiled headers, which a run leaves off (training/compile_cache.py: they cost a model's first compile
# more than they save), pay here, where each worker compiles many small graphs cold: each g++ build of a graph's code
# spends most of its 2.5-3.5 s parsing torch's headers. Measured on a 2-core Zen 3 (torch 2.13), three 1-3 layer steps
# compiled one after the other, each into an empty cache: 38.9, 21.2 and 35.9 s with them against 40.4, 32.5 and 45.0 s
# without. The compiled code is the same either way; the tests of the run's own choice unset the variable. One folder
# holds them for the whole run, made by the process that starts it and inherited by pytest-xdist's workers, so that
# the second worker uses the headers the first made (inductor locks each while it is made), and removed at its end.
os.environ.setdefault("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "1")
_INHERITED_HEADERS = os.environ.get("TINYCHAR_TEST_HEADERS") if _WORKER else None
_HEADERS = _INHERITED_HEADERS or tempfile.mkdtemp(prefix="tinychar-test-headers-", dir=_TEMP)
os.environ["TINYCHAR_TEST_HEADERS"] = _HEADERS
# Where PYTHONDONTWRITEBYTECODE is set (the machines this suite is timed on set it), each of the 200-odd train.py,
# sample.py and helper processes the tests start compiled tinychar's modules from source again: train.py's imports of
# them took 0.27 s so, 0.15 s from bytecode (2-core Zen 2 EPYC, 2026-12-06). The process that starts the run writes
# their bytecode once, where Python writes it on a first import when the variable is not set (the clone's
# __pycache__ folders, which git ignores), and removes at its end the folders it made.
_BYTECODE_MADE: list[Path] = []
if not _WORKER and not _INHERITED_CACHE and sys.dont_write_bytecode:  # not in a process a test starts
    for _package in sorted(p for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests"):
        _BYTECODE_MADE += [d / "__pycache__" for d in (_package, *_package.rglob("*"))
                           if d.is_dir() and d.name != "__pycache__" and not (d / "__pycache__").exists()]
        compileall.compile_dir(_package, quiet=2)


_ZYGOTE = None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: runs a real train.py or sample.py subprocess (seconds); part of the default run"
    )
    # torch 2.13's inductor imports torch.utils.mkldnn, whose module-level classes still use torch.jit.script_method:
    # torch's own deprecation, raised inside torch.compile whatever the compiled code, nothing tinychar calls.
    config.addinivalue_line(
        "filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning:torch.jit._script"
    )
    config.addinivalue_line(
        "markers", "no_zygote: the test's train.py and sample.py are exec'd, not forked from a zygote"
                   " (tests/zygote.py): it times something against torch's import"
    )
    global _ZYGOTE
    if _ZYGOTE is None and not _INHERITED_CACHE:  # the real processes of train.py and sample.py: tests/zygote.py
        import zygote

        _ZYGOTE = zygote.install(dict(os.environ))


def pytest_unconfigure(config: pytest.Config) -> None:
    if _ZYGOTE is not None:
        _ZYGOTE.close()
    if not _INHERITED_CACHE:  # the session that made it removes it
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)
    if not _INHERITED_HEADERS:
        shutil.rmtree(_HEADERS, ignore_errors=True)
    for folder in _BYTECODE_MADE:
        shutil.rmtree(folder, ignore_errors=True)


def _is_local(address: object) -> bool:
    if not isinstance(address, tuple):  # a Unix socket path
        return True
    host = str(address[0])
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False  # a host name: resolving it would already be network


@pytest.fixture(autouse=True)
def _zygote_unless_marked(request: pytest.FixtureRequest):
    if _ZYGOTE is None or request.node.get_closest_marker("no_zygote") is None:
        yield
        return
    _ZYGOTE.off = True
    try:
        yield
    finally:
        _ZYGOTE.off = False


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every connection beyond this machine fails at once, so a test that needs the network fails here too."""
    connect = socket.socket.connect

    def local_only(self: socket.socket, address: object) -> None:
        if not _is_local(address):
            raise OSError(f"tests reach no other machine (tried {address!r})")
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", local_only)


# Tiny models gain nothing from a second thread, and on a busy machine OpenMP's waits between threads cost many
# times the work: the tests and the training runs they start use one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# No helper compiling into the cache after a test's run (training.warm): tests/test_training_warm.py turns it on.
os.environ["TINYCHAR_WARM_CACHE"] = "0"


def _cpu_compile_missing() -> str | None:
    import torch

    from training.compile_cache import cannot_compile

    return cannot_compile(torch.device("cpu"))


# Tests that compile for the CPU need what torch.compile needs there, a C++ compiler above all (a slim container image
# has none). Without it they are skipped, saying why, as the GPU's are; that a run then trains eagerly with one line is
# tested on every machine (tests/test_training_engine.py), and the tests of when to compile pretend a compiler.
_WHY_NOT = _cpu_compile_missing()
needs_cpu_compile = pytest.mark.skipif(_WHY_NOT is not None, reason=f"compiles for the CPU: {_WHY_NOT}")


@pytest.fixture
def a_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """For tests of when tinychar compiles, not of compiling: the machine has what torch.compile needs."""
    from sampling import compiling
    from training import engine

    monkeypatch.setattr(engine, "cannot_compile", lambda device: None)
    monkeypatch.setattr(compiling, "cannot_compile", lambda device: None)


@pytest.fixture(scope="session", autouse=True)
def _compile_into_the_session_cache():
    """Whatever a test compiles goes where a run's compiles go (training.compile_cache.prepare_compile), here the
    session's folder, with a run's settings: not into inductor's default folder in the temp folder, whose entries
    outlive the session (so a later session's compiles were warm there and cold in CI), and whose code the warm
    helper's process, which compiles into the session's folder, could not reuse."""
    import torch._inductor.codecache as codecache

    from training import compile_cache

    compile_cache.prepare_compile()
    # Inductor puts precompiled headers in the temp folder's torchinductor_<user>/precompiled_headers: this process's
    # and its children's go to the run's folder instead (_HEADERS; a torch without that folder is left as it is).
    if all(hasattr(codecache, name) for name in ("_HEADER_DIR", "_HEADER_LOCK_DIR", "default_cache_dir")):
        codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR = _HEADERS, os.path.join(_HEADERS, "locks")
        theirs = Path(os.environ["TMPDIR"]) / Path(codecache.default_cache_dir()).name / "precompiled_headers"
        theirs.parent.mkdir(parents=True, exist_ok=True)
        if not theirs.is_symlink():
            theirs.symlink_to(_HEADERS, target_is_directory=True)


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SMALL_TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n\nFirst Citizen:\nYou are all resolved rather to die than to famish?\n\n"
    "All:\nResolved. resolved.\n\nFirst Citizen:\nFirst, you know Caius Marcius is chief enemy to the people.\n"
) * 20


@pytest.fixture
def small_corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(SMALL_TEXT, encoding="utf-8")
    return path


def tiny_overrides(corpus: Path, out_dir: Path, **extra: object) -> list[str]:
    """Overrides for a seconds-long run on a small corpus."""
    values = {
        "data.path": str(corpus),
        "out_dir": str(out_dir),
        "model.block_size": 8,
        "model.n_layer": 2,
        "model.n_head": 2,
        "model.n_embd": 16,
        "train.batch_size": 8,
        "train.max_iters": 20,
        "train.warmup_iters": 2,
        "train.eval_interval": 10,
        "train.eval_iters": 2,
        "train.log_interval": 5,
        "train.sample_chars": 20,
        # Runs that tests keep alive with a large max_iters would otherwise compile under `auto` (tens of seconds);
        # tests/test_training_engine.py turns compiling on where it is the subject.
        "train.compile": "false",
        # What these runs assert (losses repeated to the bit, the CPU's random state, gloo between processes, the
        # compile cache's helper) holds on the CPU, where CI runs them: on a machine with a GPU, `auto` would take it.
        # Tests of the GPU's path ask for it by name.
        "train.device": "cpu",
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def train_small_run(base: Path, **extra: object) -> Path:
    """Train a tiny model on SMALL_TEXT into base/out, in process; returns the run folder."""
    import train

    corpus = base / "corpus.txt"
    corpus.write_text(SMALL_TEXT, encoding="utf-8")
    out = base / "out"
    assert train.main(["--config", str(ROOT / "configs" / "tiny.yaml"), *tiny_overrides(corpus, out, **extra)],
                      progress=False) == 0
    return out


@pytest.fixture(scope="session")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, str]]:
    """20 steps in one go (evaluations at 10 and 20, TensorBoard on), with its per-step losses: trained once for the
    signal, checkpoint and bad-input tests, which compare with it and work on copies of it."""
    from training_runs import straight_run

    return straight_run(tmp_path_factory.mktemp("straight"))


def refused_with_imports(script: str, args: list[str], cwd: Path) -> tuple[str, list[str]]:
    """Run the project's script (train.py, sample.py) with args in cwd under `python -X importtime`, which must refuse
    them: exit status 2, nothing on stdout, one line on stderr. (That line, the modules the process imported.)"""
    done = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / script), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120, check=False)
    imported = [line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    said = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 2 and done.stdout == "" and len(said) == 1 and said[0].startswith("error: "), said
    return said[0], imported
