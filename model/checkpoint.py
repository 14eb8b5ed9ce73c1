"""Reading a checkpoint (``weights_only=True``) and rebuilding the model and its vocabulary from it.

A checkpoint is a plain dict: the model's weights and config, the vocabulary as a list of characters, and
whatever the trainer adds (optimizer, step, RNG states, run config). Nothing in it needs pickle to run code.
Writing one, and the training state in it, is the trainer's business (training/checkpoints.py).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import stat
import warnings
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .baselines import build_model
from .config import GPTConfig
from .runs import CheckpointError, check_checkpoint_path, quoted

FORMAT = "tinychar-checkpoint"  # the "format" entry of every checkpoint, checked on loading
VERSION = 1
# The model config's keys that every checkpoint has held since the first: keys added later may be missing from an
# older one and take their defaults, these not. n_head above all: a wrong head count fits every weight's shape.
DESCRIBING = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")


class WholeCheckpoint(CheckpointError):
    """A checkpoint that is whole but cannot be used here: no reason to replace it with another file."""


class NotThisVersion(WholeCheckpoint):
    """A whole checkpoint that a later tinychar wrote."""


class NoMemoryToLoad(WholeCheckpoint):
    """A checkpoint this process has not the memory to load."""


class Unreadable(WholeCheckpoint):
    """A checkpoint the system will not let this process open (no permission): nothing says it is damaged, so no
    advice to replace it with another file."""


def not_a_file(mode: int) -> str | None:
    """In words, what a path of this st_mode is when it is not a regular file; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISFIFO(mode):
        return "a pipe (a FIFO, or <(command) in a shell)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", mmap: bool = False) -> dict[str, Any]:
    """Read a tinychar checkpoint; anything else (missing, not a regular file, truncated, foreign, unsafe) is a
    CheckpointError. mmap: its tensors read from the file as they are touched, not copied into memory at once."""
    path = Path(path)
    check_checkpoint_path(path)
    kind = not_a_file(os.stat(path).st_mode)
    if kind is not None:  # opening a pipe waits for a writer, forever; a device may never end
        raise CheckpointError(f"{quoted(path)} is {kind}, not a checkpoint file; give the path of a file torch.save "
                              f"wrote")
    if safetensors(path):  # torch said "safetensors is not installed" of one named .safetensors, as if that would help
        raise CheckpointError(f"{quoted(path)} is a safetensors file; tinychar reads the .pt checkpoints its own "
                              f"train.py writes")
    try:  # a file this user may not read was "truncated or not a checkpoint", with advice to replace it
        with open(path, "rb"):
            pass
    except OSError as e:
        raise Unreadable(f"cannot read checkpoint {quoted(path)} ({e.strerror or type(e).__name__}); check that this "
                         f"user may read it") from None
    check_archive(path)
    try:
        with warnings.catch_warnings():
            # torch warns about the pickle protocol of files it did not write; the error below says all there is
            warnings.simplefilter("ignore", UserWarning)
            payload = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        # torch's own message spans several lines, carries terminal escape codes and explains how to load the
        # file unsafely, which is not advice to pass on for a file nobody vouches for. The weights-only unpickler
        # refuses a pickle that names a Python callable or class as an unsupported "global"; any other complaint
        # (an "unsupported operand") is bytes that are no pickle at all: text, an image, a damaged file.
        if "global" not in str(e).lower():
            raise CheckpointError(f"cannot read checkpoint {quoted(path)} (truncated or not a checkpoint): it is not a "
                                  f"file that torch.save wrote") from None
        raise CheckpointError(
            f"refusing to load {quoted(path)}: it holds Python objects, not just plain data (tensors, numbers, "
            f"strings, lists, dicts); only load checkpoints tinychar wrote") from None
    except Exception as e:  # noqa: BLE001 - damaged bytes make the unpickler raise KeyError, IndexError, struct.error...
        text = str(e).strip()
        if isinstance(e, MemoryError) or "can't allocate memory" in text:  # a whole file, too large for what is left
            size = os.stat(path).st_size
            raise NoMemoryToLoad(f"cannot load checkpoint {quoted(path)} ({size / 1e6:,.0f} MB): this process ran "
                                 f"out of memory reading it; free some memory, or raise the process's limit (ulimit "
                                 f"-v) in the shell that starts it") from None
        if "legacy .tar format" in text:  # torch's advice about weights_only and its old format, for any non-zip bytes
            detail = "it is not a zip archive, as torch.save writes one"
        else:
            first = first_sentence(text.splitlines()[0]) if text else ""
            # a reason in words is passed on; a bare KeyError's '101', or a C++ check's file and line, say nothing
            words = re.search(r"[A-Za-z]{3,} [A-Za-z]{3,}", first) and not first.startswith("[enforce fail")
            detail = f"{type(e).__name__}: {first}" if words else "it is not a whole file that torch.save wrote"
        raise CheckpointError(f"cannot read checkpoint {quoted(path)} (truncated or not a checkpoint): "
                              f"{detail}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{quoted(path)} is not a tinychar checkpoint{foreign_kind(payload)}; tinychar reads "
                              f"the checkpoints its own train.py writes (configs/shakespeare_char.yaml trains "
                              f"nanoGPT's baby GPT)")
    version = payload.get("version", VERSION)  # every checkpoint tinychar wrote has one; a hand-made one may not
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointError(f"checkpoint {quoted(path)} has a damaged format version (not an integer)")
    if version < 1:  # the first format was 1
        raise CheckpointError(f"checkpoint {quoted(path)} has a damaged format version (below 1, the first)")
    if version > VERSION:
        shown = f"{version}" if version < 10**6 else "a far later one"
        raise NotThisVersion(f"checkpoint {quoted(path)} is in format version {shown}, newer than this tinychar reads "
                              f"({VERSION}); load it with the tinychar that wrote it, or a later one")
    for key in ("model", "model_config", "vocab"):
        if key not in payload:
            raise CheckpointError(f"checkpoint {quoted(path)} lacks '{key}'; it is damaged or from another program")
    return payload


def holds_later_step(path: Path, step: int) -> bool:
    """Whether the checkpoint at path was saved after step, or is whole but cannot be read here (a later format, too
    little memory left to load it): either way not one to write an older step over. False where it is no checkpoint
    load_checkpoint reads (a save that failed midway)."""
    try:
        saved = load_checkpoint(path).get("step")
    except WholeCheckpoint:  # it read as "no checkpoint", and a resume copied its older ckpt.pt over it
        return True
    except CheckpointError:
        return False
    return isinstance(saved, int) and saved > step


def first_sentence(text: str, limit: int = 160) -> str:
    """text up to the end of its first sentence, and at most limit characters of it, cut at a word ('...')."""
    end = text.find(". ")
    text = text if end < 0 else text[: end + 1]
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + " ..."


def safetensors(path: Path) -> bool:
    """Whether the file starts as a safetensors file does: the length of a JSON header, then the header's '{'."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
        return len(head) == 9 and head[8:] == b"{" and 2 <= int.from_bytes(head[:8], "little") < os.path.getsize(path)
    except OSError:
        return False


def foreign_kind(payload: object) -> str:
    """What a loaded file that is no tinychar checkpoint looks like, as ': ...' (or '' when it is no telling)."""
    if not isinstance(payload, dict):
        return f": it holds {type(payload).__name__ if not isinstance(payload, torch.Tensor) else 'a tensor'}"
    if "model_args" in payload and ("iter_num" in payload or "model" in payload):
        return ": it looks like nanoGPT's (model_args, iter_num), whose model and vocabulary tinychar cannot rebuild"
    if payload and all(isinstance(v, torch.Tensor) for v in payload.values()):
        return f": it holds weights only ({len(payload):,} tensors), without the model config and vocabulary"
    return ""


def check_archive(path: Path) -> None:
    """Refuse, from the zip's central directory alone, a checkpoint whose data would expand in memory beyond the
    file's own size. torch.save stores its entries uncompressed, but torch.load inflates compressed ones, so a
    hand-made file of 25 MB could ask for 25 GB before anything counts what the model needs; and stored entries hold
    their bytes in the file, so sizes that add up to more than it are a lie or overlapping entries. A file that is not
    a zip Python can read (truncated, another format, torch's legacy one) is left to torch.load to judge."""
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except Exception:  # noqa: BLE001 - zipfile raises BadZipFile, OSError, ValueError, struct.error... on foreign bytes
        return
    compressed = next((e for e in entries if e.compress_type != zipfile.ZIP_STORED), None)
    if compressed is not None:
        raise CheckpointError(f"checkpoint {quoted(path)} holds compressed data ({quoted(compressed.filename)}), which "
                              f"torch.save never writes and which could expand far beyond the file's size; refusing "
                              f"to load it")
    total, size = sum(e.file_size for e in entries), path.stat().st_size
    if total > size:
        raise CheckpointError(f"checkpoint {quoted(path)} claims {total:,} bytes of data in a file of {size:,} bytes; "
                              f"it is damaged or crafted, refusing to load it")


def checkpoint_config(payload: dict[str, Any], path: str | Path = "checkpoint") -> tuple[GPTConfig, list[str]]:
    """The model config and vocabulary a loaded checkpoint describes, validated as a config file is (types
    included) and checked against each other, before anything the size of the model is allocated."""
    vocab = payload["vocab"]
    if not isinstance(vocab, list) or not all(isinstance(c, str) and len(c) == 1 for c in vocab):
        raise CheckpointError(f"checkpoint {quoted(path)} has a malformed vocabulary")
    problem = vocabulary_problem(vocab)
    if problem is not None:
        raise CheckpointError(f"checkpoint {quoted(path)} has a malformed vocabulary: {problem}")
    if not isinstance(payload["model_config"], dict):
        raise CheckpointError(f"checkpoint {quoted(path)} has an unusable model config: not a mapping")
    missing = [key for key in DESCRIBING if key not in payload["model_config"]]
    if missing:  # a default in their place could build a model that fits the weights and computes something else
        raise CheckpointError(f"checkpoint {quoted(path)} has an unusable model config: it lacks "
                              f"{', '.join(missing)}, which every checkpoint tinychar writes holds")
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    # each name escaped: a newline in one split the message over two lines
    unknown = sorted(quoted(str(key)) for key in payload["model_config"] if key not in known)
    if unknown:
        raise NotThisVersion(f"checkpoint {quoted(path)} has an unusable model config: {', '.join(unknown[:5])[:200]} "
                              f"is no setting this tinychar knows; load it with the tinychar that wrote it")
    try:
        config = GPTConfig(**payload["model_config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {quoted(path)} has an unusable model config: {str(e)[:200]}") from None
    if config.vocab_size != len(vocab):
        raise CheckpointError(f"checkpoint {quoted(path)} is inconsistent: its vocabulary has {len(vocab)} characters "
                              f"but the model expects {config.vocab_size}")
    return config, vocab


def vocabulary_problem(vocab: list[str]) -> str | None:
    """What makes a list of one-character strings unusable as a vocabulary, in words; None when nothing does. Ids
    are positions in the list, so each character must appear once (twice, the prompt is encoded to one id and the
    other prints the same character), and each must be one that can be printed as UTF-8 (a lone surrogate cannot)."""
    if not vocab:
        return "it is empty"
    seen: dict[str, int] = {}
    for i, c in enumerate(vocab):
        try:
            c.encode("utf-8")
        except UnicodeEncodeError:
            return f"character {i} ({c!r}) is a lone surrogate (half of a UTF-16 pair), which UTF-8 cannot write"
        if c in seen:
            return f"{c!r} is in it twice (characters {seen[c]} and {i})"
        seen[c] = i
    return None


def model_from_checkpoint(payload: dict[str, Any], path: str | Path = "checkpoint") -> tuple[nn.Module, list[str]]:
    """Rebuild the model (a GPT, or the model.type it names) and its vocabulary from a loaded checkpoint, checking
    that they fit together."""
    config, vocab = checkpoint_config(payload, path)
    model = build_model(config)
    weights = payload["model"]
    if isinstance(weights, dict):
        # load_state_dict takes every name for a string (an int was an AttributeError traceback from its prefix check)
        odd = [type(k).__name__ for k in weights if not isinstance(k, str)]
        if odd:
            raise CheckpointError(f"checkpoint {quoted(path)} names a weight by a value of type {odd[0]}, not by a "
                                  f"string; it is damaged or from another program")
        if (odd_weight := unusable_weight(weights)) is not None:
            name, kind = odd_weight
            raise CheckpointError(f"checkpoint {quoted(path)} holds {kind} as weights ({quoted(str(name))}); it is "
                                  f"damaged or from another program")
    try:
        model.load_state_dict(weights)
    except (RuntimeError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {quoted(path)} weights do not match its model config: "
                              f"{error_reasons(e)}") from None
    # The saved tensors too: of two tied weights (the head and the token embedding) the model keeps the one loaded
    # last, and a NaN in the other went past this check into the weights' average, which reads the saved tensors
    name = first_not_finite(model) or first_not_finite_of(
        (k, v) for k, v in weights.items() if isinstance(v, torch.Tensor))
    if name is not None:
        raise CheckpointError(f"checkpoint {quoted(path)} holds weights that are not finite (NaN or infinite) in "
                              f"{name}; it is damaged (training stops before saving such weights)")
    return model, vocab


def unusable_weight(weights: dict) -> tuple[str, str] | None:
    """(name, what it holds, in words) of the first tensor in weights that no model tinychar builds holds, or None.
    load_state_dict would keep the real part of a complex tensor, with a warning on stderr, and take integers or
    booleans as the numbers they are (True as 1.0), without a word; a sparse or meta tensor it refused, its reason cut
    off behind the shapes' line. An 8-bit float passed them all, to a NotImplementedError traceback from the finite
    check ("isfinite" is not implemented for float8_e4m3fn in torch 2.13)."""
    for name, v in weights.items():
        if not isinstance(v, torch.Tensor):
            continue
        if v.is_complex() or not v.is_floating_point() or v.layout != torch.strided or v.is_meta:
            return name, ("complex numbers" if v.is_complex() else "booleans" if v.dtype == torch.bool
                          else "integers" if not v.is_floating_point() else "a sparse tensor"
                          if v.layout != torch.strided else "a tensor with no values (on the meta device)")
        if v.dtype not in WEIGHT_DTYPES:
            return name, f"{str(v.dtype).removeprefix('torch.')} numbers"
    return None


# The floating-point types a weight may be saved in: a model's own (float32), those of a run's other dtypes, and
# float64, which loads as exactly as they do.
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def unlike_weights(weights: object, like: dict) -> str | None:
    """What keeps weights from standing in for like, the loaded weights of the same model, in words; None if nothing
    does: they must be tensors of like's names and shapes (checked first: a tensor of 10**12 values, expanded from one
    in a 2 MB file, was checked whole, 4 TB), of real floating-point numbers in memory, and finite."""
    if not isinstance(weights, dict) or weights.keys() != like.keys() or not all(
            isinstance(t, torch.Tensor) and isinstance(like[k], torch.Tensor) and t.shape == like[k].shape
            for k, t in weights.items()):
        return "not the model's shapes"
    if (odd := unusable_weight(weights)) is not None:
        return f"{odd[1]} in {quoted(str(odd[0]))}"
    if (name := first_not_finite_of(weights.items())) is not None:
        return f"not all finite numbers: {quoted(str(name))}"
    return None


# Values of a weight checked at a time: the check's own memory stays at 16 MiB of booleans, whatever the model.
FINITE_CHUNK = 2**24


def first_not_finite(model: nn.Module) -> str | None:
    """The name of the first parameter holding a NaN or an infinity (in the model's dtype: a float64 1e300 that
    became inf on loading counts), or None. One pass over the weights: sampling from them would fail at the first
    softmax, or on a fixed-shape path draw garbage."""
    return first_not_finite_of(model.named_parameters())


def first_not_finite_of(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating-point tensor of named (name, tensor) pairs holding a NaN or an infinity."""
    for name, p in named:
        if not p.is_floating_point():
            continue
        if not all(bool(chunk.isfinite().all()) for chunk in p.detach().reshape(-1).split(FINITE_CHUNK)):
            return name
    return None


# Characters of an exception's reasons that a one-line message keeps.
REASON_LIMIT = 160


def error_reasons(e: Exception, limit: int = REASON_LIMIT) -> str:
    """An exception's message as one line of at most limit characters, for a person. load_state_dict's first line
    says only that there were errors ("Error(s) in loading state_dict for GPT:"); its reasons follow, one a line
    (missing keys, unexpected keys, a size mismatch), each after a newline and a tab, and are what this keeps. Key
    names come from the file, so the line is escaped: a newline in one cannot split it."""
    message = str(e).strip()
    lines = [line.strip() for line in (message.split("\n\t") if "\n\t" in message else message.splitlines())]
    reasons = [line for line in lines[1:] if line] or [line for line in lines[:1] if line]
    text = "; ".join(reasons) or type(e).__name__
    text = text if text.isprintable() else repr(text)[1:-1]
    return text if len(text) <= limit else text[: limit - 3] + "..."
