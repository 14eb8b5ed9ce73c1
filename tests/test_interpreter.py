"""train.py, sample.py, bench.py and the lab's commands on a Python older than tinychar needs: one line and exit
status 2, said before any of its modules (or its requirements) are imported, not an ImportError traceback from inside
them; and each of them without a requirement installed."""

from __future__ import annotations

import ast
import contextlib
import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from training.interpreter import OLDEST, missing_requirement, too_old


def old_python() -> str | None:
    """An interpreter older than OLDEST that can parse the entry points (3.8-3.10), if this machine has one that runs
    (a pyenv shim on PATH may name a version that is not installed, or not selected)."""
    roots = [os.environ.get("PYENV_ROOT"), os.path.expanduser("~/.pyenv")]
    base = Path(sys.base_prefix)  # this Python, or the one its virtual environment was made from, pyenv's own
    if base.parent.name == "versions":
        roots.append(str(base.parent.parent))
    for minor in (10, 9, 8):
        shim = shutil.which(f"python3.{minor}")
        if shim and Path(shim).parent.name == "shims":  # pyenv's shims are in ROOT/shims
            roots.append(str(Path(shim).parent.parent))
    for minor in (10, 9, 8):
        candidates = [shutil.which(f"python3.{minor}")]
        for root in filter(None, roots):
            candidates += sorted(glob.glob(os.path.join(root, "versions", f"3.{minor}.*", "bin", "python")))
        for python in filter(None, candidates):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                said = subprocess.run([python, "-c", "import sys; print(sys.version_info[1])"], capture_output=True,
                                      text=True, timeout=30)
                if said.returncode == 0 and said.stdout.strip() == str(minor):
                    return python
    return None


OLD_PYTHON = old_python()


@pytest.mark.parametrize("version", [(3, 10, 13, "final", 0), (3, 8, 0), (2, 7, 18)])
def test_an_older_python_is_refused_in_one_line(version: tuple) -> None:
    line = too_old("/somewhere/train.py", version, "/usr/bin/python3.10")
    assert line is not None and "\n" not in line
    assert line.startswith("error: tinychar needs Python 3.11 or newer")
    assert f"Python {'.'.join(map(str, version[:3]))};" in line and "/usr/bin/python3.10" in line
    assert "run train.py with python3.11" in line and "pip install -r requirements.txt" in line


@pytest.mark.parametrize("version", [OLDEST + (0,), (3, 12, 1), (3, 13, 0), (4, 0, 0), tuple(sys.version_info)])
def test_a_recent_enough_python_is_let_through(version: tuple) -> None:
    assert too_old("train.py", version) is None


# Every file a command is started from, as `python FILE` or `python -m MODULE`
ENTRY_POINTS = ["train.py", "sample.py", "bench.py", "lab/__init__.py", "lab/__main__.py", "lab/sort.py",
                "lab/walkthrough.py", "data/bench.py"]


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_the_entry_points_and_the_check_parse_on_python_3_8(script: str) -> None:
    for path in (ROOT / script, ROOT / "training" / "interpreter.py", ROOT / "training" / "__init__.py"):
        ast.parse(path.read_text(encoding="utf-8"), str(path), feature_version=(3, 8))


@pytest.mark.skipif(OLD_PYTHON is None, reason="no Python 3.8-3.10 on this machine (python3.10 on PATH or pyenv)")
@pytest.mark.parametrize("argv", [["train.py", "--help"], ["train.py"], ["sample.py"], ["sample.py", "--help"]])
def test_an_older_python_running_an_entry_point_sees_one_line(argv: list[str], tmp_path: Path) -> None:
    # -E -s: no PYTHON* variables and no user site-packages (not -I, which would leave out the script's folder, where
    # the training package is found); from another folder, which the script writes nothing into
    done = subprocess.run([OLD_PYTHON, "-E", "-s", str(ROOT / argv[0]), *argv[1:]], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: tinychar needs Python 3.11 or newer")
    assert f"run {argv[0]} with python3.11" in done.stderr
    assert list(tmp_path.iterdir()) == []  # not even a runs/ folder


@pytest.mark.skipif(OLD_PYTHON is None, reason="no Python 3.8-3.10 on this machine (python3.10 on PATH or pyenv)")
@pytest.mark.parametrize(("argv", "named"), [
    (["bench.py", "--help"], "bench.py"),
    (["bench.py", "--nanogpt", "nowhere"], "bench.py"),
    (["lab/__main__.py", "notes"], "-m lab"),
    (["lab/sort.py", "--help"], "sort.py"),
    (["lab/walkthrough.py"], "walkthrough.py"),
    (["-m", "lab", "sort", "--steps", "1"], "-m lab"),
    (["-m", "lab", "--help"], "-m lab"),
    (["-m", "lab.sort"], "sort.py"),
    (["-m", "lab.walkthrough"], "walkthrough.py"),
])
def test_an_older_python_running_the_bench_or_the_lab_sees_one_line(argv: list[str], named: str) -> None:
    # they stopped in a ModuleNotFoundError (PyYAML) or ImportError (typing.Self) traceback from inside the packages;
    # from the repository's root, where python -m finds the lab
    argv = argv if argv[0] == "-m" else [str(ROOT / argv[0]), *argv[1:]]
    done = subprocess.run([OLD_PYTHON, "-E", "-s", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: tinychar needs Python 3.11 or newer")
    assert f"run {named} with python3.11" in done.stderr


@pytest.mark.parametrize(("module", "named"), [("torch", "torch"), ("yaml", "PyYAML"), ("PIL", "Pillow")])
def test_a_requirement_not_installed_is_named_in_one_line(module: str, named: str) -> None:
    line = missing_requirement(ModuleNotFoundError(f"No module named '{module}'", name=module), "/venv/bin/python")
    assert line is not None and "\n" not in line
    assert line.startswith(f"error: {named} is not installed for /venv/bin/python (Python ")
    assert line.endswith("`/venv/bin/python -m pip install -r requirements.txt`")


@pytest.mark.parametrize("module", ["torch._C", "training.runner", "configs", None])
def test_other_missing_modules_keep_their_traceback(module: str | None) -> None:
    # a requirement broken inside, or a module of tinychar's own gone (a damaged clone): not an install to suggest
    assert missing_requirement(ModuleNotFoundError("No module", name=module)) is None


# Runs an entry point as `python SCRIPT ARGS` would, with the imports of one top-level module failing as they do
# where it is not installed
WITHOUT = """import runpy, sys
ABSENT = sys.argv[1]
class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NotInstalled())
sys.argv = sys.argv[2:]
sys.path.insert(0, sys.argv[0].rpartition("/")[0])  # the script's folder, as `python SCRIPT` puts it first
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize(("module", "named", "argv"), [
    ("yaml", "PyYAML", ["train.py", "--help"]),
    ("yaml", "PyYAML", ["sample.py", "--help"]),
    ("yaml", "PyYAML", ["bench.py", "--help"]),
    ("yaml", "PyYAML", ["lab/__main__.py", "--help"]),
    ("yaml", "PyYAML", ["lab/__main__.py", "sort", "--steps", "1"]),
    ("yaml", "PyYAML", ["lab/sort.py", "--help"]),
    ("yaml", "PyYAML", ["lab/walkthrough.py"]),
    ("torch", "torch", ["train.py", "--config", "configs/tiny.yaml", "out_dir=run", "train.max_iters=1"]),
    ("torch", "torch", ["sample.py", "--checkpoint", "configs/tiny.yaml"]),
    # python -m lab as well: configs, which its first lines import, imports PyYAML (a traceback of the import)
    ("yaml", "PyYAML", ["lab/__main__.py", "notes"]),
    ("torch", "torch", ["lab/__main__.py", "notes"]),
    # the pipeline's benchmark, a command of the README's too (python data/bench.py): a traceback of either import
    ("yaml", "PyYAML", ["data/bench.py", "--help"]),
    ("numpy", "NumPy", ["data/bench.py", "--size-mb", "1", "--no-train"]),
])
def test_an_entry_point_without_a_requirement_says_which_in_one_line(module: str, named: str, argv: list[str],
                                                                      tmp_path: Path) -> None:
    argv = [str(ROOT / argv[0]), *(str(ROOT / a) if a.startswith("configs/") else a for a in argv[1:])]
    done = subprocess.run([sys.executable, "-c", WITHOUT, module, *argv], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"error: {named} is not installed for ")  # the Python, its path as it sees it
    assert done.stderr.endswith(" -m pip install -r requirements.txt`\n")
