"""Rewards: the built-in checkers (:mod:`.verifiers`), a user's reward function loaded by path, the
filter metric as the keep rule sees it (:func:`binarize`), and, each imported on its own, the
dialogue reward (:mod:`.dialogue`) and its scorers (:mod:`.scorers`, which needs torch).

A reward function has verl's custom-reward signature
``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` and returns a float or a
dict with ``"score"`` and optionally ``"acc"`` and other named float components (str values, such as
verl's ``"pred"``, are kept for the rollout dump); :func:`check_reward` enforces that.
"""
from __future__ import annotations

import math
import numbers
import os
from typing import TYPE_CHECKING, Callable, Dict, Optional, Tuple, Union

import numpy as np

from .verifiers import (
    ARITHMETIC_DATA_SOURCES,
    MATH_DATA_SOURCES,
    answer_text,
    answers_match,
    arithmetic_compute_score,
    default_compute_score,
    extract_final_answer,
    math_compute_score,
    normalize_answer,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "math_compute_score",
    "arithmetic_compute_score",
    "default_compute_score",
    "load_reward_fn",
    "check_reward",
    "binarize",
    "MAX_ABS_REWARD",
    "extract_final_answer",
    "normalize_answer",
    "answers_match",
    "answer_text",
    "MATH_DATA_SOURCES",
    "ARITHMETIC_DATA_SOURCES",
]

ScoreFn = Callable[..., Union[float, dict]]
# GRPO's group statistics square reward differences in float64 (max ~1.8e308): larger rewards
# overflow to inf / NaN advantages.
MAX_ABS_REWARD = 1e100


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


def _real(value, what: str) -> float:
    """``value`` as a float when it is a real finite number of a sane size, else a TypeError / ValueError."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (numbers.Real, np.bool_)):
        raise TypeError(f"{what} must be a real number (bool, int, float or a numpy scalar), "
                        f"got {type(value).__name__} {value!r}"[:300])
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{what} is not finite: {x}")
    if abs(x) > MAX_ABS_REWARD:
        raise ValueError(f"{what} has magnitude {abs(x):.3g} > {MAX_ABS_REWARD:g} (the advantages would overflow)")
    return x


def check_reward(value, *, fn_name: str, sample_index: int, row_index: int) -> Tuple[float, Dict[str, object]]:
    """``(score, components)`` of what a reward function returned, or an error naming it.

    ``value``: a real finite number (bool, int, float, numpy scalar; not a str) -> ``(float(value), {})``;
    or a dict with a ``"score"`` key -> ``(score, dict)`` with every numeric value a float (each must be
    a real finite number) and str values kept as they are (verl's ``"pred"``). Anything else (None, a
    str, a list, a tensor, NaN / inf, ``|x| > MAX_ABS_REWARD``, a dict without ``"score"`` or with a
    value of another type) is a TypeError / ValueError naming ``fn_name``, ``sample_index`` (the response
    in the batch) and ``row_index`` (the data row).
    """
    where = f"reward function {fn_name!r} on sample {sample_index} (row {row_index})"
    if not isinstance(value, dict):
        return _real(value, f"{where}: the reward"), {}
    if "score" not in value:
        raise ValueError(f"{where} returned a dict with no 'score' key (keys: {sorted(map(str, value))})")
    comps: Dict[str, object] = {}
    for key, v in value.items():
        if isinstance(v, str) and key not in ("score", "acc"):
            comps[key] = v
        else:
            comps[key] = _real(v, f"{where}: the reward's [{key!r}]")
    return comps["score"], comps


def binarize(metric: torch.Tensor, threshold: Optional[float]) -> torch.Tensor:
    """``metric >= threshold`` as 0. / 1. (float64); ``metric`` itself when ``threshold`` is None.

    The filter metric (``algorithm.filter_groups.metric``: ``acc``; ``score`` / ``seq_reward``, the
    score; ``seq_final_reward``, the score after the overlong penalty; a mapping, that weighted mix of
    reward components) passes through this on every step before DAPO's keep rule: with
    ``reward_threshold`` set, a group is kept exactly when some of its responses pass the threshold
    and some do not, and groups whose metrics differ but all lie on one side of it are dropped."""
    if threshold is None:
        return metric
    return (metric >= threshold).double()
