"""tinychar's data: text -> CharTokenizer -> token ids -> batches. Never imports model/. Its names load
with their modules, on first use: the config alone (data.config) imports neither torch nor numpy.
"""

from __future__ import annotations

import importlib

# Each name's module, imported when the name is first used
_HOMES = {
    "CharTokenizer": "tokenizer",
    "Corpus": "prepare",
    "DataConfig": "config",
    "DataError": "paths",
    "SHAKESPEARE_SHA256": "corpus",
    "UNKNOWN": "stream",
    "data_dir": "corpus",
    "get_batch": "batches",
    "load_corpus": "corpus",
    "prepare_corpus": "prepare",
    "read_text": "corpus",
    "shakespeare_path": "corpus",
    "split_ids": "batches",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
