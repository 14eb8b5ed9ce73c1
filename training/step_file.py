"""The compiled training step kept whole in the compile cache: compiled ahead of time, saved as one file, and loaded
by the next run of the same step in about a second instead of rebuilt from the cache's pieces.

Why: a compile from the warm cache still traces the step with dynamo, runs AOTAutograd and looks each graph up in
inductor's cache, 3-6 s on a 2-core CPU, which every repeated run pays and which `train.compile: auto` weighs
against the steps left. Loading the step saved whole skips all of that. Measured on a 2-core Zen 4 EPYC (torch 2.13,
separate processes, interleaved): tiny.yaml's step (3 layers of 64, Muon, batch 128) loaded in 1.6-1.7 s against
4.5-5.8 s from the warm cache; nanoGPT's CPU config (4 layers of 128, block 64) 1.3-1.6 s against 4.1-4.9 s; a
2-layer model of 32, 1.3-1.6 s against 2.9-3.3 s. The loaded step computes what the compiled one does to the bit:
the loss, the gradient norm, the weights and the optimizer's state (tests/test_training_step_file.py). sample.py's
compiled sampling step on a CPU (model.sampler.run_steps, through sampling.writing.saved_step) is kept the same way.

A step saved this way keeps none of dynamo's guards (they walk the model's modules, which torch cannot rebuild when it
loads the file), so nothing checks its arguments when it is called. The file's name is therefore a digest of all
that its code was specialised on (signature): every tensor's shape, strides and dtype, the model's settings and
mode (compiled_step.module_settings), the step's constants and layout, torch and Python's versions, the threads,
inductor's options, the global state the step runs under, and tinychar's own code in model/ and training/ (with
the file of any module class defined elsewhere), so that an edited or updated model never runs code traced from the
old one. A model with hooks, whose code could be anywhere, is not saved (NotSaveable): it compiles with the guards.
CompiledStep looks its function up again whenever the shape of a call's batch or the model's mode differs from the
last call's.

Loading the file runs its code, as loading inductor's cache runs the libraries it holds: it is kept in the same
folder (compile_cache.cache_folder), and one that another user owns is never loaded. A file that cannot be read or
loaded is compiled again and overwritten. Saving a step prunes the folder's least recently used ones beyond
KEEP_BYTES. A torch without torch.compiler.load_compiled_function compiles as before; one that has it but leaves it
off by default (torch 2.11) has it turned on while the step compiles.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import inspect
import io
import os
import platform
import stat
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from configs.userinput import read_user_file

from .compile_cache import WARM_SHARE, cache_folder, compile_options

AHEAD = hasattr(torch.compiler, "load_compiled_function")


def used_on(device: torch.device) -> bool:
    """Whether the step is saved whole on this device: on a CPU, and on CUDA, where a lent H200 checked it (torch
    2.11, configs/shakespeare_char.yaml's model in bfloat16, 2026-12-04): loaded in 8.4-10.7 s against 11.2-14.9 s
    from the warm cache, three interleaved pairs, the step as fast (5.1-6.0 ms against 5.2-6.3), and the CUDA tests
    pass with it. Elsewhere (mps) it compiles with dynamo's guards."""
    return AHEAD and device.type in ("cpu", "cuda")


# A saved step loads in this share of the cold compile that saved it, or less: measured on a 2-core Zen 4 EPYC, about
# 5% (tiny.yaml's step 31.0 -> 1.4-1.7 s, the CPU config's 39.2 -> 1.4-2.0 s); twice that for slower disks and hosts.
# On an H200 loading took a quarter (38.4 -> 8.4-10.7 s), compile_cache.WARM_SHARE.
LOADED_SHARE = 0.1


def warm_share(device: torch.device) -> float:
    """The share of a cold compile's time that a repeated run's compile takes on device: LOADED_SHARE where the step
    is saved whole on a CPU, else compile_cache.WARM_SHARE (compile_cache.measured_saving)."""
    return LOADED_SHARE if used_on(device) and device.type == "cpu" else WARM_SHARE


# The files' layout; a new one names new files.
FORMAT = 1
# A saved step holds its graphs and generated code: 1.2-1.6 MB for the models above on a CPU, 17.7 MB for
# configs/shakespeare_char.yaml's on an H200 (its kernels' machine code). Anything far larger, or not a regular file
# (a named pipe would wait for a writer forever), is not one.
MAX_BYTES = 256 << 20
# The saved steps a cache folder keeps, the most recently used first, at most this many bytes in all (the one just
# saved always stays). Each change of the code, the model's settings or the batch names a new file (1-2 MB on a CPU,
# 17.7 MB for configs/shakespeare_char.yaml's step on an H200), and the old ones would otherwise pile up for good.
KEEP_BYTES = 512 << 20
# The folders whose Python the step traces (the model's forward, the step, the optimizers' arithmetic).
CODE_FOLDERS = ("model", "training")
ROOT = Path(__file__).resolve().parents[1]

# The steps of this process, by signature: a second CompiledStep of the same shapes (a resumed run, another run in
# the same process) takes the function the first one loaded or compiled.
_STEPS: dict[str, Callable] = {}


@functools.cache
def code_digest(root: Path = ROOT) -> str:
    """A digest of tinychar's Python in CODE_FOLDERS, which the step's graphs are traced from."""
    digest = hashlib.sha256()
    for folder in CODE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            digest.update(f"{path.relative_to(root).as_posix()}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def file_digest(path: str) -> str:
    """A digest of the file at path ('' where it cannot be read)."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return ""


class NotSaveable(ValueError):
    """A step whose code depends on more than its signature can name: it is compiled with dynamo's guards instead."""


HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _module_code(model: nn.Module) -> list[tuple[str, str]]:
    """The source files of the model's module classes that lie outside tinychar's CODE_FOLDERS (a model defined
    elsewhere, by the person), with their digests; torch's own are named by its version. NotSaveable where a module
    has hooks: their code, which the step traces, can be anywhere."""
    files = set()
    for name, m in model.named_modules():
        if any(getattr(m, h, None) for h in HOOKS):
            raise NotSaveable(f"module {name or 'model'} has hooks")
        if type(m).__module__.startswith("torch."):
            continue
        try:
            source = Path(inspect.getsourcefile(type(m)) or "").resolve()
        except TypeError:  # a class of no file
            raise NotSaveable(f"module {name or 'model'}'s class {type(m).__qualname__} has no source file") from None
        if not any(source.is_relative_to(ROOT / folder) for folder in CODE_FOLDERS):
            files.add(str(source))
    return [(f, file_digest(f)) for f in sorted(files)]


def _described(value: object) -> object:
    """What compiled code specialises on in one argument of the step."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), str(value.dtype), str(value.device),
                value.requires_grad, type(value).__name__)
    if isinstance(value, nn.Module):  # its parameters are replaced by the flat buffer's views; its buffers are read
        from .compiled_step import module_settings

        return ("module", module_settings(value), value.training, _module_code(value),
                [(name, _described(t)) for name, t in value.named_buffers()],
                [(name, _described(t)) for name, t in value.named_parameters()])
    return ("value", repr(value))


def _device_described(device: torch.device) -> tuple:
    """What compiled code for device is built for beyond its name: on CUDA the GPU's model and architecture (its
    kernels are machine code for one), the CUDA and Triton versions; on a CPU its instruction set names the cache
    folder the file is in (compile_cache.machine_tag)."""
    if device.type != "cuda":
        return ()
    p = torch.cuda.get_device_properties(device)
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    return (p.name, p.major, p.minor, p.multi_processor_count, torch.version.cuda, triton)


def signature(fn: Callable, args: tuple, device: torch.device) -> str:
    """The name of the step fn compiled for these arguments (CompiledStep's call of compiled_step._whole_step, or
    sampling's model.sampler.run_steps) here and now: equal only where the same compiled code is right for both."""
    parts = [FORMAT, torch.__version__, platform.python_version(), str(device), _device_described(device),
             torch.get_num_threads(), str(torch.get_default_dtype()), torch.is_grad_enabled(),
             torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.is_inference_mode_enabled(), repr(sorted(compile_options(device).items())), code_digest(),
             f"{fn.__module__}.{fn.__qualname__}", [_described(a) for a in args]]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def step_path(name: str) -> Path:
    return cache_folder() / f"tinychar-step-{name}.pt2"


def _no_guards(entries: list) -> list[bool]:
    return [False] * len(entries)


def load(path: Path, device: torch.device) -> Callable | None:
    """The step saved at path, or None where there is none that loads (missing, not a regular file, too large,
    damaged, or of another torch), or none to trust: a file another user owns (in a folder others can write, such as
    the temp folder's stand-in for the cache, anyone could have put it there, and loading it runs its code).

    Loading looks the file's C++ code up in the compile cache under inductor's settings at the time, and builds it
    where it misses: so it loads under compile_options, as the step was compiled, and finds the code the compile
    built. Under torch's own settings it missed, built inductor's precompiled headers in the temp folder (which
    compile_cache.COMPILE_OPTIONS leaves off) and the code again: measured on a 2-core Zen 2 EPYC (torch 2.13,
    2026-12-06), a one-layer step's load just after its compile took 16.0 s with an empty temp folder (12.2 s of it
    the headers, 283 MB that nothing removes), against 0.02 s under compile_options."""
    import torch._inductor.config as inductor

    try:
        data = read_user_file(path, "compiled step", MAX_BYTES, own=True)  # the owner checked on the open file
    except ValueError:
        return None
    try:
        with inductor.patch(compile_options(device)):
            step = torch.compiler.load_compiled_function(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - a file that does not load is compiled again and replaced
        return None
    with contextlib.suppress(OSError):  # used now: the last to be pruned (prune)
        os.utime(path)
    return step


def prune(folder: Path, keep: Path) -> list[Path]:
    """Remove the saved steps in folder that are least recently used (by their files' times: a load touches its
    file) until those left come to KEEP_BYTES or fewer, keep always staying; the ones removed. Only this user's files
    are touched; one another process removes first, or that cannot be removed, is passed over."""
    saved = []
    for path in folder.glob("tinychar-step-*.pt2"):
        try:
            st = path.stat()
        except OSError:
            continue
        if path != keep and stat.S_ISREG(st.st_mode) and (not hasattr(os, "getuid") or st.st_uid == os.getuid()):
            saved.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in saved) + (keep.stat().st_size if keep.exists() else 0)
    removed = []
    for _, size, path in sorted(saved, key=lambda entry: entry[0]):  # the oldest first
        if total <= KEEP_BYTES:
            break
        with contextlib.suppress(OSError):  # one that cannot be removed still counts
            path.unlink()
            removed.append(path)
            total -= size
    return removed


def compile_ahead(fn: Callable, args: tuple, device: torch.device) -> Callable:
    """fn compiled for args now, whole, without guards (fullgraph, static shapes, compile_options)."""
    # Before torch 2.13 (2.11 measured) the API is there but off by default: torch.compile attaches aot_compile to
    # what it returns only while this is set, and AOTAutograd's cache reads it while compiling.
    off = getattr(torch._dynamo.config, "enable_aot_compile", True) is False
    ahead = torch._dynamo.config.patch(enable_aot_compile=True) if off else contextlib.nullcontext()
    with ahead:
        compiled = torch.compile(fn, fullgraph=True, dynamic=False,
                                 options={**compile_options(device), "guard_filter_fn": _no_guards})
        restart = getattr(torch._dynamo.exc, "TensorifyScalarRestartAnalysis", None)
        for attempt in range(3):
            try:
                return compiled.aot_compile((args, {}))
            except Exception as e:  # noqa: BLE001 - checked just below
                # Dynamo traces a Python float (the setup's clip), then asks to trace again with it kept a constant;
                # torch.compile does so by itself, aot_compile leaves it to its caller.
                if restart is None or not isinstance(e, restart) or attempt == 2:
                    raise
    raise AssertionError("unreachable")


def step_function(fn: Callable, args: tuple, device: torch.device) -> tuple[Callable, str]:
    """The compiled step for args: this process's, the one saved in the compile cache, or compiled now and saved
    there; with where it came from ('this process', 'loaded', 'compiled'). Raises what compiling raised."""
    name = signature(fn, args, device)
    if name in _STEPS:
        return _STEPS[name], "this process"
    path = step_path(name)
    step = load(path, device)
    source = "loaded"
    if step is None:
        step, source = compile_ahead(fn, args, device), "compiled"
        try:  # to a new file that then takes the name: never written through a link put in its place
            step.save_compiled_function(str(path))
        except Exception:  # noqa: BLE001 - a step that cannot be saved is still this run's; the next compiles again
            pass
        else:  # loaded at once, as the next run loads it (its C++ from the cache: see load)
            step = load(path, device) or step
            with contextlib.suppress(OSError):
                prune(path.parent, path)
    if hasattr(step, "disable_guard_check"):
        # Its guards were all left out (_no_guards), yet each call still bound the arguments to the signature and
        # ran the empty check: 16.5 us a call, about 1% of bench.py's block-8 step (measured on a 2-core Zen 2).
        step.disable_guard_check()
    _STEPS[name] = step
    return step, source
