"""Launchers of the Triton kernels (the ``triton`` backend of ``varlen_attention_fwd`` / ``_bwd``) and
the work lists they run over."""
from __future__ import annotations

import torch
import triton.language as tl

from ..._alloc import empty_output
from ..._cache import per_tensor_cache
from ..._registry import register
from .._triton_utils import INTERPRET, TL_DTYPES, cdiv
from .lse import delta_dtype, lse_dtype
from .tiles import (_GPU_TILES, _arch_family, _atomic_dq_offered, _block_d, _dkdv_tma, _kernel_row,
                    _length_buckets, _outer_block, _tile_dim)
from .triton_fwd_tma import _varlen_attention_fwd_hopper_kernel, ensure_allocator, tma_offered
from .triton_bwd import (
    _varlen_attention_bwd_delta_kernel,
    _varlen_attention_bwd_dkdv_kernel,
    _varlen_attention_bwd_dq_kernel,
)
from .triton_kernels import _varlen_attention_fwd_kernel

_LOG2E = 1.4426950408889634
# Elements of the delta preprocess per program ([rows, D] tiles of O and dO, fp64, 8 warps): few
# enough rows that the fp64 tiles do not spill.
_DELTA_ELEMS = 4096


def _dtype_meta(dtype: torch.dtype) -> dict:
    """Constexprs every kernel takes: DOT_T is the ``tl.dot`` operand type (fp32 in the
    interpreter, whose 3.9 version multiplies raw bits of 16-bit dot operands; exact since
    16-bit products fit fp32), PREC keeps fp32 attention IEEE instead of silently TF32, and
    INTERPRET selects the bf16 rounding fix of ``_cast``."""
    return dict(DOT_T=tl.float32 if INTERPRET else TL_DTYPES[dtype],
                PREC="ieee" if dtype == torch.float32 else "tf32", INTERPRET=INTERPRET)


@per_tensor_cache  # once per batch, not per layer
def _work_list(cu_seqlens: torch.Tensor, total_tokens: int, block: int, causal: bool, per_key: bool,
               longest_first: bool = True):
    """int32 ``[n, 2]`` (sequence, block) pairs, built on the device without a host sync; with
    ``longest_first`` the most expensive first (LPT), else in (sequence, block) order. Pass every
    argument positionally: the cache is keyed on them.

    ``n = cdiv(T, block) + B`` bounds the true count (sum of per-sequence ceilings); the
    surplus rows are ``(-1, *)`` and come last, their programs exit at once. Cost = key
    blocks a query block walks (causal: its index + 1) or, ``per_key``, query blocks a key
    block walks (causal: blocks from it to the end); non-causal: the sequence's block count.
    """
    cu = cu_seqlens.long()
    B = cu.numel() - 1
    n = cdiv(total_tokens, block) + B
    nblk = (cu[1:] - cu[:-1] + block - 1) // block
    cum = torch.cumsum(nblk, 0)
    item = torch.arange(n, device=cu.device)
    seq = torch.searchsorted(cum, item, right=True).clamp_(max=max(B - 1, 0))
    blk = item - (cum[seq] - nblk[seq])
    if causal:
        cost = nblk[seq] - blk if per_key else blk + 1
    else:
        cost = nblk[seq]
    valid = item < cum[-1]
    work = torch.stack([torch.where(valid, seq, -1), blk], 1)
    if longest_first:
        work = work[torch.argsort(torch.where(valid, cost, -1), descending=True, stable=True)]
    return work.to(torch.int32).contiguous()


def _mask_args(T: int, causal: bool, window_left: int, window_right: int, softmax_scale: float, softcap: float):
    """Runtime scalars and constexprs of the score math: (qk_scale, cap, left, right) and LOCAL /
    SOFTCAP. Unbounded window sides (-1) become T + 1, beyond any key; causal sets right = 0."""
    left = T + 1 if window_left < 0 else window_left
    right = 0 if causal else (T + 1 if window_right < 0 else window_right)
    local = window_left >= 0 or (not causal and window_right >= 0)
    if softcap > 0:
        return (softmax_scale / softcap, softcap * _LOG2E, left, right), dict(LOCAL=local, SOFTCAP=True)
    return (softmax_scale * _LOG2E, 1.0, left, right), dict(LOCAL=local, SOFTCAP=False)


# The forward's load paths (fwd_triton's ``variant``): "auto" autotunes the descriptor (TMA) configs beside the
# pointer ones where tma_offered, else runs the pointer kernel; "pointer" / "tma" force one (tests, benchmarks).
FWD_VARIANTS = ("auto", "pointer", "tma")


@register("varlen_attention_fwd", "triton")
def fwd_triton(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, window_left, window_right, softcap,
               longest_first: bool = True, variant: str = "auto"):
    """``(out, base-2 lse)``; ``longest_first=False`` runs the work list in sequence order (for
    benchmarks: the op always runs longest first). ``variant`` (FWD_VARIANTS): "tma" runs the descriptor
    kernel alone with its first tile (the interpreter's 16-key config there), for 16-bit inputs where
    the GPU's tables have a row for it (any in the interpreter)."""
    if variant not in FWD_VARIANTS:
        raise ValueError(f"variant must be one of {FWD_VARIANTS}, got {variant!r}")
    q, k, v, cu_seqlens = (t.contiguous() for t in (q, k, v, cu_seqlens))  # the kernels address them as dense
    T, Hq, D = q.shape
    out = empty_output(q.shape, dtype=q.dtype, device=q.device)
    lse = empty_output((Hq, T), dtype=lse_dtype(q.dtype), device=q.device)
    if variant == "tma" and (q.dtype == torch.float32 or not (INTERPRET or tma_offered(q, k, v, _arch_family()))):
        raise ValueError(f"variant='tma' has no tile for {q.dtype} inputs at D={D} on this GPU (or they are not "
                         "16-byte aligned)")
    if T == 0:
        return out, lse
    block = _outer_block("fwd", q.dtype, D)
    work = _work_list(cu_seqlens, T, block, causal, False, longest_first)
    scalars, flags = _mask_args(T, causal, window_left, window_right, softmax_scale, softcap)
    args = (q, k, v, out, lse, cu_seqlens, work, T, Hq, Hq // k.shape[1], *scalars, *_length_buckets(max_seqlen, T))
    meta = dict(HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_M=block, IS_CAUSAL=causal, **flags, **_dtype_meta(q.dtype))
    grid = (work.shape[0] * Hq,)
    if variant == "tma":
        ensure_allocator()
        bn, warps, stages = (16, 1, 1) if INTERPRET else _GPU_TILES["tma_fwd", 90, 2][_tile_dim(D)][1][0]
        _varlen_attention_fwd_hopper_kernel.fn[grid](*args, **meta, BLOCK_N=bn, TMA=True, num_warps=warps,
                                                     num_stages=stages)
    elif variant == "auto" and not INTERPRET and tma_offered(q, k, v, _arch_family()):
        ensure_allocator()
        _varlen_attention_fwd_hopper_kernel[grid](*args, **meta)
    else:
        _varlen_attention_fwd_kernel[grid](*args, **meta)
    return out, lse


def _launch_delta(out: torch.Tensor, dout: torch.Tensor, q: torch.Tensor, finite_qdo: bool):
    """``(delta, q, dout)``; with ``finite_qdo`` the q and dout returned are copies whose non-finite
    entries read 0 (for the dK/dV kernel's FINITE_QDO)."""
    T, Hq, D = out.shape
    delta = empty_output((Hq, T), dtype=delta_dtype(out.dtype), device=out.device)
    q_f, do_f = (torch.empty_like(q), torch.empty_like(dout)) if finite_qdo else (q, dout)
    rows = min(32, _DELTA_ELEMS // _block_d(D))
    _varlen_attention_bwd_delta_kernel[(cdiv(T * Hq, rows),)](
        out, dout, delta, q, q_f, do_f, T, Hq, HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_R=rows, FINITE_QDO=finite_qdo,
        num_warps=8,
    )
    return delta, q_f, do_f


@register("varlen_attention_bwd", "triton")
def bwd_triton(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale, window_left, window_right,
               softcap, deterministic=True, longest_first: bool = True):
    """``(dq, dk, dv)`` from the forward's base-2 ``lse``; ``longest_first`` as in :func:`fwd_triton`."""
    dout, q, k, v, out, lse, cu_seqlens = (t.contiguous() for t in (dout, q, k, v, out, lse, cu_seqlens))
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    dq = empty_output(q.shape, dtype=q.dtype, device=q.device)
    dk = empty_output(k.shape, dtype=k.dtype, device=k.device)
    dv = empty_output(v.shape, dtype=v.dtype, device=v.device)
    if T == 0:
        return dq, dk, dv
    (qk_scale, *masking), flags = _mask_args(T, causal, window_left, window_right, softmax_scale, softcap)
    # TMA form of dK/dV (tiles._dkdv_tma): masked steps read q / dO copies with non-finite entries zeroed,
    # also made where q / dO are not 16-byte aligned (descriptor bases must be).
    tma = _dkdv_tma(q.dtype, D)
    finite_qdo = tma and (causal or flags["LOCAL"] or q.data_ptr() % 16 != 0 or dout.data_ptr() % 16 != 0)
    delta, q_f, do_f = _launch_delta(out, dout, q, finite_qdo)
    if tma:
        ensure_allocator()
    meta = dict(HEAD_DIM=D, BLOCK_D=_block_d(D), IS_CAUSAL=causal, **flags, **_dtype_meta(q.dtype))
    meta["DP_F64"] = delta_dtype(q.dtype) is torch.float64
    scales = (qk_scale, softmax_scale, *masking, *_length_buckets(max_seqlen, T))  # (+ LENGTH_KEY)
    atomic = not deterministic and _atomic_dq_offered(q.dtype, D, flags["SOFTCAP"])
    # fp32 dQ accumulates in place; 16-bit dQ in an fp32 buffer, rounded once at the end.
    dq_acc = (dq if q.dtype == torch.float32 else torch.empty(q.shape, dtype=torch.float32, device=q.device)
              ).zero_() if atomic else dq
    block = _outer_block(_kernel_row("dkdv", atomic, flags["SOFTCAP"], flags["LOCAL"]), q.dtype, D)
    work_kv = _work_list(cu_seqlens, T, block, causal, True, longest_first)
    _varlen_attention_bwd_dkdv_kernel[(work_kv.shape[0] * Hkv,)](
        q_f, k, v, do_f, lse, delta, dk, dv, dq_acc, cu_seqlens, work_kv, T, Hkv, Hq // Hkv, *scales, BLOCK_N=block,
        ATOMIC_DQ=atomic, FINITE_QDO=finite_qdo, TMA=tma, **meta,
    )
    if atomic:
        return (dq if dq_acc is dq else dq.copy_(dq_acc)), dk, dv
    block = _outer_block("dq", q.dtype, D)
    work_q = _work_list(cu_seqlens, T, block, causal, False, longest_first)
    _varlen_attention_bwd_dq_kernel[(work_q.shape[0] * Hq,)](
        q, k, v, dout, lse, delta, dq, cu_seqlens, work_q, T, Hq, Hq // Hkv, *scales, BLOCK_M=block, **meta,
    )
    return dq, dk, dv
