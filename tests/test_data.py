"""Tests for data/: tokenizer, config, corpus loading and caching, splits and batches. CPU, tiny inputs."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from data import (
    SHAKESPEARE_SHA256,
    CharTokenizer,
    DataConfig,
    DataError,
    data_dir,
    get_batch,
    load_corpus,
    prepare_corpus,
    read_text,
    shakespeare_path,
    split_ids,
)
from data.corpus import check_shakespeare
from data.paths import quoted

SHAKESPEARE_SIZE = 1_115_394
MIXED = "Γειά σου κόσμε, 你好世界 😀🎉 e\u0301 n\u0303\r\nline two\r\n\tend\u00a0"


ROOT = Path(__file__).resolve().parents[1]


def files_in(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


# --- tokenizer --------------------------------------------------------------------------------------------------


def test_round_trip_of_any_unicode_text() -> None:
    tok = CharTokenizer.from_text(MIXED)
    ids = tok.encode(MIXED)
    assert tok.decode(ids) == MIXED
    assert tok.decode(torch.tensor(ids)) == MIXED
    assert len(ids) == len(MIXED)  # one id per code point: "😀" is one id, "e\u0301" two, "\r\n" two
    assert "\r" in tok.chars and "😀" in tok.chars and "\u0301" in tok.chars


def test_vocabulary_is_sorted_and_unique() -> None:
    tok = CharTokenizer.from_text("banana 😀 ab\u00e9")
    assert tok.chars == sorted(set("banana 😀 ab\u00e9"))
    assert tok.vocab_size == len(tok.chars) == 6
    assert tok.encode("ab") == [tok.chars.index("a"), tok.chars.index("b")]
    assert CharTokenizer(tok.chars) == tok


def test_constructor_refuses_unsorted_duplicate_or_multi_character_vocabularies() -> None:
    for bad in (["b", "a"], ["a", "a"], ["ab"], [""]):
        with pytest.raises(ValueError):
            CharTokenizer(bad)


def test_unknown_characters_are_listed_and_refused() -> None:
    tok = CharTokenizer.from_text("hello world")
    assert tok.unknown("hello world") == []
    assert tok.unknown("Hello, w😀rld!") == sorted(["H", ",", "😀", "!"])
    with pytest.raises(ValueError, match="'H'.*'😀'|'😀'.*'H'"):
        tok.encode("Hello w😀rld")
    with pytest.raises(ValueError, match="'Z'"):
        tok.encode_tensor("Z")
    # A code point above every one in the vocabulary takes another path through the lookup than one below it.
    with pytest.raises(ValueError, match="'\\\\U0010ffff'|'\U0010ffff'"):
        tok.encode("\U0010ffff")


def test_encode_tensor_equals_encode() -> None:
    tok = CharTokenizer.from_text(MIXED)
    tensor = tok.encode_tensor(MIXED)
    assert tensor.dtype == torch.int64 and tensor.dim() == 1
    assert tensor.tolist() == tok.encode(MIXED)
    assert tok.encode_tensor("").shape == (0,)


def test_decode_refuses_ids_outside_the_vocabulary() -> None:
    tok = CharTokenizer.from_text("abc")
    for bad in ([3], [-1], torch.tensor([0, 7])):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tok.decode(bad)
    # an id past int64 was an OverflowError, a uint64 one past 2**63 named as negative, and 1.7 decoded as 1
    for bad, said in (([0, 2**63], f"id {2**63} is"), (np.array([2**63 + 5], dtype=np.uint64), f"id {2**63 + 5} is"),
                      ([1.7], "integer ids, got 1.7"), ([True], "integer ids, got True"),
                      ([0, None], "integer ids, got None")):  # None was taken for no odd id: a TypeError
        with pytest.raises(ValueError, match=re.escape(said)):
            tok.decode(bad)
    assert tok.decode(np.array([2, 0], dtype=np.uint64)) == tok.decode([2, 0]) == "ca" and tok.decode([]) == ""
    with pytest.raises(ValueError, match=re.escape("decode needs a 1-D integer tensor, got 1-D torch.bool")):
        tok.decode(torch.tensor([True, False]))  # a tensor of booleans as a list of them: it decoded as [1, 0]


# --- config -----------------------------------------------------------------------------------------------------


def test_data_config_defaults_and_help() -> None:
    cfg = DataConfig()
    assert (cfg.path, cfg.dataset, cfg.val_fraction) == (None, "shakespeare_char", 0.1)
    from dataclasses import fields

    assert all(f.metadata.get("help") for f in fields(DataConfig))
    with pytest.raises(TypeError):
        DataConfig("x.txt")  # keyword-only


@pytest.mark.parametrize("value", [0.0, 1.0, 1.5, -0.1, float("nan")])
def test_data_config_refuses_val_fraction_outside_zero_one(value: float) -> None:
    with pytest.raises(ValueError, match="data.val_fraction must be between 0 and 1 \\(exclusive\\), got"):
        DataConfig(val_fraction=value)


def test_data_config_refuses_unknown_dataset_and_no_source() -> None:
    with pytest.raises(ValueError, match="shakespeare_char.*'tiny_stories'"):
        DataConfig(dataset="tiny_stories")
    with pytest.raises(ValueError, match="data.path.*data.dataset"):
        DataConfig(path=None, dataset=None)
    assert DataConfig(path="x.txt", dataset=None).path == "x.txt"


def test_data_config_new_fields_default_and_validate() -> None:
    cfg = DataConfig()
    assert (cfg.errors, cfg.max_vocab, cfg.cache_dir) == ("strict", None, None)
    for bad, message in [
        ({"errors": "ignore"}, "data.errors must be one of strict, replace, got 'ignore'"),
        ({"max_vocab": 1}, "data.max_vocab must be >= 2"),
        ({"max_vocab": True}, "data.max_vocab must be >= 2"),
        ({"cache_dir": " "}, "data.cache_dir is empty"),
    ]:
        with pytest.raises(ValueError, match=message):
            DataConfig(**bad)


# --- read_text --------------------------------------------------------------------------------------------------


def test_read_text_keeps_the_text_exactly(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_bytes(MIXED.encode("utf-8"))
    assert read_text(f) == MIXED  # "\r\n" untouched


def test_read_text_missing_file_suggests_a_close_name(tmp_path: Path) -> None:
    (tmp_path / "input.txt").write_text("hello")
    with pytest.raises(DataError, match=r"no such file '.*inptu\.txt'; did you mean '.*input\.txt'\?"):
        read_text(tmp_path / "inptu.txt")
    with pytest.raises(DataError, match="no such file") as info:
        read_text(tmp_path / "completely_different.md")
    assert "did you mean" not in str(info.value)


def test_read_text_refuses_a_folder_and_an_empty_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="is a folder"):
        read_text(tmp_path)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="is empty"):
        read_text(tmp_path / "empty.txt")


def test_read_text_refuses_non_utf8_naming_the_offset(tmp_path: Path) -> None:
    f = tmp_path / "latin1.txt"
    f.write_bytes(b"caf\xe9 au lait")
    with pytest.raises(DataError, match="not UTF-8.*offset 3.*convert it to UTF-8") as info:
        read_text(f)
    assert "\n" not in str(info.value)


def test_read_text_refuses_a_text_shorter_than_one_window(tmp_path: Path) -> None:
    f = tmp_path / "short.txt"
    f.write_text("abcd")
    with pytest.raises(DataError, match="has 4 characters.*block_size \\+ 1 = 9"):
        read_text(f, min_chars=9)
    assert read_text(f, min_chars=4) == "abcd"


def test_load_corpus_prefers_path(tmp_path: Path) -> None:
    f = tmp_path / "mine.txt"
    f.write_text("my own text")
    text, source = load_corpus(DataConfig(path=str(f)))
    assert text == "my own text" and str(f) in source


@pytest.mark.parametrize("errors", ["strict", "replace"])
def test_load_corpus_gives_the_text_a_run_trains_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    errors: str) -> None:
    # A leading byte-order mark left out and data.errors honoured, as prepare_corpus's streaming reader does: the
    # mark was kept as U+FEFF, and replace refused a Latin-1 byte as strict does.
    monkeypatch.setenv("TINYCHAR_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "bom.txt"
    content = b"\xef\xbb\xbf" + MIXED.encode("utf-8") + (b" caf\xe9" if errors == "replace" else b"") + b"\xef\xbb\xbf."
    f.write_bytes(content)
    cfg = DataConfig(path=str(f), errors=errors)
    text, _ = load_corpus(cfg)
    corpus = prepare_corpus(cfg, 2, progress=False)
    assert text == CharTokenizer(corpus.chars).decode(corpus.ids)
    assert text == content[3:].decode("utf-8", errors) and text.endswith("\ufeff.")  # a mark further in is text
    if errors == "strict":  # the offset still counts the mark's three bytes
        f.write_bytes(b"\xef\xbb\xbfcaf\xe9")
        with pytest.raises(DataError, match="byte 0xe9 at offset 6, line 1"):
            load_corpus(cfg)


# --- split and batches ------------------------------------------------------------------------------------------


def test_split_sizes() -> None:
    ids = torch.arange(100)
    train, val = split_ids(ids, 0.1, block_size=8)
    assert len(train) == 90 and len(val) == 10
    assert torch.equal(torch.cat([train, val]), ids)  # validation is the end of the text
    # rounded, not cut: a quarter of 103 is 25.75, so 26 (a fraction of .25, as 101 gave, reads the same either way)
    train, val = split_ids(torch.arange(103), 0.25, block_size=8)
    assert len(val) == 26 and len(train) == 77


def test_split_refuses_a_text_too_short_for_the_block_size() -> None:
    with pytest.raises(DataError, match="too short for block_size 10 with val_fraction 0.1 \\(100 characters"):
        split_ids(torch.arange(100), 0.1, block_size=10)  # validation would hold 10 ids, fewer than 11
    split_ids(torch.arange(110), 0.1, block_size=10)


def test_get_batch_shapes_and_next_character_targets() -> None:
    data = torch.arange(1000, 1500)  # ids equal to position + 1000, so a window's start can be read back
    g = torch.Generator().manual_seed(0)
    x, y = get_batch(data, block_size=16, batch_size=5, generator=g)
    assert x.shape == y.shape == (5, 16)
    assert x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()  # callers may .view(-1) the targets
    for row_x, row_y in zip(x, y, strict=True):
        start = int(row_x[0]) - 1000
        assert torch.equal(row_x, data[start : start + 16])
        assert torch.equal(row_y, data[start + 1 : start + 17])
    before = x.clone()
    y.view(-1).fill_(-1)  # the targets masked in place, as a caller may: the inputs stay as they were
    assert torch.equal(x, before)


def test_get_batch_reaches_the_last_window() -> None:
    data = torch.arange(10)
    x, y = get_batch(data, block_size=9, batch_size=4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(x[0], data[:9]) and torch.equal(y[0], data[1:])  # the only window there is


def test_get_batch_depends_only_on_the_generator_state() -> None:
    data = torch.randint(65, (2000,), generator=torch.Generator().manual_seed(123))
    g = torch.Generator().manual_seed(7)
    get_batch(data, 32, 4, g)
    state = g.get_state()
    first = get_batch(data, 32, 4, g)
    g2 = torch.Generator()
    g2.set_state(state)  # a resumed run restores the generator and must see the same batch
    again = get_batch(data, 32, 4, g2)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    other = get_batch(data, 32, 4, torch.Generator().manual_seed(8))
    assert not torch.equal(first[0], other[0])


# --- tiny Shakespeare, shipped in the repo, and TINYCHAR_DATA_DIR ----------------------------------------------


def test_the_built_in_corpus_ships_in_the_repo_and_reads_offline() -> None:
    # conftest refuses every connection beyond this machine, so this passing means no network was asked for
    path = shakespeare_path()
    assert path == ROOT / "data" / "tinyshakespeare.txt"
    assert path.stat().st_size == SHAKESPEARE_SIZE
    assert hashlib.sha256(path.read_bytes()).hexdigest() == SHAKESPEARE_SHA256
    text, source = load_corpus(DataConfig(), min_chars=257)
    assert str(path) in source and "tiny Shakespeare" in source
    assert len(text) == SHAKESPEARE_SIZE and text.startswith("First Citizen:")
    assert CharTokenizer.from_text(text).vocab_size == 65


def test_git_keeps_the_built_in_corpus_byte_for_byte() -> None:
    # a checkout that turned its newlines into CRLF would change the sha256 and the vocabulary
    attributes = (ROOT / ".gitattributes").read_text(encoding="utf-8").split("\n")
    assert "data/tinyshakespeare.txt -text" in attributes


def test_a_changed_or_missing_built_in_corpus_is_refused_and_left_alone(tmp_path: Path) -> None:
    changed = tmp_path / "tinyshakespeare.txt"
    changed.write_bytes(shakespeare_path().read_bytes().replace(b"\n", b"\r\n"))
    before = changed.read_bytes()
    with pytest.raises(DataError, match="is not the tiny Shakespeare tinychar ships.*git checkout") as info:
        check_shakespeare(changed)
    assert "\n" not in str(info.value)
    assert changed.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["tinyshakespeare.txt"]
    with pytest.raises(DataError, match="is missing; restore it"):
        check_shakespeare(tmp_path / "gone.txt")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("what", ["a pipe", "a link to /dev/zero", "a link to a larger file", "a folder"])
def test_a_built_in_corpus_that_is_no_file_of_its_size_is_refused_at_once(tmp_path: Path, what: str) -> None:
    """It was opened as any file and hashed to its end: a named pipe in its place waited forever for a writer, and a
    link to /dev/zero was read forever."""
    from test_data_sources import within

    target = tmp_path / "tinyshakespeare.txt"
    if what == "a pipe":
        os.mkfifo(target)
    elif what == "a folder":
        target.mkdir()
    else:
        bigger = tmp_path / "bigger.txt"
        if what == "a link to a larger file":
            bigger.write_bytes(shakespeare_path().read_bytes() + b"more\n")
        target.symlink_to("/dev/zero" if "zero" in what else bigger)
    with pytest.raises(DataError) as info:
        within(check_shakespeare, target, seconds=10)
    line = str(info.value)
    assert "\n" not in line and line.endswith("restore it with `git checkout -- data/tinyshakespeare.txt`, or train "
                                              "on your own text with data.path=...")
    expected = {"a pipe": "is a pipe", "a link to /dev/zero": "is a character device", "a folder": "is a folder",
                "a link to a larger file": f"({SHAKESPEARE_SIZE + 5:,} bytes, expected {SHAKESPEARE_SIZE:,})"}
    assert expected[what] in line


def test_the_built_in_corpus_is_encoded_into_the_cache_folder_not_beside_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("TINYCHAR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    shipped = sorted(p.name for p in (ROOT / "data").iterdir())
    corpus = prepare_corpus(DataConfig(), min_chars=9, progress=False)
    assert corpus.path.parent == tmp_path / "cache" / "tinychar" / "encoded"
    assert sorted(p.name for p in (ROOT / "data").iterdir()) == shipped


def test_data_dir_is_where_relative_data_paths_are_also_looked_up(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("TINYCHAR_DATA_DIR", raising=False)
    assert data_dir() is None
    corpora = tmp_path / "corpora"
    corpora.mkdir()
    (corpora / "poems.txt").write_text("roses are red\n" * 20, encoding="utf-8")
    monkeypatch.setenv("TINYCHAR_DATA_DIR", str(corpora))
    monkeypatch.chdir(tmp_path)
    assert data_dir() == corpora
    text, _ = load_corpus(DataConfig(path="poems.txt"))
    assert text.startswith("roses are red")
    (tmp_path / "poems.txt").write_text("violets are blue\n" * 20, encoding="utf-8")
    text, _ = load_corpus(DataConfig(path="poems.txt"))
    assert text.startswith("violets")  # the current folder comes first
    with pytest.raises(DataError, match="no such file 'nothing.txt'"):
        load_corpus(DataConfig(path="nothing.txt"))
    with pytest.raises(DataError) as info:  # standard input in many tools; it was "no such file '-'"
        load_corpus(DataConfig(path="-"))
    assert str(info.value) == ("data.path reads a file, not standard input ('-'); save the text in a file and give "
                               "its path")
    assert sorted(p.name for p in corpora.iterdir()) == ["poems.txt"]  # nothing written into it


def test_a_missing_data_path_says_where_it_was_looked_for(tmp_path, monkeypatch):
    # it said "no such file 'nope.txt'", whatever the folder, and nothing of a TINYCHAR_DATA_DIR that is no folder
    from data.sources import resolve_inputs

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TINYCHAR_DATA_DIR", str(tmp_path / "corpora"))
    for find in (lambda p: resolve_inputs(p), lambda p: load_corpus(DataConfig(path=p))):
        with pytest.raises(DataError) as info:
            find("nope.txt")
        assert str(info.value) == (f"data.path: no such file 'nope.txt' (looked for from {quoted(tmp_path)} and in "
                                   f"TINYCHAR_DATA_DIR {quoted(tmp_path / 'corpora')}, no folder); check the path")
    with pytest.raises(DataError) as info:
        resolve_inputs(str(tmp_path / "nope.txt"))
    assert str(info.value) == f"data.path: no such file {quoted(tmp_path / 'nope.txt')}; check the path"


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="needs Linux's /proc")
def test_a_file_of_the_kernels_is_said_to_report_no_size():
    from data.sources import resolve_inputs

    with pytest.raises(DataError) as info:
        resolve_inputs("/proc/cpuinfo")
    assert "is empty (the kernel's files under /proc and /sys say 0 bytes whatever they hold: copy one first)" in str(
        info.value)
