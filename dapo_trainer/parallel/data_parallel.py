"""Data parallelism: FSDP2 (``fully_shard``) or DDP, and sequence balancing across ranks and micro-batches.

Both wrappers average gradients over the data-parallel group. A loss that should be
a mean over all tokens of the global batch is therefore written per rank as
``local_sum * global_mean_scale(local_count, group)``.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

import dapo_kernels as dk

from ..model import Transformer
from .collectives import collective_device
from .expert import expert_parameters


def _as_mesh(mesh_or_group, device_type: str):
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh_or_group, DeviceMesh):
        return mesh_or_group
    return DeviceMesh.from_group(mesh_or_group, device_type)


def apply_fsdp(
    model: Transformer,
    dp_mesh,
    *,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = torch.float32,
    reshard_after_forward: bool = True,
) -> Transformer:
    """Shard ``model`` with FSDP2, one unit per decoder layer plus the root; returns it.

    Args:
        dp_mesh: 1-D ``DeviceMesh`` (or a ProcessGroup) of the data-parallel ranks.
        param_dtype: compute dtype (``torch.bfloat16`` for bf16 training over fp32
            master weights); None keeps the parameters' dtype.
        reduce_dtype: dtype of the gradient reduce-scatter.
        reshard_after_forward: free each layer's gathered weights after its forward
            (ZeRO-3) instead of keeping them for backward (ZeRO-2).

    The root unit (embeddings, final norm, lm_head) stays unsharded from forward to
    backward: :meth:`Transformer.log_probs` reads ``lm_head.weight`` after ``forward``
    returns, and needs the gathered weight, not this rank's shard. Expert-parallel shards
    (:func:`~.expert.expert_parameters`) are left out: each rank owns its own.
    """
    # Public since torch 2.6; the _composable path is kept for older builds only.
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # pragma: no cover
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

    device_type = next(model.parameters()).device.type
    mesh = _as_mesh(dp_mesh, device_type)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    ignored = set(expert_parameters(model).values()) or None
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    ignored_params=ignored)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored)
    return model


def apply_ddp(model: Transformer, dp_group=None, **ddp_kwargs) -> nn.Module:
    """Wrap ``model`` in ``DistributedDataParallel`` over ``dp_group``.

    Call ``forward`` through the wrapper and ``log_probs`` on ``wrapper.module``. Expert-parallel
    shards (:func:`~.expert.expert_parameters`) are not all-reduced: each rank owns its own.
    """
    from torch.nn.parallel import DistributedDataParallel

    ignored = list(expert_parameters(model))
    if ignored:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    device = next(model.parameters()).device
    ids = None if device.type == "cpu" else [device]
    return DistributedDataParallel(model, device_ids=ids, process_group=dp_group, **ddp_kwargs)


def global_mean_scale(local_count, group=None) -> float:
    """``world_size / global_count``: turns a per-rank sum into its share of the global mean.

    ``local_count`` (int or scalar tensor) is summed over ``group`` (one all-reduce);
    the factor undoes the averaging FSDP / DDP apply to gradients.
    """
    t = torch.as_tensor(local_count, dtype=torch.float64).reshape(1).to(collective_device(group))
    dist.all_reduce(t, group=group)
    total = t.item()
    if total <= 0:
        raise ValueError(f"local_count: the global count over the group is {total}; nothing to average")
    return dist.get_world_size(group) / total


def balanced_dp_split(seqlens: Sequence[int], group=None, *, hidden_size: Optional[int] = None) -> List[int]:
    """Indices of the sequences this data-parallel rank trains on.

    Partitions the batch over the ranks of ``group`` with ``dk.balanced_partitions``, by
    attention workload (``dk.attention_workload``) when ``hidden_size`` is given, else
    by token count. Every rank computes the same partition from the same ``seqlens``.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    workloads = seqlens if hidden_size is None else dk.attention_workload(seqlens, hidden_size)
    return list(dk.balanced_partitions(workloads, world)[rank])


def sp_micro_batches(seqlens: Sequence[int], max_token_len: int, *, hidden_size: int, sp: int = 1,
                     min_num_micro_batches: int = 1) -> List[List[int]]:
    """Token-capped micro-batches of one data-parallel rank's sequences, for an SP group of ``sp`` ranks.

    ``max_token_len`` is per rank (``ppo_max_token_len_per_gpu``): the ``sp`` ranks of a group
    compute a micro-batch together, each ``1/sp`` of its tokens, so ``dk.micro_batches`` gets
    the cap ``max_token_len * sp``, and a sequence may be up to that long. Micro-batches are
    balanced by attention workload (``dk.attention_workload``: its ``L*L`` term follows whole
    sequences), so each one costs the group about the same. Inside a micro-batch the ranks'
    work is equal by construction: contiguous token shards of equal size, and attention for
    ``1/sp`` of the heads over every token.
    """
    workloads = dk.attention_workload(seqlens, hidden_size)
    return dk.micro_batches(seqlens, max_token_len * sp, workloads=workloads,
                            min_num_micro_batches=min_num_micro_batches)
