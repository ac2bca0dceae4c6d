"""Mixture-of-experts layer of Qwen3-MoE / Mixtral-style models as kernels: routing, permutation,
the experts' SwiGLU MLPs as grouped GEMMs (forward and backward), and the router's auxiliary loss.

transformers runs the experts in a Python loop with a host read per expert (``Qwen3MoeExperts``);
here the (token, choice) pairs are sorted into expert-contiguous rows on the device
(:mod:`.permutation`) and every expert runs in the same kernels: no loop, no host read on the
Triton path. Conventions follow transformers' Qwen3-MoE (weights ``gate_up_proj [E, 2I, H]``, gate
first, and ``down_proj [E, H, I]``, as ``Qwen3MoeExperts`` stores them; routing as
``Qwen3MoeTopKRouter``) and vLLM (``fused_moe(hidden_states, ..., topk, renormalize)``,
``topk_weights`` / ``topk_ids``).

The package, one concern per module (imports go down this list, never up):

* this file: the public functions and their validation;
* :mod:`.op`: the custom ops ``dapo::moe_experts_fwd`` / ``_bwd`` (fake kernels, autograd);
* :mod:`.permutation`: expert-contiguous order, counts and offsets, on the device;
* :mod:`.torch_path`: the ``torch`` backend (CPU default): one padded ``bmm`` per matmul;
* :mod:`.launch`: the ``triton`` backend (CUDA default): launchers over a work list of (expert,
  row-block) tiles built on the device, and the tile table;
* :mod:`.triton_kernels`: the grouped-GEMM kernels (SwiGLU fused in the gate/up GEMM's epilogue,
  forward and backward) and the combine over the k choices.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..._validation import check_flag, check_int, check_mask, check_tensor
from .op import _moe_experts_fwd
from .permutation import MoEPermutation, build_permutation, tokens_per_expert

__all__ = ["moe_route", "moe_experts", "fused_moe", "moe_permute", "moe_unpermute", "moe_load_balancing_loss",
           "moe_tokens_per_expert", "MoEPermutation"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ID_DTYPES = (torch.int32, torch.int64)


def _check_logits(router_logits, top_k) -> int:
    check_tensor("router_logits", router_logits, ndim=2, dtypes=_WEIGHT_DTYPES)
    E = router_logits.shape[1]
    if E < 1:
        raise ValueError(f"router_logits must have at least one expert (shape [T, E] with E >= 1), got "
                         f"{list(router_logits.shape)}")
    top_k = check_int("top_k", top_k, minimum=1)
    if top_k > E:
        raise ValueError(f"top_k must be <= the number of experts ({E}), got {top_k}")
    return top_k


def moe_route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool = True
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of transformers' ``Qwen3MoeTopKRouter``: softmax over experts in float32, the
    ``top_k`` largest probabilities, divided by their sum if ``norm_topk_prob``, cast to the logits' dtype.

    Args:
        router_logits: ``[T, E]`` float16 / bfloat16 / float32 / float64 (the router's ``F.linear``).
        top_k: experts per token, ``1 <= top_k <= E`` (``num_experts_per_tok``).
        norm_topk_prob: renormalise the chosen probabilities to sum to 1 (Qwen3-MoE: True).

    Returns:
        ``(topk_weights [T, k] in router_logits' dtype, topk_ids [T, k] int64)``, distinct experts per
        token, ordered by decreasing probability. Differentiable w.r.t. ``router_logits`` (through the
        weights). Plain torch on the device: no host read.
    """
    top_k = _check_logits(router_logits, top_k)
    norm_topk_prob = check_flag("norm_topk_prob", norm_topk_prob)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(router_logits.dtype), ids


def moe_load_balancing_loss(router_logits: torch.Tensor, top_k: int,
                            attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The router's auxiliary loss of one layer: transformers' ``load_balancing_loss_func`` given this
    layer's logits alone (Switch Transformer eqs. 4-6), ``E * sum_{j, e} f[j, e] * P[e]`` with
    ``f[j, e]`` the share of tokens whose j-th choice is expert ``e`` and ``P[e]`` their mean router
    probability (softmax in float32), over the tokens ``attention_mask`` keeps.

    Args:
        router_logits: ``[T, E]`` float.
        top_k: experts per token (``1 <= top_k <= E``).
        attention_mask: optional, ``T`` elements (``[B, S]`` with ``B * S = T`` as transformers
            takes it, or ``[T]``), bool / int / float 0-1; 1 = a real token.

    Returns:
        float32 scalar, differentiable w.r.t. ``router_logits`` (through ``P``; the counts ``f`` are
        constants, as in transformers). Scatter-adds on the device: no host read (no ``one_hot``).
        Multiply by the config's ``router_aux_loss_coef`` and average over layers as the model does.
    """
    top_k = _check_logits(router_logits, top_k)
    T, E = router_logits.shape
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    ids = torch.topk(probs, top_k, dim=-1).indices
    if attention_mask is None:
        m = probs.new_ones(T)
    else:
        mask = check_mask("attention_mask", attention_mask, device=router_logits.device)
        if mask.numel() != T:
            raise ValueError(f"attention_mask must have T = {T} elements (router_logits' rows), got shape "
                             f"{list(attention_mask.shape)}")
        m = mask.reshape(-1).float()
    hits = probs.new_zeros(E).index_add_(0, ids.reshape(-1), m[:, None].expand(T, top_k).reshape(-1))
    n = m.sum()
    return (hits / n * ((probs * m[:, None]).sum(0) / n)).sum() * E


def moe_tokens_per_expert(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The router's load: int64 ``[E]``, how many (token, choice) pairs picked each expert (ids outside
    ``[0, E)`` count nowhere). A device tensor (scatter-add, no host read): log it with the step's metrics."""
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=_ID_DTYPES)
    num_experts = check_int("num_experts", num_experts, minimum=1)
    return tokens_per_expert(topk_ids, num_experts)


def moe_permute(hidden_states: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
                ) -> Tuple[torch.Tensor, MoEPermutation]:
    """Tokens into expert-contiguous order (Megatron's ``permute``, vLLM's ``moe_permute``).

    Args:
        hidden_states: ``[T, H]`` float.
        topk_ids: ``[T, k]`` int32 / int64; an id outside ``[0, num_experts)`` selects no expert.
        num_experts: ``E``.

    Returns:
        ``(permuted [T*k, H], permutation)``: row ``r`` of ``permuted`` is token
        ``permutation.row_slot[r] // k``; expert ``e``'s rows are
        ``permutation.expert_offsets[e]:permutation.expert_offsets[e+1]`` (int32 ``[E+1]``, computed on
        the device), in token order; rows of invalid ids come last. Differentiable w.r.t.
        ``hidden_states``; no host read.
    """
    check_tensor("hidden_states", hidden_states, ndim=2, dtypes=_WEIGHT_DTYPES)
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=_ID_DTYPES, device=hidden_states.device)
    if topk_ids.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"topk_ids must have shape [T, k] with T = {hidden_states.shape[0]} (hidden_states' rows), "
                         f"got {list(topk_ids.shape)}")
    num_experts = check_int("num_experts", num_experts, minimum=1)
    perm = build_permutation(topk_ids, num_experts)
    return hidden_states.index_select(0, perm.row_slot.long() // max(topk_ids.shape[1], 1)), perm


def moe_unpermute(permuted: torch.Tensor, permutation: MoEPermutation, topk_weights: torch.Tensor) -> torch.Tensor:
    """Back to token order with the weighted sum over the k choices (unpermute + combine):
    ``out[t] = sum_j topk_weights[t, j] * permuted[permutation.slot_row[t*k + j]]``, choices without a
    valid expert left out.

    Args:
        permuted: ``[T*k, H]`` float, rows in :func:`moe_permute`'s order (e.g. the experts' outputs).
        permutation: :func:`moe_permute`'s :class:`MoEPermutation`.
        topk_weights: ``[T, k]`` float.

    Returns:
        ``[T, H]`` in ``permuted``'s dtype, summed in float32 (float64 for float64). Differentiable
        w.r.t. ``permuted`` and ``topk_weights``; no host read.
    """
    check_tensor("permuted", permuted, ndim=2, dtypes=_WEIGHT_DTYPES)
    check_tensor("topk_weights", topk_weights, ndim=2, dtypes=_WEIGHT_DTYPES, device=permuted.device)
    if not isinstance(permutation, MoEPermutation):
        raise TypeError(f"permutation must be a MoEPermutation (moe_permute's), got {type(permutation).__name__}")
    T, k = topk_weights.shape
    if permuted.shape[0] != T * k or permutation.slot_row.shape != (T * k,):
        raise ValueError(f"permuted must have T*k = {T * k} rows (topk_weights is [{T}, {k}]) and come with its "
                         f"permutation, got {permuted.shape[0]} rows and slot_row {list(permutation.slot_row.shape)}")
    acc = torch.float64 if permuted.dtype == torch.float64 else torch.float32
    valid = permutation.slot_row < permutation.expert_offsets[-1]
    rows = permuted.index_select(0, permutation.slot_row.long()).to(acc).view(T, k, -1)
    out = torch.where(valid.view(T, k, 1), rows * topk_weights.to(acc)[..., None], 0.0).sum(1)
    return out.to(permuted.dtype)


def _check_experts(hidden_states, gate_up_proj, down_proj) -> None:
    check_tensor("hidden_states", hidden_states, ndim=2, dtypes=_DTYPES)
    dev, dt = hidden_states.device, hidden_states.dtype
    H = hidden_states.shape[1]
    check_tensor("gate_up_proj", gate_up_proj, ndim=3, dtypes=(dt,), device=dev)
    E, I2, H2 = gate_up_proj.shape
    if E < 1 or I2 < 2 or I2 % 2 or H2 != H:
        raise ValueError(f"gate_up_proj must have shape [E, 2I, H] with E >= 1, I >= 1 and H = {H} (hidden_states' "
                         f"columns), got {list(gate_up_proj.shape)}")
    check_tensor("down_proj", down_proj, shape=[E, H, I2 // 2], dtypes=(dt,), device=dev)
    if H < 1:
        raise ValueError(f"hidden_states must have at least one column, got shape {list(hidden_states.shape)}")


def moe_experts(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts of a sparse MoE block (transformers' ``Qwen3MoeExperts.forward``, vLLM's
    ``fused_experts``) as grouped GEMMs over expert-contiguous rows.

    ``out[t] = sum_j topk_weights[t, j] * down_proj[e] @ (silu(g) * u)`` with ``e = topk_ids[t, j]`` and
    ``g, u = (gate_up_proj[e] @ hidden_states[t]).chunk(2)``.

    Args:
        hidden_states: ``[T, H]`` float16 / bfloat16 / float32.
        gate_up_proj: ``[E, 2I, H]``, gate rows first, same dtype and device (transformers' layout).
        down_proj: ``[E, H, I]``, same dtype and device.
        topk_weights: ``[T, k]`` float (any float dtype; Qwen3-MoE: the logits' dtype).
        topk_ids: ``[T, k]`` int32 / int64. Several tokens may pick one expert and one token may pick an
            expert several times (each choice counts); an id outside ``[0, E)`` selects no expert
            (transformers' ``num_experts`` sentinel, vLLM's -1 for a non-local expert): its choice adds
            nothing and gets a zero weight gradient. The ids are not read to the host.

    Returns:
        ``out [T, H]`` in ``hidden_states``' dtype, accumulated in float32. Differentiable w.r.t.
        ``hidden_states``, both weights and ``topk_weights``; an expert that receives no token gets zero
        weight gradients. No host read on the Triton path (the torch path reads the largest count).
    """
    _check_experts(hidden_states, gate_up_proj, down_proj)
    T = hidden_states.shape[0]
    check_tensor("topk_weights", topk_weights, ndim=2, dtypes=_WEIGHT_DTYPES, device=hidden_states.device)
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=_ID_DTYPES, device=hidden_states.device)
    if topk_weights.shape[0] != T or topk_weights.shape[1] < 1:
        raise ValueError(f"topk_weights must have shape [T, k] with T = {T} (hidden_states' rows) and k >= 1, got "
                         f"{list(topk_weights.shape)}")
    if topk_ids.shape != topk_weights.shape:
        raise ValueError(f"topk_ids must have topk_weights' shape {list(topk_weights.shape)}, got "
                         f"{list(topk_ids.shape)}")
    perm = build_permutation(topk_ids, gate_up_proj.shape[0])
    out, _ = _moe_experts_fwd(hidden_states.contiguous(), gate_up_proj.contiguous(), down_proj.contiguous(),
                              topk_weights.contiguous(), *perm)
    return out


def fused_moe(hidden_states: torch.Tensor, router_logits: torch.Tensor, gate_up_proj: torch.Tensor,
              down_proj: torch.Tensor, top_k: int, norm_topk_prob: bool = True) -> torch.Tensor:
    """A sparse MoE block after its router's linear (transformers' ``Qwen3MoeSparseMoeBlock`` given
    ``router_logits = hidden_states @ gate.weight.T``; vLLM's ``fused_moe``): :func:`moe_route` then
    :func:`moe_experts`.

    Args:
        hidden_states: ``[T, H]`` float16 / bfloat16 / float32.
        router_logits: ``[T, E]`` float (any float dtype).
        gate_up_proj: ``[E, 2I, H]``; down_proj: ``[E, H, I]`` (same dtype and device as ``hidden_states``).
        top_k: experts per token, ``1 <= top_k <= E``.
        norm_topk_prob: renormalise the chosen probabilities (Qwen3-MoE: True).

    Returns:
        ``out [T, H]`` in ``hidden_states``' dtype, differentiable w.r.t. ``hidden_states``,
        ``router_logits`` and both weights. No host read on the Triton path. The auxiliary loss is
        :func:`moe_load_balancing_loss`, the router's load :func:`moe_tokens_per_expert`.
    """
    _check_experts(hidden_states, gate_up_proj, down_proj)
    top_k = _check_logits(router_logits, top_k)
    check_tensor("router_logits", router_logits, device=hidden_states.device)
    if router_logits.shape[0] != hidden_states.shape[0] or router_logits.shape[1] != gate_up_proj.shape[0]:
        raise ValueError(f"router_logits must have shape [T, E] = [{hidden_states.shape[0]}, {gate_up_proj.shape[0]}] "
                         f"(hidden_states' rows, gate_up_proj's experts), got {list(router_logits.shape)}")
    topk_weights, topk_ids = moe_route(router_logits, top_k, norm_topk_prob)
    return moe_experts(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids)
