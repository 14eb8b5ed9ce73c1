"""Where the values a config message is about came from: the command line (the override quoted as typed), the config
file, or a field's default. `python train.py model.n_layer=0` must not be told that the file, which holds 3, is
wrong."""

from __future__ import annotations

import re
import shlex
from typing import Any

from .userinput import shown

# Words that may be dotted config keys, and the quoted values to skip when looking for them: a refused value that
# reads 'seed' names no key.
_WORD = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")


class Overridden(dict):
    """A config mapping with command-line overrides set into it, remembering the override behind each dotted key it
    set (the last, where one key is set twice). load_config builds the file alone and then this; reading `given`,
    build blames a value refused only the second time on the override that set it."""

    def __init__(self, data: dict, given: dict[str, str]) -> None:
        super().__init__(data)
        self.given = given


def as_typed(override: str) -> str:
    """An override quoted as a shell would take it back, and bounded: model.n_layer=0, 'out_dir=my runs'."""
    return shown(shlex.quote(override))


def keys_in(message: str, keys: set[str]) -> list[str]:
    """The config keys a message names, in order of first mention, leaving out the values it quotes."""
    found: list[str] = []
    for word in _WORD.findall(_QUOTED.sub(" ", message)):
        if word in keys and word not in found:
            found.append(word)
    return found


def _in_mapping(mapping: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(mapping, dict) or part not in mapping:
            return False
        mapping = mapping[part]
    return True


def source(message: str, mapping: Any, keys: set[str], where: str) -> str:
    """How a message about mapping's values ends: `where` (' (in configs/tiny.yaml)', or '') unless a key the message
    names was set on the command line; then ' (command line: OVERRIDES; KEY in FILE; default KEY)', so a check of
    two keys that came from two places names both."""
    given: dict[str, str] = getattr(mapping, "given", {})
    named = keys_in(message, keys)
    typed = [as_typed(given[key]) for key in named if key in given]
    if not typed:
        return where
    in_file = where.strip().removeprefix("(").removesuffix(")") or "as configured"
    parts = [" ".join(typed)]
    for key in (k for k in named if k not in given):
        parts.append(f"{key} {in_file}" if _in_mapping(mapping, key) else f"default {key}")
    return f" (command line: {'; '.join(parts)})"
