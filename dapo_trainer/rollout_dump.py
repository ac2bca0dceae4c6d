"""Rollout dumps (``trainer.rollout_data_dir``): the rows the trainer writes, read by ``dapo-report``
(:mod:`dapo_trainer.tools.batch_quality`).

The trainer writes, per step, ``ROLLOUT_DIR/{step}.jsonl`` (verl's file name): at most
``trainer.rollout_data_max_rows`` rows, whole prompt groups spread evenly over the step's
generation batches, one JSON object per response:

``step, gen_batch, group`` (index of the prompt in its generation batch), ``sample`` (index in
the group), ``prompt``, ``response`` (decoded text), ``response_ids``, ``response_length``,
``finish_reason`` ("stop" | "length"), ``score`` (the reward function's), ``acc``, ``reward``
(score + overlong penalty: what the advantages are computed from), ``filter_metric``,
``components`` (the reward function's dict; ``{}`` for responses another data-parallel replica
sampled), ``kept`` (the group passed the dynamic-sampling filter).
"""
from __future__ import annotations

import json
import os
from typing import List, Sequence


def check_rollout_dir(rollout_dir: str, key: str = "trainer.rollout_data_dir") -> None:
    """Start-up check that :func:`write_step` can write under ``rollout_dir`` (named ``key`` in the
    ValueError): every existing part of the path is a directory, the deepest one writable."""
    target = os.path.abspath(rollout_dir)
    existing = target
    while not os.path.isdir(existing):
        if os.path.lexists(existing):  # a file, or a link to nothing, where a directory must be
            raise ValueError(f"{key}: {existing!r} is not a directory, so rollouts cannot be written to "
                             f"{target!r}; pick another path")
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{key}: the directory {existing!r} is not writable, so rollouts cannot be written to "
                         f"{target!r}; pick another path")


def spread_groups(groups_per_batch: Sequence[int], n: int, max_rows: int) -> List[tuple]:
    """``(gen batch, group)`` pairs to dump: at most ``max_rows // n`` groups (at least one), evenly
    strided over all groups of the step in arrival order, so every generation batch is sampled."""
    total = sum(groups_per_batch)
    want = min(total, max(1, max_rows // n))
    flat = [(k, g) for k, b in enumerate(groups_per_batch) for g in range(b)]
    return [flat[i * total // want] for i in range(want)]


def write_step(rollout_dir: str, step: int, rows: List[dict]) -> str:
    """``rollout_dir/{step}.jsonl``, replaced atomically (a resumed step overwrites its file)."""
    os.makedirs(rollout_dir, exist_ok=True)
    path = os.path.join(rollout_dir, f"{step}.jsonl")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)
    return path
