"""DataConfig: where the training text comes from and how much of it is held out, validated when built."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

# Built-in corpora, which ship inside data/; ``data.path`` covers everything else.
DATASETS = ("shakespeare_char",)
ERRORS = ("strict", "replace")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The training text, how it becomes token ids, and its train/validation split.

    Each field's ``help`` metadata is its one-line meaning; ``train.py --help`` prints it.
    """

    path: str | None = field(
        default=None,
        metadata={"path": True,
                  "help": "UTF-8 text: a file, a folder or a glob (files joined by newlines); wins over a config "
                          "file's dataset (one given on the command line wins over a file's path)"},
    )
    dataset: str | None = field(
        default="shakespeare_char",
        metadata={"help": f"built-in corpus, shipped with tinychar: {', '.join(DATASETS)}"},
    )
    val_fraction: float = field(
        default=0.1, metadata={"help": "fraction of the text, taken from its end, held out for validation"}
    )
    errors: str = field(
        default="strict",
        metadata={"help": "invalid UTF-8: strict (stop, naming file and byte) or replace (with U+FFFD)"},
    )
    max_vocab: int | None = field(
        default=None,
        metadata={"help": "most characters kept; the rarest others become U+FFFD (null = every character)"},
    )
    cache_dir: str | None = field(
        default=None,
        metadata={"path": True,
                  "help": "folder for encoded corpora (null = $TINYCHAR_CACHE_DIR, else "
                          "$XDG_CACHE_HOME/tinychar/encoded, else ~/.cache/tinychar/encoded)"},
    )

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:  # written this way so that NaN is refused too
            raise ValueError(f"data.val_fraction must be between 0 and 1 (exclusive), got {self.val_fraction}")
        if self.val_fraction < sys.float_info.min:  # a subnormal: 0 once training flushes them (1e-320 was a traceback)
            raise ValueError(f"data.val_fraction must be at least {sys.float_info.min:.4g}, the smallest normal "
                             f"float, got {self.val_fraction:.4g}")
        if self.path is not None and not self.path.strip():
            raise ValueError(
                "data.path is empty; give a UTF-8 text file, a folder or a glob, or leave it unset to use data.dataset"
            )
        if self.dataset is not None and self.dataset not in DATASETS:
            raise ValueError(
                f"data.dataset must be one of {', '.join(DATASETS)} (or unset with data.path given), "
                f"got {self.dataset!r}"
            )
        if self.path is None and self.dataset is None:
            raise ValueError(
                f"no training text: give data.path (a UTF-8 text file, folder or glob) or data.dataset (one of "
                f"{', '.join(DATASETS)})"
            )
        if self.errors not in ERRORS:
            raise ValueError(f"data.errors must be one of {', '.join(ERRORS)}, got {self.errors!r}")
        # bool is an int in Python; a YAML 'true' here is a mistake, not a vocabulary of one
        if self.max_vocab is not None and (isinstance(self.max_vocab, bool) or self.max_vocab < 2):
            raise ValueError(
                f"data.max_vocab must be >= 2 (one character plus the unknown symbol) or null, got {self.max_vocab}"
            )
        if self.cache_dir is not None and not self.cache_dir.strip():
            raise ValueError("data.cache_dir is empty; give a folder, or leave it unset for the default")
