"""Expert-contiguous order of the (token, choice) pairs, built on the device with no host read.

The ``T * k`` *slots* (slot ``s = t * k + j``: token ``t``'s ``j``-th choice) are sorted stably by
expert id into *rows*: expert ``e`` owns rows ``expert_offsets[e]:expert_offsets[e + 1]``, in token
order. Slots whose id lies outside ``[0, E)`` (transformers' ``num_experts`` sentinel, vLLM's -1 for
an expert on another rank) sort after every expert's rows (rows ``expert_offsets[E]:T * k``) and
contribute nothing.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class MoEPermutation(NamedTuple):
    """Where each (token, choice) pair sits in expert-contiguous order; all int32, on the ids' device.

    * ``row_slot [T*k]``: the slot (``t * k + j``) of each row; the row's token is ``row_slot // k``.
    * ``slot_row [T*k]``: the inverse, the row of each slot.
    * ``expert_offsets [E+1]``: expert ``e``'s rows are ``expert_offsets[e]:expert_offsets[e+1]``;
      ``expert_offsets[E]`` is the number of rows with a valid expert.
    """

    row_slot: torch.Tensor
    slot_row: torch.Tensor
    expert_offsets: torch.Tensor


def expert_keys(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 ``[T*k]``: each slot's expert, ``num_experts`` where the id is outside ``[0, E)``."""
    flat = topk_ids.reshape(-1).long()
    return torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)


def tokens_per_expert(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 ``[E]``: the slots that picked each expert (a scatter-add on the device: no read)."""
    keys = expert_keys(topk_ids, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=topk_ids.device)
    return counts.scatter_add_(0, keys, torch.ones_like(keys))[:num_experts]


def build_permutation(topk_ids: torch.Tensor, num_experts: int) -> MoEPermutation:
    """The :class:`MoEPermutation` of ``topk_ids [T, k]`` (a stable sort, a scatter-add and a cumsum
    on the device; no host read)."""
    keys = expert_keys(topk_ids, num_experts)
    n = keys.numel()
    row_slot = torch.argsort(keys, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=keys.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=keys.device)
    offsets[1:] = torch.cumsum(counts[:num_experts], 0)
    slot_row = torch.empty_like(row_slot).scatter_(0, row_slot, torch.arange(n, device=keys.device))
    return MoEPermutation(row_slot.to(torch.int32), slot_row.to(torch.int32), offsets.to(torch.int32))
