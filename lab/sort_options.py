"""The command line of `python -m lab sort` and what it refuses before training, each in one line: options that ask
for something the run would not do, paths that would be in each other's way, and --bottleneck's lengths."""

from __future__ import annotations

import os
import sys

if not __package__:  # run as a file (python lab/sort_options.py): the project's packages are one folder up
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # functions, not a command: said at once
    from lab import not_a_command

    raise SystemExit(not_a_command("lab/sort_options.py"))

from configs.userinput import shown


def contradiction(args: object) -> str | None:
    """What in the options asks for something the run would not do (a flag it would ignore), in words; or None."""
    given = {name for name in ("score", "length", "lengths", "heatmap", "logdir", "min_length")
             if getattr(args, name) is not None}
    if args.bottleneck:
        if args.model == "transformer":
            return "--bottleneck compares the GRU with and without attention; leave out --model transformer"
        if args.no_attention:
            return "--bottleneck runs the GRU both with and without attention; leave out --no-attention"
        for name, why in (("length", "takes its lengths from --lengths"), ("heatmap", "prints a table and draws no "
                          "heatmap"), ("logdir", "prints a table and logs nothing to TensorBoard"),
                          ("min_length", "runs each of --lengths unpadded")):
            if name in given:
                return f"--bottleneck {why}; leave out --{name.replace('_', '-')}"
        if args.no_padding_mask:
            return "--bottleneck runs each of --lengths unpadded; leave out --no-padding-mask"
        return None
    if "lengths" in given:
        return "--lengths is for --bottleneck's table; give one run its length with --length"
    if "score" in given and args.model == "transformer":
        return ("--score is the GRU's attention score, and the transformer's attention is its own (scaled dot "
                "product); leave out --score")
    if "score" in given and args.no_attention:
        return "--score scores the GRU's attention, which --no-attention leaves out; give one of them"
    if "heatmap" in given and args.no_attention:
        return "--no-attention has no attention to draw a heatmap of; leave out --heatmap"
    return None


def check_apart(heatmap: str, logdir: str | None) -> None:
    """ValueError in one line when --logdir is at --heatmap's path or under it: the logs' folder, made before
    training, would stand where the picture is written after it. A heatmap inside the logs' folder is fine."""
    if logdir is None:
        return
    picture, logs = os.path.realpath(heatmap), os.path.realpath(logdir)  # ./, ../ and links as the system takes them
    if logs == picture:
        raise ValueError(f"--heatmap and --logdir name the same path, '{shown(heatmap)}', and the logs' folder would "
                         f"stand where the picture goes; give them different paths")
    if logs.startswith(picture.rstrip(os.sep) + os.sep):
        raise ValueError(f"--logdir is inside --heatmap's path, '{shown(heatmap)}', which would have to be a folder "
                         f"for it; give the heatmap another name, or the logs another folder")


def check_lengths(lengths: list[int], steps: int, max_steps: int) -> None:
    """ValueError in one line when --bottleneck's lengths cannot be run: one out of range, one given twice, or so
    many that their runs, two a length of steps each, would take more than max_steps in all (the most steps of one
    run, there to keep a command to about an hour)."""
    if (bad := next((n for n in lengths if not 0 < n < 2**63), None)) is not None:
        raise ValueError(f"--lengths must be from 1 to 2**63 - 1, got {bad}")  # as SortConfig checks --length
    if (total := len(lengths) * 2 * steps) > max_steps:  # first: it is cheap, and a list past it may be long
        raise ValueError(f"--lengths and --steps ask for {len(lengths):,} lengths x 2 runs x {steps:,} steps = "
                         f"{total:,} steps, past the {max_steps:,} one command may take (about an hour); give fewer "
                         f"lengths or fewer --steps")
    seen: set[int] = set()
    if (twice := next((n for n in lengths if n in seen or seen.add(n)), None)) is not None:
        raise ValueError(f"--lengths names {twice} twice; give each length once")
