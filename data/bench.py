"""Benchmark of the streaming pipeline: preparation speed and memory, and the start of training on the result.

    python -m data.bench                        # a 100 MB corpus (a few minutes, most of it train.py)
    python -m data.bench --size-mb 1000 --json bench.json
    python data/bench.py --size-mb 2 --no-train  # the same, run by its path

A corpus of tiny Shakespeare repeated, with a slice of several thousand distinct CJK characters in the middle (so
ids are uint16), is generated in a new folder (in the temp folder, or in --workdir) with a 1 MB one of the same
vocabulary beside it. Each measurement of memory runs in a child process that reports its own peak resident memory
(VmHWM): preparing each corpus into a fresh cache, a second preparation (a cache hit), an in-process loop of get_batch
calls on the prepared ids (the memory claim checked without train.py), and train.py itself, timed from launch to its
first 'step N' line. The get_batch timings, which take no memory figure, share one child (--size-mb 2 --no-train on a
2-core Zen 1 EPYC: 31 s -> 22 s, with a child of its own for each of them and for preparing the ASCII corpus).
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    if not __package__:
        # run as a file (python data/bench.py): Python put data/ first on the path, where its modules would shadow
        # any of the same name (config, cache, paths) and 'data' itself cannot be imported; the project root instead
        sys.path[0] = str(Path(__file__).resolve().parents[1])
    # as train.py does, before the imports that fail on a Python older than tinychar needs or without a requirement
    # (NumPy here, PyYAML in the parser's configs): reads only sys and os
    from training.interpreter import missing_requirement, refuse_old_python

    refuse_old_python(__file__)

try:
    import numpy as np
except ModuleNotFoundError as e:
    if __name__ != "__main__" or missing_requirement(e) is None:
        raise
    print(missing_requirement(e), file=sys.stderr)
    sys.exit(2)

ROOT = Path(__file__).resolve().parents[1]
CJK_FIRST, N_CJK = 0x4E00, 6000  # CJK Unified Ideographs: 6000 distinct characters
_STEP_LINE = re.compile(rb"^step \d+")


def _parser() -> argparse.ArgumentParser:
    from configs.userinput import OneLineParser

    parser = OneLineParser(prog="python -m data.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=_positive, default=100, help="size of the big corpus in MB (1e6 bytes)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument(
        "--workdir",
        default=None,
        help="folder in which a new sub-folder holds the corpora and caches (default: the temp folder); "
        "nothing else in it is touched",
    )
    parser.add_argument("--keep", action="store_true", help="keep the bench's sub-folder afterwards")
    parser.add_argument("--no-train", action="store_true", help="skip the train.py runs")
    parser.add_argument("--train-script", default=str(ROOT / "train.py"), help="the train.py to run (default: ours)")
    parser.add_argument("--cold", action="store_true", help="drop the corpus from the page cache before preparing")
    parser.add_argument(
        "--train-memory-cap-gb",
        type=_positive,
        default=6.0,
        help=(
            "address-space limit for the train.py children, so a train.py that still reads the whole text into memory "
            "fails instead of exhausting the machine"
        ),
    )
    parser.add_argument("--child", nargs=3, metavar=("MODE", "CORPUS", "CACHE"), help=argparse.SUPPRESS)
    parser.add_argument("--train-child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.size_mb * 1e6 < (least := len(_cjk_slice(0)) + 2):
        parser.error(f"argument --size-mb: the corpus holds a CJK slice of {least - 2:,} bytes, so it must be at least "
                     f"{least / 1e6:g}")
    if args.child:
        from data.bench_children import child

        return child(*args.child)
    if args.train_child:
        _train_child(*args.train_child[:2], args.train_child[2:])
        return 0

    from configs.userinput import shown
    from data import DataError, shakespeare_path
    from data.bench_report import json_problem, table, write_json
    from training.signals import STOP_SIGNALS

    if args.json is not None and (why := json_problem(args.json)):
        parser.error(f"--json: {why}")  # before the run, not after it
    if args.workdir == "":
        parser.error("--workdir: '' is empty; give a folder, or leave --workdir out for the temp folder")
    if not args.no_train and not Path(args.train_script).is_file():
        parser.error(f"--train-script: no file '{shown(args.train_script)}'; give the path of a train.py")
    if sys.stdout is None and args.json is None:
        parser.error("stdout is closed, and the table is written there; redirect it, or give --json FILE")
    try:
        shakespeare = shakespeare_path().read_bytes()
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        work, made = _work_folder(args.workdir)
    except (OSError, RuntimeError) as e:  # RuntimeError: '~nouser', a home folder that cannot be found
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        print(f"error: --workdir: cannot make a folder in '{shown(args.workdir)}' ({why})", file=sys.stderr)
        return 2
    stopped: list[int] = []

    def stop(signum: int, frame: object) -> None:  # SIGTERM (and SIGHUP, a closed terminal) as Ctrl-C: the children
        stopped.append(signum)  # end, the sub-folder goes
        raise KeyboardInterrupt

    for sig in STOP_SIGNALS:  # SIGHUP among them unless started by nohup
        if sig != signal.SIGINT:
            signal.signal(sig, stop)
    try:
        # the corpus, its cached ids (up to 4 bytes a character) and the train.py runs' copies: measured, 20 MB of
        # disk for --size-mb 5
        if 4 * args.size_mb * 1e6 > (free := shutil.disk_usage(work).free):
            print(f"error: --size-mb {args.size_mb:g} needs about {4 * args.size_mb:,.0f} MB of disk, more than the "
                  f"{free / 1e6:,.0f} MB free in '{shown(work.parent)}'; ask for less, or give another --workdir",
                  file=sys.stderr)
            return 2
        results = _measure(args, work, shakespeare)
    except KeyboardInterrupt:
        signum = stopped[0] if stopped else signal.SIGINT
        print(f"interrupted ({signal.Signals(signum).name}); nothing measured is printed", file=sys.stderr)
        return 128 + signum
    finally:
        if not args.keep:
            # only what the bench made: a --workdir given may hold anything else (or be '.', or a home folder)
            shutil.rmtree(work, ignore_errors=True)
            for folder in made:
                try:
                    folder.rmdir()  # made for the bench, and now empty
                except OSError:
                    pass
    if args.keep:
        print(f"kept: '{shown(work)}'", file=sys.stderr)
    status = 0
    if args.json:  # first: a stdout that fails must not lose the figures
        try:
            write_json(args.json, json.dumps(results, indent=2) + "\n")
        except OSError as e:  # the table below is all there is of the figures then
            print(f"error: --json: cannot write '{shown(args.json)}' ({e.strerror or e})", file=sys.stderr)
            status = 1
    try:
        print(table(results), flush=True)
    except OSError as e:  # a full disk, or a reader gone (BrokenPipeError): quiet for that one
        try:  # what is still buffered goes to /dev/null at exit, not into a second failure
            fd = sys.stdout.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
        except (OSError, ValueError):  # a stdout of no descriptor
            pass
        if not isinstance(e, BrokenPipeError):
            print(f"error: cannot write the table to stdout ({e.strerror or e})", file=sys.stderr)
            return 1
    return status


def _positive(text: str) -> float:
    """argparse's type for --size-mb and --train-memory-cap-gb: a finite number above 0 (nan, inf and 0 were
    tracebacks once the bench had begun)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number, got '{text}'")
    return value


def _work_folder(workdir: str | None) -> tuple[Path, list[Path]]:
    """(work, made): a new folder of the bench's own inside workdir (or the temp folder), and the folders above it that
    did not exist and were made for it (innermost first), so that only these are ever removed."""
    # absolute: the training children run in the project's folder, and get the cache's path in their environment
    parent = Path(workdir).expanduser().absolute() if workdir else Path(tempfile.gettempdir())
    made = []
    for folder in (parent, *parent.parents):
        if folder.exists():
            if not folder.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))  # not "File exists"
            break
        made.append(folder)
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="tinychar-bench-", dir=parent)), made


def _measure(args: argparse.Namespace, work: Path, shakespeare: bytes) -> dict:
    """Every figure of the table, from corpora generated in work."""
    cache = work / "cache"
    results: dict = {"size_mb": args.size_mb, "workdir": str(work), "python": sys.version.split()[0]}
    big = _generate(work / "big" / "corpus.txt", int(args.size_mb * 1e6), shakespeare)
    small = _generate(work / "small" / "corpus.txt", 1_000_000, shakespeare)
    ascii_only = work / "ascii" / "corpus.txt"
    ascii_only.parent.mkdir(parents=True, exist_ok=True)
    ascii_only.write_bytes(shakespeare[:1_000_000])
    if args.cold:
        _evict(big)
    results["prepare"] = {
        "big": _run_child("prepare", big, cache),
        "big_again": _run_child("prepare", big, cache),
        "small": _run_child("prepare", small, cache),
    }
    results["batches"] = {"big": _run_child("batches", big, cache), "small": _run_child("batches", small, cache)}
    corpora = [(str(ascii_only), False), (str(small), False), (str(big), True)]  # the ASCII one prepared there
    results["get_batch_us"] = _run_child("timings", json.dumps(corpora), cache)["us"]
    if not args.no_train:
        cap = int(args.train_memory_cap_gb * 2**30)
        results["train"] = {
            "big": _train(args.train_script, big, cache, work / "run-big", cap),
            "small": _train(args.train_script, small, cache, work / "run-small", cap),
        }
    return results


def _generate(path: Path, size: int, shakespeare: bytes) -> Path:
    """size bytes of UTF-8: tiny Shakespeare repeated, with a CJK slice (1% of the size, every one of the N_CJK
    characters at least once) in the middle, 80 characters a line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    cjk = _cjk_slice(size)
    if size < len(cjk) + 2:
        raise ValueError(f"--size-mb is too small for the CJK slice of {len(cjk)} bytes")
    ascii_bytes = size - len(cjk)
    with path.open("wb") as f:
        _repeat(f, shakespeare, ascii_bytes // 2)
        f.write(cjk)
        _repeat(f, shakespeare, ascii_bytes - ascii_bytes // 2)
        f.flush()
        os.fsync(f.fileno())  # written out, so that --cold can drop it from the page cache
    return path


def _cjk_slice(size: int) -> bytes:
    """The CJK slice of a corpus of size bytes: every one of the N_CJK characters at least once, 1% of the size."""
    rng = np.random.default_rng(0)
    n_cjk = max(N_CJK, size // 100 // 3)
    codes = np.concatenate([rng.permutation(N_CJK), rng.integers(0, N_CJK, n_cjk - N_CJK)]) + CJK_FIRST
    lines = [codes[i : i + 80].astype("<u4").tobytes().decode("utf-32-le") for i in range(0, len(codes), 80)]
    return ("\n".join(lines) + "\n").encode("utf-8")


def _repeat(f, text: bytes, n_bytes: int) -> None:
    """Write text over and over, n_bytes in all (text is ASCII, so any cut is a character boundary)."""
    while n_bytes > 0:
        piece = text[:n_bytes]
        f.write(piece)
        n_bytes -= len(piece)


def _evict(path: Path) -> None:
    """Drop path's pages from the page cache, so that preparing it reads the disk (Linux; a no-op elsewhere)."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _run_child(mode: str, corpus: Path | str, cache: Path) -> dict:
    """Run this module's child mode in a fresh interpreter; its JSON result, with the wall time added."""
    command = [sys.executable, "-m", "data.bench", "--child", mode, str(corpus), str(cache)]
    start = time.perf_counter()
    proc = subprocess.run(command, check=False, cwd=ROOT, stdout=subprocess.PIPE)
    if proc.returncode:
        which = "" if mode == "timings" else f" for {corpus}"  # timings': a JSON list of every corpus
        raise SystemExit(f"error: the {mode} child{which} failed with status {proc.returncode}")
    result = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - start
    return result


def _train(script: str, corpus: Path, cache: Path, out_dir: Path, cap: int) -> dict:
    """train.py for 20 steps on corpus (already prepared): seconds from launch to its first step line, peak RSS."""
    overrides = [
        f"data.path={corpus}",
        "train.max_iters=20",
        "train.eval_interval=20",
        "train.eval_iters=2",
        f"out_dir={out_dir}",
        "train.tensorboard=false",
        "train.sample_chars=0",
        "train.log_interval=1",
    ]
    report = out_dir.with_suffix(".memory.json")
    command = [sys.executable, "-m", "data.bench", "--train-child", script, str(report), *overrides]
    env = {**os.environ, "TINYCHAR_CACHE_DIR": str(cache)}
    start = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err)
        try:
            # Set from outside rather than in preexec_fn (unsafe with threads); the child needs seconds to reach
            # the reading of its data, long before any limit matters.
            resource.prlimit(proc.pid, resource.RLIMIT_AS, (cap, cap))
            first_step = None
            for line in proc.stdout:
                if first_step is None and _STEP_LINE.match(line):
                    first_step = time.perf_counter() - start
            status = proc.wait()
        except BaseException:  # stopped (Ctrl-C, SIGTERM): the child goes too
            proc.kill()
            proc.wait()
            raise
        err.seek(0)
        tail = err.read().decode(errors="replace").strip().splitlines()[-1:]
    memory = json.loads(report.read_text()) if report.exists() else {}
    return {
        "first_step_s": first_step,
        "total_s": time.perf_counter() - start,
        "peak_rss_mb": memory.get("peak_mb"),
        "memory_at_exit": memory,
        "status": status,
        "error": tail[0] if status and tail else None,
    }


def _train_child(script: str, report: str, overrides: list[str]) -> None:
    """Run script (a train.py) as `python train.py overrides...` would, writing this process's memory at exit.

    The peak is read from /proc inside the process: getrusage of a child counts the parent's resident memory at
    fork time as well (Linux keeps the larger across exec), which would hide a small child behind a big parent.
    """
    import atexit
    import runpy

    from data.bench_children import memory

    atexit.register(lambda: Path(report).write_text(json.dumps(memory()), encoding="utf-8"))
    sys.argv = [script, *overrides]
    runpy.run_path(script, run_name="__main__")


# ---------------------------------------------------------------------------------------------- report


if __name__ == "__main__":  # the project's root is on the path (see the top)
    try:
        status = main()
    except ModuleNotFoundError as e:  # PyYAML, which the parser's configs import
        if missing_requirement(e) is None:
            raise
        print(missing_requirement(e), file=sys.stderr)
        status = 2
    sys.exit(status)
