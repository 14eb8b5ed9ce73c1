"""The speed rows, the programs alternating round by round: a training step, timed inside each program's run between
two of its step lines as they arrive; a sampled character, each program's whole process timed at two lengths and
differenced."""

from __future__ import annotations

import math
import statistics

from .runs import SAMPLE_SHAPES, STEP_SHAPES, Plan, Programs, note, per_unit


def median(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def compare(label: str, unit: str, nano: list[float], tiny: list[float]) -> dict:
    """A table row from per-round figures. The ratio is nanoGPT's time over tinychar's, so for a rate (chars/s) it is
    tinychar's figure over nanoGPT's; spread is the lowest and highest of the per-round ratios."""

    def ratio(n: float, t: float) -> float:
        a, b = (t, n) if unit.endswith("/s") else (n, t)
        return a / b if math.isfinite(a) and math.isfinite(b) and b > 0 else math.nan

    rounds = [r for r in (ratio(n, t) for n, t in zip(nano, tiny, strict=True)) if math.isfinite(r)]
    return {"label": label, "unit": unit, "nanogpt": median(nano), "tinychar": median(tiny),
            "ratio": ratio(median(nano), median(tiny)),
            "spread": [min(rounds), max(rounds)] if len(rounds) > 1 else None,
            "rounds": {"nanogpt": nano, "tinychar": tiny}}


def step_rows(p: Programs, name: str, plan: Plan, rounds: int, bf16: bool) -> list[dict]:
    """ms per training step of one shape, float32 for both; with bf16, tinychar's train.dtype=auto as well."""
    shape = STEP_SHAPES[name]
    tiny = {"eager": ["train.dtype=float32", "train.compile=false"],
            "compiled": ["train.dtype=float32", "train.compile=true"]}
    if bf16:
        tiny["auto"] = ["train.dtype=auto", "train.compile=true"]
    # a run of `last` steps, logging every `first`: timed from the line at `first` steps to the one at `last`
    contenders = {"nanoGPT": lambda first, last: p.nanogpt("train.py", shape.nanogpt(last, first))}
    for who, extra in tiny.items():
        contenders[who] = lambda first, last, extra=extra: p.tinychar("train.py",
                                                                      [*shape.tinychar(last, first), *extra])
    lengths = {who: plan.steps[name] if who in ("nanoGPT", "eager") else plan.compiled_steps[name]
               for who in contenders}
    for who, go in contenders.items() if plan.warm_up else ():
        note(f"  warm-up: {who}")
        first, _ = lengths[who]
        go(first, first)
    ms: dict[str, list[float]] = {who: [] for who in contenders}
    for r in range(rounds):
        note(f"  round {r + 1}/{rounds}")
        for who, go in contenders.items():
            first, last = lengths[who]
            ms[who].append(1e3 * go(first, last).seconds_per_step(first))
    label = f"train step, {shape.label()}"
    if name == "block64":
        label += " (nanoGPT's CPU config)"
    rows = [compare(f"{label}, float32, tinychar eager (train.compile=false)", "ms/step", ms["nanoGPT"], ms["eager"]),
            compare(f"{label}, float32, tinychar compiled (train.compile=true)", "ms/step", ms["nanoGPT"],
                    ms["compiled"])]
    if bf16:
        rows.append(compare(f"{label}, tinychar compiled with train.dtype=auto (bfloat16 from n_embd 128)", "ms/step",
                            ms["nanoGPT"], ms["auto"]))
    return rows


def sample_rows(p: Programs, name: str, plan: Plan, rounds: int) -> list[dict]:
    """Characters per second of one sample stream with each program's sample.py, from a checkpoint of the shape."""
    shape, (m1, m2) = SAMPLE_SHAPES[name], plan.chars
    nano_out, tiny_out = p.fresh("nanogpt-out"), p.fresh("tinychar-out")
    # Two steps make a checkpoint of the shape (its weights do not change the speed); nanoGPT saves only at an
    # evaluation after step 0, and only an improved one unless always_save_checkpoint.
    p.nanogpt("train.py", [*shape.nanogpt(2), "--eval_interval=2", "--always_save_checkpoint=True"], out_dir=nano_out)
    p.tinychar("train.py", shape.tinychar(2), out_dir=tiny_out)
    # One sample at temperature 0.8, each program's default top-k (nanoGPT 200, tinychar none) and context handling.
    contenders = {
        "nanoGPT": lambda m: p.nanogpt("sample.py", [
            f"--out_dir={nano_out}", "--device=cpu", "--dtype=float32", "--compile=False", "--num_samples=1",
            f"--max_new_tokens={m}", "--temperature=0.8", "--seed=1337"]),
    }
    for who, compile_ in (("tinychar", "auto"), ("compiled", "true")):
        contenders[who] = lambda m, compile_=compile_: p.tinychar("sample.py", [
            "--out-dir", str(tiny_out), "--device", "cpu", "--num-samples", "1", "--max-new-tokens", str(m),
            "--temperature", "0.8", "--seed", "1337", "--compile", compile_])
    lengths = {who: plan.compiled_chars if who == "compiled" else (m1, m2) for who in contenders}
    for go in contenders.values() if plan.warm_up else ():
        go(m1)
    rate: dict[str, list[float]] = {who: [] for who in contenders}
    for r in range(rounds):
        note(f"  round {r + 1}/{rounds}")
        seconds = {(who, i): go(lengths[who][i]).seconds for i in (0, 1) for who, go in contenders.items()}
        for who in contenders:
            rate[who].append(1 / per_unit(seconds[who, 0], seconds[who, 1], *lengths[who]))
    label = (f"sampling, one stream, exact context, block {shape.block_size}, "
             f"{shape.n_layer}L/{shape.n_head}H/{shape.n_embd}")
    return [compare(f"{label}, tinychar's default (--compile auto)", "chars/s", rate["nanoGPT"], rate["tinychar"]),
            compare(f"{label}, tinychar --compile true", "chars/s", rate["nanoGPT"], rate["compiled"])]
