"""The ``torch`` (CPU) path of ``moe_experts``: every expert in one batched matmul over a padded layout.

Expert ``e``'s rows go to slots ``e * C : e * C + count[e]`` of an ``[E, C, *]`` buffer, ``C`` the
largest count (read to the host: this is the CPU path, where a read costs nothing), and each of the
forward's two matmuls and the backward's five is one ``torch.bmm`` over all experts: no Python loop
over experts, no per-expert read (transformers' loop makes one per expert). Padding rows are zero and
are zeroed again after every matmul, so a non-finite weight of an expert reaches only that expert's
real rows. The backward recomputes the experts' outputs for the routing weights' gradient (its fifth
matmul; no ``[T*k, H]`` tensor kept from the forward). 16-bit inputs compute in float32 (rounded once
on the way out; the saved ``gate_up_out`` in the inputs' dtype, as the Triton path saves it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..._alloc import empty_output
from ..._cache import per_tensor_cache
from ..._registry import register


@per_tensor_cache  # forward and backward of one call share it
def _layout(expert_offsets: torch.Tensor):
    """``(C, nv, pad_of_row [nv], valid_pad [E*C] bool)``: the padded slot of each row with a valid
    expert (rows ``0:nv``), and which padded slots hold a row."""
    off = expert_offsets.long()
    E = off.numel() - 1
    counts = off[1:] - off[:-1]
    C, nv = torch.stack([counts.max(), off[-1]]).tolist()  # one read (free on the CPU)
    r = torch.arange(nv, device=off.device)
    e = torch.searchsorted(off[1:], r, right=True)
    pad = e * C + (r - off[e])
    valid_pad = torch.zeros(E * C, dtype=torch.bool, device=off.device)
    valid_pad[pad] = True
    return C, nv, pad, valid_pad


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _pad_rows(src: torch.Tensor, pad: torch.Tensor, E: int, C: int, dtype: torch.dtype) -> torch.Tensor:
    """``[E, C, F]`` zeros with ``src``'s rows at ``pad``."""
    out = torch.zeros(E * C, src.shape[-1], dtype=dtype, device=src.device)
    out[pad] = src.to(dtype)
    return out.view(E, C, -1)


def _slot_gather(rows_pad: torch.Tensor, slot_row: torch.Tensor, pad: torch.Tensor, nv: int):
    """``(values [T*k, F], valid [T*k] bool)``: each slot's row of the padded ``[E*C, F]`` tensor; slots
    without a valid expert read row 0 and are marked invalid."""
    sr = slot_row.long()
    valid = sr < nv
    if pad.numel() == 0:
        return rows_pad.new_zeros(sr.numel(), rows_pad.shape[-1]), valid
    idx = pad[sr.clamp(max=max(nv - 1, 0))]
    return rows_pad[idx], valid


def _expert_rows(T: int, k: int, row_slot: torch.Tensor, nv: int) -> torch.Tensor:
    """int64 token of each valid row."""
    return row_slot[:nv].long() // k


@register("moe_experts_fwd", "torch")
def fwd_torch(x, gate_up, down, topk_weights, row_slot, slot_row, expert_offsets):
    T, H = x.shape
    E, I2, _ = gate_up.shape
    k = topk_weights.shape[1]
    cdt = _compute_dtype(x.dtype)
    out = empty_output((T, H), dtype=x.dtype, device=x.device)
    gu_rows = empty_output((T * k, I2), dtype=x.dtype, device=x.device)
    C, nv, pad, valid_pad = _layout(expert_offsets)
    gu_rows[nv:] = 0
    if nv == 0:
        return out.zero_(), gu_rows
    xs = _pad_rows(x[_expert_rows(T, k, row_slot, nv)], pad, E, C, cdt)
    gu = torch.bmm(xs, gate_up.to(cdt).transpose(1, 2)).view(E * C, I2)
    gu_rows[:nv] = gu[pad]
    # The saved (rounded) gate / up are what the activation reads, as in the backward; padding rows 0.
    gu = torch.where(valid_pad[:, None], gu.to(x.dtype).to(cdt), 0.0)
    g, u = gu.view(E, C, I2).chunk(2, dim=-1)
    y = torch.bmm(F.silu(g) * u, down.to(cdt).transpose(1, 2)).view(E * C, H)
    ys, valid = _slot_gather(y, slot_row, pad, nv)
    ys = ys * topk_weights.reshape(-1, 1).to(cdt)
    out.copy_(torch.where(valid[:, None], ys, 0.0).view(T, k, H).sum(1))
    return out, gu_rows


@register("moe_experts_bwd", "torch")
def bwd_torch(dout, x, gate_up, down, topk_weights, gu_rows, row_slot, slot_row, expert_offsets):
    T, H = x.shape
    E, I2, _ = gate_up.shape
    k = topk_weights.shape[1]
    cdt = _compute_dtype(x.dtype)
    C, nv, pad, valid_pad = _layout(expert_offsets)
    if nv == 0:
        return (torch.zeros_like(x), torch.zeros_like(gate_up), torch.zeros_like(down),
                torch.zeros_like(topk_weights))
    tok = _expert_rows(T, k, row_slot, nv)
    w_pad = torch.zeros(E * C, dtype=cdt, device=x.device)
    w_pad[pad] = topk_weights.reshape(-1)[row_slot[:nv].long()].to(cdt)
    w_pad = w_pad.view(E, C, 1)
    dout_pad = _pad_rows(dout[tok], pad, E, C, cdt)
    gu = _pad_rows(gu_rows[:nv], pad, E, C, cdt)
    g, u = gu.chunk(2, dim=-1)
    keep = valid_pad.view(E, C, 1)
    # dL/da before the routing weight; padding rows zeroed (a non-finite down_proj stays in its expert).
    ga = torch.where(keep, torch.bmm(dout_pad, down.to(cdt)), 0.0)
    sig = torch.sigmoid(g)
    silu = g * sig
    act = silu * u
    # d topk_weights = dout . y with the expert output y recomputed (as torch's autograd of y * w sums
    # it), not act . ga: that sum's rounding grew to 4.5x torch's error in fp32 (tests/ops/test_moe.py).
    y = torch.bmm(act, down.to(cdt).transpose(1, 2))
    dw_pad = (y * dout_pad).sum(-1).view(E * C, 1)
    da = ga * w_pad
    dgu = torch.cat([da * u * sig * (1.0 + g * (1.0 - sig)), da * silu], dim=-1)
    d_down = torch.bmm((dout_pad * w_pad).transpose(1, 2), act)
    xs = _pad_rows(x[tok], pad, E, C, cdt)
    d_gate_up = torch.bmm(dgu.transpose(1, 2), xs)
    dxs = torch.where(keep, torch.bmm(dgu, gate_up.to(cdt)), 0.0).view(E * C, H)
    dx_slots, valid = _slot_gather(dxs, slot_row, pad, nv)
    dx = torch.where(valid[:, None], dx_slots, 0.0).view(T, k, H).sum(1)
    dw_slots, _ = _slot_gather(dw_pad, slot_row, pad, nv)
    dw = torch.where(valid[:, None], dw_slots, 0.0).view(T, k)
    return dx.to(x.dtype), d_gate_up.to(gate_up.dtype), d_down.to(down.dtype), dw.to(topk_weights.dtype)
