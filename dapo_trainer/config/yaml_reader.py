"""YAML as the config loader reads it: SafeLoader that refuses a key given twice in one mapping, keeps
an integer written with a leading zero (``010``) as text for the loader to refuse, and reports a syntax
error as a ``ValueError`` naming the file and line."""
from __future__ import annotations

import yaml


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


class LeadingZero(str):
    """An integer scalar written with a leading zero (``010``), kept as its text."""


def _construct_int(loader, node):
    text = loader.construct_scalar(node)
    digits = text.replace("_", "").lstrip("+-")
    if len(digits) > 1 and digits[0] == "0" and digits.isdigit() and int(digits, 8) != int(digits, 10):
        return LeadingZero(text)
    return yaml.SafeLoader.construct_yaml_int(loader, node)


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def yaml_load(stream):
    return yaml.load(stream, Loader=_UniqueKeyLoader)


def read_yaml(stream, path: str):
    """The YAML document in ``stream``; its syntax errors (tabs, bad indentation, python/* tags
    that SafeLoader does not construct) as a ``ValueError`` naming ``path`` and the line."""
    try:
        return yaml_load(stream)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        what = getattr(e, "problem", None) or str(e)
        if "'\\t'" in what:
            what += "; YAML indents with spaces"
        col = f", column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"{where}: not valid YAML ({what}{col})") from None
