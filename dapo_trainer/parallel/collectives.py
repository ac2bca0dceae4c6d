"""Autograd collectives of tensor (Megatron) and sequence (DeepSpeed-Ulysses) parallelism: a leaf module.

It imports nothing of ``dapo_trainer``; the parallel modules of :mod:`~dapo_trainer.parallel.tensor`
and :mod:`~dapo_trainer.parallel.sequence` call these, and the rollout samplers too.
"""
from __future__ import annotations

from typing import Tuple

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


# --------------------------------------------------------------------------- Ulysses
def sequence_shards(total: int, group) -> Tuple[Tuple[int, ...], int]:
    """How ``total`` packed tokens split over the ranks of ``group``: ``(tokens per rank, this
    rank's first token)``. Contiguous and as even as integers allow (the later ranks take the
    remainder), so no padding token is ever computed; sequences may cross shard boundaries.
    """
    n, r = dist.get_world_size(group), dist.get_rank(group)
    cuts = [total * q // n for q in range(n + 1)]
    return tuple(cuts[q + 1] - cuts[q] for q in range(n)), cuts[r]


def _all_to_all(x: torch.Tensor, group, shards, to_heads: bool) -> torch.Tensor:
    """One ``all_to_all_single``. ``to_heads``: ``[shards[r], H, D]`` (this rank's tokens, all
    heads) -> ``[sum(shards), H / n, D]`` (every token, heads block r); else the inverse."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    if to_heads:
        t, h, d = x.shape
        # Rank j's block (heads j*h/n ..) first: the buffer is split along dim 0 in rank order.
        send = x.view(t, n, h // n, d).transpose(0, 1).reshape(n * t, h // n, d)
        out = x.new_empty(sum(shards), h // n, d)
        dist.all_to_all_single(out, send, list(shards), [t] * n, group=group)
        return out
    h, d, t = x.shape[1], x.shape[2], shards[r]
    out = x.new_empty(n * t, h, d)
    dist.all_to_all_single(out, x, [t] * n, list(shards), group=group)
    return out.view(n, t, h, d).transpose(0, 1).reshape(t, n * h, d)


class _Exchange(torch.autograd.Function):
    """An all-to-all whose backward is the opposite exchange: ``exchange(x, *there)`` forward,
    ``exchange(grad, *back)`` backward (Ulysses' sequence <-> head shards, expert parallelism's rows)."""

    @staticmethod
    def forward(ctx, x, exchange, there, back):
        ctx.exchange, ctx.back = exchange, back
        return exchange(x, *there)

    @staticmethod
    def backward(ctx, grad):
        return ctx.exchange(grad, *ctx.back), None, None, None


def seq_to_heads(x: torch.Tensor, group, shards) -> torch.Tensor:
    """``[shards[r], H, D]`` -> ``[sum(shards), H / n, D]``: every token of this rank's heads.

    Rank r gets heads ``r*H/n .. (r+1)*H/n - 1``. With fewer heads than ranks (GQA's KV heads,
    ``n % H == 0``) each head is repeated ``n / H`` times first, so rank r gets head ``r*H // n``:
    the one its query heads read. The repeat's backward sums the copies' gradients.
    """
    n = dist.get_world_size(group)
    if x.shape[1] < n:
        x = x.repeat_interleave(n // x.shape[1], dim=1)
    shards = tuple(shards)
    return _Exchange.apply(x, _all_to_all, (group, shards, True), (group, shards, False))


def heads_to_seq(x: torch.Tensor, group, shards) -> torch.Tensor:
    """``[sum(shards), h, D]`` (this rank's heads) -> ``[shards[r], n*h, D]`` (its tokens, all heads)."""
    shards = tuple(shards)
    return _Exchange.apply(x, _all_to_all, (group, shards, False), (group, shards, True))


# --------------------------------------------------------------------------- expert parallelism
def exchange_rows(x: torch.Tensor, group, out_splits, in_splits) -> torch.Tensor:
    """One ``all_to_all_single`` of rows: ``in_splits[j]`` rows of ``x`` (in rank order) go to rank j,
    ``out_splits[j]`` rows come from it; not differentiable (ids, counts)."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)
    return out


def all_to_all_rows(x: torch.Tensor, group, out_splits, in_splits) -> torch.Tensor:
    """Differentiable :func:`exchange_rows` (the expert-parallel token dispatch and its return): the
    backward sends each row's gradient back where the row came from."""
    out_splits, in_splits = tuple(out_splits), tuple(in_splits)
    return _Exchange.apply(x, exchange_rows, (group, out_splits, in_splits), (group, in_splits, out_splits))


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    return _ScaleGrad.apply(x, scale)
