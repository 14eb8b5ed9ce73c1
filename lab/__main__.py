"""``python -m lab <command>``: the lab's runnable exercises. ``notes``: the notes' worked example of attention,
step by step; ``sort``: sorting digits with attention."""

from __future__ import annotations

import importlib
import os
import sys

if not __package__:  # run as a file (python lab/__main__.py): the project's packages are one folder up
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# reads only sys and os, on any Python that parses this file
from training.interpreter import missing_requirement, refuse_old_python

if __name__ == "__main__":  # before the imports below, which fail on a Python older than tinychar needs
    refuse_old_python("-m lab")  # (lab/sort.py and lab/walkthrough.py check before they import this module)

try:
    from configs.userinput import shown
    from lab import output_failed
    from training.signals import start_or_status
    from training.streams import stderr_kept_open, stdout_encodes_any_text
except ModuleNotFoundError as e:  # a requirement not installed for this Python (PyYAML, imported by configs)
    # Whether run as python -m lab or imported by lab/sort.py or lab/walkthrough.py run as scripts, this module is
    # imported only to run a command: the line is said for all of them.
    if missing_requirement(e) is None:
        raise
    print(missing_requirement(e), file=sys.stderr)
    sys.exit(2)

# command -> (its module in lab/, what it does)
COMMANDS = {"notes": ("walkthrough", "the notes' worked example of attention, step by step, computed by tinychar"),
            "sort": ("sort", "sorting digits with a GRU or transformer encoder-decoder, with or without attention")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        try:
            print("usage: python -m lab <command> [options]\n")
            for name, (_, what) in COMMANDS.items():
                print(f"  {name:<6} {what}")
            sys.stdout.flush()  # here, where a full disk is one line, not at exit in a traceback
        except OSError as e:
            return output_failed(e)
        return 0
    if not argv or argv[0] not in COMMANDS:
        # quoted as typed, escaped and cut: a newline in it split the line, a terminal's escapes acted on the screen
        given = f"unknown command '{shown(argv[0])}'" if argv else "no command given"
        print(f"error: {given}; the commands are: {', '.join(COMMANDS)} (see python -m lab --help)", file=sys.stderr)
        return 2
    # Imported only when run: torch and the models are slow to load for --help. Ctrl-C or SIGTERM meanwhile waits until
    # they have loaded, then ends the command in one line (SIGTERM ended it without a word).
    module = f"lab.{COMMANDS[argv[0]][0]}"
    if (status := start_or_status((module,), "interrupted ({}) while starting; nothing was done")) is not None:
        return status
    command = importlib.import_module(module)
    stderr_kept_open()
    stdout_encodes_any_text()
    return command.main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
