"""Launchers of the Triton kernels (the ``triton`` backend of ``moe_experts_fwd`` / ``_bwd``), the work
list of (expert, row-block) tiles they run over, and the tile table.

Forward: gate/up GEMM (SwiGLU's inputs, saved) -> down GEMM weighted by the routing weights -> combine
over each token's k rows. Backward: SwiGLU backward fused after ``dout @ down_proj`` -> the routing
weights' gradient as ``dout . y`` with ``y`` recomputed (a row sum in the down GEMM's epilogue, no
``[T*k, H]`` tensor) -> ``dx`` rows and their combine -> both weights' gradients per expert. Seven
launches, no host read: every size a kernel needs on the host is a shape.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton.language as tl

from ..._alloc import empty_output
from ..._cache import per_tensor_cache
from ..._registry import register
from .._triton_utils import INTERPRET, TL_DTYPES, cdiv
from .triton_kernels import (DOT_DOUT, STORE, WEIGHTED, _moe_combine_kernel, _moe_gate_up_bwd_kernel,
                             _moe_gate_up_fwd_kernel, _moe_rows_gemm_kernel, _moe_weight_grad_kernel)


class Tile(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# GPU tiles per (kernel kind, 16-bit or fp32). 16-bit: on sm_90 every tl.dot is a wgmma with N = BLOCK_N
# (>= 64): row tiles of 64 rows at 4 warps (one warpgroup, m64n128k16); the weight gradients' 128 x 128
# blocks at 8 warps (two warpgroups of m64n128k16). fp32 runs IEEE products (FMA, no tensor cores):
# smaller tiles. The interpreter runs 16 x 16 x 16 (tl.dot's minimum), so tiny tests span several blocks.
_GPU_TILES = {
    ("rows", True): Tile(64, 128, 64, 4, 3),
    ("gate_up", True): Tile(64, 128, 64, 8, 3),   # two [64, 128] accumulators: 8 warps keep them in registers
    ("wgrad", True): Tile(128, 128, 32, 8, 3),
    ("rows", False): Tile(32, 64, 32, 4, 2),
    ("gate_up", False): Tile(32, 64, 32, 4, 2),
    ("wgrad", False): Tile(64, 64, 16, 4, 2),
}
_INTERP_TILE = Tile(16, 16, 16, 1, 1)
_COMBINE = dict(BLOCK_T=16, BLOCK_H=128)


def tile(kind: str, dtype: torch.dtype) -> Tile:
    return _INTERP_TILE if INTERPRET else _GPU_TILES[kind, dtype != torch.float32]


def _meta(dtype: torch.dtype, t: Tile) -> dict:
    """DOT_T is the tl.dot operand type (fp32 in the interpreter: its 3.9 tl.dot multiplies raw bits of
    bf16 operands; exact, 16-bit products fit fp32); PREC keeps fp32 inputs IEEE."""
    return dict(DOT_T=tl.float32 if INTERPRET else TL_DTYPES[dtype], PREC="ieee" if dtype == torch.float32 else "tf32",
                INTERPRET=INTERPRET, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.num_warps,
                num_stages=t.num_stages)


@per_tensor_cache  # forward and backward of one call share it
def _work_list(expert_offsets: torch.Tensor, num_rows: int, block: int) -> torch.Tensor:
    """int32 ``[n, 2]`` (expert, row block) pairs in expert order, built on the device (no host read).

    ``n = cdiv(num_rows, block) + E`` bounds the true count (the sum of per-expert ceilings); the surplus
    entries are ``(-1, *)``, last, and their programs return at once. Pass the arguments positionally
    (the cache is keyed on them)."""
    off = expert_offsets.long()
    E = off.numel() - 1
    nblk = (off[1:] - off[:-1] + block - 1) // block
    cum = torch.cumsum(nblk, 0)
    item = torch.arange(cdiv(num_rows, block) + E, device=off.device)
    e = torch.searchsorted(cum, item, right=True).clamp_(max=E - 1)
    blk = item - (cum[e] - nblk[e])
    return torch.stack([torch.where(item < cum[-1], e, -1), blk], 1).to(torch.int32).contiguous()


@register("moe_experts_fwd", "triton")
def fwd_triton(x, gate_up, down, topk_weights, row_slot, slot_row, expert_offsets):
    """``(out, gate_up_out)``; ``gate_up_out``'s rows without a valid expert are left unwritten."""
    T, H = x.shape
    E, I2, _ = gate_up.shape
    I, k = I2 // 2, topk_weights.shape[1]
    out = empty_output((T, H), dtype=x.dtype, device=x.device)
    gu = empty_output((T * k, I2), dtype=x.dtype, device=x.device)
    if T == 0:
        return out, gu
    t_gu, t_rows = tile("gate_up", x.dtype), tile("rows", x.dtype)
    work = _work_list(expert_offsets, T * k, t_gu.block_m)
    _moe_gate_up_fwd_kernel[(work.shape[0], cdiv(I, t_gu.block_n))](
        x, gate_up, gu, expert_offsets, row_slot, work, H, I, TOPK=k, **_meta(x.dtype, t_gu))
    y = empty_output((T * k, H), dtype=x.dtype, device=x.device)
    work = _work_list(expert_offsets, T * k, t_rows.block_m)
    _moe_rows_gemm_kernel[(work.shape[0], cdiv(H, t_rows.block_n))](
        gu, down, y, x, topk_weights, expert_offsets, row_slot, work, I, H, H * I, 1, I,
        TOPK=k, A_SWIGLU=True, EPILOGUE=WEIGHTED, **_meta(x.dtype, t_rows))
    _combine(y, out, slot_row, expert_offsets, k)
    return out, gu


def _combine(rows: torch.Tensor, out: torch.Tensor, slot_row: torch.Tensor, expert_offsets: torch.Tensor, k: int):
    T, H = out.shape
    _moe_combine_kernel[(cdiv(T, _COMBINE["BLOCK_T"]), cdiv(H, _COMBINE["BLOCK_H"]))](
        rows, out, slot_row, expert_offsets[-1:], T, H, TOPK=k, INTERPRET=INTERPRET, num_warps=4, **_COMBINE)


@register("moe_experts_bwd", "triton")
def bwd_triton(dout, x, gate_up, down, topk_weights, gu, row_slot, slot_row, expert_offsets):
    T, H = x.shape
    E, I2, _ = gate_up.shape
    I, k, N = I2 // 2, topk_weights.shape[1], T * topk_weights.shape[1]
    dx = empty_output((T, H), dtype=x.dtype, device=x.device)
    d_gate_up = empty_output(gate_up.shape, dtype=gate_up.dtype, device=x.device)
    d_down = empty_output(down.shape, dtype=down.dtype, device=x.device)
    t_gu, t_rows, t_w = tile("gate_up", x.dtype), tile("rows", x.dtype), tile("wgrad", x.dtype)
    dgu = empty_output((N, I2), dtype=x.dtype, device=x.device)
    if N:
        work = _work_list(expert_offsets, N, t_gu.block_m)
        _moe_gate_up_bwd_kernel[(work.shape[0], cdiv(I, t_gu.block_n))](
            dout, down, gu, topk_weights, dgu, expert_offsets, row_slot, work, H, I, TOPK=k, **_meta(x.dtype, t_gu))
        work = _work_list(expert_offsets, N, t_rows.block_m)
        grid = (work.shape[0], cdiv(H, t_rows.block_n))
        # d topk_weights = dout . y, y = silu(g) * u @ down_proj^T recomputed: one partial sum per column block.
        part = torch.empty((N, grid[1]), dtype=torch.float32, device=x.device)
        _moe_rows_gemm_kernel[grid](gu, down, part, dout, topk_weights, expert_offsets, row_slot, work, I, H,
                                    H * I, 1, I, TOPK=k, A_SWIGLU=True, EPILOGUE=DOT_DOUT, **_meta(x.dtype, t_rows))
        dxs = empty_output((N, H), dtype=x.dtype, device=x.device)
        _moe_rows_gemm_kernel[grid](dgu, gate_up, dxs, dout, topk_weights, expert_offsets, row_slot, work, I2, H,
                                    I2 * H, H, 1, TOPK=k, A_SWIGLU=False, EPILOGUE=STORE, **_meta(x.dtype, t_rows))
        _combine(dxs, dx, slot_row, expert_offsets, k)
        sr = slot_row.long()
        dw = torch.where(sr < expert_offsets[-1], part.sum(1)[sr], 0.0).view(T, k).to(topk_weights.dtype)
    else:
        dw = torch.zeros_like(topk_weights)
    # Both weights' gradients, every expert (those without rows store zeros).
    _moe_weight_grad_kernel[(E, cdiv(H, t_w.block_m), cdiv(I, t_w.block_n))](
        dout, gu, d_down, topk_weights, expert_offsets, row_slot, H, I, H, I2, TOPK=k, A_GATHER=True, A_SCALE=True,
        B_GATHER=False, B_SWIGLU=True, **_meta(x.dtype, t_w))
    _moe_weight_grad_kernel[(E, cdiv(I2, t_w.block_m), cdiv(H, t_w.block_n))](
        dgu, x, d_gate_up, topk_weights, expert_offsets, row_slot, I2, H, I2, H, TOPK=k, A_GATHER=False,
        A_SCALE=False, B_GATHER=True, B_SWIGLU=False, **_meta(x.dtype, t_w))
    return dx, d_gate_up, d_down, dw
