"""The environment variables the entry scripts read, in words for their --help (the README's table under "Configs"
says more). Plain Python: the scripts build their help before torch is imported."""

from __future__ import annotations

MEANINGS = {
    "TINYCHAR_DATA_DIR": "a folder of corpora, where a relative data.path not found from here is looked for",
    "TINYCHAR_CACHE_DIR": "where encoded corpora are kept, an absolute path (default ~/.cache/tinychar/encoded)",
    "TORCHINDUCTOR_CACHE_DIR": "where compiled code is kept (default ~/.cache/tinychar/compiled)",
    "XDG_CACHE_HOME": "an absolute path: tinychar's cache folders go in its tinychar/ (default ~/.cache)",
    "TINYCHAR_WARM_CACHE": "1 (default) or 0: warm the compile cache after a run that trained eagerly",
    "TINYCHAR_ONEDNN": "auto (default), 0 or 1: float32 CPU products through oneDNN where faster, never, always",
    "TINYCHAR_GEMM": "auto (default), 0 or 1: the compiled CPU step's linear layers by tinychar's kernel where faster",
    "TINYCHAR_SPLIT_STEP": "auto (default), 0 or 1: a small model's compiled CPU step in two halves, one a core",
    "TINYCHAR_FLUSH_DENORMALS": "1 (default) or 0: treat denormal numbers as zero while training",
    "TINYCHAR_KEEP_MEMORY": "1 (default) or 0: keep the memory a training step frees for the next",
}


def environment_help(names: tuple[str, ...]) -> str:
    """An "environment:" block for a --help epilog: each of names with its meaning, aligned."""
    width = max(len(name) for name in names)
    return "\n".join(["environment:", *(f"  {name:<{width}}  {MEANINGS[name]}" for name in names)])
