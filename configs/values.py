"""How a config value is read as the type of its field: a YAML file's value (already a number, a bool or text) or
the text of a command-line override, each read the same way, so that a word means one thing in either place."""

from __future__ import annotations

import contextlib
import decimal
import math
import re
from typing import Any


class NotOfType(Exception):
    """Raised by a converter for a value it cannot take; configs.coerce turns it into the one-line ConfigError."""


class NearZero(NotOfType):
    """Raised for a number written other than 0 that a float holds only as 0 (see near_zero); written is its text."""

    def __init__(self, written: str) -> None:
        super().__init__(written)
        self.written = written


# What is said of such a number, after its text
NEAR_ZERO = ("is too near 0 for a float (the least above 0 is about 5e-324), so it would be read as 0; write 0 if 0 "
             "is meant")


def near_zero(text: str, number: float) -> bool:
    """Whether number, what float() read from text, is 0 where text spells another number: float() reads 1e-400 (and
    -1e-400) as 0 without a word, and a setting whose 0 means something of its own then meant that, not the tiny
    number asked for (train.grad_clip=1e-400 was no clipping at all, train.ema_decay=1e-400 no average)."""
    if number != 0:
        return False
    try:
        return decimal.Decimal(text.strip()) != 0
    except decimal.InvalidOperation:  # a spelling of float's that Decimal does not take
        return False


# YAML 1.1's integers in base 16 and base 2, as PyYAML resolves them (lower-case prefix, '_' anywhere after it): a
# file's unquoted `eval_interval: 0x10` is 16, and the same words on the command line, or quoted in a file, are read
# the same way (train.eval_interval=0x10 was refused as no integer). Octal is not among them: YAML's 010 is 8, which
# load_yaml refuses in a file, and 010 on the command line is 10.
_BASED_INT = re.compile(r"([-+]?)0(?:x([0-9a-fA-F_]+)|b([01_]+))")
# YAML 1.1's decimal integers, '_' anywhere after the first digit (Python takes one '_' between two digits alone)
_UNDERSCORED_INT = re.compile(r"[-+]?[1-9][0-9_]*")
# YAML 1.1's decimal floats as PyYAML resolves them, '_' anywhere before the exponent: a file's 1__0.5 is 10.5
_UNDERSCORED_FLOAT = re.compile(r"[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?")


def _int_text(text: str) -> int | None:
    """The integer that text spells as YAML's unquoted integers do (decimal, 0x.. or 0b..), or None."""
    based = _BASED_INT.fullmatch(text.strip())
    if based is None:
        # YAML's 1__0 and 10_ are 10, which Python's int refuses
        plain = text.strip().replace("_", "") if _UNDERSCORED_INT.fullmatch(text.strip()) else text
        try:  # Python refuses integer text of over 4300 digits with a ValueError, which lands here too
            return int(plain, 10)
        except ValueError:
            return None
    sign, hexadecimal, binary = based.groups()
    digits = (hexadecimal or binary).replace("_", "")
    if not digits:  # '0x_': no digit at all
        return None
    number = int(digits, 16 if hexadecimal else 2)
    return -number if sign == "-" else number


def _to_bool(value: Any, from_text: bool) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):  # a file's 1 and 0, as the command line's train.compile=1 is read
        return bool(value)
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("true", "yes", "on"):
            return True
        if low in ("false", "no", "off"):
            return False
        if _int_text(value) in (0, 1):  # +1, 01 and 0x1 are YAML's 1 in a file, so here too
            return bool(_int_text(value))
    raise NotOfType


def _to_int(value: Any, from_text: bool) -> int:
    if isinstance(value, bool):  # a bool is an int in Python; 'true' for a count is a mistake
        raise NotOfType
    if isinstance(value, int):
        return value
    if isinstance(value, float):  # YAML's 1.0e+18: the digits written (load_yaml's exact), else the shortest spelling
        return _integral(getattr(value, "written", None) or repr(value))
    if not isinstance(value, str):
        raise NotOfType
    number = _int_text(value)  # before the float words: 0xE holds an E
    if number is not None:
        return number
    if any(c in value for c in ".eE"):  # 1e3 and 1.0e+18 are counts, as the same words in a YAML file are
        return _integral(value)
    raise NotOfType


def _integral(text: str) -> int:
    """The integer that decimal text such as '1e18' or '2.0' spells, exactly (float('1e23') is 99999999999999991611392);
    NotOfType for 1.5, and for what is past float's range (1e400), as a YAML file's number would be."""
    try:
        number = decimal.Decimal(text)
    except decimal.InvalidOperation:
        raise NotOfType from None
    if not number.is_finite() or number != number.to_integral_value() or math.isinf(float(number)):
        raise NotOfType
    return int(number)


def _to_float(value: Any, from_text: bool) -> float:
    if isinstance(value, bool):
        raise NotOfType
    if isinstance(value, (int, float)):
        written = getattr(value, "written", None)  # a file's 1.0e-400, which YAML read as 0.0 (load_yaml's exact)
        if written is not None and near_zero(written, value):
            raise NearZero(written)
        try:
            return float(value)
        except OverflowError:  # an integer past float's range (YAML's 400 digits): infinite, as '1e400' is
            return math.inf if value > 0 else -math.inf
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            number = float(value)  # YAML reads 3e-4 (no dot) as a string; it is a fine number here
            if near_zero(value, number):
                raise NearZero(value)
            return number
        if _YAML_INF_NAN.fullmatch(value.strip()):  # YAML's own spellings, as a file's unquoted .inf is read
            return float(value.replace(".", "", 1))
        if _UNDERSCORED_FLOAT.fullmatch(value.strip()):  # 1__0.5 and 1.5_, which Python's float refuses
            digits = value.strip().replace("_", "")
            number = float(digits)
            if near_zero(digits, number):  # 1__0.0e-400, read as 0 as 1e-400 was
                raise NearZero(value)
            return number
        number = _int_text(value)  # 0x10 and 0b10, which a file's YAML reads as integers
        if number is None:
            raise NotOfType
        return _to_float(number, from_text)
    raise NotOfType


_YAML_INF_NAN = re.compile(r"[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)")


def _to_str(value: Any, from_text: bool) -> str:
    if isinstance(value, str):
        return value
    if from_text or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return str(value)
    raise NotOfType


CONVERTERS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}
