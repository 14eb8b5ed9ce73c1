"""Train a character-level GPT.

    python train.py                                    # = --config configs/tiny.yaml
    python train.py --config configs/shakespeare_char_cpu.yaml train.max_iters=500 data.path=my.txt
    python train.py --resume                           # continue out_dir/ckpt.pt
    torchrun --standalone --nproc-per-node 2 train.py  # data-parallel over 2 processes (DDP)
    tensorboard --logdir runs

Config: a YAML file of sections (data, model, train) and top-level keys (out_dir, seed), then dotted
KEY=VALUE overrides. ``python train.py --help`` lists every key with its default and meaning.

This file reads the command line and reports how the run ended (one line and an exit status); the run itself is
the training package's.
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

# Ctrl-C while the modules load (torch takes a second or more) waits until they have loaded, then ends the run in
# one line: raised inside an import, a KeyboardInterrupt can leave torch or numpy half-made (seen: an
# AttributeError from numpy instead) or be lost in their C code (seen: the run went on to the end).
HELD_SIGINT: list[int] = []
STARTING_INTERRUPTED = "interrupted ({}) while starting; nothing was saved"
# What a process of a torchrun launch given --help passes on in place of a refusal (see main)
HELP_ASKED = "--help"
if __name__ == "__main__":
    signal.signal(signal.SIGINT, lambda signum, _frame: HELD_SIGINT.append(signum))

try:  # and a KeyboardInterrupt that an import raises all the same is taken as such a Ctrl-C
    import argparse
    import contextlib
    import io
    import os
    from functools import partial
    from pathlib import Path

    from configs import ConfigError, describe, option_as_setting, valid_keys
    from configs.environment import environment_help
    from configs.errors import UsageError
    from configs.userinput import OneLineParser, StoreOnce, shown
    from data.paths import DataError
    from data.sources import refuse_if_nothing_there
    from training.config import DEFAULT_CONFIG, RunConfig, load_config
    from training.launch import Launch, LaunchError, launch_from_env
    from training.outdir import prepare_out_dir
    from training.resuming import resume_target
    from training.signals import InterruptSignals, start_or_status, wrapped_stop
    from training.streams import leave_now, say, stderr_kept_open, stdout_encodes_any_text
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
    if HELD_SIGINT:
        print(STARTING_INTERRUPTED.format("SIGINT"), file=sys.stderr)
        sys.exit(128 + signal.SIGINT)


# The environment variables train.py reads (the data, the caches, the engine, the numerics), for --help.
ENVIRONMENT = ("TINYCHAR_DATA_DIR", "TINYCHAR_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME",
               "TINYCHAR_WARM_CACHE", "TINYCHAR_ONEDNN", "TINYCHAR_GEMM", "TINYCHAR_SPLIT_STEP",
               "TINYCHAR_FLUSH_DENORMALS", "TINYCHAR_KEEP_MEMORY")


def help_epilog() -> str:
    rows = describe(RunConfig)
    shown = ["null" if d is None else str(d).lower() if isinstance(d, bool) else str(d) for _, d, _ in rows]
    key_width, value_width = max(len(key) for key, _, _ in rows), max(len(v) for v in shown)
    lines = ["config keys (set in the YAML file or as KEY=VALUE overrides), each with the value it takes where "
             "a config leaves it out:"]
    for (key, _, meaning), value in zip(rows, shown, strict=True):
        lines.append(f"  {key:<{key_width}}  {value:<{value_width}}  {meaning}")
    lines += ["", environment_help(ENVIRONMENT)]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(
        prog="train.py",
        description="Train a character-level GPT on a text file.",
        epilog=help_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    config = parser.add_argument("--config", default=None, action=StoreOnce,
                                 help=f"YAML config file (default {DEFAULT_CONFIG})")
    config.once_hint = " (configs do not add up: give the other's settings as KEY=VALUE overrides)"
    parser.add_argument("--resume", action="store_true", help="continue the run saved in out_dir/ckpt.pt")
    parser.add_argument("--overwrite", action="store_true", help="start afresh even if out_dir holds a run")
    parser.add_argument("--out-dir", default=None, help="same as the override out_dir=DIR")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.max_iters=500")
    parser.unknown_hint = partial(option_as_setting, keys=valid_keys(RunConfig),
                                  options=set(parser._option_string_actions))
    args = parser.parse_intermixed_args(argv)  # overrides may come before and after the flags
    if args.resume and args.overwrite:
        parser.error("--resume and --overwrite contradict each other; choose one")
    if args.out_dir is not None:
        given = [o.partition("=")[2] for o in args.overrides if o.partition("=")[0].strip() == "out_dir"]
        def folder(path: str) -> str:  # runs/a, runs/a/ and /here/runs/a are one folder
            return os.path.abspath(os.path.expanduser(path))

        if any(folder(value) != folder(args.out_dir) for value in given):
            other = next(value for value in given if folder(value) != folder(args.out_dir))
            parser.error(f"--out-dir '{shown(args.out_dir)}' and out_dir='{shown(other)}' contradict each other; "
                         f"give one of them")
        args.overrides = [*args.overrides, f"out_dir={args.out_dir}"]
    return args


# What training needs besides its config, torch above all (seconds to import): imported once the command line and
# the config have been read, so that a bad one is refused at once.
TRAINER_MODULES = ("torch", "training.checkpoints", "training.distributed", "training.errors", "training.runner")


def main(argv: list[str] | None = None, progress: bool | None = None) -> int:
    """Run train.py with argv (default sys.argv[1:]); the exit status. progress: a tqdm bar (None: on a terminal)."""
    stderr_kept_open()
    stdout_encodes_any_text()
    try:
        launch = launch_from_env()
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args, refused, said = None, None, io.StringIO()
    with contextlib.ExitStack() as quiet:
        if not launch.main:  # rank 0 answers --help; a refusal is said by rank 0 once the processes have joined
            quiet.enter_context(contextlib.redirect_stdout(io.StringIO()))
            quiet.enter_context(contextlib.redirect_stderr(said))
        try:
            args = parse_args(argv)
        except SystemExit as e:
            # The machines of a run may have been given different command lines: a process that refuses its own, or
            # that was asked for --help, still joins the others, so that they stop too instead of waiting for it
            # (rank 0 has already said why, or printed the help).
            if not launch.torchrun:
                raise
            refused = (said.getvalue().strip().removeprefix("error: ") or "bad command line") if e.code else HELP_ASKED
    cfg = None
    if not launch.torchrun:  # the config, or a resume's overrides, read before torch is imported
        try:
            if not args.resume:
                cfg = load_config(args.config, args.overrides)
                # As the run checks them first, said at once rather than after torch: a folder that holds a run (a
                # second `python train.py`), and a data.path with nothing there (a stat; a glob with no match, a
                # folder with no file)
                prepare_out_dir(Path(cfg.out_dir), resume=False, overwrite=args.overwrite)
                if cfg.data.path is not None:
                    refuse_if_nothing_there(str(cfg.data.path))
            else:  # and the checkpoint it continues, found again by load_run, which reads it beside the config
                resume_target(args.config, args.overrides)
        except (ConfigError, DataError, UsageError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except Exception:  # noqa: S110 - not the config's words: read again below, and reported as a run reports it
            pass
    if (status := start_or_status(TRAINER_MODULES, STARTING_INTERRUPTED)) is not None:
        return status
    return train(args, cfg, launch, refused, progress)


def train(args: argparse.Namespace, cfg: RunConfig | None, launch: Launch, refused: str | None,
          progress: bool | None) -> int:
    """The run the command line asks for, cfg its config if already read; the exit status. refused: why this process
    of a torchrun launch refused its command line (rank 0 has said it), to be agreed on with the others."""
    import torch

    from training import distributed
    from training.checkpoints import load_run
    from training.devices import denormals_as_zero
    from training.errors import HelpAsked, SharedFailure, UsageError, agree, exit_status, failure_line
    from training.heap import memory_kept
    from training.runner import run

    joined = False  # this process has joined the others of a torchrun launch
    try:
        with InterruptSignals(), contextlib.ExitStack() as numerics:
            failure, payload, backend, device = None, None, "gloo", torch.device("cpu")
            try:
                if refused is HELP_ASKED:
                    raise HelpAsked(launch.rank)
                if refused is not None:
                    raise UsageError(refused)
                # before torch first works in parallel (a resume's checks may): its threads copy the setting
                numerics.enter_context(denormals_as_zero())
                numerics.enter_context(memory_kept())  # before the first large tensor
                if cfg is None:
                    cfg, payload, changes = load_run(args.config, args.overrides, args.resume)
                    if launch.main:
                        for change in changes:
                            say(f"resume: {change}")
                if launch.torchrun:
                    device = distributed.rank_device(cfg.train.device, launch)
                    backend = distributed.resolve_backend(cfg.train.backend, device)
            except Exception as e:
                if not launch.torchrun:
                    raise
                failure = e  # said once, by rank 0, when the processes have joined and agree on it
            with distributed.joined(launch, backend, device):
                joined = True
                agree(launch, failure)
                run(cfg, resume=args.resume, overwrite=args.overwrite, progress=progress, payload=payload,
                    launch=launch)
    except Exception as e:
        e = wrapped_stop(e) or e  # a stop signal a library reported as an error of its own: a stop all the same
        line = failure_line(e, cfg, launch)
        if line is None:
            raise  # a bug
        if refused is not None and isinstance(e, SharedFailure) and e.rank == 0:
            line = ""  # rank 0's own refusal, said as argparse refused it
        alone = refused not in (None, HELP_ASKED) and not launch.main and not isinstance(e, SharedFailure)
        if alone:  # the processes never agreed on it, so rank 0 cannot say it
            line = f"error: rank {launch.rank}: {refused}"
        elif launch.torchrun and not launch.main and not joined and isinstance(e, LaunchError) and line:
            # It could not join the others (a host name it cannot resolve, a connection refused): with no group to
            # agree through, it says why itself, on its own machine, where the cause is; it ended in silence, status 2
            alone, line = True, line.replace("error: ", f"error: rank {launch.rank}: ", 1)
        # Under torchrun every process gets here for a shared failure, a stop or a divergence; one line is enough.
        if line and (launch.main or alone):
            print(line, file=sys.stderr)
        return exit_status(e)
    return 0


if __name__ == "__main__":
    # Outside main's own handlers, Ctrl-C and SIGTERM are ignored: main has then either not begun (it is reading its
    # arguments) or said all it has to say, and a second Ctrl-C while the interpreter shuts down (torch's exit
    # handlers take a moment) would only print a traceback from inside one of them.
    for sig in InterruptSignals.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    status = main()
    with contextlib.suppress(LaunchError):  # said by main
        if launch_from_env().torchrun:
            # A process of a torchrun launch, its group torn down and all it writes saved, leaves at once: the
            # interpreter's shutdown ran the teardown of torch's C++ libraries, which aborted (SIGABRT, "terminate
            # called without an active exception", no Python frame left) in about 1 launch in 20-40 of two processes
            # on a busy 2-core machine, after the run had finished, so that torchrun reported it FAILED.
            leave_now(status)
    sys.exit(status)
