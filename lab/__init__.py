"""The attention lab: teaching code that shows what the model does. ``lab.notes`` runs each step of the attention notes
under their names, and ``lab.walkthrough`` prints them on the notes' example (``python -m lab notes``);
``lab.heatmap`` draws attention weights as pictures (their colours from ``lab.colours``, axis labels from
``lab.labels``, written by ``lab.pictures``); ``lab.seq2seq`` and ``lab.sort`` (with ``lab.sort_options``,
``lab.sort_outputs`` and ``lab.sort_task``) are the notes' encoder-decoder exercise, sorting digits with attention
(``python -m lab sort``). Imports model/ and configs/, and from training/ only its helpers for output, memory and
stop signals."""

from __future__ import annotations

import errno
import sys


def not_a_command(path: str) -> int:
    """What ``python -m lab.<module>`` says of a module of functions, rather than exit having done nothing."""
    print(f"error: {path} holds functions for the lab's commands, not a command of its own; run "
          f"`python -m lab notes` or `python -m lab sort` (see python -m lab --help)", file=sys.stderr)
    return 2


def output_failed(e: OSError) -> int:
    """The exit status of a command whose writing to stdout raised e: 0 where the reader went away (`| head`: stop
    quietly, as command-line tools do), 1 with one line for a full disk or a closed descriptor. Raises e where it is
    not stdout's."""
    from training.streams import discard_stdout

    if not isinstance(e, BrokenPipeError) and (e.errno not in (errno.ENOSPC, errno.EIO, errno.EBADF)
                                               or e.filename is not None):
        raise e
    discard_stdout()  # nothing written later, nor the flush at exit, fails again
    if isinstance(e, BrokenPipeError):
        return 0
    print(f"error: cannot write to stdout ({e.strerror or e})", file=sys.stderr)
    return 1
