"""tinychar's data: text -> CharTokenizer -> token ids -> batches. Never imports model/."""

from .batches import get_batch, split_ids
from .config import DataConfig
from .corpus import SHAKESPEARE_SHA256, DataError, data_dir, load_corpus, read_text, shakespeare_path
from .tokenizer import CharTokenizer

__all__ = [
    "SHAKESPEARE_SHA256",
    "CharTokenizer",
    "DataConfig",
    "DataError",
    "data_dir",
    "get_batch",
    "load_corpus",
    "read_text",
    "shakespeare_path",
    "split_ids",
]
