"""Megatron's autograd collectives for tensor parallelism: a leaf module.

It imports nothing of ``dapo_trainer``, so the model can call these while
:mod:`dapo_trainer.parallel.tensor` (which imports the model) applies the sharding:
``parallel/`` imports the model, never the reverse.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# The collective backend of each device type; :func:`collective_device` reads it backwards.
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def collective_device(group=None) -> torch.device:
    """The device whose tensors ``group``'s backend takes: this process's current CUDA device
    for nccl, its NPU for hccl, the CPU for gloo.

    Every tensor handed to a collective must live there (NCCL rejects CPU tensors), so
    tensors built on the host for a reduction go through ``.to(collective_device(group))``.
    """
    backend = str(dist.get_backend(group)).lower()
    for dev_type, name in BACKENDS.items():
        if name == backend:
            if dev_type == "cpu":
                return torch.device("cpu")
            return torch.device(dev_type, getattr(torch, dev_type).current_device())
    raise ValueError(f"group: no device known for the collective backend {backend!r} "
                     f"(known: {sorted(BACKENDS.values())})")


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce backward: the replicated input of a column-parallel op."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward: partial sums of a row-parallel op.

    The backward is the identity (not another all-reduce, as in
    ``torch.distributed.nn.all_reduce``) because what follows is replicated: every
    rank already holds the full gradient of the sum.
    """

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward, keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(n, dim=-1)[r].contiguous(), None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherFromTP.apply(x, group)
