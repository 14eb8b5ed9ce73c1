"""The training text: a user's file, or tiny Shakespeare downloaded once, checked by sha256 and cached.

Every failure a person can fix raises DataError with a one-line message saying what is wrong and what to do.
"""

from __future__ import annotations

import difflib
import hashlib
import http.client
import os
import secrets
import urllib.error
import urllib.request
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from .config import DataConfig

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_FILE = "tinyshakespeare.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"  # 1,115,394 bytes
_CHUNK = 1 << 16
_TIMEOUT_S = 30.0  # per socket operation, so a dead connection fails instead of hanging the run
_SNIFF = 8000  # bytes looked at for a NUL to tell a binary file from text (git looks at as many)


class DataError(ValueError):
    """The training text cannot be had; the message is one line for a person: what is wrong, what to do."""


def data_dir() -> Path:
    """Where built-in corpora are cached: $TINYCHAR_DATA_DIR, else $XDG_CACHE_HOME/tinychar, else ~/.cache/tinychar."""
    if folder := os.environ.get("TINYCHAR_DATA_DIR"):
        return Path(folder).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "tinychar"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def shakespeare_path(progress: bool = True) -> Path:
    """The cached tiny Shakespeare file, downloaded into data_dir() first if it is not there.

    A valid cached copy is only read, never rewritten, so the cache may live in a read-only folder.
    """
    folder = data_dir()
    target = folder / SHAKESPEARE_FILE
    if target.exists():
        try:
            digest = _sha256(target)
        except OSError as e:
            raise DataError(
                f"cannot read the cached tiny Shakespeare {target} ({e.strerror or e}); "
                "fix its permissions or delete it so it is downloaded again"
            ) from e
        if digest != SHAKESPEARE_SHA256:
            # Never deleted here: the file may be someone's own text that happens to carry this name.
            raise DataError(
                f"{target} is not the expected tiny Shakespeare (sha256 {digest[:16]}..., expected "
                f"{SHAKESPEARE_SHA256[:16]}...); delete it so it is downloaded again"
            )
        return target
    _download(folder, target, progress)
    return target


def _download(folder: Path, target: Path, progress: bool) -> None:
    advice = f"pass data.path=your_text.txt (or set TINYCHAR_DATA_DIR to a folder holding {SHAKESPEARE_FILE})"
    # A name of our own rather than tempfile.mkstemp: mkstemp makes the file 0600, and the final file should get
    # the usual permissions so that a shared cache stays readable by others.
    partial = folder / f".{SHAKESPEARE_FILE}.{os.getpid()}.{secrets.token_hex(4)}.part"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        out = partial.open("xb")
    except OSError as e:
        raise DataError(
            f"tiny Shakespeare is not cached in {folder} and cannot be saved there ({e.strerror or e}); {advice}"
        ) from e
    try:
        with out:
            try:
                digest = _fetch(SHAKESPEARE_URL, out, progress)
            # URLError, timeouts, resets and TLS failures are all OSErrors; a short read is an HTTPException.
            except (OSError, http.client.HTTPException) as e:
                raise DataError(
                    f"tiny Shakespeare is not cached in {folder} and could not be downloaded ({_reason(e)}); {advice}"
                ) from e
        if digest != SHAKESPEARE_SHA256:
            raise DataError(
                f"the download of {SHAKESPEARE_URL} has sha256 {digest[:16]}..., expected "
                f"{SHAKESPEARE_SHA256[:16]}... (a truncated or changed file); try again, or {advice}"
            )
        # Atomic on one file system, which is why the partial file sits in the same folder: a reader sees either
        # no file or the whole, checked file, even when two runs download at once.
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _fetch(url: str, out: BinaryIO, progress: bool) -> str:
    """Stream url into out with a progress bar; the sha256 of what was received."""
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response:
        length = response.headers.get("Content-Length")
        total = int(length) if length and length.isdigit() else None
        with tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=SHAKESPEARE_FILE, disable=not progress
        ) as bar:
            while chunk := response.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
                bar.update(len(chunk))
    return digest.hexdigest()


def _reason(e: Exception) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):
        return str(e.reason)
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__


def read_text(path: str | Path, min_chars: int = 2, *, label: str = "data.path") -> str:
    """The exact contents of a UTF-8 text file (newlines untouched), with at least min_chars characters.

    Callers pass min_chars = block_size + 1, the length of one training window. label names the setting the
    path came from, so that the message points at what to change.
    """
    p = Path(path)
    shown = str(path)
    if p.is_dir():
        raise DataError(f"{label}: {shown!r} is a folder, not a text file; give the path of a UTF-8 text file")
    try:
        raw = p.read_bytes()
    except FileNotFoundError as e:
        raise DataError(f"{label}: no such file {shown!r}{_did_you_mean(p)}") from e
    except PermissionError as e:
        raise DataError(f"{label}: cannot read {shown!r} (permission denied); check the file's permissions") from e
    except OSError as e:
        raise DataError(f"{label}: cannot read {shown!r} ({e.strerror or e})") from e
    except ValueError as e:  # a NUL character in the path, which no file name can hold
        raise DataError(f"{label}: {shown!r} is not a usable path ({e})") from e
    if not raw:
        raise DataError(f"{label}: {shown!r} is empty; give a UTF-8 text file with at least {min_chars} characters")
    if b"\x00" in raw[:_SNIFF]:
        # Text has no NUL bytes; a checkpoint, an archive, an image or UTF-16 text has many. Said plainly here, as
        # the UTF-8 error below would suggest converting the file from Latin-1.
        raise DataError(
            f"{label}: {shown!r} is a binary file (it holds NUL bytes: a checkpoint, an archive, UTF-16 text?), "
            "not UTF-8 text; give a UTF-8 text file"
        )
    try:
        # Bytes decoded directly rather than a text-mode open, which would turn "\r\n" into "\n".
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{label}: {shown!r} is not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}, line "
            f"{line}); convert it to UTF-8, e.g. iconv -f latin1 -t utf-8"
        ) from e
    if len(text) < min_chars:
        raise DataError(
            f"{label}: {shown!r} has {len(text)} characters, but one training window needs at least "
            f"block_size + 1 = {min_chars}; use a longer text or a smaller model.block_size"
        )
    return text


def _did_you_mean(p: Path) -> str:
    """'; did you mean ...?' naming the closest file in the same folder, or '' when there is none."""
    folder = p.parent
    try:
        names = [q.name for q in folder.iterdir() if q.is_file()]
    except OSError:
        return ""
    match = difflib.get_close_matches(p.name, names, n=1)
    return f"; did you mean {str(p.with_name(match[0]))!r}?" if match else ""


def load_corpus(cfg: DataConfig, min_chars: int = 2, progress: bool = True) -> tuple[str, str]:
    """The training text and where it came from (for logs); cfg.path wins over cfg.dataset."""
    if cfg.path is not None:
        return read_text(cfg.path, min_chars), cfg.path
    if cfg.dataset == "shakespeare_char":
        path = shakespeare_path(progress)
        return read_text(path, min_chars, label="data.dataset=shakespeare_char"), f"tiny Shakespeare ({path})"
    # DataConfig refuses any other dataset, so reaching this line means the two lists fell out of step.
    raise ValueError(f"data.dataset {cfg.dataset!r} is accepted by DataConfig but load_corpus cannot load it")
