"""data/sources.py, data/globs.py and data/paths.py: what data.path names is found without looping or blocking, and
whatever it is, a person is told in one line. A recursive glob over links back up the tree returns at once; a pipe,
a device or a socket is refused by what it is; every OSError on the path (a name over 255 bytes, a loop of links, a
file where a folder should be) names the setting and the reason; a path with a newline or of any length stays on one
line. Each call runs under a time limit, so that a regression fails here instead of hanging the suite."""

from __future__ import annotations

import errno
import os
import socket
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from test_data_stream import prepare, text_of, write

import data.sources
from data import DataError, read_text
from data.paths import open_regular, quoted
from data.sources import resolve_inputs

T = TypeVar("T")
LIMIT_S = 5.0  # each of these returns in milliseconds; a loop or a blocking open never does


@pytest.fixture(autouse=True)
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Every test encodes into a folder of its own (never the session's or the user's cache)."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("TINYCHAR_CACHE_DIR", str(folder))
    return folder


def within(fn: Callable[..., T], *args: object, seconds: float = LIMIT_S) -> T:
    """fn(*args), run in a thread: its result, or its exception raised here; a failure if it takes over seconds.

    A thread rather than a subprocess so that the limit is not spent importing torch; a hung call is left behind in
    a daemon thread, which ends with the test session.
    """
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except Exception as e:  # noqa: BLE001 - raised again in the test's own thread, whatever it is
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)}{args!r} did not return within {seconds} s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def refusal(fn: Callable[..., object], *args: object) -> str:
    """The one-line DataError message that fn(*args) raises within the time limit."""
    with pytest.raises(DataError) as info:
        within(fn, *args)
    message = str(info.value)
    assert "\n" not in message and "\r" not in message and len(message) < 400, message
    return message


def sources_of(spec: str | Path) -> list[str]:
    return [str(s.path) for s in within(resolve_inputs, str(spec)).sources]


# --- globs over links ------------------------------------------------------------------------------------------------


@pytest.fixture
def release_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The issue's layout: b/a.txt, and two links back to b itself (as release folders have 'latest', 'current')."""
    monkeypatch.chdir(tmp_path)
    b = tmp_path / "b"
    write(b / "a.txt", "".join(f"{i}\n" for i in range(1, 1001)))
    (b / "latest").symlink_to(".")
    (b / "current").symlink_to(".")
    return b


def test_a_recursive_glob_does_not_follow_links_back_up_the_tree(release_tree: Path) -> None:
    assert sources_of("b/**/*.txt") == ["b/a.txt"]  # glob.glob(recursive=True) never returned here
    assert sources_of("b/**") == ["b/a.txt"]
    assert sources_of("b") == ["b/a.txt"]
    corpus = within(prepare, "b/**/*.txt")
    assert text_of(corpus) == "".join(f"{i}\n" for i in range(1, 1001))


def test_wildcards_that_follow_links_visit_each_real_folder_once(release_tree: Path) -> None:
    # '*' follows links, as in glob; 12 levels through two self-links are 2**12 paths, but one real folder
    deep = "b/" + "*/" * 12 + "*.txt"
    [only] = sources_of(deep)
    assert Path(only).resolve() == (release_tree / "a.txt").resolve()


def test_a_link_to_a_file_is_read_once_and_a_link_to_a_folder_only_where_named(tmp_path: Path) -> None:
    write(tmp_path / "elsewhere" / "far.txt", "far")
    write(tmp_path / "b" / "a.txt", "near")
    (tmp_path / "b" / "far.txt").symlink_to(tmp_path / "elsewhere" / "far.txt")
    (tmp_path / "b" / "again.txt").symlink_to(tmp_path / "b" / "a.txt")  # the same file under a second name
    (tmp_path / "b" / "linked").symlink_to(tmp_path / "elsewhere")
    assert text_of(within(prepare, tmp_path / "b" / "**" / "*.txt")) == "near\nfar"
    # a wildcard part enters the linked folder, as glob's '*' does
    assert sources_of(tmp_path / "b" / "*" / "*.txt") == [str(tmp_path / "b" / "linked" / "far.txt")]


def test_the_check_before_torch_refuses_where_nothing_is_there_and_reads_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """refuse_if_nothing_there, which train.py asks before it imports torch: a glob with no match and a folder with no
    file get the run's own refusal; where anything is there, the run decides, and the check has read no file and
    listed no more folders than it took to find one."""
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "texts" / "a.txt", "alpha\n")
    write(tmp_path / "texts" / "bin" / "b.dat", b"\0\1\2")
    for i in range(30):
        write(tmp_path / "texts" / "more" / f"{i:02}" / "c.txt", "gamma\n")
    write(tmp_path / "empty" / ".keep", "")
    (tmp_path / "empty" / "sub" / "subsub").mkdir(parents=True)
    for spec in ("texts/*.md", "nowhere/**/*.txt", "empty", "texts/more/*/*.md"):
        message = refusal(data.sources.refuse_if_nothing_there, spec)
        assert message == refusal(resolve_inputs, spec)
        assert message.startswith(("data.path: no text file matches", "data.path: 'empty' is a folder with no text"))

    def not_read(*args: object) -> bool:
        raise AssertionError(f"a file was read: {args[0]}")

    listed: list[str] = []
    scandir, is_text = os.scandir, data.sources._is_text
    monkeypatch.setattr(os, "scandir", lambda path=".": listed.append(os.fsdecode(path)) or scandir(path))
    monkeypatch.setattr(data.sources, "_is_text", not_read)
    for spec in ("texts", "texts/*.txt", "texts/bin/*.dat", "texts/more/*/c.txt"):
        assert within(data.sources.refuse_if_nothing_there, spec) is None  # a .dat alone is the run's to refuse
    assert listed == ["texts"]  # the folder's first file was enough; the globs list by os.listdir
    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(data.sources, "_is_text", is_text)
    assert refusal(resolve_inputs, "texts/bin/*.dat").startswith("data.path: no text file matches 'texts/bin/*.dat'")
    # a relative pattern with no match here is looked for in TINYCHAR_DATA_DIR, as the run looks
    monkeypatch.chdir(tmp_path / "empty")
    monkeypatch.setenv("TINYCHAR_DATA_DIR", str(tmp_path / "texts"))
    assert within(data.sources.refuse_if_nothing_there, "*.txt") is None
    assert sources_of("*.txt") == [str(tmp_path / "texts" / "a.txt")]
    assert refusal(data.sources.refuse_if_nothing_there, "*.md").startswith("data.path: no text file matches '*.md'")


# --- what data.path names -----------------------------------------------------------------------------------------


def test_a_fifo_is_refused_as_a_pipe_without_opening_it(tmp_path: Path) -> None:
    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)  # no writer: opening it to read would wait forever
    for fn in (prepare, read_text):
        message = refusal(fn, fifo)
        assert message.startswith(f"data.path: {quoted(fifo)} is a pipe") and "so save it to a file first" in message


def test_a_shell_process_substitution_is_refused_as_a_pipe() -> None:
    read_end, write_end = os.pipe()  # what bash's <(zcat corpus.gz) hands over: /dev/fd/N, a pipe
    try:
        path = f"/dev/fd/{read_end}"
        if not os.path.exists(path):
            pytest.skip("no /dev/fd on this system")
        assert refusal(prepare, path).startswith(f"data.path: '{path}' is a pipe (a FIFO, or <(command) in a shell)")
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_file_that_says_it_is_empty_is_never_opened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc/kmsg says it is empty, and a read of it waits for the kernel's next message: the sniff for NUL bytes hung
    data.path=/proc/kmsg, and any folder or glob reaching it, forever. An empty file adds nothing: it is not opened."""
    books = tmp_path / "books"
    write(books / "a.txt", "alpha")
    write(books / "empty.txt", "")
    opened = []

    def recording(path: Path, label: str) -> object:
        opened.append(Path(path).name)
        return open_regular(path, label)

    monkeypatch.setattr(data.sources, "open_regular", recording)
    assert sources_of(books) == sources_of(books / "*.txt") == [str(books / "a.txt")]
    assert refusal(resolve_inputs, str(books / "empty.txt")) == f"data.path: {quoted(books / 'empty.txt')} is empty; " \
        "give UTF-8 text with at least one training window"
    assert "a.txt" in opened and "empty.txt" not in opened


def test_a_sparse_file_is_binary_not_read_to_its_end(tmp_path: Path) -> None:
    """A line of text and `truncate -s 1T` after it: its NUL bytes came past the sniff, so all of them were read (at
    a few GB a minute) and encoded, into an ids file as large as the disk allowed."""
    sparse = write(tmp_path / "books" / "sparse.txt", "a line of text\n" * 1000)
    os.truncate(sparse, 1 << 40)
    with sparse.open("rb") as f:
        if os.lseek(f.fileno(), 0, getattr(os, "SEEK_HOLE", os.SEEK_END)) == 1 << 40:
            pytest.skip("this file system keeps no holes")
    write(tmp_path / "books" / "text.txt", "text")
    assert refusal(prepare, sparse).startswith(f"data.path: {quoted(sparse)} is a binary file (it holds NUL bytes")
    corpus = within(prepare, tmp_path / "books")
    assert text_of(corpus) == "text" and any("left out 1 binary file" in n and "sparse.txt" in n for n in corpus.notes)


def test_devices_are_refused_by_kind() -> None:
    assert refusal(prepare, "/dev/zero").startswith("data.path: '/dev/zero' is a character device, not a file")
    assert refusal(read_text, "/dev/zero").startswith("data.path: '/dev/zero' is a character device")
    block = next((p for p in sorted(Path("/dev").iterdir()) if stat.S_ISBLK(os.lstat(p).st_mode)), None)
    if block is not None:
        assert refusal(prepare, block).startswith(f"data.path: '{block}' is a block device")


def test_a_socket_is_refused_as_a_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a relative name: a socket's path is limited to ~100 bytes
    with socket.socket(socket.AF_UNIX) as server:
        server.bind("corpus.sock")
        message = refusal(prepare, tmp_path / "corpus.sock")
        assert message.startswith(f"data.path: {quoted(tmp_path / 'corpus.sock')} is a socket")


def test_pipes_in_a_folder_or_matched_by_a_glob_are_left_out_unopened(tmp_path: Path) -> None:
    write(tmp_path / "books" / "a.txt", "text")
    os.mkfifo(tmp_path / "books" / "b.txt")
    assert text_of(within(prepare, tmp_path / "books")) == "text"
    assert text_of(within(prepare, tmp_path / "books" / "*.txt")) == "text"


# --- errors from the system, in one line ----------------------------------------------------------------------------


def test_a_name_over_255_bytes_is_one_line_naming_the_setting(tmp_path: Path) -> None:
    long = tmp_path / ("x" * 300) / "corpus.txt"
    message = refusal(prepare, long)
    assert message.startswith("data.path: cannot read '") and "..." in message
    assert message.endswith(
        "(File name too long); a name in it is 300 bytes, over the limit of 255; use a shorter name"
    )
    assert "over the limit of 255" in refusal(read_text, long)


def test_a_loop_of_links_a_file_used_as_a_folder_and_a_link_to_nowhere(tmp_path: Path) -> None:
    (tmp_path / "loop").symlink_to("loop")
    assert "leads back to itself" in refusal(prepare, tmp_path / "loop")
    assert "leads back to itself" in refusal(prepare, tmp_path / "loop" / "*.txt")
    write(tmp_path / "a.txt", "text")
    assert "should be a folder is a file" in refusal(prepare, tmp_path / "a.txt" / "b.txt")
    (tmp_path / "gone.txt").symlink_to("nowhere.txt")
    assert refusal(prepare, tmp_path / "gone.txt").endswith(
        "is a symbolic link to 'nowhere.txt', which does not exist; fix the link"
    )


def test_paths_with_newlines_or_of_any_length_stay_on_one_line(tmp_path: Path) -> None:
    odd = tmp_path / "two\nlines.txt"
    assert "two\\nlines.txt' is a pipe" in (os.mkfifo(odd), refusal(prepare, odd))[1]
    assert "no such file" in refusal(prepare, tmp_path / "no\rsuch\nfile.txt")
    assert "no text file matches" in refusal(prepare, tmp_path / "no\nmatch*.txt")
    assert "6,010 bytes, over the system's limit" in refusal(prepare, "a/" * 3000 + "corpus.txt")  # cut when shown
    write(tmp_path / "new\nline" / "t.txt", "\0binary")
    assert "new\\nline" in refusal(prepare, tmp_path / "new\nline" / "t.txt")


@pytest.fixture
def deep_tree(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(deep, bottom): deep/top.txt, and bottom/bottom.txt 1,100 folders below deep; made and removed a folder at a
    time, as mkdir(parents=True) and shutil.rmtree (pytest's clean-up) recurse too."""
    deep = bottom = tmp_path / "deep"
    write(deep / "top.txt", "top")
    for _ in range(1100):
        bottom /= "d"
        bottom.mkdir()
    write(bottom / "bottom.txt", "bottom")
    yield deep, bottom
    (bottom / "bottom.txt").unlink()
    for folder in [bottom, *bottom.parents][:1100]:
        folder.rmdir()


def test_a_tree_a_thousand_folders_deep_is_walked(deep_tree: tuple[Path, Path]) -> None:
    """Python 3.11's os.walk recursed once a level: 1,100 levels were a RecursionError, for a folder and for '**'."""
    deep, bottom = deep_tree
    assert sources_of(deep) == sources_of(deep / "**") == [str(bottom / "bottom.txt"), str(deep / "top.txt")]


def test_a_glob_of_a_thousand_wildcard_parts_is_matched_at_once(deep_tree: tuple[Path, Path]) -> None:
    """Matching recursed once a part of the pattern: 1,100 '?' parts were a RecursionError; '**/*.txt' over the tree
    took 15 s (a realpath of each folder, and the folders above each match looked up in the square of the depth)."""
    deep, bottom = deep_tree
    assert sources_of(Path(deep, *["?"] * 1100, "*.txt")) == [str(bottom / "bottom.txt")]
    assert sources_of(deep / "**" / "*.txt") == [str(bottom / "bottom.txt"), str(deep / "top.txt")]


def test_a_folder_that_cannot_be_read_is_refused_not_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "books" / "a.txt", "text")
    locked = tmp_path / "books" / "locked"
    write(locked / "b.txt", "more")

    def denied(listing: Callable[..., T]) -> Callable[..., T]:
        """listing, answering for locked as the system does for a folder without read permission (root, who runs
        some test machines, reads any folder, so chmod alone would not show it)."""

        def wrapped(path: object = ".") -> T:
            if Path(os.fsdecode(path)) == locked:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))
            return listing(path)

        return wrapped

    monkeypatch.setattr(os, "scandir", denied(os.scandir))  # what os.walk lists folders with
    monkeypatch.setattr(os, "listdir", denied(os.listdir))  # what a wildcard lists a folder with
    for spec in (tmp_path / "books", tmp_path / "books" / "**" / "*.txt", tmp_path / "books" / "*" / "*.txt"):
        message = refusal(prepare, spec)
        assert message.startswith(f"data.path: cannot read the folder {quoted(locked)} (Permission denied); check its")
        assert "/books/locked' (" in message  # however long the temp folder, the message names the folder


# --- tinychar run folders under data.path -----------------------------------------------------------------------------


def a_run(folder: Path, *marks: str) -> Path:
    """A folder as a tinychar run leaves it: config.yaml beside marks (.lock, ckpt.pt, best.pt), plus a sample."""
    write(folder / "config.yaml", "out_dir: runs/tiny\nseed: 1337\n")
    for mark in marks:
        write(folder / mark, b"PK\x03\x04\0\0" if mark.endswith(".pt") else b"")
    write(folder / "samples.txt", "what the model wrote, not the corpus\n")
    return folder


@pytest.mark.parametrize("marks", [(".lock",), ("ckpt.pt",), ("best.pt", ".lock")])
def test_run_folders_under_a_data_folder_or_a_glob_are_left_out_with_a_note(tmp_path: Path, marks: tuple) -> None:
    """An out_dir inside data.path made the run's config.yaml training text for every later run."""
    novels = tmp_path / "novels"
    write(novels / "a.txt", "alpha\n")
    write(novels / "b" / "c.txt", "gamma\n")
    a_run(novels / "runs" / "tiny", *marks)
    corpus = prepare(novels)
    assert text_of(corpus) == "alpha\n\ngamma\n"
    (note,) = [n for n in corpus.notes if "tinychar run" in n]
    assert note == (
        f"data.path: left out what 1 tinychar run(s) wrote there (a run's folder, or its config.yaml, is not training "
        f"text): {quoted(novels / 'runs' / 'tiny', 133)}"
    )
    for pattern in ("**/*", "*"):
        matched = resolve_inputs(f"{novels}/{pattern}")
        assert all("runs" not in s.path.parts for s in matched.sources), pattern
        assert matched.runs == [novels / "runs" / "tiny"], pattern
    with pytest.raises(DataError, match=r"no text file matches .* \(tinychar run folders left out: '"):
        resolve_inputs(f"{novels}/runs/*")  # every match is the run's: nothing is left, and the line says why


def test_a_glob_leaves_out_files_deep_inside_a_run_folder_as_walking_does(tmp_path: Path) -> None:
    """A glob's match was checked against its own folder only: a text in a folder inside a run's was training text
    under '**/*.txt', though walking the folder (data.path=novels) leaves the run's whole tree out."""
    novels = tmp_path / "novels"
    write(novels / "a.txt", "alpha\n")
    write(a_run(novels / "runs" / "tiny", "ckpt.pt") / "samples" / "more.txt", "the model's again\n")
    walked, matched = resolve_inputs(novels), resolve_inputs(f"{novels}/**/*.txt")
    assert [s.path for s in matched.sources] == [s.path for s in walked.sources] == [novels / "a.txt"]
    assert matched.runs == walked.runs == [novels / "runs" / "tiny"]
    for pattern in ("runs/**/*.txt", "*/*/*/*.txt"):  # every match is in the run
        with pytest.raises(DataError, match=r"no text file matches .* \(tinychar run folders left out: '"):
            resolve_inputs(f"{novels}/{pattern}")


def test_the_runs_own_out_dir_is_left_out_before_the_run_has_marked_it(tmp_path: Path) -> None:
    """A first run trained on what its out_dir inside data.path held (notes of the person's); by the resume the
    folder was a run's, left out, and the resume was refused for good as "not the text this run was trained on"."""
    novels = tmp_path / "novels"
    write(novels / "a.txt", "alpha\n")
    write(novels / "run" / "notes.txt", "notes for this experiment\n")  # out_dir, no config.yaml or .lock yet
    for spec in (novels, f"{novels}/**/*.txt", f"{novels}/*"):
        assert [s.path for s in resolve_inputs(spec).sources][-1] == novels / "run" / "notes.txt"  # not a run's
        inputs = resolve_inputs(spec, runs=[novels / "run"])
        assert [s.path for s in inputs.sources] == [novels / "a.txt"] and inputs.runs == [novels / "run"], spec
    named = resolve_inputs(novels / "run", runs=[novels / "run"])  # data.path=out_dir: the person's chosen corpus
    assert [s.path for s in named.sources] == [novels / "run" / "notes.txt"]
    assert named.runs == []  # no config.yaml there yet to leave out (the note named one)
    assert [s.path for s in resolve_inputs(novels, runs=[tmp_path / "elsewhere"]).sources][-1].name == "notes.txt"


def test_only_config_yaml_beside_a_mark_makes_a_run_folder(tmp_path: Path) -> None:
    write(tmp_path / "c" / "notes" / "config.yaml", "a: 1\n")  # a config of the person's own, no run beside it
    write(tmp_path / "c" / "other" / "ckpt.pt.txt", "text\n")
    write(tmp_path / "c" / "other" / "best.txt", "text\n")
    inputs = resolve_inputs(tmp_path / "c")
    assert [s.path.name for s in inputs.sources] == ["config.yaml", "best.txt", "ckpt.pt.txt"] and inputs.runs == []


def test_a_run_in_the_named_folder_itself_leaves_out_only_its_config(tmp_path: Path) -> None:
    """data.path=. with out_dir=.: the folder is the corpus the person chose; the run's config.yaml is not."""
    a_run(tmp_path / "c", ".lock", "ckpt.pt")
    write(tmp_path / "c" / "book.txt", "the book\n")
    inputs = resolve_inputs(tmp_path / "c")
    assert [s.path.name for s in inputs.sources] == ["book.txt", "samples.txt"]
    assert inputs.runs == [tmp_path / "c" / "config.yaml"]


def test_a_glob_into_a_run_folder_leaves_out_only_its_config_as_the_folder_form_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A glob whose fixed part is a run's out_dir matched nothing ('*.txt' in a folder that had been out_dir=.), or
    nothing but its config ('c/**'), though data.path=c gave the folder's text: the fixed part is named, as a folder
    data.path names is, and only the run's config.yaml is left out there."""
    c = a_run(tmp_path / "c", ".lock", "ckpt.pt")
    write(c / "book.txt", "the book\n")
    write(c / "more" / "page.txt", "a page\n")
    folder = [s.path for s in resolve_inputs(c).sources]
    assert folder == [c / "book.txt", c / "more" / "page.txt", c / "samples.txt"]
    top = [c / "book.txt", c / "samples.txt"]
    for pattern, expected in (("**", folder), ("**/*", folder), ("*", folder), ("*.txt", top),
                              ("*/*.txt", [c / "more" / "page.txt"])):
        inputs = resolve_inputs(f"{c}/{pattern}")
        assert sorted(s.path for s in inputs.sources) == expected, pattern
        assert inputs.runs == ([c / "config.yaml"] if pattern in ("**", "**/*", "*") else []), pattern
    write(tmp_path / "new" / "a.txt", "alpha\n")  # the run's own out_dir, before it has marked it
    monkeypatch.chdir(tmp_path / "new")
    assert [s.path for s in resolve_inputs("*.txt", runs=[Path(".")]).sources] == [Path("a.txt")]


def test_a_glob_into_a_cache_folder_leaves_out_only_its_entries_as_the_folder_form_does(tmp_path: Path) -> None:
    novels = tmp_path / "novels"
    write(novels / "a.txt", "alpha\n")
    entry = prepare(novels, cache_dir=str(novels)).path
    write(novels / "b.txt", "beta\n")
    for spec in (novels, f"{novels}/**", f"{novels}/*", f"{novels}/*.*"):
        inputs = resolve_inputs(spec)
        assert [s.path for s in inputs.sources] == [novels / "a.txt", novels / "b.txt"], spec
        assert inputs.caches == [novels], spec
    assert entry.exists()


def test_a_folder_of_nothing_but_runs_says_so(tmp_path: Path) -> None:
    a_run(tmp_path / "runs" / "tiny", ".lock")
    with pytest.raises(DataError, match=r"is a folder with no text files in it \(tinychar run folders left out: '"):
        resolve_inputs(tmp_path / "runs")


# --- tinychar's cache of encoded corpora under data.path -------------------------------------------------------------


def cache_inside(novels: Path, how: str, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, Path]:
    """(settings for prepare, the cache folder): a cache folder inside novels, chosen by the setting how names."""
    if how == "data.cache_dir":
        return {"cache_dir": str(novels / "cache")}, novels / "cache"
    if how == "TINYCHAR_CACHE_DIR":
        monkeypatch.setenv("TINYCHAR_CACHE_DIR", str(novels / "cache"))
        return {}, novels / "cache"
    monkeypatch.delenv("TINYCHAR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(novels / "xdg"))
    return {}, novels / "xdg" / "tinychar" / "encoded"


@pytest.mark.parametrize("how", ["data.cache_dir", "TINYCHAR_CACHE_DIR", "XDG_CACHE_HOME"])
def test_a_cache_folder_inside_the_data_folder_is_left_out_with_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The cache's meta files are JSON text: each run trained on those of the runs before it (a new vocabulary, a
    new entry, one more meta file for the next run), and a --resume blamed the corpus for characters it lacked."""
    novels = tmp_path / "novels"
    write(novels / "a.txt", "alpha\n")
    write(novels / "b" / "c.txt", "gamma\n")
    settings, cache = cache_inside(novels, how, monkeypatch)
    first = prepare(novels, **settings)
    assert first.path.parent == cache and text_of(first) == "alpha\n\ngamma\n"
    again = prepare(novels, **settings)
    assert again.cache_hit and text_of(again) == text_of(first) and again.fingerprint == first.fingerprint
    (note,) = [n for n in again.notes if "tinychar's cache" in n]
    assert note == (
        "data.path: left out the files of tinychar's cache of encoded corpora (ids and meta files, not training text) "
        f"in 1 folder(s): {quoted(cache, 133)}"
    )
    assert len(list(cache.glob("*.json"))) == 1  # no entry of a corpus holding the cache itself


def test_a_glob_leaves_out_the_cache_folder_and_any_folder_holding_cache_entries(tmp_path: Path) -> None:
    """A glob's matches inside the cache folder were training text too; and a cache folder that no setting names
    any more (a run with another data.cache_dir left it) is told by the entries it holds."""
    novels = tmp_path / "novels"
    write(novels / "a.txt", "alpha\n")
    write(novels / "notes" / "page-0123456789abcdef0123456789abcdef.json", '{"a person\'s": "file"}\n')  # no .ids
    cache = prepare(novels, cache_dir=str(novels / "cache")).path.parent
    texts = [novels / "a.txt", novels / "notes" / "page-0123456789abcdef0123456789abcdef.json"]
    for spec in (novels, f"{novels}/**/*", f"{novels}/**", f"{novels}/*"):
        told_by_its_entries = resolve_inputs(spec)
        assert [s.path for s in told_by_its_entries.sources] == texts and told_by_its_entries.caches == [cache], spec
        named_by_the_settings = resolve_inputs(spec, "data.path", [cache])
        assert [s.path for s in named_by_the_settings.sources] == texts and named_by_the_settings.caches == [cache]
    for pattern in ("c*/*.json", "cache/*", "**/*.ids"):  # every match is the cache's
        with pytest.raises(DataError, match=r"no text file matches .* \(tinychar cache folders left out: '"):
            resolve_inputs(f"{novels}/{pattern}")


def test_a_cache_folder_that_is_the_data_folder_itself_leaves_out_only_its_entries(tmp_path: Path) -> None:
    """data.path=. with data.cache_dir=.: the folder is the corpus the person chose; the cache's files are not (a
    JSON file of the person's own, named like a meta but with no ids beside it, is)."""
    novels = tmp_path / "novels"
    write(novels / "a.txt", "alpha\n")
    write(novels / "page-0123456789abcdef0123456789abcdef.json", "[1]\n")
    first = prepare(novels, cache_dir=str(novels))
    write(novels / "b.txt", "beta\n")
    second = prepare(novels, cache_dir=str(novels))
    assert text_of(first) == "alpha\n\n[1]\n" and text_of(second) == "alpha\n\nbeta\n\n[1]\n"
    inputs = resolve_inputs(novels)
    assert [s.path.name for s in inputs.sources] == ["a.txt", "b.txt", "page-0123456789abcdef0123456789abcdef.json"]
    assert inputs.caches == [novels]
    for entry in (second.path, second.path.with_suffix(".json")):
        write(tmp_path / "only" / entry.name, entry.read_bytes())
    with pytest.raises(DataError, match=r"is a folder with no text files in it \(tinychar cache folders left out: '"):
        resolve_inputs(tmp_path / "only")


@pytest.mark.slow
def test_a_run_whose_out_dir_is_inside_its_data_folder_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The audit's case: cd novels; train.py data.path=. (out_dir runs/tiny), then --resume was refused for
    'characters the model never saw' (those of config.yaml), and later runs trained on it."""
    from conftest import SMALL_TEXT, tiny_overrides

    import train

    novels = tmp_path / "novels"
    write(novels / "a.txt", SMALL_TEXT)
    monkeypatch.chdir(novels)
    first = tiny_overrides(Path("."), Path("runs/tiny"), **{"train.sample_chars": 0, "train.tensorboard": "false"})
    assert train.main(first, progress=False) == 0
    assert train.main(["--resume", "--out-dir", "runs/tiny", "train.max_iters=30"], progress=False) == 0
    said = capsys.readouterr()
    assert "characters the model never saw" not in said.err
    assert "left out what 1 tinychar run(s) wrote there" in said.out  # said at the resume, which found the run


def test_a_pipe_or_a_broken_link_under_a_data_folder_or_a_glob_is_left_out_with_a_note(tmp_path: Path) -> None:
    """They were skipped without a word, where a binary file gets a note: a link whose target moved left a file out
    of the corpus unsaid."""
    novels = tmp_path / "novels"
    write(novels / "a.txt", "alpha\n")
    os.mkfifo(novels / "pipe.txt")
    (novels / "moved.txt").symlink_to(tmp_path / "gone.txt")
    for spec in (novels, str(novels / "*.txt")):
        corpus = prepare(spec)
        assert text_of(corpus) == "alpha\n"
        (note,) = [n for n in corpus.notes if "no file to read" in n]
        assert note == (
            f"data.path: left out 2 entries that are no file to read (a named pipe, a socket, a device or a link that "
            f"leads nowhere): {quoted(novels / 'moved.txt', 133)}, {quoted(novels / 'pipe.txt', 133)}"
        )
