"""Streaming a corpus in two passes: count its characters, then write their token ids, a chunk at a time.

Memory is bounded by the chunk size, never by the corpus: pass 1 keeps one count per code point, pass 2 writes each
chunk's ids to a file before reading the next chunk.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
from tqdm import tqdm

from .paths import UTF16_MARKS, DataError, check_unchanged, not_utf8, open_regular, quoted
from .sources import Inputs, Source

# Bytes read at a time. Preparing peaks at ~10x this above the imports (UTF-32 copies, int64 temporaries); 16 MB
# chunks were no faster and added ~130 MB to the peak (measured on 100 MB and 1 GB corpora).
CHUNK_BYTES = 4 << 20
UNKNOWN = "\ufffd"  # U+FFFD REPLACEMENT CHARACTER: what a capped vocabulary maps its rarest characters to
N_CODE_POINTS = 0x110000
# Code points per numpy step: bincount and take widen their input to int64 first, so a step costs 8 bytes per code
# point; 1M keeps that at 8 MB and is about as fast per byte as whole 16 MB chunks (measured).
_BLOCK = 1 << 20
_SEPARATOR = b"\n"  # between two files, so one file's last line never runs into the next file's first
BOM = codecs.BOM_UTF8  # U+FEFF as the first bytes of a file: a mark of the encoding some editors write, not text


@dataclass
class Oddities:
    """What pass 1 met that a person should hear of: byte-order marks left out, NUL bytes kept."""

    boms: int = 0  # files whose leading byte-order mark was left out
    # files holding a NUL byte (all past the binary sniff at their start, or they would not be inputs): (path, offset
    # of the first) for each
    nuls: list[tuple[Path, int]] = field(default_factory=list)


def pieces(
    inputs: Inputs,
    errors: str,
    chunk_bytes: int,
    bar: tqdm | None = None,
    *,
    strip_bom: bool = True,
    seen: Oddities | None = None,
) -> Iterator[bytes | np.ndarray]:
    """The text of inputs, files joined by newlines: each chunk as ASCII bytes, or else as uint32 code points.

    With strip_bom, a byte-order mark that starts a file is left out: it says how the file was saved, and kept it
    would be a character of the vocabulary, learnt after every file separator of a folder of such files. seen, if
    given, collects the marks left out and the files holding NUL bytes.

    ASCII chunks stay bytes because most text is ASCII and bytes are 4x smaller and far quicker to count and map
    than code points (a latin-1-kind str encodes to UTF-32 at only ~300 MB/s). The incremental decoder carries a
    character split across two reads into the next one.
    """
    for i, source in enumerate(inputs.sources):
        if i:
            yield _SEPARATOR
        decoder = codecs.getincrementaldecoder("utf-8")(errors)
        with open_regular(source.path, inputs.label) as f:
            done = _past_bom(f, source, inputs.label, strip_bom, seen, bar)  # bytes of this file read so far
            nul_seen = seen is None
            while True:
                chunk = f.read(min(chunk_bytes, source.size - done)) if done < source.size else b""
                if not chunk:  # its listed size read (or less: it shrank), and no further, whatever it holds now
                    check_unchanged(f, source, inputs.label)
                if not nul_seen and (at := chunk.find(b"\0")) >= 0:  # memchr: no cost beside decoding
                    seen.nuls.append((source.path, done + at))
                    nul_seen = True
                held = len(decoder.getstate()[0])  # bytes of an unfinished character kept from the last read
                try:
                    text = decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as e:
                    # e.start counts from the held bytes, which end where this read begins
                    at = done - held + e.start
                    raise DataError(
                        f"{inputs.label}: {quoted(source.path)} is not UTF-8 at byte {at}; "
                        "fix the file or set data.errors=replace"
                    ) from e
                done += len(chunk)
                if bar is not None:
                    bar.update(len(chunk))
                if text.isascii():  # O(1): CPython records it when the str is made
                    if text:
                        yield text.encode("ascii")
                else:
                    yield np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
                if not chunk:
                    break


def _past_bom(f: BinaryIO, source: Source, label: str, strip_bom: bool, seen: Oddities | None,
              bar: tqdm | None) -> int:
    """Where f's text begins: past a UTF-8 byte-order mark that starts it, with strip_bom (counted in seen and on
    the bar), else at 0. UTF-16's marks are DataError."""
    head = f.read(len(BOM))  # read apart from the chunks, however small they are
    if head.startswith(UTF16_MARKS):  # (with NUL bytes, as most UTF-16 has, it was refused as binary)
        raise not_utf8(label, source.path, head)
    if strip_bom and head == BOM:
        if seen is not None:
            seen.boms += 1
        if bar is not None:
            bar.update(len(BOM))
        return len(BOM)
    f.seek(0)
    return 0


def _code_points(piece: bytes | np.ndarray) -> np.ndarray:
    return np.frombuffer(piece, dtype=np.uint8) if isinstance(piece, bytes) else piece


def count_chars(
    inputs: Inputs,
    errors: str,
    chunk_bytes: int = CHUNK_BYTES,
    bar: tqdm | None = None,
    *,
    strip_bom: bool = True,
    seen: Oddities | None = None,
) -> np.ndarray:
    """Pass 1: how often each code point occurs in the corpus, as an int64 array indexed by code point; seen (if
    given) collects what else a person should hear of (see pieces)."""
    counts = np.zeros(N_CODE_POINTS, dtype=np.int64)
    for piece in pieces(inputs, errors, chunk_bytes, bar, strip_bom=strip_bom, seen=seen):
        codes = _code_points(piece)
        for start in range(0, len(codes), _BLOCK):
            # bincount over a few distinct values is a fast linear pass; np.unique would sort and collections.Counter
            # loops in Python, both some 10-20x slower (measured)
            found = np.bincount(codes[start : start + _BLOCK])
            counts[: len(found)] += found
    return counts


def write_ids(
    inputs: Inputs,
    errors: str,
    lookup: np.ndarray,
    out: BinaryIO,
    chunk_bytes: int = CHUNK_BYTES,
    bar: tqdm | None = None,
    *,
    strip_bom: bool = True,
) -> int:
    """Pass 2: write the id of every character to out, as lookup[code point] (lookup's dtype); the count written.
    strip_bom must be what pass 1 had."""
    # For one-byte ids an ASCII chunk maps through bytes.translate, some 6x faster than a numpy gather
    table = lookup[:256].tobytes() if lookup.dtype.itemsize == 1 else None
    n = 0
    for piece in pieces(inputs, errors, chunk_bytes, bar, strip_bom=strip_bom):
        if table is not None and isinstance(piece, bytes):
            out.write(piece.translate(table))
            n += len(piece)
            continue
        codes = _code_points(piece)
        out.writelines(np.take(lookup, codes[start : start + _BLOCK]) for start in range(0, len(codes), _BLOCK))
        n += len(codes)
    return n


def ids_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned little-endian integer that holds every id: uint8, uint16 or uint32."""
    for dtype in ("<u1", "<u2", "<u4"):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ValueError(f"a vocabulary of {vocab_size} characters is larger than Unicode")


def cap_vocab(counts: np.ndarray, max_vocab: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(kept, replaced): sorted code points of the vocabulary, and those that map to UNKNOWN instead.

    With no cap, or a corpus within it, every character is kept. Otherwise the max_vocab - 1 most frequent
    characters (ties to the lower code point) are kept, and UNKNOWN takes the last place; an UNKNOWN already in the
    text is that same symbol, so it is neither kept twice nor counted as replaced.
    """
    present = np.flatnonzero(counts)
    if max_vocab is None or len(present) <= max_vocab:
        return present, present[:0]
    unknown = ord(UNKNOWN)
    others = present[present != unknown]
    order = np.lexsort((others, -counts[others]))  # by count, descending; then by code point
    kept = np.sort(np.append(others[order[: max_vocab - 1]], unknown))
    return kept, np.sort(others[order[max_vocab - 1 :]])


def lookup_table(kept: np.ndarray, replaced: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The code point -> id table: kept[i] -> i, each replaced code point -> the id of UNKNOWN, the rest 0.

    Code points absent from the corpus get 0: pass 1 saw every character, and a file changed between the passes is
    caught by its size and times afterwards.
    """
    table = np.zeros(N_CODE_POINTS, dtype=dtype)
    table[kept] = np.arange(len(kept))
    if len(replaced):
        table[replaced] = np.searchsorted(kept, ord(UNKNOWN))
    return table
