"""Where `python -m lab sort` puts its results: the run in words, its attention heatmap (the picture, and its path
checked before training) and its TensorBoard log."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if not __package__:  # run as a file (python lab/sort_outputs.py): the project's packages are one folder up
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # functions, not a command: said at once, before the seconds of importing torch
    from lab import not_a_command

    raise SystemExit(not_a_command("lab/sort_outputs.py"))

from configs.userinput import shown
from lab.heatmap import render_attention_map
from lab.pictures import check_picture_path, log_image

if TYPE_CHECKING:
    from lab.sort import SortConfig, SortResult


# How the heatmap labels an input position that holds padding
PAD_LABEL = "_"


def describe(cfg: SortConfig) -> str:
    """The model in a few words: 'GRU, additive attention', 'GRU, no attention', 'transformer'; and ', no padding
    mask' where the padding is left in view."""
    unmasked = ", no padding mask" if not cfg.padding_mask else ""
    if cfg.model == "transformer":
        s = cfg.seq2seq()
        return f"transformer ({s.n_embd} wide, {s.n_layer} block(s) each side, {s.n_head} heads){unmasked}"
    return (f"GRU, {cfg.score} attention{unmasked}" if cfg.attention
            else "GRU, no attention (final encoder state only)")


def heatmap_of(result: SortResult, cfg: SortConfig) -> object:
    """The picture of one decoding: the model's output digits down the side (each digit it got wrong followed by the
    right one in brackets, '6 (1)'), input digits along the top. A padded input's padding has its columns (labelled
    _): grey where the padding mask hides them, coloured with what leaks there without it; the rows are its digits'
    outputs only."""
    digits = [d for d in result.example.tolist() if d != cfg.digits]
    inputs = [str(d) if d != cfg.digits else PAD_LABEL for d in result.example.tolist()]
    # the weights of row t were taken while the model wrote its own digit t, whether or not that was the right one
    said, right = result.answer.tolist()[: len(digits)], sorted(digits)
    outputs = [str(s) if s == r else f"{s} ({r})" for s, r in zip(said, right, strict=True)]
    rows = "the model's output" + (" (the right digit in brackets where it is wrong)" if said != right else "")
    heads = cfg.seq2seq().n_head
    title = f"transformer: cross-attention (mean of {heads} heads)" if cfg.model == "transformer" else describe(cfg)
    if cfg.model == "transformer" and not cfg.padding_mask:
        title += ", no padding mask"
    hidden = (result.example == cfg.digits) if cfg.padding_mask else None
    return render_attention_map(result.weights[: len(digits)], outputs, inputs, title=title, rows=rows,
                                columns="input", hidden=hidden)


def check_heatmap(path: str | Path) -> None:
    """ValueError in one line when the heatmap could not be written at path (a name Pillow cannot write, a folder
    there, a file it must not replace, a file where a folder must be, a folder that cannot be written), so that it
    is refused before training rather than after."""
    refuse = f"--heatmap: cannot write the heatmap '{shown(str(path))}'"
    if not str(path):
        raise ValueError("--heatmap is empty; give the picture's file name, such as sort.png (or leave it out)")
    try:
        check_picture_path(path)
    except ValueError as e:
        raise ValueError(f"{refuse}: {e}") from None


def tensorboard_writer(logdir: str | None) -> object | None:
    """A TensorBoard writer into logdir (created), or None; ValueError in one line when logdir cannot be used, so that
    a bad --logdir is refused before training rather than after."""
    if logdir is None:
        return None
    from training.events import EventWriter

    refuse = f"--logdir: cannot write TensorBoard logs into '{shown(logdir)}'"
    advice = "give a folder that can be created and written"
    # A folder that is there but cannot be written, said as such (the writer would name its file in the folder)
    if os.path.isdir(logdir) and not os.access(logdir, os.W_OK | os.X_OK):
        raise ValueError(f"{refuse} (the folder cannot be written); {advice}")
    if os.path.exists(logdir) and not os.path.isdir(logdir):  # makedirs said only "File exists"
        raise ValueError(f"{refuse} (it is a file, not a folder); {advice}")
    try:
        return EventWriter(logdir)
    except OSError as e:
        reason = e.strerror or type(e).__name__
        if e.filename is not None and os.fsdecode(e.filename) != str(logdir):  # a folder above it, say
            reason = f"'{shown(os.fsdecode(e.filename))}': {reason}"
        raise ValueError(f"{refuse} ({reason}); {advice}") from None


def log_result(writer: object, result: SortResult, image: object | None, cfg: SortConfig) -> None:
    writer.add_scalar("accuracy/held_out", result.accuracy, cfg.steps)
    if result.padding is not None:
        writer.add_scalar("accuracy/held_out_alone", result.padding.accuracy_alone, cfg.steps)
        writer.add_scalar("padding/changed_answers", result.padding.changed, cfg.steps)
    if image is not None:
        log_image(writer, "attention/decoder_over_encoder", image, cfg.steps)
    writer.close()


def default_heatmap(cfg: SortConfig) -> str:
    """The heatmap's name when --heatmap is left out: the model and its attention, then what the task has other
    than the default (sort_gru_additive_attention_len2-8_nomask.png), so that a run made to compare with another,
    such as --no-padding-mask, does not write over its picture."""
    name = "sort_transformer_cross_attention" if cfg.model == "transformer" else f"sort_gru_{cfg.score}_attention"
    default = type(cfg)()
    if cfg.padded:
        name += f"_len{cfg.min_length}-{cfg.length}" + ("" if cfg.padding_mask else "_nomask")
    elif cfg.length != default.length:
        name += f"_len{cfg.length}"
    if cfg.digits != default.digits:
        name += f"_digits{cfg.digits}"
    return f"{name}.png"

