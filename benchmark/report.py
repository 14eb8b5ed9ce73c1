"""The results: the markdown table the README shows, and the --json file (checked before the rows run, replaced
whole when they are done)."""

from __future__ import annotations

import math
from pathlib import Path

from . import jsonfile
from .runs import CPU_FLAGS, ISA_LIMITS


def cell(value: float, unit: str) -> str:
    if not math.isfinite(value):
        return "n/a"
    return {"ms/step": f"{value:.2f}", "chars/s": f"{value:,.0f}"}.get(unit, f"{value:.1f}")


def ratio_cell(value: float | None) -> str:
    """A ratio as the table prints it; n/a where it could not be measured (NaN, or None as JSON holds it)."""
    return f"{value:.2f}x" if value is not None and math.isfinite(value) else "n/a"


NOTES = ("Ratio: nanoGPT's time over tinychar's (above 1: tinychar is faster); spread: the lowest and highest ratio of "
         "the rounds. Training steps: inside one run of each program's train.py, the time between two of the step "
         "lines it logs, as they arrive (from the line at the first logged step count to the last), so start-up, "
         "data loading, compilation and the closing evaluation are left out. Sampling: whole-process wall time of "
         "each program's sample.py at two lengths, differenced, so start-up and compilation cancel (tinychar's "
         "compiled runs are longer, so that the few seconds' noise of a compile from the cache cancels too). One "
         "warm-up run of each goes first. "
         "nanoGPT runs with compile=False, as its README's CPU command; tinychar with its config's defaults, but for "
         "what the row names. Time to quality: from launch to the evaluation line, as the line arrives, the programs "
         "alternating over the rounds, nanoGPT's first run setting the target that every round times it to; tinychar's "
         "empty-cache run starts with a fresh cache folder, the repeated run reuses it once the helper that the first "
         "run may leave has warmed it (training.warm; it starts when the run has ended); nanoGPT's data is prepared "
         "beforehand.")

GPU_NOTES = ("Ratio: nanoGPT's time over tinychar's (above 1: tinychar is faster); spread: the lowest and highest "
             "ratio of the rounds. --gpu: time from launch to the evaluation line, as the line arrives. nanoGPT runs "
             "its baby GPT recipe as its README does on a GPU (compile=True, bfloat16), and its first run sets the "
             "targets: its best val, and its first val within 2% of that (the best lies where runs differ by "
             "chance; the curves still fall steeply there); tinychar runs configs/shakespeare_char.yaml as it is "
             "(compile: true, dtype auto: bfloat16) and with train.compile=false, each from a fresh cache folder and "
             "again with that folder as the first run left it, each stopped at the lower target.")


def markdown(report: dict) -> str:
    """The report as the README shows it: a header line, the matmul ceiling, the table, and how it was measured."""
    flags = ", ".join(report["cpu_flags"]) or "none of " + ", ".join(CPU_FLAGS)
    limits = ISA_LIMITS.get(report.get("isa"))
    lines = [f"tinychar vs nanoGPT, {report['date']}: {report['cpu']} ({flags}), {report['cores']} cores, "
             f"torch {report['torch']}, {report['threads']} threads, rounds: {report['rounds']}"
             + (f"; limited to {report['isa'].upper()} (" + ", ".join(f"{k}={v}" for k, v in limits.items()) + ")"
                if limits else "")
             + (f"; GPU: {report['gpu']}" if report.get("gpu") else "")
             + (" (--quick: smoke-test lengths, not figures to quote; n/a: the longer run was not the slower, the "
                "difference lost in the machine's noise, or a training run logged too few steps)"
                if report.get("quick") else ""), ""]
    if "matmul_gflops" in report:
        c = report["matmul_gflops"]
        ceiling = f"float32 {c['float32']:.0f} GFLOP/s, bfloat16 {c['bfloat16']:.0f} GFLOP/s"
        if "float32_onednn" in c:
            ceiling += f"; float32 through oneDNN {c['float32_onednn']:.0f} GFLOP/s"
        lines += [f"Matmul ceiling (1024x1024): {ceiling}.", ""]
    if report.get("products"):
        parts = [f"{p['label']} {p['ms']:.2f} ms ({ratio_cell(p['bound'])})" for p in report["products"].values()]
        lines += ["Float32 linear products of one training step, each timed alone through PyTorch's default BLAS, and "
                  "nanoGPT's float32 step over them, the most a step on that BLAS can gain on it: "
                  + "; ".join(parts) + ".", ""]
    lines += ["| measure | unit | nanoGPT | tinychar | ratio | spread |", "|---|---|---:|---:|---:|---:|"]
    for row in report["rows"]:
        tiny = cell(row["tinychar"], row["unit"])
        if "target" in row and not math.isfinite(row["tinychar"]):
            tiny = f"not reached (best {row['tinychar_best']:.4f})"
        ratio = ratio_cell(row["ratio"])
        spread = f"{row['spread'][0]:.2f}-{row['spread'][1]:.2f}x" if row["spread"] else "-"
        lines.append(f"| {row['label']} | {row['unit']} | {cell(row['nanogpt'], row['unit'])} | {tiny} | {ratio} | "
                     f"{spread} |")
    said = engines_line(report["rows"])
    return "\n".join([*lines, "", *([said, ""] if said else []), GPU_NOTES if report.get("gpu") else NOTES])


def engines_line(rows: list[dict]) -> str | None:
    """What each of tinychar's race runs trained with, round by round, as its train.py said (its "engine:" line),
    once for each config and when; None for a report without races (or from before bench.py kept them)."""
    seen: dict[str, list[str]] = {}
    for row in rows:
        if row.get("tinychar_engines") and row.get("runs"):
            seen.setdefault(row["runs"], row["tinychar_engines"])
    if not seen:
        return None
    parts = [f"{runs}: " + (f"{engines[0]} in all {len(engines)}" if len(engines) > 1 and len(set(engines)) == 1
                            else ", ".join(engines)) for runs, engines in seen.items()]
    return "tinychar's engine in the races' runs, round by round, as train.py said: " + "; ".join(parts) + "."


def plain(value: object) -> object:
    """value with NaN as None, which JSON can hold."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def json_problem(name: str) -> str | None:
    """Why the results could not be written to the file name (--json), in words, or None."""
    return jsonfile.json_problem(name, "bench.json", _is_result, "an earlier bench.py result")


def _is_result(data: dict) -> bool:
    return {"cpu_flags", "rows"} <= data.keys()


def is_bench_result(path: Path) -> bool:
    """Whether the regular file at path holds what --json wrote before (a file --json may replace)."""
    return jsonfile.holds_result(path, _is_result)


def write_json(name: str, text: str) -> None:
    """Write the results to the file name (benchmark/jsonfile.py's write_json)."""
    jsonfile.write_json(name, text, json_problem)
