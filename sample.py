"""Generate text from a trained tinychar model.

    python sample.py --out-dir runs/tiny --prompt "ROMEO:" --max-new-tokens 500

stdout carries only the samples (the prompt, then the generated characters); everything else goes to stderr.
"""

from __future__ import annotations

import signal  # signal and sys are built into the interpreter: there is no moment to interrupt in importing them
import sys

# reads only sys and os, on any Python that parses this file
from training.interpreter import missing_requirement, refuse_old_python

if __name__ == "__main__":  # before the imports below, which fail on a Python older than tinychar needs
    refuse_old_python(__file__)
    from training import collector

    collector.pause()  # until the work begins: the start makes next to no cyclic garbage (training/collector.py)

# Ctrl-C (or SIGTERM, SIGHUP) while the modules load (torch takes a second or more) waits until they have loaded, then
# ends the run in one line: raised inside an import, a KeyboardInterrupt can leave torch or numpy half-made (seen: an
# AttributeError from numpy instead) or be lost in their C code (seen: the run went on to the end).
HELD_SIGINT: list[int] = []
STARTING_INTERRUPTED = "interrupted ({}) while starting; nothing was sampled"
if __name__ == "__main__":
    _hangup = getattr(signal, "SIGHUP", None)  # a closed terminal too, unless started by nohup (which ignores it)
    for _stop in (signal.SIGINT, signal.SIGTERM, _hangup):
        if _stop is not None and (_stop != _hangup or signal.getsignal(_stop) is not signal.SIG_IGN):
            signal.signal(_stop, lambda signum, _frame: HELD_SIGINT.append(signum))

try:  # and a KeyboardInterrupt that an import raises all the same is taken as such a Ctrl-C
    import argparse

    from configs.environment import environment_help
    from configs.errors import UsageError
    from configs.userinput import OneLineParser
    from model.runs import CheckpointError
    from sampling.options import check_options, checkpoint_to_read, integer, prompt_text, real, temperature
    from sampling.stops import ctrl_c_between_characters, stopped, terminated
    from training.config import COMPILE
    from training.signals import STOP_SIGNALS, start_or_status
    from training.streams import (
        discard_stdout,
        leave_now,
        reader_gone,
        stderr_kept_open,
        stdout_encodes_any_text,
    )
except KeyboardInterrupt:
    if __name__ != "__main__":
        raise
    HELD_SIGINT.append(signal.SIGINT)
except ModuleNotFoundError as e:  # a requirement not installed for this Python (PyYAML, imported by configs)
    if __name__ != "__main__" or missing_requirement(e) is None:
        raise
    print(missing_requirement(e), file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if not HELD_SIGINT:  # else the imports may have stopped short of terminated
        for _stop in STOP_SIGNALS:  # SIGTERM, and SIGHUP unless started by nohup
            if _stop != signal.SIGINT:
                signal.signal(_stop, terminated)
    if HELD_SIGINT:
        print(STARTING_INTERRUPTED.format(signal.Signals(HELD_SIGINT[0]).name), file=sys.stderr)
        sys.exit(128 + HELD_SIGINT[0])

# What sampling needs besides the command line, torch above all (seconds to import): imported once the options have
# been checked, so that a bad one is refused at once.
SAMPLER_MODULES = ("torch", "model.gpt", "sampling.request", "sampling.writing")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(prog="sample.py", description="Sample text from a trained tinychar checkpoint.",
                      epilog=environment_help(("TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME", "TINYCHAR_ONEDNN")),
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out-dir", default=None, help="a run folder: uses best.pt, else ckpt.pt (default runs/tiny)")
    where.add_argument("--checkpoint", default=None, help="a checkpoint file")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None, help="text to continue (default: a newline)")
    prompt.add_argument("--prompt-file", default=None, help="read the prompt from this UTF-8 file")
    p.add_argument("--num-samples", type=integer, default=1, help="how many samples (default 1)")
    p.add_argument("--max-new-tokens", type=integer, default=500,
                   help="characters to generate per sample (default 500)")
    p.add_argument("--temperature", type=temperature, default=0.8,
                   help="sampling temperature; 0 = greedy (always the likeliest character) (default 0.8)")
    p.add_argument("--top-k", type=integer, default=None,
                   help="sample only from the k likeliest characters (default: all)")
    p.add_argument("--top-p", type=real, default=None,
                   help="sample from the smallest set with probability >= p (default: no limit)")
    p.add_argument("--seed", type=integer, default=1337,
                   help="random seed; the same seed gives the same text (torch keeps its low 32 bits: seeds 2**32 "
                        "apart give the same text) (default 1337)")
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps (default auto)")
    p.add_argument("--no-cache", action="store_true",
                   help="the plain path: a forward pass over the whole context per character, no fixed-shape window")
    p.add_argument("--compile", choices=COMPILE, default="auto",
                   help="torch.compile the sampling step: auto (on a CPU, when the text is long enough to win the "
                        "compile time back; else tinychar's window kernel where it applies), true, or false (no "
                        "compiled code of any kind: the notes' code as written) (default auto)")
    p.add_argument("--stream", action="store_true", help="print characters as they are generated")
    p.add_argument("--attention-map", default=None, metavar="FILE.png",
                   help="also draw the attention of every layer and head over the prompt (its last block_size "
                        "characters) into this picture: PNG, or the format its extension names (.jpg, .webp, ...); "
                        "missing folders on its path are made")
    p.add_argument("--attention-values", action="store_true",
                   help="write each weight in its square of the --attention-map picture, with two decimals (the "
                        "squares grow to hold them)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    stderr_kept_open()
    stdout_encodes_any_text()
    args = parse_args(argv)
    if sys.stdout is None:  # started with stdout closed (`>&-`): the samples would go nowhere
        print("error: stdout is closed, and the samples are written there; redirect it to a file (> out.txt) or to "
              "/dev/null instead of closing it", file=sys.stderr)
        return 2
    try:
        check_options(args)
        checkpoint_to_read(args)  # here a missing checkpoint or run folder is said at once, not after torch
    except (UsageError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError:  # a path the system will not take (a name too long): said by prepare, as every path is
        pass
    try:
        prompt = prompt_text(args)  # read once, here: a --prompt-file missing, empty or not UTF-8 is said at once too
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if (status := start_or_status(SAMPLER_MODULES, STARTING_INTERRUPTED)) is not None:
        return status
    from model import NonFiniteLogits
    from sampling.request import prepare
    from sampling.writing import write_samples

    try:
        ready = prepare(args, prompt)
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
    except NonFiniteLogits:  # finite for the prompt (sampling.request.OVERFLOW), not for a later window: the text
        # so far was written (write_samples)
        print("error: the model's output stopped being a finite number partway through the text (its weights are "
              "so large that float32 overflows); sample from another checkpoint", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C (or SIGTERM) while sampling: the text so far is written (or was streamed)
        print(file=sys.stderr)
        return stopped(e, "stopped sampling")
    except OSError as e:  # stdout is a full disk (or a device that refuses): not the input's fault, exit status 1
        gone = reader_gone(e, sys.stdout)  # asked before stdout is /dev/null, a character device as a terminal is
        discard_stdout()  # what is still buffered would fail again at exit
        if gone:  # its terminal has closed: the hang-up signal, seen or on its way
            return 128 + signal.SIGHUP
        print(f"error: cannot write the samples to stdout ({e.strerror or e})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    status = main()
    if status - 128 in STOP_SIGNALS:
        # Interrupted: leave now. Ending the interpreter normally would first wait on what torch.compile may have
        # started (its pool of compiler processes), which once kept a Ctrl-C'd run alive for minutes.
        leave_now(status)
    sys.exit(status)
