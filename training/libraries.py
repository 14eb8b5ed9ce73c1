"""Damaged libraries of compiled code in the compile cache, found before torch.compile loads them.

Inductor links each piece of compiled C++ straight to its place in the cache (`<hash>.so`, the C++ wrapper's
`<hash>.main.so`) and loads it with dlopen from there the next time. A link cut short (the process killed while the
linker wrote, a full disk) leaves a file that is not whole: dlopen of one cut anywhere past its first pages maps what
is no longer there, and the process died of SIGBUS (exit 135, no line) on every later compile; an empty or garbled one
failed to load, and every later run trained eagerly, saying it could not compile. A library that is not there is
simply built again (measured: the sampler's loop from a warm cache in 3.7 s, the same characters), so a damaged one is
removed before compiling. Linux only: the check reads ELF, the format Linux's libraries are in.
"""

from __future__ import annotations

import os
import struct
import sys
import time
from pathlib import Path

# A library younger than this may still be being written by another process's linker (a warm helper's, at the lowest
# priority on a busy machine): it is left alone.
SETTLED_SECONDS = 600
_PT_LOAD = 1


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


def drop_damaged_libraries(folder: Path, now: float | None = None) -> int:
    """Remove the libraries of compiled code in folder (and below) that are not whole and are older than
    SETTLED_SECONDS, so that inductor builds them again; how many it removed. Nothing on a platform other than Linux,
    and nothing it cannot read or remove."""
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
                if path.is_symlink() or now - path.stat().st_mtime < SETTLED_SECONDS or whole_elf(path):
                    continue
                path.unlink()
            except OSError:
                continue
            removed += 1
    return removed
