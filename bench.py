"""Measure tinychar next to nanoGPT on this machine's CPU, each program run as its users run it.

    python bench.py --nanogpt ../nanoGPT                  # every row, ~35-40 minutes on 2 cores
    python bench.py --nanogpt ../nanoGPT --isa avx2       # as on a CPU without AVX-512 (libraries kept to AVX2)
    python bench.py --nanogpt ../nanoGPT --skip-quality   # training steps and sampling only
    python bench.py --nanogpt ../nanoGPT --quick          # a smoke test of every row, short step counts
    python bench.py --nanogpt ../nanoGPT --gpu            # on a CUDA GPU: the baby GPT to nanoGPT's best loss

Get nanoGPT with: git clone https://github.com/karpathy/nanoGPT

Both programs run their own train.py and sample.py as subprocesses of this Python (same torch), on tiny Shakespeare,
with the same thread count, model shape and batch. A training step is timed inside each program's run, between two of
the step lines it logs as they arrive; a sampled character from whole-process wall times taken at two lengths and
differenced; so start-up, data loading and compilation are left out of both. Rounds alternate the two programs so
machine noise falls on both. The table goes to stdout (markdown), progress to stderr.
"""

from __future__ import annotations

import sys

# reads only sys and os, on any Python that parses this file
from training.interpreter import missing_requirement, refuse_old_python

if __name__ == "__main__":  # before the imports below, which fail on a Python older than tinychar needs
    refuse_old_python(__file__)

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path

try:
    from benchmark.quality import gpu_quality_rows, quality_rows
    from benchmark.report import json_problem, markdown, plain, write_json
    from benchmark.runs import (
        CLONE_HINT,
        FULL,
        ISA_LIMITS,
        NANOGPT_FILES,
        NANOGPT_MARKS,
        QUICK,
        SAMPLE_SHAPES,
        STEP_SHAPES,
        BenchError,
        Plan,
        Programs,
        cpu_info,
        note,
        usable_flags,
    )
    from benchmark.speed import sample_rows, step_rows
    from configs.userinput import OneLineParser, shown
    from model.config import short_int
    from training.config import MAX_THREADS, THREADS_PER_CORE, cores_here
    from training.signals import Interrupted, InterruptSignals, start_or_status
    from training.streams import discard_stdout
except ModuleNotFoundError as e:  # a requirement not installed for this Python (PyYAML, imported by configs)
    if __name__ != "__main__" or missing_requirement(e) is None:
        raise
    print(missing_requirement(e), file=sys.stderr)
    sys.exit(2)


def measure(args: argparse.Namespace, plan: Plan, scratch: Path) -> dict:
    """Every row, in the table's order, with the machine they were measured on; scratch holds all the runs' files."""
    import torch

    from benchmark.products import matmul_gflops, products_ms

    cpuinfo = Path("/proc/cpuinfo")
    cpu, flags = cpu_info(cpuinfo.read_text(encoding="utf-8", errors="replace") if cpuinfo.exists() else "")
    flags = usable_flags(flags, args.isa)
    rounds = args.rounds or (1 if args.gpu else plan.rounds)  # --gpu: each round is minutes of the GPU's time
    report = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu, "cpu_flags": flags, "isa": args.isa,
              "cores": os.cpu_count(),
              "torch": torch.__version__, "threads": args.threads, "rounds": rounds, "quick": args.quick,
              "lengths": {"steps": plan.steps, "compiled_steps": plan.compiled_steps, "chars": plan.chars,
                          "compiled_chars": plan.compiled_chars, "quality_iters": plan.quality_iters}}
    if args.gpu:
        report["gpu"] = torch.cuda.get_device_name()
        note("nanoGPT: copying and preparing its data ...")
        p = Programs(Path(args.nanogpt).resolve(), scratch, args.threads)
        report["rows"] = gpu_quality_rows(p, plan.quality_iters, rounds)
        return report
    note("matmul ceilings ...")
    report["matmul_gflops"] = matmul_gflops(args.threads, plan.ceiling_seconds)
    note("nanoGPT: copying and preparing its data ...")
    p = Programs(Path(args.nanogpt).resolve(), scratch, args.threads)
    bf16 = "avx512_bf16" in flags or "amx_bf16" in flags  # where tinychar's dtype=auto may choose bfloat16
    rows, auto_rows = [], []
    report["products"] = {}
    for name in plan.steps:
        note(f"training steps, {name} ...")
        float32, *auto = step_rows(p, name, plan, rounds, bf16)
        rows.append(float32)
        auto_rows += auto
        ms = products_ms(STEP_SHAPES[name], args.threads, plan.ceiling_seconds / 4)
        report["products"][name] = {"label": STEP_SHAPES[name].label(), "ms": ms, "bound": float32["nanogpt"] / ms}
    rows += auto_rows
    if not args.skip_quality:
        rows += quality_rows(p, plan.quality_iters, bf16, rounds)
    for name in SAMPLE_SHAPES:
        note(f"sampling, {name} ...")
        rows.extend(sample_rows(p, name, plan, rounds))
    report["rows"] = rows
    return report


def checkout_problem(folder: Path) -> str | None:
    """Why folder cannot be used as a nanoGPT checkout, or None."""
    try:
        if not folder.is_dir():
            return f"--nanogpt: no such folder '{shown(str(folder))}'; {CLONE_HINT}"
        missing = [name for name in NANOGPT_FILES if not (folder / name).is_file()]
        if missing:
            return f"--nanogpt: '{shown(str(folder))}' is not a nanoGPT checkout (it has no {missing[0]}); {CLONE_HINT}"
        for name, mark in NANOGPT_MARKS.items():
            with open(folder / name, "rb") as f:  # a regular file: nanoGPT's are some kilobytes
                if mark not in f.read(1 << 20):
                    return (f"--nanogpt: '{shown(str(folder))}' is not a nanoGPT checkout (its {name} is not "
                            f"nanoGPT's: no '{mark.decode()}' in it); {CLONE_HINT}")
    except OSError as e:  # a name too long for the system, say: Path.is_dir raises it rather than answer False
        return f"--nanogpt: cannot use '{shown(str(folder))}' ({e.strerror or type(e).__name__}); give another folder"
    return None


def load_torch() -> None:
    """Import torch (seconds: the options are checked first), or leave with start_or_status's status: TORCH_LOGS=help
    prints torch's list of its logs and ends with 0, a TORCH_LOGS that names no log of torch's is one line and 2 (both
    were a traceback from inside torch's import, and 1)."""
    if (status := start_or_status(("torch",), "interrupted ({}) while starting; nothing was measured")) is not None:
        raise SystemExit(status)


def cuda_available() -> bool:
    load_torch()  # only for --gpu: the other options are checked before torch is imported
    import torch

    return torch.cuda.is_available()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    p = OneLineParser(prog="bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt", metavar="DIR", help=f"required: a nanoGPT checkout to measure against ({CLONE_HINT})")
    p.add_argument("--threads", type=int, default=threads, help=f"threads for both programs (default all: {threads})")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds per row (default 3; --quick 1)")
    p.add_argument("--skip-quality", action="store_true", help="skip the time-to-quality rows (minutes)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the results to this JSON file")
    p.add_argument("--quick", action="store_true", help="short step counts: a smoke test of every row")
    p.add_argument("--gpu", action="store_true",
                   help="on a CUDA GPU, only the time from launch to nanoGPT's best loss on its baby GPT (one round "
                        "unless --rounds; minutes: nanoGPT's whole run and four of tinychar's to its loss)")
    p.add_argument("--isa", choices=["native", *ISA_LIMITS], default="native",
                   help="avx2: keep both programs' libraries to AVX2, to measure as on a CPU without AVX-512 "
                        "(default native: all the CPU offers)")
    args = p.parse_args(argv)
    if not 1 <= args.threads <= MAX_THREADS:  # torch.set_num_threads(10**20) was a traceback
        p.error(f"--threads must be from 1 to {MAX_THREADS}, got {short_int(args.threads)}")
    if args.threads > THREADS_PER_CORE * (cores := cores_here()):  # else train.py refused it, once the run had begun
        p.error(f"--threads {args.threads} is more than {THREADS_PER_CORE} threads for each of the {cores} "
                f"core{'s' if cores > 1 else ''} this process may use, which train.py refuses; give at most "
                f"{THREADS_PER_CORE * cores}")
    if args.rounds is not None and args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {short_int(args.rounds)}")
    if args.gpu and not cuda_available():
        p.error("--gpu needs a CUDA GPU, and PyTorch finds none here; run without --gpu for the CPU rows")
    if args.gpu and args.isa != "native":
        p.error("--isa limits the CPU's libraries; it has no meaning with --gpu")
    if args.gpu and args.skip_quality:
        p.error("--gpu runs only the time-to-quality race, which --skip-quality leaves out; use one of them")
    if args.json is not None and (why := json_problem(args.json)) is not None:  # else found only at the end
        p.error(f"--json: {why}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if sys.stdout is None and not args.json:  # started with stdout closed (`>&-`): the table would go nowhere
        print("error: stdout is closed, and the table is written there; redirect it to a file (> bench.md) or give "
              "--json FILE", file=sys.stderr)
        return 2
    problem = checkout_problem(Path(args.nanogpt)) if args.nanogpt else f"--nanogpt DIR is required; {CLONE_HINT}"
    if not problem:  # TINYCHAR_ONEDNN, _GEMM and _SPLIT_STEP, read by the runs after the checkout is copied
        load_torch()  # not for a refusal that can do without it
        from model.linear import gemm_setting, onednn_min_macs
        from training.paired_step import split_setting

        try:
            onednn_min_macs()
            gemm_setting()
            split_setting()
        except ValueError as e:
            problem = str(e)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    limits = ISA_LIMITS.get(args.isa, {})
    if any(os.environ.get(k) != v for k, v in limits.items()):
        # torch reads these when it loads, and it is loaded: start again with them set (children inherit them)
        script = [str(Path(__file__).resolve()), *(sys.argv[1:] if argv is None else argv)]
        os.execve(sys.executable, [sys.executable, *script], {**os.environ, **limits})
    try:
        # SIGTERM (`timeout`, `kill`) as Ctrl-C: the program running now is stopped and the scratch folder (a copy of
        # nanoGPT and the runs) removed; before, both were left behind, the program training on for minutes.
        with InterruptSignals(), tempfile.TemporaryDirectory(prefix="tinychar-bench-") as scratch:
            report = measure(args, QUICK if args.quick else FULL, Path(scratch))
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Interrupted) as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        print(f"interrupted ({signal.Signals(signum).name}); nothing measured is printed", file=sys.stderr)
        return 128 + signum
    status = 0
    if args.json:  # first: a stdout that fails (`> /dev/full`, `| true`) must not lose the half hour's results
        try:
            write_json(args.json, json.dumps(plain(report), indent=2) + "\n")
        except OSError as e:  # a full disk, or a folder made read-only while the rows ran
            print(f"error: cannot write --json '{shown(args.json)}' ({e.strerror or e}); the table below holds the "
                  f"results", file=sys.stderr)
            status = 1
    try:
        print(markdown(report), flush=True)
    except OSError as e:  # BrokenPipeError among them: the reader went away
        discard_stdout()
        if not isinstance(e, BrokenPipeError):
            saved = f"; the results are in '{shown(args.json)}'" if args.json and not status else ""
            print(f"error: cannot write the table to stdout ({e.strerror or e}){saved}", file=sys.stderr)
            return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
