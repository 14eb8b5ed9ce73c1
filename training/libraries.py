"""Damaged libraries of compiled code in the compile cache, found before torch.compile loads them.

Inductor links each piece of compiled C++ straight to its place in the cache (`<hash>.so`, the C++ wrapper's
`<hash>.main.so`) and loads it with dlopen from there the next time. A link cut short (the process killed while the
linker wrote, a full disk) leaves a file that is not whole: dlopen of one cut anywhere past its first pages maps what
is no longer there, and the process died of SIGBUS (exit 135, no line) on every later compile; an empty or garbled one
failed to load, and every later run trained eagerly, saying it could not compile. A library that is not there is
simply built again (measured: the sampler's loop from a warm cache in 3.7 s, the same characters), so a damaged one is
removed before compiling, unless another process may be building it now: inductor builds each of its libraries
holding a lock named by it (locks/<key>.lock in the cache folder), which is taken here too before one is removed.
Linux only: the check reads ELF, the format Linux's libraries are in.

The temporary files of writes killed midway are removed from the folder too (drop_abandoned_writes): nothing else
ever did, and a step being saved whole leaves one of some MB.
"""

from __future__ import annotations

import os
import re
import stat
import struct
import sys
import time
from pathlib import Path

from .atomic import locked

# A library that is not where inductor puts its own (so not under a lock of inductor's), younger than this, may still
# be being written by another process's linker (a warm helper's, at the lowest priority on a busy machine): it is left
# alone. Inductor's own go by their lock instead: one cut short by a run killed while it linked was left for this long,
# and every run meanwhile loaded it and died of SIGBUS.
SETTLED_SECONDS = 600
_PT_LOAD = 1
# The temporary files that a write killed midway leaves in the compile cache folder, which no one then uses or removes:
# training.atomic's (`.tinychar-<name>.<8 characters>.tmp`: a marker's, a warm helper's failure record) and torch's
# (`tmp<8 characters>`: a step being saved whole, by save_compiled_function). Their writers take a second at most (a
# saved step of some MB), so one unchanged for ABANDONED_SECONDS is abandoned, even in a folder shared by machines
# whose clocks disagree by minutes.
ABANDONED = re.compile(r"\.tinychar-.+\.[a-z0-9_]{8}\.tmp|tmp[a-z0-9_]{8}")
ABANDONED_SECONDS = 3600


def whole_elf(path: Path) -> bool:
    """Whether path holds an ELF file whose headers, sections and loaded segments all lie within it."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(64)
        if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
            return False
        wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
        if wide and len(head) < 64:
            return False
        phoff, shoff = struct.unpack_from(order + ("QQ" if wide else "II"), head, 32 if wide else 28)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 54 if wide else 42)
        if phoff + phnum * phentsize > size or shoff + shnum * shentsize > size or phentsize < (56 if wide else 32):
            return False
        f.seek(phoff)
        table = f.read(phnum * phentsize)
    for i in range(phnum):
        entry = table[i * phentsize:(i + 1) * phentsize]
        kind = struct.unpack_from(order + "I", entry, 0)[0]
        offset, filesz = (struct.unpack_from(order + "QQQQ", entry, 8)[::3] if wide
                          else struct.unpack_from(order + "IIII", entry, 4)[::3])
        if kind == _PT_LOAD and offset + filesz > size:
            return False
    return True


def tidy(folder: Path, now: float | None = None) -> int:
    """Remove what interrupted compiles and writes left in the compile cache folder, before a compile: libraries not
    whole (drop_damaged_libraries) and abandoned temporary files (drop_abandoned_writes); how many files it removed."""
    return drop_damaged_libraries(folder, now) + drop_abandoned_writes(folder, now)


def drop_abandoned_writes(folder: Path, now: float | None = None) -> int:
    """Remove the temporary files that writes killed midway left in folder itself (ABANDONED; inductor's, in the
    folders below, are its own), once unchanged for ABANDONED_SECONDS; how many it removed. Only this user's regular
    files are touched; one that cannot be removed, or that another process removes first, is passed over."""
    now = time.time() if now is None else now
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    removed = 0
    for name in names:
        if not ABANDONED.fullmatch(name):
            continue
        try:
            st = os.lstat(folder / name)
            mine = not hasattr(os, "getuid") or st.st_uid == os.getuid()
            if not stat.S_ISREG(st.st_mode) or not mine or now - st.st_mtime < ABANDONED_SECONDS:
                continue
            (folder / name).unlink()
        except OSError:
            continue
        removed += 1
    return removed


def drop_damaged_libraries(folder: Path, now: float | None = None) -> int:
    """Remove the libraries of compiled code in folder (and below) that are not whole and that no other process is
    building (_remove_unless_building), so that inductor builds them again; how many it removed. Nothing on a platform
    other than Linux, and nothing it cannot read or remove."""
    if not sys.platform.startswith("linux"):
        return 0
    now = time.time() if now is None else now
    removed = 0
    for root, _, names in os.walk(folder):
        for name in names:
            if not name.endswith(".so"):
                continue
            path = Path(root) / name
            try:
                if path.is_symlink() or whole_elf(path):
                    continue
                removed += _remove_unless_building(Path(folder), path, now)
            except OSError:
                continue
    return removed


def _remove_unless_building(folder: Path, path: Path, now: float) -> bool:
    """Remove the library at path, not whole, unless another process may be building it; whether it did. One of
    inductor's C++ cache (folder/<key[1:3]>/<key>.so or <key>.main.so) is removed while this process holds the lock
    inductor builds it under (folder/locks/<key>.lock), and kept while another does; any other, and one whose lock
    cannot be taken (a file where the locks' folder goes, no flock), only once older than SETTLED_SECONDS."""
    key = path.name.split(".", 1)[0]
    if path.parent.parent == folder and path.parent.name == key[1:3]:
        lock = folder / "locks" / f"{key}.lock"
        try:
            lock.parent.mkdir(exist_ok=True)
            with locked(lock) as free:
                if free is not None:  # None: no locks on this file system, so its age decides, as below
                    if not free or whole_elf(path):  # another process is building it now, or has built it
                        return False
                    path.unlink()
                    return True
        except OSError:
            pass
    if now - path.stat().st_mtime < SETTLED_SECONDS:
        return False
    path.unlink()
    return True
