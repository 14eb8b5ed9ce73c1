"""Nothing is loaded or parsed in a way that could run code: no source file calls an unsafe loader, and a
booby-trapped checkpoint is refused by the real sample.py and train.py without running its payload."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from test_model_checkpoint import WritesAFile
from test_train import child_env, one_error_line, snapshot


def unsafe_calls(source: str) -> list[str]:
    """Calls that could run code from a file: exec/eval/compile, yaml loaders other than safe_load, pickle loads,
    and torch.load without weights_only=True."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else None
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else None
        attr = func.attr if isinstance(func, ast.Attribute) else None
        safe_torch_load = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                              for k in node.keywords)
        if (name in ("exec", "eval", "compile", "__import__")
                or (owner == "yaml" and attr in ("load", "load_all", "unsafe_load", "full_load", "full_load_all"))
                or (owner in ("pickle", "dill", "marshal") and attr in ("load", "loads"))
                or (owner == "torch" and attr == "load" and not safe_torch_load)):
            found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_the_unsafe_call_finder_finds_what_it_looks_for():
    source = ("import torch, yaml, pickle\nexec('1')\neval('1')\nyaml.load(s)\npickle.loads(b)\ntorch.load(p)\n"
              "torch.load(p, weights_only=False)\nmodel.eval()\ntorch.load(p, weights_only=True)\nyaml.safe_load(s)\n")
    assert [f.split(":")[0] for f in unsafe_calls(source)] == [f"line {n}" for n in (2, 3, 4, 5, 6, 7)]
    assert safe_torch_loads(source) == 1
    assert safe_torch_loads('"""Loads with torch.load(p, weights_only=True)."""\nload(p, weights_only=False)\n') == 0


def test_no_source_file_loads_anything_in_a_way_that_could_run_code():
    skip = {"tests", ".git", ".ci-venv", ".venv", "venv", "runs", "out"}
    files = [p for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts[:-1])]
    assert {"train.py", "sample.py", "checkpoint.py", "__init__.py"} <= {p.name for p in files}
    found = {str(p.relative_to(ROOT)): calls for p in files if (calls := unsafe_calls(p.read_text(encoding="utf-8")))}
    assert found == {}
    # and the one place that loads checkpoints does so with weights_only=True: a call, not the words (the module's
    # docstring names them, so a search of its text passed whatever the module called, or whether it loaded at all)
    assert safe_torch_loads((ROOT / "model" / "checkpoint.py").read_text(encoding="utf-8")) == 1


def safe_torch_loads(source: str) -> int:
    """How many calls in source are torch.load(..., weights_only=True)."""
    return sum(1 for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
               and ast.unparse(node.func) == "torch.load"
               and any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                       for k in node.keywords))


@pytest.fixture
def booby_trapped(tmp_path) -> tuple[Path, Path]:
    """A checkpoint whose unpickling would create a marker file, shown to be live by loading it unsafely once."""
    marker = tmp_path / "marker"
    path = tmp_path / "run" / "ckpt.pt"
    path.parent.mkdir()
    payload = {"format": "tinychar-checkpoint", "model": WritesAFile(marker), "model_config": {}, "vocab": [],
               "optimizer": {}, "config": {}}
    torch.save(payload, path)
    torch.load(path, weights_only=False)["model"].close()  # the control: an unsafe load runs it
    assert marker.exists()
    marker.unlink()
    return path, marker


@pytest.mark.slow
@pytest.mark.parametrize("command", ["sample.py --checkpoint", "train.py --resume"])
def test_a_checkpoint_that_would_run_code_is_refused_by_the_real_commands(booby_trapped, command):
    path, marker = booby_trapped
    script, flag = command.split()
    args = [flag, str(path)] if script == "sample.py" else [flag, "--out-dir", str(path.parent)]
    before = snapshot(path.parent)
    result = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=child_env(), capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert "refusing to load" in one_error_line(result.stderr) and result.stdout == ""
    assert not marker.exists()
    assert snapshot(path.parent) == before
