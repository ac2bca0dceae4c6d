"""Gradient clipping by the norm of the whole model's unsharded gradient, under any parallelism."""
from __future__ import annotations

from typing import Collection, Optional

import torch
import torch.distributed as dist
from torch import nn


def clip_grad_norm(model: nn.Module, max_norm: float, *, tp_group=None, sharded: Collection[str] = (),
                   dp_group=None, pp_group=None, exclude: Optional[nn.Parameter] = None,
                   comm_device=None, ep_group=None, ep_sharded: Collection[str] = ()) -> torch.Tensor:
    """Clip ``model``'s gradients to ``max_norm`` by the norm of the whole model's gradient; return
    the norm (a 0-dim device tensor: nothing is read on the host).

    ``tp_group``: the parameters named in ``sharded`` hold a TP shard, the others a TP replica;
    ``dp_group``: FSDP2 (DTensor) gradients' local shards are summed over it; ``pp_group``: this
    rank holds some stages, their norms summed over it; ``exclude``: a parameter clipped but left
    out of the norm (the last stage's copy of a tied embedding); ``ep_group``: the parameters named in
    ``ep_sharded`` hold this rank's experts (plain tensors, outside FSDP2), their norms summed over it.
    Without TP, PP and EP: torch's ``clip_grad_norm_``.
    """
    from torch.distributed.tensor import DTensor

    if tp_group is None and pp_group is None and ep_group is None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        # FSDP2: the norm of DTensor gradients is a (replicated) DTensor; read as a plain tensor.
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    # Squared norms of this rank's gradients: [0] of the TP-sharded parameters, [1] of the others,
    # [2] of the expert shards.
    sq = torch.zeros(3, dtype=torch.float64, device=comm_device)
    grads, fsdp = [], False
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        if isinstance(g, DTensor):
            g, fsdp = g.to_local(), True
        grads.append(g)
        if p is not exclude:
            sq[0 if name in sharded else 2 if name in ep_sharded else 1] += g.double().pow(2).sum()
    if fsdp:  # the DTensors' local shards; the expert shards are no DTensors
        dense = sq[:2].clone()
        dist.all_reduce(dense, group=dp_group)
        sq[:2] = dense
    if ep_group is not None:
        experts = sq[2:].clone()
        dist.all_reduce(experts, group=ep_group)
        sq[2] = experts[0]
    if tp_group is not None:
        shard_sq = sq[:1].clone()
        dist.all_reduce(shard_sq, group=tp_group)
        sq[0] = shard_sq[0]
    total = sq.sum().reshape(1)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    norm = total[0].sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0).float()  # as clip_grad_norm_, on the device
    for g in grads:  # local shards: scaling them scales the DTensors
        g.mul_(coef.to(g.device))
    return norm
