"""data/stream.py and data/prepare.py: prepare_corpus streams files, folders and globs into token ids exactly (however
the read chunks split the characters), refuses bad UTF-8 naming the byte, keeps the vocabulary it is given or the most
frequent characters, and hands training a memory map of the encoded file. Tiny inputs, tiny read chunks, CPU."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import data.idsfile
import data.prepare
from configs.userinput import QUOTE_LIMIT, shell_word
from data import (
    UNKNOWN,
    CharTokenizer,
    Corpus,
    DataConfig,
    DataError,
    get_batch,
    prepare_corpus,
    read_text,
    shakespeare_path,
    split_ids,
)
from data.paths import LOG_PATH, quoted

MIXED = "Γειά σου κόσμε, 你好世界 😀🎉 e\u0301 n\u0303\r\nline two\r\n\tend\u00a0"


@pytest.fixture(autouse=True)
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Every test encodes into a folder of its own (never the session's or the user's cache)."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("TINYCHAR_CACHE_DIR", str(folder))
    return folder


def prepare(
    path: Path | str, min_chars: int = 2, chunk_bytes: int = 7, vocab: list[str] | None = None, **settings: object
) -> Corpus:
    return prepare_corpus(
        DataConfig(path=str(path), **settings), min_chars, progress=False, vocab=vocab, chunk_bytes=chunk_bytes
    )


def text_of(corpus: Corpus) -> str:
    return CharTokenizer(corpus.chars).decode(corpus.ids)


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return path


def distinct_chars(n: int) -> str:
    """n distinct characters from U+0020 up, skipping the surrogates (which UTF-8 cannot hold)."""
    codes = [c for c in range(0x20, 0x20 + n + 0x800) if not 0xD800 <= c <= 0xDFFF][:n]
    return "".join(map(chr, codes))


# --- one file --------------------------------------------------------------------------------------------------------


def test_a_file_round_trips_exactly_with_the_tokenizer_vocabulary(tmp_path: Path) -> None:
    f = write(tmp_path / "mixed.txt", MIXED * 3)
    corpus = prepare(f)
    assert corpus.chars == CharTokenizer.from_text(MIXED).chars
    assert corpus.ids.dtype == torch.uint8 and corpus.n_tokens == len(corpus.ids) == 3 * len(MIXED)
    assert text_of(corpus) == MIXED * 3  # "\r\n", combining marks and emoji untouched
    assert torch.equal(corpus.ids.to(torch.int64), CharTokenizer.from_text(MIXED).encode_tensor(MIXED * 3))
    assert not corpus.cache_hit and "encoded" in corpus.description and "\n" not in corpus.description


@pytest.mark.parametrize("chunk_bytes", [1, 2, 3, 5, 1 << 20])
def test_characters_split_across_read_chunks_are_decoded_whole(tmp_path: Path, chunk_bytes: int) -> None:
    # 1-, 2-, 3- and 4-byte characters at every offset against every chunk size above
    text = "a\u00e9\u4e2d\U0001f600" * 7 + "\u0436z\U00010348"
    corpus = prepare(write(tmp_path / "t.txt", text), chunk_bytes=chunk_bytes)
    assert text_of(corpus) == text


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    # NUL marks a binary file (as for git and grep), refused in test_missing_empty_binary_and_too_short_inputs
    text=st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), min_size=2, max_size=40),
    chunk_bytes=st.integers(1, 9),
)
def test_any_text_round_trips_at_any_chunk_size(tmp_path: Path, text: str, chunk_bytes: int) -> None:
    assume(not text.startswith("\ufeff"))  # a byte-order mark, left out: test_a_leading_byte_order_mark_...
    corpus = prepare(write(tmp_path / "any.txt", text), chunk_bytes=chunk_bytes)
    assert text_of(corpus) == text and corpus.chars == sorted(set(text))


def test_the_built_in_dataset_goes_through_the_same_path() -> None:
    corpus = prepare_corpus(DataConfig(), min_chars=257, progress=False, chunk_bytes=1 << 18)
    text = read_text(shakespeare_path())
    assert corpus.n_tokens == len(text) == 1_115_394
    assert corpus.vocab_size == 65 and corpus.ids.dtype == torch.uint8
    assert "tiny Shakespeare" in corpus.description
    assert torch.equal(corpus.ids.to(torch.int64), CharTokenizer.from_text(text).encode_tensor(text))


def test_missing_empty_binary_and_too_short_inputs_are_refused(tmp_path: Path) -> None:
    write(tmp_path / "input.txt", "hello")
    with pytest.raises(DataError, match=r"no such file '.*inptu\.txt'; did you mean '.*input\.txt'\?"):
        prepare(tmp_path / "inptu.txt")
    with pytest.raises(DataError, match="is empty"):
        prepare(write(tmp_path / "empty.txt", ""))
    with pytest.raises(DataError, match="is a binary file .*give a UTF-8 text file"):
        prepare(write(tmp_path / "utf16.txt", "hello".encode("utf-16-le")))  # valid UTF-8, but not text
    with pytest.raises(DataError, match=r"has 5 characters.*block_size \+ 1 = 9") as info:
        prepare(tmp_path / "input.txt", min_chars=9)
    assert "\n" not in str(info.value)
    with pytest.raises(DataError, match=r"'.*one\.txt' has 1 character, but one training window needs at least "
                                        r"block_size \+ 1 = 9"):
        prepare(write(tmp_path / "one.txt", "a"), min_chars=9)
    with pytest.raises(DataError, match=r"has 1 character, but"):
        read_text(tmp_path / "one.txt", 9)


@pytest.mark.parametrize("chunk_bytes", [1, 2, 7, 1 << 16])
def test_a_leading_byte_order_mark_is_left_out_of_each_file_with_a_note(tmp_path: Path, chunk_bytes: int) -> None:
    """A file saved 'UTF-8 with BOM' made U+FEFF a vocabulary character, after every separator of a folder."""
    books = tmp_path / "books"
    write(books / "a.txt", "\ufeffalpha\n")
    write(books / "b.txt", "\ufeffbeta \ufeff gamma")  # one inside the text is a character of it, and kept
    write(books / "c.txt", "\ufeff")  # nothing but the mark: an empty file
    write(books / "d.txt", "d\u00e9")
    corpus = prepare(books, chunk_bytes=chunk_bytes)
    assert text_of(corpus) == "alpha\n\nbeta \ufeff gamma\n\nd\u00e9"
    assert "data.path: left out the byte-order mark (U+FEFF) that starts 3 file(s): it says how a file was saved, " \
        "it is not text" in corpus.notes
    one = prepare(write(tmp_path / "one.txt", b"\xef\xbb\xbfab\xffc"), chunk_bytes=chunk_bytes, errors="replace")
    assert text_of(one) == "ab\ufffdc" and "\ufeff" not in one.chars
    with pytest.raises(DataError, match=r"is not UTF-8 at byte 5;"):  # offsets still count the mark's 3 bytes
        prepare(tmp_path / "one.txt", chunk_bytes=chunk_bytes)
    # nothing but the mark: no ids at all, which an empty cache file holds (mmap refused it: a ValueError traceback)
    with pytest.raises(DataError, match=r"has 0 characters, but one training window needs at least"):
        prepare(books / "c.txt", chunk_bytes=chunk_bytes, min_chars=9)


def test_a_nul_byte_past_the_binary_sniff_is_kept_and_said(tmp_path: Path) -> None:
    """A NUL past the first 8,000 bytes entered the vocabulary with no word; one before them makes a file binary."""
    text = "abc\n" * 2500  # 10,000 bytes
    late = write(tmp_path / "c" / "late.txt", text[:9000] + "\0" + text[9000:])
    write(tmp_path / "c" / "later.txt", text + "\0")
    write(tmp_path / "c" / "early.txt", "\0" + text)
    corpus = prepare(tmp_path / "c", chunk_bytes=4096)
    assert "\0" in corpus.chars and text_of(corpus) == f"{text[:9000]}\0{text[9000:]}\n{text}\0"
    (note,) = [n for n in corpus.notes if "NUL" in n]
    assert note == (
        f"data.path: {quoted(late, 133)} holds a NUL byte at byte 9,000 (and 1 more file(s)), past the first 8,000 "
        "bytes that tell a binary file (left out); it is kept as a character (U+0000): if the file is not text, "
        "remove it or leave it out of data.path"
    )
    assert any("left out 1 binary file" in n and "early.txt" in n for n in corpus.notes)
    assert prepare(tmp_path / "c").notes == corpus.notes  # a cache hit says it too


# --- folders and globs ----------------------------------------------------------------------------------------------


def test_a_folder_is_its_text_files_in_sorted_order_joined_by_newlines(tmp_path: Path) -> None:
    books = tmp_path / "books"
    write(books / "b.txt", "second\n")
    write(books / "a.txt", "first")  # no final newline: the separator keeps it off the next file's first line
    write(books / "sub" / "c.md", "third")
    write(books / "z.txt", "fourth")
    write(books / "empty.txt", "")
    write(books / ".hidden.txt", "never")
    write(books / ".git" / "HEAD", "never")
    write(books / "cover.png", b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    corpus = prepare(books)
    assert text_of(corpus) == "first\nsecond\n\nthird\nfourth"
    assert "4 files" in corpus.description
    assert any("left out 1 binary file" in note and "cover.png" in note for note in corpus.notes)
    # hidden ones were left out without a word
    assert (f"data.path: left out 2 hidden file(s) and folder(s), whose names start with '.': "
            f"{quoted(books / '.git', LOG_PATH // 3)}, {quoted(books / '.hidden.txt', LOG_PATH // 3)}") in corpus.notes


def test_a_folder_of_hidden_files_alone_says_they_were_left_out(tmp_path: Path) -> None:
    """It said 'a folder with no text files in it; add some' of a folder holding text, all of it hidden."""
    write(tmp_path / "notes" / ".a.txt", "hidden text " * 10)
    write(tmp_path / "notes" / ".drafts" / "b.txt", "hidden text " * 10)
    with pytest.raises(DataError) as info:
        prepare(tmp_path / "notes")
    assert str(info.value) == (
        f"data.path: {quoted(tmp_path / 'notes')} is a folder with no text files in it (hidden files and folders "
        f"(names that start with '.') left out: {quoted(tmp_path / 'notes' / '.a.txt')}, "
        f"{quoted(tmp_path / 'notes' / '.drafts')}); add some, or give a file")


def test_a_glob_picks_its_matches_in_sorted_order(tmp_path: Path) -> None:
    write(tmp_path / "logs" / "2.log", "two")
    write(tmp_path / "logs" / "1.log", "one")
    write(tmp_path / "logs" / "notes.txt", "not a log")
    write(tmp_path / "logs" / "old" / "0.log", "zero")
    assert text_of(prepare(tmp_path / "logs" / "*.log")) == "one\ntwo"
    assert text_of(prepare(tmp_path / "logs" / "**" / "*.log")) == "one\ntwo\nzero"
    with pytest.raises(DataError, match=r"no text file matches '.*\*\.csv'"):
        prepare(tmp_path / "logs" / "*.csv")


def test_a_folder_without_text_is_refused(tmp_path: Path) -> None:
    (tmp_path / "nothing").mkdir()
    with pytest.raises(DataError, match="is a folder with no text files in it"):
        prepare(tmp_path / "nothing")


# --- invalid UTF-8 ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "offset"),
    [
        (b"a" * 1000 + b"\xff" + b"b" * 100, 1000),  # a byte that never starts a character
        (b"a" * 63 + b"\xe4" + b"b" * 100, 63),  # a character cut short, its lead byte the last of a read
        (b"a" * 62 + b"\xe4\xbd" + b"b" * 100, 62),  # the same, two bytes held over from the read before
        (b"x" * 100 + b"\xe4\xbd", 100),  # a character cut short by the end of the file
        (b"\xed\xa0\x80" + b"a" * 10, 0),  # an encoded surrogate, which UTF-8 forbids
    ],
)
def test_invalid_utf8_names_the_file_and_absolute_byte_offset(tmp_path: Path, content: bytes, offset: int) -> None:
    f = write(tmp_path / "big.txt", content)
    with pytest.raises(DataError) as info:
        prepare(f, chunk_bytes=64)
    assert str(info.value) == (
        f"data.path: {quoted(f)} is not UTF-8 at byte {offset}; fix the file or set data.errors=replace"
    )


def test_invalid_utf8_in_a_folder_names_that_file(tmp_path: Path) -> None:
    write(tmp_path / "d" / "a.txt", "fine " * 50)
    bad = write(tmp_path / "d" / "b.txt", b"ok" * 20 + b"caf\xe9")
    with pytest.raises(DataError, match=rf"{re.escape(quoted(bad))} is not UTF-8 at byte 43;"):
        prepare(tmp_path / "d", chunk_bytes=16)


@pytest.mark.parametrize("chunk_bytes", [1, 3, 64])
def test_replace_mode_puts_fffd_where_the_bytes_were_bad(tmp_path: Path, chunk_bytes: int) -> None:
    content = b"caf\xe9 \xe4\xbd\xa0 \xe4\xbd! \xff\xfe end \xf0\x9f\x98"
    corpus = prepare(write(tmp_path / "t.txt", content), chunk_bytes=chunk_bytes, errors="replace")
    assert text_of(corpus) == content.decode("utf-8", "replace")
    assert text_of(corpus).count(UNKNOWN) == 5 and UNKNOWN in corpus.chars


@pytest.mark.parametrize("errors", ["strict", "replace"])
@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be"])
def test_utf16_without_nul_bytes_is_refused_with_the_conversion(tmp_path: Path, errors: str, encoding: str) -> None:
    """Chinese saved as UTF-16 (Windows's "Unicode") has no NUL byte to call it binary: strict said 'not UTF-8 at
    byte 0; ... or set data.errors=replace', and replace trained on the bytes read as UTF-8, garbage."""
    text = ("\ufeff" + "中文文本训练数据" * 40).encode(encoding)
    path = write(tmp_path / "zh.txt", text)
    assert b"\0" not in path.read_bytes()
    with pytest.raises(DataError) as info:
        prepare(path, errors=errors)
    assert str(info.value) == f"data.path: {quoted(path)} is UTF-16 text (it starts with UTF-16's byte-order mark), " \
        f"not UTF-8; convert it to UTF-8, e.g. iconv -f UTF-16 -t UTF-8 {command_word(path)} > converted.txt"
    # a path past QUOTE_LIMIT characters, whatever the temp folder: the command says FILE
    long = write(tmp_path / f"{'x' * QUOTE_LIMIT}.txt", text)
    with pytest.raises(DataError) as info:
        prepare(long, errors=errors)
    assert str(info.value).endswith("e.g. iconv -f UTF-16 -t UTF-8 FILE > converted.txt")


def command_word(path: Path) -> str:
    """The file as the conversion's command names it: its path where that fits in QUOTE_LIMIT characters, else FILE.
    (A temp folder such as macOS's, /var/folders/.../T/, or a longer user name in pytest's, makes tmp_path too long:
    the expected lines wrote the path there, and failed with the product unchanged.)"""
    word = shell_word(str(path))
    return word if len(word) <= QUOTE_LIMIT else "FILE"


@pytest.mark.parametrize(("encoding", "name"), [("utf-16", "UTF-16"), ("utf-16-be", "UTF-16"), ("utf-32", "UTF-32")])
def test_wide_text_with_nul_bytes_is_refused_as_what_it_is_with_the_conversion(tmp_path: Path, encoding: str,
                                                                                name: str) -> None:
    """English saved as UTF-16 (Notepad's "Unicode") holds a NUL byte after every letter, and was refused as 'a binary
    file', without the command that converts it."""
    path = write(tmp_path / "en.txt", ("\ufeff" if encoding == "utf-16-be" else "").encode(encoding)
                 + ("hello world " * 80).encode(encoding))
    assert b"\0" in path.read_bytes()[:100]
    expected = (f"data.path: {quoted(path)} is {name} text (it starts with {name}'s byte-order mark), not UTF-8; "
                f"convert it to UTF-8, e.g. iconv -f {name} -t UTF-8 {command_word(path)} > converted.txt")
    for errors in ("strict", "replace"):
        with pytest.raises(DataError) as info:
            prepare(path, errors=errors)
        assert str(info.value) == expected
    with pytest.raises(DataError) as info:
        read_text(path)
    assert str(info.value) == expected
    write(tmp_path / "books" / "a.txt", "plain text " * 10)
    path.rename(tmp_path / "books" / "en.txt")  # in a folder, left out with the binary files, as before
    assert any("left out 1 binary file" in note and "en.txt" in note for note in prepare(tmp_path / "books").notes)


# --- vocabulary ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n_chars", "dtype"),
    [(256, torch.uint8), (257, torch.uint16), (65536, torch.uint16), (65537, torch.uint32)],
)
def test_ids_take_the_narrowest_dtype_and_round_trip_exactly(tmp_path: Path, n_chars: int, dtype: torch.dtype) -> None:
    chars = distinct_chars(n_chars)
    text = chars[::-1] + chars[:300]
    corpus = prepare(write(tmp_path / "t.txt", text), chunk_bytes=4096)
    assert corpus.ids.dtype == dtype and corpus.vocab_size == n_chars
    expected = CharTokenizer.from_text(text).encode_tensor(text)
    assert int(expected.max()) == n_chars - 1  # the highest id is there: above 32767 for the uint16 cases
    assert torch.equal(corpus.ids.to(torch.int64), expected)
    # batches widen every id exactly, above 32767 (uint16) and 65535 (uint32) included
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for got, want in zip(get_batch(corpus.ids, 64, 16, g1), get_batch(expected, 64, 16, g2), strict=True):
        assert got.dtype == torch.int64 and torch.equal(got, want)


def test_get_batch_keeps_uint16_ids_above_32767() -> None:
    values = np.arange(65536 - 40, 65536, dtype=np.uint16)
    for ids in (torch.from_numpy(values), torch.from_numpy(values.astype(np.uint32) + 70000)):
        x, y = get_batch(ids, 8, 4, torch.Generator().manual_seed(0))
        assert int(x.min()) >= int(values[0]) and x.dtype == torch.int64
        assert torch.equal(y, x + 1)  # consecutive values: the target is the next one


def test_max_vocab_keeps_the_most_frequent_and_maps_the_rest_to_unknown(tmp_path: Path) -> None:
    text = "a" * 50 + "b" * 40 + "c" * 30 + "e" * 5 + "d" * 5 + "z" * 1  # d and e tie: the lower code point stays
    f = write(tmp_path / "t.txt", text)
    corpus = prepare(f, max_vocab=5)
    assert corpus.chars == ["a", "b", "c", "d", UNKNOWN]
    assert text_of(corpus) == text.replace("e", UNKNOWN).replace("z", UNKNOWN)
    (note,) = corpus.notes
    assert "data.max_vocab=5: 2 rare character(s), 6 occurrences" in note and "U+FFFD" in note
    # a cap the text fits in changes nothing; without one every character is kept
    assert prepare(f, max_vocab=6).chars == prepare(f).chars == sorted(set(text))
    assert prepare(f, max_vocab=6).notes == ()


def test_an_unknown_symbol_already_in_the_text_is_not_counted_twice(tmp_path: Path) -> None:
    text = "aaaa" + UNKNOWN * 3 + "bb" + "c"
    corpus = prepare(write(tmp_path / "t.txt", text), max_vocab=3)
    assert corpus.chars == ["a", "b", UNKNOWN]
    assert "1 rare character(s), 1 occurrences" in corpus.notes[0]


def test_a_given_vocabulary_encodes_and_names_characters_outside_it(tmp_path: Path) -> None:
    first = prepare(write(tmp_path / "first.txt", "hello world"))
    second = prepare(write(tmp_path / "second.txt", "low dell"), vocab=first.chars)
    assert second.chars == first.chars and text_of(second) == "low dell"
    with pytest.raises(
        DataError, match=r"2 character\(s\) the model never saw \(outside its vocabulary of 8\): 'H', 'W'"
    ):
        prepare(write(tmp_path / "third.txt", "Hello World"), vocab=first.chars)
    with_unknown = sorted([*first.chars, UNKNOWN])
    mapped = prepare(tmp_path / "third.txt", vocab=with_unknown)
    assert text_of(mapped) == f"{UNKNOWN}ello {UNKNOWN}orld" and "2 rare character(s)" in mapped.notes[0]


# --- memory map ------------------------------------------------------------------------------------------------------


def rss_anon_mb() -> float:
    with open("/proc/self/status", encoding="ascii", errors="replace") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


def mapped_ranges(path: Path) -> list[range]:
    """The address ranges at which this process maps path, from /proc/self/maps."""
    ranges = []
    with open("/proc/self/maps", encoding="utf-8", errors="surrogateescape") as f:  # paths: any bytes
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == str(path.resolve()):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append(range(start, end))
    return ranges


def test_the_ids_of_a_small_corpus_are_a_copy_that_a_cache_file_changed_in_place_leaves_alone(tmp_path: Path) -> None:
    """A memory map shares the file's pages: a cache file cut short in place while a run read it (`cp backup.ids
    ...`, `truncate`) killed the run with SIGBUS, no checkpoint, no line; rewritten in place, the run trained on
    other text without a word. A corpus of ids no larger than IN_MEMORY_BYTES is read into memory instead, from
    the same bytes its checksum was taken of, first when encoded and then when found in the cache."""
    f = write(tmp_path / "t.txt", "hello world, a small corpus\n" * 200)
    for corpus in (prepare(f), prepare(f)):
        assert corpus.n_tokens * corpus.ids.element_size() <= data.idsfile.IN_MEMORY_BYTES
        expected = text_of(corpus)
        assert not mapped_ranges(corpus.path)
        with open(corpus.path, "r+b") as ids_file:  # other ids of the vocabulary, then cut short
            ids_file.write(bytes(reversed(ids_file.read())))
            ids_file.truncate(100)
        assert text_of(corpus) == expected and int(corpus.ids[-1]) == corpus.chars.index("\n")
        train, _ = split_ids(corpus.ids, 0.1, 8)
        get_batch(train, 8, 32, torch.Generator().manual_seed(0))
    assert prepare(f).notes and text_of(prepare(f)) == expected  # the cut entry is found damaged and encoded again


def test_the_ids_of_a_large_corpus_are_a_memory_map_of_the_cache_file_not_a_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(data.idsfile, "IN_MEMORY_BYTES", 1 << 20)  # as a corpus of over 64 MB of ids is
    f = tmp_path / "big.txt"
    with f.open("w", encoding="utf-8") as out:
        for _ in range(24):
            out.write("abcdefghijklmnopqrstuvwxyz0123456789 .,;\n" * 25_000)  # 24 MB
    prepare(f, chunk_bytes=1 << 22)
    before = rss_anon_mb()
    corpus = prepare(f)
    train, val = split_ids(corpus.ids, 0.1, 8)
    checksum = int(corpus.ids[::4096].sum())  # reads a byte of every page: file pages, not this process's own
    for _ in range(20):
        get_batch(train, 8, 32, torch.Generator().manual_seed(0))
    assert checksum > 0 and rss_anon_mb() - before < 8  # a copy would add 24 MB (uint8) or 192 MB (int64)

    # the tensor's memory is the kernel's mapping of the cache file
    assert any(corpus.ids.data_ptr() in r for r in mapped_ranges(corpus.path))
    # split_ids gives views into the same map
    assert train.data_ptr() == corpus.ids.data_ptr()
    assert val.data_ptr() == corpus.ids.data_ptr() + len(train) * corpus.ids.element_size()

    # and for another device they are read from the file, not faulted in from the map page by page (meta: no GPU)
    read: list[Path] = []
    real_read = data.prepare._read_ids
    monkeypatch.setattr(data.prepare, "_read_ids", lambda path, *a, **k: read.append(path) or real_read(path, *a, **k))
    assert corpus.ids_on("meta").shape == corpus.ids.shape and read == [corpus.path]


def test_ids_on_a_device_are_read_from_the_cache_file_in_pieces(tmp_path: Path) -> None:
    corpus = prepare(write(tmp_path / "t.txt", distinct_chars(300) * 3))
    assert corpus.ids.dtype == torch.uint16 and corpus.ids_on("cpu") is corpus.ids
    for piece_bytes in (2, 6, 1 << 20):  # one id at a time, three, and all at once
        copy = data.prepare._read_ids(corpus.path, corpus.ids.dtype, corpus.n_tokens, torch.device("cpu"), piece_bytes,
                                      crc32=corpus.crc32)
        assert torch.equal(copy, corpus.ids) and copy.data_ptr() != corpus.ids.data_ptr()


@pytest.mark.parametrize("change", ["a byte", "cut short", "removed"])
def test_ids_read_for_a_device_are_checked_against_the_checksum_the_map_was(tmp_path: Path, change: str) -> None:
    """On a GPU the ids are read from the cache file by name, after the checked file was mapped: a file changed or
    removed since by another process reached the GPU unchecked, or ended the run in a traceback."""
    corpus = prepare(write(tmp_path / "t.txt", distinct_chars(300) * 3))
    raw = corpus.path.read_bytes()
    corpus.path.unlink()  # the map keeps the checked file; the name now leads elsewhere, or nowhere
    if change != "removed":
        corpus.path.write_bytes(raw[:-2] if change == "cut short" else raw[:7] + bytes([raw[7] ^ 1]) + raw[8:])
    with pytest.raises(DataError, match=r"^the cache file .* changed after it was checked \((its checksum differs|it "
                                        r"is shorter than its meta says|No such file or directory)\); run again"):
        data.prepare._read_ids(corpus.path, corpus.ids.dtype, corpus.n_tokens, torch.device("cpu"), 64,
                               crc32=corpus.crc32)


def test_a_stray_write_to_the_ids_never_reaches_the_cache_file(tmp_path: Path) -> None:
    corpus = prepare(write(tmp_path / "t.txt", MIXED))
    on_disk = corpus.path.read_bytes()
    corpus.ids[:5] = 0
    assert corpus.path.read_bytes() == on_disk
    assert text_of(prepare(tmp_path / "t.txt")) == MIXED


@pytest.mark.parametrize("keyed", ["hashed whole", "by samples"])
@pytest.mark.parametrize("change", ["appended to", "given a hole to 1 TiB"])
def test_a_file_that_grows_after_it_is_listed_is_read_no_further_and_said_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache: Path, keyed: str, change: str
) -> None:
    """Such a file was read to its new end, twice (the cache key's hash, then both passes): one extended to 1 TiB
    after it was listed was read for hours (the listing's refusal of sparse files came too early), and the change was
    said only after both passes. Running again cannot help a file that is being written to: the line says to copy it."""
    from test_data_sources import within

    import data.cachekey

    f = write(tmp_path / "log.txt", "abcdefgh" * 64)
    listed = data.prepare.resolve_inputs

    def list_then_grow(*args: object, **kwargs: object) -> object:
        inputs = listed(*args, **kwargs)
        if change == "appended to":
            with f.open("ab") as out:
                out.write(b"one more line\n")
        else:
            os.truncate(f, 1 << 40)
        return inputs

    monkeypatch.setattr(data.prepare, "resolve_inputs", list_then_grow)
    if keyed == "by samples":  # as inputs of 64 MB or more are: the key reads a few blocks, the passes all of it
        monkeypatch.setattr(data.cachekey, "CONTENT_HASH_BELOW", 0)
    now = 512 + 14 if change == "appended to" else 1 << 40
    with pytest.raises(DataError) as info:
        within(prepare, f, seconds=20)
    # The command names the file where its path fits in QUOTE_LIMIT characters: a temp folder such as macOS's
    # (/var/folders/.../T/, ~50 characters) makes tmp_path too long for that, and the command says FILE instead.
    word = command_word(f)
    assert str(info.value) == (
        f"data.path: {quoted(f)} grew from 512 to {now:,} bytes while it was being read; a file still being written to "
        f"(a live log) changes at every run: train on a copy of it, kept out of what data.path reads (cp -- {word} "
        "COPY)")
    assert not list(cache.glob("*.ids"))


def test_a_cache_hit_is_served_after_a_change_of_the_files_metadata_alone(tmp_path: Path) -> None:
    """A chmod (or a backup tool's extended attributes) between the listing and the reading of the cache key changed
    the file's ctime, and the run was refused: "changed while it was being read". Its text is as it was."""
    from data.sources import resolve_inputs

    f = write(tmp_path / "t.txt", "abcdefgh" * 64)
    first = prepare(f)
    real = data.prepare.resolve_inputs

    def listed_then_chmod(*args, **kwargs):
        inputs = real(*args, **kwargs)
        before = f.stat().st_ctime_ns
        while f.stat().st_ctime_ns == before:  # (a file system whose clock ticks coarsely: again, later)
            f.chmod(0o640 if f.stat().st_mode & 0o7 else 0o644)
        return inputs

    assert resolve_inputs is real
    with pytest.MonkeyPatch.context() as m:
        m.setattr(data.prepare, "resolve_inputs", listed_then_chmod)
        again = prepare(f)
    assert again.cache_hit and again.path == first.path


def test_a_file_rewritten_after_it_is_listed_is_said_to_have_changed_by_the_first_pass(tmp_path: Path) -> None:
    """The change (here one that keeps the size) was said only once both passes had read the whole corpus."""
    from data.sources import resolve_inputs
    from data.stream import count_chars

    f = write(tmp_path / "t.txt", "abcdefgh" * 64)
    inputs = resolve_inputs(f)
    st = f.stat()
    while f.stat().st_ctime_ns == st.st_ctime_ns:  # (a file system whose clock ticks coarsely: again, later)
        f.write_text("z" * st.st_size, encoding="utf-8")
    with pytest.raises(DataError, match=r"^data\.path: '.*t\.txt' changed while it was being read; run again$"):
        count_chars(inputs, "strict", 7)
