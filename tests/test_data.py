"""Tests for data/: tokenizer, config, corpus loading and caching, splits and batches. CPU, tiny inputs."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

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
    read_text,
    shakespeare_path,
    split_ids,
)

SHAKESPEARE_SIZE = 1_115_394
MIXED = "Γειά σου κόσμε, 你好世界 😀🎉 e\u0301 n\u0303\r\nline two\r\n\tend\u00a0"


def _real_data_dir() -> Path:
    """The shared folder holding a verified tinyshakespeare.txt (CI exports it as TINYCHAR_DATA_DIR)."""
    if folder := os.environ.get("TINYCHAR_DATA_DIR"):
        return Path(folder)
    return Path(__file__).resolve().parents[2] / "shared" / "data"


# Read once, before any test points TINYCHAR_DATA_DIR at a temporary folder.
REAL_DATA_DIR = _real_data_dir()
REAL_FILE = REAL_DATA_DIR / "tinyshakespeare.txt"


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
    text, source = load_corpus(DataConfig(path=str(f)), progress=False)
    assert text == "my own text" and str(f) in source


# --- split and batches ------------------------------------------------------------------------------------------


def test_split_sizes() -> None:
    ids = torch.arange(100)
    train, val = split_ids(ids, 0.1, block_size=8)
    assert len(train) == 90 and len(val) == 10
    assert torch.equal(torch.cat([train, val]), ids)  # validation is the end of the text
    train, val = split_ids(torch.arange(101), 0.25, block_size=8)
    assert len(val) == round(101 * 0.25) and len(train) + len(val) == 101


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


# --- cache folder and tiny Shakespeare --------------------------------------------------------------------------


def test_data_dir_honours_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TINYCHAR_DATA_DIR", str(tmp_path / "d"))
    assert data_dir() == tmp_path / "d"
    monkeypatch.delenv("TINYCHAR_DATA_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert data_dir() == tmp_path / "cache" / "tinychar"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert data_dir() == Path.home() / ".cache" / "tinychar"


class FakeResponse(io.BytesIO):
    """What urlopen returns, as far as the download uses it: headers, read(n), a context manager."""

    def __init__(self, payload: bytes) -> None:
        super().__init__(payload)
        self.headers = {"Content-Length": str(len(payload))}


def serve(payload: bytes) -> Callable[..., FakeResponse]:
    """A fake urlopen that answers every request with payload."""

    def urlopen(url: str, *args: object, **kwargs: object) -> FakeResponse:
        return FakeResponse(payload)

    return urlopen


def refuse_network(url: str, *args: object, **kwargs: object) -> None:
    raise urllib.error.URLError("no network in tests")


def test_shakespeare_path_uses_the_shared_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINYCHAR_DATA_DIR", str(REAL_DATA_DIR))
    monkeypatch.setattr(urllib.request, "urlopen", refuse_network)
    path = shakespeare_path(progress=False)
    assert path == REAL_FILE
    assert hashlib.sha256(path.read_bytes()).hexdigest() == SHAKESPEARE_SHA256
    text, source = load_corpus(DataConfig(), min_chars=257, progress=False)
    assert str(REAL_FILE) in source
    assert len(text) == SHAKESPEARE_SIZE and text.startswith("First Citizen:")
    assert CharTokenizer.from_text(text).vocab_size == 65


def test_corrupted_cache_is_refused_and_left_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TINYCHAR_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(urllib.request, "urlopen", refuse_network)
    bad = tmp_path / "tinyshakespeare.txt"
    bad.write_bytes(b"not shakespeare")
    with pytest.raises(DataError, match="tinyshakespeare.txt.*delete it") as info:
        shakespeare_path(progress=False)
    assert "\n" not in str(info.value)
    assert files_in(tmp_path) == {"tinyshakespeare.txt": b"not shakespeare"}


def test_valid_copy_in_a_read_only_folder_is_used_as_is(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    shutil.copyfile(REAL_FILE, folder / "tinyshakespeare.txt")
    before = (folder / "tinyshakespeare.txt").stat().st_mtime_ns
    monkeypatch.setenv("TINYCHAR_DATA_DIR", str(folder))
    monkeypatch.setattr(urllib.request, "urlopen", refuse_network)
    folder.chmod(0o555)
    try:
        assert shakespeare_path(progress=False) == folder / "tinyshakespeare.txt"
        # Root ignores the mode bits, so "nothing written" is checked directly rather than through a failed write.
        assert [p.name for p in folder.iterdir()] == ["tinyshakespeare.txt"]
        assert (folder / "tinyshakespeare.txt").stat().st_mtime_ns == before
    finally:
        folder.chmod(0o755)


def test_download_lands_checked_and_leaves_no_partial_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    folder = tmp_path / "fresh" / "cache"  # not there yet: the download creates it
    monkeypatch.setenv("TINYCHAR_DATA_DIR", str(folder))
    payload = REAL_FILE.read_bytes()
    monkeypatch.setattr(urllib.request, "urlopen", serve(payload))
    path = shakespeare_path(progress=False)
    assert path == folder / "tinyshakespeare.txt"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == SHAKESPEARE_SHA256
    assert [p.name for p in folder.iterdir()] == ["tinyshakespeare.txt"]


def test_download_with_wrong_bytes_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TINYCHAR_DATA_DIR", str(tmp_path))
    truncated = REAL_FILE.read_bytes()[:100_000]
    monkeypatch.setattr(urllib.request, "urlopen", serve(truncated))
    with pytest.raises(DataError, match="sha256"):
        shakespeare_path(progress=False)
    assert list(tmp_path.iterdir()) == []  # neither the final name nor a partial file


def test_download_without_network_says_what_to_do(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TINYCHAR_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(urllib.request, "urlopen", refuse_network)
    with pytest.raises(DataError, match="not cached in .*could not be downloaded \\(no network in tests\\).*data.path"):
        load_corpus(DataConfig(), progress=False)
    assert list(tmp_path.iterdir()) == []
