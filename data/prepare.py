"""prepare_corpus: any amount of text -> token ids in a cached file, read by training through a memory map.

The first run streams the text twice (vocabulary, then ids) into a cache folder; later runs with unchanged inputs
only map the cached file, so they start at once and their memory does not grow with the corpus.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from tqdm import tqdm

from .config import DataConfig
from .corpus import DataError, shakespeare_path
from .sources import FORMAT_VERSION, Inputs, Source, cache_dirs, cache_key, resolve_inputs
from .stream import CHUNK_BYTES, UNKNOWN, cap_vocab, count_chars, ids_dtype, lookup_table, write_ids
from .tokenizer import CharTokenizer

_SHOW_AT_MOST = 20  # unseen characters named in an error; beyond that the message stops being one line


@dataclass(frozen=True, eq=False)
class Corpus:
    """A prepared corpus: its token ids, mapped from the cache file, and its vocabulary.

    ids is a read-only-in-spirit view of the file (a private copy-on-write mapping: a stray write changes this
    process's pages, never the cache); slicing it, as split_ids does, makes views, not copies.
    """

    ids: torch.Tensor  # 1-D uint8, uint16 or uint32, backed by the memory-mapped cache file
    chars: list[str]  # the vocabulary, sorted; ids index it
    description: str  # one log line: source, size, vocabulary, cache hit or freshly encoded
    n_tokens: int
    notes: tuple[str, ...] = ()  # lines worth logging at start: characters replaced, files skipped, cache moved
    path: Path | None = None  # the cache file holding the ids
    cache_hit: bool = False

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def tokenizer(self) -> CharTokenizer:
        return CharTokenizer(self.chars)

    def ids_on(self, device: torch.device | str) -> torch.Tensor:
        """The ids on device: on the CPU, ids itself (the memory map); elsewhere one copy, read from the cache file.

        Read rather than copied from ids because the map is advised for random access, which makes a sequential
        pass through it fault in page by page, ~4x slower than reading the file (measured); the file is read in
        pieces, so the host never holds the whole corpus either.
        """
        device = torch.device(device)
        if device.type == "cpu" or self.path is None:
            return self.ids.to(device)
        return _read_ids(self.path, self.ids.dtype, self.n_tokens, device)


def prepare_corpus(
    cfg: DataConfig,
    min_chars: int,
    progress: bool = True,
    vocab: list[str] | None = None,
    *,
    chunk_bytes: int = CHUNK_BYTES,
) -> Corpus:
    """The corpus cfg names, encoded into the cache on first use and memory-mapped; DataError for what a person fixes.

    min_chars is the length of one training window (block_size + 1). With vocab (a resumed run's, or a model's),
    the ids follow that vocabulary; a character outside it is an error, unless the vocabulary holds UNKNOWN, which
    then stands for it. Without vocab, the vocabulary is every character of the text, or with data.max_vocab the
    most frequent ones plus UNKNOWN. progress shows tqdm bars (bytes, MB/s) while encoding, on a terminal only, so
    that logs and captured stderr stay free of them. chunk_bytes (how much is read at a time) never changes the
    result.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    if cfg.path is not None:
        inputs = resolve_inputs(cfg.path, "data.path")
        source = cfg.path
    elif cfg.dataset == "shakespeare_char":
        path = shakespeare_path()
        inputs = resolve_inputs(path, "data.dataset=shakespeare_char")
        source = f"tiny Shakespeare ({path})"
    else:
        raise ValueError(f"data.dataset {cfg.dataset!r} is accepted by DataConfig but prepare_corpus cannot load it")
    if vocab is not None:
        CharTokenizer(vocab)  # refuses an unsorted or duplicated vocabulary before any work
    folders = cache_dirs(cfg.cache_dir)
    stem = _stem(inputs)

    settings = {"errors": cfg.errors, "max_vocab": cfg.max_vocab, "vocab": None}
    key = cache_key(inputs, settings)
    found = _find(folders, stem, key)
    if vocab is not None and (found is None or found[0]["chars"] != list(vocab)):
        # a resumed run usually brings the vocabulary its text gave, so the entry above serves it; a different
        # vocabulary gives different ids, and an entry of its own
        digest = hashlib.blake2b("".join(vocab).encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
        settings = {"errors": cfg.errors, "max_vocab": None, "vocab": digest}
        key = cache_key(inputs, settings)
        found = _find(folders, stem, key)
    t0 = time.perf_counter()
    moved: list[str] = []  # cache folders that refused the new entry
    hit = found is not None
    if found is None:
        found = _encode(inputs, cfg, settings, key, vocab, folders, stem, chunk_bytes, progress, moved)
    info, ids_path = found
    n_tokens = info["n_tokens"]
    if n_tokens < min_chars:
        raise DataError(
            f"{inputs.label}: {inputs.spec!r} has {n_tokens} characters, but one training window needs at least "
            f"block_size + 1 = {min_chars}; use a longer text or a smaller model.block_size"
        )
    ids = _map(ids_path, np.dtype(info["dtype"]), n_tokens)
    notes = _notes(inputs, info, moved, ids_path)
    files = f"{len(inputs.sources)} files, " if len(inputs.sources) > 1 else ""
    how = "cached" if hit else f"encoded in {time.perf_counter() - t0:.1f} s"
    description = (
        f"{source} ({files}{_size(inputs.n_bytes)}, {n_tokens:,} characters, vocabulary {len(info['chars'])} as "
        f"{np.dtype(info['dtype']).name}; {how}: {ids_path})"
    )
    return Corpus(ids, list(info["chars"]), description, n_tokens, notes, ids_path, hit)


def _stem(inputs: Inputs) -> str:
    """A readable start for cache file names: the input's name, made safe for any file system."""
    name = Path(inputs.spec).name or Path(inputs.spec).resolve().name
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")[:40] or "corpus"


def _find(folders: list[Path], stem: str, key: str) -> tuple[dict, Path] | None:
    """The meta and ids file of a complete cache entry for key, in the first folder holding one."""
    for folder in folders:
        meta_path, ids_path = folder / f"{stem}-{key}.json", folder / f"{stem}-{key}.ids"
        try:
            info = json.loads(meta_path.read_text(encoding="utf-8"))
            complete = (
                info["format"] == FORMAT_VERSION
                and info["key"] == key
                and ids_path.stat().st_size == info["n_tokens"] * np.dtype(info["dtype"]).itemsize
            )
        except (OSError, ValueError, KeyError, TypeError):  # absent, or not a meta file of this version
            continue
        if complete:
            return info, ids_path
    return None


def _encode(
    inputs: Inputs,
    cfg: DataConfig,
    settings: dict,
    key: str,
    vocab: list[str] | None,
    folders: list[Path],
    stem: str,
    chunk_bytes: int,
    progress: bool,
    moved: list[str],
) -> tuple[dict, Path]:
    """Both passes over the text, into a new cache entry in the first folder that takes it; its meta and ids file."""
    with _bar(inputs, "vocabulary", progress) as bar:
        counts = count_chars(inputs, cfg.errors, chunk_bytes, bar)
    if vocab is None:
        kept, replaced = cap_vocab(counts, cfg.max_vocab)
    else:
        kept = np.array([ord(c) for c in vocab], dtype=np.int64)
        present = np.flatnonzero(counts)
        replaced = present[~np.isin(present, kept)]
        if len(replaced) and UNKNOWN not in vocab:
            shown = ", ".join(repr(chr(c)) for c in replaced[:_SHOW_AT_MOST])
            more = f" and {len(replaced) - _SHOW_AT_MOST} more" if len(replaced) > _SHOW_AT_MOST else ""
            raise DataError(
                f"{inputs.label}: {inputs.spec!r} holds {len(replaced)} character(s) the model never saw (outside "
                f"its vocabulary of {len(vocab)}): {shown}{more}; use the text it was trained on, or start a new run"
            )
    dtype = ids_dtype(len(kept))
    info = {
        "format": FORMAT_VERSION,
        "key": key,
        "dtype": dtype.str,
        "n_tokens": int(counts.sum()),
        "chars": [chr(c) for c in kept],
        "replaced_chars": len(replaced),
        "replaced_occurrences": int(counts[replaced].sum()),
        "settings": settings,
        "sources": [[str(s.path.resolve()), s.size, s.mtime_ns] for s in inputs.sources],
    }
    lookup = lookup_table(kept, replaced, dtype)
    folder, out, part = _open_part(folders, stem, ".ids", moved)
    ids_path, meta_path = folder / f"{stem}-{key}.ids", folder / f"{stem}-{key}.json"
    try:
        with _bar(inputs, "ids", progress) as bar, out:
            written = write_ids(inputs, cfg.errors, lookup, out, chunk_bytes, bar)
            _settle(out)
        if written != info["n_tokens"] or any(_changed(s) for s in inputs.sources):
            raise DataError(f"{inputs.label}: {inputs.spec!r} changed while it was being read; run again")
        # Atomic renames: a reader sees a whole entry or none, and a crash leaves at worst a hidden .part file.
        # The meta goes last because it is what _find looks for.
        os.replace(part, ids_path)
        _, meta_out, meta_part = _open_part([folder], stem, ".json", [])
        with meta_out:
            meta_out.write(json.dumps(info).encode("utf-8"))
        os.replace(meta_part, meta_path)
    except OSError as e:
        raise DataError(
            f"cannot write the encoded corpus to {folder} ({e.strerror or e}); "
            "free some space or set data.cache_dir to another folder"
        ) from e
    finally:
        part.unlink(missing_ok=True)
    _prune(folder, stem, key, info)
    return info, ids_path


def _bar(inputs: Inputs, what: str, progress: bool) -> tqdm:
    """A bar of bytes read and MB/s; disable=None shows it on a terminal only, keeping logs free of it."""
    name = Path(inputs.spec).name or inputs.spec
    return tqdm(
        total=inputs.n_bytes, unit="B", unit_scale=True, desc=f"{name}: {what}", disable=None if progress else True
    )


def _settle(out: BinaryIO) -> None:
    """Put the ids on disk and out of the page cache.

    On disk before the rename, so that a crash cannot leave a name pointing at blocks never written. Out of the
    page cache because the writes left it in large folios (up to 2 MB), and a memory map maps a whole cached folio
    on each fault: 3,000 random windows of a 2 GB file then made 1.5 GB resident (Linux 6.18, ext4). Read back
    page by page (MADV_RANDOM), a window costs 4 KB of resident memory instead.
    """
    out.flush()
    os.fsync(out.fileno())
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(out.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _changed(source: Source) -> bool:
    try:
        st = source.path.stat()
    except OSError:
        return True
    return (st.st_size, st.st_mtime_ns) != (source.size, source.mtime_ns)


def _open_part(folders: list[Path], stem: str, suffix: str, refused: list[str]) -> tuple[Path, BinaryIO, Path]:
    """(folder, file, path): a new hidden partial file in the first folder that takes one; refusals noted."""
    for folder in folders:
        # A name of our own rather than tempfile's: mkstemp makes files 0600, and a shared cache should stay
        # readable by others.
        part = folder / f".{stem}.{os.getpid()}.{secrets.token_hex(4)}{suffix}.part"
        if _read_only(folder):
            refused.append(f"{folder} (read-only)")
            continue
        try:
            folder.mkdir(parents=True, exist_ok=True)
            return folder, part.open("xb"), part
        except OSError as e:
            refused.append(f"{folder} ({e.strerror or e})")
    raise DataError(
        f"cannot write the encoded corpus to {'; nor to '.join(refused)}; set data.cache_dir to a writable folder"
    )


def _read_only(folder: Path) -> bool:
    """Whether folder, or the nearest existing folder above it, is marked read-only.

    The mode bits count even for root, who could write anyway: a folder made read-only is meant to stay as it is.
    """
    existing = folder
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    return existing.is_dir() and (not existing.stat().st_mode & 0o222 or not os.access(existing, os.W_OK))


def _prune(folder: Path, stem: str, key: str, info: dict) -> None:
    """Delete older entries made from the same files with the same settings: they are stale copies, and a
    re-encoded 1 GB corpus would otherwise leave a 1 GB file behind at every edit."""
    paths = [s[0] for s in info["sources"]]
    for meta_path in folder.glob(f"{stem}-*.json"):
        if meta_path.name == f"{stem}-{key}.json":
            continue
        try:
            old = json.loads(meta_path.read_text(encoding="utf-8"))
            if [s[0] for s in old["sources"]] != paths or old["settings"] != info["settings"]:
                continue
            meta_path.unlink()
            meta_path.with_suffix(".ids").unlink(missing_ok=True)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # someone else's file, or one being replaced at this moment: leave it


def _map(path: Path, dtype: np.dtype, n_tokens: int) -> torch.Tensor:
    """The ids file as a 1-D tensor over a private, copy-on-write memory map: nothing is read until it is used."""
    with path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if hasattr(mapped, "madvise"):
        # Training reads windows at random: without this, each page fault reads ahead ~128 KB around it, which in
        # a cold cache made batches ~8x slower and resident memory grow ~16x faster (measured on a 1 GB file).
        mapped.madvise(mmap.MADV_RANDOM)
    # a writable buffer (copy-on-write) so torch.from_numpy has nothing to warn about; no byte is copied
    return torch.from_numpy(np.frombuffer(mapped, dtype=dtype, count=n_tokens))


def _read_ids(
    path: Path, dtype: torch.dtype, n_tokens: int, device: torch.device, piece_bytes: int = 64 << 20
) -> torch.Tensor:
    """The n_tokens ids of the file at path, of dtype, read into a new tensor on device piece_bytes at a time."""
    out = torch.empty(n_tokens, dtype=dtype, device=device)
    step = max(1, piece_bytes // out.element_size())
    buffer = torch.empty(min(step, n_tokens), dtype=dtype)
    with path.open("rb") as f:
        for start in range(0, n_tokens, step):
            piece = buffer[: min(step, n_tokens - start)]
            view = memoryview(piece.numpy()).cast("B")
            if f.readinto(view) != len(view):
                raise DataError(f"the cache file {path} is shorter than its meta says; delete it and run again")
            out[start : start + len(piece)].copy_(piece)
    return out


def _notes(inputs: Inputs, info: dict, moved: list[str], ids_path: Path) -> tuple[str, ...]:
    notes = []
    if info["replaced_chars"]:
        share = 100 * info["replaced_occurrences"] / max(info["n_tokens"], 1)
        why = f"data.max_vocab={info['settings']['max_vocab']}" if info["settings"]["vocab"] is None else "vocabulary"
        notes.append(
            f"{why}: {info['replaced_chars']:,} rare character(s), {info['replaced_occurrences']:,} occurrences "
            f"({share:.3g}% of the text), map to the unknown symbol U+FFFD {UNKNOWN!r}"
        )
    if inputs.skipped:
        shown = ", ".join(repr(str(p)) for p in inputs.skipped[:3])
        more = " ..." if len(inputs.skipped) > 3 else ""
        notes.append(f"{inputs.label}: left out {len(inputs.skipped)} binary file(s): {shown}{more}")
    if moved:
        notes.append(
            f"data: cannot write to the cache folder {moved[0]}, so the encoded corpus went to "
            f"{ids_path.parent}; set data.cache_dir to choose the folder"
        )
    return tuple(notes)


def _size(n_bytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes} bytes"
