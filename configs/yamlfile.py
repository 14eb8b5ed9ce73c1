"""Reading a YAML config file: a regular file of a page of UTF-8 text, plain data only (``yaml.safe_load``), no key
given twice, and no unquoted number that YAML reads other than it looks. Each refusal is one line naming the file."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from .errors import CHECK_LIMIT, ConfigError
from .userinput import path_kind, read_user_file, shown
from .yamlkeys import first_duplicate

# A config file is a page of settings: the shipped ones are under 2 KB. PyYAML's pure-Python parser reads about
# 100 KB a second and load_yaml parses twice (once for duplicate keys), so 64 KiB, thirty times the largest real
# config, still reads in about a second; /dev/zero or a log given by mistake is refused at once.
MAX_CONFIG_BYTES = 64 * 1024


class WrittenFloat(float):
    """A float YAML read, with its text as written: a count given as 1.0000000000000000001 is not 1, though the
    float is, and 1.0e-400 is not 0 (see load_yaml's exact)."""

    written: str

    def __new__(cls, value: float, written: str) -> WrittenFloat:
        number = super().__new__(cls, value)
        number.written = written
        return number

    def __repr__(self) -> str:  # messages quote the number as the file has it
        return self.written

    __str__ = __repr__


def load_yaml(path: str | Path, as_written: frozenset[str] = frozenset(),
              exact: frozenset[str] = frozenset()) -> dict:
    """A YAML config file as a mapping (empty file -> {}). Only plain data: safe_load, no Python tags. A regular
    file of at most MAX_CONFIG_BYTES, and a key given twice in one mapping is refused, not silently dropped.

    as_written: dotted keys whose values are text (text_keys), which keep an unquoted number or bool as it is written:
    YAML reads `out_dir: 001` as the number 1 and `0123` as 83 (octal), and their text as a folder name was another
    folder's; `off` is false.

    exact: dotted keys whose values are counts (int_keys) or reals (float_keys): an unquoted float there is a
    WrittenFloat, so that a count is read from its digits, as the same words on the command line are (a float keeps
    about 17), and a real too small for a float (1.0e-400, read as 0.0) is told from 0."""
    name = shown(str(path))
    kind = path_kind(path)
    if kind is not None:
        raise ConfigError(f"config file: '{name}' is {kind}, not a file; give the path of a regular file")
    raw = read_user_file(path, "config file", MAX_CONFIG_BYTES, error=ConfigError)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"cannot read config file '{name}': it is not UTF-8 text (byte {e.start:,} is "
                          f"{raw[e.start]:#04x}); save it as UTF-8") from None
    root = _parsed(lambda: yaml.compose(text, Loader=yaml.SafeLoader), name)
    duplicate = _parsed(lambda: first_duplicate(root), name)  # a long chain of '<<' merges recurses
    if duplicate is not None:
        first, second = duplicate.first_line, duplicate.second_line
        lines = f"lines {first} and {second}" if first != second else f"both on line {first}"
        why = ("merges ('<<') bring it in twice, and which one YAML keeps differs between versions of PyYAML"
               if duplicate.merged else "YAML would silently use only the last")
        raise ConfigError(f"config file '{name}' sets '{shown(duplicate.key)}' twice ({lines}); keep one, since "
                          f"{why}")
    misread = _first_misread_number(root, as_written)
    if misread is not None:
        key, node, value = misread
        how = "an octal number" if ":" not in node.value else "a base-60 number"
        raise ConfigError(f"config file '{name}' sets '{shown(key)}' to {shown(node.value)} (line "
                          f"{node.start_mark.line + 1}), which YAML reads as {how}, {shown(str(value))}; write the "
                          f"number you mean in decimal, without a leading 0 or a ':'")
    data = _parsed(lambda: yaml.safe_load(text), name)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{name}' must hold a mapping of sections (data:, model:, train:), "
                          f"got {type(data).__name__}")
    for keys, written in _numbers_as_written(root, as_written, _TEXT_READ_AS_OTHER):
        _replace(data, keys, lambda _, text: text, written)
    for keys, written in _numbers_as_written(root, exact - as_written):
        _replace(data, keys, lambda value, text: WrittenFloat(value, text) if type(value) is float else value, written)
    return data


def _replace(data: dict, keys: list[str], make: Callable[[Any, str], Any], written: str) -> None:
    """data's value at the key path keys, where it leads to one, replaced by make(value, written)."""
    section: Any = data
    for key in keys[:-1]:
        section = section.get(key) if isinstance(section, dict) else None
    if isinstance(section, dict) and keys[-1] in section:
        section[keys[-1]] = make(section[keys[-1]], written)


_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
# What YAML 1.1 reads an unquoted word of a text key as, other than text: a number, or a bool (yes, no, on, off, true,
# false). `out_dir: off` was refused as "must be a string or null, got False", where out_dir=off on the command line
# is the folder 'off'.
_TEXT_READ_AS_OTHER = (*_NUMBER_TAGS, "tag:yaml.org,2002:bool")


def _numbers_as_written(node: Any, wanted: frozenset[str], tags: tuple[str, ...] = _NUMBER_TAGS,
                        prefix: str = "") -> Iterator[tuple[list[str], str]]:
    """(key path, text as written) of each unquoted scalar of one of tags (numbers by default) in the composed YAML
    node whose dotted key is wanted."""
    if not wanted or not isinstance(node, yaml.MappingNode):
        return
    for key_node, value in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            continue
        dotted = prefix + key_node.value
        # Only towards a wanted key: a mapping that holds itself (`data: &d {x: *d}`) recursed without end
        if isinstance(value, yaml.MappingNode) and any(w.startswith(dotted + ".") for w in wanted):
            for keys, written in _numbers_as_written(value, wanted, tags, dotted + "."):
                yield [key_node.value, *keys], written
        elif isinstance(value, yaml.ScalarNode) and dotted in wanted and value.tag in tags and value.style is None:
            yield [key_node.value], value.value


_OCTAL = re.compile(r"[-+]?0[0-7_]+")


def _first_misread_number(root: Any, as_written: frozenset[str]) -> tuple[str, yaml.ScalarNode, int | float] | None:
    """(dotted key, node, value) of the first unquoted number of a config's keys and sections that YAML 1.1 reads as
    other than it looks: octal (`batch_size: 010` is 8, where train.batch_size=010 on the command line is 10) or base
    60 (`1:30` is 90). Hexadecimal (0x10) says what it is. Keys in as_written keep their text (load_yaml)."""
    if not isinstance(root, yaml.MappingNode):
        return None
    seen: set[int] = set()  # a mapping aliased many times is looked at once
    entries = [(k, v, "") for k, v in root.value]
    while entries:
        key, value, prefix = entries.pop(0)
        if not isinstance(key, yaml.ScalarNode):
            continue
        dotted = prefix + key.value
        if isinstance(value, yaml.MappingNode) and not prefix and id(value) not in seen:
            seen.add(id(value))
            entries.extend((k, v, dotted + ".") for k, v in value.value)
        elif (isinstance(value, yaml.ScalarNode) and value.tag in _NUMBER_TAGS and value.style is None
              and dotted not in as_written):
            digits = value.value.replace("_", "")
            if ":" in digits or (_OCTAL.fullmatch(value.value) and int(digits, 8) != int(digits, 10)):
                return dotted, value, yaml.safe_load(value.value)
    return None


def _parsed(parse: Callable[[], Any], name: str) -> Any:
    """parse() of a config file's text, its failures as one-line ConfigErrors naming the file."""
    try:
        return parse()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or (str(e).splitlines() or [type(e).__name__])[0]
        # shown(): a problem may quote the file, such as an undefined alias's name
        raise ConfigError(f"config file '{name}' is not valid YAML{at}: {shown(problem, CHECK_LIMIT)}") from None
    except (ValueError, OverflowError) as e:
        # safe_load builds dates as it reads them: 'seed: 2024-13-01' is a date with month 13, which Python refuses
        detail = shown((str(e).splitlines() or [type(e).__name__])[0], CHECK_LIMIT)
        if "int_max_str_digits" in str(e):  # Python's advice (sys.set_int_max_str_digits) is no fix for a config
            detail = ("an integer too long for Python to read (over 4,300 digits by default), far past what any "
                      "setting takes; give a smaller number")
        raise ConfigError(f"config file '{name}' holds a value YAML cannot build: {detail}") from None
    except RecursionError:
        raise ConfigError(f"config file '{name}' is nested too deeply to read") from None
