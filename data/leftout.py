"""What a folder or glob holds that is not the corpus: tinychar's run folders and cache folders, and the files left
out while a corpus's files are listed (data/sources.py).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .paths import quoted

# A folder holding config.yaml beside any of these is a tinychar run's out_dir: training.outdir writes config.yaml and
# .lock when a run claims the folder, the checkpoints when it saves. Each alone is too common a name to go by.
RUN_CONFIG = "config.yaml"
RUN_MARKS = frozenset({".lock", "ckpt.pt", "best.pt"})
# The files of an encoded-corpus cache entry (data/cache.py): '<stem>-<key>.ids' and '<stem>-<key>.json', the key 32
# hex digits (cache_key) and the stem made of these characters (prepare._stem). A folder holding such a pair is a
# cache folder even when no setting names it any more (a run with another data.cache_dir put it there).
CACHE_ENTRY = re.compile(r"[A-Za-z0-9._-]+-[0-9a-f]{32}\.(?:ids|json)")


@dataclass
class LeftOut:
    """What a folder or glob holds that is not the corpus, gathered while its files are listed."""

    label: str
    cache_ids: frozenset[tuple[int, int]]  # (device, inode) of the cache folders that exist
    run_ids: frozenset[tuple[int, int]] = frozenset()  # of the run folders named (resolve_inputs's runs) that exist
    skipped: list[Path] = field(default_factory=list)  # binary files
    others: list[Path] = field(default_factory=list)  # pipes, sockets, devices, broken links: never opened
    hidden: list[Path] = field(default_factory=list)  # files and folders whose names start with '.'
    runs: list[Path] = field(default_factory=list)  # run folders, or the named folder's run config.yaml
    caches: list[Path] = field(default_factory=list)  # cache folders
    known: dict[Path, str | None] = field(default_factory=dict)  # owner's answers: many matches share a folder
    listed: dict[Path, list[str]] = field(default_factory=dict)  # a glob's fixed part's names (_owned_in_base)

    def add(self, owner: str, folder: Path) -> None:
        found = self.runs if owner == "run" else self.caches
        if folder not in found:  # a glob reaches a folder both as a match and inside a matched folder
            found.append(folder)

    def said(self) -> str:
        """' (tinychar run folders left out: ...)', and the like for cache folders and hidden files, naming the first
        few of each; '' when nothing was left out for being tinychar's or hidden."""
        runs = [r.parent if r.name == RUN_CONFIG else r for r in self.runs]
        parts = [
            f"{what} left out: {', '.join(map(quoted, folders[:2]))}{' ...' if len(folders) > 2 else ''}"
            for what, folders in (("tinychar run folders", runs), ("tinychar cache folders", self.caches),
                                  ("hidden files and folders (names that start with '.')", self.hidden))
            if folders
        ]
        return f" ({'; '.join(parts)})" if parts else ""


def is_run(names: Iterable[str], folder: Path | None = None,
           run_ids: frozenset[tuple[int, int]] = frozenset()) -> bool:
    """Whether a folder holding these names is a tinychar run's out_dir (config.yaml beside .lock or a checkpoint), or
    folder is one of run_ids, marked or not."""
    names = set(names)
    if RUN_CONFIG in names and not RUN_MARKS.isdisjoint(names):
        return True
    return bool(run_ids) and folder is not None and identity(folder) in run_ids


def is_cache(folder: Path, names: Iterable[str], cache_ids: frozenset[tuple[int, int]]) -> bool:
    """Whether folder, holding these names, is one that encoded corpora are cached in: a folder the settings name
    (cache_ids), or one holding an entry, an ids file beside its meta, that a run with other settings left there."""
    if any(n.endswith(".json") for n in entry_files(names)):
        return True
    return bool(cache_ids) and identity(folder) in cache_ids


def entry_files(names: Iterable[str]) -> set[str]:
    """The names of cache entries' files among names: each meta beside its ids file, and each ids file (one alone is
    what an encoder killed before it wrote the meta leaves). A meta alone may be a person's JSON of a like name."""
    names = set(names)
    ids = {n for n in names if n.endswith(".ids") and CACHE_ENTRY.fullmatch(n)}
    return ids | {f"{n[:-4]}.json" for n in ids if f"{n[:-4]}.json" in names}


def identities(folders: Iterable[Path]) -> frozenset[tuple[int, int]]:
    """The identities (identity) of those of folders that exist."""
    return frozenset(filter(None, map(identity, folders)))


def identity(folder: Path) -> tuple[int, int] | None:
    """(device, inode) of folder, which names it however it is reached (links, '..'); None if it is not there."""
    try:
        st = os.stat(folder)
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def owner_of(folder: Path, out: LeftOut) -> str | None:
    """'run' if folder is a tinychar run's out_dir, 'cache' if it holds encoded corpora, else None."""
    if folder not in out.known:
        try:
            names = os.listdir(folder)
        except OSError:  # a folder that cannot be listed is nothing of ours to leave out; reading the file says more
            out.known[folder] = None
        else:
            run = is_run(names, folder, out.run_ids)
            owner = "run" if run else "cache" if is_cache(folder, names, out.cache_ids) else None
            out.known[folder] = owner
    return out.known[folder]
