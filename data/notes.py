"""What a prepared corpus says about its inputs as a run starts: characters replaced, byte-order marks and NUL bytes
met, what a folder or glob held that was left out (binary, hidden, no file, tinychar's own), and where the encoded
corpus went when the cache folder refused it. Each is one line of the run's log."""

from __future__ import annotations

from pathlib import Path

from .paths import LOG_PATH, quoted
from .sources import SNIFF_BYTES, Inputs
from .stream import UNKNOWN


def first_few(paths: list[Path]) -> str:
    """The first three of paths as a note names them, and ' ...' after them if there are more."""
    return ", ".join(quoted(p, LOG_PATH // 3) for p in paths[:3]) + (" ..." if len(paths) > 3 else "")


def input_notes(inputs: Inputs, info: dict, moved: list[str], ids_path: Path) -> tuple[str, ...]:
    """The lines a run logs as it starts about its text (info: the cache entry's meta): characters replaced,
    byte-order marks and NUL bytes met, what a folder or glob held that was left out, and a cache folder that refused
    the entry (moved; ids_path: where it went instead)."""
    notes = []
    if info["replaced_chars"]:
        share = 100 * info["replaced_occurrences"] / max(info["n_tokens"], 1)
        why = f"data.max_vocab={info['settings']['max_vocab']}" if info["settings"]["vocab"] is None else "vocabulary"
        notes.append(
            f"{why}: {info['replaced_chars']:,} rare character(s), {info['replaced_occurrences']:,} occurrences "
            f"({share:.3g}% of the text), map to the unknown symbol U+FFFD {UNKNOWN!r}"
        )
    if info["boms"]:
        notes.append(
            f"{inputs.label}: left out the byte-order mark (U+FEFF) that starts {info['boms']:,} file(s): it says how "
            "a file was saved, it is not text"
        )
    if info["nul_files"]:
        path, at = info["nuls"][0]
        more = f" (and {info['nul_files'] - 1:,} more file(s))" if info["nul_files"] > 1 else ""
        notes.append(
            f"{inputs.label}: {quoted(path, LOG_PATH // 3)} holds a NUL byte at byte {at:,}{more}, past the first "
            f"{SNIFF_BYTES:,} bytes that tell a binary file (left out); it is kept as a character (U+0000): if the "
            "file is not text, remove it or leave it out of data.path"
        )
    if inputs.skipped:
        notes.append(f"{inputs.label}: left out {len(inputs.skipped)} binary file(s): {first_few(inputs.skipped)}")
    if inputs.others:
        notes.append(f"{inputs.label}: left out {len(inputs.others)} entries that are no file to read (a named pipe, "
                     f"a socket, a device or a link that leads nowhere): {first_few(inputs.others)}")
    if inputs.hidden:
        notes.append(f"{inputs.label}: left out {len(inputs.hidden)} hidden file(s) and folder(s), whose names start "
                     f"with '.': {first_few(inputs.hidden)}")
    if inputs.runs:
        notes.append(
            f"{inputs.label}: left out what {len(inputs.runs)} tinychar run(s) wrote there (a run's folder, or its "
            f"config.yaml, is not training text): {first_few(inputs.runs)}"
        )
    if inputs.caches:
        notes.append(
            f"{inputs.label}: left out the files of tinychar's cache of encoded corpora (ids and meta files, not "
            f"training text) in {len(inputs.caches)} folder(s): {first_few(inputs.caches)}"
        )
    if moved:
        notes.append(
            f"data: cannot write to the cache folder {moved[0]}, so the encoded corpus went to "
            f"{quoted(ids_path.parent, LOG_PATH)}; set data.cache_dir to choose the folder"
        )
    return tuple(notes)
