"""prepare_corpus: any amount of text -> token ids in a cached file, read by training into memory (up to 64 MB of ids)
or through a memory map.

The first run streams the text twice (vocabulary, then ids) into a cache folder; later runs with unchanged inputs
only read or map the cached file, so they start at once, and a large corpus's memory does not grow with it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from configs.userinput import shown

from . import idsfile
from .cache import find, meta_checksum, open_part, prune, reap_parts, unwritten
from .cachekey import cache_dirs, cache_key
from .config import DataConfig
from .corpus import shakespeare_path
from .idsfile import read_ids, settle
from .notes import input_notes
from .paths import LOG_PATH, DataError, quoted
from .sources import FORMAT_VERSION, Inputs, Source, resolve_inputs
from .stream import CHUNK_BYTES, UNKNOWN, Oddities, cap_vocab, count_chars, ids_dtype, lookup_table, write_ids
from .tokenizer import CharTokenizer

BOM_CHAR = "\ufeff"  # the character a byte-order mark decodes to
_SHOW_AT_MOST = 20  # unseen characters named in an error; beyond that the message stops being one line


@dataclass(frozen=True, eq=False)
class Corpus:
    """A prepared corpus: its token ids, read from the cache file (data.idsfile.read_ids), and its vocabulary.

    ids is read-only in spirit: this process's copy of the file, or for a large corpus a private copy-on-write map of
    it (a stray write changes this process's pages, never the cache); slicing it, as split_ids does, makes views.
    """

    ids: torch.Tensor  # 1-D uint8, uint16 or uint32: in memory, or backed by the memory-mapped cache file
    chars: list[str]  # the vocabulary, sorted; ids index it
    description: str  # one log line: source, size, vocabulary, cache hit or freshly encoded
    n_tokens: int
    notes: tuple[str, ...] = ()  # lines worth logging at start: characters replaced, files skipped, cache moved
    path: Path | None = None  # the cache file holding the ids
    cache_hit: bool = False
    # The ids and vocabulary in 16 hex digits, the same on any machine and in any cache folder: a run can tell that
    # it is given the text it was trained on (any change to the ids, their count or the vocabulary changes it).
    fingerprint: str = field(kw_only=True)
    crc32: int | None = field(default=None, kw_only=True)  # of the cache file, checked again when ids_on reads it

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def tokenizer(self) -> CharTokenizer:
        return CharTokenizer(self.chars)

    def ids_on(self, device: torch.device | str) -> torch.Tensor:
        """The ids on device: on the CPU, ids itself (in memory, or a large corpus's memory map); elsewhere one copy,
        of ids in memory, else read from the cache file.

        A map's ids are read rather than copied because the map is advised for random access, which makes a
        sequential pass through it fault in page by page, ~4x slower than reading the file (measured); the file is
        read in pieces, so the host never holds the whole corpus either.
        """
        device = torch.device(device)
        # read_ids's own test of the size, read now (a test, a later version may change it): a map is read anew
        if device.type == "cpu" or self.path is None or self.ids.numel() * self.ids.element_size() <= (
                idsfile.IN_MEMORY_BYTES):
            return self.ids.to(device)
        return _read_ids(self.path, self.ids.dtype, self.n_tokens, device, crc32=self.crc32)


def prepare_corpus(
    cfg: DataConfig,
    min_chars: int,
    progress: bool = True,
    vocab: list[str] | None = None,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    trained_on: str | None = None,
    out_dir: str | Path | None = None,
) -> Corpus:
    """The corpus cfg names, encoded into the cache on first use and read from it; DataError for what a person fixes.

    min_chars is the length of one training window (block_size + 1). With vocab (a resumed run's, or a model's),
    the ids follow that vocabulary; a character outside it is an error, unless the vocabulary holds UNKNOWN, which
    then stands for it. Without vocab, the vocabulary is every character of the text, or with data.max_vocab the
    most frequent ones plus UNKNOWN. A byte-order mark that starts a file is left out, with a note. progress shows
    tqdm bars (bytes, MB/s) while encoding, on a terminal only, so that logs and captured stderr stay free of them.
    chunk_bytes (how much is read at a time) never changes the result.

    trained_on is a resumed run's fingerprint of its text. A run trained before tinychar left byte-order marks out
    learnt U+FEFF from them: when the text has such marks, the run's vocabulary holds U+FEFF and the text read
    without them is not the run's, the text is read with them kept, as then, and used if it is the run's.

    out_dir, the run's folder, is never part of a folder or glob's text, even before the run has marked it as its own.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    cache = cache_dirs(cfg.cache_dir)
    inputs, source = _inputs(cfg, cache[0], [Path(out_dir)] if out_dir is not None else [])
    if vocab is not None:
        CharTokenizer(vocab)  # refuses an unsorted or duplicated vocabulary before any work
    corpus, boms = _prepared(inputs, source, cfg, vocab, cache, chunk_bytes, progress, strip_bom=True)
    if trained_on is None or corpus.fingerprint == trained_on or not boms or BOM_CHAR not in (vocab or ()):
        return _long_enough(corpus, inputs, min_chars, trained_on)
    older, _ = _prepared(inputs, source, cfg, vocab, cache, chunk_bytes, progress, strip_bom=False)
    if older.fingerprint != trained_on:
        return corpus  # other text indeed: the resume's own check refuses it
    note = (
        f"{inputs.label}: read with the byte-order marks (U+FEFF) that start its files kept, as this run was trained "
        "on them; tinychar now leaves them out, so a new run would not see them"
    )
    return dataclasses.replace(older, notes=(*older.notes, note))


def _prepared(
    inputs: Inputs,
    source: str,
    cfg: DataConfig,
    vocab: list[str] | None,
    cache: tuple[list[Path], str],
    chunk_bytes: int,
    progress: bool,
    *,
    strip_bom: bool,
) -> tuple[Corpus, int]:
    """(corpus, byte-order marks left out): prepare_corpus's work, with the leading byte-order marks of the files
    left out (strip_bom) or kept as characters."""
    folders = cache[0]
    stem = _stem(inputs)
    damaged: list[str] = []  # cached copies found damaged, so encoded again below
    settings, key, found = _cached(inputs, cfg, vocab, folders, stem, damaged, "strip" if strip_bom else "keep")
    t0 = time.perf_counter()
    moved: list[str] = []  # cache folders that refused the new entry
    hit = found is not None
    if found is None:
        found = _encode(inputs, cfg, settings, key, vocab, cache, stem, chunk_bytes, progress, moved)
    info, ids_path, ids = found
    n_tokens = info["n_tokens"]
    notes = input_notes(inputs, info, moved, ids_path) + tuple(damaged if not hit else ())
    how = "cached" if hit else f"encoded in {time.perf_counter() - t0:.1f} s"
    description = (
        f"{shown(source, LOG_PATH)} ({_files(inputs)}{_size(inputs.n_bytes)}, {n_tokens:,} characters, vocabulary "
        f"{len(info['chars'])} as {np.dtype(info['dtype']).name}; {how}: {shown(ids_path, LOG_PATH)})"
    )
    chars = list(info["chars"])
    print_ = fingerprint(info["crc32"], n_tokens, chars)
    return Corpus(ids, chars, description, n_tokens, notes, ids_path, hit, fingerprint=print_,
                  crc32=info["crc32"]), info["boms"]


def _long_enough(corpus: Corpus, inputs: Inputs, min_chars: int, trained_on: str | None) -> Corpus:
    """corpus, if it holds one training window (min_chars, block_size + 1); else DataError. A resume's text that is
    not the run's (trained_on, its fingerprint) passes: the resume's own check refuses it, saying that it is other
    text, where this line's advice (a smaller block_size) is one a resume refuses."""
    n_tokens = corpus.n_tokens
    if n_tokens < min_chars and (trained_on is None or corpus.fingerprint == trained_on):
        raise DataError(
            f"{inputs.label}: {quoted(inputs.spec)} has {n_tokens} character{'s' * (n_tokens != 1)}, but one "
            f"training window needs at least block_size + 1 = {min_chars}; use a longer text or a smaller "
            "model.block_size"
        )
    return corpus


def _cached(
    inputs: Inputs,
    cfg: DataConfig,
    vocab: list[str] | None,
    folders: list[Path],
    stem: str,
    damaged: list[str],
    bom: str,
) -> tuple[dict, str, tuple[dict, Path, torch.Tensor] | None]:
    """(settings, key, entry): the settings that make the ids, the cache key they give, and the cached entry for
    that key if a whole one exists (damaged ones said in damaged). bom: 'strip' or 'keep' the leading marks."""
    settings = {"errors": cfg.errors, "max_vocab": cfg.max_vocab, "vocab": None, "bom": bom}
    key = cache_key(inputs, settings)
    found = find(folders, stem, key, damaged)
    if vocab is not None and (found is None or found[0]["chars"] != list(vocab)):
        # a resumed run usually brings the vocabulary its text gave, so the entry above serves it; a different
        # vocabulary gives different ids, and an entry of its own
        digest = hashlib.blake2b("".join(vocab).encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
        settings = {"errors": cfg.errors, "max_vocab": None, "vocab": digest, "bom": bom}
        key = cache_key(inputs, settings)
        found = find(folders, stem, key, damaged)
    return settings, key, found


def fingerprint(crc32: int, n_tokens: int, chars: list[str]) -> str:
    """16 hex digits naming token ids (by their CRC-32 and count) and the vocabulary that gives them meaning."""
    described = json.dumps({"crc32": crc32, "n_tokens": n_tokens, "chars": "".join(chars)})  # \u-escaped: ASCII
    return hashlib.blake2b(described.encode("ascii"), digest_size=8).hexdigest()


def _inputs(cfg: DataConfig, caches: list[Path], runs: list[Path]) -> tuple[Inputs, str]:
    """The files cfg names, and how the log names them; caches (the cache folders) and runs (run folders) are never
    among them."""
    if cfg.path is not None:
        return resolve_inputs(cfg.path, "data.path", caches, runs), cfg.path
    if cfg.dataset == "shakespeare_char":
        path = shakespeare_path()
        return resolve_inputs(path, "data.dataset=shakespeare_char"), f"tiny Shakespeare ({path})"
    raise ValueError(f"data.dataset {cfg.dataset!r} is accepted by DataConfig but prepare_corpus cannot load it")


def _stem(inputs: Inputs) -> str:
    """A readable start for cache file names: the input's name, made safe for any file system."""
    name = Path(inputs.spec).name or Path(inputs.spec).resolve().name
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")[:40] or "corpus"


def _meta(inputs: Inputs, key: str, settings: dict, counts: np.ndarray, kept: np.ndarray, replaced: np.ndarray,
          dtype: np.dtype, seen: Oddities) -> dict:
    """A new cache entry's meta, before the ids are written: what the first pass found (counts of each character,
    the vocabulary kept and replaced, the byte-order marks and NULs seen) and where the text came from."""
    return {
        "format": FORMAT_VERSION,
        "key": key,
        "dtype": dtype.str,
        "n_tokens": int(counts.sum()),
        "crc32": None,  # of the ids file, once written
        "chars": [chr(c) for c in kept],
        "replaced_chars": len(replaced),
        "replaced_occurrences": int(counts[replaced].sum()),
        "boms": seen.boms,  # files whose leading byte-order mark was left out
        "nul_files": len(seen.nuls),  # files holding NUL bytes (past the binary sniff), and the first few
        "nuls": [[str(path), at] for path, at in seen.nuls[:3]],
        "settings": settings,
        "spec": inputs.asked,  # what the files were asked for: a folder or glob's later entries replace this one
        "sources": [[str(s.path.resolve()), s.size, s.mtime_ns] for s in inputs.sources],
    }


def _encode(
    inputs: Inputs,
    cfg: DataConfig,
    settings: dict,
    key: str,
    vocab: list[str] | None,
    cache: tuple[list[Path], str],
    stem: str,
    chunk_bytes: int,
    progress: bool,
    moved: list[str],
) -> tuple[dict, Path, torch.Tensor]:
    """Both passes over the text, into a new cache entry in the first of cache's folders that takes it: its meta, its
    ids file and the ids read. cache is (folders, the setting that chose them), as cache_dirs gives."""
    folders, setting = cache
    strip_bom = settings["bom"] == "strip"
    seen = Oddities()
    with _bar(inputs, "vocabulary", progress) as bar:
        counts = count_chars(inputs, cfg.errors, chunk_bytes, bar, strip_bom=strip_bom, seen=seen)
    kept, replaced = _vocabulary(inputs, counts, cfg.max_vocab, vocab)
    dtype = ids_dtype(len(kept))
    info = _meta(inputs, key, settings, counts, kept, replaced, dtype, seen)
    lookup = lookup_table(kept, replaced, dtype)
    folder, out, part = open_part(folders, stem, ".ids", moved, setting)
    reap_parts(folder)  # what killed encodings left there, before this one takes its own room
    ids_path, meta_path = folder / f"{stem}-{key}.ids", folder / f"{stem}-{key}.json"
    meta_part = None
    try:
        with _bar(inputs, "ids", progress) as bar, out:
            written = write_ids(inputs, cfg.errors, lookup, out, chunk_bytes, bar, strip_bom=strip_bom)
            settle(out)
        if written != info["n_tokens"] or any(_changed(s) for s in inputs.sources):
            raise DataError(f"{inputs.label}: {quoted(inputs.spec)} changed while it was being read; run again")
        with part.open("rb") as f:  # read back rather than summed while written: the checksum is of what is stored
            info["crc32"], _, ids = read_ids(f, dtype, info["n_tokens"])
        info["meta_crc32"] = meta_checksum(info)  # last: of everything else in the meta, the vocabulary included
        # Atomic renames: a reader sees a whole entry or none, and a crash leaves at worst a hidden .part file,
        # which a later encoding into the folder reaps (reap_parts).
        # The meta goes last because it is what find looks for; it is written before either rename, so that a disk
        # too full for it leaves no ids file that no meta names (as large as the corpus's ids, and never pruned).
        _, meta_out, meta_part = open_part([folder], stem, ".json", [])
        with meta_out:
            meta_out.write(json.dumps(info).encode("utf-8"))
        os.replace(part, ids_path)
        try:
            os.replace(meta_part, meta_path)
        except OSError:  # a folder in the meta's place, say: no meta would ever name these ids
            ids_path.unlink(missing_ok=True)
            raise
    except OSError as e:
        raise unwritten(setting, folder, (ids_path, meta_path), e) from e
    finally:
        part.unlink(missing_ok=True)
        if meta_part is not None:
            meta_part.unlink(missing_ok=True)
    prune(folder, stem, key, info)
    return info, ids_path, ids


def _vocabulary(
    inputs: Inputs, counts: np.ndarray, max_vocab: int | None, vocab: list[str] | None
) -> tuple[np.ndarray, np.ndarray]:
    """(kept, replaced) code points: the text's own vocabulary (capped at max_vocab), or the one given, with
    characters outside it replaced by UNKNOWN if it holds that, else refused."""
    if vocab is None:
        return cap_vocab(counts, max_vocab)
    kept = np.array([ord(c) for c in vocab], dtype=np.int64)
    present = np.flatnonzero(counts)
    replaced = present[~np.isin(present, kept)]
    if len(replaced) and UNKNOWN not in vocab:
        named = ", ".join(repr(chr(c)) for c in replaced[:_SHOW_AT_MOST])
        more = f" and {len(replaced) - _SHOW_AT_MOST} more" if len(replaced) > _SHOW_AT_MOST else ""
        raise DataError(
            f"{inputs.label}: {quoted(inputs.spec)} holds {len(replaced)} character(s) the model never saw (outside "
            f"its vocabulary of {len(vocab)}): {named}{more}; use the text it was trained on, or start a new run"
        )
    return kept, replaced


def _bar(inputs: Inputs, what: str, progress: bool) -> tqdm:
    """A bar of bytes read and MB/s; disable=None shows it on a terminal only, keeping logs free of it."""
    name = Path(inputs.spec).name or inputs.spec
    return tqdm(
        total=inputs.n_bytes, unit="B", unit_scale=True, desc=f"{name}: {what}", disable=None if progress else True
    )


def _changed(source: Source) -> bool:
    try:
        st = source.path.stat()
    except OSError:
        return True
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns) != (source.size, source.mtime_ns, source.ctime_ns)


def _read_ids(
    path: Path, dtype: torch.dtype, n_tokens: int, device: torch.device, piece_bytes: int = 64 << 20,
    crc32: int | None = None,
) -> torch.Tensor:
    """The n_tokens ids of the file at path, of dtype, read into a new tensor on device piece_bytes at a time; with
    crc32, checked against it (the file is read by its name again, after the checked one was read: another
    process may have removed or changed it since), DataError where it differs."""
    out = torch.empty(n_tokens, dtype=dtype, device=device)
    step = max(1, piece_bytes // out.element_size())
    buffer = torch.empty(min(step, n_tokens), dtype=dtype)
    changed = f"the cache file {quoted(path)} changed after it was checked"
    crc = 0
    try:
        with path.open("rb") as f:
            for start in range(0, n_tokens, step):
                piece = buffer[: min(step, n_tokens - start)]
                view = memoryview(piece.numpy()).cast("B")
                if f.readinto(view) != len(view):
                    raise DataError(f"{changed} (it is shorter than its meta says); run again, which encodes it anew")
                crc = zlib.crc32(view, crc)
                out[start : start + len(piece)].copy_(piece)
    except OSError as e:
        raise DataError(f"{changed} ({e.strerror or type(e).__name__}); run again, which encodes it anew") from None
    if crc32 is not None and crc != crc32:
        raise DataError(f"{changed} (its checksum differs); run again, which encodes it anew")
    return out


def _files(inputs: Inputs) -> str:
    return f"{len(inputs.sources)} files, " if len(inputs.sources) > 1 else ""


def _size(n_bytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes} bytes"
