"""The time-to-quality rows: from launch to the validation loss nanoGPT's own run reaches, tinychar from empty caches
and again, on the CPU reference runs or (--gpu) nanoGPT's baby GPT."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

from .runs import NANOGPT_CPU_RUN, BenchError, Eval, Programs, Run, note
from .speed import compare


def nanogpt_flags(cfg: dict) -> list[str]:
    """nanoGPT flags for the model, batch, schedule and evaluation a tinychar YAML config describes. nanoGPT takes
    a value only of the type of its default, hence the conversions; keys the file leaves out keep nanoGPT's own."""
    values = {**cfg.get("model", {}), **cfg.get("train", {})}
    if values.get("lr_decay_iters") is None:  # tinychar's null: decay over the whole run
        values["lr_decay_iters"] = values["max_iters"]
    kinds = {int: ("block_size", "n_layer", "n_head", "n_embd", "batch_size", "max_iters", "lr_decay_iters",
                   "warmup_iters", "eval_interval", "eval_iters", "log_interval"),
             float: ("dropout", "learning_rate", "min_lr", "weight_decay", "beta2", "grad_clip"), bool: ("bias",)}
    return [f"--{key}={kind(values[key])!r}" for kind, keys in kinds.items() for key in keys if key in values]


# nanoGPT's block-8 reference run: tiny.yaml's model, trained with the recipe tiny.yaml had when nanoGPT was first
# measured against it (batch 256, 1300 steps, lr 1.2e-2; its best val is about 1.94). Fixed here, so that tuning
# tiny.yaml for time to quality moves only tinychar's side of the comparison.
NANOGPT_BLOCK8_RUN = {
    "model": {"block_size": 8, "n_layer": 3, "n_head": 4, "n_embd": 64, "dropout": 0.0, "bias": True},
    "train": {"batch_size": 256, "max_iters": 1300, "learning_rate": 1.2e-2, "min_lr": 1.2e-3, "warmup_iters": 100,
              "weight_decay": 0.1, "beta2": 0.99, "grad_clip": 1.0, "eval_interval": 325, "eval_iters": 8,
              "log_interval": 100},
}


# What a race times the programs to: a function that picks the target evaluation from nanoGPT's first run, and the
# row's words for it ("{step}": that evaluation's step).
Goal = tuple[Callable[[list[Eval]], Eval], str]
WHENS = ("empty caches", "repeated run")


def nanogpt_best(evals: list[Eval]) -> Eval:
    return min(evals, key=lambda e: e[2])


def nanogpt_final(evals: list[Eval]) -> Eval:
    return evals[-1]


# The GPU race's second target: the best loss lies at the bottom of both programs' curves, where a run's evaluations
# differ by a few thousandths from one run to the next, so whether a run gets below it at all is partly chance (H100,
# 2026-11-26: tinychar's four runs' best 1.4648-1.4698 against nanoGPT's 1.4674). Within 2% of it the curves still
# fall by about 0.01-0.06 an evaluation, so the time to it measures speed rather than luck.
NEAR_BEST = 0.02


def nanogpt_near_best(evals: list[Eval]) -> Eval:
    """nanoGPT's first evaluation within NEAR_BEST of its best val."""
    bar = (1 + NEAR_BEST) * nanogpt_best(evals)[2]
    return next(e for e in evals if e[2] <= bar)


def quality_rows(p: Programs, iters: int | None, bf16: bool = False, rounds: int = 1) -> list[dict]:
    """Time from launch to nanoGPT's best val on the block-8 reference run, and to its final val on its README's CPU
    run: nanoGPT's first run sets each target, then tinychar runs the matching config with its defaults, from empty
    caches and again; with rounds, the two programs alternate, each round timing nanoGPT to the same target. With
    bf16 (where the CPU config's dtype=auto trains in bfloat16), the CPU config in float32 as well."""
    common = ["--device=cpu", "--compile=False", "--dtype=float32", "--always_save_checkpoint=False",
              "--wandb_log=False"]
    block8 = ["config/train_shakespeare_char.py", *common, *nanogpt_flags(NANOGPT_BLOCK8_RUN)]
    what = "nanoGPT's best (step {step}) training tiny.yaml's model, block 8"
    rows = race(p, "nanoGPT on tiny.yaml's model, the reference recipe", [*block8, *shortened(iters, "--{}={}")],
                [(nanogpt_best, what)], [("configs/tiny.yaml", [], "")], iters, rounds)
    in_float32 = ", tinychar in float32 (train.dtype=float32)"
    float32 = [("configs/shakespeare_char_cpu.yaml", ["train.dtype=float32"], in_float32)] if bf16 else []
    rows += race(p, "nanoGPT's CPU config", [*NANOGPT_CPU_RUN, *shortened(iters, "--{}={}")],
                 [(nanogpt_final, "nanoGPT's final (step {step}) on its CPU config, block 64")],
                 [("configs/shakespeare_char_cpu.yaml", [], ""), *float32], iters, rounds)
    return rows


def gpu_quality_rows(p: Programs, iters: int | None, rounds: int = 1) -> list[dict]:
    """--gpu: time from launch to nanoGPT's best val on its baby GPT recipe (config/train_shakespeare_char.py, as its
    README runs it on a GPU: compiled, bfloat16), and to its first val within NEAR_BEST of that, against
    configs/shakespeare_char.yaml as it is (compiled) and trained eagerly, each from empty caches and repeated."""
    nano = ["config/train_shakespeare_char.py", "--always_save_checkpoint=False", "--wandb_log=False",
            *shortened(iters, "--{}={}")]
    contenders = [("configs/shakespeare_char.yaml", [], ""),
                  ("configs/shakespeare_char.yaml", ["train.compile=false"], ", tinychar eager (train.compile=false)")]
    where = "on its baby GPT, block 256, on the GPU"
    goals = [(nanogpt_best, f"nanoGPT's best (step {{step}}) {where}"),
             (nanogpt_near_best, f"nanoGPT's first within {NEAR_BEST:.0%} of its best (step {{step}}) {where}")]
    return race(p, "nanoGPT's baby GPT on the GPU", nano, goals, contenders, iters, rounds, device="cuda")



def race(p: Programs, name: str, nano_args: list[str], goals: list[Goal], contenders: list[tuple[str, list[str], str]],
         iters: int | None, rounds: int, device: str = "cpu") -> list[dict]:
    """Rows for each goal and each tinychar (config, overrides, label suffix) in contenders reaching the val that the
    goal picks from nanoGPT's first run, from empty caches and repeated, over rounds that alternate the two programs:
    nanoGPT's time in each round is when that round's run first reached the target. tinychar's runs stop at the
    lowest target; the others are read from the same runs' evaluations."""
    nano: dict[int, list[float]] = {}
    tiny: dict[tuple[int, int, str], list[float]] = {}
    engines: dict[tuple[int, str], list[str]] = {}  # (contender, when): the engine of each round's run
    best: dict[tuple[int, int, str], float] = {}
    targets: list[Eval] = []
    for r in range(rounds):
        note(f"time to quality: {name}, round {r + 1}/{rounds} ...")
        evals = evaluations(p.nanogpt("train.py", nano_args))
        if r == 0:
            targets = [pick(evals) for pick, _ in goals]
        for g, (_, _, target) in enumerate(targets):
            nano.setdefault(g, []).append(first_at(evals, target))
        lowest = min(val for _, _, val in targets)
        for i, (config, extra, _) in enumerate(contenders):
            for when, run, engine in tinychar_to(p, config, lowest, iters, extra, device):
                engines.setdefault((i, when), []).append(engine or "unknown")
                low = min((val for _, _, val in run), default=math.nan)
                for g, (_, _, target) in enumerate(targets):
                    tiny.setdefault((g, i, when), []).append(first_at(run, target))
                    best[g, i, when] = min(best.get((g, i, when), math.inf), low)
    rows = []
    for g, i, when in sorted(tiny, key=lambda k: (k[0], k[1], WHENS.index(k[2]))):
        _, step, target = targets[g]
        label = f"launch to val <= {target:.4f}, {goals[g][1].format(step=step)}{contenders[i][2]}; tinychar {when}"
        rows.append({**compare(label, "s", nano[g], tiny[g, i, when]), "target": target,
                     "tinychar_best": best[g, i, when], "tinychar_engines": engines[i, when],
                     "runs": f"{Path(contenders[i][0]).name}{contenders[i][2].replace(', tinychar ', ' ')}, {when}"})
    return rows


def first_at(evals: list[Eval], target: float) -> float:
    """Seconds from launch to the first evaluation at or below target; NaN if none got there."""
    return next((t for t, _, val in evals if val <= target), math.nan)


def wait_for_helpers(cache: Path, limit: float = 600.0) -> None:
    """Wait until no helper left by a run (training.warm) is still compiling into the cache folder: a repeated run,
    as a person starts it later, finds the cache as the helper leaves it."""
    start = time.perf_counter()
    while any(cache.glob("tinychar/compiled/*/tinychar-*.warming")) and time.perf_counter() - start < limit:
        time.sleep(0.5)
    if time.perf_counter() - start > 1:
        note(f"  the compile cache's helper finished {time.perf_counter() - start:.0f} s after the run")


def shortened(iters: int | None, form: str) -> list[str]:
    """--quick's short quality runs: max_iters, lr_decay_iters, eval_interval and warmup_iters, each written as form
    says. The configs' 100-step warmups would outlast such a run, and leave the learning rate near zero throughout."""
    if iters is None:
        return []
    return [form.format(k, v) for k, v in (("max_iters", iters), ("lr_decay_iters", iters),
                                           ("eval_interval", max(1, iters // 2)), ("warmup_iters", iters // 10))]


def evaluations(run: Run) -> list[Eval]:
    if not run.evals:
        raise BenchError("nanoGPT's train.py printed no evaluation line")
    return run.evals


def tinychar_to(p: Programs, config: str, target: float, iters: int | None, extra: list[str],
               device: str = "cpu") -> list[tuple[str, list[Eval], str | None]]:
    """tinychar's config (with the overrides in extra) run to val <= target from empty caches, then repeated: (when,
    the run's evaluations, the engine it said it trained with) for each."""
    cache, out = p.fresh("cache"), []
    for when in WHENS:
        if when == "repeated run":
            wait_for_helpers(cache)
        note(f"time to quality: tinychar {config}, {when} ...")
        # --quick: tinychar may take three times nanoGPT's steps, evaluating as often (it stops at the target): a
        # config tuned for its full length (tiny.yaml's weight average spans ~100 steps) lags in so short a race,
        # which would leave the row "not reached" on any machine and so test nothing.
        quick = [] if iters is None else [f"train.max_iters={3 * iters}", f"train.lr_decay_iters={3 * iters}",
                                          f"train.eval_interval={iters // 2}", f"train.warmup_iters={iters // 10}"]
        run = p.tinychar("train.py", ["--config", config, f"train.device={device}", *quick, *extra], cache=cache,
                         stop_at=target)
        out.append((when, run.evals, run.engine))
    return out
