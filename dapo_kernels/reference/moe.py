"""Reference for the MoE ops: transformers' Qwen3-MoE block written as plainly as possible.

Routing as ``Qwen3MoeTopKRouter`` (softmax in float32, top-k, optional renormalisation), the experts
as ``Qwen3MoeExperts`` (a Python loop over experts, SwiGLU MLP, weighted sum over the k choices),
the auxiliary loss as ``load_balancing_loss_func`` for one layer. Everything is differentiable; with
the default float64 it is the accuracy reference, with the inputs' own dtype it is "plain torch in
that dtype", whose error sets the tests' tolerance.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def moe_route_ref(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool = True,
                  compute_dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights [T, k] in router_logits' dtype, topk_ids [T, k] int64)``: softmax over
    experts in ``compute_dtype`` (transformers: float32), the ``top_k`` largest, divided by their sum
    if ``norm_topk_prob``, cast back to the logits' dtype."""
    probs = torch.softmax(router_logits.to(compute_dtype), dim=-1)
    top, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(router_logits.dtype), ids


def moe_experts_ref(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``out [T, H]`` in ``compute_dtype``: for each token ``t`` and choice ``j`` with expert
    ``e = topk_ids[t, j]`` in ``[0, E)``, ``topk_weights[t, j] * down_proj[e] @ (silu(g) * u)`` with
    ``g, u = (gate_up_proj[e] @ hidden_states[t]).chunk(2)``; ids outside ``[0, E)`` add nothing.
    One expert at a time, as transformers' ``Qwen3MoeExperts.forward``."""
    x = hidden_states.to(compute_dtype)
    w = topk_weights.to(compute_dtype)
    out = x.new_zeros(x.shape)
    for e in range(gate_up_proj.shape[0]):
        tok, pos = torch.where(topk_ids == e)
        if tok.numel() == 0:
            continue
        gate, up = F.linear(x[tok], gate_up_proj[e].to(compute_dtype)).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down_proj[e].to(compute_dtype))
        out = out.index_add(0, tok, y * w[tok, pos, None])
    return out


def moe_load_balancing_loss_ref(router_logits: torch.Tensor, top_k: int,
                                attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func((router_logits,), E, top_k, attention_mask)`` for one
    layer, in float64: ``E * sum_{j, e} f[j, e] * P[e]`` with ``f[j, e]`` the share of (unmasked)
    tokens whose j-th choice is ``e`` and ``P[e]`` their mean router probability."""
    E = router_logits.shape[-1]
    probs = torch.softmax(router_logits.double(), dim=-1)
    _, ids = torch.topk(probs, top_k, dim=-1)
    hit = F.one_hot(ids, E).double()  # [T, k, E]
    m = (torch.ones(router_logits.shape[0], dtype=torch.float64) if attention_mask is None
         else attention_mask.reshape(-1).double())
    tokens_per_expert = (hit * m[:, None, None]).sum(0) / m.sum()
    prob_per_expert = (probs * m[:, None]).sum(0) / m.sum()
    return (tokens_per_expert * prob_per_expert[None]).sum() * E


def moe_tokens_per_expert_ref(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 ``[E]``: how many (token, choice) pairs picked each expert."""
    return torch.tensor([int((topk_ids == e).sum()) for e in range(num_experts)], dtype=torch.int64)
