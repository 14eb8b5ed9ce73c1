"""Reading run configs: YAML files (``yaml.safe_load`` only) and dotted ``KEY=VALUE`` overrides into
frozen dataclasses, with one-line errors that name the nearest valid key.

The dataclasses themselves (``GPTConfig``, ``DataConfig``, ``TrainConfig``, ``RunConfig``) live with the code
that uses them; this module only knows how to fill them from plain data and to describe them.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config that cannot be used; the message is one line for a person."""


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _user_fields(cls: type) -> list[dataclasses.Field]:
    """Fields a user may set (``derived`` ones, such as vocab_size, come from the data)."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("derived")]


def valid_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a config class, sections expanded: ['seed', 'train.batch_size', ...]."""
    hints = typing.get_type_hints(cls)
    keys = []
    for f in _user_fields(cls):
        if _is_section(hints[f.name]):
            keys += valid_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def nearest(key: str, candidates: list[str]) -> str | None:
    """The valid key a misspelt one most likely meant, comparing whole dotted keys and last parts."""
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if match:
        return match[0]
    last = key.rsplit(".", 1)[-1]
    by_last = {c.rsplit(".", 1)[-1]: c for c in candidates}
    match = difflib.get_close_matches(last, list(by_last), n=1, cutoff=0.6)
    return by_last[match[0]] if match else None


def _section_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted section name of a config class: ['data', 'model', 'train']."""
    hints = typing.get_type_hints(cls)
    keys = []
    for f in _user_fields(cls):
        if _is_section(hints[f.name]):
            keys += [prefix + f.name, *_section_keys(hints[f.name], f"{prefix}{f.name}.")]
    return keys


def _shown(text: str) -> str:
    """Text a person typed, echoed in a message: as it is, or escaped where a newline or the like would break the
    message's one line."""
    return text if text.isprintable() else repr(text)[1:-1]


def _unknown(key: str, cls: type, where: str, section: bool = False) -> ConfigError:
    # A misspelt section ('trian:' holding a mapping) is compared with the section names as well, which the
    # dotted keys alone never come close to.
    guess = nearest(key, valid_keys(cls) + (_section_keys(cls) if section else []))
    hint = f"; did you mean '{guess}'?" if guess else "; see `python train.py --help` for the valid keys"
    return ConfigError(f"unknown config key '{_shown(key)}'{where}{hint}")


def _type_name(tp: Any) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args:
        return " or ".join(_type_name(a) for a in args) + (" or null" if type(None) in typing.get_args(tp) else "")
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def coerce(value: Any, tp: Any, key: str, from_text: bool = False) -> Any:
    """Check value against a field's type; text from the command line is parsed by that type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        is_null = value is None or (from_text and str(value).lower() in ("null", "none", "~"))
        if is_null and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce(value, option, key, from_text)
            except ConfigError:
                continue
        raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r}")
    bad = ConfigError(f"{key} must be {_type_name(tp)}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str):
            low = value.strip().lower()
            if low in ("true", "yes", "on", "1"):
                return True
            if low in ("false", "no", "off", "0"):
                return False
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            return int(value)
        if isinstance(value, str):
            try:
                number = float(value.replace("_", "")) if any(c in value for c in ".eE") else int(value, 10)
            except ValueError:
                raise bad from None
            if isinstance(number, float):
                if not number.is_integer():
                    raise bad
                number = int(number)
            return number
        raise bad
    if tp is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML reads 3e-4 (no dot) as a string; it is a fine number here
            except ValueError:
                raise bad from None
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        if from_text or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return str(value)
        raise bad
    raise ConfigError(f"{key}: unsupported field type {tp!r}")


def build(cls: type, mapping: Any, where: str = "", prefix: str = "", root: type | None = None) -> Any:
    """Make a cls instance from a plain mapping; unknown keys and wrong types raise ConfigError."""
    root = root or cls
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, dict):
        what = f"section '{prefix[:-1]}'" if prefix else "a config"
        raise ConfigError(f"{what}{where} must be a mapping of keys to values, got {type(mapping).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in _user_fields(cls)}
    kwargs = {}
    for key, value in mapping.items():
        name = str(key)
        if name not in fields:
            raise _unknown(prefix + name, root, where, section=isinstance(value, dict))
        tp = hints[name]
        if _is_section(tp):
            kwargs[name] = build(tp, value, where, f"{prefix}{name}.", root)
        else:
            kwargs[name] = coerce(value, tp, prefix + name)
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ConfigError(f"{e}{where}") from None


def load_yaml(path: str | Path) -> dict:
    """A YAML config file as a mapping (empty file -> {}). Only plain data: safe_load, no Python tags."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file not found: '{path}'")
    if path.is_dir():
        raise ConfigError(f"config path '{path}' is a directory; give a .yaml file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file '{path}': {e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file '{path}' is not valid YAML{at}: {problem}") from None
    except (ValueError, OverflowError) as e:
        # safe_load builds dates as it reads them: 'seed: 2024-13-01' is a date with month 13, which Python refuses
        detail = (str(e).splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"config file '{path}' holds a value YAML cannot build: {detail}") from None
    except RecursionError:
        raise ConfigError(f"config file '{path}' is nested too deeply to read") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of sections (data:, model:, train:), "
                          f"got {type(data).__name__}")
    return data


def apply_overrides(mapping: dict, overrides: list[str], cls: type) -> dict:
    """Set dotted KEY=VALUE strings into a copy of mapping; each key must exist in cls."""
    result = {k: (dict(v) if isinstance(v, dict) else v) for k, v in mapping.items()}
    keys = valid_keys(cls)
    hints = _flat_hints(cls)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{_shown(item)}' must look like KEY=VALUE, e.g. train.max_iters=500")
        key, _, text = item.partition("=")
        key = key.strip()
        if key not in keys:
            raise _unknown(key, cls, " (command line)")
        value = coerce(text, hints[key], key, from_text=True)
        *sections, name = key.split(".")
        target = result
        for section in sections:
            if not isinstance(target.get(section), dict):
                target[section] = {}
            target = target[section]
        target[name] = value
    return result


def _flat_hints(cls: type, prefix: str = "") -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    flat = {}
    for f in _user_fields(cls):
        if _is_section(hints[f.name]):
            flat.update(_flat_hints(hints[f.name], f"{prefix}{f.name}."))
        else:
            flat[prefix + f.name] = hints[f.name]
    return flat


def describe(cls: type, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, default, one-line meaning) for every key, for --help."""
    hints = typing.get_type_hints(cls)
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
    hints = typing.get_type_hints(type(config))
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
