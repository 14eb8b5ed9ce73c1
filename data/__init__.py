"""tinychar's data: text -> CharTokenizer -> token ids -> batches. Never imports model/."""

from .batches import get_batch, split_ids
from .config import DataConfig
from .corpus import SHAKESPEARE_SHA256, data_dir, load_corpus, read_text, shakespeare_path
from .paths import DataError
from .prepare import Corpus, prepare_corpus
from .stream import UNKNOWN
from .tokenizer import CharTokenizer

__all__ = [
    "SHAKESPEARE_SHA256",
    "UNKNOWN",
    "CharTokenizer",
    "Corpus",
    "DataConfig",
    "DataError",
    "data_dir",
    "get_batch",
    "load_corpus",
    "prepare_corpus",
    "read_text",
    "shakespeare_path",
    "split_ids",
]
