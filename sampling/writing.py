"""Drawing the characters and writing the samples: the fixed-shape window sampler (compiled where that pays) or the
plain path, one batch for every sample, stdout holding only the samples."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from model import GPT, NonFiniteLogits
from model.config import a_model_of
from model.sampler import GRAPH_CHUNK, MIN_FAST_TEMPERATURE, WindowPass, WindowSampler
from model.span import span_for
from training import collector, compile_cache, step_file
from training.compile_errors import compile_failed, compile_or_clear, compiler_log_quiet, one_line
from training.signals import Interrupted, InterruptSignals, insist_on_stop, interrupting
from training.streams import discard_stdout

from . import compiling
from .stops import Stops, interruption

SEPARATOR = "-" * 40 + "\n"  # each sample ends with a newline; this line sits between two


def write_samples(model: GPT, ids: torch.Tensor, prompt: str, vocab: list[str], args: argparse.Namespace,
                  stops: Stops | None = None) -> None:
    """The samples to stdout, each the prompt, then its characters, then a newline. All of them are generated as one
    batch; with --stream the first one is printed as it comes and the others when they are complete. Stopped by a
    signal between characters (stops: see ctrl_c_between_characters), the samples so far are written, then
    KeyboardInterrupt (or Terminated) is raised; a signal while they are written raises at once. Logits that stop
    being finite numbers partway (weights so large that a later window overflows) end the samples there too: what
    was drawn is written, then NonFiniteLogits is raised."""
    stops = stops or Stops()
    out = sys.stdout
    # the ids of every sample until they are written: 4-byte ints, with room to grow (training.memory.KEPT_ID: 5 bytes
    # a character), checked to fit
    kept = [array("i") for _ in range(args.num_samples)]
    stop: KeyboardInterrupt | NonFiniteLogits | None = None
    with sampling_threads(model, args.num_samples, ids.device) as all_threads:
        try:
            # Ctrl-C or SIGTERM while the sampler is made and compiled (seconds, cold) stops it at once, as in
            # train.py, rather than once it has compiled and drawn its first character
            with InterruptSignals():
                steps = character_steps(model, ids.expand(args.num_samples, -1), args, all_threads)
        except Interrupted as e:
            raise interruption(e.signum) from None
        collector.resume()  # paused by sample.py while it started
        while True:
            try:
                step_ids = next(steps, None)
            except NonFiniteLogits as e:  # a later window overflowed: the text so far is written, then the error
                stop = e
                break
            if step_ids is None:
                break
            column = [row[0] for row in step_ids.tolist()]  # (B, 1) -> B ids: 0.6 us, against 1.8 through [:, 0]
            if args.stream:
                # A stop while a write waits on a reader that is not reading (a pager, `| sleep`) ends it there: noted
                # for later, it waited as long as the reader did (`timeout` sends one signal).
                try:
                    stops.at_once = True
                    if not kept[0]:
                        out.write(prompt)
                    out.write(vocab[column[0]])
                    out.flush()
                except KeyboardInterrupt:
                    discard_stdout()  # what the pipe has not taken would wait on it again at exit
                    raise
                finally:
                    stops.at_once = False
            for row, i in zip(kept, column, strict=True):
                row.append(i)
            if signum := stops():  # stopped between characters: the text so far is written, as it stands
                stop = interruption(signum)
                break
    stops.at_once = True
    if stop is None and (signum := stops()):  # noted after the last character was drawn
        stop = interruption(signum)
    for n, row in enumerate(kept):
        if n:
            out.write(SEPARATOR)
        if not (args.stream and n == 0 and row):
            out.write(prompt + "".join([vocab[i] for i in row]))
        out.write("\n")
    out.flush()
    if stop is not None:
        raise stop


@contextmanager
def sampling_threads(model: GPT, batch: int, device: torch.device) -> Iterator[Callable[[], None]]:
    """One torch thread while sampling a window too small to share out among threads (the count is put back). What it
    gives puts every thread back at once: for the eager sampler's window pass (training/window_kernel.py), one kernel
    whose rows are shared out even at block 8 (3L/4H/64, one stream, 2-core Zen 4: 10,900 characters a second on one
    thread, 12,100-12,700 on two, three rounds in one process)."""
    threads = torch.get_num_threads()
    cfg = model.config
    if device.type == "cpu" and batch * cfg.block_size * cfg.n_embd <= compiling.SAMPLE_ONE_THREAD_MAX:
        torch.set_num_threads(1)
    try:
        yield lambda: torch.set_num_threads(threads)
    finally:
        torch.set_num_threads(threads)


def plain_path(model: GPT, args: argparse.Namespace) -> str | None:
    """Why this request samples on the plain path (GPT.generate: nothing compiled), or None for the window sampler."""
    if not isinstance(model, GPT):
        return f"{a_model_of(model.config.type)} samples on the plain path"
    if args.no_cache:
        return "--no-cache takes the plain path"
    if 0 < args.temperature < MIN_FAST_TEMPERATURE:
        return f"a --temperature below {MIN_FAST_TEMPERATURE:g} (greedy) takes the plain path"
    return None


def character_steps(model: GPT, batch: torch.Tensor, args: argparse.Namespace,
                    all_threads: Callable[[], None] = lambda: None) -> Iterator[torch.Tensor]:
    """The (num_samples, 1) ids of each next character. A GPT samples from a fixed-shape window (model.sampler), on
    one thread where its operators are too small to share out (all_threads puts the others back: see
    sampling_threads), compiled where that pays; --no-cache, the other model types and vanishing temperatures take
    the plain path. Both give the same characters for a seed."""
    if args.max_new_tokens == 0:  # nothing to draw: nothing to compile or capture either
        return iter(())
    gen = torch.Generator(device=batch.device).manual_seed(args.seed)
    plain = plain_path(model, args)
    if plain is not None:
        if args.compile == "true":  # said, as when the environment cannot compile
            print(f"--compile true, but {plain}: sampling without compiling", file=sys.stderr)
        return model.generate_iter(batch, args.max_new_tokens, args.temperature, args.top_k, args.top_p, gen,
                                   use_cache=not args.no_cache)
    cfg, device = model.config, batch.device
    key = compiling.sampling_key(cfg, len(batch), args.temperature, args.top_k, args.top_p, device)
    compiled, why_not = compiling.sampling_compiles(args.compile, args.max_new_tokens, key, device,
                                                 compiling.sampling_eager_pass(cfg, len(batch), device))
    if why_not:
        print(f"--compile true, but {why_not}: sampling without compiling", file=sys.stderr)
    graph = compiling.sampling_graphs(device)
    chunk = noise_chunk(GRAPH_CHUNK if graph else compiling.SAMPLE_CHUNK if compiled else 1, len(batch),
                        cfg.vocab_size, args.temperature)
    # A compile's cost, as --compile auto weighs it, includes importing the compiler, which only a compile needs (1.2 s
    # of a 2.6 s load of the step saved whole on a Zen 5 EPYC): timed without it, auto once compiled 5,000 characters
    # where sampling them eagerly was as fast.
    begun = time.perf_counter()
    try:
        window_pass = None
        if compiled:  # before torch.compile is first called: it makes the cache folder torch is told of, or fails there
            compile_cache.prepare_compile()
            if device.type == "cpu":  # the window's pass as one kernel, else the linear layers' products from weights
                from training import linear_kernel, window_kernel  # packed once, where the kernels apply

                window_pass = window_kernel.window_pass(model, len(batch))
                if window_pass is None:
                    linear_kernel.attach_packed(model)
        else:
            window_pass = eager_window_pass(model, len(batch), args, device)
            if window_pass is not None:
                all_threads()
        # inductor's options only for a compile: on CUDA, reading them imports inductor (1.5 s of a CPU build's import)
        options = compile_cache.compile_options(device) if compiled else None
        source: list[str] = []  # where the step saved whole came from, if it was (step_file.step_function)
        ahead = saved_step(device, source) if compiled and not graph and step_file.used_on(device) else None
        sampler = WindowSampler(model, args.temperature, args.top_k, args.top_p, compile=compiled, options=options,
                                chunk=chunk, graph=graph, ahead=ahead,
                                span=span_for(len(batch), cfg) if compiled and device.type == "cpu" else 1,
                                window_pass=window_pass)
    except Exception as e:  # the compiler is imported here: a signal that lands inside an import can come out wrapped
        # (Python 3.11 wraps one raised in a class's __set_name__ in a RuntimeError; jinja2, which compiles inductor's
        # kernel templates as prepare_compile imports them, in a TemplateSyntaxError), a traceback then
        if (stop := interrupting(e)) is not None:
            raise interruption(getattr(stop, "signum", signal.SIGINT)) from None
        raise
    if compiled or graph:
        cold = compiled and compile_cache.cached_compile_seconds(key) is None
        start = begun if compiled else time.perf_counter()
        try:
            with compiler_log_quiet(), insist_on_stop():
                compile_or_clear(lambda: sampler.warm_up(len(batch), device))
        except Exception as e:  # noqa: BLE001 - any failure of the compiler stack or of the capture: sample eagerly
            if (stop := interrupting(e)) is not None:  # a signal (write_samples's InterruptSignals), which the
                raise interruption(getattr(stop, "signum", signal.SIGINT)) from None  # compiler may report as its own
            why = compile_failed(e) if compiled else f"cannot capture a CUDA graph here ({one_line(e)})"
            print(f"{why}; sampling eagerly", file=sys.stderr)
            eager_pass = eager_window_pass(model, len(batch), args, device) if compiled else None
            if eager_pass is not None:
                all_threads()
            sampler = WindowSampler(model, args.temperature, args.top_k, args.top_p, window_pass=eager_pass)
            compiled = False
        else:
            if (stop := interrupting()) is not None:  # a signal the compiler swallowed, compiling to the end
                raise interruption(getattr(stop, "signum", signal.SIGINT))
            made = "captured as a CUDA graph" if not compiled else "loaded" if source == ["loaded"] else "compiled"
            if compiled:
                # a step loaded whole is no compile from an empty cache, whatever the markers say
                compile_cache.remember_compile(key, time.perf_counter() - start, cold and source != ["loaded"])
            print(f"sampling step {made} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    steps = sampler.generate_iter(batch, args.max_new_tokens, gen)
    # Timed for --compile auto (sampling.compiling.sampling_compiles): on a CPU, where it decides, and not while the
    # characters are streamed, whose writes wait on the reader (a pager, a pipe); eagerly, only as auto samples
    # eagerly (not --compile false where auto would take the window's pass)
    as_auto = (sampler.steps.pass_op is not None) == compiling.sampling_eager_pass(cfg, len(batch), device)
    field = "compiled_ms" if compiled else "eager_ms" if as_auto else None
    if device.type == "cpu" and not args.stream and args.max_new_tokens >= TIMED_MIN_STEPS and field:
        return timed_steps(steps, key, field, args.max_new_tokens)
    return steps


def eager_window_pass(model: GPT, batch: int, args: argparse.Namespace, device: torch.device) -> WindowPass | None:
    """The eager sampler's window pass (training/window_kernel.py, called from Python: a few dozen operators a
    character the less), where it applies (compiling.sampling_eager_pass) and builds; None with --compile false (no
    compiler of any kind: the notes' code as written)."""
    if args.compile == "false" or not compiling.sampling_eager_pass(model.config, batch, device):
        return None
    from training import window_kernel  # the linear kernel's modules, only where they are wanted

    return window_kernel.window_pass(model, batch, compiled=False)


def saved_step(device: torch.device, source: list[str]) -> Callable[[Callable, tuple], Callable | None]:
    """WindowSampler's ``ahead``: the sampling step saved whole in the compile cache (training.step_file), loaded
    there, or compiled and saved for the next run; None (torch.compile's own step follows) where that fails. Where
    it came from is appended to source."""

    def ahead(fn: Callable, args: tuple) -> Callable | None:
        try:
            function, came_from = step_file.step_function(fn, args, device)
        except Exception as e:  # noqa: BLE001 - torch.compile's own compile follows, and says what fails
            if interrupting(e) is not None:
                raise
            return None
        source.append(came_from)
        return function

    return ahead


# The most memory that a chunk's noise, (chunk, samples, vocabulary) floats drawn ahead of the compiled loop, may take:
# with 200 samples of a 60,000-character vocabulary, 32 characters' noise is 1.5 GB, which the compiled loop held twice
# (sample.py --compile true peaked at 3.5 GB where 0.5 GB was counted). Fewer characters a call cost only the calls'
# overhead, which a vocabulary that wide outweighs.
NOISE_BYTES = 64 * 2**20


def noise_chunk(chunk: int, samples: int, vocab_size: int, temperature: float) -> int:
    """The characters a call of the sampling step draws: chunk, fewer where their noise would pass NOISE_BYTES."""
    if temperature == 0:  # greedy: no noise
        return chunk
    return max(1, min(chunk, NOISE_BYTES // (samples * vocab_size * 4)))


# The fewest characters whose drawing is timed: 256 take 0.5-1.3 s eagerly on a 2-core Zen 1 EPYC (block 8 and 64).
TIMED_MIN_STEPS = 256


def timed_steps(steps: Iterator[torch.Tensor], key: str, field: str, count: int) -> Iterator[torch.Tensor]:
    """steps, passed on; once all count of them were drawn (not stopped early), the milliseconds each took noted as
    field ("eager_ms" or "compiled_ms") of the sampling step's marker in the compile cache."""
    start = time.perf_counter()
    drawn = 0
    for step in steps:
        drawn += 1
        yield step
    if drawn == count:
        compile_cache.remember_step_times(key, **{field: (time.perf_counter() - start) * 1000 / count})
