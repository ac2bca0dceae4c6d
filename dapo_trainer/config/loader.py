"""Defaults <- a YAML file <- ``key=value`` overrides, each value coerced to its field's type.

A file that is not valid YAML (a tab, bad indentation, a ``!!python/*`` tag) is a ``ValueError``
naming the file and line.
A key given twice in one YAML mapping, or set twice in one file (dotted once, nested once), is a
``ValueError`` naming the key; a value of the wrong type is a ``TypeError`` naming the key. Unknown
keys, and verl keys whose value asks for what is not implemented (:mod:`.verl_keys`), are collected
over the whole file and every override and reported in one :class:`ConfigError`, each with the
closest valid key when one is close. verl keys accepted without effect are listed in one
:class:`VerlKeysNoted` warning. Values and rules are checked after the last override
(:func:`.rules.validate`), so an override may fix what the file set.

Interpolations resolve as omegaconf's (verl's) do, after the last override: ``${oc.env:VAR}`` and
``${oc.env:VAR,default}`` (an unset ``VAR`` without a default is a ``ValueError`` naming the key),
``${path.to.key}`` and the relative ``${.sibling}``; a value that is one interpolation takes the
referenced value's type, one with text around it is text; a backslash before ``${`` keeps it literal.
An integer with a leading zero (``010``: octal 8 in YAML 1.1, 10 to a reader of decimals) is a
``ValueError`` naming the key.
"""
from __future__ import annotations

import dataclasses
import difflib
import io
import os
import re
import typing
import warnings
from typing import Any, Dict, List, Literal, Optional, Union

import yaml

from ..readers import read_text
from .rules import notes as setting_notes, validate
from .schema import Config
from .verl_keys import VERL_KEYS, check_verl_keys, is_verl_section, split_loggers
from .yaml_reader import LeadingZero, read_yaml as _read_yaml, yaml_load as _yaml_load


class ConfigError(ValueError):
    """Every unknown or rejected key of one load; ``problems``: one line each."""

    def __init__(self, problems: List[str]):
        self.problems = list(problems)
        if len(self.problems) == 1:
            super().__init__(self.problems[0])
        else:
            super().__init__(f"{len(self.problems)} config problems:\n" + "\n".join(f"  - {p}" for p in problems))


class VerlKeysNoted(UserWarning):
    """verl keys accepted without effect here; ``notes``: one line each, ``key=value: what it means here``."""

    def __init__(self, notes: List[str]):
        self.notes = list(notes)
        super().__init__("verl keys accepted with no effect here:\n" + "\n".join(f"  {n}" for n in notes))


# ${...} not preceded by a backslash; its body holds no further braces or "$".
_INTERP = re.compile(r"(?<!\\)\$\{([^${}]*)\}")


def _has_interp(value) -> bool:
    if isinstance(value, str):
        return bool(_INTERP.search(value)) or "\\${" in value
    if isinstance(value, (list, tuple)):
        return any(_has_interp(v) for v in value)
    if isinstance(value, dict):
        return any(_has_interp(v) for v in value.values())
    return False


class _Reading:
    """What one load collects until the last override: verl keys given, notes, problems, and the
    interpolations, resolved against the final values."""

    def __init__(self):
        self.verl: Dict[str, Any] = {}  # key -> last value given
        self.notes: Dict[str, str] = {}
        self.problems: List[str] = []
        self.pending: Dict[str, Any] = {}  # field key -> value holding ${...}, last given
        self._resolving: List[str] = []

    def resolve(self, cfg: Config) -> None:
        """Set every pending interpolated field from the final values (omegaconf resolves on access,
        after every merge); then the verl keys' interpolations."""
        while self.pending:
            self._resolve_key(cfg, next(iter(self.pending)))
        for key, value in list(self.verl.items()):
            if _has_interp(value):
                self.verl[key] = self._value(cfg, key, value)

    def _resolve_key(self, cfg: Config, key: str) -> None:
        if key in self._resolving:
            chain = " -> ".join(self._resolving[self._resolving.index(key):] + [key])
            raise ValueError(f"config key {key!r}: interpolation cycle {chain}")
        self._resolving.append(key)
        value = self._value(cfg, key, self.pending[key])
        self._resolving.pop()
        del self.pending[key]
        path = key.split(".")
        obj, name = _leaf(cfg, path)
        if isinstance(value, str) and _base_type(_hints(type(obj))[name]) is not str:
            try:  # omegaconf converts a resolved str to the node's type: "${oc.env:SEED}" -> 5
                value = _yaml_load(value)
            except yaml.YAMLError:
                pass
        _set(cfg, path, value, key, self, resolved=True)

    def _value(self, cfg: Config, key: str, value):
        if isinstance(value, (list, tuple)):
            return [self._value(cfg, f"{key}[{i}]", v) for i, v in enumerate(value)]
        if isinstance(value, dict):
            return {k: self._value(cfg, f"{key}.{k}", v) for k, v in value.items()}
        if not isinstance(value, str):
            return value
        whole = _INTERP.fullmatch(value)
        if whole:
            return self._one(cfg, key, whole.group(1))
        text = _INTERP.sub(lambda m: _as_text(self._one(cfg, key, m.group(1))), value)
        return text.replace("\\${", "${")

    def _one(self, cfg: Config, key: str, expr: str):
        """The value of one ``${expr}`` in ``key``'s value."""
        expr = expr.strip()
        if expr.startswith("oc.env:"):
            var, comma, default = expr[len("oc.env:"):].partition(",")
            var = var.strip()
            if var in os.environ:
                return os.environ[var]
            if comma:
                default = default.strip()
                if default == "null":
                    return None
                return default[1:-1] if len(default) > 1 and default[0] == default[-1] in "'\"" else default
            raise ValueError(f"config key {key!r}: environment variable {var!r} of ${{{expr}}} is not set; "
                             f"set it or give a default: ${{oc.env:{var},default}}")
        if ":" in expr:
            raise ValueError(f"config key {key!r}: ${{{expr}}} uses a resolver other than oc.env, "
                             f"which is not supported here")
        target = expr
        if expr.startswith("."):  # relative: one dot is key's own section, each further dot one up
            dots = len(expr) - len(expr.lstrip("."))
            base = key.split(".")[:-dots]
            target = ".".join(base + [expr[dots:]])
        canonical = _canonical(target)
        if canonical in self.pending:
            self._resolve_key(cfg, canonical)
        found = _leaf(cfg, canonical.split("."))
        if found is not None:
            obj, name = found
            v = getattr(obj, name)
            return dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
        if target in self.verl:
            return self.verl[target]
        raise ValueError(f"config key {key!r}: ${{{expr}}} names no config key {target!r}")

    def not_a_field(self, key: str, value) -> None:
        """``key`` names no field: a verl key (judged in :meth:`finish`), a section of some, or unknown."""
        if key in VERL_KEYS:
            self.verl[key] = value
        elif isinstance(value, dict) and is_verl_section(key):
            for k, v in value.items():
                self.not_a_field(f"{key}.{k}", v)
        else:
            self.problems.append(_unknown_key(key))

    def finish(self, cfg: Config) -> List[str]:
        """Judge the verl keys against the final ``cfg``: one :class:`ConfigError` with every problem,
        else the notes."""
        notes, problems = check_verl_keys(list(self.verl.items()), cfg)
        if self.problems or problems:
            raise ConfigError(self.problems + problems)
        return list(self.notes.values()) + notes


def _print_notes(notes: List[str]) -> None:
    if notes:
        warnings.warn(VerlKeysNoted(notes), stacklevel=3)


def _as_text(value) -> str:
    """A resolved value inside text, as omegaconf writes it (None as "None")."""
    return str(value)


def _leaf(cfg, path: List[str]):
    """(section object, field name) that the dotted ``path`` names under ``cfg`` (aliases read), or None."""
    obj = cfg
    for i, part in enumerate(path):
        if not dataclasses.is_dataclass(obj):
            return None
        name = _aliases(type(obj)).get(part, part)
        if name not in {f.name for f in dataclasses.fields(obj)}:
            return None
        if i == len(path) - 1:
            return obj, name
        obj = getattr(obj, name)
    return None


def _canonical(key: str) -> str:
    """``key`` with every alias replaced by its field's name."""
    obj, parts = Config(), []
    for part in key.split("."):
        name = _aliases(type(obj)).get(part, part) if dataclasses.is_dataclass(obj) else part
        parts.append(name)
        obj = getattr(obj, name, None)
    return ".".join(parts)


def _hints(cls) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def _aliases(cls) -> Dict[str, str]:
    """``{alias: field name}`` of the section class ``cls`` (its fields' ``aliases`` metadata)."""
    return {a: f.name for f in dataclasses.fields(cls) for a in f.metadata.get("aliases", ())}


def all_keys(cls=Config, prefix: str = "") -> List[str]:
    """Every dotted key of the config, leaves and sections."""
    keys = []
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        keys.append(key)
        t = _hints(cls)[f.name]
        if dataclasses.is_dataclass(t):
            keys += all_keys(t, key + ".")
    return keys


def _sections(cls=Config):
    yield cls
    for t in _hints(cls).values():
        if dataclasses.is_dataclass(t):
            yield from _sections(t)


# Other spellings of a field, per section: {section class name: {alias: field}}.
ALIASES = {cls.__name__: a for cls in _sections() if (a := _aliases(cls))}


def _closest_key(key: str) -> Optional[str]:
    """A valid key close to ``key``: a sibling with a similar name, else a near-identical dotted key."""
    known = all_keys() + list(VERL_KEYS)
    section, _, leaf = key.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == section]
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.75)
    if close:
        return f"{section}.{close[0]}" if section else close[0]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.9)
    return close[0] if close else None


def _unknown_key(key: str) -> str:
    close = _closest_key(key)
    hint = f"; did you mean {close!r}?" if close else ""
    return f"unknown config key {key!r}{hint}"


def _coerce(key: str, value, tp):
    """``value`` checked (and mildly converted: int -> float, str -> [str]) against ``tp``.

    A ``Literal`` is checked for its values' type only; its values are checked at validation.
    """
    if isinstance(value, LeadingZero):
        if tp in (int, float):
            digits = value.replace("_", "")
            raise ValueError(f"config key {key!r} is {value}: with a leading zero YAML 1.1 reads octal "
                             f"({int(digits, 8)}) where a decimal reader sees {int(digits, 10)}; "
                             f"write it without the leading zero")
        value = str(value)
    origin = typing.get_origin(tp)
    if origin is Literal:
        return _coerce(key, value, type(typing.get_args(tp)[0]))
    if origin is Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, value, a)
            except TypeError:
                pass
        names = " or ".join(_type_name(a) for a in args)
        raise TypeError(f"config key {key!r} must be {names}, got {type(value).__name__} {value!r}")
    if origin in (list, List):
        (item,) = typing.get_args(tp)
        if isinstance(value, str) and _base_type(item) is str:
            return [value]  # a single file where a list is expected
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"config key {key!r} must be a list, got {type(value).__name__} {value!r}")
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if origin in (dict, Dict):
        kt, vt = typing.get_args(tp)
        if not isinstance(value, dict):
            raise TypeError(f"config key {key!r} must be a mapping, got {type(value).__name__} {value!r}")
        return {_coerce(key, k, kt): _coerce(f"{key}.{k}", v, vt) for k, v in value.items()}
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads "1e-6" (no dot) as a string.
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"config key {key!r} must be a float, got {type(value).__name__} {value!r}")
        return float(value)
    if tp in (int, str, bool):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise TypeError(f"config key {key!r} must be {tp.__name__}, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"config key {key!r}: unsupported type {tp}")  # pragma: no cover - a bug in the schema


def _base_type(t):
    """The Python type of ``t``'s values (a ``Literal``'s values' type)."""
    return type(typing.get_args(t)[0]) if typing.get_origin(t) is Literal else t


def _type_name(t) -> str:
    t = _base_type(t)
    return getattr(t, "__name__", str(t).replace("typing.", ""))


def _set(obj, path: List[str], value, full_key: str, reading: _Reading, seen: Optional[set] = None,
         resolved: bool = False) -> None:
    """Assign ``value`` at ``path`` under the dataclass ``obj``; a mapping merges into a section.
    A key that names no field goes to ``reading``.

    ``seen``: the leaf keys this mapping has set so far; setting one again (``a.b: 1`` and
    ``a: {b: 2}`` in one file) is a duplicate key. ``resolved``: ``value`` is an interpolation's
    result, set as it is (a literal ``${`` left by ``\\${`` stays).
    """
    name = _aliases(type(obj)).get(path[0], path[0]) if dataclasses.is_dataclass(obj) else path[0]
    if name != path[0]:  # one canonical spelling, so that an alias and its field count as one key
        full_key = full_key[:len(full_key) - len(".".join(path))] + ".".join([name, *path[1:]])
    if not dataclasses.is_dataclass(obj) or name not in {f.name for f in dataclasses.fields(obj)}:
        return reading.not_a_field(full_key, value)
    tp = _hints(type(obj))[name]
    if len(path) > 1:
        if not dataclasses.is_dataclass(tp):
            return reading.not_a_field(full_key, value)
        _set(getattr(obj, name), path[1:], value, full_key, reading, seen, resolved)
    elif dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise TypeError(f"config key {full_key!r} is a section; give a mapping, got {type(value).__name__}")
        for k, v in value.items():
            _set(getattr(obj, name), [str(k)], v, f"{full_key}.{k}", reading, seen)
    else:
        if seen is not None:
            if full_key in seen:
                raise ValueError(f"duplicate config key {full_key!r}: set twice in one file")
            seen.add(full_key)
        if not resolved and _has_interp(value):
            reading.pending[full_key] = value  # resolved after the last override, as omegaconf on access
            return
        reading.pending.pop(full_key, None)
        if full_key == "trainer.logger":
            value, note = split_loggers(value)
            reading.notes.pop(full_key, None)
            if note:
                reading.notes[full_key] = f"{full_key}: {note}"
        setattr(obj, name, _coerce(full_key, value, tp))


def _apply_dict(cfg: Config, tree: dict, reading: _Reading) -> None:
    if not isinstance(tree, dict):
        raise TypeError(f"config file must hold a mapping at the top level, got {type(tree).__name__}")
    seen: set = set()
    for k, v in tree.items():
        _set(cfg, str(k).split("."), v, str(k), reading, seen)


def _apply_override(cfg: Config, override: str, reading: _Reading) -> None:
    if not isinstance(override, str) or "=" not in override:
        raise ValueError(f"override {override!r} must look like key=value")
    key, raw = override.split("=", 1)
    key = key.strip().lstrip("+")
    try:
        value = _yaml_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    _set(cfg, key.split("."), value, key, reading)


def apply_dict(cfg: Config, tree: dict) -> Config:
    """Merge a nested mapping (a parsed YAML file) into ``cfg``; returns it. A key set twice
    (spelled dotted once and nested once) is a ``ValueError``; unknown keys, one :class:`ConfigError`."""
    reading = _Reading()
    _apply_dict(cfg, tree, reading)
    reading.resolve(cfg)
    _print_notes(reading.finish(cfg))
    return cfg


def apply_override(cfg: Config, override: str) -> Config:
    """Apply one ``dotted.key=value`` (verl's ``+key=value`` is accepted for known keys)."""
    reading = _Reading()
    _apply_override(cfg, override, reading)
    reading.resolve(cfg)
    _print_notes(reading.finish(cfg))
    return cfg


def load_config(yaml_path: Optional[str] = None, overrides=()) -> Config:
    """Defaults <- YAML file <- ``overrides`` (``["key=value", ...]``), then :func:`validate`.

    Every unknown or rejected key of the file and the overrides: one :class:`ConfigError`."""
    if isinstance(overrides, str):
        raise TypeError("overrides must be a list of 'key=value' strings, got a single str")
    cfg, reading = Config(), _Reading()
    if yaml_path is not None:
        stream = io.StringIO(read_text(yaml_path))  # UTF-8 checked, naming the file and line
        stream.name = yaml_path  # for the line marks of yaml's errors (duplicate keys)
        tree = _read_yaml(stream, yaml_path) or {}
        _apply_dict(cfg, tree, reading)
    for o in overrides:
        _apply_override(cfg, o, reading)
    reading.resolve(cfg)
    notes = reading.finish(cfg)
    validate(cfg)
    _print_notes(notes + setting_notes(cfg))
    return cfg


def dump_config(cfg: Config, path: str) -> None:
    """Write ``cfg`` as YAML (loadable by :func:`load_config`)."""
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
