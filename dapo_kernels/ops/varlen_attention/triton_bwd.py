"""Flash-attention-2 style backward kernels of ``varlen_attention``: the delta preprocess, dK/dV
(optionally with dQ by atomics) and dQ, with their backward-only jit helpers.

Names and units as in :mod:`.triton_kernels` (FLA names; base-2 scores and lse, fp64 lse for fp32
inputs). The launchers are in :mod:`.launch`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .tiles import LENGTH_KEY, _inner_configs, _prune
from .triton_kernels import (
    _cast,
    _finite_or_zero,
    _in_window,
    _program_block,
    _scores,
    _store_rows,
    _window_range,
)


# --------------------------------------------------------------------------- backward-only helpers
@triton.jit
def _shifted(b_s, b_t, qk_scale, b_shift, SOFTCAP: tl.constexpr):
    """``scores - shift`` for exp2 (``_scores``' pair): without SOFTCAP ``b_t`` is the raw dot product
    and the scaling is fused, ``fma(qk, scale, -shift)``: one rounding of a result that is small near
    the row max, as the GPU build's contraction gives (the interpreter would otherwise round twice)."""
    if SOFTCAP:
        return b_s - b_shift
    else:
        return tl.fma(b_t, qk_scale, -b_shift)


@triton.jit
def _exp2_shifted(b_s, b_t, qk_scale, b_lse, SOFTCAP: tl.constexpr):
    """exp2(scores - lse): the backward's probabilities. An fp64 lse (fp32 inputs) is subtracted as an fp32
    pair hi + lo: scores - hi is exact where P matters (Sterbenz), so an fp32 lse's rounding (ulp(72) / 2 in
    base 2 under softcap 50) does not reach every P of the row. +-inf / NaN lse: lo = 0, P as before."""
    if b_lse.dtype == tl.float64:
        b_fin = tl.where(tl.abs(b_lse) < float("inf"), b_lse, 0.0)  # (no inf - inf for lo)
        b_lo = (b_fin - b_fin.to(tl.float32).to(tl.float64)).to(tl.float32)
        return tl.exp2(_shifted(b_s, b_t, qk_scale, b_lse.to(tl.float32), SOFTCAP) - b_lo)
    else:
        return tl.exp2(_shifted(b_s, b_t, qk_scale, b_lse, SOFTCAP))


@triton.jit
def _dsoftcap(b_ds, b_t, SOFTCAP: tl.constexpr):
    """d(scores) -> d(uncapped scores): times d tanh = 1 - t^2 under SOFTCAP."""
    if SOFTCAP:
        b_ds = b_ds * (1.0 - b_t * b_t)
    return b_ds


@triton.jit
def _dot_f64(p_a, o_a, m_a, p_b, o_b, m_b, FINITE_B: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    """fp64 ``[BLOCK_A, BLOCK_B]``: sum_d a[i, d] * b[j, d] of the rows at ``p_a + o_a[i]`` and
    ``p_b + o_b[j]`` (masked rows read 0; ``FINITE_B``: b's non-finite entries read 0). Loaded
    from memory (cache-resident tiles) 16 columns at a time, since fp64 tiles of the whole head dim
    held in registers spill. ``out_dtype`` is explicit: Triton 3.6 rejects fp64 operands without it."""
    b_acc = tl.zeros([BLOCK_A, BLOCK_B], dtype=tl.float64)
    for c in tl.static_range(0, BLOCK_D, 16):
        o_c = c + tl.arange(0, 16)
        m_c = o_c < HEAD_DIM
        b_a = tl.load(p_a + o_a[:, None] + o_c[None, :], mask=m_a[:, None] & m_c[None, :], other=0.0)
        b_b = tl.load(p_b + o_b[:, None] + o_c[None, :], mask=m_b[:, None] & m_c[None, :], other=0.0)
        if FINITE_B:
            b_b = _finite_or_zero(b_b)
        b_acc = tl.dot(b_a.to(tl.float64), tl.trans(b_b.to(tl.float64)), b_acc, out_dtype=tl.float64)
    return b_acc


@triton.jit
def _rows_desc(p_base, n_rows, stride, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tensor descriptor of the ``[n_rows, HEAD_DIM]`` rows ``p_base + r * stride`` in ``[BLOCK_R, BLOCK_D]``
    blocks (reads past its bounds give 0, writes there are dropped). ``p_base`` and ``stride`` 16-byte aligned."""
    return tl.make_tensor_descriptor(p_base, shape=[n_rows, HEAD_DIM], strides=[stride, 1],
                                     block_shape=[BLOCK_R, BLOCK_D])



# --------------------------------------------------------------------------- backward
@triton.jit
def _varlen_attention_bwd_delta_kernel(p_o, p_do, p_delta, p_q, p_qf, p_dof, T, Hq, HEAD_DIM: tl.constexpr,
                                       BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, FINITE_QDO: tl.constexpr):
    """delta[h, t] = sum_d dO[t, h, d] * O[t, h, d] (in p_delta's dtype), over rows r = t * Hq + h.
    ``FINITE_QDO``: also copy Q and dO to ``p_qf`` / ``p_dof`` with non-finite entries read as 0, for
    the dK/dV kernel's masked steps (a query's inf would reach keys it does not attend as 0 * inf)."""
    o_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_r = o_r < T * Hq
    m = m_r[:, None] & (o_d < HEAD_DIM)[None, :]
    # fp64 products and sum, rounded once: delta's error reaches dQ / dK through a term that does not
    # cancel (plain softmax backward has none), so it is kept to O's rounding. Memory-bound: fp64 is free.
    o_x = o_r[:, None] * HEAD_DIM + o_d[None, :]
    b_o = tl.load(p_o + o_x, mask=m, other=0.0).to(tl.float64)
    b_do = tl.load(p_do + o_x, mask=m, other=0.0)
    tl.store(p_delta + (o_r % Hq) * T + o_r // Hq, tl.sum(b_o * b_do.to(tl.float64), 1).to(p_delta.dtype.element_ty),
             mask=m_r)
    if FINITE_QDO:
        tl.store(p_dof + o_x, _finite_or_zero(b_do), mask=m)
        tl.store(p_qf + o_x, _finite_or_zero(tl.load(p_q + o_x, mask=m, other=0.0)), mask=m)


@triton.jit
def _dkdv_inner(b_dk, b_dv, b_k, b_v, p_v, stride_kv, p_q, p_do, p_lse, p_delta, p_dq, stride_q, o_n, lo, hi, L,
                qk_scale, sm_scale, cap, win_left, win_right, SOFTCAP: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, DOT_T: tl.constexpr,
                PREC: tl.constexpr, DP_F64: tl.constexpr, INTERPRET: tl.constexpr, FINITE_QDO: tl.constexpr,
                TMA: tl.constexpr, MASK_CAUSAL: tl.constexpr = False, MASK_LEN: tl.constexpr = False,
                MASK_WINDOW: tl.constexpr = False):
    """Accumulate dK, dV of one key block over query rows [lo, hi) of one head, on
    transposed scores [keys, queries] so no tile is transposed twice. Query rows past the
    sequence end read q = dO = 0 and lse = +inf: their probabilities are exactly 0, no
    score mask needed for the length. ``ATOMIC_DQ``: also add this key block's share of dQ,
    dS @ K * scale, into the fp32 buffer ``p_dq`` (rows of this head) with atomics; key rows
    past the end (k = 0, score 0) then need their P masked (MASK_LEN, and in MASK_WINDOW), since
    exp2(0 - lse) overflows the 16-bit dS for a query with lse < -16 and inf * (k = 0) is NaN."""
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    L32 = L.to(tl.int32)
    # The causal diagonal's few steps are not software-pipelined: its q / dO pass through registers
    # (non-finite entries zeroed), and a prefetched pair held there across the step spilled.
    for start in tl.range(lo, hi, BLOCK_M, num_stages=1 if MASK_CAUSAL and not FINITE_QDO else None):
        o_m32 = (start + tl.arange(0, BLOCK_M)).to(tl.int32)
        o_m = o_m32.to(tl.int64)
        m_row = o_m32 < L32
        m_q = m_row[:, None] & m_d[None, :]
        if TMA:  # (p_q, p_do: descriptors of the head's rows [0, L): rows past L read 0)
            b_q = p_q.load([start, 0]).to(DOT_T)
            b_do = p_do.load([start, 0]).to(DOT_T)
        else:
            b_q = tl.load(p_q + o_m[:, None] * stride_q + o_d[None, :], mask=m_q, other=0.0).to(DOT_T)
            b_do = tl.load(p_do + o_m[:, None] * stride_q + o_d[None, :], mask=m_q, other=0.0).to(DOT_T)
        if (MASK_CAUSAL or MASK_WINDOW) and not FINITE_QDO:  # (FINITE_QDO: zeroed by the delta kernel)
            b_q, b_do = _finite_or_zero(b_q), _finite_or_zero(b_do)
        if TMA:  # (int32 offsets; delta is loaded later)
            b_lse = tl.load(p_lse + o_m32, mask=m_row, other=float("inf"))
        else:
            b_lse = tl.load(p_lse + o_m, mask=m_row, other=float("inf"))
            b_delta = tl.load(p_delta + o_m, mask=m_row, other=0.0)
        b_st, b_tt = _scores(tl.dot(b_k, tl.trans(b_q), input_precision=PREC), qk_scale, cap, SOFTCAP)
        b_pt = _exp2_shifted(b_st, b_tt, qk_scale, b_lse[None, :], SOFTCAP)
        if MASK_WINDOW:
            m_att = _in_window(o_m32[None, :], o_n[:, None], win_left, win_right)
            if ATOMIC_DQ:  # (a right window reaches past the end; keys < L only matter for dQ)
                m_att = m_att & (o_n[:, None] < L32)
        elif MASK_CAUSAL:  # (keys >= L are after every query < L)
            m_att = o_m32[None, :] >= o_n[:, None]
        else:
            m_att = o_n[:, None] < L32
        if MASK_CAUSAL or MASK_LEN or MASK_WINDOW:
            b_pt = tl.where(m_att, b_pt, 0.0)
        # (q, k, v and dO share one dtype; p_q / p_do may be descriptors)
        b_dv += tl.dot(_cast(b_pt, p_v.dtype.element_ty, INTERPRET).to(DOT_T), b_do, input_precision=PREC)
        if DP_F64:  # dP - delta in fp64, then fp32 (lse.delta_dtype)
            b_dpt = _dot_f64(p_v, o_n.to(tl.int64) * stride_kv, o_n < L32, p_do, o_m * stride_q, m_row,
                             MASK_CAUSAL or MASK_WINDOW, HEAD_DIM, BLOCK_D, b_k.shape[0], BLOCK_M) - b_delta[None, :]
        elif TMA:  # delta loaded only now (held across the S^T and dV products it spilled), dP accumulated
            b_delta = tl.load(p_delta + o_m32, mask=m_row, other=0.0)  # onto -delta: no second fp32 tile
            b_dpt = tl.dot(b_v, tl.trans(b_do), tl.zeros_like(b_st) - b_delta[None, :], input_precision=PREC)
        else:
            b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision=PREC) - b_delta[None, :]
        b_dst = _dsoftcap(b_pt * b_dpt.to(tl.float32), b_tt, SOFTCAP)
        # A query's NaN lse / delta must not reach the keys it does not attend: there P is exactly 0. Keyed
        # on P, not on the mask, which would stay live in registers across the dP product (spills); an
        # attended P that underflowed to 0 then drops a non-finite dP too, whose inputs nan.py marks anyway.
        if MASK_CAUSAL or MASK_WINDOW:
            b_dst = tl.where(b_pt != 0.0, b_dst, 0.0)
        b_dst = _cast(b_dst, p_v.dtype.element_ty, INTERPRET).to(DOT_T)
        b_dk += tl.dot(b_dst, b_q, input_precision=PREC)
        if ATOMIC_DQ:  # (b_k comes with non-finite entries zeroed where tiles are masked: see the kernel)
            b_dq = tl.dot(tl.trans(b_dst), b_k, input_precision=PREC) * sm_scale
            if TMA and not INTERPRET:  # (the interpreter has no descriptor atomics: p_dq stays a pointer)
                p_dq.atomic_add([start, 0], b_dq)
            else:
                tl.atomic_add(p_dq + o_m[:, None] * stride_q + o_d[None, :], b_dq, mask=m_q, sem="relaxed")
    return b_dk, b_dv


# reset_to_zero: timing a config adds into the dQ buffer (ATOMIC_DQ); the autotuner zeroes it
# before each timed run and before the run that counts.
@triton.autotune(configs=_inner_configs("dkdv", "BLOCK_M"),
                 key=["HEAD_DIM", "IS_CAUSAL", "LOCAL", "SOFTCAP", "ATOMIC_DQ", "DOT_T", *LENGTH_KEY],
                 prune_configs_by=_prune("dkdv", "BLOCK_M"), reset_to_zero=["p_dq"])
@triton.jit(do_not_specialize=LENGTH_KEY)
def _varlen_attention_bwd_dkdv_kernel(
    p_q, p_k, p_v, p_do, p_lse, p_delta, p_dk, p_dv, p_dq, p_cu, p_work, T, Hkv, GROUP, qk_scale, sm_scale,
    cap, win_left, win_right, len_bucket, tok_bucket,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, LOCAL: tl.constexpr, SOFTCAP: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    DOT_T: tl.constexpr, PREC: tl.constexpr, DP_F64: tl.constexpr, INTERPRET: tl.constexpr, FINITE_QDO: tl.constexpr,
    TMA: tl.constexpr,
):
    """dK, dV of one (key block, KV head): loops over the GROUP query heads sharing the KV
    head and over their query blocks, summing in registers; one writer per element, so
    dK / dV are deterministic and need no atomics or zero-init. ``ATOMIC_DQ`` (flash-attn's
    ``deterministic=False``): dQ too, added with fp32 atomics into the zeroed buffer ``p_dq``
    (5 matmuls per tile pair in all instead of 7 with the separate dQ kernel; the order of the
    atomic adds, hence dQ's last bits, varies from run to run)."""
    i_b, i_hk, i_n, bos, L, o_n, o_d, _, m_kv = _program_block(p_work, p_cu, Hkv, BLOCK_N, HEAD_DIM, BLOCK_D)
    if i_b < 0:
        return
    stride_q = Hkv * GROUP * HEAD_DIM
    stride_kv = Hkv * HEAD_DIM

    o_kv = (bos + o_n)[:, None] * stride_kv + i_hk * HEAD_DIM + o_d[None, :]
    b_k = tl.load(p_k + o_kv, mask=m_kv, other=0.0).to(DOT_T)
    if (IS_CAUSAL or LOCAL) and ATOMIC_DQ:
        # dQ += dS @ K over a masked tile reaches queries that do not attend every key of the block,
        # where a non-finite key would turn their zero dS into NaN. Zeroed once here, not per tile
        # (which would keep a second K tile live); the op marks that key's own dK / dV NaN anyway.
        b_k = _finite_or_zero(b_k)
    b_v = tl.load(p_v + o_kv, mask=m_kv, other=0.0).to(DOT_T)
    b_dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Causal: queries on the block's diagonal see part of it (masked [lo, mid)), later ones all of it.
    L32 = L.to(tl.int32)
    if TMA:  # int32 query positions: an int64 loop variable hoisted an int64 arange into registers (spills)
        L_q, i_q = L32, i_n.to(tl.int32)
    else:
        L_q, i_q = L, i_n
    lo = i_q * BLOCK_N if IS_CAUSAL else 0
    mid = tl.minimum(lo + BLOCK_N, L_q) if IS_CAUSAL else 0
    o_k = i_n.to(tl.int32) * BLOCK_N + tl.arange(0, BLOCK_N)  # int32 for the masks: int64 ones take registers
    for g in range(GROUP):
        i_h = (i_hk * GROUP + g).to(tl.int64)
        p_qh = p_q + bos * stride_q + i_h * HEAD_DIM
        p_doh = p_do + bos * stride_q + i_h * HEAD_DIM
        p_lseh = p_lse + i_h * T + bos
        p_vh = p_v + bos * stride_kv + i_hk * HEAD_DIM
        p_deltah = p_delta + i_h * T + bos
        p_dqh = p_dq + bos * stride_q + i_h * HEAD_DIM
        if TMA:  # tensor descriptors (TMA loads into shared memory): no per-element addresses in registers
            p_qh = _rows_desc(p_qh, L32, stride_q, BLOCK_M, HEAD_DIM, BLOCK_D)
            p_doh = _rows_desc(p_doh, L32, stride_q, BLOCK_M, HEAD_DIM, BLOCK_D)
            if ATOMIC_DQ and not INTERPRET:
                p_dqh = _rows_desc(p_dqh, L32, stride_q, BLOCK_M, HEAD_DIM, BLOCK_D)
        if LOCAL:  # sliding window: the queries that see some key of the block, all masked
            w_lo, w_hi = _window_range(i_q * BLOCK_N, BLOCK_N, win_right, win_left, L_q)
            b_dk, b_dv = _dkdv_inner(
                b_dk, b_dv, b_k, b_v, p_vh, stride_kv, p_qh, p_doh, p_lseh, p_deltah, p_dqh, stride_q, o_k,
                lo=w_lo, hi=w_hi, L=L, qk_scale=qk_scale, sm_scale=sm_scale, cap=cap, win_left=win_left,
                win_right=win_right, SOFTCAP=SOFTCAP, ATOMIC_DQ=ATOMIC_DQ, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                BLOCK_M=BLOCK_M, DOT_T=DOT_T, PREC=PREC, DP_F64=DP_F64, INTERPRET=INTERPRET,
                FINITE_QDO=FINITE_QDO, TMA=TMA, MASK_WINDOW=True)
        else:
            # Causal: the diagonal's masked steps [lo, mid), then [mid, L). FINITE_QDO: one masked loop over
            # [lo, L) instead; as two loops the wide tiles spilled (NOTES.md, "Hopper retiling").
            if IS_CAUSAL:
                b_dk, b_dv = _dkdv_inner(
                    b_dk, b_dv, b_k, b_v, p_vh, stride_kv, p_qh, p_doh, p_lseh, p_deltah, p_dqh, stride_q, o_k,
                    lo=lo, hi=L_q if FINITE_QDO else mid, L=L, qk_scale=qk_scale, sm_scale=sm_scale, cap=cap,
                    win_left=win_left, win_right=win_right, SOFTCAP=SOFTCAP, ATOMIC_DQ=ATOMIC_DQ, HEAD_DIM=HEAD_DIM,
                    BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, DOT_T=DOT_T, PREC=PREC, DP_F64=DP_F64, INTERPRET=INTERPRET,
                    FINITE_QDO=FINITE_QDO, TMA=TMA, MASK_CAUSAL=True)
            # Not causal, with atomic dQ: padded keys masked (MASK_LEN) in the one loop; an instantiation for the
            # last block alone spilled 144 B at D = 128. Causal: a partial key block has mid = L.
            if not (IS_CAUSAL and FINITE_QDO):
                b_dk, b_dv = _dkdv_inner(
                    b_dk, b_dv, b_k, b_v, p_vh, stride_kv, p_qh, p_doh, p_lseh, p_deltah, p_dqh, stride_q, o_k,
                    lo=mid, hi=L_q, L=L, qk_scale=qk_scale, sm_scale=sm_scale, cap=cap, win_left=win_left,
                    win_right=win_right, SOFTCAP=SOFTCAP, ATOMIC_DQ=ATOMIC_DQ, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                    BLOCK_M=BLOCK_M, DOT_T=DOT_T, PREC=PREC, DP_F64=DP_F64, INTERPRET=INTERPRET,
                    FINITE_QDO=FINITE_QDO, TMA=TMA, MASK_LEN=ATOMIC_DQ and not IS_CAUSAL)
    b_dk = _cast(b_dk * sm_scale, p_dk.dtype.element_ty, INTERPRET)
    b_dv = _cast(b_dv, p_dv.dtype.element_ty, INTERPRET)
    if TMA:  # (the prologue's scalars, held across the loops, spilled: read again from the work list)
        _, i_hk, i_n, bos, L, _, _, _, _ = _program_block(p_work, p_cu, Hkv, BLOCK_N, HEAD_DIM, BLOCK_D)
        o_head, L32, row = bos * stride_kv + i_hk * HEAD_DIM, L.to(tl.int32), i_n.to(tl.int32) * BLOCK_N
        _rows_desc(p_dk + o_head, L32, stride_kv, BLOCK_N, HEAD_DIM, BLOCK_D).store([row, 0], b_dk)
        _rows_desc(p_dv + o_head, L32, stride_kv, BLOCK_N, HEAD_DIM, BLOCK_D).store([row, 0], b_dv)
    else:
        o_tile = (bos + i_n * BLOCK_N) * stride_kv + i_hk * HEAD_DIM
        _store_rows(p_dk + o_tile, L - i_n * BLOCK_N, stride_kv, b_dk, BLOCK_N, HEAD_DIM, BLOCK_D)
        _store_rows(p_dv + o_tile, L - i_n * BLOCK_N, stride_kv, b_dv, BLOCK_N, HEAD_DIM, BLOCK_D)


@triton.jit
def _dq_inner(b_dq, b_q, b_do, p_do, stride_q, b_lse, b_delta, p_k, p_v, stride_kv, o_m, lo, hi, L, qk_scale, cap,
              win_left, win_right, SOFTCAP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_N: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr, DP_F64: tl.constexpr,
              INTERPRET: tl.constexpr, MASK_CAUSAL: tl.constexpr = False, MASK_LEN: tl.constexpr = False,
              MASK_WINDOW: tl.constexpr = False):
    """Accumulate dQ of one query block over keys [lo, hi) (keys past the end read 0 and
    would get p = exp2(-lse) != 0, hence the MASK_LEN score mask on the tail)."""
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        o_n = start + tl.arange(0, BLOCK_N).to(tl.int64)
        m_kv = (o_n < L)[:, None] & m_d[None, :]
        b_k = tl.load(p_k + o_n[:, None] * stride_kv + o_d[None, :], mask=m_kv, other=0.0).to(DOT_T)
        b_v = tl.load(p_v + o_n[:, None] * stride_kv + o_d[None, :], mask=m_kv, other=0.0).to(DOT_T)
        if MASK_CAUSAL or MASK_WINDOW:
            b_k, b_v = _finite_or_zero(b_k), _finite_or_zero(b_v)
        b_s, b_t = _scores(tl.dot(b_q, tl.trans(b_k), input_precision=PREC), qk_scale, cap, SOFTCAP)
        b_p = _exp2_shifted(b_s, b_t, qk_scale, b_lse[:, None], SOFTCAP)
        if MASK_WINDOW:
            b_p = tl.where(_in_window(o_m[:, None], o_n[None, :], win_left, win_right) & (o_n[None, :] < L), b_p, 0.0)
        elif MASK_CAUSAL:
            b_p = tl.where((o_m[:, None] >= o_n[None, :]) & (o_n[None, :] < L), b_p, 0.0)
        elif MASK_LEN:
            b_p = tl.where(o_n[None, :] < L, b_p, 0.0)
        if DP_F64:  # (as in _dkdv_inner)
            b_dp = _dot_f64(p_do, o_m * stride_q, o_m < L, p_v, o_n * stride_kv, o_n < L, MASK_CAUSAL or MASK_WINDOW,
                            HEAD_DIM, BLOCK_D, b_q.shape[0], BLOCK_N)
        else:
            b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
        b_ds = _dsoftcap(b_p * (b_dp - b_delta[:, None]).to(tl.float32), b_t, SOFTCAP)
        b_dq += tl.dot(_cast(b_ds, p_k.dtype.element_ty, INTERPRET).to(DOT_T), b_k, input_precision=PREC)
    return b_dq


@triton.autotune(configs=_inner_configs("dq", "BLOCK_N"),
                 key=["HEAD_DIM", "IS_CAUSAL", "LOCAL", "SOFTCAP", "DOT_T", *LENGTH_KEY],
                 prune_configs_by=_prune("dq", "BLOCK_N"))
@triton.jit(do_not_specialize=LENGTH_KEY)
def _varlen_attention_bwd_dq_kernel(
    p_q, p_k, p_v, p_do, p_lse, p_delta, p_dq, p_cu, p_work, T, Hq, GROUP, qk_scale, sm_scale,
    cap, win_left, win_right, len_bucket, tok_bucket,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, LOCAL: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_T: tl.constexpr, PREC: tl.constexpr, DP_F64: tl.constexpr, INTERPRET: tl.constexpr,
):
    """dQ of one (query block, query head), recomputing P from the saved lse: two extra
    matmuls instead of an fp32 atomic dQ buffer (deterministic, no zero-init, no cast)."""
    i_b, i_h, i_m, bos, L, o_m, o_d, m_row, m_q = _program_block(p_work, p_cu, Hq, BLOCK_M, HEAD_DIM, BLOCK_D)
    if i_b < 0:
        return
    stride_q = Hq * HEAD_DIM
    stride_kv = (Hq // GROUP) * HEAD_DIM
    p_kh = p_k + bos * stride_kv + (i_h // GROUP) * HEAD_DIM
    p_vh = p_v + bos * stride_kv + (i_h // GROUP) * HEAD_DIM

    o_q = (bos + o_m)[:, None] * stride_q + i_h * HEAD_DIM + o_d[None, :]
    b_q = tl.load(p_q + o_q, mask=m_q, other=0.0).to(DOT_T)
    b_do = tl.load(p_do + o_q, mask=m_q, other=0.0).to(DOT_T)
    p_doh = p_do + bos * stride_q + i_h * HEAD_DIM
    o_stat = i_h.to(tl.int64) * T + bos + o_m
    b_lse = tl.load(p_lse + o_stat, mask=m_row, other=float("inf"))
    b_delta = tl.load(p_delta + o_stat, mask=m_row, other=0.0)
    b_dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if LOCAL:
        lo, hi = _window_range(i_m * BLOCK_M, BLOCK_M, win_left, win_right, L)
        b_dq = _dq_inner(
            b_dq, b_q, b_do, p_doh, stride_q, b_lse, b_delta, p_kh, p_vh, stride_kv, o_m, lo=lo, hi=hi, L=L,
            qk_scale=qk_scale, cap=cap, win_left=win_left, win_right=win_right, SOFTCAP=SOFTCAP, HEAD_DIM=HEAD_DIM,
            BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, DOT_T=DOT_T, PREC=PREC, DP_F64=DP_F64, INTERPRET=INTERPRET,
            MASK_WINDOW=True)
    else:  # unmasked [0, mid), then masked [mid, hi), as in the forward kernel
        mid = i_m * BLOCK_M if IS_CAUSAL else (L // BLOCK_N) * BLOCK_N
        hi = tl.minimum(mid + BLOCK_M, L) if IS_CAUSAL else L
        b_dq = _dq_inner(
            b_dq, b_q, b_do, p_doh, stride_q, b_lse, b_delta, p_kh, p_vh, stride_kv, o_m, lo=0, hi=mid, L=L,
            qk_scale=qk_scale, cap=cap, win_left=win_left, win_right=win_right, SOFTCAP=SOFTCAP, HEAD_DIM=HEAD_DIM,
            BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, DOT_T=DOT_T, PREC=PREC, DP_F64=DP_F64, INTERPRET=INTERPRET)
        b_dq = _dq_inner(
            b_dq, b_q, b_do, p_doh, stride_q, b_lse, b_delta, p_kh, p_vh, stride_kv, o_m, lo=mid, hi=hi, L=L,
            qk_scale=qk_scale, cap=cap, win_left=win_left, win_right=win_right, SOFTCAP=SOFTCAP, HEAD_DIM=HEAD_DIM,
            BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, DOT_T=DOT_T, PREC=PREC, DP_F64=DP_F64, INTERPRET=INTERPRET,
            MASK_CAUSAL=IS_CAUSAL, MASK_LEN=True)
    _store_rows(p_dq + (bos + i_m * BLOCK_M) * stride_q + i_h * HEAD_DIM, L - i_m * BLOCK_M, stride_q,
                _cast(b_dq * sm_scale, p_dq.dtype.element_ty, INTERPRET), BLOCK_M, HEAD_DIM, BLOCK_D)
