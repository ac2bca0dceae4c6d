"""Text, JSON and JSON-lines files read with errors that locate the problem.

Every reader raises ``ValueError`` naming the file, and the line where there is one: a path that is
missing or a directory, a byte sequence that is not UTF-8, text that is not JSON. The data loader, the
model's ``config.json`` and the diagnostics CLIs read through these.
"""
from __future__ import annotations

import json
import os
from typing import Any, List, Tuple

__all__ = ["read_text", "read_json", "read_jsonl"]


def _check_file(path: str) -> None:
    if os.path.isdir(path):
        raise ValueError(f"{path!r} is a directory, not a file")
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} does not exist")


def read_text(path: str) -> str:
    """The UTF-8 text of ``path``."""
    _check_file(path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 (byte {data[e.start]:#04x} at offset {e.start}); "
                         "save the file as UTF-8") from None


def read_json(path: str) -> Any:
    """The JSON value in ``path``."""
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno})") from None


def read_jsonl(path: str, *, skip_partial_last: bool = False) -> List[Tuple[int, Any]]:
    """``[(line number, value)]`` of the non-blank lines of ``path``, one JSON value each.

    ``skip_partial_last``: a last line that is not JSON is dropped (what a writer killed mid-line
    leaves) instead of raising, unless it is the only line: then nothing says the file was ever
    what it should be."""
    lines = read_text(path).split("\n")  # not splitlines(): JSON strings may hold U+2028 and the like
    last = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            if skip_partial_last and n == last and out:
                continue
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg}, column {e.colno})") from None
    return out
