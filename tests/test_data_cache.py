"""data/prepare.py and data/sources.py, the cache of encoded corpora: a second run maps the cached ids without
reading the text, changed inputs are encoded again and their old entries pruned, the key follows content (or size and
mtime for large inputs) and the settings that change the ids, an unwritable cache folder falls back or is refused
in one line, a damaged entry (its checksum or size wrong, a meta that disagrees with its own checksum or ids past its
vocabulary) is encoded again and said, and the fingerprint names the ids and vocabulary wherever they are cached."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from test_data_sources import within
from test_data_stream import MIXED, prepare, text_of, write

import data.cache
import data.cachekey
import data.idsfile
import data.prepare
import data.sources
from configs.userinput import shown
from data import DataError
from data.paths import LOG_PATH, quoted


@pytest.fixture(autouse=True)
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Every test encodes into a folder of its own (never the session's or the user's cache)."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("TINYCHAR_CACHE_DIR", str(folder))
    return folder


def entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# --- cache -----------------------------------------------------------------------------------------------------------


def refuse_to_read(*args: object, **kwargs: object) -> None:
    raise AssertionError("the text was read again")


def test_resuming_with_the_texts_own_vocabulary_reuses_its_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = write(tmp_path / "t.txt", MIXED)
    first = prepare(f)
    monkeypatch.setattr(data.prepare, "count_chars", refuse_to_read)
    again = prepare(f, vocab=first.chars)
    assert again.cache_hit and again.path == first.path


def test_a_second_run_reuses_the_cache_without_reading_the_text(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = write(tmp_path / "t.txt", MIXED * 5)
    first = prepare(f)
    assert not first.cache_hit and first.path.parent == cache
    monkeypatch.setattr(data.prepare, "count_chars", refuse_to_read)
    monkeypatch.setattr(data.prepare, "write_ids", refuse_to_read)
    second = prepare(f, chunk_bytes=1 << 20)  # the read size is not part of the key: it never changes the ids
    assert second.cache_hit and "cached" in second.description and second.path == first.path
    assert torch.equal(second.ids, first.ids) and second.chars == first.chars
    assert entries(cache) == [first.path.name, first.path.with_suffix(".json").name]


def test_a_changed_file_is_encoded_again_and_its_old_entry_removed(tmp_path: Path, cache: Path) -> None:
    f = write(tmp_path / "t.txt", "old text, old text")
    first = prepare(f)
    write(f, "new text, now longer than before")
    second = prepare(f)
    assert not second.cache_hit and text_of(second) == "new text, now longer than before"
    assert entries(cache) == [second.path.name, second.path.with_suffix(".json").name]
    assert not first.path.exists()


def metas(folder: Path) -> list[dict]:
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted(folder.glob("*.json"))]


@pytest.mark.parametrize("form", ["folder", "glob"])
def test_a_folder_or_glob_that_gains_loses_or_renames_files_leaves_one_entry(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    """Only an entry of exactly the same files was pruned: each change to a folder's files left a whole entry behind
    for good (a 10 MB folder gaining three small files left 4 entries, 39 MB). An entry says what it was asked for,
    and a later one of the same folder or glob replaces it, whatever its files; another folder's stays."""
    books = tmp_path / "books"
    write(books / "a.txt", "alpha " * 20)
    spec = str(books) if form == "folder" else f"{books}/*.txt"
    first = prepare(spec)
    monkeypatch.chdir(tmp_path)  # the same corpus named another way: the meta holds what it came to
    other_way = "books" if form == "folder" else "books/*.txt"
    for change in ("gains", "loses", "renames"):
        if change == "gains":
            write(books / "b.txt", "beta " * 20)
        elif change == "loses":
            (books / "a.txt").unlink()
        else:
            (books / "b.txt").rename(books / "c.txt")
        again = prepare(other_way)
        assert not again.cache_hit, change
        assert entries(cache) == [again.path.name, again.path.with_suffix(".json").name], change
    assert not first.path.exists()
    (asked,) = {meta["spec"] for meta in metas(cache)}
    here = books.stat()
    assert asked == (str(books.resolve()) if form == "folder" else str(books.resolve() / "*.txt")) + (
        f" ({here.st_dev}:{here.st_ino})")


def test_another_machines_entry_of_a_folder_at_the_same_path_is_not_pruned(tmp_path: Path, cache: Path) -> None:
    """Machines sharing a cache folder (a home on a network file system), each with its own copy of a folder at one
    path, took each other's entries for older ones of the same corpus, and encoded it again at every run. Here the
    other machine's folder is one moved away, and this one's is made anew at its path (so it, too, is taken for
    another folder, and its entry is kept)."""
    books = tmp_path / "books"
    write(books / "a.txt", "alpha " * 20)
    theirs = prepare(books).path
    books.rename(tmp_path / "elsewhere")
    write(books / "a.txt", "alpha " * 20)
    write(books / "b.txt", "beta " * 20)  # this machine's copy holds another file
    mine = prepare(books)
    assert not mine.cache_hit and theirs.exists() and mine.path.exists()
    write(books / "c.txt", "gamma " * 20)
    assert not prepare(books).cache_hit and theirs.exists() and not mine.path.exists()  # its own older one: pruned


def test_another_corpus_or_another_spec_of_the_same_files_keeps_its_entry(tmp_path: Path, cache: Path) -> None:
    """Runs of different folders (here of one name, so of one stem) and of a glob share a cache: a folder's new
    entry prunes its own older one, never theirs."""
    mine, theirs = tmp_path / "mine" / "books", tmp_path / "theirs" / "books"
    write(mine / "a.txt", "alpha " * 20)
    write(theirs / "a.txt", "alpha " * 20)
    kept = [prepare(theirs).path, prepare(f"{mine}/*").path]
    write(mine / "b.txt", "beta " * 20)
    prepare(mine)
    write(mine / "c.txt", "gamma " * 20)
    newest = prepare(mine)
    assert all(p.exists() for p in kept)
    assert entries(cache) == sorted(p.name for e in (*kept, newest.path) for p in (e, e.with_suffix(".json")))


def test_an_entry_from_before_metas_said_what_was_asked_for_is_pruned_by_its_files_alone(
    tmp_path: Path, cache: Path
) -> None:
    books = tmp_path / "books"
    write(books / "a.txt", "alpha " * 20)
    old_same_files = prepare(books).path
    meta_path = old_same_files.with_suffix(".json")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    del meta["spec"]
    meta["meta_crc32"] = data.cache.meta_checksum(meta)
    meta_path.write_text(json.dumps(meta), encoding="utf-8")
    assert prepare(books).cache_hit  # still whole: served
    write(books / "b.txt", "beta " * 20)
    newer = prepare(books)  # other files than the old entry's: an entry without a spec is not known to be this one's
    assert old_same_files.exists()
    (books / "b.txt").unlink()
    os.utime(books / "a.txt", ns=(0, 0))  # the same file again, another entry: the old comparison prunes the first
    prepare(books)
    assert not old_same_files.exists() and not newer.path.exists()


def test_an_edit_keeping_size_and_mtime_is_caught_by_the_content_hash(tmp_path: Path) -> None:
    f = write(tmp_path / "t.txt", "abcdefgh" * 10)
    prepare(f)
    before = f.stat()
    write(f, "hgfedcba" * 10)
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert f.stat().st_mtime_ns == before.st_mtime_ns and f.stat().st_size == before.st_size
    again = prepare(f)
    assert not again.cache_hit and text_of(again) == "hgfedcba" * 10


def edit_keeping_size_and_mtime(f: Path, at: int, byte: bytes) -> None:
    """Overwrite one byte of f, then put its mtime back (as rsync -t or cp -p of an edited copy would)."""
    before = f.stat()
    with f.open("r+b") as out:
        out.seek(at)
        out.write(byte)
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert f.stat().st_mtime_ns == before.st_mtime_ns and f.stat().st_size == before.st_size


def test_large_inputs_are_keyed_by_blocks_sampled_across_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs of 64 MB or more were keyed by size and mtime alone: an edit keeping both was served from the stale
    cache, and a --resume on it accepted, whatever the README promised."""
    monkeypatch.setattr(data.cachekey, "CONTENT_HASH_BELOW", 0)  # as if the inputs were large
    monkeypatch.setattr(data.cachekey, "SAMPLES", 3)  # blocks of 4 bytes at 0, 38 and 76 of the 80 bytes joined
    monkeypatch.setattr(data.cachekey, "SAMPLE_BYTES", 4)
    a, b = write(tmp_path / "c" / "a.txt", "abcdefgh" * 5), write(tmp_path / "c" / "b.txt", "ijklmnop" * 5)
    first = prepare(tmp_path / "c")
    for f, at in ((a, 0), (a, 39), (b, 36), (b, 39)):  # each in a block: a change the key sees
        edit_keeping_size_and_mtime(f, at, b"Z")
        again = prepare(tmp_path / "c")
        assert not again.cache_hit and again.fingerprint != first.fingerprint and "Z" in again.chars, (f.name, at)
        first = again
    for f, at in ((a, 20), (b, 0)):  # between blocks (one never runs on into the next file): not seen, as README says
        edit_keeping_size_and_mtime(f, at, b"Y")
        assert prepare(tmp_path / "c").cache_hit


def test_the_sampled_blocks_are_spread_evenly_and_read_at_most_samples_times_their_size() -> None:
    files = [data.sources.Source(Path(name), size, 0) for name, size in (("a", 100), ("b", 1), ("c", 899))]
    found = data.cachekey._samples(files, 5, 10)  # starts 0, 247, 495, 742, 990 of 1,000 bytes
    assert [(s.path.name, offsets) for s, offsets in found] == [("a", [0]), ("c", [146, 394, 641, 889])]
    assert data.cachekey._samples(files[:1], 64, 1 << 16) == [(files[0], [0])]  # smaller than a block: read once


def test_settings_that_change_the_ids_have_entries_of_their_own(tmp_path: Path) -> None:
    f = write(tmp_path / "t.txt", b"abc\xff abc")
    replaced = prepare(f, errors="replace")
    capped = prepare(f, errors="replace", max_vocab=2)
    assert replaced.path != capped.path and replaced.path.exists()
    assert prepare(f, errors="replace").cache_hit


def test_a_failed_encoding_leaves_no_file_behind(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def write_some_then_fail(inputs: object, errors: str, lookup: np.ndarray, out, *args: object, **kw: object) -> int:
        out.write(b"\0" * 10)
        raise KeyboardInterrupt

    monkeypatch.setattr(data.prepare, "write_ids", write_some_then_fail)
    with pytest.raises(KeyboardInterrupt):
        prepare(write(tmp_path / "t.txt", MIXED))
    assert entries(cache) == []  # neither a final name nor a partial file


@pytest.mark.parametrize("keeps_mtime", [False, True])
def test_a_file_changed_between_the_two_passes_is_refused(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, keeps_mtime: bool
) -> None:
    """Rewritten between counting its characters and writing their ids, as an rsync -t or a cp -p of a new copy of
    the same size does (mtime set back): only size and mtime were compared, so every character the count never saw
    became id 0, and the run trained on 'aaaa...' for 'zzzz...', silently."""
    f = write(tmp_path / "t.txt", "abcdefgh" * 64)
    count_chars = data.prepare.count_chars

    def count_then_rewrite(*args: object, **kwargs: object) -> np.ndarray:
        counts = count_chars(*args, **kwargs)
        st = f.stat()
        while f.stat().st_ctime_ns == st.st_ctime_ns:  # (a file system whose clock ticks coarsely: again, later)
            time.sleep(0.01)
            f.write_text("z" * st.st_size, encoding="utf-8")
            if keeps_mtime:
                os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        return counts

    monkeypatch.setattr(data.prepare, "count_chars", count_then_rewrite)
    with pytest.raises(DataError, match=r"t\.txt' changed while it was being read; run again$"):
        prepare(f)
    assert entries(cache) == []


def test_a_disk_too_full_for_the_meta_leaves_no_file_behind(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ids were renamed into place before the meta was written: a full disk left them there, as large as the
    corpus's ids, with no meta to find or prune them by, and the meta's partial file beside them."""
    open_part = data.prepare.open_part

    def no_space(_: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full_for_the_meta(folders: list[Path], stem: str, suffix: str, *args: object) -> tuple:
        folder, out, part = open_part(folders, stem, suffix, *args)
        if suffix == ".json":
            out.write = no_space
        return folder, out, part

    monkeypatch.setattr(data.prepare, "open_part", full_for_the_meta)
    with pytest.raises(DataError, match=r"cannot write the encoded corpus to .* \(No space left on device\); free"):
        prepare(write(tmp_path / "t.txt", MIXED))
    assert entries(cache) == []


def test_the_cache_falls_back_when_the_default_folder_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TINYCHAR_CACHE_DIR")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))
    user_cache = tmp_path / "user-cache"
    write(user_cache / "tinychar", "a file where the cache folder would go")  # mkdir fails even for root
    monkeypatch.setenv("XDG_CACHE_HOME", str(user_cache))
    corpus = prepare(write(tmp_path / "t.txt", MIXED))
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    assert corpus.path.parent == tmp_path / "temp" / f"tinychar-{uid}" / "encoded"
    assert any("cannot write to the cache folder" in note for note in corpus.notes)
    assert prepare(tmp_path / "t.txt").cache_hit


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="needs POSIX user ids (os.getuid)")
def test_the_temp_folders_cache_is_used_only_where_it_is_this_users_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its name is known to all: another user could make it first, or let everyone write in it, and put there ids
    that a run would read as its text; and the ids in it are the text, which others should not read."""
    monkeypatch.delenv("TINYCHAR_CACHE_DIR")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))
    user_cache = tmp_path / "user-cache"
    write(user_cache / "tinychar", "a file where the cache folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(user_cache))
    root = tmp_path / "temp" / f"tinychar-{os.getuid()}"
    corpus = prepare(write(tmp_path / "t.txt", MIXED))
    assert corpus.path.is_relative_to(root) and root.stat().st_mode & 0o777 == 0o700  # made for this user alone
    root.chmod(0o777)
    assert data.cachekey.cache_dirs(None)[0] == [user_cache / "tinychar" / "encoded"]  # neither read nor written
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: (_ for _ in ()).throw(RuntimeError("no home"))))
    with pytest.raises(DataError, match=f"^no folder for the encoded corpus: no home folder, and others can write in "
                                        f"'{re.escape(shown(str(root)))}'; remove it, or set data.cache_dir or "
                                        "TINYCHAR_CACHE_DIR"):
        data.cachekey.cache_dirs(None)
    root.chmod(0o700)
    assert data.cachekey.cache_dirs(None)[0] == [root / "encoded"]


def test_a_relative_xdg_cache_home_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The XDG base directory specification has a relative path ignored: it put the cache in whichever folder the
    command ran from, a project's or a corpus's among them."""
    from data.cachekey import cache_dirs

    monkeypatch.delenv("TINYCHAR_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    monkeypatch.chdir(tmp_path)
    assert cache_dirs(None)[0][0] == tmp_path / "home" / ".cache" / "tinychar" / "encoded"
    prepare(write(tmp_path / "t.txt", MIXED))
    assert not (tmp_path / "relative").exists()
    assert list((tmp_path / "home" / ".cache" / "tinychar" / "encoded").iterdir())


def test_a_read_only_cache_or_data_folder_is_left_alone_even_by_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TINYCHAR_CACHE_DIR")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))
    user_cache, corpora = tmp_path / "user-cache", tmp_path / "corpora"
    user_cache.mkdir()
    write(corpora / "t.txt", MIXED)
    monkeypatch.setenv("XDG_CACHE_HOME", str(user_cache))
    monkeypatch.setenv("TINYCHAR_DATA_DIR", str(corpora))
    monkeypatch.chdir(tmp_path)
    user_cache.chmod(0o555)
    corpora.chmod(0o555)
    try:
        corpus = prepare("t.txt")  # found in TINYCHAR_DATA_DIR
    finally:
        user_cache.chmod(0o755)
        corpora.chmod(0o755)
    assert list(user_cache.iterdir()) == [] and [p.name for p in corpora.iterdir()] == ["t.txt"]
    assert corpus.path.is_relative_to(tmp_path / "temp") and text_of(corpus) == MIXED


def test_a_chosen_cache_folder_is_used_or_refused(tmp_path: Path) -> None:
    f = write(tmp_path / "t.txt", MIXED)
    assert prepare(f, cache_dir=str(tmp_path / "mine")).path.parent == tmp_path / "mine"
    blocked = write(tmp_path / "blocked", "a file, not a folder")
    with pytest.raises(DataError, match="cannot write the encoded corpus to .*blocked.*set data.cache_dir"):
        prepare(f, cache_dir=str(blocked))


def test_the_cache_entry_describes_itself(tmp_path: Path) -> None:
    corpus = prepare(write(tmp_path / "t.txt", MIXED))
    meta = json.loads(corpus.path.with_suffix(".json").read_text(encoding="utf-8"))
    assert meta["chars"] == corpus.chars and meta["n_tokens"] == corpus.n_tokens and meta["dtype"] == "|u1"
    assert meta["sources"][0][0] == str((tmp_path / "t.txt").resolve())


# --- damaged entries -------------------------------------------------------------------------------------------------


def damage(path: Path, how: str) -> None:
    """Damage a cached ids file in place, as a disk error, a stray write or a copy cut short would."""
    if how == "truncated":
        os.truncate(path, path.stat().st_size - 3)
        return
    with path.open("r+b") as f:
        f.seek(4)
        first = f.read(1)[0]
        f.seek(4)
        # another id of the vocabulary (the text below has 8 characters, ids 0-7), or one beyond it
        f.write(bytes([(first + 1) % 8 if how == "valid id" else 0xFF]))


@pytest.mark.parametrize("how", ["valid id", "id beyond the vocabulary", "truncated"])
def test_a_damaged_cache_entry_is_encoded_again_and_said(tmp_path: Path, how: str) -> None:
    text = "abcdefgh" * 64
    first = prepare(write(tmp_path / "t.txt", text))
    damage(first.path, how)
    again = prepare(tmp_path / "t.txt")
    assert not again.cache_hit and "cached" not in again.description
    assert text_of(again) == text and again.fingerprint == first.fingerprint
    [note] = again.notes
    why = "holds 509 bytes, not 512" if how == "truncated" else "its CRC-32 is"
    assert note.startswith(f"data: the cached copy '{first.path}' was damaged (") and why in note
    assert note.endswith("; it has been encoded again")
    assert prepare(tmp_path / "t.txt").cache_hit  # and the new copy is trusted


def test_a_cached_copy_that_cannot_be_read_is_not_called_damaged(tmp_path: Path, monkeypatch) -> None:
    """An ids file without read permission (a shared cache folder, say) was said to be damaged; it is encoded again
    all the same, with a note that says what was wrong."""
    text = "abcdefgh" * 64
    first = prepare(write(tmp_path / "t.txt", text))
    real_open = os.open

    def no_permission(path, flags, *args, **kwargs):  # as chmod 000 would, for a user other than root
        if Path(path) == first.path:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_permission)
    again = prepare(tmp_path / "t.txt")
    monkeypatch.undo()
    assert not again.cache_hit and text_of(again) == text
    assert again.notes == (f"data: the cached copy '{first.path}' could not be read (Permission denied); it has been "
                           f"encoded again",)


def test_an_ids_file_that_is_a_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    """fdopen refused the folder with an OSError naming its descriptor: 'error: cannot use '3' (Is a directory)'."""
    first = prepare(write(tmp_path / "t.txt", "abcdefgh" * 64))
    first.path.unlink()
    first.path.mkdir()
    with pytest.raises(DataError) as info:
        prepare(tmp_path / "t.txt")  # the folder cannot be replaced by the new ids
    # it said "(Is a directory); free some space", naming the cache folder
    assert str(info.value) == (f"TINYCHAR_CACHE_DIR: cannot write the encoded corpus to {quoted(first.path)}: a folder "
                               "of that name is in the way; move it away, or set TINYCHAR_CACHE_DIR to another folder")
    first.path.rmdir()  # once it is gone, the text is encoded again
    assert text_of(prepare(tmp_path / "t.txt")) == "abcdefgh" * 64


def test_an_entry_without_a_checksum_is_not_trusted(tmp_path: Path) -> None:
    f = write(tmp_path / "t.txt", MIXED)
    first = prepare(f)
    meta_path = first.path.with_suffix(".json")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    assert meta["crc32"] == zlib.crc32(first.path.read_bytes())
    del meta["crc32"]  # as the meta of an older tinychar, had its key been the same
    meta_path.write_text(json.dumps(meta), encoding="utf-8")
    first.path.write_bytes(b"\0" * first.path.stat().st_size)
    again = prepare(f)
    assert not again.cache_hit and text_of(again) == MIXED


def rewrite_meta(ids_path: Path, change: str) -> None:
    """Change a cached entry's meta as a disk error or a stray edit would; "old" first makes it a meta from before
    metas carried their own checksum (the entries tinychar wrote until then), and the change follows the "+"."""
    meta_path = ids_path.with_suffix(".json")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    old, _, change = change.rpartition("+")
    if old:
        meta.pop("meta_crc32", None)
    if change == "vocabulary cut short":  # the ids reach past it: an embedding lookup failed in the middle of training
        meta["chars"] = meta["chars"][:-5]
    elif change == "another character":  # as many characters, one of them wrong: every 'h' read as 'z', silently
        meta["chars"] = [*meta["chars"][:-1], "z"]
    elif change == "two characters swapped":
        meta["chars"][0], meta["chars"][1] = meta["chars"][1], meta["chars"][0]
    meta_path.write_text(json.dumps(meta), encoding="utf-8")


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ("vocabulary cut short", "its meta does not match its own checksum"),
        ("another character", "its meta does not match its own checksum"),
        ("two characters swapped", "its meta does not match its own checksum"),
    ],
)
def test_a_damaged_meta_is_encoded_again_and_said(tmp_path: Path, cache: Path, change: str, why: str) -> None:
    """Only the ids were checksummed: a meta with a wrong vocabulary was served as cached, and training either
    stopped with IndexError in the embedding or learnt the text with the wrong characters."""
    text = "abcdefgh" * 64
    first = prepare(write(tmp_path / "t.txt", text))
    rewrite_meta(first.path, change)
    again = prepare(tmp_path / "t.txt")
    assert not again.cache_hit and text_of(again) == text and again.chars == first.chars
    assert again.fingerprint == first.fingerprint
    damaged = first.path.with_suffix(".json")
    assert again.notes == (f"data: the cached copy '{damaged}' was damaged ({why}); it has been encoded again",)
    assert prepare(tmp_path / "t.txt").cache_hit  # and the new copy is trusted
    assert entries(cache) == [first.path.name, first.path.with_suffix(".json").name]


@pytest.mark.parametrize("dtype", [">u2", "<u8"])
def test_ids_of_a_byte_order_or_width_the_encoder_never_writes_are_encoded_again(tmp_path: Path, cache: Path,
                                                                                 dtype: str) -> None:
    """A meta saying '>u2' (big-endian), its checksums made to agree with it and with the ids, was a traceback from
    numpy ("byte order different from the native byte order"); '<u8' was trained on."""
    text = "abcdefgh" * 64
    first = prepare(write(tmp_path / "t.txt", text))
    meta_path = first.path.with_suffix(".json")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    ids = np.frombuffer(first.path.read_bytes(), dtype=meta["dtype"]).astype(dtype).tobytes()
    first.path.write_bytes(ids)
    meta.update(dtype=dtype, crc32=zlib.crc32(ids))
    meta["meta_crc32"] = data.cache.meta_checksum(meta)
    meta_path.write_text(json.dumps(meta), encoding="utf-8")
    again = prepare(tmp_path / "t.txt")
    assert not again.cache_hit and text_of(again) == text
    assert again.notes == (f"data: the cached copy '{meta_path}' was damaged (its ids are said to be {dtype}, not "
                           "unsigned little-endian integers of 1, 2 or 4 bytes); it has been encoded again",)


@pytest.mark.parametrize("content", [b"", b'{"format": 3, "key": "', b"\xff\xfe garbage", b"[1, 2, 3]", b"null"])
def test_a_meta_cut_short_or_overwritten_is_encoded_again_and_said(tmp_path: Path, cache: Path, content: bytes) -> None:
    """A meta that was no JSON (a copy cut short, a stray write) was passed over without the note a damaged entry
    gets."""
    text = "abcdefgh" * 64
    first = prepare(write(tmp_path / "t.txt", text))
    meta_path = first.path.with_suffix(".json")
    meta_path.write_bytes(content)
    again = prepare(tmp_path / "t.txt")
    assert not again.cache_hit and text_of(again) == text and again.fingerprint == first.fingerprint
    assert again.notes == (f"data: the cached copy {quoted(meta_path, LOG_PATH)} was damaged (its meta is not the JSON "
                           "the encoder wrote); it has been encoded again",)
    assert prepare(tmp_path / "t.txt").cache_hit and entries(cache) == [first.path.name, meta_path.name]


def test_a_relative_tinychar_cache_dir_is_refused_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It put the cache in whichever folder the command ran from (a repository's, a corpus's)."""
    monkeypatch.setenv("TINYCHAR_CACHE_DIR", "relcache")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as info:
        prepare(write(tmp_path / "t.txt", MIXED))
    assert str(info.value) == ("TINYCHAR_CACHE_DIR: 'relcache' is a relative path, which would put a cache in each "
                               "folder a run starts from (a repository, a corpus); give an absolute path")
    assert entries(tmp_path) == ["t.txt"]
    monkeypatch.setenv("TINYCHAR_CACHE_DIR", "~/cache")  # a home folder is no relative path
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert prepare(tmp_path / "t.txt").path.parent == tmp_path / "home" / "cache"


@pytest.mark.parametrize("what", ["its own", "another entry's"])
def test_a_meta_larger_than_any_is_not_read_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    """A sparse file of 100 GB in a meta's place was read whole: a MemoryError traceback (or the memory filled), in
    the lookup or in the pruning of the same text's older entries after an encoding."""
    text = "abcdefgh" * 64
    first = prepare(write(tmp_path / "t.txt", text))
    meta_path = first.path.with_suffix(".json")
    if what == "another entry's":
        meta_path = meta_path.with_name(f"t.txt-{'0' * 32}.json")
        first.path.with_suffix(".json").unlink()
    monkeypatch.setattr(data.cache, "META_MAX_BYTES", 1 << 20)
    with meta_path.open("wb") as f:
        f.truncate(100 << 30)  # sparse: no disk used
    reads = []
    real_read = data.cache._read_meta

    def read(path: Path) -> dict:
        try:
            return real_read(path)
        except ValueError as e:
            reads.append(str(e))
            raise

    monkeypatch.setattr(data.cache, "_read_meta", read)
    again = prepare(tmp_path / "t.txt")
    assert not again.cache_hit and text_of(again) == text and again.fingerprint == first.fingerprint
    assert reads == [f"{meta_path} is larger than any meta (1,048,576 bytes)"]
    assert prepare(tmp_path / "t.txt").cache_hit


@pytest.mark.parametrize(("field", "value"), [("n_tokens", "1e999"), ("n_tokens", "-1e999"), ("sources", "[[]]"),
                                              ("sources", '[""]')])
def test_a_meta_of_absurd_values_is_passed_over_not_a_traceback(tmp_path: Path, field: str, value: str) -> None:
    """An infinite count was an OverflowError traceback in every run; another meta of the same text whose source is
    empty was an IndexError traceback when the new encoding pruned the old ones."""
    text = "abcdefgh" * 64
    first = prepare(write(tmp_path / "t.txt", text))
    meta_path = first.path.with_suffix(".json")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    if field == "sources":  # another entry's, met when the new one prunes the text's older entries
        meta_path.unlink()
        meta_path = meta_path.with_name(f"t.txt-{'0' * 32}.json")
    meta_path.write_text(json.dumps({**meta, field: json.loads(value)}), encoding="utf-8")
    again = prepare(tmp_path / "t.txt")
    assert not again.cache_hit and text_of(again) == text and again.fingerprint == first.fingerprint
    assert prepare(tmp_path / "t.txt").cache_hit


def test_a_folder_in_the_metas_place_leaves_no_ids_behind(tmp_path: Path, cache: Path) -> None:
    """The refusal was right, but the ids had been renamed into place first: as large as the corpus's ids, with no
    meta to name them, never pruned."""
    first = prepare(write(tmp_path / "t.txt", "abcdefgh" * 64))
    first.path.unlink()
    meta_path = first.path.with_suffix(".json")
    meta_path.unlink()
    meta_path.mkdir()
    with pytest.raises(DataError, match="a folder of that name is in the way"):
        prepare(tmp_path / "t.txt")
    assert entries(cache) == [meta_path.name]


@pytest.mark.parametrize("what", ["a pipe", "JSON nested past the recursion limit", "another entry's meta, a pipe"])
def test_a_meta_that_is_no_json_file_is_passed_over_not_read_forever(tmp_path: Path, what: str) -> None:
    """A meta was read as any file: one that was a pipe waited forever (when looked up, or pruned as another entry
    of the same text), one linked to /dev/zero filled the memory, and '[' * 100,000 was a RecursionError."""
    text = "abcdefgh" * 64
    first = prepare(write(tmp_path / "t.txt", text))
    meta_path = first.path.with_suffix(".json")
    if what == "another entry's meta, a pipe":  # an older entry of the same text: the new one prunes it
        meta_path = meta_path.with_name(f"t.txt-{'0' * 32}.json")
        first.path.with_suffix(".json").unlink()
    meta_path.unlink(missing_ok=True)
    if what.startswith("JSON"):
        meta_path.write_text("[" * 100_000, encoding="utf-8")
    else:
        os.mkfifo(meta_path)
    again = within(prepare, tmp_path / "t.txt")
    assert not again.cache_hit and text_of(again) == text and again.fingerprint == first.fingerprint
    assert within(prepare, tmp_path / "t.txt").cache_hit  # the new meta took the place of what was there


@pytest.mark.parametrize("change", ["old+", "old+another character", "old+vocabulary cut short"])
def test_an_entry_from_before_metas_carried_a_checksum_is_encoded_again(tmp_path: Path, change: str) -> None:
    """Such a meta's vocabulary was trusted if it was sorted: one character changed for another that kept it sorted
    (a flipped bit turns 'z' into '{') trained the run on the wrong characters, without a word."""
    text = "abcdefgh" * 64  # its last character made 'z' keeps the vocabulary sorted
    f = write(tmp_path / "t.txt", text)
    first = prepare(f)
    assert "meta_crc32" in json.loads(first.path.with_suffix(".json").read_text(encoding="utf-8"))
    rewrite_meta(first.path, change)
    again = prepare(f)
    assert not again.cache_hit and again.notes == () and text_of(again) == text and again.chars == first.chars
    assert again.fingerprint == first.fingerprint
    assert prepare(f).cache_hit  # the new entry, with its checksum, is served


def test_the_largest_id_is_found_in_the_checksums_pass_whatever_the_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = np.arange(1000, dtype="<u2")[::-1].copy()
    ids[517] = 4321
    path = write(tmp_path / "ids", ids.tobytes())
    monkeypatch.setattr(data.idsfile, "_CRC_PIECE", 7)  # every other piece cuts an id in two
    with path.open("rb", buffering=0) as f:
        assert data.idsfile.scan(f, np.dtype("<u2")) == (zlib.crc32(ids.tobytes()), 4321)
        assert data.idsfile.scan(f) == (zlib.crc32(ids.tobytes()), -1)


def test_the_checksum_is_of_the_whole_file_in_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    content = bytes(range(256)) * 100
    path = write(tmp_path / "ids", content)
    monkeypatch.setattr(data.idsfile, "_CRC_PIECE", 7)  # pieces that never line up with the file's end
    with path.open("rb", buffering=0) as f:
        f.read(10)  # from the start, wherever the file was left
        assert data.idsfile.scan(f)[0] == zlib.crc32(content)


# --- fingerprint -----------------------------------------------------------------------------------------------------


def test_the_fingerprint_names_the_text_and_vocabulary_not_where_they_are(tmp_path: Path) -> None:
    here = prepare(write(tmp_path / "here" / "t.txt", MIXED), cache_dir=str(tmp_path / "cache-1"))
    there = prepare(write(tmp_path / "there" / "other.txt", MIXED), cache_dir=str(tmp_path / "cache-2"))
    assert here.path.parent != there.path.parent and here.fingerprint == there.fingerprint
    assert len(here.fingerprint) == 16 and prepare(tmp_path / "here" / "t.txt").fingerprint == here.fingerprint

    edited = prepare(write(tmp_path / "edited.txt", MIXED.replace("line two", "line Two")))
    assert edited.n_tokens == here.n_tokens and edited.fingerprint != here.fingerprint
    # the same ids, a vocabulary with one more character (after every other, so no id moves)
    wider = prepare(tmp_path / "here" / "t.txt", vocab=[*here.chars, "\U0010ffff"])
    assert torch.equal(wider.ids, here.ids) and wider.fingerprint != here.fingerprint


# --- the cache folder ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("folder", "why"),
    [
        ("x" * 300, "(File name too long)"),
        ("fifo", "(it is a pipe (a FIFO, or <(command) in a shell), not a folder)"),
        ("file", "(it is a file, not a folder)"),
        ("file/under", "(Not a directory)"),
        ("new\nline/" + "y" * 300, "(File name too long)"),
        ("dangling", "(it is a symbolic link to 'nowhere', which leads to no folder)"),  # both were 'File exists'
        ("loop", "(it is a symbolic link to 'loop', which leads to no folder)"),
        ("nul\0", "(it holds a character no file name can)"),  # a config file's "\0": a traceback
        ("surrogate\ud800", "(it holds a character no file name can)"),
    ],
)
def test_a_cache_folder_that_cannot_be_one_is_refused_in_one_line(tmp_path: Path, folder: str, why: str) -> None:
    f = write(tmp_path / "t.txt", MIXED)
    os.mkfifo(tmp_path / "fifo")
    write(tmp_path / "file", "a file")
    (tmp_path / "dangling").symlink_to("nowhere")
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(DataError) as info:
        prepare(f, cache_dir=str(tmp_path / folder))
    message = str(info.value)
    assert message.startswith("data.cache_dir: cannot write the encoded corpus to '") and why in message
    assert message.endswith("; set data.cache_dir to a writable folder") and "\n" not in message
    assert len(message) < 300


def test_a_cache_folder_from_tinychar_cache_dir_is_blamed_on_that_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = write(tmp_path / "t.txt", MIXED)
    monkeypatch.setenv("TINYCHAR_CACHE_DIR", str(write(tmp_path / "file", "a file")))
    with pytest.raises(DataError) as info:
        prepare(f)
    message = str(info.value)
    assert message.startswith("TINYCHAR_CACHE_DIR: cannot write the encoded corpus to '")
    assert "data.cache_dir" not in message
    assert message.endswith("; set TINYCHAR_CACHE_DIR to a writable folder")
    with pytest.raises(DataError, match=r"^data\.cache_dir: cannot write .*; set data\.cache_dir to a writable"):
        prepare(f, cache_dir=str(tmp_path / "file"))  # the config's choice wins, and is the one named


@pytest.mark.parametrize("setting", ["data.cache_dir", "TINYCHAR_CACHE_DIR", "XDG_CACHE_HOME", "TINYCHAR_DATA_DIR"])
def test_a_home_folder_of_an_unknown_user_is_one_line_naming_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    """'~nouser/x' made pathlib's expanduser raise RuntimeError: a traceback instead of a line."""
    f = write(tmp_path / "t.txt", MIXED)
    value = "~no_such_user_of_tinychar/x"
    settings: dict[str, object] = {}
    if setting == "data.cache_dir":
        settings["cache_dir"] = value
    else:
        if setting == "XDG_CACHE_HOME":
            monkeypatch.delenv("TINYCHAR_CACHE_DIR")
        monkeypatch.setenv(setting, value)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as info:
        prepare("t.txt" if setting == "TINYCHAR_DATA_DIR" else f, **settings)
    assert str(info.value) == (
        f"{setting}: '{value}' starts with the home folder of 'no_such_user_of_tinychar', a user this machine does "
        "not know; give the folder's full path"
    )


def test_train_py_says_an_unknown_home_folder_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import train

    f = write(tmp_path / "t.txt", MIXED * 20)
    args = [f"data.path={f}", "data.cache_dir=~no_such_user_of_tinychar/x", f"out_dir={tmp_path / 'run'}"]
    assert train.main(args, progress=False) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: data.cache_dir: '~no_such_user_of_tinychar/x' starts with the home folder of ")
    assert len(err.splitlines()) == 1 and not (tmp_path / "run").exists()


# --- partial files left by killed encodings --------------------------------------------------------------------------


def test_partial_files_of_dead_encoders_are_reaped_once_stale_and_nothing_else(tmp_path: Path, cache: Path) -> None:
    """A killed encoding left '.<stem>.<pid>.<hex>.ids.part' in the cache folder for ever, up to the corpus's size."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead, alive = child.pid, os.getppid()  # a process just ended here, and one that lives (this one's parent)
    hour_ago = time.time() - data.cache.STALE_PART_S - 60
    names = {
        "stale": f".t.txt.{dead}.0123abcd.ids.part",
        "stale meta of another corpus": f".other.txt.{dead}.89abcdef.json.part",
        "fresh": f".t.txt.{dead}.4567cdef.ids.part",  # may be a live encoder on another machine sharing the folder
        "live": f".t.txt.{alive}.0a1b2c3d.ids.part",
        "not ours": f".t.txt.{dead}.0123abcd.ids.part.keep",
        "a user's": "notes.part",
    }
    cache.mkdir()
    for label, name in names.items():
        write(cache / name, b"\0" * 100)
        if label != "fresh":
            os.utime(cache / name, (hour_ago, hour_ago))
    prepare(write(tmp_path / "t.txt", MIXED))
    left = set(entries(cache))
    assert names["stale"] not in left and names["stale meta of another corpus"] not in left
    assert {names[k] for k in ("fresh", "live", "not ours", "a user's")} <= left
    assert not [n for n in left if n.endswith(".part") and f".{os.getpid()}." in n]  # and this run left none


def test_a_live_encoder_on_this_machine_keeps_its_partial_file_however_old(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    part = write(folder / f".t.txt.{os.getpid()}.0123abcd.ids.part", b"\0")
    os.utime(part, (0, 0))  # stopped for decades
    assert data.cache.reap_parts(folder) == [] and part.exists()


def test_a_full_disk_names_the_partial_files_a_killed_encoding_left_there(tmp_path: Path) -> None:
    """Such a file is kept an hour (its encoder may live on another machine), and `ls` does not show it: the line
    only said to free some space."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    folder = tmp_path / "c"
    write(folder / f".zh.txt.{child.pid}.5e457059.ids.part", b"\0" * (3 << 20))
    write(folder / f".t.txt.{os.getpid()}.0123abcd.ids.part", b"\0" * (5 << 20))  # this run's own, alive
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert str(data.cache.unwritten("data.cache_dir", folder, (), full)) == (
        f"data.cache_dir: cannot write the encoded corpus to {quoted(folder)} (No space left on device); 1 partial "
        f"file that an encoding killed midway left there holds 3.0 MB ('.zh.txt.{child.pid}.5e457059.ids.part'): "
        f"remove it if no other machine is encoding into that folder, free some space, or set data.cache_dir to "
        f"another folder")
    (folder / f".zh.txt.{child.pid}.5e457059.ids.part").write_bytes(b"\0" * 300)
    assert "left there holds 300 bytes (" in str(data.cache.unwritten("data.cache_dir", folder, (), full))
    assert str(data.cache.unwritten("data.cache_dir", tmp_path / "empty", (), full)).endswith(
        "(No space left on device); free some space or set data.cache_dir to another folder")


# --- byte-order marks: entries and runs from before they were left out -----------------------------------------------


def old_entry(folder: Path, f: Path, text: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """The entry format 2 (before byte-order marks were left out) wrote for text in f: U+FEFF a character of it."""
    inputs = data.sources.resolve_inputs(f)
    settings = {"errors": "strict", "max_vocab": None, "vocab": None}
    with monkeypatch.context() as m:
        m.setattr(data.cachekey, "FORMAT_VERSION", 2)
        key = data.cachekey.cache_key(inputs, settings)
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], dtype="|u1").tobytes()
    stem = data.prepare._stem(inputs)
    meta = {
        "format": 2, "key": key, "dtype": "|u1", "n_tokens": len(text), "crc32": zlib.crc32(ids), "chars": chars,
        "replaced_chars": 0, "replaced_occurrences": 0, "settings": settings,
        "sources": [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns]],
    }
    folder.mkdir(parents=True, exist_ok=True)
    write(folder / f"{stem}-{key}.ids", ids)
    write(folder / f"{stem}-{key}.json", json.dumps(meta))
    return folder / f"{stem}-{key}.ids", folder / f"{stem}-{key}.json"


def test_an_entry_encoded_before_byte_order_marks_were_left_out_is_not_served_and_is_pruned(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = write(tmp_path / "t.txt", "\ufeffhello world\n")
    stale = old_entry(cache, f, "\ufeffhello world\n", monkeypatch)
    corpus = prepare(f)
    assert not corpus.cache_hit and text_of(corpus) == "hello world\n" and "\ufeff" not in corpus.chars
    assert not any(p.exists() for p in stale)  # of an older format, for the same file: nothing reads it any more


def test_a_run_trained_on_byte_order_marks_resumes_on_its_own_text(tmp_path: Path) -> None:
    """A run trained before marks were left out knows U+FEFF, and its fingerprint is of the ids with the marks."""
    text = "\ufeffhello world\n"
    f = write(tmp_path / "t.txt", text)
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], dtype="|u1")
    then = data.prepare.fingerprint(zlib.crc32(ids.tobytes()), len(text), chars)

    def resumed(trained_on: str | None) -> data.prepare.Corpus:
        cfg = data.DataConfig(path=str(f))
        return data.prepare_corpus(cfg, 2, progress=False, vocab=chars, trained_on=trained_on)

    corpus = resumed(then)
    assert corpus.fingerprint == then and text_of(corpus) == text
    assert any("read with the byte-order marks (U+FEFF) that start its files kept" in n for n in corpus.notes)
    for other in (None, "0123456789abcdef"):  # a new use of the vocabulary, or other text: read as tinychar now reads
        assert text_of(resumed(other)) == "hello world\n"
