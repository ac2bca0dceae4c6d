"""Defaults <- a YAML file <- ``key=value`` overrides, each value coerced to its field's type.

A key given twice in one YAML mapping, or set twice in one file (dotted once, nested once), is a
``ValueError`` naming the key; an unknown key names the closest valid one; a value of the wrong
type is a ``TypeError`` naming the key. Values and rules are checked after the last override
(:func:`.rules.validate`), so an override may fix what the file set.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Dict, List, Literal, Optional, Union

import yaml

from .rules import validate
from .schema import Config


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the last).

    A ``<<`` merge key is not a duplicate: keys written next to it override the merged ones by
    YAML's definition.
    """

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = key in first
                except TypeError:  # an unhashable key: SafeLoader's own error follows
                    continue
                mark = key_node.start_mark
                if seen:
                    raise ValueError(f"duplicate config key {key!r} in {mark.name}, line {mark.line + 1} "
                                     f"(first at line {first[key].line + 1})")
                first[key] = mark
        return super().construct_mapping(node, deep=deep)


def _yaml_load(stream):
    return yaml.load(stream, Loader=_UniqueKeyLoader)


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


def _unknown_key(key: str) -> ValueError:
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.0)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ValueError(f"unknown config key {key!r}{hint}")


def _coerce(key: str, value, tp):
    """``value`` checked (and mildly converted: int -> float, str -> [str]) against ``tp``.

    A ``Literal`` is checked for its values' type only; its values are checked at validation.
    """
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


def _set(obj, path: List[str], value, full_key: str, seen: Optional[set] = None) -> None:
    """Assign ``value`` at ``path`` under the dataclass ``obj``; a mapping merges into a section.

    ``seen``: the leaf keys this mapping has set so far; setting one again (``a.b: 1`` and
    ``a: {b: 2}`` in one file) is a duplicate key.
    """
    name = _aliases(type(obj)).get(path[0], path[0]) if dataclasses.is_dataclass(obj) else path[0]
    if name != path[0]:  # one canonical spelling, so that an alias and its field count as one key
        full_key = full_key[:len(full_key) - len(".".join(path))] + ".".join([name, *path[1:]])
    if not dataclasses.is_dataclass(obj) or name not in {f.name for f in dataclasses.fields(obj)}:
        raise _unknown_key(full_key)
    tp = _hints(type(obj))[name]
    if len(path) > 1:
        if not dataclasses.is_dataclass(tp):
            raise _unknown_key(full_key)
        _set(getattr(obj, name), path[1:], value, full_key, seen)
    elif dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise TypeError(f"config key {full_key!r} is a section; give a mapping, got {type(value).__name__}")
        for k, v in value.items():
            _set(getattr(obj, name), [str(k)], v, f"{full_key}.{k}", seen)
    else:
        if seen is not None:
            if full_key in seen:
                raise ValueError(f"duplicate config key {full_key!r}: set twice in one file")
            seen.add(full_key)
        setattr(obj, name, _coerce(full_key, value, tp))


def apply_dict(cfg: Config, tree: dict, prefix: str = "") -> Config:
    """Merge a nested mapping (a parsed YAML file) into ``cfg``; returns it. A key set twice
    (spelled dotted once and nested once) is a ``ValueError``."""
    if not isinstance(tree, dict):
        raise TypeError(f"config file must hold a mapping at the top level, got {type(tree).__name__}")
    seen: set = set()
    for k, v in tree.items():
        key = f"{prefix}{k}"
        _set(cfg, key.split("."), v, key, seen)
    return cfg


def apply_override(cfg: Config, override: str) -> Config:
    """Apply one ``dotted.key=value`` (verl's ``+key=value`` is accepted for known keys)."""
    if not isinstance(override, str) or "=" not in override:
        raise ValueError(f"override {override!r} must look like key=value")
    key, raw = override.split("=", 1)
    key = key.strip().lstrip("+")
    try:
        value = _yaml_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    _set(cfg, key.split("."), value, key)
    return cfg


def load_config(yaml_path: Optional[str] = None, overrides=()) -> Config:
    """Defaults <- YAML file <- ``overrides`` (``["key=value", ...]``), then :func:`validate`."""
    if isinstance(overrides, str):
        raise TypeError("overrides must be a list of 'key=value' strings, got a single str")
    cfg = Config()
    if yaml_path is not None:
        with open(yaml_path) as f:
            tree = _yaml_load(f) or {}
        apply_dict(cfg, tree)
    for o in overrides:
        apply_override(cfg, o)
    return validate(cfg)


def dump_config(cfg: Config, path: str) -> None:
    """Write ``cfg`` as YAML (loadable by :func:`load_config`)."""
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
