"""sample.py's options: the numbers and texts a person gives, checked before torch is imported (seconds), so that a
bad one is refused at once."""

from __future__ import annotations

import argparse
import codecs
import os
from pathlib import Path

from configs.errors import UsageError
from configs.userinput import not_stdin, path_kind, read_user_file, shown
from configs.userinput import real as read_real
from model.runs import check_checkpoint_path, find_checkpoint

# generate() holds the prompt and every new character in one tensor of 8-byte ids: 10 million is 80 MB, and far more
# text than a character model is sampled for. A larger request is refused here rather than failing in that allocation.
MAX_NEW_TOKENS = 10_000_000
MAX_PROMPT_BYTES = 10_000_000  # --prompt-file: the same bound, in bytes of text
# Where sample.py looks without --out-dir or --checkpoint: the folder configs/tiny.yaml trains into.
DEFAULT_OUT_DIR = "runs/tiny"


def integer(text: str) -> int:
    """An int from the command line; refused with the text cut to its ends (argparse's own type=int quotes it
    whole)."""
    try:
        return int(text)
    except ValueError:  # not a number, or one of more than 4,300 digits (Python's int-from-text limit)
        raise argparse.ArgumentTypeError(f"invalid int value: '{shown(text)}'") from None


def real(text: str) -> float:
    """A float from the command line; refused with the text cut to its ends, or where it is nearer 0 than a float
    can hold (configs.userinput.real)."""
    return read_real(text)


def temperature(text: str) -> float:
    """--temperature: a real, whose 1e-400 (read as 0 by float) was greedy sampling without a word; refused, saying
    that 0 is greedy (as every temperature below about 1e-38 is in effect: model.gpt.greedy_where_overflowed)."""
    return read_real(text, ": --temperature 0 samples greedily")


def number(n: int) -> str:
    """n as an error line quotes it: whole up to 20 digits, else its ends and how many digits it has."""
    digits = str(abs(n))
    if len(digits) <= 20:
        return str(n)
    return f"{'-' if n < 0 else ''}{digits[:4]}...{digits[-4:]} ({len(digits):,} digits)"


def check_options(args: argparse.Namespace) -> None:
    """UsageError for a number out of its range, an empty path or a --prompt that is not UTF-8."""
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
    for flag, what in (("--out-dir", "a run folder (or leave it out: runs/tiny)"),
                       ("--checkpoint", "a checkpoint file"),
                       ("--prompt-file", "a UTF-8 text file"),
                       ("--attention-map", "the picture's file name, such as map.png")):
        name = flag[2:].replace("-", "_")
        value = getattr(args, name)
        if value == "":  # Path("") is the current folder: never what was meant
            raise UsageError(f"{flag} is empty; give {what}")
        if flag == "--prompt-file" and value == "-" and not os.path.lexists(value):  # stdin, as in many tools
            raise UsageError(f"{not_stdin('--prompt-file')}, or give the text with --prompt")
        if value is not None:  # '~' is the home folder, as in train.py's paths (the shell leaves --out-dir=~/r)
            setattr(args, name, os.path.expanduser(value))
    if args.attention_values and args.attention_map is None:
        raise UsageError("--attention-values writes the weights into the --attention-map picture; give that too "
                         "(--attention-map FILE.png)")
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


def prompt_text(args: argparse.Namespace) -> str | None:
    """The prompt given: --prompt-file's text (without a leading byte-order mark) or --prompt; None for the default,
    which the vocabulary decides (sampling.request.read_prompt). Read before torch is imported, so that a file that
    is missing, empty or not UTF-8 is said at once: UsageError. The file is read once (read_user_file refuses pipes
    and devices, so nothing is consumed that a second read would miss)."""
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
    return None


def checkpoint_to_read(args: argparse.Namespace) -> Path:
    """The checkpoint sample.py reads: --checkpoint, else the one of the run folder (run_checkpoint). Asked before
    torch is imported, so that a path with nothing to read (a typo, or no run trained yet) is said at once, not
    seconds later: CheckpointError, or UsageError for an --out-dir that is a file."""
    if args.checkpoint is None:
        return run_checkpoint(args.out_dir)
    path = Path(args.checkpoint)
    check_checkpoint_path(path)
    return path


def run_checkpoint(out_dir: str | None) -> Path:
    """The checkpoint of a run folder (out_dir, or DEFAULT_OUT_DIR without one): model.runs.find_checkpoint's
    CheckpointError when there is none, UsageError when the folder is a file or a device."""
    out_dir = out_dir or DEFAULT_OUT_DIR
    if os.path.isfile(out_dir) or os.path.isfile(out_dir.rstrip("/") or "/"):  # 'run/ckpt.pt/', a tab's completion
        raise UsageError(f"--out-dir '{shown(out_dir)}' is a file, not a run folder; to sample from it, pass it as "
                         f"--checkpoint")
    kind = path_kind(out_dir) or path_kind(out_dir.rstrip("/") or "/")  # /dev/null/ cannot be looked at as it is
    if kind not in (None, "a folder"):  # /dev/null: "no run folder", as if nothing was there
        raise UsageError(f"--out-dir '{shown(out_dir)}' is {kind}, not a run folder; give the folder a run wrote")
    return find_checkpoint(out_dir)
