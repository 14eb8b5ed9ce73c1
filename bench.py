"""Measure tinychar's speed on this machine, next to a nanoGPT-style reference loop run in the same process.

    python bench.py                       # ~2 minutes: matmul ceilings, training steps, sampling, eval share
    python bench.py --time-to-quality     # also train the CPU configs to their target losses (a few minutes)
    python bench.py --json bench.json

The reference loop does a training step the way nanoGPT does on a CPU: a Python loop that slices one window per
batch row, PyTorch's fused attention kernel, the default (for-each) AdamW, float32. The tinychar loop is what
``train.py`` runs with the config's defaults. Both train the same model on the same data with the same batch,
and rounds of the two alternate, so machine noise falls on both alike; the ratio is the number to read.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from data import CharTokenizer, DataConfig, load_corpus, split_ids
from model import GPT, GPTConfig
from training import RunConfig, TrainConfig, load_config, run
from training.devices import matmul_ceiling, resolve_dtype
from training.loop import Trainer
from training.optim import make_optimizer

# nanoGPT's figures measured on the 2-core machine this project is developed on (torch 2.13 CPU, 2 threads)
NANOGPT_REFERENCE = {
    "block8": {"ms_per_step": 3.92, "tokens_per_s": 65_400},
    "block64": {"ms_per_step": 31.5, "tokens_per_s": 24_400, "seconds_to_1.886": 68.0},
    "sampling_chars_per_s": 723,
}

ROWS = {
    "block8": {"block_size": 8, "batch_size": 32, "n_layer": 3, "n_head": 4, "n_embd": 32},
    "block64": {"block_size": 64, "batch_size": 12, "n_layer": 4, "n_head": 4, "n_embd": 128},
}


def time_it(fn: Callable[[], object], repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def matmul_ceilings(seconds: float = 1.5) -> dict[str, float]:
    """GFLOP/s of a 1024x1024 matrix multiply, best of many: float32 as PyTorch runs it by default, and bfloat16."""
    cpu = torch.device("cpu")
    return {name: matmul_ceiling(cpu, dtype, seconds) / 1e9
            for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}


class Loop:
    """One training setup: model, optimizer, batches, and a step function. The tinychar loop is train.py's own
    Trainer.train_step; the nanoGPT-style one is written out here, as nanoGPT's train.py does it."""

    def __init__(self, name: str, row: dict, train_ids: torch.Tensor, vocab: int, nanogpt_style: bool,
                 dtype: torch.dtype = torch.float32) -> None:
        torch.manual_seed(0)
        self.name, self.row = name, row
        self.cfg = GPTConfig(vocab_size=vocab, block_size=row["block_size"], n_layer=row["n_layer"],
                             n_head=row["n_head"], n_embd=row["n_embd"], bias=False,
                             attention="fused" if nanogpt_style else "manual")
        self.model = GPT(self.cfg)
        self.data, self.dtype = train_ids, dtype
        self.gen = torch.Generator().manual_seed(0)
        cpu = torch.device("cpu")
        if nanogpt_style:
            groups = [{"params": [p for p in self.model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                      {"params": [p for p in self.model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
            self.optimizer = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99))
            self.step = self._nanogpt_step
        else:
            run_cfg = RunConfig(model=self.cfg, train=TrainConfig(batch_size=row["batch_size"], warmup_iters=0))
            self.optimizer = make_optimizer(self.model, run_cfg.train, cpu)
            trainer = Trainer(run_cfg, self.model, self.optimizer, {"train": train_ids}, device=cpu, dtype=dtype,
                              gen=self.gen)
            self.step = trainer.train_step

    def _loop_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        T, B = self.row["block_size"], self.row["batch_size"]
        starts = torch.randint(len(self.data) - T, (B,), generator=self.gen)
        x = torch.stack([self.data[i : i + T] for i in starts.tolist()])
        y = torch.stack([self.data[i + 1 : i + 1 + T] for i in starts.tolist()])
        return x, y

    def _nanogpt_step(self) -> None:
        x, y = self._loop_batch()
        _, loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def bench_training(train_ids: torch.Tensor, vocab: int, rounds: int, steps: int,
                   ceilings: dict[str, float]) -> list[dict]:
    results = []
    for row_name, row in ROWS.items():
        tiny_dtype = resolve_dtype("auto", torch.device("cpu"), row["n_embd"])
        loops = [Loop("nanoGPT-style", row, train_ids, vocab, nanogpt_style=True),
                 Loop("tinychar", row, train_ids, vocab, nanogpt_style=False, dtype=tiny_dtype)]
        for loop in loops:
            for _ in range(10):
                loop.step()
        times: dict[str, list[float]] = {loop.name: [] for loop in loops}
        n = max(3, steps if row["block_size"] <= 8 else steps // 8)
        for _ in range(rounds):
            for loop in loops:
                times[loop.name].append(time_it(loop.step, n))
        for loop in loops:
            sec = statistics.median(times[loop.name])
            tokens = row["batch_size"] * row["block_size"]
            ceiling = ceilings["bfloat16" if loop.dtype == torch.bfloat16 else "float32"]
            results.append({
                "row": row_name, "loop": loop.name, "ms_per_step": sec * 1e3, "tokens_per_s": tokens / sec,
                "mfu": loop.model.flops_per_token() * tokens / sec / (ceiling * 1e9),
                "dtype": str(loop.dtype).replace("torch.", ""),
            })
    return results


def bench_sampling(vocab: int, n_chars: int) -> dict[str, float]:
    """Characters per second from the block-64 model (one sample): full recompute per character, the KV cache
    with the window sliding by one character (then every character past block_size recomputes the window), and
    the KV cache with the window jumping back to its last half when full."""
    row = ROWS["block64"]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=row["block_size"], n_layer=row["n_layer"],
                          n_head=row["n_head"], n_embd=row["n_embd"], bias=False)).eval()
    prompt = torch.zeros(1, 1, dtype=torch.long)
    out = {}
    half = row["block_size"] // 2
    ways = (("no_cache", False, None), ("kv_cache", True, None), ("kv_cache_keep_half", True, half))
    for name, use_cache, keep in ways:
        gen = torch.Generator().manual_seed(0)
        model.generate(prompt, 20, generator=gen, use_cache=use_cache, keep=keep)
        start = time.perf_counter()
        model.generate(prompt, n_chars, generator=gen, use_cache=use_cache, keep=keep)
        out[name] = n_chars / (time.perf_counter() - start)
    return out


def bench_eval_share() -> dict[str, float]:
    """Share of a default tiny.yaml run's wall time spent evaluating, logging samples and saving (~30 s)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config("configs/tiny.yaml", [f"out_dir={tmp}"])
        stats = run(cfg, progress=False)
    return {"eval_seconds": stats["eval_seconds"], "total_seconds": stats["seconds"],
            "eval_share": stats["eval_seconds"] / stats["seconds"]}


def time_to_quality() -> list[dict]:
    """Train the CPU configs and record the wall time when validation first reaches the target."""
    out = []
    for config, target in (("configs/tiny.yaml", 1.93), ("configs/shakespeare_char_cpu.yaml", 1.886)):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(config, [f"out_dir={tmp}", "train.tensorboard=false"])
            stats = run(cfg, progress=False)
        reached = next((t for t, v in stats["val_history"] if v <= target), None)
        out.append({"config": config, "target": target, "final_val": stats["val"], "seconds": stats["seconds"],
                     "seconds_to_target": reached})
    return out


def markdown(report: dict) -> str:
    title = (f"tinychar benchmark, {report['date']}, {report['machine']}, torch {report['torch']}, "
             f"{report['threads']} threads")
    lines = [title, ""]
    c = report["matmul_gflops"]
    lines += ["| matmul ceiling (1024x1024) | GFLOP/s |", "|---|---|",
              f"| float32 | {c['float32']:.0f} |", f"| bfloat16 | {c['bfloat16']:.0f} |", ""]
    lines += [("| training step | loop | dtype | ms/step | tokens/s | MFU | vs nanoGPT-style loop "
               "| vs nanoGPT's figure |"),
              "|---|---|---|---|---|---|---|---|"]
    base = {r["row"]: r for r in report["training"] if r["loop"] == "nanoGPT-style"}
    for r in report["training"]:
        ratio = r["tokens_per_s"] / base[r["row"]]["tokens_per_s"]
        figure = r["tokens_per_s"] / NANOGPT_REFERENCE[r["row"]]["tokens_per_s"]
        lines.append(f"| {r['row']} | {r['loop']} | {r['dtype']} | {r['ms_per_step']:.2f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {ratio:.2f}x | {figure:.2f}x |")
    s = report["sampling_chars_per_s"]
    lines += ["", "| sampling, block-64 model | characters/s |", "|---|---|",
              f"| full recompute per character | {s['no_cache']:,.0f} |",
              f"| KV cache, window slides by one (exact last-block_size context) | {s['kv_cache']:,.0f} |",
              ("| KV cache, window jumps keeping the last half (`keep=block_size/2`) | "
               f"{s['kv_cache_keep_half']:,.0f} |"),
              f"| nanoGPT (reference figure) | {NANOGPT_REFERENCE['sampling_chars_per_s']:,} |"]
    if "eval" in report:
        e = report["eval"]
        share = (f"Evaluation: {e['eval_seconds']:.2f} s of a {e['total_seconds']:.1f} s tiny.yaml run = "
                 f"{e['eval_share']:.1%}.")
        lines += ["", share]
    for q in report.get("time_to_quality", []):
        reached = f"{q['seconds_to_target']:.1f} s" if q["seconds_to_target"] is not None else "not reached"
        lines.append(f"Time to quality: {q['config']} reached val <= {q['target']} at {reached} "
                     f"(run {q['seconds']:.1f} s, final val {q['final_val']:.4f}).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all cores)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating measurement rounds per row")
    parser.add_argument("--steps", type=int, default=100, help="training steps per round at block 8")
    parser.add_argument("--sample-chars", type=int, default=500, help="characters per sampling measurement")
    parser.add_argument("--time-to-quality", action="store_true", help="also train the CPU configs to target")
    parser.add_argument("--no-eval-share", action="store_true", help="skip the eval-share run (~30 s)")
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    text, _ = load_corpus(DataConfig(dataset="shakespeare_char"))
    tok = CharTokenizer.from_text(text)
    train_ids, _ = split_ids(tok.encode_tensor(text), 0.1, 64)
    report = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores", "torch": torch.__version__, "threads": args.threads,
              "nanogpt_reference": NANOGPT_REFERENCE}
    print("matmul ceilings ...", file=sys.stderr)
    report["matmul_gflops"] = matmul_ceilings()
    print("training steps ...", file=sys.stderr)
    report["training"] = bench_training(train_ids, tok.vocab_size, args.rounds, args.steps, report["matmul_gflops"])
    print("sampling ...", file=sys.stderr)
    report["sampling_chars_per_s"] = bench_sampling(tok.vocab_size, args.sample_chars)
    if not args.no_eval_share:
        print("eval share ...", file=sys.stderr)
        report["eval"] = bench_eval_share()
    if args.time_to_quality:
        print("time to quality ...", file=sys.stderr)
        report["time_to_quality"] = time_to_quality()
    print(markdown(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
