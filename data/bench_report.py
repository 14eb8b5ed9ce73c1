"""data/bench.py's output: the table it prints, and the check of its --json file, made before the run."""

from __future__ import annotations

from benchmark import jsonfile


def json_problem(name: str) -> str | None:
    """Why the figures could not go to the file name (--json), in words, or None: bench.py's checks
    (benchmark/jsonfile.py), with a regular file replaced only when it holds an earlier result of this bench."""
    return jsonfile.json_problem(name, "data-bench.json", lambda data: {"size_mb", "workdir"} <= data.keys(),
                                 "an earlier result of this bench")


def write_json(name: str, text: str) -> None:
    """Write the figures to the file name: a regular file replaced whole, a pipe or a device written into."""
    jsonfile.write_json(name, text, json_problem)


def table(r: dict) -> str:
    """The figures as two markdown tables: per corpus, and get_batch timings."""
    p, b = r["prepare"], r["batches"]
    rows = [
        (
            "prepare, fresh cache: speed",
            *(f"{p[k]['mb_per_s']:.0f} MB/s ({p[k]['seconds']:.2f} s)" for k in ("big", "small")),
        ),
        ("prepare: peak RSS of the process", *(f"{p[k]['peak_rss_mb']:.0f} MB" for k in ("big", "small"))),
        ("prepare: RSS after imports (before)", *(f"{p[k]['rss_after_imports_mb']:.0f} MB" for k in ("big", "small"))),
        ("prepare again (cache hit)", f"{p['big_again']['seconds'] * 1e3:.0f} ms", ""),
        (
            "tokens, vocabulary, ids",
            *(f"{p[k]['n_tokens']:,}, {p[k]['vocab']}, {p[k]['dtype']}" for k in ("big", "small")),
        ),
        ("get_batch loop: prepare + first batch", *(f"{b[k]['first_batch_s'] * 1e3:.0f} ms" for k in ("big", "small"))),
        ("get_batch loop: peak RSS", *(f"{b[k]['peak_rss_mb']:.0f} MB" for k in ("big", "small"))),
        (
            "get_batch loop: RSS anon / file-backed",
            *(f"{b[k]['after_anon_mb']:.0f} / {b[k]['after_file_mb']:.0f} MB" for k in ("big", "small")),
        ),
    ]
    if "train" in r:
        runs = [r["train"]["big"], r["train"]["small"]]
        rows += [
            ("train.py: launch to first step", *(_first_step(t) for t in runs)),
            ("train.py: peak RSS", *(_mb(t["peak_rss_mb"]) for t in runs)),
            (
                "train.py: RSS anon / file-backed at exit",
                *(
                    f"{_mb(t['memory_at_exit'].get('anon_mb'))} / {_mb(t['memory_at_exit'].get('file_mb'))}"
                    for t in runs
                ),
            ),
        ]
    lines = [f"| measurement | {r['size_mb']:g} MB corpus | 1 MB corpus |", "|---|---|---|"]
    lines += [f"| {label} | {big} | {small} |" for label, big, small in rows]
    lines += ["", "| get_batch | µs per call |", "|---|---|"]
    lines += [f"| {name} | {us:.1f} |" for name, us in r["get_batch_us"].items()]
    return "\n".join(lines)


def _first_step(t: dict) -> str:
    if t["status"]:
        return f"failed (status {t['status']}: {t['error']})"
    if t["first_step_s"] is None:
        return "no 'step N' line printed"
    return f"{t['first_step_s']:.1f} s (20 steps: {t['total_s']:.1f} s)"


def _mb(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f} MB"
