"""Generate text from a trained tinychar model.

    python sample.py --out-dir runs/tiny --prompt "ROMEO:" --max-new-tokens 500

stdout carries only the samples (the prompt, then the generated characters); everything else goes to stderr.
"""

from __future__ import annotations

import os  # os, signal and sys are built into the interpreter: there is no moment to interrupt in importing them
import signal
import sys

# Ctrl-C (or SIGTERM) while the modules load (torch takes a second or more) waits until they have loaded, then ends
# the run in one line: raised inside an import, a KeyboardInterrupt can leave torch or numpy half-made (seen: an
# AttributeError from numpy instead) or be lost in their C code (seen: the run went on to the end).
HELD_SIGINT: list[int] = []
if __name__ == "__main__":
    for _stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_stop, lambda signum, _frame: HELD_SIGINT.append(signum))

try:  # and a KeyboardInterrupt that an import raises all the same is taken as such a Ctrl-C
    import argparse
    import codecs
    import time
    from array import array
    from collections.abc import Iterator
    from contextlib import contextmanager
    from pathlib import Path

    import torch

    from configs.userinput import OneLineParser, read_user_file, shown
    from data.paths import LOG_PATH
    from model import (
        GPT,
        CheckpointError,
        NonFiniteLogits,
        checkpoint_config,
        find_checkpoint,
        load_checkpoint,
        model_from_checkpoint,
    )
    from model.config import GPTConfig
    from model.sampler import GRAPH_CHUNK, MIN_FAST_TEMPERATURE, WindowSampler
    from training import compile_cache, engine
    from training.config import COMPILE
    from training.devices import DeviceError, resolve_device
    from training.errors import UsageError, path_error, path_message
    from training.logger import discard_stdout, stderr_kept_open
    from training.memory import MemoryNeed, check_fits, model_need, text_bytes
    from training.signals import Interrupted, InterruptSignals, interrupting
except KeyboardInterrupt:
    if __name__ != "__main__":
        raise
    HELD_SIGINT.append(signal.SIGINT)


class Terminated(KeyboardInterrupt):
    """SIGTERM (kill, timeout), taken as a Ctrl-C is, so that every place that ends a Ctrl-C'd run in one line ends
    this one too (it ended without a word), and so that no library's `except Exception` takes it for a failure of its
    own (torch.compile's, while the sampler compiles)."""

    signum = signal.SIGTERM


def terminated(_signum: int, _frame: object) -> None:
    raise Terminated


def interruption(signum: int) -> KeyboardInterrupt:
    """What a stop signal raises: KeyboardInterrupt for Ctrl-C, Terminated for SIGTERM."""
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def stopped(e: KeyboardInterrupt, what: str) -> int:
    """Say that the run was stopped by the signal e stands for, and what became of it; its exit status."""
    signum = getattr(e, "signum", signal.SIGINT)
    print(f"interrupted ({signal.Signals(signum).name}); {what}", file=sys.stderr)
    return 128 + signum


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, terminated)
    if HELD_SIGINT:
        print(f"interrupted ({signal.Signals(HELD_SIGINT[0]).name}) while starting; nothing was sampled",
              file=sys.stderr)
        sys.exit(128 + HELD_SIGINT[0])

SEPARATOR = "-" * 40 + "\n"  # each sample ends with a newline; this line sits between two
# generate() holds the prompt and every new character in one tensor of 8-byte ids: 10 million is 80 MB, and far more
# text than a character model is sampled for. A larger request is refused here rather than failing in that allocation.
MAX_NEW_TOKENS = 10_000_000
MAX_PROMPT_BYTES = 10_000_000  # --prompt-file: the same bound, in bytes of text


def integer(text: str) -> int:
    """An int from the command line; refused with the text cut to its ends (argparse's own type=int quotes it
    whole)."""
    try:
        return int(text)
    except ValueError:  # not a number, or one of more than 4,300 digits (Python's int-from-text limit)
        raise argparse.ArgumentTypeError(f"invalid int value: '{shown(text)}'") from None


def real(text: str) -> float:
    """A float from the command line; refused with the text cut to its ends."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: '{shown(text)}'") from None


def number(n: int) -> str:
    """n as an error line quotes it: whole up to 20 digits, else its ends and how many digits it has."""
    digits = str(abs(n))
    if len(digits) <= 20:
        return str(n)
    return f"{'-' if n < 0 else ''}{digits[:4]}...{digits[-4:]} ({len(digits):,} digits)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(prog="sample.py", description="Sample text from a trained tinychar checkpoint.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out-dir", default=None, help="a run folder: uses best.pt, else ckpt.pt (default runs/tiny)")
    where.add_argument("--checkpoint", default=None, help="a checkpoint file")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None, help="text to continue (default: a newline)")
    prompt.add_argument("--prompt-file", default=None, help="read the prompt from this UTF-8 file")
    p.add_argument("--num-samples", type=integer, default=1, help="how many samples (default 1)")
    p.add_argument("--max-new-tokens", type=integer, default=500,
                   help="characters to generate per sample (default 500)")
    p.add_argument("--temperature", type=real, default=0.8,
                   help="sampling temperature; 0 = greedy (always the likeliest character) (default 0.8)")
    p.add_argument("--top-k", type=integer, default=None, help="sample only from the k likeliest characters")
    p.add_argument("--top-p", type=real, default=None, help="sample from the smallest set with probability >= p")
    p.add_argument("--seed", type=integer, default=1337,
                   help="random seed; the same seed gives the same text (torch keeps its low 32 bits: seeds 2**32 "
                        "apart give the same text)")
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps")
    p.add_argument("--no-cache", action="store_true",
                   help="the plain path: a forward pass over the whole context per character, no fixed-shape window")
    p.add_argument("--compile", choices=COMPILE, default="auto",
                   help="torch.compile the sampling step: auto (on a CPU, when the text is long enough to win the "
                        "compile time back), true or false (default auto)")
    p.add_argument("--stream", action="store_true", help="print characters as they are generated")
    p.add_argument("--attention-map", default=None, metavar="FILE.png",
                   help="also draw the attention of every layer and head over the prompt (its last block_size "
                        "characters) into this picture: PNG, or the format its extension names (.jpg, .webp, ...)")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    if (why := compile_cache.user_cache_problem()) is not None:  # where sampling compiles, and where it looks
        raise UsageError(why)
    if args.num_samples < 1:
        raise UsageError(f"--num-samples must be >= 1, got {number(args.num_samples)}")
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be >= 0, got {number(args.max_new_tokens)}")
    if args.max_new_tokens > MAX_NEW_TOKENS:
        raise UsageError(f"--max-new-tokens must be at most {MAX_NEW_TOKENS:,}, got {number(args.max_new_tokens)}")
    if not -(2**63) <= args.seed < 2**63:  # what torch.Generator.manual_seed takes without an overflow
        raise UsageError(f"--seed must fit in a signed 64-bit integer, got {number(args.seed)}")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise UsageError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise UsageError(f"--top-k must be >= 1, got {number(args.top_k)}")
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    for flag, value, what in (("--out-dir", args.out_dir, "a run folder (or leave it out: runs/tiny)"),
                              ("--checkpoint", args.checkpoint, "a checkpoint file"),
                              ("--prompt-file", args.prompt_file, "a UTF-8 text file"),
                              ("--attention-map", args.attention_map, "the picture's file name, such as map.png")):
        if value == "":  # Path("") is the current folder: never what was meant
            raise UsageError(f"{flag} is empty; give {what}")
    if args.prompt is not None:
        check_utf8(args.prompt)


def check_utf8(prompt: str) -> None:
    """UsageError when --prompt is not UTF-8: Python hands bytes that are not (b'\\xff' in argv) over as surrogates
    (U+DCFF), which no model has seen and which cannot be written out."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        c = prompt[e.start]
        what = f"byte 0x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else f"a lone surrogate {c!r}"
        raise UsageError(f"--prompt is not UTF-8 text ({what} at character {e.start}); give it as UTF-8, or in a "
                         f"--prompt-file saved as UTF-8") from None


def read_prompt(args: argparse.Namespace, vocab: list[str]) -> str:
    """The prompt: --prompt-file's text (without a leading byte-order mark), --prompt, or a newline by default;
    UsageError when it is empty."""
    if args.prompt_file is not None:
        raw = read_user_file(args.prompt_file, "--prompt-file", MAX_PROMPT_BYTES, error=UsageError)
        bom = raw.startswith(codecs.BOM_UTF8)  # Notepad's "UTF-8 with BOM": a mark of the encoding, not text
        try:
            prompt = raw[len(codecs.BOM_UTF8) if bom else 0 :].decode("utf-8")  # as they are: "\r\n" stays two
        except UnicodeDecodeError as e:
            at = e.start + (len(codecs.BOM_UTF8) if bom else 0)
            raise UsageError(f"--prompt-file: '{shown(args.prompt_file)}' is not UTF-8 (byte 0x{raw[at]:02x} at "
                             f"offset {at}); convert it to UTF-8") from None
        if prompt == "":
            raise UsageError(f"--prompt-file: '{shown(args.prompt_file)}' is empty; give a file of at least one "
                             f"character (or leave out --prompt-file)")
        return prompt
    if args.prompt is not None:
        if args.prompt == "":
            raise UsageError("the prompt is empty; give at least one character (or leave out --prompt)")
        return args.prompt
    return "\n" if "\n" in vocab else vocab[0]


def run_checkpoint(out_dir: str) -> Path:
    """The checkpoint of a run folder (model.find_checkpoint), or UsageError when the folder is a file."""
    if os.path.isfile(out_dir):
        raise UsageError(f"--out-dir '{shown(out_dir)}' is a file, not a run folder; to sample from it, pass it as "
                         f"--checkpoint")
    return find_checkpoint(out_dir)


def map_title(path: Path, prompt: str) -> str:
    return f"{path}: {prompt[-40:]!r}"


def attention_map_characters(args: argparse.Namespace, config: GPTConfig, path: Path, prompt: str) -> int:
    """How many of the prompt's last characters --attention-map draws (0 without one); UsageError, before the model
    is built, for a model whose picture would be too large even for one character."""
    if args.attention_map is None:
        return 0
    from lab.heatmap import characters_shown, too_large

    window = prompt[-config.block_size :]
    pictured = characters_shown(config.n_layer, config.n_head, list(window), map_title(path, prompt))
    if pictured == 0:
        raise UsageError(f"--attention-map: {too_large(config.n_layer, config.n_head)}; leave out --attention-map")
    return pictured


def check_sampling_fits(config: GPTConfig, args: argparse.Namespace, prompt_chars: int, device: torch.device,
                        path: Path) -> None:
    """UsageError, in one line, when the model and the text asked for cannot fit: the weights, the sampling window's
    pass and the text's ids on the device, and the ids kept until the samples are written in the CPU's memory.

    The advice follows what is too large: one sample that cannot fit is the model's fault (or its text's, when that
    dominates); a batch that cannot fit when one sample can, the number of samples (their windows, KV caches and
    text grow with it)."""
    cpu = device.type == "cpu"
    what = f"sampling from '{shown(str(path))}'"
    text_advice = "ask for fewer --num-samples or a smaller --max-new-tokens"

    def need(samples: int) -> tuple[MemoryNeed, int]:
        on_device, kept = text_bytes(samples, prompt_chars, args.max_new_tokens)
        return model_need(config, samples, text=on_device + (kept if cpu else 0)), kept

    one, _ = need(1)
    check_fits(one, device, what=what, advice="ask for a smaller --max-new-tokens" if one.dominant() == "text" else
               "it describes a model too large for this machine")
    batch, kept = need(args.num_samples)
    check_fits(batch, device, what=what, advice=text_advice if batch.dominant() == "text" else
               "ask for fewer --num-samples (one sample fits)")
    if not cpu:
        check_fits(MemoryNeed(weights=0, masks=0, activations=0, text=kept), torch.device("cpu"), what=what,
                   advice=text_advice)


def main(argv: list[str] | None = None) -> int:
    stderr_kept_open()
    args = parse_args(argv)
    if sys.stdout is None:  # started with stdout closed (`>&-`): the samples would go nowhere
        print("error: stdout is closed, and the samples are written there; redirect it to a file (> out.txt) or to "
              "/dev/null instead of closing it", file=sys.stderr)
        return 2
    try:
        ready = prepare(args)
    except KeyboardInterrupt as e:  # Ctrl-C (or SIGTERM) while the checkpoint loads or the attention map is drawn
        return stopped(e, "nothing was sampled")
    if isinstance(ready, int):
        return ready
    model, ids, prompt, vocab = ready
    try:
        with ctrl_c_between_characters() as stops:
            write_samples(model, ids, prompt, vocab, args, stops)
    except BrokenPipeError:  # the reader went away (e.g. `| head`): stop quietly, as command-line tools do
        discard_stdout()  # so the exit-time flush cannot fail too
    except NonFiniteLogits:  # finite for the prompt (see OVERFLOW) but not for a later window: the text so far stays
        print("\nerror: the model's output stopped being a finite number partway through the text (its weights are "
              "so large that float32 overflows); sample from another checkpoint", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C (or SIGTERM) while sampling: the text so far is written (or was streamed)
        print(file=sys.stderr)
        return stopped(e, "stopped sampling")
    except OSError as e:  # stdout is a full disk (or a device that refuses): not the input's fault, exit status 1
        discard_stdout()  # what is still buffered would fail again at exit
        print(f"error: cannot write the samples to stdout ({e.strerror or e})", file=sys.stderr)
        return 1
    return 0


def prepare(args: argparse.Namespace) -> tuple[GPT, torch.Tensor, str, list[str]] | int:
    """The model in eval mode on its device, the prompt's ids, the prompt and the vocabulary; or the exit status of a
    request refused in one line. The checkpoint's line and any attention map are written here."""
    try:
        check_args(args)
        if args.attention_map is not None:  # a name Pillow cannot write, a file it must not replace, a folder that
            # cannot be written: refused first
            from lab.heatmap import check_picture_path

            try:
                check_picture_path(args.attention_map)
            except ValueError as e:
                raise UsageError(f"--attention-map '{shown(args.attention_map)}': {e}") from None
        path = Path(args.checkpoint) if args.checkpoint is not None else run_checkpoint(args.out_dir or "runs/tiny")
        device = resolve_device(args.device)
        # On the CPU: a ckpt.pt also holds the optimizer's moments (and the weights the average was taken of), which
        # would take a small GPU's memory before the check below; model.to(device) moves only the model.
        payload = load_checkpoint(path)
        config, vocab = checkpoint_config(payload, path)  # before the model is built: will it fit?
        if args.attention_map is not None and config.type != "gpt":
            raise UsageError(f"--attention-map: a {config.type} model has no attention to draw (model.type=gpt has)")
        prompt = read_prompt(args, vocab)
        index = {c: i for i, c in enumerate(vocab)}
        unseen = sorted({c for c in prompt if c not in index})
        if unseen:
            listed = ", ".join(repr(c) for c in unseen[:10]) + (" ..." if len(unseen) > 10 else "")
            raise UsageError(f"the prompt holds characters the model never saw in training: {listed}; "
                             f"remove or replace them")
        pictured = attention_map_characters(args, config, path, prompt)
        check_sampling_fits(config, args, len(prompt), device, path)
        model, vocab = model_from_checkpoint(payload, path)
    except (UsageError, CheckpointError, DeviceError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path the system will not take (a name too long, a loop of links)
        if not path_error(e):
            raise
        print(f"error: {path_message(e)}", file=sys.stderr)
        return 2

    model.to(device).eval()
    ids = torch.tensor([[index[c] for c in prompt]], dtype=torch.long, device=device)
    if not finite_output(model, ids[:, -config.block_size:]):
        print(f"error: {OVERFLOW.format(path=shown(str(path)))}", file=sys.stderr)
        return 2
    step = payload.get("step")  # an int in every checkpoint train.py writes; anything else is not quoted
    step = number(step) if isinstance(step, int) and not isinstance(step, bool) else "?"
    print(f"{shown(str(path), LOG_PATH)}: {model.num_params() / 1e6:.2f}M parameters, step {step}, "
          f"vocabulary {len(vocab)}", file=sys.stderr)
    if args.attention_map is not None:
        from lab.heatmap import save_attention_map

        window = min(len(prompt), config.block_size)
        if pictured < window:
            print(f"attention map: the last {pictured:,} characters of the prompt's {window:,} (a picture of them "
                  f"all would be too large to open)", file=sys.stderr)
        try:
            saved = save_attention_map(model, ids[0], vocab, args.attention_map, title=map_title(path, prompt))
        except (OSError, ValueError) as e:  # ValueError: a format Pillow cannot write in RGB
            reason = e.strerror if isinstance(e, OSError) and e.strerror else e
            print(f"error: cannot write --attention-map '{shown(args.attention_map)}': {reason}", file=sys.stderr)
            return 2
        print(f"attention map: {shown(str(saved), LOG_PATH)}", file=sys.stderr)
    return model, ids, prompt, vocab


# A checkpoint whose weights are finite but so large (up to float32's 3.4e38) that the model's output overflows:
# load_checkpoint refuses weights that are not finite themselves, not these.
OVERFLOW = ("'{path}': the model's output is not a finite number (its weights are so large that float32 overflows); "
            "sample from another checkpoint")


@torch.no_grad()
def finite_output(model: GPT, window: torch.Tensor) -> bool:
    """Whether the model's next-character logits after window are all finite numbers: without this, sampling would
    draw from NaN probabilities (a traceback on one path, a text of the vocabulary's first character on others)."""
    logits, _ = model(window)
    return bool(torch.isfinite(logits[:, -1]).all())


def write_samples(model: GPT, ids: torch.Tensor, prompt: str, vocab: list[str], args: argparse.Namespace,
                  stops: Stops | None = None) -> None:
    """The samples to stdout, each the prompt, then its characters, then a newline. All of them are generated as one
    batch; with --stream the first one is printed as it comes and the others when they are complete. Stopped by a
    signal between characters (stops: see ctrl_c_between_characters), the samples so far are written, then
    KeyboardInterrupt (or Terminated) is raised; a signal while they are written raises at once."""
    stops = stops or Stops()
    out = sys.stdout
    # the ids of every sample until they are written: 4-byte ints, with room to grow (training.memory.KEPT_ID: 5 bytes
    # a character), checked to fit
    kept = [array("i") for _ in range(args.num_samples)]
    stop: KeyboardInterrupt | None = None
    with sampling_threads(model, args.num_samples, ids.device):
        try:
            # Ctrl-C or SIGTERM while the sampler is made and compiled (seconds, cold) stops it at once, as in
            # train.py, rather than once it has compiled and drawn its first character
            with InterruptSignals():
                steps = character_steps(model, ids.expand(args.num_samples, -1), args)
        except Interrupted as e:
            raise interruption(e.signum) from None
        for step_ids in steps:
            column = step_ids[:, 0].tolist()
            if args.stream:
                if not kept[0]:
                    out.write(prompt)
                out.write(vocab[column[0]])
                out.flush()
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


class Stops:
    """Ctrl-C (SIGINT) and SIGTERM while sampling (see ctrl_c_between_characters): noted while characters are drawn,
    where the sampler asks between two of them (calling it gives the signal, or None); raised at once after a first
    one, and once at_once is set: when the drawing is over and the samples are being written, where a noted signal
    would stop nothing (and a write to a pipe nobody reads would hold the program there)."""

    def __init__(self) -> None:
        self.noted: list[int] = []
        self.at_once = False

    def __call__(self) -> int | None:
        return self.noted[0] if self.noted else None

    def note(self, signum: int, _frame: object) -> None:
        if self.noted or self.at_once:
            raise interruption(signum)
        self.noted.append(signum)


@contextmanager
def ctrl_c_between_characters() -> Iterator[Stops]:
    """Inside: a Ctrl-C (SIGINT) or SIGTERM is noted, and the caller asks between characters, where nothing can lose
    it (once, with compiled sampling streaming, a KeyboardInterrupt raised where the signal landed vanished and
    sampling went on); a second one raises at once, wherever it lands, as does any once the caller has set at_once.
    Outside the main thread, where signals cannot be handled, Python's own handling stays."""
    stops = Stops()
    try:
        previous = {sig: signal.signal(sig, stops.note) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread
        yield stops
        return
    try:
        yield stops
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def sampling_threads(model: GPT, batch: int, device: torch.device) -> Iterator[None]:
    """One torch thread while sampling a window too small to share out among threads (the count is put back)."""
    threads = torch.get_num_threads()
    cfg = model.config
    if device.type == "cpu" and batch * cfg.block_size * cfg.n_embd <= engine.SAMPLE_ONE_THREAD_MAX:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def plain_path(model: GPT, args: argparse.Namespace) -> str | None:
    """Why this request samples on the plain path (GPT.generate: nothing compiled), or None for the window sampler."""
    if not isinstance(model, GPT):
        return f"a {model.config.type} model samples on the plain path"
    if args.no_cache:
        return "--no-cache takes the plain path"
    if 0 < args.temperature < MIN_FAST_TEMPERATURE:
        return f"a --temperature below {MIN_FAST_TEMPERATURE:g} (greedy) takes the plain path"
    return None


def character_steps(model: GPT, batch: torch.Tensor, args: argparse.Namespace) -> Iterator[torch.Tensor]:
    """The (num_samples, 1) ids of each next character. A GPT samples from a fixed-shape window (model.sampler), on
    one thread where its operators are too small to share out, compiled where that pays; --no-cache, the other
    model types and vanishing temperatures take the plain path. Both give the same characters for a seed."""
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
    key = engine.sampling_key(cfg, len(batch), args.temperature, args.top_k, args.top_p, device)
    compiled, why_not = engine.sampling_compiles(args.compile, args.max_new_tokens, key, device)
    if why_not:
        print(f"--compile true, but {why_not}: sampling without compiling", file=sys.stderr)
    graph = engine.sampling_graphs(device)
    chunk = GRAPH_CHUNK if graph else engine.SAMPLE_CHUNK if compiled else 1
    # inductor's options only for a compile: on CUDA, reading them imports inductor (1.5 s of a CPU build's import here)
    options = compile_cache.compile_options(device) if compiled else None
    sampler = WindowSampler(model, args.temperature, args.top_k, args.top_p, compile=compiled, options=options,
                            chunk=chunk, graph=graph)
    if compiled or graph:
        if compiled:
            compile_cache.prepare_compile()
        cold = compiled and compile_cache.cached_compile_seconds(key) is None
        start = time.perf_counter()
        try:
            with engine.compiler_log_quiet():
                sampler.warm_up(len(batch), device)
        except Exception as e:  # noqa: BLE001 - any failure of the compiler stack or of the capture: sample eagerly
            if (stop := interrupting(e)) is not None:  # a signal (write_samples's InterruptSignals), which the
                raise interruption(getattr(stop, "signum", signal.SIGINT)) from None  # compiler may report as its own
            why = engine.compile_failed(e) if compiled else f"cannot capture a CUDA graph here ({engine.one_line(e)})"
            print(f"{why}; sampling eagerly", file=sys.stderr)
            sampler = WindowSampler(model, args.temperature, args.top_k, args.top_p)
        else:
            if (stop := interrupting()) is not None:  # a signal the compiler swallowed, compiling to the end
                raise interruption(getattr(stop, "signum", signal.SIGINT))
            made = "compiled" if compiled else "captured as a CUDA graph"
            if compiled:
                compile_cache.remember_compile(key, time.perf_counter() - start, cold)
            print(f"sampling step {made} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return sampler.generate_iter(batch, args.max_new_tokens, gen)


if __name__ == "__main__":
    status = main()
    if status in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        # Interrupted: leave now. Ending the interpreter normally would first wait on what torch.compile may have
        # started (its pool of compiler processes), which once kept a Ctrl-C'd run alive for minutes.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:
                pass
        os._exit(status)
    sys.exit(status)
