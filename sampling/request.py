"""What sample.py is asked for, checked before anything heavy runs: the numbers, the prompt, the checkpoint, the
attention map's file and whether the model and the text fit; then the model, ready to sample."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from configs.userinput import path_word, shown, shows_nothing_alone
from data.paths import LOG_PATH
from model import (
    GPT,
    CheckpointError,
    checkpoint_config,
    load_checkpoint,
    model_from_checkpoint,
)
from model.checkpoint import WholeCheckpoint
from model.config import GPTConfig, a_model_of, parameters_text
from training import compile_cache
from training.devices import DeviceError, resolve_device
from training.errors import UsageError, path_error, path_message
from training.memory import MemoryNeed, check_fits, model_need, text_bytes

from .options import check_options, number, prompt_text, run_checkpoint


def check_args(args: argparse.Namespace) -> None:
    if (why := compile_cache.user_cache_problem()) is not None:  # where sampling compiles, and where it looks
        raise UsageError(why)
    check_options(args)


def read_prompt(given: str | None, vocab: list[str]) -> str:
    """The prompt: the text given (options.prompt_text), or a newline by default (the vocabulary's first character
    where it has none)."""
    if given is not None:
        return given
    return "\n" if "\n" in vocab else vocab[0]


def map_title(path: Path, prompt: str) -> str:
    return f"{path}: {prompt[-40:]!r}"


def attention_map_characters(args: argparse.Namespace, config: GPTConfig, path: Path, prompt: str) -> int:
    """How many of the prompt's last characters --attention-map draws (0 without one); UsageError, before the model
    is built, for a model whose picture would be too large even for one character."""
    if args.attention_map is None:
        return 0
    from lab.heatmap import characters_shown, too_large

    window = prompt[-config.block_size :]
    pictured = characters_shown(config.n_layer, config.n_head, list(window), map_title(path, prompt),
                                values=args.attention_values)
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


def check_map_path(name: str) -> None:
    """UsageError for an --attention-map that cannot be written: a name Pillow cannot write, a file it must not
    replace, a folder that cannot be written (refused before anything is loaded)."""
    from lab.pictures import check_picture_path

    try:
        check_picture_path(name)
    except ValueError as e:
        raise UsageError(f"--attention-map '{shown(name)}': {e}") from None


def shown_char(ch: str) -> str:
    """A character in a message: quoted, or its code point where it shows nothing alone (a combining mark sat on
    the quote before it: '́'; a joiner was '\u200d' beside U+ codes elsewhere)."""
    if shows_nothing_alone(ch) or (not ch.isprintable() and ch not in "\n\r\t"):
        return f"U+{ord(ch):04X}"
    return repr(ch)


def check_known(prompt: str, index: dict[str, int]) -> None:
    """UsageError for a prompt holding characters that are not in the vocabulary (index)."""
    unseen = sorted({c for c in prompt if c not in index})
    if unseen:
        listed = ", ".join(shown_char(c) for c in unseen[:10]) + (" ..." if len(unseen) > 10 else "")
        how = "remove or replace them"
        if "\r" in unseen and "\r\n" in prompt and "\n" in index:  # a file saved on Windows, the model trained on \n
            how += " (its lines end in \\r\\n, as Windows saves text: save it with \\n line endings, e.g. dos2unix)"
        elif "\ufffd" in index:  # data.max_vocab (or data.errors=replace) trained it on U+FFFD in their place
            how += (" (this model's vocabulary holds U+FFFD, which stood in for the characters its training text did "
                    "not keep: U+FFFD may stand in for them here too)")
        raise UsageError(f"the prompt holds characters the model never saw in training: {listed}; {how}")


def load_run_checkpoint(path: Path, chosen_for_the_run: bool) -> dict:
    """load_checkpoint(path); where --out-dir chose best.pt and it cannot be read, the refusal names the run's ckpt.pt
    beside it, which may be whole (a damaged best.pt gave a line with no way forward)."""
    try:
        return load_checkpoint(path)
    except CheckpointError as e:
        latest = path.with_name("ckpt.pt")
        if not chosen_for_the_run or path.name != "best.pt" or not latest.is_file() or isinstance(e, WholeCheckpoint):
            raise
        raise CheckpointError(f"{e}; the run's latest checkpoint may be whole: --checkpoint "
                              f"{path_word(str(latest))}") from None


def prepare(args: argparse.Namespace, given: str | None = None) -> tuple[GPT, torch.Tensor, str, list[str]] | int:
    """The model in eval mode on its device, the ids of the prompt's last block_size characters (all a model reads of
    it), the prompt and the vocabulary; or the exit status of a request refused in one line. given: the prompt's text
    as options.prompt_text read it (sample.py reads it before torch imports), else it is read here. The checkpoint's
    line and any attention map are written here."""
    try:
        check_args(args)
        if given is None:
            given = prompt_text(args)
        if args.attention_map is not None:
            check_map_path(args.attention_map)
        path = Path(args.checkpoint) if args.checkpoint is not None else run_checkpoint(args.out_dir)
        device = resolve_device(args.device)
        # On the CPU: a ckpt.pt also holds the optimizer's moments (and the weights the average was taken of), which
        # would take a small GPU's memory before the check below; model.to(device) moves only the model.
        payload = load_run_checkpoint(path, args.checkpoint is None)
        config, vocab = checkpoint_config(payload, path)  # before the model is built: will it fit?
        if args.attention_map is not None and config.type != "gpt":
            raise UsageError(f"--attention-map: {a_model_of(config.type)} has no attention to draw (model.type=gpt "
                             f"has)")
        prompt = read_prompt(given, vocab)
        index = {c: i for i, c in enumerate(vocab)}
        check_known(prompt, index)
        pictured = attention_map_characters(args, config, path, prompt)
        # Only the prompt's last block_size characters are ever read (every model's window, and the recurrent models'
        # start): a 5 MB prompt copied into each of 100 samples' context took 4 GB.
        window = prompt[-config.block_size:]
        check_sampling_fits(config, args, len(window), device, path)
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
    ids = torch.tensor([[index[c] for c in window]], dtype=torch.long, device=device)  # (1, at most block_size)
    if not finite_output(model, ids):
        print(f"error: {OVERFLOW.format(path=shown(str(path)))}", file=sys.stderr)
        return 2
    step = payload.get("step")  # an int in every checkpoint train.py writes; anything else is not quoted
    step = number(step) if isinstance(step, int) and not isinstance(step, bool) else "?"
    print(f"{shown(str(path), LOG_PATH)}: {parameters_text(model.num_params(non_embedding=False))}, step {step}, "
          f"vocabulary {len(vocab)}", file=sys.stderr)
    if args.attention_map is not None:
        from lab.heatmap import save_attention_map

        window = min(len(prompt), config.block_size)
        if pictured < window:
            print(f"attention map: the last {pictured:,} characters of the prompt's {window:,} (a picture of them "
                  f"all would be too large to open)", file=sys.stderr)
        try:
            saved = save_attention_map(model, ids[0], vocab, args.attention_map, title=map_title(path, prompt),
                                       values=args.attention_values)
        except (OSError, ValueError) as e:  # ValueError: a format Pillow cannot write in RGB
            reason = e.strerror if isinstance(e, OSError) and e.strerror else e
            print(f"error: cannot write --attention-map '{shown(args.attention_map)}': {reason}", file=sys.stderr)
            return 2
        except MemoryError:  # Pillow's, for the picture: about 9 bytes a pixel, which check_sampling_fits leaves out
            # (a 24-layer, 24-head model's 64 characters under a 1.2 GB limit: a MemoryError traceback, status 1)
            print(f"error: out of memory drawing the --attention-map of {pictured:,} characters x {config.n_layer:,} "
                  f"layers x {config.n_head:,} heads; give a shorter --prompt, or leave --attention-map out",
                  file=sys.stderr)
            return 1
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
