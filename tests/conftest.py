"""Shared test fixtures: tiny corpora, tiny configs, and the shared data folder for the built-in dataset."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# CI sets TINYCHAR_DATA_DIR to ../shared/data; a developer running pytest by hand gets the same.
if "TINYCHAR_DATA_DIR" not in os.environ and SHARED_DATA.is_dir():
    os.environ["TINYCHAR_DATA_DIR"] = str(SHARED_DATA)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: runs a real train.py or sample.py subprocess (seconds); part of the default run"
    )


# Encoded corpora go to a cache folder of this test session, not the user's cache.
os.environ.setdefault("TINYCHAR_CACHE_DIR", tempfile.mkdtemp(prefix="tinychar-test-cache-"))

# Tiny models gain nothing from a second thread, and on a busy machine OpenMP's waits between threads cost many
# times the work: the tests and the training runs they start use one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")


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
