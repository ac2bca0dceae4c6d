"""Rewards: the built-in checkers (:mod:`.verifiers`), a user's reward function loaded by path, and
the dialogue scorers (:mod:`.scorers`, imported on its own: it needs torch).

A reward function has verl's custom-reward signature
``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` and returns a float or a
dict with ``"score"`` and optionally ``"acc"`` and other named float components.
"""
from __future__ import annotations

import os
from typing import Callable, Union

from .verifiers import (
    ARITHMETIC_DATA_SOURCES,
    MATH_DATA_SOURCES,
    answers_match,
    arithmetic_compute_score,
    default_compute_score,
    extract_final_answer,
    math_compute_score,
    normalize_answer,
)

__all__ = [
    "math_compute_score",
    "arithmetic_compute_score",
    "default_compute_score",
    "load_reward_fn",
    "extract_final_answer",
    "normalize_answer",
    "answers_match",
    "MATH_DATA_SOURCES",
    "ARITHMETIC_DATA_SOURCES",
]

ScoreFn = Callable[..., Union[float, dict]]


def load_reward_fn(path: str, name: str = "compute_score") -> ScoreFn:
    """The function ``name`` from the Python file at ``path`` (``custom_reward_function``).

    The file is executed as Python code with the trainer's rights, as verl does: only trusted code."""
    from ..envs import load_attr

    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TypeError(f"custom_reward_function.path must be a file path, got {path!r}")
    if not isinstance(name, str) or not name:
        raise TypeError(f"custom_reward_function.name must be a non-empty str, got {name!r}")
    full = os.path.abspath(os.fspath(path))
    if not os.path.isfile(full):
        raise ValueError(f"custom_reward_function.path: no such file {full!r}")
    fn = load_attr(full, name, "custom_reward_function")
    if not callable(fn):
        raise TypeError(f"custom_reward_function.name: {name!r} in {full!r} is not callable")
    return fn
