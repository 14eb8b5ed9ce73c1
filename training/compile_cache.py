"""Where torch.compile keeps tinychar's compiled code, and what the cache remembers of each compile.

The code goes to a folder per instruction set (machine_tag) in tinychar's cache folder or the user's
$TORCHINDUCTOR_CACHE_DIR; beside it, a small marker per compiled step (named by a key of what its code depends on:
training.engine.compile_key, sampling.compiling.sampling_key) records how long its last compile took, which is how
``train.compile: auto`` and ``sample.py --compile auto`` know whether the cache is warm. Inductor's options for
what tinychar compiles (compile_options) are here too, as they decide what the cache holds.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from configs.userinput import private_temp_root, read_user_file, shown, temp_root
from model.linear import cpu_flags, lower_onednn_linear

from . import collector
from .atomic import locked, write_atomic
from .libraries import tidy

# A folder the user chose for torch's compile cache, read before torch itself may fill the variable with its default.
_USER_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
_SAID_MOVED: set[Path] = set()  # the cache folders this process has said it could not write to


# Inductor's C++ wrapper calls the step's kernels and matrix multiplies from compiled code instead of from Python:
# the same kernels, the same numbers, less overhead per call (measured on a CPU, block 8: a step 1.83 -> 1.58 ms,
# sampling 4,000 -> 5,000 characters/s), for a few more seconds of compiling the first time. Not on CUDA, where it
# builds a C++ file against CUDA's headers: measured on an H100 (torch 2.11, configs/shakespeare_char.yaml), cold
# compile 102.7 s with it, 29.3 s without, and the step no faster with it (2.0M vs 2.2-2.4M tokens/s).
# Built apart from the kernels (cpp_wrapper_build_separate), the wrapper is compiled at -O1 and only the kernels at
# -O3, where one -O3 build of both took most of the C++ of the sampler's first compile. Measured on a 2-core Zen 4
# EPYC (torch 2.13, 2026-12-03): g++ for the block-8 sampling loop 8.3 s -> 5.2 s (wrapper 2.2, kernels 2.6, linking
# 0.4); `sample.py --compile true` from an empty cache, four interleaved rounds, "compiled in" 18.2-24.0 s ->
# 16.1-16.9 s for tiny.yaml's model and 18.7-21.2 s -> 15.7-18.0 s for the CPU config's block-64 one, the same
# characters; tiny.yaml's training step 10.2 s of g++ -> 8.3 s (docs/engine-record.md). A character and a step take
# the same time either way (both builds side by side in one process). A torch without the option builds as before.
#
# Inductor's precompiled headers (cpp_cache_precompile_headers) are off: inductor writes them to the temp folder
# ($TMPDIR/torchinductor_<user>/precompiled_headers, outside the compile cache and never pruned), 285 MB for the
# sampler of one model, and looks for them on every compile, from a warm cache too. Measured there, `sample.py
# --compile true` on tiny.yaml's model, two rounds: a first compile with no headers made 22.8 and 25.5 s with them,
# 16.8 and 13.2 s without; from a warm cache once the temp folder was emptied (a reboot), 15.9 and 12.6 s with them
# (made again, unused) against 2.6 and 2.4 s; from a warm cache with the headers there 3.1 s against 2.5-2.8 s. They
# pay only for a new model's first compile while another's headers are there: 12.1 and 11.8 s against 14.6 and 14.2.
# tiny.yaml's training step: a first compile 36.8 s with them, 33.2 s without; from a warm cache after the temp
# folder was emptied 16.3 s against 4.0 s.
# TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS, when set, decides instead (wanted_options).
COMPILE_OPTIONS = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True, "cpp_cache_precompile_headers": False}


# Inductor's mix-order reduction (torch 2.10 and later) sums a layer norm's weight and bias gradients over a
# workspace of which its kernel may leave rows unwritten: measured on an H100 (torch 2.11,
# configs/shakespeare_char.yaml, 2026-11-26), the compiled step with it trained to val 1.748 at step 500 against
# 1.721 without (two runs without: 1.7212 and 1.7226, their losses alike to 3 decimals). Once PyTorch's cache was
# released, those rows held whatever the memory held: a test's NaN (the step then skips its update), or in training
# garbage (the loss from 2.07 to 3.5 in two steps after a CUDA graph's capture; docs/gpu-record.md). Off, both pass,
# and the step is as fast (2.27-2.43M tokens/s either way). A torch without the option has no such reduction.
CUDA_OPTIONS = {"triton.mix_order_reduction": False}


def compile_options(device: torch.device) -> dict:
    """Inductor's options for the compiled step and sampler on this device (see COMPILE_OPTIONS), less those this
    torch does not have (torch.compile refuses them)."""
    known = inductor_settings()
    return {k: v for k, v in wanted_options(device).items() if k in known}


def wanted_options(device: torch.device) -> dict:
    """The options compile_options starts from, read without importing the compiler: the compile keys hold them
    (training.engine), so that code compiled under other options is not taken for cached."""
    if device.type != "cpu":
        return CUDA_OPTIONS
    user = "cpp_cache_precompile_headers" if "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS" in os.environ else None
    return {k: v for k, v in COMPILE_OPTIONS.items() if k != user}


def inductor_settings() -> set[str]:
    """The names of the settings this torch's inductor has (torch.compile refuses an option it does not know)."""
    import torch._inductor.config as inductor

    return set(inductor.get_config_copy())


def compile_cache_dir() -> Path:
    """Where torch.compile keeps its compiled code: a folder per instruction set (machine_tag) in
    $TORCHINDUCTOR_CACHE_DIR if the user set it, else in tinychar's cache folder ($XDG_CACHE_HOME/tinychar/compiled if
    that is an absolute path, else ~/.cache/tinychar/compiled), else in the temp folder. A $TORCHINDUCTOR_CACHE_DIR
    that already is this machine's folder (handed down by a run to its helper, or to the processes it starts) is used
    as it is."""
    tag = machine_tag(torch.backends.cpu.get_cpu_capability(), cpu_vector_flags())
    explicit = _USER_CACHE
    if explicit:
        why = user_cache_problem()
        if why is not None:
            raise ValueError(why)
        # A folder shared by machines of different CPUs (a home folder on a cluster's file system, say) must not mix
        # their code, any more than tinychar's own: see VECTOR_FLAG_PREFIXES.
        # absolute: handed down to the processes a run starts (the warm-cache helper starts in the project's folder)
        folder = Path(explicit).expanduser().absolute()
        return folder if folder.name == tag else folder / tag
    try:
        xdg = Path(os.environ.get("XDG_CACHE_HOME") or "").expanduser()
        base = xdg if xdg.is_absolute() else Path.home() / ".cache"  # a relative one is ignored, as in data.cachekey
    except (RuntimeError, KeyError):  # no home at all: the temp folder's stand-in (cache_folder)
        return temp_root() / "compiled" / tag
    return base / "tinychar" / "compiled" / tag


def user_cache_problem() -> str | None:
    """Why $TORCHINDUCTOR_CACHE_DIR cannot name a folder, in words (for one line, before a run touches its out_dir),
    or None: a ~user whose home this machine does not know, which Path.expanduser meets with a RuntimeError."""
    if not _USER_CACHE:
        return None
    try:
        Path(_USER_CACHE).expanduser()
    except RuntimeError:
        user = _USER_CACHE.split("/", 1)[0]
        return (f"TORCHINDUCTOR_CACHE_DIR={_USER_CACHE!r} starts with {user}, the home of a user this machine does "
                f"not know; give the folder's full path, or unset it")
    return None


# Inductor's cache does not tell code built for one vector instruction set from code built for another: measured
# (torch 2.13, a 2-core AVX-512 EPYC), tiny.yaml's step compiled under ATEN_CPU_CAPABILITY=avx2 and then loaded from
# the same cache without it crashed the process (heap corruption, or a segfault), and the reverse trained NaN from
# step 1. A home folder shared by machines of different CPUs would mix them the same way. So each instruction set
# gets a folder.
VECTOR_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "sse", "ssse")


def machine_tag(capability: str, flags: set[str]) -> str:
    """The name of the compile cache's folder for code built here: the processor's architecture, the vector
    capability PyTorch runs with (ATEN_CPU_CAPABILITY can lower it) and a digest of the CPU's vector flags."""
    digest = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:8]
    return f"{platform.machine().lower() or 'cpu'}-{capability.lower()}-{digest}"


def cpu_vector_flags(cpuinfo: str | None = None) -> set[str]:
    """The vector instruction sets the CPU reports in /proc/cpuinfo (empty where there is none to read)."""
    return {f for f in cpu_flags(cpuinfo) if f.startswith(VECTOR_FLAG_PREFIXES)}


class NoCacheFolder(OSError):
    """Neither the compile cache's folder nor its stand-in in the temp folder can be written: nothing can be compiled
    here (inductor writes its code there before it loads it), so the run goes on eagerly, saying why."""


def cache_folder(say: bool = False) -> Path:
    """The folder compiled code goes to, made if need be: compile_cache_dir(), or where that cannot be written, one of
    the same name in the temp folder's tinychar-<uid>, used only while it is this user's alone, since the code in it
    runs (configs.userinput.temp_root_problem); with say, this process says so once, on stderr. NoCacheFolder where
    neither can be used (a file, or a read-only folder, in the way of both)."""
    wanted = compile_cache_dir()
    try:
        _usable(wanted)
        return wanted
    except OSError as e:
        # The temp folder's cache keeps a folder per instruction set too: code of two sets in one folder crashed a
        # run kept to AVX2 followed by a native one ("corrupted size vs. prev_size", exit 134).
        folder = temp_root() / "compiled" / wanted.name
        try:
            _usable(folder)
        except OSError as fallback:
            raise NoCacheFolder(f"no folder for compiled code: cannot use '{shown(str(wanted))}' "
                                f"({e.strerror or type(e).__name__}) nor '{shown(str(folder))}' "
                                f"({fallback.strerror or type(fallback).__name__})") from None
        if say and wanted not in _SAID_MOVED:  # once a process
            _SAID_MOVED.add(wanted)
            how = ("set TORCHINDUCTOR_CACHE_DIR, which names it, to a folder this user can write" if _USER_CACHE
                   else "set TORCHINDUCTOR_CACHE_DIR to choose the folder")
            print(f"compile cache: cannot use '{shown(str(wanted))}' ({e.strerror or type(e).__name__}), so "
                  f"compiled code goes to '{shown(str(folder))}'; {how}", file=sys.stderr, flush=True)
        return folder


def _split_by_compilers(folder: Path) -> str:
    """What in folder's path would split it in two in the C++ compiler's command that inductor builds (torch 2.13:
    it splits the command like a shell, quoting no path: a home folder with a space made every compile fail), in
    words; '' where nothing would."""
    text = str(folder)
    if any(c.isspace() for c in text):
        return ("a space" if " " in text else "a line break" if any(c in text for c in "\n\r") else "a tab"
                if "\t" in text else "a blank character")
    return next((f"a {name}" for c, name in (("'", "quote"), ('"', "quote"), ("\\", "backslash")) if c in text), "")


def _usable(folder: Path) -> None:
    """Make folder if it is missing; OSError unless it is a folder this process can write in, of a path that the
    compiler's command takes whole."""
    if odd := _split_by_compilers(folder):
        raise OSError(errno.EINVAL, f"its path holds {odd}, which splits inductor's compiler command")
    if folder.is_relative_to(temp_root()):  # a name all users know: this user's alone, or unused (its code runs)
        private_temp_root()
    folder.mkdir(parents=True, exist_ok=True)
    if not os.access(folder, os.W_OK):  # a read-only file system is said as such, not as a permission
        read_only = hasattr(os, "statvfs") and os.statvfs(folder).f_flag & getattr(os, "ST_RDONLY", 1)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS)) if read_only else PermissionError(
            errno.EACCES, os.strerror(errno.EACCES))


def prepare_compile() -> Path:
    """Ready torch.compile for this process: its caches in cache_folder(), and no test compiles of the CPU's vector
    instruction sets. Returns the cache folder; NoCacheFolder where there is none to write (cannot_compile says so
    first). Called before torch.compile is first called: that imports dynamo, which makes the folder
    $TORCHINDUCTOR_CACHE_DIR names, and fails where it cannot.

    Inductor otherwise builds and loads a small program for each instruction set the CPU reports before it trusts
    it: measured, 4-5 s of a 20 s first compile of tiny.yaml's step, and a process start per set on every later
    compile. The sets come from the CPU's own flags; the two a C++ compiler may lack (avx512_bf16, amx_fp16) inductor
    still tests, and a compiler that fails anyway makes the run fall back to eager. TORCHINDUCTOR_VEC_ISA_OK, when
    set, decides instead."""
    folder = cache_folder(say=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    tidy(folder)  # libraries cut short, built again (loading one killed the process), and abandoned temporary files
    # The step's graph holds model/linear.py's autograd.Function, which AOTAutograd's cache declines by default (its
    # code could change unseen); the graph the cache keys on includes the function's traced forward and backward, so
    # a changed function is a new key. Measured, tiny.yaml's step from a warm cache: 5.8 s without it, 2.9 s with.
    import torch._functorch.config as functorch_config

    functorch_config.autograd_cache_allow_custom_autograd_functions = True
    cache_marked_functions()
    lower_onednn_linear()
    if os.environ.get("TORCHINDUCTOR_VEC_ISA_OK") is None:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.vec_isa_ok = True
    # The compiler's own modules (1,400 of them: dynamo's, inductor's, sympy's), imported now, while train.py and
    # sample.py keep the collector paused, which then collects again, leaving them out of its sight
    # (training/collector.py); the compile itself makes cyclic garbage, which it collects.
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401

    collector.resume()
    return folder


# Functions that inductor's and AOTAutograd's caches decline in a graph unless told otherwise (each declined graph is
# a "bypass": compiled again in full, though inductor's C++ may come from its cache):
# - autocast's entry and exit, which dynamo writes into the graph for a `with torch.autocast(...)` inside the compiled
#   code (the training step's forward under bfloat16). The graph the caches key on holds their arguments (device,
#   dtype, enabled), so another autocast is another key. Measured, a Xeon with AMX (torch 2.13), train.py with
#   configs/shakespeare_char_cpu.yaml in bfloat16, a compile from the warm cache: 15.2-15.4 s without, 5.6-6.0 s with.
# - while_loop, the sampler's loop of characters (model/sampler.py). The key holds the loop's condition and body too,
#   as graphs of their own (the cache's pickler writes out a graph's submodules with their code), so a loop that
#   differs only inside them is another key. Measured there, sample.py --compile true on that config's model: a
#   compile from the warm cache 13.8-15.9 s without, 6.5-6.6 s with; the same characters.
# Both are keyed by this torch's version. Tests check that a second compile hits the cache and that a change inside
# (autocast's dtype, the loop's bound) misses it.
CACHEABLE_FUNCTIONS = ("torch.amp.autocast_mode._enter_autocast", "torch.amp.autocast_mode._exit_autocast",
                       "torch.ops.higher_order.while_loop")


def cache_marked_functions() -> None:
    """Let inductor's and AOTAutograd's caches keep compiled code that calls CACHEABLE_FUNCTIONS, the user's own
    entries kept; a torch without the setting is left as it is."""
    import torch._inductor.config as inductor_config

    marked = getattr(inductor_config, "unsafe_marked_cacheable_functions", None)
    if isinstance(marked, dict):
        inductor_config.unsafe_marked_cacheable_functions = {
            **dict.fromkeys(CACHEABLE_FUNCTIONS, torch.__version__), **marked}


def cannot_compile(device: torch.device) -> str | None:
    """Why torch.compile cannot work here, or None: it needs Linux or macOS, a CPU or CUDA device, a C++ compiler
    (for CPU code, and for the launchers of CUDA kernels) and a folder to write its code in (cache_folder)."""
    if sys.platform not in ("linux", "darwin"):
        return f"torch.compile is not supported by tinychar on {sys.platform}"
    if device.type not in ("cpu", "cuda"):
        return f"torch.compile is not used on {device.type}"
    from .c_kernels import compiler  # which imports this module

    if compiler() is None:
        return "no C++ compiler found (install g++ or clang++)"
    try:
        cache_folder()
    except NoCacheFolder as e:
        return f"{e}; set TORCHINDUCTOR_CACHE_DIR to a writable folder whose path has no space or quote"
    return None


def cache_key(kind: str, parts: dict) -> str:
    """A compiled step's name in the cache: its kind and a digest of what its compiled code depends on."""
    return f"{kind}-" + hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _marker(key: str) -> Path:
    """The step's marker, where its compiled code goes (a NoCacheFolder where nothing can be compiled: an OSError)."""
    return cache_folder() / f"tinychar-{key}.json"


# A marker holds a few numbers; anything larger, or not a regular file (a named pipe waited for a writer forever), is
# not one.
MARKER_BYTES = 4096


def read_marker(key: str) -> dict:
    """What the marker of key holds ({} where it is missing, unreadable or not a marker)."""
    try:
        last = json.loads(read_user_file(_marker(key), "compile marker", MARKER_BYTES))
    except (OSError, ValueError):
        return {}
    return last if isinstance(last, dict) else {}


def _duration(value: object) -> float | None:
    """A marker's number of seconds or milliseconds: finite and not negative, else None (a damaged marker said a
    compile took -5 s, or a step nan ms, and auto compiled on it; one of 1 and 400 zeros, which JSON reads as an
    int and float() cannot convert, stopped train.py and sample.py in a traceback)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if 0 <= number < math.inf else None


def _last_compile(key: str) -> tuple[float, bool] | None:
    """How long the last compile of this step took, and whether it began with a cold cache (None: never compiled
    here, so the cache is cold)."""
    last = read_marker(key)
    seconds = _duration(last.get("seconds"))
    return None if seconds is None else (seconds, last.get("cold", False) is True)


def cached_compile_seconds(key: str) -> float | None:
    """How long the last compile of this step took (None: never compiled here, so the cache is cold)."""
    last = _last_compile(key)
    return None if last is None else last[0]


# Held while a process reads a marker, changes it and writes it back: the warm-cache helper's step times, written
# while a run of the same step noted its compile, were lost to the run's write, and no later helper times them again.
# Waited for this long at most (its holder writes a few bytes), then the marker is written regardless.
MARKERS_LOCK, MARKERS_LOCK_WAIT = "tinychar-markers.lock", 10.0


def update_marker(key: str, fields: dict | Callable[[dict], dict]) -> None:
    """Write fields into the marker of key, keeping its others; fields may be a function of what the marker holds,
    called while the marker is held (a maximum kept by two processes at once keeps the larger)."""
    try:
        marker = _marker(key)
        marker.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as held:
            with contextlib.suppress(OSError):  # no lock to take (a folder in its place): written as before
                held.enter_context(locked(marker.parent / MARKERS_LOCK, MARKERS_LOCK_WAIT))
            last = read_marker(key)
            text = json.dumps({**last, **(fields(last) if callable(fields) else fields)}).encode()
            write_atomic(marker, lambda f: f.write(text))  # a new file: never written through a link put in its place
    except OSError:
        pass  # a read-only cache only costs the next run its estimate


def remember_compile(key: str, seconds: float, cold: bool = False) -> None:
    """Note that this step compiled here in seconds; cold: from an empty cache (a compile from the cache takes a
    fraction of that: tiny.yaml's step 26.0 s cold, 3.5 s next time)."""
    update_marker(key, {"seconds": round(seconds, 2), "cold": cold})


def remember_step_times(key: str, eager_ms: float | None = None, compiled_ms: float | None = None) -> None:
    """Note what a step took here eagerly and compiled: measured side by side (training.warm.time_steps), or one of
    them, as a sampling run timed its characters (sampling.writing); the other keeps what it held."""
    times = {"eager_ms": eager_ms, "compiled_ms": compiled_ms}
    update_marker(key, {name: round(ms, 3) for name, ms in times.items() if ms is not None})


# A compile from the warm cache takes this share of a compile from an empty one, or less (measured, tiny.yaml's step:
# 26.0 -> 3.5 s and 14-16 -> 2.2 s on a Zen 4 EPYC, 60.8 -> 8.3 s on a Zen 1): where the marker holds only a cold
# compile's time, the warm one is taken to be this share of it; where the step is saved whole (training/step_file.py,
# on a CPU), step_file.LOADED_SHARE.
WARM_SHARE = 0.25


def measured_saving(key: str, warm_share: float = WARM_SHARE) -> tuple[float, float, float] | None:
    """What compiling this step was measured to save here: (ms a step eager, ms compiled, the seconds a compile from
    the warm cache costs, taken as warm_share of a cold one where only that was timed); None where the cache is cold
    or the step was not timed both ways."""
    last, compiled = read_marker(key), _last_compile(key)
    eager_ms, compiled_ms = _duration(last.get("eager_ms")), _duration(last.get("compiled_ms"))
    if eager_ms is None or compiled_ms is None or compiled is None:
        return None
    seconds, cold = compiled
    return eager_ms, compiled_ms, seconds * warm_share if cold else seconds


def compile_expectation(key: str, device: torch.device, layers: int = 3, micro_batches: int = 1) -> str:
    """What the log says a compile of this step will take: the last compile from the cache, if there was one; else
    a range that grows with what the step unrolls, its layers and micro-batches. Measured cold on a 2-core Zen 4
    EPYC: 3 layers 26 s (tiny.yaml), 4 layers 22 s (the CPU config), 6 layers 49 s (configs/shakespeare_char.yaml
    in bfloat16), 2 layers with 3 micro-batches 62 s; on a 2-core Zen 1 EPYC (AVX2), tiny.yaml's 3 layers 61 s; on
    an H100, the 6 layers 29-36 s."""
    last = _last_compile(key)
    if last is None:
        if device.type != "cpu":
            return f"first time for this model: about {30 * max(1.0, layers / 6) * micro_batches:.0f} s on an H100"
        scale = max(1.0, layers / 3) * micro_batches
        return f"first time for this model: about {15 * scale:.0f}-{60 * scale:.0f} s"
    seconds, cold = last
    return f"cached; the first compile took {seconds:.0f} s" if cold else f"cached: about {seconds:.0f} s"
