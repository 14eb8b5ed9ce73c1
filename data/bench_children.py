"""data/bench.py's measuring children, each run in a fresh interpreter (`python -m data.bench --child MODE CORPUS
CACHE`) so that its peak resident memory is its own: preparing a corpus, batches as train.py draws them, and
get_batch timings. Each prints one line of JSON."""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from data import DataConfig


def memory() -> dict[str, float]:
    """This process's resident memory in MB: total, anonymous (its own) and file-backed (mapped files), and peak."""
    fields = {"VmRSS": "rss_mb", "RssAnon": "anon_mb", "RssFile": "file_mb", "VmHWM": "peak_mb"}
    found = {}
    with open("/proc/self/status", encoding="ascii", errors="replace") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in fields:
                found[fields[name]] = int(value.split()[0]) / 1024
    return found


def child(mode: str, corpus: str, cache: str) -> int:
    """One measurement: "prepare" or "batches" of a corpus, whose peak memory is this process's own; or "timings",
    get_batch's on several corpora (corpus: a JSON list of [path, cold]), which take no memory figure, so one process
    serves them all (each process is 2-3 s of importing torch)."""
    import torch  # noqa: F401 - imported before the figures, as in the other children

    from data import DataConfig, prepare_corpus

    if mode == "timings":
        result: dict = {"mode": mode, "us": {}}
        for path, cold in json.loads(corpus):
            result["us"].update(timings(DataConfig(path=path, dataset=None, cache_dir=cache), cold))
        result["peak_rss_mb"] = memory()["peak_mb"]
        print(json.dumps(result), flush=True)
        return 0
    cfg = DataConfig(path=corpus, dataset=None, cache_dir=cache)
    result = {"mode": mode, "bytes": os.path.getsize(corpus)}
    if mode == "prepare":
        before = memory()
        start = time.perf_counter()
        c = prepare_corpus(cfg, min_chars=9, progress=True)
        seconds = time.perf_counter() - start
        result.update(
            seconds=seconds,
            mb_per_s=result["bytes"] / 1e6 / seconds,
            n_tokens=c.n_tokens,
            vocab=c.vocab_size,
            dtype=str(c.ids.dtype).replace("torch.", ""),
            cache_hit=c.cache_hit,
            rss_after_imports_mb=before["rss_mb"],
        )
    elif mode == "batches":
        result.update(batches(cfg))
    result["peak_rss_mb"] = memory()["peak_mb"]
    print(json.dumps(result), flush=True)
    return 0


def timings(cfg: DataConfig, cold: bool) -> dict[str, float]:
    """get_batch's microseconds on a corpus (prepared first if it is not yet), by what it reads and the batch shape.
    cold: the first windows of a corpus just prepared, each a read from disk (a page fault); else the CPU's cost of
    get_batch, the small ids soon all in the page cache."""
    import torch

    from data import prepare_corpus
    from data.idsfile import map_ids

    c = prepare_corpus(cfg, min_chars=9, progress=False)
    kind = str(c.ids.dtype).replace("torch.", "")
    size = f"{os.path.getsize(cfg.path) / 1e6:g} MB"
    shapes = ((32, 8), (12, 64))
    with open(c.path, "rb") as f:  # mapped as a large corpus's ids are (a small one's are read into memory)
        mapped = map_ids(f, c.ids.numpy().dtype, c.n_tokens)
    if cold:
        return {f"{kind} memmap ({size}, cold pages), B={batch} T={block}": time_get_batch(
                    mapped, batch, block, calls=500, repeats=1, warmup=0) for batch, block in shapes}
    tensors = {f"{kind} memmap ({size})": mapped}
    if kind == "uint8":
        tensors[f"int64 tensor ({size}, in memory)"] = c.ids.to(torch.int64)
    return {f"{name}, B={batch} T={block}": time_get_batch(ids, batch, block)
            for name, ids in tensors.items() for batch, block in shapes}


def batches(cfg: DataConfig) -> dict:
    """What train.py does with the data, without the model: 20 steps of batch 128 x block 8 and an evaluation of 2
    batches per split, as in the train.py runs; the time to the first batch, and the memory before and after."""
    import torch

    from data import get_batch, prepare_corpus, split_ids

    start = time.perf_counter()
    before = memory()
    c = prepare_corpus(cfg, min_chars=9, progress=False)
    train, val = split_ids(c.ids, 0.1, 8)
    g = torch.Generator().manual_seed(0)
    get_batch(train, 8, 128, g)
    first = time.perf_counter() - start
    for _ in range(19):
        get_batch(train, 8, 128, g)
    for split in (train, val):
        for _ in range(2):
            get_batch(split, 8, 128, g)
    after = memory()
    return dict(
        first_batch_s=first,
        cache_hit=c.cache_hit,
        **{f"before_{k}": v for k, v in before.items()},
        **{f"after_{k}": v for k, v in after.items()},
    )


def time_get_batch(ids, batch: int, block: int, calls: int = 2000, repeats: int = 5, warmup: int = 200) -> float:
    """Microseconds per get_batch call, the best of repeats (the machine is shared, so the best is the signal)."""
    import torch

    from data import get_batch

    g = torch.Generator().manual_seed(0)
    for _ in range(warmup):
        get_batch(ids, block, batch, g)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            get_batch(ids, block, batch, g)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6
