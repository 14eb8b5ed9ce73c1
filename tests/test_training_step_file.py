"""The compiled step saved whole in the compile cache (training.step_file): loaded, it computes what the compiled
step does to the bit; a damaged or odd file in its place is compiled again, never trusted nor waited on; and, having
no guards, it is found only by a name that tells apart everything its code was specialised on."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import needs_cpu_compile
from test_training_compiled_step import DropoutBigram

from model.sampler import run_steps
from training import TrainConfig, compiled_step, step_file
from training.compiled_step import CompiledStep, _whole_step, deterministic_kernels, lr_argument
from training.optim import make_optimizer

CPU = torch.device("cpu")
TC = replace(TrainConfig(), grad_accum_steps=2, grad_clip=1.0)


def batches(n: int = 3, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, 5, (TC.grad_accum_steps, batch, 6), generator=g) for _ in range(n)]
    return [(x, x.roll(1, -1)) for x in xs]


def step_for(p: float = 0.25, tc: TrainConfig = TC, training: bool = True) -> CompiledStep:
    model = DropoutBigram(p).train(training)
    return CompiledStep(model, make_optimizer(model, tc, CPU), tc, CPU, torch.float32)


def name_of(step: CompiledStep, xs: torch.Tensor, ys: torch.Tensor) -> str:
    """The name of the step saved for this call, as CompiledStep's call works it out (without gradients, under
    deterministic kernels)."""
    with torch.no_grad(), deterministic_kernels(CPU):
        return step_file.signature(_whole_step, args_of(step, xs, ys), CPU)


def args_of(step: CompiledStep, xs: torch.Tensor, ys: torch.Tensor) -> tuple:
    """The arguments a CompiledStep calls its compiled function with (CompiledStep._run)."""
    lr = lr_argument(1e-3, CPU)
    return (step.model, *step.buffers(), step.decay, step.owner, xs, ys, lr, step.layout, step.constants())


def trained(step: CompiledStep) -> list[torch.Tensor]:
    """Three steps on the same batches and random stream (the model drops out): every loss, gradient norm, weight
    and state value they leave."""
    torch.manual_seed(7)
    out = [t for xs, ys in batches() for t in step(xs, ys, 1e-2)]
    return [*out, *(t.clone() for t in step.buffers())]


@needs_cpu_compile
@pytest.mark.slow
def test_the_step_saved_whole_replaces_a_damaged_file_and_loaded_computes_what_the_compiled_one_did(tmp_path,
                                                                                                  monkeypatch):
    monkeypatch.setattr(step_file, "step_path", lambda name: tmp_path / f"{name}.pt2")
    monkeypatch.setattr(step_file, "_STEPS", {})
    # a run's own choice of precompiled headers (off), where torch's setting is on: the load must take the run's
    monkeypatch.delenv("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", raising=False)
    first = step_for()
    xs, ys = batches()[0]
    saved = tmp_path / f"{name_of(first, xs, ys)}.pt2"
    saved.write_bytes(b"\x80\x04not a compiled step")  # damaged: compiled again, and replaced
    stale = tmp_path / "tinychar-step-stale.pt2"  # another step's, long unused: pruned when this one is saved
    stale.write_bytes(b"\0" * 1000)
    os.utime(stale, (1e9, 1e9))
    monkeypatch.setattr(step_file, "KEEP_BYTES", 1)
    # off, as torch 2.11 ships it: step_file turns it on while it compiles (torch's own patch, which puts the value
    # back by setting it; a monkeypatch of torch's config once left it hidden for a later test in CI)
    off = (torch._dynamo.config.patch(enable_aot_compile=False)
           if hasattr(torch._dynamo.config, "enable_aot_compile") else contextlib.nullcontext())
    import torch._dynamo.aot_compile as aot_compile
    from torch._inductor.cpp_builder import CppBuilder

    traced, built, loading = [], [], []
    trace, build, load = aot_compile.aot_compile_fullgraph, CppBuilder.build, step_file.load
    monkeypatch.setattr(aot_compile, "aot_compile_fullgraph", lambda *a, **k: traced.append(1) or trace(*a, **k))
    monkeypatch.setattr(CppBuilder, "build", lambda self: built.append(bool(loading)) or build(self))

    def counted_load(path: Path, device: torch.device) -> object:
        loading.append(path)
        try:
            return load(path, device)
        finally:
            loading.clear()

    monkeypatch.setattr(step_file, "load", counted_load)
    with off:
        first.warm_up(xs, ys)
    assert first.source == "compiled" and saved.stat().st_size > 100_000
    assert len(traced) == 1  # traced once: the learning rate is no float for dynamo to restart on (lr_argument)
    # the file, loaded at once, takes the C++ just built from the cache (under torch's settings it built it again)
    assert built.count(False) >= 2 and built.count(True) == 0, built
    compiled = trained(first)

    monkeypatch.setattr(step_file, "_STEPS", {})  # as a new process finds it
    second = step_for()
    second.warm_up(xs, ys)
    assert second.source == "loaded"
    # called without dynamo's check of its guards, which binds the arguments and checks none (all were left out)
    function, checked = second._last[1][compiled_step._whole_step, 0], []
    monkeypatch.setattr(type(function), "guard_check", lambda self, *a, **k: checked.append(a) or True)
    loaded = trained(second)
    assert not checked or not hasattr(function, "disable_guard_check")
    assert all(torch.equal(a, b) for a, b in zip(compiled, loaded, strict=True))
    assert not torch.equal(compiled[-5], step_for().flat)  # they trained: the weights moved

    third = step_for()  # and within one process, the function once loaded
    third.warm_up(xs, ys)
    assert third.source == "this process"
    assert [p.name for p in tmp_path.iterdir()] == [saved.name]


def test_what_is_not_a_saved_step_loads_as_none_without_waiting(tmp_path, monkeypatch):
    assert step_file.load(tmp_path / "missing.pt2", CPU) is None
    damaged = tmp_path / "damaged.pt2"
    damaged.write_bytes(b"PK\x03\x04" + os.urandom(1000))
    assert step_file.load(damaged, CPU) is None
    assert step_file.load(tmp_path, CPU) is None  # a folder
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "pipe.pt2")
        assert step_file.load(tmp_path / "pipe.pt2", CPU) is None  # a named pipe with no writer: not waited on
    read = []
    monkeypatch.setattr(torch.compiler, "load_compiled_function", lambda f: read.append(f) or "a step")
    mine = tmp_path / "mine.pt2"
    mine.write_bytes(b"\0" * 1000)
    assert step_file.load(mine, CPU) == "a step" and len(read) == 1  # (the staged loader takes anything)
    if hasattr(os, "getuid"):  # another user's file: anyone could have put it there, and loading it runs its code
        uid = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: uid + 1)
        assert step_file.load(mine, CPU) is None and len(read) == 1
        monkeypatch.setattr(os, "getuid", lambda: uid)
    monkeypatch.setattr(step_file, "MAX_BYTES", 999)
    big = tmp_path / "big.pt2"
    big.write_bytes(b"\0" * 1000)
    assert step_file.load(big, CPU) is None and len(read) == 1  # too large to be one: not read


def test_saving_a_step_prunes_the_least_recently_used_ones_beyond_the_limit(tmp_path, monkeypatch):
    saved = {}
    for age, name in enumerate("abcde"):
        saved[name] = tmp_path / f"tinychar-step-{name}.pt2"
        saved[name].write_bytes(b"\0" * 1000)
        os.utime(saved[name], (1e9 + age, 1e9 + age))  # a the oldest, e the newest
    other = tmp_path / "inductor.so"
    other.write_bytes(b"\0" * 5000)  # not a saved step: never touched
    monkeypatch.setattr(torch.compiler, "load_compiled_function", lambda f: "a step")
    assert step_file.load(saved["a"], CPU) == "a step"  # used now: kept longest
    new = tmp_path / "tinychar-step-new.pt2"
    new.write_bytes(b"\0" * 1000)
    monkeypatch.setattr(step_file, "KEEP_BYTES", 3000)
    if hasattr(os, "getuid"):  # another user's files are never removed
        uid = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: uid + 1)
        assert step_file.prune(tmp_path, new) == []
        monkeypatch.setattr(os, "getuid", lambda: uid)
    assert step_file.prune(tmp_path, new) == [saved["b"], saved["c"], saved["d"]]  # 6,000 bytes down to 3,000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inductor.so", "tinychar-step-a.pt2",
                                                          "tinychar-step-e.pt2", "tinychar-step-new.pt2"]
    monkeypatch.setattr(step_file, "KEEP_BYTES", 10)
    assert step_file.prune(tmp_path, new) == [saved["e"], saved["a"]]  # the one just saved stays, whatever its size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inductor.so", "tinychar-step-new.pt2"]


def test_the_saved_steps_name_tells_apart_all_that_its_code_was_specialised_on(monkeypatch):
    xs, ys = batches()[0]
    name = step_file.signature(_whole_step, args_of(step_for(), xs, ys), CPU)
    again = args_of(step_for(), xs.clone(), ys.clone())  # a new process's step
    assert step_file.signature(_whole_step, again, CPU) == name

    others = {
        "another batch": args_of(step_for(), *batches(batch=8)[0]),
        "other targets' dtype": args_of(step_for(), xs, ys.int()),
        "other strides": args_of(step_for(), xs.transpose(1, 2).contiguous().transpose(1, 2),
                                 ys.transpose(1, 2).contiguous().transpose(1, 2)),
        "another dropout": args_of(step_for(0.5), xs, ys),
        "eval mode": args_of(step_for(training=False), xs, ys),
        "another clip": args_of(step_for(tc=replace(TC, grad_clip=0.5)), xs, ys),
        "no clip": args_of(step_for(tc=replace(TC, grad_clip=0.0)), xs, ys),
        "other betas": args_of(step_for(tc=replace(TC, beta2=0.95)), xs, ys),
    }
    names = {what: step_file.signature(_whole_step, args, CPU) for what, args in others.items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        names["other threads"] = step_file.signature(_whole_step, args_of(step_for(), xs, ys), CPU)
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        names["grad mode"] = step_file.signature(_whole_step, args_of(step_for(), xs, ys), CPU)
    with torch.inference_mode():
        names["inference mode"] = step_file.signature(_whole_step, args_of(step_for(), xs, ys), CPU)
    names["another function"] = step_file.signature(run_steps, args_of(step_for(), xs, ys), CPU)
    cuda = torch.device("cuda")  # named, not used: the GPU's model and architecture are part of the name
    for gpu, major in (("NVIDIA H100", 9), ("NVIDIA H200", 9), ("NVIDIA A100", 8)):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda d, gpu=gpu, major=major: SimpleNamespace(name=gpu, major=major, minor=0,
                                                                            multi_processor_count=132))
        names[gpu] = step_file.signature(_whole_step, args_of(step_for(), xs, ys), cuda)
    assert len({name, *names.values()}) == len(names) + 1, names


def test_edited_model_code_names_another_saved_step(tmp_path):
    """An edited or updated model must not run the code traced from the old one: the name holds a digest of the
    Python the step is traced from."""
    root = Path(step_file.__file__).resolve().parents[1]
    for folder in step_file.CODE_FOLDERS:
        shutil.copytree(root / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    before = step_file.code_digest(tmp_path)
    assert before == step_file.code_digest(root)
    attention = tmp_path / "model" / "attention.py"
    attention.write_text(attention.read_text(encoding="utf-8") + "\n# edited\n", encoding="utf-8")
    step_file.code_digest.cache_clear()
    try:
        assert step_file.code_digest(tmp_path) != before
    finally:
        step_file.code_digest.cache_clear()


def test_a_call_of_another_shape_or_mode_gets_the_function_made_for_it(monkeypatch):
    """The step saved whole checks nothing when called: CompiledStep looks its function up again for a batch of
    another shape or a model in another mode, and calls the one made for those arguments."""
    made: list[str] = []

    def step_function(fn: object, args: tuple, device: torch.device) -> tuple[object, str]:
        name = step_file.signature(fn, args, device)
        made.append(name)

        def function(*called: object) -> tuple[torch.Tensor, torch.Tensor]:
            assert step_file.signature(fn, called, device) == name
            return torch.zeros(()), torch.zeros(())

        return function, "compiled"

    monkeypatch.setattr(step_file, "AHEAD", True)
    monkeypatch.setattr(step_file, "step_function", step_function)
    step = step_for()
    (small, small_y), (large, large_y) = batches(batch=4)[0], batches(batch=8)[0]
    for xs, ys in [(small, small_y), (small, small_y), (large, large_y), (large, large_y), (small, small_y)]:
        step(xs, ys, 1e-3)
    step.model.eval()
    step(small, small_y, 1e-3)
    assert len(made) == 4 and len(set(made)) == 3  # looked up when the shape or the mode changed, not each call


def test_a_failure_to_compile_ahead_of_time_falls_back_to_torch_compiles_own_step(monkeypatch):
    def failing(fn: object, args: tuple, device: torch.device) -> tuple[object, str]:
        raise RuntimeError("aot_compile is not supported here")

    calls = []

    def guarded(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(len(args))
        return torch.zeros(()), torch.zeros(())

    monkeypatch.setattr(step_file, "AHEAD", True)
    monkeypatch.setattr(step_file, "step_function", failing)
    monkeypatch.setattr(compiled_step, "_COMPILED", {compiled_step._whole_step: guarded})
    step = step_for()
    step.warm_up(*batches()[0])
    assert step.source == "compiled with guards" and calls == [13]


def test_the_saved_step_is_kept_beside_inductors_code_for_this_instruction_set():
    from training.compile_cache import cache_folder

    path = step_file.step_path("abc")
    assert path.name == "tinychar-step-abc.pt2" and path.parent == cache_folder()


def test_a_model_defined_outside_tinychar_names_its_file_and_one_with_hooks_is_not_saved(tmp_path, monkeypatch):
    """A model class of the person's own is traced from a file the code digest does not cover: its name holds that
    file's digest. A hook's code can be anywhere: a model with one compiles with dynamo's guards, unsaved."""
    source = tmp_path / "my_model.py"
    source.write_text("import torch\n\nclass Mine(torch.nn.Module):\n    def __init__(self):\n"
                      "        super().__init__()\n        self.wte = torch.nn.Embedding(5, 8)\n\n"
                      "    def forward(self, x, y):\n        logits = self.wte(x) @ self.wte.weight.T\n"
                      "        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())\n",
                      encoding="utf-8")
    spec = importlib.util.spec_from_file_location("persons_model", source)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "persons_model", module)  # imported, as a person's model would be
    spec.loader.exec_module(module)
    model = module.Mine()
    step = CompiledStep(model, make_optimizer(model, TC, CPU), TC, CPU, torch.float32)
    xs, ys = batches()[0]
    before = name_of(step, xs, ys)
    source.write_text(source.read_text(encoding="utf-8").replace("@ self.wte.weight.T", "@ self.wte.weight.T * 2"),
                      encoding="utf-8")
    assert name_of(step, xs, ys) != before

    calls = []
    monkeypatch.setattr(compiled_step, "_COMPILED", {compiled_step._whole_step: lambda *args: calls.append(args) or (
        torch.zeros(()), torch.zeros(()))})
    monkeypatch.setattr(step_file, "compile_ahead", lambda *args: pytest.fail("a model with hooks was compiled "
                                                                             "to be saved"))
    hooked = step_for()
    hooked.model.drop.register_forward_hook(lambda module, inputs, output: output * 2)
    with pytest.raises(step_file.NotSaveable, match="module drop has hooks"):
        name_of(hooked, xs, ys)
    hooked.warm_up(xs, ys)
    assert hooked.source == "compiled with guards" and len(calls) == 1


def test_the_step_is_saved_whole_on_a_cpu_and_on_cuda_with_this_torch():
    """torch 2.13, which CI installs, has the API (a lent H200 checked the CUDA path: see step_file.used_on)."""
    if torch.__version__ >= "2.13":
        assert step_file.AHEAD
    assert step_file.used_on(CPU) == step_file.AHEAD
    assert step_file.used_on(torch.device("cuda")) == step_file.AHEAD
    assert not step_file.used_on(torch.device("mps"))
