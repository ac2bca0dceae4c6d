"""A config field's rules, declared with the field, and the one generic check that applies them.

``setting(default, range=..., aliases=...)`` declares a field of a config section:

* ``range``: ``(valid, expected)`` as ``check_float`` takes it (build it with :func:`at_least`,
  :func:`above`, :func:`within`), applied to the value, or to each item of a list / mapping. Every
  float must also be finite; a float field declares ``range=ANY`` for "any finite value", so that a
  float key without a range is a visible choice (tests/trainer/test_config.py requires one on each).
* ``aliases``: other spellings of the key the loader accepts (one canonical key in errors).

Every int must fit int64 (tensors and the extension ops take them as int64).
A field typed with a ``Literal`` (alone, in a list or in a union) must hold one of its values.
:func:`check_fields` checks all of it for a whole config, naming the dotted key.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Callable, Literal, Optional, Tuple, Union

from dapo_kernels.validation import check_float

Range = Tuple[Callable[[float], bool], str]  # (valid, expected), as check_float takes them
ANY: Optional[Range] = None  # any finite value
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
_UNSET = object()


def setting(default=dataclasses.MISSING, *, default_factory=dataclasses.MISSING, range=_UNSET,
            aliases: Tuple[str, ...] = ()):
    """A dataclass field with its value ``range`` and key ``aliases`` in its metadata."""
    metadata = {} if range is _UNSET else {"range": range}
    if aliases:
        metadata["aliases"] = tuple(aliases)
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def _with_note(text: str, note: str) -> str:
    return f"{text} {note}" if note else text


def at_least(lo, note: str = "") -> Range:
    return (lambda v: v >= lo), _with_note(f">= {lo}", note)


def above(lo, note: str = "") -> Range:
    return (lambda v: v > lo), _with_note(f"> {lo}", note)


def within(lo, hi, *, open_lo: bool = False, open_hi: bool = False) -> Range:
    """``lo <= v <= hi``, either end excluded by ``open_lo`` / ``open_hi``."""
    def valid(v):
        return (v > lo if open_lo else v >= lo) and (v < hi if open_hi else v <= hi)
    return valid, f"in {'(' if open_lo else '['}{lo}, {hi}{')' if open_hi else ']'}"


def require(ok: bool, key: str, msg: str) -> None:
    """``ValueError("config key 'key': msg")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"config key {key!r}: {msg}")


def _items(key: str, value):
    """``(key, item)`` of a value: itself, a list's items as ``key[i]``, a mapping's values as ``key.name``."""
    if isinstance(value, (list, tuple)):
        return [(f"{key}[{i}]", x) for i, x in enumerate(value)]
    if isinstance(value, dict):
        return [(f"{key}.{k}", x) for k, x in value.items()]
    return [(key, value)]


def float_values(obj, prefix: str = ""):
    """``(field key, full key, value)`` of every float in the dataclass ``obj``, with list items
    as ``key[i]`` and mapping values as ``key.name`` (field key: ``key``)."""
    for f in dataclasses.fields(obj):
        key, v = prefix + f.name, getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            yield from float_values(v, key + ".")
        else:
            yield from ((key, k, x) for k, x in _items(key, v) if isinstance(x, float))


def _check_range(key: str, value, rule: Optional[Range]) -> None:
    valid, expected = rule or ((lambda v: True), "")
    if isinstance(value, float):
        check_float(f"config key {key!r}", value, valid=lambda v: math.isfinite(v) and valid(v),
                    expected=f"finite and {expected}" if expected else "finite")
    elif isinstance(value, int) and not isinstance(value, bool):
        require(INT64_MIN <= value <= INT64_MAX, key, f"must fit int64, got {value}")
        require(not rule or valid(value), key, f"must be {expected}, got {value}")


def _one_of(values) -> str:
    quoted = [repr(v) for v in values]
    if len(quoted) <= 2:
        return " or ".join(quoted)
    return f"one of {', '.join(quoted[:-1])} or {quoted[-1]}"


_KIND = {dict: "a mapping", list: "a list", type(None): "null"}


def _check_choice(key: str, value, tp) -> None:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        require(value in args, key, f"must be {_one_of(args)}, got {value!r}")
    elif origin is list and typing.get_origin(args[0]) is Literal:
        for item_key, item in _items(key, value):
            _check_choice(item_key, item, args[0])
    elif origin is Union:  # a value of the Literal's type must be one of its values
        for lit in (a for a in args if typing.get_origin(a) is Literal):
            values = typing.get_args(lit)
            if isinstance(value, type(values[0])):
                others = [_KIND.get(typing.get_origin(a) or a, str(a)) for a in args if a is not lit]
                require(value in values, key, f"must be {', or '.join([_one_of(values), *others])}, got {value!r}")


def check_fields(obj, prefix: str = "") -> None:
    """Every field of the dataclass ``obj`` (recursively) within its range and its ``Literal``'s values."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        key, value = prefix + f.name, getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            check_fields(value, key + ".")
            continue
        for item_key, item in _items(key, value):
            _check_range(item_key, item, f.metadata.get("range"))
        _check_choice(key, value, hints[f.name])
