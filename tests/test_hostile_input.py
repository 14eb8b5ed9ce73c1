"""Hostile input, tried as a user would: each row runs the real train.py or sample.py in a process of its own, under a
memory limit it sets itself (so a regression fails the test instead of the machine), and must end with exit status 2,
one short line on stderr, no traceback, and the finished run it points at byte for byte as it was. The rows are those
whose regression would take the machine's memory or hang (sizes, devices, pipes); the others run in the test's own
process, in test_bad_input.py's table, with the same checks."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import zygote
from conftest import ROOT
from test_bad_input import LINE_LIMIT, Case, _changed_checkpoint
from test_train import child_env, snapshot
from training_runs import TINY, write_corpus

MEMORY_LIMIT = 8 << 30  # bytes of heap a child may take: a run that slipped past the memory check dies here


_limit_memory = zygote.limits({resource.RLIMIT_DATA: (MEMORY_LIMIT, MEMORY_LIMIT)})


def _fifo(c: Case) -> Path:
    path = c.tmp / "pipe"
    os.mkfifo(path)
    return path


def _shakespeare(c: Case, *overrides: str) -> list[str]:
    """The built-in corpus (long enough for any window) into the finished run, with overrides."""
    return ["--config", TINY, "--overwrite", f"out_dir={c.run}", *overrides]


HOSTILE: list[tuple[str, str, Callable[[Case], list[str]], str]] = [
    # --- sizes checked against memory before anything is allocated
    ("memory-batch", "train", lambda c: c.train(**{"train.batch_size": 10**12}), "needs about"),
    ("memory-block", "train", lambda c: _shakespeare(c, "model.block_size=100000", "train.batch_size=1"),
     "needs about"),
    ("memory-width", "train", lambda c: c.train(**{"model.n_embd": 10**6, "model.n_head": 1}), "needs about"),
    ("sample-chars-beyond-memory", "train", lambda c: c.train(**{"train.sample_chars": 10**10}),
     "train.sample_chars must be at most 100,000"),
    ("checkpoint-huge-block", "sample", lambda c: c.sample(checkpoint=_changed_checkpoint(c, block_size=10**6)),
     "too large for this machine"),
    ("sample-text-beyond-memory", "sample", lambda c: c.sample("--num-samples", "100000", "--max-new-tokens",
                                                               "10000000"), "fewer --num-samples or a smaller"),
    # --- what a user names is bounded and is what it claims to be
    ("config-dev-zero", "train", lambda c: c.train(config="/dev/zero"), "character device"),
    ("prompt-file-dev-zero", "sample", lambda c: c.sample("--prompt-file", "/dev/zero"), "character device"),
    ("prompt-file-fifo", "sample", lambda c: c.sample("--prompt-file", str(_fifo(c))), "is a pipe"),
    ("data-dev-zero", "train", lambda c: c.data(Path("/dev/zero")), "character device"),
    ("data-fifo", "train", lambda c: c.data(_fifo(c)), "is a pipe"),
]


TEST_NAME = "test_hostile_input_in_a_real_process_is_one_short_line_exit_2_and_the_run_is_untouched"


@dataclass
class Outcome:
    result: subprocess.CompletedProcess
    before: dict  # the finished run's files as they were before the process started, and after it ended
    after: dict


@pytest.fixture(scope="module")
def outcomes(straight, tmp_path_factory, request) -> dict[str, Outcome]:
    """The process of every row this session runs, two at a time: each is mostly torch's import, and the machine has
    two cores (one at a time, the rows took about 35 s)."""
    wanted = {item.callspec.params["name"] for item in request.session.items
              if item.originalname == TEST_NAME and hasattr(item, "callspec")}
    rows = [(name, program, make, tmp_path_factory.mktemp(name))
            for name, program, make, _ in HOSTILE if name in wanted]

    def run(row: tuple[str, str, Callable[[Case], list[str]], Path]) -> tuple[str, Outcome]:
        name, program, make, tmp = row
        case = Case(tmp=tmp, run=Path(shutil.copytree(straight[0], tmp / "run")), corpus=write_corpus(tmp))
        args = make(case)
        before = snapshot(case.run)  # (a resume row changed its ckpt.pt before this snapshot, in make)
        result = subprocess.run([sys.executable, f"{program}.py", *map(str, args)], check=False, cwd=ROOT,
                                env=child_env(), capture_output=True, text=True, timeout=120,
                                preexec_fn=_limit_memory)
        return name, Outcome(result, before, snapshot(case.run))

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, rows))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "program", "fragment"), [(c[0], c[1], c[3]) for c in HOSTILE],
                         ids=[c[0] for c in HOSTILE])
def test_hostile_input_in_a_real_process_is_one_short_line_exit_2_and_the_run_is_untouched(
    outcomes, name, program, fragment
):
    outcome = outcomes[name]
    result = outcome.result
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    assert fragment in lines[0] and len(lines[0]) < LINE_LIMIT, lines[0]
    assert outcome.after == outcome.before
    if program == "sample":
        assert result.stdout == ""
