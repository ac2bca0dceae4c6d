"""The run's parallel layout: sizes, process groups and mesh of PP x DP x SP x TP ranks.

``ParallelDims.build`` reads the sizes from the config and the world from ``torch.distributed``;
``parallelize_model`` applies the layout to a built model (the model itself knows no parallelism).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from .collectives import collective_device
from .data_parallel import apply_fsdp
from .dist import make_mesh
from .expert import EP_KEY, apply_expert_parallel
from .pipeline import apply_pipeline
from .sequence import apply_sequence_parallel
from .tensor import parallelize


@dataclass
class ParallelDims:
    """``world = pp * dp * sp * tp``; groups are None in a single process.

    ``grad_group`` / ``grad_mesh``: the ranks gradients are reduced over, DP x SP (under SP every
    rank holds the gradient of its own token shard's loss; config validation keeps TP = 1 then).
    ``comm_device``: where tensors handed to a collective live (NCCL takes CUDA tensors only).
    ``pp`` pipeline ranks (``vpp`` model chunks each) split the layers; ``tied_group``: the first
    and the last pipeline rank of a DP x TP coordinate (a tied embedding's two copies).
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
    pp: int = 1
    vpp: int = 1
    pp_group: Any = None
    tied_group: Any = None
    ep: int = 1
    ep_group: Any = None

    @property
    def pp_rank(self) -> int:
        return dist.get_rank(self.pp_group) if self.pp > 1 else 0

    @property
    def rollout_ranks(self) -> int:
        """Ranks that sample distinct shares of a generation batch: every rank where each holds an
        unsharded replica of the model (PP, SP), else the DP replicas (a TP group samples together)."""
        return self.world if self.pp > 1 or self.sp > 1 else self.dp

    @property
    def rollout_rank(self) -> int:
        return self.rank if self.pp > 1 or self.sp > 1 else self.dp_rank

    @property
    def rollout_group(self) -> Optional[Any]:
        return dist.group.WORLD if self.pp > 1 or self.sp > 1 else self.dp_group

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
        """Sizes from ``actor_rollout_ref.actor`` (TP, Ulysses SP, PP), DP the rest of the world."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        tp, sp = actor_cfg.tensor_model_parallel_size, actor_cfg.ulysses_sequence_parallel_size
        pp, vpp = actor_cfg.pipeline_model_parallel_size, actor_cfg.virtual_pipeline_model_parallel_size or 1
        if world % (tp * sp * pp):
            raise ValueError(f"actor_rollout_ref.actor.tensor_model_parallel_size={tp} times "
                             f"ulysses_sequence_parallel_size={sp} times pipeline_model_parallel_size={pp} "
                             f"must divide the number of processes {world}")
        dp = world // (tp * sp * pp)
        rows = actor_cfg.ppo_mini_batch_size * rollout_n
        if pp > 1 and rows < dp * pp * vpp:
            raise ValueError(
                f"actor_rollout_ref.actor.ppo_mini_batch_size ({actor_cfg.ppo_mini_batch_size}) x "
                f"actor_rollout_ref.rollout.n ({rollout_n}) = {rows} rows per mini-batch, fewer than the {dp} "
                f"data-parallel ranks x {pp * vpp} pipeline stages (actor_rollout_ref.actor."
                f"pipeline_model_parallel_size {pp} x virtual_pipeline_model_parallel_size {vpp}): every stage of "
                "every replica needs a micro-batch; raise the mini-batch size or n, or run fewer processes")
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
        ep = actor_cfg.megatron.expert_model_parallel_size
        if ep > 1 and ep != dp:
            # EP groups inside DP; EP = DP only: with EP < DP each expert would have DP / EP replicas whose
            # gradients need an all-reduce of their own, not built.
            raise ValueError(f"{EP_KEY}={ep} must equal the data-parallel size {dp} ({world} processes / "
                             f"tensor x sequence x pipeline parallel sizes {tp * sp * pp}) or be 1")
        dims = cls(world=world, rank=rank, dp=dp, sp=sp, tp=tp, comm_device=device, pp=pp, vpp=vpp, ep=ep)
        if world > 1:
            mesh = make_mesh(device, tp=tp, sp=sp, pp=pp)
            if pp > 1:
                dims.pp_group = mesh["pp"].get_group()
                dims.tied_group = _tied_group(mesh.mesh, rank)
            dims.tp_group, dims.dp_mesh = mesh["tp"].get_group(), mesh["dp"]
            dims.dp_group = dims.dp_mesh.get_group()
            dims.grad_group, dims.grad_mesh = dims.dp_group, dims.dp_mesh
            if sp > 1:
                dims.sp_group = mesh["sp"].get_group()
                dims.grad_group = dims.grad_mesh = dist.group.WORLD
            dims.comm_device = collective_device(dims.dp_group)
            if ep > 1:
                dims.ep_group = dims.dp_group
        return dims


def parallelize_model(model, dims: ParallelDims, *, fsdp: bool):
    """Apply ``dims`` to ``model`` in place: expert shards (EP), TP shards, Ulysses SP, the pipeline
    split (PP), then FSDP2 over the gradient ranks when ``fsdp`` (a trainable model under
    ``actor.strategy=fsdp2``; it leaves the expert shards alone); returns it."""
    if dims.ep > 1:
        apply_expert_parallel(model, dims.ep_group)
    if dims.tp > 1:
        parallelize(model, dims.tp_group)
    if dims.sp > 1:
        apply_sequence_parallel(model, dims.sp_group)
    if dims.pp > 1:  # this rank's stages (model.pipeline_chunks), each its own FSDP2 root
        return apply_pipeline(model, dims, fsdp=fsdp)
    if fsdp and dims.grad_ranks > 1:
        apply_fsdp(model, dims.grad_mesh)
    return model


def _tied_group(ranks: torch.Tensor, rank: int):
    """The group of this rank's DP x TP coordinate's first and last pipeline rank (every rank
    creates every such group, as ``new_group`` requires); None on the middle pipeline ranks."""
    mine = None
    for col in ranks.reshape(ranks.shape[0], -1).t().tolist():
        g = dist.new_group([col[0], col[-1]])
        if rank in (col[0], col[-1]):
            mine = g
    return mine
