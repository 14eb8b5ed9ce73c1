"""CharTokenizer: one id per Unicode code point, ids in sorted order of the characters."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import NoReturn

import numpy as np
import torch

# UTF-32 gives one fixed-width unit per code point, so a str becomes a numpy array without a Python loop.
# "surrogatepass" lets lone surrogates (legal in a Python str, not in UTF-8 files) round-trip as well.
_UTF32 = "utf-32-le"
_ERRORS = "surrogatepass"
_SHOW_AT_MOST = 20  # unknown characters named in an error; beyond that the message stops being one line


def _code_points(text: str) -> np.ndarray:
    """The code points of text as a 1-D uint32 array."""
    return np.frombuffer(text.encode(_UTF32, _ERRORS), dtype="<u4")


class CharTokenizer:
    """Maps each character of a fixed vocabulary to its index in the sorted vocabulary.

    The vocabulary is stored as a plain list of characters (that is what a checkpoint carries), and it must
    already be sorted and unique: re-sorting silently here would give a checkpoint's embeddings the wrong rows.
    """

    def __init__(self, chars: Sequence[str]) -> None:
        chars = list(chars)
        for c in chars:
            if not isinstance(c, str) or len(c) != 1:
                raise ValueError(f"the vocabulary must hold single characters, got {c!r}")
        if any(a >= b for a, b in pairwise(chars)):
            raise ValueError(
                "the vocabulary must be sorted and free of duplicates (build it with CharTokenizer.from_text)"
            )
        self._chars = chars
        self._codes = _code_points("".join(chars))  # sorted, since str order is code-point order
        # A table indexed by code point encodes a 1 MB text about ten times faster than a binary search over the
        # vocabulary; it costs 4 bytes per code point up to the largest one (at most 4.4 MB, 256 KB for ASCII).
        size = int(self._codes[-1]) + 1 if len(chars) else 0
        self._lookup = np.full(size, -1, dtype=np.int32)
        self._lookup[self._codes] = np.arange(len(chars), dtype=np.int32)

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The tokenizer whose vocabulary is the sorted set of characters in text."""
        return cls(sorted(set(text)))

    @property
    def chars(self) -> list[str]:
        """The vocabulary, in id order (a copy: the tokenizer itself never changes)."""
        return list(self._chars)

    @property
    def vocab_size(self) -> int:
        return len(self._chars)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CharTokenizer):
            return NotImplemented
        return self._chars == other._chars

    def __hash__(self) -> int:
        return hash(tuple(self._chars))

    def unknown(self, text: str) -> list[str]:
        """The sorted unique characters of text that are not in the vocabulary."""
        seen = np.unique(_code_points(text))
        missing = seen[~np.isin(seen, self._codes, assume_unique=True)]
        return list(_text(missing))  # one character per code point, already sorted by np.unique

    def _ids(self, text: str) -> np.ndarray:
        codes = _code_points(text)
        if len(codes) and codes.max() >= len(self._lookup):
            self._refuse(text)
        ids = self._lookup[codes]
        if len(ids) and ids.min() < 0:
            self._refuse(text)
        return ids.astype(np.int64)

    def _refuse(self, text: str) -> NoReturn:
        missing = self.unknown(text)
        shown = ", ".join(repr(c) for c in missing[:_SHOW_AT_MOST])
        more = f" and {len(missing) - _SHOW_AT_MOST} more" if len(missing) > _SHOW_AT_MOST else ""
        raise ValueError(
            f"{len(missing)} character(s) not in the vocabulary of {self.vocab_size}: {shown}{more}; "
            "the model only knows the characters of the text it was trained on"
        )

    def encode(self, text: str) -> list[int]:
        """The ids of the characters of text; ValueError naming any character outside the vocabulary."""
        return self._ids(text).tolist()

    def encode_tensor(self, text: str) -> torch.Tensor:
        """Like encode, as a 1-D int64 tensor, without a Python loop (a 1 MB text takes milliseconds)."""
        return torch.from_numpy(self._ids(text))

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """The text of a list of ids or a 1-D integer tensor; ValueError for an id outside the vocabulary."""
        if isinstance(ids, torch.Tensor):
            # booleans too, as in a list: a mask given for ids decoded True as 1 without a word
            if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
                raise ValueError(f"decode needs a 1-D integer tensor, got {ids.dim()}-D {ids.dtype}")
            array = ids.detach().cpu().numpy()
        else:
            # as given, not cast: int64 wrapped a uint64 id past 2**63 to a negative one, truncated 1.7 to 1, and
            # raised OverflowError for 2**63 in a list (numpy holds it as an object)
            array = np.asarray(ids)
            if array.ndim != 1:
                raise ValueError(f"decode needs a flat sequence of ids, got shape {array.shape}")
            if len(array) and array.dtype.kind not in "iu":  # what numpy made of them: floats, bools, huge ints
                values = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
                # as a list, not next(..., None): an id of None is odd too (it was taken for none, a TypeError)
                odd = [x for x in values if not isinstance(x, (int, np.integer)) or isinstance(x, bool)]
                if odd:
                    raise ValueError(f"decode needs integer ids, got {odd[0]!r}")
                array = np.array(values, dtype=object)  # integers past int64, checked below as Python's
        if len(array) and (array.min() < 0 or array.max() >= self.vocab_size):
            bad = next(i for i in array.tolist() if not 0 <= i < self.vocab_size)
            raise ValueError(f"id {bad} is outside the vocabulary (ids run from 0 to {self.vocab_size - 1})")
        return _text(self._codes[array.astype(np.int64, copy=False)])


def _text(codes: np.ndarray) -> str:
    """The string whose code points are codes (the inverse of _code_points)."""
    return codes.astype("<u4", copy=False).tobytes().decode(_UTF32, _ERRORS)
