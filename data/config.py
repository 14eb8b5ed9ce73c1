"""DataConfig: where the training text comes from and how much of it is held out, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, field

# Built-in corpora that ``load_corpus`` knows how to fetch; ``data.path`` covers everything else.
DATASETS = ("shakespeare_char",)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The training text and its train/validation split.

    Each field's ``help`` metadata is its one-line meaning; ``train.py --help`` prints it.
    """

    path: str | None = field(default=None, metadata={"help": "a UTF-8 text file to train on; wins over data.dataset"})
    dataset: str | None = field(
        default="shakespeare_char",
        metadata={"help": f"built-in corpus, downloaded and cached on first use: {', '.join(DATASETS)}"},
    )
    val_fraction: float = field(
        default=0.1, metadata={"help": "fraction of the text, taken from its end, held out for validation"}
    )

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:  # written this way so that NaN is refused too
            raise ValueError(f"data.val_fraction must be between 0 and 1 (exclusive), got {self.val_fraction}")
        if self.path is not None and not self.path.strip():
            raise ValueError("data.path is empty; give a UTF-8 text file, or leave it unset to use data.dataset")
        if self.dataset is not None and self.dataset not in DATASETS:
            raise ValueError(
                f"data.dataset must be one of {', '.join(DATASETS)} (or unset with data.path given), "
                f"got {self.dataset!r}"
            )
        if self.path is None and self.dataset is None:
            raise ValueError(
                f"no training text: give data.path (a UTF-8 text file) or data.dataset (one of {', '.join(DATASETS)})"
            )
