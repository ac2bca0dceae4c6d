"""Mixture-of-experts routing in the policy update: the router's auxiliary loss and load metrics.

Each training forward of an MoE model is traced (:meth:`~dapo_trainer.model.Transformer.trace_routing`);
:class:`RouterLoad` turns one micro-batch's :class:`~dapo_trainer.model.RouterTrace` records into
its load-balancing loss (``dk.moe_load_balancing_loss`` over all its sparse layers' logits at once,
as transformers' ``load_balancing_loss_func`` concatenates them) and adds the tokens each expert
received to device sums; :meth:`RouterLoad.metrics` reads them once per update and names them:

* ``actor/moe_aux_loss``: the load-balancing loss (``num_experts_per_tok`` when balanced, at most
  ``num_experts``), token-weighted over the update's
  micro-batches -- logged whether or not ``actor.router_aux_loss_coef`` adds it to the loss;
* ``actor/moe_load_max`` / ``actor/moe_load_min``: over the sparse layers, the busiest / idlest
  expert's tokens divided by the layer's mean per expert (1 / 1 when balanced);
* ``actor/moe_idle_experts``: the share of (layer, expert) pairs that received no token.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

import dapo_kernels as dk

from .model import RouterTrace


class RouterLoad:
    """The update's routing sums on the device (no host read until :meth:`metrics`)."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, device: torch.device):
        self.num_experts, self.top_k = num_experts, top_k
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)  # tokens per expert
        self.aux_sum = torch.zeros((), dtype=torch.float64, device=device)  # aux loss x tokens, summed
        self.tokens = torch.zeros((), dtype=torch.float64, device=device)  # tokens routed, summed

    def add(self, traces: List[RouterTrace]) -> torch.Tensor:
        """Count one micro-batch's routing (its forward's traces, one per sparse layer held) and return
        its load-balancing loss (float32 scalar in the router's graph)."""
        if len(traces) != self.counts.shape[0]:
            raise ValueError(f"expected one router trace per sparse layer ({self.counts.shape[0]}), got "
                             f"{len(traces)}: one forward per trace_routing block")
        self.counts += torch.stack([dk.moe_tokens_per_expert(t.topk_ids, self.num_experts) for t in traces]).double()
        aux = dk.moe_load_balancing_loss(torch.cat([t.logits for t in traces]), self.top_k)
        T = traces[0].logits.shape[0]
        self.aux_sum += aux.detach().double() * T
        self.tokens += T
        return aux

    def metrics(self, group=None, comm_device: Optional[torch.device] = None) -> Dict[str, float]:
        """The ``actor/moe_*`` metrics (module doc), the sums first added over ``group`` (the gradient
        ranks: each routed its own tokens); one host read."""
        vec = torch.cat([self.counts.reshape(-1), torch.stack([self.aux_sum, self.tokens])])
        if group is not None and dist.get_world_size(group) > 1:
            vec = vec.to(comm_device or vec.device)
            dist.all_reduce(vec, group=group)
        counts, aux_sum, tokens = vec[:-2].view_as(self.counts), vec[-2], vec[-1]
        share = counts / counts.mean(1, keepdim=True).clamp_min(1e-12)  # per layer: 1 = the mean expert
        aux, high, low, idle = torch.stack([aux_sum / tokens.clamp_min(1.0), share.max(), share.min(),
                                            (counts == 0).double().mean()]).tolist()
        return {"actor/moe_aux_loss": aux, "actor/moe_load_max": high, "actor/moe_load_min": low,
                "actor/moe_idle_experts": idle}
