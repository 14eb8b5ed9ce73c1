"""Reading run configs: YAML files (``yaml.safe_load`` only) and dotted ``KEY=VALUE`` overrides into
frozen dataclasses, with one-line errors that name the nearest valid key.

The dataclasses themselves (``GPTConfig``, ``DataConfig``, ``TrainConfig``, ``RunConfig``) live with the code
that uses them; this module only knows how to fill them from plain data and to describe them.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import re
import types
import typing
from typing import Any

from .errors import CHECK_LIMIT, ConfigError
from .names import nearest as nearest
from .names import option_as_setting as option_as_setting
from .origins import Overridden, as_typed, source
from .userinput import path_kind, shown
from .values import CONVERTERS, NEAR_ZERO, NearZero, NotOfType
from .yamlfile import MAX_CONFIG_BYTES as MAX_CONFIG_BYTES
from .yamlfile import load_yaml as load_yaml


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The field types of a config class, resolved once a process: a run's config took 120 calls of
    typing.get_type_hints, half of loading it (13.3 -> 6.7 ms, 2-core Zen 2 EPYC, 2026-12-06). Read, never changed."""
    return typing.get_type_hints(cls)


def _user_fields(cls: type) -> list[dataclasses.Field]:
    """Fields a user may set (``derived`` ones, such as vocab_size, come from the data)."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("derived")]


def valid_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a config class, sections expanded: ['seed', 'train.batch_size', ...]."""
    hints = _hints(cls)
    keys = []
    for f in _user_fields(cls):
        if _is_section(hints[f.name]):
            keys += valid_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def path_keys(cls: type, prefix: str = "") -> frozenset[str]:
    """The dotted keys whose values name files or folders (their fields' metadata says ``path``)."""
    hints = _hints(cls)
    keys: set[str] = set()
    for f in _user_fields(cls):
        if _is_section(hints[f.name]):
            keys |= path_keys(hints[f.name], f"{prefix}{f.name}.")
        elif f.metadata.get("path"):
            keys.add(prefix + f.name)
    return frozenset(keys)


def _section_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted section name of a config class: ['data', 'model', 'train']."""
    hints = _hints(cls)
    keys = []
    for f in _user_fields(cls):
        if _is_section(hints[f.name]):
            keys += [prefix + f.name, *_section_keys(hints[f.name], f"{prefix}{f.name}.")]
    return keys


def _unknown(key: str, cls: type, where: str, section: bool = False) -> ConfigError:
    # A misspelt section ('trian:' holding a mapping) is compared with the section names as well, which the
    # dotted keys alone never come close to.
    guess = nearest(key, valid_keys(cls) + (_section_keys(cls) if section else []))
    hint = f"; did you mean '{guess}'?" if guess else "; see `python train.py --help` for the valid keys"
    if key in valid_keys(cls):  # 'train.batch_size: 4' at a file's top level: it was "did you mean" itself
        section_name, _, name = key.rpartition(".")
        hint = (f"; in a file, nest it: '{name}:' indented under '{section_name}:' (dotted keys are for the command "
                f"line)")
    return ConfigError(f"unknown config key '{shown(key)}'{where}{hint}")


def _type_name(tp: Any) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args:
        return " or ".join(_type_name(a) for a in args) + (" or null" if type(None) in typing.get_args(tp) else "")
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _wrong_type(key: str, tp: Any, value: Any) -> ConfigError:
    # shown(): the value may be a few hundred bytes of YAML aliases that expand to billions of items
    got = f"'{shown(value)}'" if isinstance(value, str) else shown(value)
    # YAML reads an unquoted 2024-01-01 as a date: a text setting written so is told to quote it
    hint = ("; YAML reads an unquoted date as one: put it in quotes" if isinstance(value, datetime.date)
            and str in typing.get_args(tp) + (tp,) else "")
    return ConfigError(f"{key} must be {_type_name(tp)}, got {got}{hint}")


def coerce(value: Any, tp: Any, key: str, from_text: bool = False) -> Any:
    """Check value against a field's type; text from the command line is parsed by that type."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return _coerce_union(value, tp, key, from_text)
    convert = CONVERTERS.get(tp)
    if convert is None:
        raise ConfigError(f"{key}: unsupported field type {shown(tp)}")
    try:
        return convert(value, from_text)
    except NearZero as e:  # a number, but not one a float holds
        raise ConfigError(f"{key}: {shown(e.written)} {NEAR_ZERO}") from None
    except NotOfType:
        raise _wrong_type(key, tp, value) from None


def _coerce_union(value: Any, tp: Any, key: str, from_text: bool) -> Any:
    options = typing.get_args(tp)
    # On the command line null is spelt null or none; not ~, YAML's third spelling, which the shell leaves alone in
    # out_dir=~ and which the README promises is the home folder there (it was the default out_dir, runs/tiny)
    is_null = value is None or (from_text and str(value).lower() in ("null", "none"))
    if is_null and type(None) in options:
        return None
    for option in options:
        if option is type(None):
            continue
        try:
            return coerce(value, option, key, from_text)
        except ConfigError:
            continue
    raise _wrong_type(key, tp, value)


@dataclasses.dataclass(frozen=True)
class _Origin:
    """What build needs to say where a refused value came from: the root class, the whole mapping (an Overridden
    one knows its command-line keys) and `where`, the file's part of a message."""

    root: type
    mapping: Any
    where: str

    def refuse(self, message: str) -> ConfigError:
        return ConfigError(message + source(message, self.mapping, set(valid_keys(self.root)), self.where))


def build(cls: type, mapping: Any, where: str = "", prefix: str = "", root: type | None = None) -> Any:
    """Make a cls instance from a plain mapping; unknown keys and wrong types raise ConfigError. A message ends with
    where its values came from: `where` (such as ' (in run.yaml)'), or the command line for an Overridden mapping's
    overrides (see configs.origins)."""
    return _build(cls, mapping, prefix, _Origin(root or cls, mapping, _bounded_where(where)))


def refusal(cls: type, mapping: Any, message: str, where: str = "") -> ConfigError:
    """A check of a cls instance built from mapping (build), made outside the config classes, as build says theirs:
    message ends with where the values it names came from."""
    return _Origin(cls, mapping, _bounded_where(where)).refuse(message)


def check_keys(cls: type, mapping: Any, where: str = "") -> None:
    """What build checks key by key (unknown keys, wrong types), without the config classes' own checks, which may
    need values that overrides bring: a file is checked so before its overrides are applied, and its per-key
    mistakes are blamed on it."""
    _build(cls, mapping, "", _Origin(cls, mapping, _bounded_where(where)), construct=False)


def _bounded_where(where: str) -> str:
    """where, such as ' (in run.yaml)', with what it quotes escaped and bounded: load_config puts the config's path
    there, and a path may hold a newline or run to thousands of characters."""
    if where.startswith(" (in ") and where.endswith(")"):
        return f" (in {shown(where[5:-1])})"  # the path cut as every message cuts one (shown), its file name kept
    if where.startswith(" (") and where.endswith(")"):
        return f" ({shown(where[2:-1])})"
    return shown(where)


def _build(cls: type, mapping: Any, prefix: str, origin: _Origin, construct: bool = True) -> Any:
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, dict):
        what = f"section '{prefix[:-1]}'" if prefix else "a config"
        raise ConfigError(f"{what}{origin.where} must be a mapping of keys to values, got {type(mapping).__name__}")
    hints = _hints(cls)
    fields = {f.name: f for f in _user_fields(cls)}
    kwargs = {}
    for key, value in mapping.items():
        name = str(key)
        if name not in fields:
            raise _unknown(prefix + name, origin.root, origin.where, section=isinstance(value, dict))
        if _is_section(hints[name]):
            kwargs[name] = _build(hints[name], value, f"{prefix}{name}.", origin, construct)
            continue
        try:
            kwargs[name] = coerce(value, hints[name], prefix + name)
        except ConfigError as e:
            raise origin.refuse(str(e)) from None
    if not construct:
        return kwargs
    try:
        return cls(**kwargs)
    except ValueError as e:
        # The config classes' own checks quote values with repr; shown() bounds what a huge value would make, once
        # each long quoted value is cut short itself (cut as a whole, the message lost what it asks for: the list
        # of the values that would do)
        raise origin.refuse(shown(_quoted_values_cut(str(e)), limit=CHECK_LIMIT)) from None


# A quoted value in a check's message longer than this is cut in its middle
QUOTED_VALUE_LIMIT = 40


def _quoted_values_cut(message: str) -> str:
    """message with every quoted value ('...' as repr writes it) of more than QUOTED_VALUE_LIMIT characters cut in
    its middle."""
    def cut(match: re.Match[str]) -> str:
        quote, inner = match.group(1), match.group(2)
        half = QUOTED_VALUE_LIMIT // 2
        return f"{quote}{inner[:half]}...{inner[-half:]}{quote}"

    # '...' as repr writes most values, "..." one that holds an apostrophe
    return re.sub(rf"""(['"])((?:(?!\1)[^\n]){{{QUOTED_VALUE_LIMIT + 1},}})\1""", cut, message)


def text_keys(cls: type) -> frozenset[str]:
    """The dotted keys of cls whose values are text (str, or str or None): paths and names."""
    return _keys_of(cls, str)


def int_keys(cls: type) -> frozenset[str]:
    """The dotted keys of cls whose values are counts (int, or int or None)."""
    return _keys_of(cls, int)


def float_keys(cls: type) -> frozenset[str]:
    """The dotted keys of cls whose values are real numbers (float, or float or None)."""
    return _keys_of(cls, float)


def _keys_of(cls: type, kind: type) -> frozenset[str]:
    """The dotted keys of cls whose type is kind, or kind or None."""
    def is_kind(tp: Any) -> bool:
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            return set(typing.get_args(tp)) == {kind, type(None)}
        return tp is kind
    return frozenset(key for key, tp in _flat_hints(cls).items() if is_kind(tp))


def apply_overrides(mapping: dict, overrides: list[str], cls: type) -> dict:
    """Set dotted KEY=VALUE strings into a copy of mapping; each key must exist in cls. The copy is an Overridden
    mapping, which remembers each key's override so that build can blame a bad value on it."""
    result = {k: (dict(v) if isinstance(v, dict) else v) for k, v in mapping.items()}
    given = dict(getattr(mapping, "given", {}))
    keys = valid_keys(cls)
    hints = _flat_hints(cls)
    paths = path_keys(cls)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{shown(item)}' must look like KEY=VALUE, e.g. train.max_iters=500")
        key, _, text = item.partition("=")
        key = key.strip()
        if not key:
            raise ConfigError(f"override '{shown(item)}' must look like KEY=VALUE, e.g. train.max_iters=500")
        if key in _section_keys(cls):  # 'train=1': a whole section, which takes its keys one by one
            first = next((k for k in keys if k.startswith(key + ".")), key + ".KEY")
            raise ConfigError(f"'{shown(key)}' is a section of the config, not a key; give {shown(key)}.KEY=VALUE "
                              f"(such as {first}=...; `python train.py --help` lists them)")
        if key not in keys:
            raise _unknown(key, cls, " (command line)")
        try:
            value = coerce(text, hints[key], key, from_text=True)
        except ConfigError as e:
            raise ConfigError(f"{e} (command line: {as_typed(item)})") from None
        if value is None and key in paths and os.path.lexists(text):
            # KEY=none unsets a path; a file or folder of that very name here is what was more likely meant
            raise ConfigError(f"{as_typed(item)} unsets {key} (none and null mean no value on the command line), "
                              f"but '{shown(text)}' is also {path_kind(text) or 'a file'} here: write "
                              f"{key}=./{shown(text)} for it, or leave {key} out for no value")
        *sections, name = key.split(".")
        target = result
        for section in sections:
            if not isinstance(target.get(section), dict):
                target[section] = {}
            target = target[section]
        target[name] = value
        given[key] = item
    return Overridden(result, given)


def _flat_hints(cls: type, prefix: str = "") -> dict[str, Any]:
    hints = _hints(cls)
    flat = {}
    for f in _user_fields(cls):
        if _is_section(hints[f.name]):
            flat.update(_flat_hints(hints[f.name], f"{prefix}{f.name}."))
        else:
            flat[prefix + f.name] = hints[f.name]
    return flat


def describe(cls: type, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, default, one-line meaning) for every key, for --help."""
    hints = _hints(cls)
    rows = []
    for f in _user_fields(cls):
        if _is_section(hints[f.name]):
            rows += describe(hints[f.name], f"{prefix}{f.name}.")
        else:
            default = f.default if f.default is not dataclasses.MISSING else None
            rows.append((prefix + f.name, default, f.metadata.get("help", "")))
    return rows


def to_dict(config: Any) -> dict:
    """A config instance as plain nested data (what config.yaml and checkpoints store)."""
    hints = _hints(type(config))
    out = {}
    for f in _user_fields(type(config)):
        value = getattr(config, f.name)
        out[f.name] = to_dict(value) if _is_section(hints[f.name]) else value
    return out


def flatten(mapping: dict, prefix: str = "") -> dict[str, Any]:
    """{'train': {'lr': 1}} -> {'train.lr': 1}."""
    flat = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat
