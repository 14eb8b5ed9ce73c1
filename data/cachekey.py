"""The key that names an encoded corpus (its files, their sizes and times, the settings, their content) and the
folders where encoded corpora are cached.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from configs.userinput import temp_root, temp_root_problem

from .paths import DataError, check_unchanged, expand_home, open_regular, quoted
from .sources import FORMAT_VERSION, Inputs, Source

CONTENT_HASH_BELOW = 64 << 20  # inputs smaller than this in total are hashed, catching edits that keep size and mtime
_HASH_CHUNK = 1 << 20
# Larger inputs are keyed by SAMPLES blocks of SAMPLE_BYTES spread evenly across them, the first and last bytes
# included: 4 MB read at most, whatever the size (measured on a 200 MB file: see cache_key).
SAMPLES = 64
SAMPLE_BYTES = 64 << 10


def cache_key(inputs: Inputs, settings: dict) -> str:
    """A hex digest naming the encoded corpus: inputs' paths, sizes and mtimes, the settings, and their content, so
    that an edit that keeps size and mtime (as some tools and copies do) still changes the key.

    Inputs under CONTENT_HASH_BELOW are hashed whole. Larger ones are hashed by SAMPLES blocks spread evenly over
    them (4 MB at most), which sees such an edit only where it touches a block. On a 200 MB file (2-core machine):
    the blocks take 5-6 ms from the page cache and 13-18 ms from disk, a whole hash 0.25-0.5 s at every start.

    The files' status-change times (ctime), which no tool sets back, are not in the key, though they would see every
    edit: a copy of the same file on each machine of a cluster (`rsync -t` to local disks) has its own, so machines
    sharing one cache folder would each encode the corpus again and, finding the others' entry for the same path
    and settings, remove it (prune), at every run. Tried and taken back on 2026-12-05.
    """
    files = [[str(s.path.resolve()), s.size, s.mtime_ns] for s in inputs.sources]
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps({"format": FORMAT_VERSION, "settings": settings, "files": files}).encode())
    if inputs.n_bytes < CONTENT_HASH_BELOW:
        for s in inputs.sources:
            with open_regular(s.path, inputs.label) as f:
                left = s.size  # no further than its listed size: a file extended meanwhile is not read to its end
                while left > 0 and (chunk := f.read(min(_HASH_CHUNK, left))):
                    digest.update(chunk)
                    left -= len(chunk)
                check_unchanged(f, s, inputs.label, ctime=False)
    else:
        for source, offsets in _samples(inputs.sources, SAMPLES, SAMPLE_BYTES):
            with open_regular(source.path, inputs.label) as f:
                for offset in offsets:
                    f.seek(offset)
                    digest.update(f.read(min(SAMPLE_BYTES, source.size - offset)))
                check_unchanged(f, source, inputs.label, ctime=False)
    return digest.hexdigest()


def _samples(sources: list[Source], n: int, size: int) -> list[tuple[Source, list[int]]]:
    """Where n blocks of size bytes, spread evenly over the files joined (the first at 0, the last at the end),
    start: each file that holds one, with the offsets in it, in order."""
    total = sum(s.size for s in sources)
    starts = sorted({i * max(total - size, 0) // max(n - 1, 1) for i in range(n)})
    found: list[tuple[Source, list[int]]] = []
    base, i = 0, 0
    for s in sources:
        offsets = []
        while i < len(starts) and starts[i] < base + s.size:
            offsets.append(starts[i] - base)
            i += 1
        if offsets:
            found.append((s, offsets))
        base += s.size
    return found


def cache_dirs(configured: str | None) -> tuple[list[Path], str]:
    """(folders, setting): the folders to look for and write encoded corpora in, in order, and the setting that
    chose them, which a message about them names (data.cache_dir, or TINYCHAR_CACHE_DIR when that chose).

    data.cache_dir, else $TINYCHAR_CACHE_DIR (an absolute path, or DataError), is the only folder. Otherwise the
    per-user cache ($XDG_CACHE_HOME/tinychar/encoded where it is an absolute path, else ~/.cache/tinychar/encoded),
    then the temp folder's, where it is this user's alone (configs.userinput.temp_root_problem), should that one be
    read-only or missing; data.cache_dir is what a person sets to choose another. Never a folder of the project or of
    the corpus. A '~user' that names no known user is DataError, naming the setting that holds it.
    """
    if configured:
        return [expand_home(configured, "data.cache_dir")], "data.cache_dir"
    if chosen := os.environ.get("TINYCHAR_CACHE_DIR"):
        folder = expand_home(chosen, "TINYCHAR_CACHE_DIR")
        if not folder.is_absolute():  # a setting of the environment: the same folder from any working folder
            raise DataError(f"TINYCHAR_CACHE_DIR: {quoted(chosen)} is a relative path, which would put a cache in "
                            "each folder a run starts from (a repository, a corpus); give an absolute path")
        return [folder], "TINYCHAR_CACHE_DIR"
    # The temp folder's, only where it is this user's alone: another user could have made it first (its name is known
    # to all) and put there ids that a run would read as its text.
    problem = temp_root_problem()
    temp = [] if problem else [temp_root() / "encoded"]
    try:
        home = Path.home()
    except (RuntimeError, KeyError):  # no $HOME and no entry in the user database, as in some containers
        if problem:
            raise DataError(f"no folder for the encoded corpus: no home folder, and {problem}; remove it, or set "
                            "data.cache_dir or TINYCHAR_CACHE_DIR to a folder of your own") from None
        return temp, "data.cache_dir"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = expand_home(xdg, "XDG_CACHE_HOME") if xdg else None
    if base is None or not base.is_absolute():  # relative: another folder from each working folder, so the XDG
        base = home / ".cache"  # base directory specification has it ignored
    return [base / "tinychar" / "encoded", *temp], "data.cache_dir"
