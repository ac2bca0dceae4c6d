"""The anchor designs of the performance model's calibration (``benchmarks/gpu/calibrate.py``): attention
kernels written here from the public descriptions of designs whose H100 figures are published, compiled
like ours and fed to the same model.

* ``tutorial``: the structure of Triton's fused-attention tutorial (FlashAttention-2's algorithm, one
  program per (query block, head), no warp specialisation): a forward whose causal case runs the keys
  before the diagonal unmasked and the diagonal block(s) masked; a backward of three kernels, the
  delta preprocess, dK/dV over query blocks (32 queries x 128 keys) and dQ over key blocks (128 queries
  x 32 keys), with the tutorial's autotune space (forward: 64/128-row query blocks, 32-128-key blocks,
  4/8 warps, 2-4 stages).
* ``fa2``: FlashAttention-2's CUDA design on Hopper runs ``mma.sync`` (it predates wgmma); the same
  forward and backward compiled for sm_80 give that instruction mix, which the model then prices at
  H100 rates (``aot_model.MMA_SYNC_TFLOPS``), with FA2's tiles (forward 128 x 64 at 4 warps) and its
  backward's structure: one kernel per key block (128 keys, 64-query steps, 8 warps) that also adds dQ
  with fp32 atomics (5 products per tile pair).

Dense [heads, T, D] fp16 tensors (no varlen bookkeeping: the published figures are fixed-length
batches). Never launched: only compiled (``calibrate.py``).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rows(p, o_r, D: tl.constexpr):
    """The [len(o_r), D] tile of rows ``o_r`` of a dense [T, D] head."""
    return tl.load(p + o_r[:, None] * D + tl.arange(0, D)[None, :])


@triton.jit
def _kv_block(p_k, p_v, start, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """(key positions, K tile, V tile) of the key block at ``start``."""
    o_n = start + tl.arange(0, BLOCK_N)
    return o_n, _rows(p_k, o_n, D), _rows(p_v, o_n, D)


@triton.jit
def _query_block(p_q, T, BLOCK_M: tl.constexpr, D: tl.constexpr):
    """The prologue of a program per (query block, head): (head offset, query positions, Q tile)."""
    i_m, i_h = tl.program_id(0), tl.program_id(1)
    base = i_h.to(tl.int64) * T * D
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return base, o_m, _rows(p_q + base, o_m, D)


@triton.jit
def _anchor_fwd_block(acc, l_i, m_i, q, p_k, p_v, o_m, lo, hi, qk_scale, D: tl.constexpr, BLOCK_N: tl.constexpr,
                      MASKED: tl.constexpr):
    for start in tl.range(lo, hi, BLOCK_N):
        o_n, k, v = _kv_block(p_k, p_v, start, BLOCK_N, D)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            s = tl.where(o_m[:, None] >= o_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _anchor_fwd_kernel(p_q, p_k, p_v, p_o, p_lse, T, qk_scale, D: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    base, o_m, q = _query_block(p_q, T, BLOCK_M, D)
    i_m, i_h = tl.program_id(0), tl.program_id(1)
    o_d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    hi = i_m * BLOCK_M if CAUSAL else T
    acc, l_i, m_i = _anchor_fwd_block(acc, l_i, m_i, q, p_k + base, p_v + base, o_m, 0, hi, qk_scale, D, BLOCK_N,
                                      False)
    if CAUSAL:
        acc, l_i, m_i = _anchor_fwd_block(acc, l_i, m_i, q, p_k + base, p_v + base, o_m, hi, hi + BLOCK_M, qk_scale,
                                          D, BLOCK_N, True)
    tl.store(p_o + base + o_m[:, None] * D + o_d[None, :], (acc / l_i[:, None]).to(p_o.dtype.element_ty))
    tl.store(p_lse + i_h.to(tl.int64) * T + o_m, m_i + tl.log2(l_i))


@triton.jit
def _anchor_bwd_delta_kernel(p_o, p_do, p_delta, T, D: tl.constexpr, BLOCK_M: tl.constexpr):
    o_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, D)
    o = tl.load(p_o + o_m[:, None] * D + o_d[None, :]).to(tl.float32)
    do = tl.load(p_do + o_m[:, None] * D + o_d[None, :]).to(tl.float32)
    tl.store(p_delta + o_m, tl.sum(o * do, 1))


@triton.jit
def _anchor_dkdv_block(dk, dv, k, v, p_q, p_do, p_lse, p_delta, p_dq, o_n, lo, hi, D: tl.constexpr,
                       BLOCK_M: tl.constexpr, MASKED: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    o_d = tl.arange(0, D)
    for start in tl.range(lo, hi, BLOCK_M):
        o_m = start + tl.arange(0, BLOCK_M)
        q, do = _rows(p_q, o_m, D), _rows(p_do, o_m, D)
        lse = tl.load(p_lse + o_m)
        pt = tl.exp2(tl.dot(k, tl.trans(q)) - lse[None, :])
        if MASKED:
            pt = tl.where(o_m[None, :] >= o_n[:, None], pt, 0.0)
        dv += tl.dot(pt.to(do.dtype), do)
        delta = tl.load(p_delta + o_m)
        dpt = tl.dot(v, tl.trans(do)) - delta[None, :]
        dst = (pt * dpt).to(q.dtype)
        dk += tl.dot(dst, q)
        if ATOMIC_DQ:  # FlashAttention-2's backward: dQ += dS K by fp32 atomics, 5 products per tile pair
            dq = tl.dot(tl.trans(dst), k)
            tl.atomic_add(p_dq + o_m[:, None] * D + o_d[None, :], dq, sem="relaxed")
    return dk, dv


@triton.jit
def _anchor_bwd_dkdv_kernel(p_q, p_k, p_v, p_do, p_lse, p_delta, p_dk, p_dv, p_dq, T, D: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                            ATOMIC_DQ: tl.constexpr):
    """(K is pre-scaled by softmax_scale * log2(e), as in the tutorial.)"""
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    base = i_h.to(tl.int64) * T * D
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, D)
    k = _rows(p_k + base, o_n, D)
    v = _rows(p_v + base, o_n, D)
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    lo = i_n * BLOCK_N if CAUSAL else 0
    p_q, p_do, p_lse, p_delta, p_dq = p_q + base, p_do + base, p_lse + i_h * T, p_delta + i_h * T, p_dq + base
    if CAUSAL:
        dk, dv = _anchor_dkdv_block(dk, dv, k, v, p_q, p_do, p_lse, p_delta, p_dq, o_n, lo, lo + BLOCK_N, D, BLOCK_M,
                                    True, ATOMIC_DQ)
        lo = lo + BLOCK_N
    dk, dv = _anchor_dkdv_block(dk, dv, k, v, p_q, p_do, p_lse, p_delta, p_dq, o_n, lo, T, D, BLOCK_M, False,
                                ATOMIC_DQ)
    tl.store(p_dk + base + o_n[:, None] * D + o_d[None, :], dk.to(p_dk.dtype.element_ty))
    tl.store(p_dv + base + o_n[:, None] * D + o_d[None, :], dv.to(p_dv.dtype.element_ty))


@triton.jit
def _anchor_dq_block(dq, q, do, lse, delta, p_k, p_v, o_m, lo, hi, D: tl.constexpr, BLOCK_N: tl.constexpr,
                     MASKED: tl.constexpr):
    for start in tl.range(lo, hi, BLOCK_N):
        o_n, k, v = _kv_block(p_k, p_v, start, BLOCK_N, D)
        p = tl.exp2(tl.dot(q, tl.trans(k)) - lse[:, None])
        if MASKED:
            p = tl.where(o_m[:, None] >= o_n[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v)) - delta[:, None]
        dq += tl.dot((p * dp).to(k.dtype), k)
    return dq


@triton.jit
def _anchor_bwd_dq_kernel(p_q, p_k, p_v, p_do, p_lse, p_delta, p_dq, T, D: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    base, o_m, q = _query_block(p_q, T, BLOCK_M, D)
    i_m, i_h = tl.program_id(0), tl.program_id(1)
    o_d = tl.arange(0, D)
    do = _rows(p_do + base, o_m, D)
    lse = tl.load(p_lse + i_h * T + o_m)
    delta = tl.load(p_delta + i_h * T + o_m)
    dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    hi = i_m * BLOCK_M if CAUSAL else T
    dq = _anchor_dq_block(dq, q, do, lse, delta, p_k + base, p_v + base, o_m, 0, hi, D, BLOCK_N, False)
    if CAUSAL:
        dq = _anchor_dq_block(dq, q, do, lse, delta, p_k + base, p_v + base, o_m, hi, hi + BLOCK_M, D, BLOCK_N, True)
    tl.store(p_dq + base + o_m[:, None] * D + o_d[None, :], dq.to(p_dq.dtype.element_ty))


# The configs each design offers (what its autotuning would choose among), per kernel.
TUTORIAL_FWD = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
                for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]
TUTORIAL_DKDV = [dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=5)]
TUTORIAL_DQ = [dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=5)]
FA2_FWD = [dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2)]
FA2_DKDVDQ = [dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2)]


def launch(kernel: str, D: int, causal: bool, cfg: dict, T: int = 1024, H: int = 2):
    """Call one anchor kernel on CPU tensors (under aot's compile-only mode nothing runs)."""
    import torch
    q, k, v, o, do, dq, dk, dv = (torch.empty(H, T, D, dtype=torch.float16) for _ in range(8))
    lse, delta = torch.empty(H, T), torch.empty(H, T)
    meta = dict(cfg)
    if kernel == "fwd":
        grid = (T // meta["BLOCK_M"], H)
        _anchor_fwd_kernel[grid](q, k, v, o, lse, T, 0.1, D=D, CAUSAL=causal, **meta)
    elif kernel == "delta":
        _anchor_bwd_delta_kernel[(H * T // 128,)](o, do, delta, H * T, D=D, BLOCK_M=128, num_warps=4)
    elif kernel in ("dkdv", "dkdvdq"):
        grid = (T // meta["BLOCK_N"], H)
        _anchor_bwd_dkdv_kernel[grid](q, k, v, do, lse, delta, dk, dv, dq.float(), T, D=D, CAUSAL=causal,
                                      ATOMIC_DQ=kernel == "dkdvdq", **meta)
    elif kernel == "dq":
        grid = (T // meta["BLOCK_M"], H)
        _anchor_bwd_dq_kernel[grid](q, k, v, do, lse, delta, dq, T, D=D, CAUSAL=causal, **meta)
    else:
        raise ValueError(f"unknown anchor kernel {kernel!r}")
