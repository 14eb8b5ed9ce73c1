"""A clone stands alone: nothing in it names a folder of a particular machine, requirements.txt names every package
the code imports, and the README's commands train and sample in a lone copy with an empty HOME."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT

# Folders that exist on one machine only: its users' homes, a workplace, the folder beside the clone.
MACHINE_PATHS = re.compile(r"/work/|/home/[a-z]|/root/|/Users/|\.\./shared|[A-Z]:\\\\Users")
NOT_PROJECT = {".git", ".ci-venv", ".venv", "venv", "runs", "out", ".pytest_cache", ".hypothesis", ".ruff_cache",
               "__pycache__"}
# Import name -> the distribution requirements.txt installs it from, where the two differ.
DISTRIBUTIONS = {"PIL": "pillow", "yaml": "pyyaml"}


def project_files() -> list[Path]:
    files = []
    for path in sorted(ROOT.rglob("*")):
        parts = set(path.relative_to(ROOT).parts)
        if path.is_file() and not parts & NOT_PROJECT and path.suffix not in (".png", ".pyc", ".pt"):
            files.append(path)
    return files


def test_no_file_of_the_project_names_a_path_of_a_particular_machine() -> None:
    assert len(project_files()) > 40  # the walk found the project
    offenders = []
    for path in project_files():
        if path.name == "tinyshakespeare.txt" or path == Path(__file__):  # this file holds the patterns and examples
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if MACHINE_PATHS.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


def test_the_finder_finds_what_it_looks_for() -> None:
    for line in ("see /work/shared/notes", "TINYCHAR_DATA_DIR=../shared/data", "/home/alice/corpus.txt"):
        assert MACHINE_PATHS.search(line)
    assert not MACHINE_PATHS.search("runs/tiny/ckpt.pt and ~/.cache/tinychar")


def imported_packages() -> set[str]:
    """Top-level names of every package the project's Python files import, less the standard library and the
    project's own packages and modules."""
    own = {p.stem for p in ROOT.glob("*.py")} | {p.parent.name for p in ROOT.glob("*/__init__.py")}
    own |= {p.stem for p in (ROOT / "tests").glob("*.py")}
    found = set()
    for path in project_files():
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - own - {"__future__"}


def required() -> set[str]:
    names = set()
    for line in (ROOT / "requirements.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.add(re.split(r"[<>=!~\[; ]", line)[0].lower())
    return names


def test_requirements_name_every_package_the_code_imports() -> None:
    imported = {DISTRIBUTIONS.get(name, name).lower() for name in imported_packages()}
    assert {"torch", "pillow", "numpy", "tqdm", "pyyaml"} <= imported  # the scan sees the project's imports
    # tensorboard is not imported (runs write its files themselves) but required: it shows them, and tests read them
    assert imported | {"tensorboard"} <= required(), "requirements.txt misses what the code imports"


@pytest.mark.slow
def test_a_lone_copy_with_an_empty_home_trains_and_samples_as_the_readme_says(tmp_path: Path) -> None:
    """The README's commands in a copy of the project with nothing beside it, HOME empty and no data or cache
    variables: the built-in corpus comes from the copy itself, and only the cache under HOME is written."""
    clone = tmp_path / "alone" / "tinychar"
    shutil.copytree(ROOT, clone, ignore=shutil.ignore_patterns(*NOT_PROJECT, "*.pt"))
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TINYCHAR_", "XDG_", "TORCHINDUCTOR_"))}
    env.update(HOME=str(home), OMP_NUM_THREADS="1")
    data_before = sorted(p.name for p in (clone / "data").iterdir())

    def command(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], check=False, cwd=clone, env=env, capture_output=True, text=True,
                              timeout=300)

    # the defaults (configs/tiny.yaml), shortened: a real run of the full length is the README's measurement. Four
    # steps and one evaluation of one batch a split are enough to write the run and read the corpus from the copy
    # (2.5 s of CPU for train.py, against 4.0 s for 40 steps evaluated on 32 batches: 2026-12-05, 2-core AMD EPYC
    # (Zen 3, AVX2); an interpreter that imports torch is 1.7 s of either)
    trained = command("train.py", "train.max_iters=4", "train.eval_interval=4", "train.eval_iters=1",
                      "train.log_interval=2")
    assert trained.returncode == 0, trained.stderr
    assert "tiny Shakespeare" in trained.stdout and str(clone / "data" / "tinyshakespeare.txt") in trained.stdout
    assert (clone / "runs" / "tiny" / "ckpt.pt").is_file()
    sampled = command("sample.py", "--out-dir", "runs/tiny", "--prompt", "ROMEO:", "--max-new-tokens", "20")
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout.startswith("ROMEO:") and len(sampled.stdout) == len("ROMEO:") + 20 + 1
    assert sorted(p.name for p in (clone / "data").iterdir()) == data_before  # nothing written next to the corpus
    written = sorted(str(p.relative_to(home)) for p in home.rglob("*") if p.is_file())
    # on a GPU, the CUDA driver keeps the GPU code it compiles as a program loads in ~/.nv/ComputeCache (any CUDA
    # program does; CUDA_CACHE_PATH moves it): the driver's, not tinychar's
    ours = [name for name in written if not (torch.cuda.is_available() and name.startswith(".nv/ComputeCache/"))]
    # the encoded corpus, the eager sampler's window kernel where it applies (sample.py builds it once a machine),
    # and the machine's matrix-multiply ceiling, MFU's yardstick (training/ceiling.py), with the markers' lock file
    kernels = [name for name in ours if name.startswith(".cache/tinychar/compiled/")]
    ceiling = [name for name in kernels if re.fullmatch(r"tinychar-(ceiling-\w+\.json|markers\.lock)", Path(name).name)]
    assert len(ceiling) == 2, written
    assert all(Path(name).name.startswith("tinychar-window-") and name.endswith(".so")
               for name in kernels if name not in ceiling), written
    encoded = [name for name in ours if name.startswith(".cache/tinychar/encoded/")]
    assert encoded and sorted(encoded + kernels) == ours, written
