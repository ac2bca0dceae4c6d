"""References for group filtering: verl's semantics written plainly (dict of groups, loops).

* Keep rule of DAPO's dynamic sampling (verl recipe/dapo): population std (``np.std``,
  ddof 0) of the group's metric > ``min_std``, or a single member.
* GRPO advantages of verl's ``compute_grpo_outcome_advantage``: ``torch.std`` (unbiased),
  singletons mean 0 / std 1.

One deliberate difference from verl: a group whose values are all identical has std
exactly 0. ``np.std([0.1] * 3)`` returns 1.4e-17 (rounding of the mean), which would make
verl keep a group that carries no learning signal.

Another: each group's statistics are taken of its scores divided by a power of two near their
largest magnitude (exact, so ordinary scores give verl's numbers bit for bit); scores near
+-1e308 then give finite advantages where ``torch.std`` overflows to inf (advantages all 0).
"""
from __future__ import annotations

from collections import defaultdict

import math

import numpy as np
import torch


def _groups(group_index) -> dict:
    groups = defaultdict(list)
    for i, g in enumerate(group_index.tolist()):
        groups[g].append(i)
    return groups


def pow2_scale(amax: float) -> float:
    """The power of two ``2**floor(log2(amax))`` for ``amax >= 1``, else 1: dividing by it is exact and
    leaves magnitudes below 2, whose sums and squares cannot overflow."""
    return 2.0 ** max(math.frexp(amax)[1] - 1, 0)


def group_filter_ref(scores, group_index, num_groups: int, *, epsilon: float = 1e-6,
                     norm_adv_by_std: bool = True, min_std: float = 0.0, dtype=torch.float64):
    """Returns (keep [N] bool, advantages [N] ``dtype``, group_keep [G] bool, group_size [G] int64,
    group_mean [G], group_std [G]) for finite scores and indices in ``[0, G)``.

    ``dtype`` is the precision of the torch arithmetic (float64 for the reference,
    float32 for "what plain torch costs in float32").
    """
    vals = scores.detach().cpu().to(dtype)
    groups = _groups(group_index.cpu())
    N = vals.shape[0]
    keep = torch.zeros(N, dtype=torch.bool)
    adv = torch.zeros(N, dtype=dtype)
    group_keep = torch.zeros(num_groups, dtype=torch.bool)
    group_size = torch.zeros(num_groups, dtype=torch.int64)
    group_mean = torch.zeros(num_groups, dtype=dtype)
    group_std = torch.zeros(num_groups, dtype=dtype)
    for g, idx in groups.items():
        metric = [float(vals[i]) for i in idx]
        uniform = len(set(metric)) == 1
        scale = pow2_scale(max(abs(v) for v in metric))
        pop_std = 0.0 if uniform else np.std([v / scale for v in metric]) * scale
        kept = bool(pop_std > min_std) or len(idx) == 1
        t = vals[idx] / scale
        if len(idx) == 1:
            mean, std = torch.tensor(0.0, dtype=dtype), torch.tensor(1.0 / scale, dtype=dtype)
        else:
            mean = torch.mean(t)
            std = torch.tensor(0.0, dtype=dtype) if uniform else torch.std(t)
        a = t - mean
        a = a / (std + epsilon / scale) if norm_adv_by_std else a * scale
        if uniform and len(idx) > 1:
            a = torch.zeros_like(a)
        adv[idx] = a
        keep[idx] = kept
        group_keep[g], group_size[g], group_mean[g], group_std[g] = kept, len(idx), mean * scale, std * scale
    return keep, adv, group_keep, group_size, group_mean, group_std

