"""The Hopper forward of ``varlen_attention``: K / V / Q tiles loaded and O stored through tensor
descriptors (TMA), offered to the autotuner beside the pointer kernel's own configs.

``_varlen_attention_fwd_hopper_kernel`` is one autotuned kernel whose configs carry ``TMA``: with
``TMA=False`` it is the pointer kernel of :mod:`.triton_kernels` inlined unchanged (the configs of
``_GPU_TILES["fwd", 90, 2]``), with ``TMA=True`` the descriptor forward below
(``_GPU_TILES["tma_fwd", 90, 2]``), so timing both can only pick something at least as fast as the
pointer kernel. The launcher (:mod:`.launch`) runs it on sm_90 for 16-bit inputs where a
``tma_fwd`` row exists; everything else runs the pointer kernel.

Descriptors are built per program on the device (``tl.make_tensor_descriptor``) with their base at
the sequence's first token of the head and shape = the sequence's rows x the head dim: rows past
the sequence (and columns past the head dim) read 0 and stores to them are dropped, so no tile can
read or write the next sequence and no row mask is needed on the loads. Their 128-byte scratch
comes from ``triton.set_allocator`` (:func:`ensure_allocator`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_utils import INTERPRET
from .tiles import _GPU_TILES, LENGTH_KEY, TMA_FWD_PLAIN_MAXNREG, _arch_family, _tile_dim
from .triton_kernels import (
    _cast,
    _finite_or_zero,
    _fwd_scores,
    _in_window,
    _program_block,
    _softmax_step,
    _varlen_attention_fwd_kernel,
    _window_range,
)

# Device-side descriptors exist in every declared Triton (3.6 and 3.9, and the 3.9 / 3.6 interpreters);
# an older Triton lacking them runs the pointer kernel only.
DESCRIPTORS = hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")
_MAXNREG = {"tma_fwd_plain": TMA_FWD_PLAIN_MAXNREG}  # register caps per _GPU_TILES row (others: none)
# The pointer forward, inlined as the TMA=False branch (its autotuner's jit function).
_POINTER_FWD = _varlen_attention_fwd_kernel.fn


def _scratch(size: int, alignment: int, stream):
    """Descriptor scratch (128 B per descriptor and program) from torch's caching allocator."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Device-side tensor descriptors (forward and dK/dV) take global scratch, which Triton asks of the
    allocator set with ``triton.set_allocator`` (a context variable: per thread, and autograd runs the
    backward on its own): set one where none is, keep the caller's otherwise (the interpreter needs none)."""
    from triton.runtime import _allocation
    if not INTERPRET and isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def tma_offered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: int) -> bool:
    """Whether the descriptor forward has tiles for these inputs on ``arch`` (a ``tma_fwd`` row: 16-bit on
    sm_90) and the tensors meet TMA's alignment: 16-byte base addresses (row strides are D * 2 bytes, a
    multiple of 16 since D is a multiple of 8)."""
    rows = _GPU_TILES.get(("tma_fwd", arch, q.dtype.itemsize), {})
    return DESCRIPTORS and _tile_dim(q.shape[-1]) in rows and all(t.data_ptr() % 16 == 0 for t in (q, k, v))


def _configs(interpret: bool = INTERPRET):
    """The pointer kernel's sm_90 16-bit configs (TMA=False) and the descriptor ones (TMA=True); the
    interpreter gets one small descriptor config (the launcher forces a variant there)."""
    if interpret:
        return [triton.Config({"BLOCK_N": 16, "TMA": True}, num_warps=1, num_stages=1)]
    out = {}
    for kernel in ("fwd", "tma_fwd", "tma_fwd_masked", "tma_fwd_plain"):
        for bn, w, s in sorted({c for _, cs in _GPU_TILES.get((kernel, 90, 2), {}).values() for c in cs}):
            key = (kernel != "fwd", bn, w, s, _MAXNREG.get(kernel))  # (tma_fwd_masked repeats tma_fwd's configs)
            out.setdefault(key, triton.Config({"BLOCK_N": bn, "TMA": key[0]}, num_warps=w, num_stages=s,
                                              maxnreg=key[4]))
    return list(out.values())


def _rows(local: bool, softcap: bool) -> tuple:
    """The _GPU_TILES rows whose configs a launch is offered: the pointer row, the descriptor row (its
    ``tma_fwd_masked`` form with a window or softcap, where the table has one) and without either mask
    the register-capped ``tma_fwd_plain`` row."""
    if local or softcap:
        return ("fwd", "tma_fwd_masked" if ("tma_fwd_masked", 90, 2) in _GPU_TILES else "tma_fwd")
    return ("fwd", "tma_fwd", "tma_fwd_plain")


def _prune(configs, named_args, **kwargs):
    """Keep the configs of this launch's dtype and head dim: each variant's own table row (and the
    ``tma_fwd_plain`` row's without window and softcap)."""
    if INTERPRET:
        return configs
    dtype, head_dim = named_args["p_q"].dtype, kwargs["HEAD_DIM"]
    offered = {(kernel != "fwd", bn, w, s, _MAXNREG.get(kernel))
               for kernel in _rows(kwargs["LOCAL"], kwargs["SOFTCAP"])
               for bn, w, s in _GPU_TILES.get((kernel, _arch_family(), dtype.itemsize), {}).get(
                   _tile_dim(head_dim), (0, ()))[1]}
    return [c for c in configs if (c.kwargs["TMA"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, c.maxnreg)
            in offered]


@triton.jit
def _fwd_tma_inner(b_acc, b_l, b_m, b_q, d_k, d_v, o_m, lo, hi, L, qk_scale, cap, win_left, win_right,
                   SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr,
                   INTERPRET: tl.constexpr, MASK_CAUSAL: tl.constexpr = False, MASK_LEN: tl.constexpr = False,
                   MASK_WINDOW: tl.constexpr = False, WARP_SPEC: tl.constexpr = False):
    """Online softmax over keys [lo, hi) (int32), K / V tiles through the descriptors ``d_k`` / ``d_v``
    (rows >= L read 0). The same arithmetic as the pointer kernel's ``_fwd_inner``: score masks only in
    the masked instantiations, scaling fused into exp2's FMA without SOFTCAP, P rounded to V's dtype."""
    # WARP_SPEC False compiles as a plain range loop (no tt.warp_specialize attribute): the tables' configs.
    for start in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        o_n = start + tl.arange(0, BLOCK_N)
        b_k = d_k.load([start, 0]).to(DOT_T)
        b_v = d_v.load([start, 0])
        if MASK_CAUSAL or MASK_WINDOW:
            b_v = _finite_or_zero(b_v)  # (the score mask below replaces a masked key's NaN score)
        b_s, b_scale = _fwd_scores(b_q, b_k, qk_scale, cap, SOFTCAP=SOFTCAP, PREC=PREC)
        if MASK_WINDOW:
            b_s = tl.where(_in_window(o_m[:, None], o_n[None, :], win_left, win_right) & (o_n[None, :] < L),
                           b_s, float("-inf"))
        elif MASK_CAUSAL:  # (keys >= L are after every row < L; rows >= L are never stored)
            b_s = tl.where(o_m[:, None] >= o_n[None, :], b_s, float("-inf"))
        elif MASK_LEN:
            b_s = tl.where(o_n[None, :] < L, b_s, float("-inf"))
        b_acc, b_l, b_m = _softmax_step(b_acc, b_l, b_m, b_s, b_scale, b_v, DOT_T=DOT_T, PREC=PREC,
                                        INTERPRET=INTERPRET, MASKED=MASK_CAUSAL or MASK_LEN or MASK_WINDOW)
    return b_acc, b_l, b_m


@triton.jit
def _fwd_tma(p_q, p_k, p_v, p_o, p_lse, p_cu, p_work, T, Hq, GROUP, qk_scale, cap, win_left, win_right,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             IS_CAUSAL: tl.constexpr, LOCAL: tl.constexpr, SOFTCAP: tl.constexpr,
             DOT_T: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr, WARP_SPEC: tl.constexpr = False):
    """One (query block, query head) per program, as the pointer kernel, through descriptors; ``WARP_SPEC``:
    the key loops warp-specialised (no table config sets it: benchmarks/gpu/sweep.py's candidate)."""
    i_b, i_h, i_m, bos, L, o_m, _, m_row, _ = _program_block(p_work, p_cu, Hq, BLOCK_M, HEAD_DIM, BLOCK_D)
    if i_b < 0:
        return
    stride_q = Hq * HEAD_DIM
    stride_kv = (Hq // GROUP) * HEAD_DIM
    L32 = L.to(tl.int32)
    i_hk = i_h // GROUP
    d_q = tl.make_tensor_descriptor(p_q + bos * stride_q + i_h * HEAD_DIM, shape=[L32, HEAD_DIM],
                                    strides=[stride_q, 1], block_shape=[BLOCK_M, BLOCK_D])
    d_k = tl.make_tensor_descriptor(p_k + bos * stride_kv + i_hk * HEAD_DIM, shape=[L32, HEAD_DIM],
                                    strides=[stride_kv, 1], block_shape=[BLOCK_N, BLOCK_D])
    d_v = tl.make_tensor_descriptor(p_v + bos * stride_kv + i_hk * HEAD_DIM, shape=[L32, HEAD_DIM],
                                    strides=[stride_kv, 1], block_shape=[BLOCK_N, BLOCK_D])
    q_lo = (i_m * BLOCK_M).to(tl.int32)
    o_m32 = q_lo + tl.arange(0, BLOCK_M)
    b_q = d_q.load([q_lo, 0]).to(DOT_T)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if LOCAL:  # sliding window: only the keys some row of the block sees, all masked
        lo, hi = _window_range(i_m * BLOCK_M, BLOCK_M, win_left, win_right, L)
        b_acc, b_l, b_m = _fwd_tma_inner(
            b_acc, b_l, b_m, b_q, d_k, d_v, o_m32, lo.to(tl.int32), hi.to(tl.int32), L32, qk_scale, cap, win_left,
            win_right, SOFTCAP=SOFTCAP, BLOCK_N=BLOCK_N, DOT_T=DOT_T, PREC=PREC, INTERPRET=INTERPRET,
            MASK_WINDOW=True, WARP_SPEC=WARP_SPEC)
    else:  # unmasked keys [0, mid), then masked [mid, hi), as in the pointer kernel
        mid = q_lo if IS_CAUSAL else (L32 // BLOCK_N) * BLOCK_N
        hi = tl.minimum(mid + BLOCK_M, L32) if IS_CAUSAL else L32
        b_acc, b_l, b_m = _fwd_tma_inner(
            b_acc, b_l, b_m, b_q, d_k, d_v, o_m32, 0, mid, L32, qk_scale, cap, win_left, win_right,
            SOFTCAP=SOFTCAP, BLOCK_N=BLOCK_N, DOT_T=DOT_T, PREC=PREC, INTERPRET=INTERPRET, WARP_SPEC=WARP_SPEC)
        b_acc, b_l, b_m = _fwd_tma_inner(
            b_acc, b_l, b_m, b_q, d_k, d_v, o_m32, mid, hi, L32, qk_scale, cap, win_left, win_right,
            SOFTCAP=SOFTCAP, BLOCK_N=BLOCK_N, DOT_T=DOT_T, PREC=PREC, INTERPRET=INTERPRET,
            MASK_CAUSAL=IS_CAUSAL, MASK_LEN=True, WARP_SPEC=WARP_SPEC)

    b_l_safe = tl.where(b_l == 0.0, 1.0, b_l)
    b_o = _cast(b_acc / b_l_safe[:, None], p_o.dtype.element_ty, INTERPRET)
    d_o = tl.make_tensor_descriptor(p_o + bos * stride_q + i_h * HEAD_DIM, shape=[L32, HEAD_DIM],
                                    strides=[stride_q, 1], block_shape=[BLOCK_M, BLOCK_D])
    d_o.store([q_lo, 0], b_o)  # rows past the sequence, columns past D: dropped by the descriptor
    # Base-2 lse, the units the backward recomputes P in (the public function converts).
    b_lse = tl.where(b_l == 0.0, float("-inf"), b_m + tl.log2(b_l_safe))
    tl.store(p_lse + i_h.to(tl.int64) * T + bos + o_m, b_lse, mask=m_row)


@triton.autotune(configs=_configs(), key=["HEAD_DIM", "IS_CAUSAL", "LOCAL", "SOFTCAP", "DOT_T", *LENGTH_KEY],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit(do_not_specialize=LENGTH_KEY)
def _varlen_attention_fwd_hopper_kernel(
    p_q, p_k, p_v, p_o, p_lse, p_cu, p_work, T, Hq, GROUP, qk_scale, cap, win_left, win_right, len_bucket, tok_bucket,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, LOCAL: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_T: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr, TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr = False,
):
    """The forward with a config-chosen load path: ``TMA`` descriptors, else the pointer kernel."""
    if TMA:
        _fwd_tma(p_q, p_k, p_v, p_o, p_lse, p_cu, p_work, T, Hq, GROUP, qk_scale, cap, win_left, win_right,
                 HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, IS_CAUSAL=IS_CAUSAL,
                 LOCAL=LOCAL, SOFTCAP=SOFTCAP, DOT_T=DOT_T, PREC=PREC, INTERPRET=INTERPRET, WARP_SPEC=WARP_SPEC)
    else:
        _POINTER_FWD(p_q, p_k, p_v, p_o, p_lse, p_cu, p_work, T, Hq, GROUP, qk_scale, cap, win_left, win_right,
                     len_bucket, tok_bucket,
                     HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, IS_CAUSAL=IS_CAUSAL,
                     LOCAL=LOCAL, SOFTCAP=SOFTCAP, DOT_T=DOT_T, PREC=PREC, INTERPRET=INTERPRET)
