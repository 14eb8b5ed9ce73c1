"""The training text: a user's file, or tiny Shakespeare, which ships beside this module.

Every failure a person can fix raises DataError with a one-line message saying what is wrong and what to do.
"""

from __future__ import annotations

import codecs
import difflib
import hashlib
import os
import stat
from pathlib import Path

from configs.userinput import file_kind, not_stdin

from .config import DataConfig
from .paths import UTF16_MARKS, DataError, expand_home, not_utf8, open_regular, quoted, stat_path

SHAKESPEARE_FILE = "tinyshakespeare.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHAKESPEARE_BYTES = 1_115_394
_CHUNK = 1 << 16
_SNIFF = 8000  # bytes looked at for a NUL to tell a binary file from text (git looks at as many)


def data_dir() -> Path | None:
    """$TINYCHAR_DATA_DIR: a folder of the user's corpora, where a relative data.path not found from the current
    folder is looked up (None when unset). Nothing is ever written there."""
    folder = os.environ.get("TINYCHAR_DATA_DIR")
    return expand_home(folder, "TINYCHAR_DATA_DIR") if folder else None


def _shipped_sha256(path: Path, restore: str) -> str:
    """The sha256 of the file at path, if it is a regular file of the shipped size; else DataError (restore: what to
    do). Opened as data.path files are, without blocking, and judged by the open file (fstat): a named pipe in its
    place waited forever for a writer, and a link to /dev/zero was read forever. No more than the shipped size is
    read, whatever the file grows to meanwhile."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise DataError(f"the built-in tiny Shakespeare {quoted(path)} is missing; {restore}") from None
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise DataError(f"cannot read the built-in tiny Shakespeare {quoted(path)} ({reason}); {restore}") from None
    try:
        st = os.fstat(fd)
        if (kind := file_kind(st.st_mode)) is not None:
            raise DataError(f"the built-in tiny Shakespeare {quoted(path)} is {kind}, not a file; {restore}")
        os.set_blocking(fd, True)  # a plain file (O_NONBLOCK was for a pipe's open): read as one, on any file system
        if st.st_size != SHAKESPEARE_BYTES:
            raise DataError(f"{quoted(path)} is not the tiny Shakespeare tinychar ships ({st.st_size:,} bytes, "
                            f"expected {SHAKESPEARE_BYTES:,}); {restore}")
        digest, left = hashlib.sha256(), SHAKESPEARE_BYTES
        while left and (chunk := os.read(fd, min(_CHUNK, left))):
            digest.update(chunk)
            left -= len(chunk)
    except OSError as e:  # EIO from a failing disk
        reason = e.strerror or type(e).__name__
        raise DataError(f"cannot read the built-in tiny Shakespeare {quoted(path)} ({reason}); {restore}") from None
    finally:
        os.close(fd)
    return digest.hexdigest()


def shakespeare_path() -> Path:
    """The tiny Shakespeare that ships with tinychar (data/tinyshakespeare.txt), checked against its sha256.

    Only read, never written: no download, no network, nothing made next to it.
    """
    return check_shakespeare(Path(__file__).resolve().parent / SHAKESPEARE_FILE)


def check_shakespeare(target: Path) -> Path:
    """target, if it holds exactly the tiny Shakespeare tinychar ships; else DataError saying how to get it back."""
    restore = f"restore it with `git checkout -- data/{SHAKESPEARE_FILE}`, or train on your own text with data.path=..."
    digest = _shipped_sha256(target, restore)
    if digest != SHAKESPEARE_SHA256:
        # Never rewritten here: the change may be someone's own edit. (Line endings converted by a checkout are the
        # usual cause; .gitattributes keeps git from doing that.)
        raise DataError(
            f"{quoted(target)} is not the tiny Shakespeare tinychar ships (sha256 {digest[:16]}..., expected "
            f"{SHAKESPEARE_SHA256[:16]}...); {restore}"
        )
    return target


def locate(spec: str) -> Path:
    """The path a data.path names: as given, or, when it is relative and not found from the current folder, inside
    $TINYCHAR_DATA_DIR if that holds it."""
    try:
        p = Path(spec).expanduser()
    except RuntimeError:  # '~' with no $HOME and no entry in the user database: taken as written, and not found
        p = Path(spec)
    folder = data_dir()
    if folder is not None and not p.is_absolute() and not _exists(p) and _exists(folder / p):
        return folder / p
    return p


def _exists(p: Path) -> bool:
    """Whether p leads somewhere; False on any error, which looking at p itself then reports."""
    try:
        os.stat(p)
    except (OSError, ValueError):
        return False
    return True


def read_text(path: str | Path, min_chars: int = 2, *, label: str = "data.path", errors: str = "strict") -> str:
    """The text of a UTF-8 file as training reads it (newlines untouched, a leading byte-order mark left out), with
    at least min_chars characters.

    Callers pass min_chars = block_size + 1, the length of one training window. label names the setting the
    path came from, so that the message points at what to change. errors is data.errors: strict refuses bytes that
    are not UTF-8, replace makes them U+FFFD, as prepare_corpus's streaming reader does.
    """
    p = Path(path)
    st = stat_path(p, label)
    if st is None:
        raise no_such_file(label, path, p)
    if stat.S_ISDIR(st.st_mode):
        raise DataError(f"{label}: {quoted(path)} is a folder, not a text file; give the path of a UTF-8 text file")
    with open_regular(p, label) as f:  # a pipe or device is refused here, before any read
        raw = f.read()
    if not raw:
        raise DataError(
            f"{label}: {quoted(path)} is empty; give a UTF-8 text file with at least {min_chars} characters"
        )
    if b"\x00" in raw[:_SNIFF] or raw.startswith(UTF16_MARKS):
        # Text has no NUL bytes; a checkpoint, an archive, an image or UTF-16 text has many. Said plainly here, as
        # the UTF-8 error below would suggest converting the file from Latin-1.
        raise not_utf8(label, path, raw[:4])
    # A byte-order mark says how the file was saved and is no character of its text: prepare_corpus leaves it out,
    # and so does this, or a tokenizer built from this text has U+FEFF that the run's vocabulary lacks.
    start = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0
    try:
        # Bytes decoded directly rather than a text-mode open, which would turn "\r\n" into "\n".
        text = raw[start:].decode("utf-8", errors)
    except UnicodeDecodeError as e:
        at = start + e.start  # an offset into the file, the mark included
        line = raw.count(b"\n", 0, at) + 1
        raise DataError(
            f"{label}: {quoted(path)} is not UTF-8 (byte 0x{raw[at]:02x} at offset {at}, line "
            f"{line}); convert it to UTF-8, e.g. iconv -f latin1 -t utf-8"
        ) from e
    if len(text) < min_chars:
        raise DataError(
            f"{label}: {quoted(path)} has {len(text)} character{'s' * (len(text) != 1)}, but one "
            f"training window needs at least block_size + 1 = {min_chars}; use a longer text or a smaller "
            "model.block_size"
        )
    return text


def no_such_file(label: str, given: object, p: Path) -> DataError:
    """The DataError for a path that leads nowhere: where a relative one was looked for (the current folder, and
    $TINYCHAR_DATA_DIR when set, said to be no folder when it is none), and the closest name there or what to do."""
    if str(given) == "-":
        return DataError(not_stdin(label))
    where = ""
    if not p.is_absolute():
        try:
            where = f" (looked for from {quoted(os.getcwd())}"
        except OSError:  # the current folder was removed
            where = " (looked for from the current folder, which no longer exists"
        folder = data_dir()
        if folder is not None:
            where += f" and in TINYCHAR_DATA_DIR {quoted(folder)}{'' if os.path.isdir(folder) else ', no folder'}"
        where += ")"
    return DataError(f"{label}: no such file {quoted(given)}{where}{_did_you_mean(p) or '; check the path'}")


def _did_you_mean(p: Path) -> str:
    """'; did you mean ...?' naming the closest file in the same folder, or '' when there is none."""
    folder = p.parent
    try:
        names = [q.name for q in folder.iterdir() if q.is_file()]
    except OSError:
        return ""
    match = difflib.get_close_matches(p.name, names, n=1)
    return f"; did you mean {quoted(p.with_name(match[0]))}?" if match else ""


def load_corpus(cfg: DataConfig, min_chars: int = 2) -> tuple[str, str]:
    """The training text and where it came from (for logs); cfg.path wins over cfg.dataset."""
    if cfg.path is not None:
        return read_text(locate(cfg.path), min_chars, errors=cfg.errors), cfg.path
    if cfg.dataset == "shakespeare_char":
        path = shakespeare_path()
        return (read_text(path, min_chars, label="data.dataset=shakespeare_char", errors=cfg.errors),
                f"tiny Shakespeare ({path})")
    # DataConfig refuses any other dataset, so reaching this line means the two lists fell out of step.
    raise ValueError(f"data.dataset {cfg.dataset!r} is accepted by DataConfig but load_corpus cannot load it")
