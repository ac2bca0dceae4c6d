"""The custom ops ``dapo::moe_experts_fwd`` / ``_bwd``: dispatch to the device's backend, fake (meta)
kernels and autograd. Inputs arrive validated and contiguous (the public functions), with the
:class:`~.permutation.MoEPermutation` of the ids passed as its three tensors."""
from __future__ import annotations

from typing import Tuple

import torch

from ..._registry import current_backend, dispatch, use_backend
from . import launch, torch_path  # noqa: F401  (register the triton and torch backends)


@torch.library.custom_op("dapo::moe_experts_fwd", mutates_args=())
def _moe_experts_fwd(
    x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor,
    row_slot: torch.Tensor, slot_row: torch.Tensor, expert_offsets: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H], gate_up_out [T*k, 2I])``: the experts' SwiGLU MLPs summed over each token's k
    choices with their weights; ``gate_up_out`` (rows in expert-contiguous order, in ``x``'s dtype,
    rows without a valid expert 0) is saved for the backward."""
    return dispatch("moe_experts_fwd", x.device)(x, gate_up_proj, down_proj, topk_weights, row_slot, slot_row,
                                                 expert_offsets)


@_moe_experts_fwd.register_fake
def _(x, gate_up_proj, down_proj, topk_weights, row_slot, slot_row, expert_offsets):
    return torch.empty_like(x), x.new_empty((row_slot.shape[0], gate_up_proj.shape[1]))


@torch.library.custom_op("dapo::moe_experts_bwd", mutates_args=())
def _moe_experts_bwd(
    dout: torch.Tensor, x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
    topk_weights: torch.Tensor, gate_up_out: torch.Tensor, row_slot: torch.Tensor, slot_row: torch.Tensor,
    expert_offsets: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, d_gate_up_proj, d_down_proj, d_topk_weights)``, each in its input's dtype; an expert that
    received no token gets zero weight gradients, a choice without a valid expert a zero weight gradient."""
    return dispatch("moe_experts_bwd", x.device)(dout, x, gate_up_proj, down_proj, topk_weights, gate_up_out,
                                                 row_slot, slot_row, expert_offsets)


@_moe_experts_bwd.register_fake
def _(dout, x, gate_up_proj, down_proj, topk_weights, gate_up_out, row_slot, slot_row, expert_offsets):
    return (torch.empty_like(x), torch.empty_like(gate_up_proj), torch.empty_like(down_proj),
            torch.empty_like(topk_weights))


def _fwd_setup(ctx, inputs, output):
    x, gate_up_proj, down_proj, topk_weights, row_slot, slot_row, expert_offsets = inputs
    ctx.save_for_backward(x, gate_up_proj, down_proj, topk_weights, output[1], row_slot, slot_row, expert_offsets)
    ctx.backend = current_backend(x.device)
    ctx.mark_non_differentiable(output[1])


def _fwd_backward(ctx, dout, _dgu):
    x, gate_up_proj, down_proj, topk_weights, gu, row_slot, slot_row, expert_offsets = ctx.saved_tensors
    with use_backend(ctx.backend):
        dx, dgu, ddown, dw = _moe_experts_bwd(dout.contiguous(), x, gate_up_proj, down_proj, topk_weights, gu,
                                              row_slot, slot_row, expert_offsets)
    return dx, dgu, ddown, dw, None, None, None


_moe_experts_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)
