"""The files of the encoded-corpus cache: an entry is `<stem>-<key>.ids` (the token ids) and `<stem>-<key>.json` (its
meta: vocabulary, dtype, count, the CRC-32 of the ids, and the CRC-32 of the rest of the meta). An entry is trusted
only once its meta agrees with its own checksum, its ids file has the size and the checksum its meta says, and every
id is one of its vocabulary; written atomically (hidden partial files, renamed into place); pruned when stale.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import stat
import time
import zlib
from itertools import pairwise
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from configs.userinput import file_kind, private_temp_root, temp_root

from .idsfile import read_ids
from .paths import LOG_PATH, DataError, open_regular, quoted
from .sources import FORMAT_VERSION

# The partial files open_part names: '.<stem>.<pid>.<8 hex digits><suffix>.part', suffix '.ids' or '.json'.
_PART = re.compile(r"\.(?P<stem>.+)\.(?P<pid>[0-9]+)\.[0-9a-f]{8}\.(?:ids|json)\.part")
# The largest meta read: a vocabulary of every Unicode character takes under 18 MB of escaped JSON, and each source
# file about 200 bytes; a corpus of a million files would fit.
META_MAX_BYTES = 256 << 20
# How long a partial file must have gone unwritten before it may be reaped (see reap_parts for why an hour).
STALE_PART_S = 3600.0


def find(folders: list[Path], stem: str, key: str, damaged: list[str]) -> tuple[dict, Path, torch.Tensor] | None:
    """(meta, ids file, ids) of the first entry for key that is whole, its ids read (read_ids); None when there is none.

    An entry of this format whose meta disagrees with itself (its own checksum, or a vocabulary that is no sorted
    list of characters) or whose ids are not sound (the wrong size or checksum, or an id past the vocabulary: a disk
    error, a stray write, a copy cut short) is removed where possible, and said in damaged, so that it is encoded
    again, not trusted: a wrong vocabulary would give every id the wrong character, or an id no embedding has.
    """
    for folder in folders:
        meta_path, ids_path = folder / f"{stem}-{key}.json", folder / f"{stem}-{key}.ids"
        if not os.path.lexists(meta_path):  # no entry (or no such folder: writing there says so)
            continue
        try:
            info = _read_meta(meta_path)
        except ValueError:  # there, but no meta: cut short, overwritten, a pipe or a folder in its place
            state, why = ("could not be read", "no permission") if not os.access(meta_path, os.R_OK) else (
                "was damaged", "its meta is not the JSON the encoder wrote")
            damaged.append(_damaged_note(meta_path, state, why))
            _remove(meta_path, ids_path)
            continue
        try:
            dtype, n_tokens = np.dtype(info["dtype"]), int(info["n_tokens"])
            # a meta without its own checksum is from before metas carried one: encoded again, like an older format
            # (its vocabulary was trusted if sorted, and one flipped bit, 'z' read as '{', kept it sorted)
            sound = (info["format"] == FORMAT_VERSION and info["key"] == key and isinstance(info["crc32"], int)
                     and "meta_crc32" in info)
        except (ValueError, KeyError, TypeError, OverflowError):  # JSON, but not a meta of this version (an infinite
            continue  # count, 1e999, was an OverflowError traceback in every run)
        if not sound:
            continue
        damaged_path, why, state = meta_path, _meta_damage(info, dtype), "was damaged"
        if not why:
            try:
                mapped, why = _open_checked(ids_path, dtype, n_tokens, info["crc32"], len(info["chars"]))
            except OSError as e:  # no permission to read it, say: nothing says its bytes are wrong
                mapped, why, state = None, e.strerror or type(e).__name__, "could not be read"
            if mapped is not None:
                return info, ids_path, mapped
            damaged_path = ids_path
        damaged.append(_damaged_note(damaged_path, state, why))
        _remove(meta_path, ids_path)
    return None


def _damaged_note(path: Path, state: str, why: str) -> str:
    return f"data: the cached copy {quoted(path, LOG_PATH)} {state} ({why}); it has been encoded again"


def _remove(meta_path: Path, ids_path: Path) -> None:
    """Remove a damaged entry, the meta first: without it, no one trusts the ids."""
    for path in (meta_path, ids_path):
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only cache folder (or a folder in the way): the entry stays, and is checked again next time


def _read_meta(path: Path) -> dict:
    """The JSON of the meta file at path; OSError or ValueError (DataError among them) when it cannot be one.

    Opened as data.path is, without blocking and only if it is a regular file: a meta that is a pipe waited forever,
    one linked to /dev/zero filled the memory, and JSON nested past Python's recursion limit was a traceback. Nor is
    one larger than META_MAX_BYTES read: a sparse file of 100 GB in a meta's place was a MemoryError traceback.
    """
    with open_regular(path, "data.cache_dir") as f:
        text = f.read(META_MAX_BYTES + 1)
        if len(text) > META_MAX_BYTES:
            raise ValueError(f"{path} is larger than any meta ({META_MAX_BYTES:,} bytes)")
        try:
            info = json.loads(text.decode("utf-8"))
        except RecursionError:
            raise ValueError(f"{path} is JSON nested too deep to be a meta") from None
    if not isinstance(info, dict):
        raise ValueError(f"{path} holds JSON that is no meta")
    return info


def meta_checksum(info: dict) -> int:
    """The CRC-32 of a meta, less its own "meta_crc32": the same for the dict written and the dict read back, as JSON
    gives back the same strings, integers and lists it was given."""
    rest = {name: value for name, value in info.items() if name != "meta_crc32"}
    return zlib.crc32(json.dumps(rest, sort_keys=True).encode("ascii"))  # \u-escaped: ASCII whatever the paths


def _meta_damage(info: dict, dtype: np.dtype) -> str:
    """Why a meta of this format cannot be what the encoder wrote, in words; '' when nothing says so (its vocabulary
    a sorted list of distinct characters, as every encoder wrote it, and _open_checked then finds every id within
    it)."""
    chars = info.get("chars")
    if info["meta_crc32"] != meta_checksum(info):
        return "its meta does not match its own checksum"
    if not isinstance(chars, list) or not all(isinstance(c, str) and len(c) == 1 for c in chars):
        return "its vocabulary is not a list of characters"
    if any(a >= b for a, b in pairwise(chars)):
        return "its vocabulary is not sorted, or holds a character twice"
    if dtype.str not in ("|u1", "<u2", "<u4"):  # what ids_dtype gives: a big-endian '>u2' was a traceback
        return f"its ids are said to be {dtype.str}, not unsigned little-endian integers of 1, 2 or 4 bytes"
    return ""


def _open_checked(
    path: Path, dtype: np.dtype, n_tokens: int, crc: int, n_chars: int
) -> tuple[torch.Tensor | None, str]:
    """(the ids, '') if the file at path holds n_tokens ids of dtype whose CRC-32 is crc, each below n_chars (the
    size of the vocabulary); else (None, why not). OSError where it cannot be opened for another reason than its
    absence (no permission): unreadable, which is not damaged.

    The checksum is taken on the bytes then used (read_ids), or on the same open file that is then mapped.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None, "it is missing"
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # before fdopen, which refuses a folder with an OSError naming the fd ('3')
        os.close(fd)
        return None, f"it is {file_kind(st.st_mode)}"
    with os.fdopen(fd, "rb", buffering=0) as f:
        expected = n_tokens * dtype.itemsize
        if st.st_size != expected:
            return None, f"it holds {st.st_size:,} bytes, not {expected:,}"
        try:
            found, top, ids = read_ids(f, dtype, n_tokens)
            if found != crc:
                return None, f"its CRC-32 is {found:08x}, not {crc:08x}"
            if top >= n_chars:
                return None, f"it holds id {top:,}, past the {n_chars:,} characters of the vocabulary in its meta"
            return ids, ""
        except OSError as e:
            return None, e.strerror or type(e).__name__


def open_part(
    folders: list[Path], stem: str, suffix: str, refused: list[str], setting: str = "data.cache_dir"
) -> tuple[Path, BinaryIO, Path]:
    """(folder, file, path): a new hidden partial file in the first folder that takes one; refusals noted. setting
    is what chose the folders (data.cache_dir or TINYCHAR_CACHE_DIR), named in the refusal."""
    for folder in folders:
        # A name of our own rather than tempfile's: mkstemp makes files 0600, and a shared cache should stay
        # readable by others.
        part = folder / f".{stem}.{os.getpid()}.{secrets.token_hex(4)}{suffix}.part"
        if _read_only(folder):
            refused.append(f"{quoted(folder)} (read-only)")
            continue
        try:
            if folder.is_relative_to(temp_root()):  # made for this user alone: the text's ids are readable in it
                private_temp_root()
            folder.mkdir(parents=True, exist_ok=True)
            return folder, part.open("xb"), part
        except OSError as e:
            refused.append(f"{quoted(folder)} ({_why_not(folder, e)})")
        except ValueError:  # a config's "\0" or "\ud800": a ValueError or UnicodeEncodeError traceback
            refused.append(f"{quoted(folder)} (it holds a character no file name can)")
    raise DataError(
        f"{setting}: cannot write the encoded corpus to {'; nor to '.join(refused)}; set {setting} to a writable folder"
    )


def reap_parts(folder: Path) -> list[Path]:
    """Remove the partial files that encodings killed midway (kill -9, an OOM kill, a power cut) left in folder; the
    paths removed. Nothing else ever removes them, and each is up to the size of its corpus's ids.

    A partial file is removed only when both hold: the process its name gives is not alive on this machine, and the
    file has not been written for STALE_PART_S (an hour). The pid alone is not enough: a cache folder may be shared
    (NFS, a cluster's home folder) with other machines, whose pids mean nothing here, so a pid dead here may be a
    live encoder there. Such an encoder writes its file a chunk at a time, every few seconds, until it renames it;
    only the fsync and the read-back checksum at the end (about a second a GB) write nothing. An hour without a
    write rules it out, with room to spare for clocks that disagree between machines. The age alone is not enough
    either: an encoder on this machine that was stopped (Ctrl-Z, a suspended laptop) for an hour still owns its
    file. A pid alive here keeps its file, even when it was reused by another program: the file goes once that
    process has ended. Only names of open_part's exact form are touched, never anything else in the folder.
    """
    removed = []
    for path, _ in orphaned_parts(folder):
        try:
            if time.time() - os.lstat(path).st_mtime < STALE_PART_S:
                continue
            path.unlink()
        except OSError:
            continue  # gone already (another run reaped it), or not ours to remove
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    """Whether a process with this id lives on this machine (or may: when it cannot be told, it counts as alive)."""
    if pid <= 0 or pid == os.getpid():  # 0 and -1 would signal a group, not look at one process
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # EPERM: another user's process, alive
        return True
    return True


def _why_not(folder: Path, e: OSError) -> str:
    """Why folder cannot hold the cache, in words: what is there instead of a folder, else the system's reason."""
    try:
        kind = file_kind(os.stat(folder).st_mode)
    except OSError:
        try:  # a link to nowhere, or in a loop: mkdir said only 'File exists'
            return f"it is a symbolic link to {quoted(os.readlink(folder))}, which leads to no folder"
        except OSError:
            kind = "a folder"
    if kind != "a folder":
        return f"it is {kind or 'a file'}, not a folder"
    return e.strerror or type(e).__name__


def _read_only(folder: Path) -> bool:
    """Whether folder, or the nearest existing folder above it, is marked read-only.

    The mode bits count even for root, who could write anyway: a folder made read-only is meant to stay as it is.
    A folder that cannot be looked at is not called read-only here: trying to write to it gives the reason.
    """
    existing = folder
    try:
        while not os.path.lexists(existing) and existing.parent != existing:
            existing = existing.parent
        st = os.stat(existing)
    except (OSError, ValueError):
        return False
    return stat.S_ISDIR(st.st_mode) and (not st.st_mode & 0o222 or not os.access(existing, os.W_OK))


def prune(folder: Path, stem: str, key: str, info: dict) -> None:
    """Delete older entries of the same corpus with the same settings, or of an older format (which nothing reads any
    more): they are stale copies, and a re-encoded 1 GB corpus would otherwise leave a 1 GB file behind at every
    edit. The same corpus is one asked for the same way (its meta's "spec": the same folder or glob, whatever files it
    gave then: one gaining a file left a whole entry behind at each change), or one made from the same files (all
    a meta from before metas said what was asked for can be told by): with the same stem and settings, another key
    means that those files changed. An entry of another folder or glob, of other files, is never touched. A run that
    has read or mapped an entry deleted here reads on: its ids are in its memory, or the map keeps the file for it.
    """
    paths, spec = [s[0] for s in info["sources"]], info.get("spec") or None
    try:
        metas = list(folder.glob(f"{stem}-*.json"))
    except OSError:
        return
    for meta_path in metas:
        if meta_path.name == f"{stem}-{key}.json":
            continue
        try:
            old = _read_meta(meta_path)
            if (spec is None or old.get("spec") != spec) and [s[0] for s in old["sources"]] != paths:
                continue
            if old.get("format") == FORMAT_VERSION and old["settings"] != info["settings"]:
                continue
            meta_path.unlink()
            meta_path.with_suffix(".ids").unlink(missing_ok=True)
        except (OSError, ValueError, LookupError, TypeError):  # an empty source too: an IndexError traceback
            continue  # someone else's file, or one being replaced at this moment: leave it


def unwritten(setting: str, folder: Path, entry: tuple[Path, ...], e: OSError) -> DataError:
    """The DataError for an entry that could not be written into folder: a folder where its file goes, a full disk,
    or the system's reason."""
    if (blocked := next((p for p in entry if os.path.isdir(p)), None)) is not None:
        return DataError(f"{setting}: cannot write the encoded corpus to {quoted(blocked)}: a folder of that name is "
                         f"in the way; move it away, or set {setting} to another folder")
    full = e.errno in (errno.ENOSPC, errno.EDQUOT)
    todo = "free some space or" if full else "check the folder, or"
    left = orphaned_parts(folder) if full else []
    if left:  # not reaped yet: each is kept an hour, in case its encoder lives on another machine (reap_parts)
        size = sum(n for _, n in left)
        todo = (f"{len(left)} partial file{'s' if len(left) > 1 else ''} that an encoding killed midway left there "
                f"hold{'' if len(left) > 1 else 's'} {_megabytes(size)} ({quoted(left[0][0].name)}"
                f"{', ...' if len(left) > 1 else ''}): remove {'them' if len(left) > 1 else 'it'} if no other "
                f"machine is encoding into that folder, free some space, or")
    return DataError(f"{setting}: cannot write the encoded corpus to {quoted(folder)} ({e.strerror or e}); {todo} "
                     f"set {setting} to another folder")


def _megabytes(n: int) -> str:
    return f"{n / 2**20:,.0f} MB" if n >= 10 * 2**20 else f"{n / 2**20:.1f} MB" if n >= 2**20 // 10 else f"{n:,} bytes"


def orphaned_parts(folder: Path) -> list[tuple[Path, int]]:
    """The partial files in folder whose encoder is not alive on this machine, with their sizes, largest first."""
    if os.name != "posix":  # os.kill(pid, 0) would end the process on Windows, not look at it
        return []
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    found = []
    for name in names:
        match = _PART.fullmatch(name)
        if match is not None and not _alive(int(match["pid"])):
            try:
                found.append((folder / name, os.lstat(folder / name).st_size))
            except OSError:
                continue
    return sorted(found, key=lambda item: -item[1])
