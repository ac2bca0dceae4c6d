"""The run's parallel layout: sizes, process groups and mesh of DP x SP x TP ranks.

``ParallelDims.build`` reads the sizes from the config and the world from ``torch.distributed``;
``parallelize_model`` applies the layout to a built model (the model itself knows no parallelism).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass
class ParallelDims:
    """``world = dp * sp * tp``; groups are None in a single process.

    ``grad_group`` / ``grad_mesh``: the ranks gradients are reduced over, DP x SP (under SP every
    rank holds the gradient of its own token shard's loss; config validation keeps TP = 1 then).
    ``comm_device``: where tensors handed to a collective live (NCCL takes CUDA tensors only).
    """

    world: int
    rank: int
    dp: int
    sp: int
    tp: int
    comm_device: torch.device
    tp_group: Any = None
    sp_group: Any = None
    dp_group: Any = None
    dp_mesh: Any = None
    grad_group: Any = None
    grad_mesh: Any = None

    @property
    def grad_ranks(self) -> int:
        return self.dp * self.sp

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica (a TP x SP group samples and trains as one)."""
        return dist.get_rank(self.dp_group) if self.dp > 1 else 0

    @property
    def loss_tp_group(self) -> Optional[Any]:
        """The group the vocabulary is sharded over in the loss (None without TP)."""
        return self.tp_group if self.tp > 1 else None

    @classmethod
    def build(cls, actor_cfg, rollout_n: int, device: torch.device) -> "ParallelDims":
        """Sizes from ``actor_rollout_ref.actor`` (TP, Ulysses SP), DP the rest of the world."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        tp, sp = actor_cfg.tensor_model_parallel_size, actor_cfg.ulysses_sequence_parallel_size
        if world % (tp * sp):
            raise ValueError(f"actor_rollout_ref.actor.tensor_model_parallel_size={tp} times "
                             f"ulysses_sequence_parallel_size={sp} must divide the number of processes {world}")
        dp = world // (tp * sp)
        rows = actor_cfg.ppo_mini_batch_size * rollout_n
        if rows < dp:
            # A DP rank without a row would run no backward, and the others would wait in the
            # gradient all-reduce forever.
            raise ValueError(
                f"actor_rollout_ref.actor.ppo_mini_batch_size ({actor_cfg.ppo_mini_batch_size}) x "
                f"actor_rollout_ref.rollout.n ({rollout_n}) = {rows} rows per mini-batch, fewer than "
                f"the {dp} data-parallel ranks ({world} processes / "
                f"actor_rollout_ref.actor.tensor_model_parallel_size {tp} / ulysses_sequence_parallel_size "
                f"{sp}): every rank needs at least one row; raise the mini-batch size or n, or run fewer "
                "processes")
        dims = cls(world=world, rank=rank, dp=dp, sp=sp, tp=tp, comm_device=device)
        if world > 1:
            from .collectives import collective_device
            from .dist import make_mesh

            mesh = make_mesh(device, tp=tp, sp=sp)
            dims.tp_group, dims.dp_mesh = mesh["tp"].get_group(), mesh["dp"]
            dims.dp_group = dims.dp_mesh.get_group()
            dims.grad_group, dims.grad_mesh = dims.dp_group, dims.dp_mesh
            if sp > 1:
                dims.sp_group = mesh["sp"].get_group()
                dims.grad_group = dims.grad_mesh = dist.group.WORLD
            dims.comm_device = collective_device(dims.dp_group)
        return dims


def parallelize_model(model, dims: ParallelDims, *, fsdp: bool):
    """Apply ``dims`` to ``model`` in place: TP shards, Ulysses SP, then FSDP2 over the gradient
    ranks when ``fsdp`` (a trainable model under ``actor.strategy=fsdp2``); returns it."""
    if dims.tp > 1:
        from .tensor import parallelize

        parallelize(model, dims.tp_group)
    if dims.sp > 1:
        from .sequence import apply_sequence_parallel

        apply_sequence_parallel(model, dims.sp_group)
    if fsdp and dims.grad_ranks > 1:
        from .data import apply_fsdp

        apply_fsdp(model, dims.grad_mesh)
    return model
