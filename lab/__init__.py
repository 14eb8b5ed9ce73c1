"""The attention lab: teaching code that shows what the model does. ``lab.notes`` runs each step of the attention
notes under their names, and ``lab.walkthrough`` prints them on the notes' example (``python -m lab notes``);
``lab.heatmap`` draws attention weights as pictures; ``lab.seq2seq`` and ``lab.sort`` are the notes'
encoder-decoder exercise, sorting digits with attention (``python -m lab sort``). Imports model/ and configs/, and
from training/ only its helpers for output and memory."""

from __future__ import annotations

import sys


def not_a_command(path: str) -> int:
    """What ``python -m lab.<module>`` says of a module of functions, rather than exit having done nothing."""
    print(f"error: {path} holds functions for the lab's commands, not a command of its own; run "
          f"`python -m lab notes` or `python -m lab sort` (see python -m lab --help)", file=sys.stderr)
    return 2
