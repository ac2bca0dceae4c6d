"""Expert parallelism (EP) applied to a built :class:`~dapo_trainer.model.Transformer`: each sparse MoE
layer's experts split over the ranks of an EP group, tokens sent to their experts by all-to-all.

``apply_expert_parallel(model, ep_group)`` replaces every sparse block's ``experts`` in place by
:class:`ExpertParallelExperts`: rank r of ``n`` keeps experts ``[r*E/n, (r+1)*E/n)`` (rows of
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``; the parameter names stay, so a gathered state
dict is the one-process one). The router (``gate``) stays replicated. One sparse layer's forward:

1. route locally (the block's ``dk.moe_route``, router replay included);
2. sort this rank's ``T*k`` (token, choice) rows by the rank owning their expert, exchange the counts
   (one all-to-all of ``n`` ints, read on the host: they size the next exchange), then all-to-all the
   rows' hidden states and local expert ids;
3. run the local experts on the received rows (``dk.moe_experts``, weight 1 per row);
4. all-to-all the outputs back and sum each token's choices with its routing weights.

The row exchanges are autograd functions whose backward is the reverse exchange. Here the EP group is
the whole gradient (data-parallel) group, as verl / Megatron lay EP inside DP with EP = DP: every
rank's tokens reach an expert's single owner, so its gradient is complete there and is not all-reduced
(DDP and FSDP2 are told to ignore the shards: :func:`expert_parameters`); since DDP / FSDP2 average the
other gradients over the group, each rank's loss carries a factor of the group size, which the shards'
gradients take off in their backward (:func:`~.collectives.scale_grad`). A rank holding an expert that
received no token gets its zero gradient, as in one process.
"""
from __future__ import annotations

from typing import Dict, Set

import torch
import torch.distributed as dist
from torch import nn

import dapo_kernels as dk

from ..model import MoEExperts, Transformer
from .collectives import all_to_all_rows, collective_device, exchange_rows, scale_grad

EP_KEY = "actor_rollout_ref.actor.megatron.expert_model_parallel_size"
# The expert weights' names inside a sparse block's ``experts``; both sharded along dim 0 (experts).
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


class ExpertParallelExperts(nn.Module):
    """This rank's ``E / n`` experts of one sparse layer, called as :class:`MoEExperts` is:
    ``(x [T, H], topk_weights [T, k], topk_ids [T, k] global ids) -> [T, H]`` (collective over ``group``)."""

    def __init__(self, experts: MoEExperts, group):
        super().__init__()
        self.group = group
        n, r = dist.get_world_size(group), dist.get_rank(group)
        self.num_experts = experts.gate_up_proj.shape[0]
        self.local = self.num_experts // n
        for name in EXPERT_WEIGHTS:
            full = getattr(experts, name)
            setattr(self, name, nn.Parameter(full.detach()[r * self.local:(r + 1) * self.local].clone(),
                                             requires_grad=full.requires_grad))

    def forward(self, x, topk_weights, topk_ids):
        n, (T, k), H = dist.get_world_size(self.group), topk_ids.shape, x.shape[1]
        flat = topk_ids.reshape(-1).long()
        valid = (flat >= 0) & (flat < self.num_experts)  # an id outside [0, E) selects no expert (dk's rule)
        owner = torch.where(valid, torch.div(flat, self.local, rounding_mode="floor"), n)
        order = torch.argsort(owner, stable=True)  # rows grouped by owner rank, rank order; invalid last
        send = torch.bincount(owner, minlength=n + 1)[:n]
        recv = exchange_rows(send.to(collective_device(self.group)), self.group, [1] * n, [1] * n)
        in_splits, out_splits = send.tolist(), recv.tolist()  # the host read that sizes the exchanges
        sent = order[:sum(in_splits)]
        local_ids = (flat[sent] - owner[sent] * self.local).view(-1, 1)
        rows = all_to_all_rows(x.index_select(0, sent // k), self.group, out_splits, in_splits)
        ids = exchange_rows(local_ids, self.group, out_splits, in_splits)
        scale = 1.0 / n  # each rank's loss carries the group size (DDP / FSDP2 average the other grads)
        # In the compute dtype: FSDP2's param_dtype does not cast the shards it leaves out (its master copies).
        gate_up, down = (scale_grad(w, scale).to(x.dtype) for w in (self.gate_up_proj, self.down_proj))
        y = dk.moe_experts(rows, gate_up, down, rows.new_ones(rows.shape[0], 1), ids)
        back = all_to_all_rows(y, self.group, in_splits, out_splits)
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32  # as dk.moe_experts sums
        per_choice = x.new_zeros(T * k, H).index_copy(0, sent, back).to(acc).view(T, k, H)
        return (per_choice * topk_weights.to(acc).unsqueeze(-1)).sum(1).to(x.dtype)


def expert_parallel_group(model: nn.Module):
    """The group ``model``'s experts are split over by :func:`apply_expert_parallel`; None if not."""
    return next((m.group for m in model.modules() if isinstance(m, ExpertParallelExperts)), None)


def expert_shard_names(model: nn.Module) -> Set[str]:
    """Names of ``model``'s parameters that hold this rank's experts (sharded along dim 0 over
    :func:`expert_parallel_group`); empty without expert parallelism."""
    return {f"{mod_name}.{w}" for mod_name, mod in model.named_modules()
            if isinstance(mod, ExpertParallelExperts) for w in EXPERT_WEIGHTS}


def expert_parameters(model: nn.Module) -> Dict[str, nn.Parameter]:
    """{name: parameter} of the expert shards: their gradients must not be reduced over the data-parallel
    ranks (module doc), so DDP and FSDP2 leave them out."""
    names = expert_shard_names(model)
    return {n: p for n, p in model.named_parameters() if n in names}


def unshard_experts(t: torch.Tensor, group) -> torch.Tensor:
    """The full ``[E, ...]`` tensor of an expert shard (or its gradient) gathered over ``group`` (collective)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def apply_expert_parallel(model: Transformer, ep_group) -> Transformer:
    """Split ``model``'s experts over ``ep_group`` in place (module doc); returns it. Every rank must
    hold the same full weights. ValueError naming :data:`EP_KEY` for a dense model or when the group
    size does not divide the experts."""
    if not isinstance(model, Transformer):
        raise TypeError(f"model must be a dapo_trainer Transformer, got {type(model).__name__}")
    if not dist.is_initialized():
        raise ValueError("ep_group: torch.distributed is not initialised")
    if expert_parallel_group(model) is not None:
        raise ValueError("model is already expert parallel")
    ep, cfg = dist.get_world_size(ep_group), model.config
    blocks = model.sparse_blocks()
    if not blocks:
        raise ValueError(f"{EP_KEY}={ep}: model_type {cfg.model_type!r} is dense (no sparse MoE layer); expert "
                         "parallelism needs a mixture-of-experts model: set it to 1")
    if cfg.num_experts % ep:
        raise ValueError(f"{EP_KEY}={ep} must divide the number of experts num_experts={cfg.num_experts} "
                         f"(model_type {cfg.model_type!r})")
    for block in blocks:
        block.experts = ExpertParallelExperts(block.experts, ep_group)
    return model

