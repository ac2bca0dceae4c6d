"""Triton kernels of ``moe_experts``: grouped GEMMs over expert-contiguous rows, forward and backward.

Rows are the (token, choice) pairs sorted by expert (:mod:`.permutation`); a *row tile* is
``BLOCK_M`` rows of one expert, taken from a work list of (expert, row-block) pairs built on the
device (:func:`.launch._work_list`), so no kernel needs to know the counts on the host. Row tiles
read their tokens' rows of ``x`` / ``dout`` through the rows' slots (no permuted copy of ``x``).

* :func:`_moe_gate_up_fwd_kernel`: ``[g | u] = x[tok] @ gate_up_proj[e]^T`` (two accumulators, the gate
  and up columns of the same block), stored for the backward;
* :func:`_moe_rows_gemm_kernel`: ``acc = A @ B[e]`` with ``A`` either ``silu(g) * u`` (from the stored
  gate/up, the down GEMM) or a stored ``[rows, K]`` tensor, and three epilogues: weighted by the row's
  routing weight (the forward's expert output), a row-sum against ``dout`` (the routing weights'
  gradient, from the recomputed expert output), plain (``dx`` per row);
* :func:`_moe_gate_up_bwd_kernel`: ``dout[tok] @ down_proj[e]``, then SwiGLU's backward in the epilogue;
* :func:`_moe_weight_grad_kernel`: per expert, ``sum over its rows of A^T B`` (both weights' gradients),
  a loop over the expert's rows whose trip count comes from the offsets;
* :func:`_moe_combine_kernel`: each token's sum over its k rows (choices without a valid expert skipped).

Names follow FLA as in varlen_attention: ``p_`` pointers, ``o_`` offsets, ``m_`` masks, ``b_`` blocks.
Accumulation is float32; ``DOT_T`` is the ``tl.dot`` operand type (float32 in the interpreter, whose
3.9 ``tl.dot`` multiplies raw bits of bf16 operands), ``PREC`` keeps fp32 inputs IEEE.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..varlen_attention.triton_kernels import _cast

# _moe_rows_gemm_kernel's epilogues
WEIGHTED, DOT_DOUT, STORE = 0, 1, 2


@triton.jit
def _row_tile(p_work, p_off, p_row_slot, BLOCK_M: tl.constexpr):
    """This program's (expert, row block) of the work list: (expert (-1: a padding entry, return),
    rows int64, rows' mask, rows' slots int64)."""
    i_w = tl.program_id(0)
    i_e = tl.load(p_work + 2 * i_w)
    i_blk = tl.load(p_work + 2 * i_w + 1)
    i_es = tl.maximum(i_e, 0)
    start = tl.load(p_off + i_es) + i_blk * BLOCK_M
    end = tl.load(p_off + i_es + 1)
    o_r = start + tl.arange(0, BLOCK_M)
    m_r = o_r < end
    slot = tl.load(p_row_slot + o_r, mask=m_r, other=0)
    return i_e, o_r.to(tl.int64), m_r, slot.to(tl.int64)


@triton.jit
def _silu_mul(b_g, b_u):
    """silu(g) * u in fp32."""
    return b_g / (1.0 + tl.exp(-b_g)) * b_u


@triton.jit
def _moe_gate_up_fwd_kernel(
    p_x, p_w, p_gu, p_off, p_row_slot, p_work, H, I,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_T: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr,
):
    """gu[r, n] = x[tok_r] . gate_up_proj[e, n] and gu[r, I + n] = x[tok_r] . gate_up_proj[e, I + n] for
    the BLOCK_N columns n of program_id(1)."""
    i_e, o_r, m_r, slot = _row_tile(p_work, p_off, p_row_slot, BLOCK_M)
    if i_e < 0:
        return
    tok = slot // TOPK
    o_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < I
    p_we = p_w + i_e.to(tl.int64) * 2 * I * H
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < H
        b_x = tl.load(p_x + tok[:, None] * H + o_k[None, :], mask=m_r[:, None] & m_k[None, :], other=0.0).to(DOT_T)
        m_w = m_k[:, None] & m_n[None, :]
        b_wg = tl.load(p_we + o_n[None, :] * H + o_k[:, None], mask=m_w, other=0.0).to(DOT_T)
        b_wu = tl.load(p_we + (o_n + I)[None, :] * H + o_k[:, None], mask=m_w, other=0.0).to(DOT_T)
        acc_g = tl.dot(b_x, b_wg, acc_g, input_precision=PREC)
        acc_u = tl.dot(b_x, b_wu, acc_u, input_precision=PREC)
    p_out = p_gu + o_r[:, None] * (2 * I) + o_n[None, :]
    m_out = m_r[:, None] & m_n[None, :]
    tl.store(p_out, _cast(acc_g, p_gu.dtype.element_ty, INTERPRET), mask=m_out)
    tl.store(p_out + I, _cast(acc_u, p_gu.dtype.element_ty, INTERPRET), mask=m_out)


@triton.jit
def _moe_rows_gemm_kernel(
    p_a, p_b, p_c, p_dout, p_wt, p_off, p_row_slot, p_work, K, N, stride_be, stride_bk, stride_bn,
    TOPK: tl.constexpr, A_SWIGLU: tl.constexpr, EPILOGUE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_T: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr,
):
    """acc[r, n] = sum_k A[r, k] * B[e, k, n] over a row tile and BLOCK_N columns n (program_id(1)).

    A: with A_SWIGLU, silu(g) * u read from the stored ``[rows, 2K]`` gate/up (rounded to their dtype, as
    torch feeds the down projection), else a ``[rows, K]`` tensor. B is addressed through its strides.
    EPILOGUE: WEIGHTED stores acc * topk_weights[slot] (``[rows, N]``); DOT_DOUT stores the fp32 row sums
    of acc * dout[tok] over the block into column program_id(1) of ``[rows, cdiv(N, BLOCK_N)]``; STORE
    stores acc."""
    i_e, o_r, m_r, slot = _row_tile(p_work, p_off, p_row_slot, BLOCK_M)
    if i_e < 0:
        return
    i_n = tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    p_be = p_b + i_e.to(tl.int64) * stride_be
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_a = m_r[:, None] & (o_k < K)[None, :]
        if A_SWIGLU:
            p_ga = p_a + o_r[:, None] * (2 * K) + o_k[None, :]
            b_g = tl.load(p_ga, mask=m_a, other=0.0).to(tl.float32)
            b_u = tl.load(p_ga + K, mask=m_a, other=0.0).to(tl.float32)
            b_a = _cast(_silu_mul(b_g, b_u), p_a.dtype.element_ty, INTERPRET).to(DOT_T)
        else:
            b_a = tl.load(p_a + o_r[:, None] * K + o_k[None, :], mask=m_a, other=0.0).to(DOT_T)
        b_b = tl.load(p_be + o_k[:, None] * stride_bk + o_n[None, :] * stride_bn,
                      mask=(o_k < K)[:, None] & m_n[None, :], other=0.0).to(DOT_T)
        acc = tl.dot(b_a, b_b, acc, input_precision=PREC)
    m_out = m_r[:, None] & m_n[None, :]
    if EPILOGUE == 0:  # WEIGHTED
        b_w = tl.load(p_wt + slot, mask=m_r, other=0.0).to(tl.float32)
        tl.store(p_c + o_r[:, None] * N + o_n[None, :], _cast(acc * b_w[:, None], p_c.dtype.element_ty, INTERPRET),
                 mask=m_out)
    elif EPILOGUE == 1:  # DOT_DOUT
        tok = slot // TOPK
        b_do = tl.load(p_dout + tok[:, None] * N + o_n[None, :], mask=m_out, other=0.0).to(tl.float32)
        tl.store(p_c + o_r * tl.num_programs(1) + i_n, tl.sum(acc * b_do, 1), mask=m_r)
    else:  # STORE
        tl.store(p_c + o_r[:, None] * N + o_n[None, :], _cast(acc, p_c.dtype.element_ty, INTERPRET), mask=m_out)


@triton.jit
def _moe_gate_up_bwd_kernel(
    p_dout, p_down, p_gu, p_wt, p_dgu, p_off, p_row_slot, p_work, H, I,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_T: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr,
):
    """dgu for BLOCK_N columns n of the activation: ga = dout[tok] @ down_proj[e][:, n], da = w * ga,
    d gate = da * u * silu'(g), d up = da * silu(g)."""
    i_e, o_r, m_r, slot = _row_tile(p_work, p_off, p_row_slot, BLOCK_M)
    if i_e < 0:
        return
    tok = slot // TOPK
    o_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < I
    p_de = p_down + i_e.to(tl.int64) * H * I
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < H
        b_do = tl.load(p_dout + tok[:, None] * H + o_k[None, :], mask=m_r[:, None] & m_k[None, :],
                       other=0.0).to(DOT_T)
        b_dn = tl.load(p_de + o_k[:, None] * I + o_n[None, :], mask=m_k[:, None] & m_n[None, :], other=0.0).to(DOT_T)
        acc = tl.dot(b_do, b_dn, acc, input_precision=PREC)
    m_out = m_r[:, None] & m_n[None, :]
    b_w = tl.load(p_wt + slot, mask=m_r, other=0.0).to(tl.float32)
    p_g = p_gu + o_r[:, None] * (2 * I) + o_n[None, :]
    b_g = tl.load(p_g, mask=m_out, other=0.0).to(tl.float32)
    b_u = tl.load(p_g + I, mask=m_out, other=0.0).to(tl.float32)
    b_sig = 1.0 / (1.0 + tl.exp(-b_g))
    b_da = acc * b_w[:, None]
    p_d = p_dgu + o_r[:, None] * (2 * I) + o_n[None, :]
    tl.store(p_d, _cast(b_da * b_u * b_sig * (1.0 + b_g * (1.0 - b_sig)), p_dgu.dtype.element_ty, INTERPRET),
             mask=m_out)
    tl.store(p_d + I, _cast(b_da * b_g * b_sig, p_dgu.dtype.element_ty, INTERPRET), mask=m_out)


@triton.jit
def _moe_weight_grad_kernel(
    p_a, p_b, p_c, p_wt, p_off, p_row_slot, M, N, lda, ldb,
    TOPK: tl.constexpr, A_GATHER: tl.constexpr, A_SCALE: tl.constexpr, B_GATHER: tl.constexpr,
    B_SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_T: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr,
):
    """C[e][m, n] = sum over expert e's rows r of A'[r, m] * B'[r, n], for the (BLOCK_M, BLOCK_N) block
    (program_id(1), program_id(2)) of expert program_id(0); an expert without rows stores zeros.

    A' = A[tok_r] (A_GATHER) or A[r], times topk_weights[slot_r] (A_SCALE, rounded to A's dtype as torch's
    dy = dout * w is); B' = B[tok_r] (B_GATHER) or B[r], or silu(g) * u of the stored gate/up (B_SWIGLU:
    g at column n, u at N + n)."""
    i_e = tl.program_id(0)
    o_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m = o_m < M
    m_n = o_n < N
    start = tl.load(p_off + i_e)
    end = tl.load(p_off + i_e + 1)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        o_k = r0 + tl.arange(0, BLOCK_K)
        m_k = o_k < end
        slot = tl.load(p_row_slot + o_k, mask=m_k, other=0).to(tl.int64)
        o_k64 = o_k.to(tl.int64)
        if A_GATHER:
            row_a = slot // TOPK
        else:
            row_a = o_k64
        b_at = tl.load(p_a + row_a[None, :] * lda + o_m[:, None], mask=m_m[:, None] & m_k[None, :], other=0.0)
        if A_SCALE:
            b_w = tl.load(p_wt + slot, mask=m_k, other=0.0).to(tl.float32)
            b_at = _cast(b_at.to(tl.float32) * b_w[None, :], p_a.dtype.element_ty, INTERPRET)
        if B_GATHER:
            row_b = slot // TOPK
        else:
            row_b = o_k64
        m_b = m_k[:, None] & m_n[None, :]
        if B_SWIGLU:
            p_bg = p_b + row_b[:, None] * ldb + o_n[None, :]
            b_g = tl.load(p_bg, mask=m_b, other=0.0).to(tl.float32)
            b_u = tl.load(p_bg + N, mask=m_b, other=0.0).to(tl.float32)
            b_b = _cast(_silu_mul(b_g, b_u), p_b.dtype.element_ty, INTERPRET)
        else:
            b_b = tl.load(p_b + row_b[:, None] * ldb + o_n[None, :], mask=m_b, other=0.0)
        acc = tl.dot(b_at.to(DOT_T), b_b.to(DOT_T), acc, input_precision=PREC)
    p_ce = p_c + i_e.to(tl.int64) * M * N
    tl.store(p_ce + o_m[:, None] * N + o_n[None, :], _cast(acc, p_c.dtype.element_ty, INTERPRET),
             mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _moe_combine_kernel(
    p_y, p_out, p_slot_row, p_nv, T, H,
    TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr,
):
    """out[t] = sum_j y[slot_row[t * TOPK + j]] in fp32, rows >= nv (choices without a valid expert)
    skipped."""
    o_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_t = o_t < T
    m_h = o_h < H
    nv = tl.load(p_nv)
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    o_t64 = o_t.to(tl.int64)
    for j in tl.static_range(TOPK):
        row = tl.load(p_slot_row + o_t64 * TOPK + j, mask=m_t, other=0)
        ok = m_t & (row < nv)
        acc += tl.load(p_y + row.to(tl.int64)[:, None] * H + o_h[None, :], mask=ok[:, None] & m_h[None, :],
                       other=0.0).to(tl.float32)
    tl.store(p_out + o_t64[:, None] * H + o_h[None, :], _cast(acc, p_out.dtype.element_ty, INTERPRET),
             mask=m_t[:, None] & m_h[None, :])
