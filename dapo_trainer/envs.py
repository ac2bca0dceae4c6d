"""Multi-turn environments: the user / tool side of a dialogue the policy is trained on.

An environment is any object with two methods::

    reset(row) -> [message, ...]            # the conversation's opening (system, user, ...)
    step(history) -> (message | None, components)

``row`` is a data row (:func:`dapo_trainer.data.load_rows`: ``prompt``, ``ground_truth``,
``data_source``, ``extra_info``). ``history`` is the conversation so far as
``{"role", "content"}`` messages, ending with the assistant's latest turn (a ``step`` that
takes a second parameter, ``step(history, row)``, also gets the conversation's data row, for
facts the policy must not see). ``step`` returns
the next user / tool message (a message dict, or a str meaning a user message), or None
when the dialogue is over, and a mapping of named reward components (floats) for that
turn; a conversation's components are the per-name sums over its steps. ``step`` is called
after every assistant turn, also the last one (the one that hits ``max_turns`` or the token
budget), so that the environment can score it.

Environments are configured like the reward function (``environment.path`` /
``environment.name``) and loaded by :func:`load_environment`; one instance serves every
conversation, so it must keep no per-conversation state outside ``history``.
"""
from __future__ import annotations

import math
import os
from typing import Dict, List, Mapping, Optional, Tuple

from .chat import check_messages

__all__ = ["Environment", "EnvironmentError_", "load_environment", "load_attr", "check_step_result"]


class Environment:
    """Base class (optional: any object with ``reset`` and ``step`` works)."""

    def reset(self, row: dict) -> List[Dict[str, str]]:
        raise NotImplementedError

    def step(self, history: List[Dict[str, str]]) -> Tuple[Optional[Dict[str, str]], Dict[str, float]]:
        raise NotImplementedError


class EnvironmentError_(RuntimeError):
    """An environment failed on some conversations (an exception, a bad return value, an
    empty turn). ``output`` holds the whole rollout: the other conversations' samples are
    complete, the failed ones are flagged (``output.errors``)."""

    def __init__(self, message: str, output=None):
        super().__init__(message)
        self.output = output


def load_attr(path: str, name: Optional[str], key: str):
    """The attribute ``name`` of a Python file ``path``, or the object a dotted path names
    (``pkg.mod:attr`` or ``pkg.mod.attr``; ``name``, if given, is then looked up in it).

    A file is executed as Python code with the trainer's rights, as verl does: only trusted code.
    ``key`` is the config key named in errors.
    """
    import importlib.util

    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TypeError(f"{key}.path must be a file path or a dotted module path, got {path!r}")
    path = os.fspath(path)
    if path.endswith(".py") or os.path.sep in path or os.path.isfile(path):
        full = os.path.abspath(path)
        if not os.path.isfile(full):
            raise ValueError(f"{key}.path: no such file {full!r}")
        if not isinstance(name, str) or not name:
            raise TypeError(f"{key}.name must be a non-empty str, got {name!r}")
        # A unique module name per file, so two files named alike do not collide.
        spec = importlib.util.spec_from_file_location(f"_dapo_{key.replace('.', '_')}_{abs(hash(full))}", full)
        if spec is None or spec.loader is None:
            raise ValueError(f"{key}.path: cannot import {full!r} as a Python module")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        where = full
    else:
        if ":" in path:
            mod_name, _, attr = path.partition(":")
        elif importlib.util.find_spec(path.split(".")[0]) is not None and _is_module(path):
            mod_name, attr = path, ""
        else:  # pkg.module.Attr
            mod_name, _, attr = path.rpartition(".")
        try:
            module = importlib.import_module(mod_name or path)
        except ImportError as e:
            raise ValueError(f"{key}.path: cannot import {mod_name or path!r}: {e}") from None
        where = mod_name or path
        if attr:
            if not hasattr(module, attr):
                raise ValueError(f"{key}.path: module {where!r} has no attribute {attr!r}")
            module = getattr(module, attr)
            if not name:
                return module
    if not hasattr(module, name):
        public = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        raise ValueError(f"{key}.name: {where!r} defines no {name!r} (callables: {public})")
    return getattr(module, name)


def _is_module(dotted: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(dotted) is not None
    except (ImportError, ValueError):  # a parent is not a package
        return False


def load_environment(path: str, name: Optional[str] = None):
    """The environment ``environment.path`` / ``environment.name`` name: a class (instantiated
    without arguments), a factory function (called without arguments), or an instance."""
    obj = load_attr(path, name, "environment")
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "reset")):
        obj = obj()
    for method in ("reset", "step"):
        if not callable(getattr(obj, method, None)):
            raise TypeError(f"environment {path!r} {name or ''}: {type(obj).__name__} has no {method}() method")
    return obj


def check_step_result(result) -> Tuple[Optional[Dict[str, str]], Dict[str, float]]:
    """``step``'s return value checked: ``(message dict or None, {name: finite float})``;
    a ValueError / TypeError saying what is wrong otherwise."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise TypeError(f"step() must return (message or None, components), got {type(result).__name__} {result!r:.80}")
    msg, comps = result
    if isinstance(msg, str):
        msg = {"role": "user", "content": msg}
    if msg is not None:
        (msg,) = check_messages([msg], "step()'s message")
        if not msg["content"]:
            raise ValueError(f"step() returned an empty turn {msg!r}; return None to end the dialogue")
    if comps is None:
        comps = {}
    if not isinstance(comps, Mapping):
        raise TypeError(f"step()'s reward components must be a mapping {{name: float}}, got {type(comps).__name__}")
    out = {}
    for k, v in comps.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise TypeError(f"step()'s reward component {k!r} must be a finite float under a str name, got {v!r}")
        out[k] = float(v)
    return msg, out
