"""Flash-attention-2 style Triton kernels of ``varlen_attention``: forward, the backward's delta
preprocess, dK/dV (optionally with dQ by atomics) and dQ.

Names follow FLA: ``p_`` pointers, ``o_`` offsets, ``m_`` masks, ``b_`` block (register) tensors,
``i_`` program indices. Scores and lse are in base-2 units throughout (one MUFU ex2 per exponential;
the softmax scale arrives folded with log2(e)); the lse is fp64 for fp32 inputs (see ``_exp2_shifted``).
The launchers are in :mod:`.launch`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .tiles import _inner_configs, _prune


# --------------------------------------------------------------------------- shared helpers
@triton.jit
def _cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``x.to(dtype)`` rounding to nearest even. GPU casts round; the 3.9 interpreter
    truncates fp32 -> bf16 (twice the error), so there the fp32 bits are rounded first and
    the truncation is then exact."""
    if INTERPRET and dtype == tl.bfloat16:
        b_bits = x.to(tl.uint32, bitcast=True)
        b_bits = (b_bits + 0x7FFF + ((b_bits >> 16) & 1)) & 0xFFFF0000
        x = b_bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _finite_or_zero(x):
    """``x`` with non-finite entries read as 0. For the diagonal blocks' tiles, where a query row
    does not attend every key the tile holds: a masked key's inf / NaN would still reach the row
    through a zero probability (0 * inf = NaN). What does attend it is marked NaN by the op."""
    return tl.where(tl.abs(x) < float("inf"), x, 0.0).to(x.dtype)


@triton.jit
def _tanh(x):
    """fp32 tanh without libdevice (the interpreter has none): an odd Taylor polynomial for
    |x| < 0.4, where 1 - 2 / (e^2x + 1) would lose x's leading digits to cancellation (the
    polynomial's first omitted term is < 1e-8 relative there), that form beyond. NaN stays NaN."""
    x2 = x * x
    b_poly = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * (0.021869488536155203 + x2 * (-0.008863235529902197
                                                               + x2 * 0.003592128036572481))))))
    b_big = 1.0 - 2.0 / (tl.exp2(tl.abs(x) * 2.8853900817779268) + 1.0)  # 2 * log2(e)
    return tl.where(tl.abs(x) < 0.4, b_poly, tl.where(x < 0, -b_big, b_big))


@triton.jit
def _scores(b_qk, qk_scale, cap, SOFTCAP: tl.constexpr):
    """(base-2 scores, tanh term) of raw dot products. Without SOFTCAP ``qk_scale`` is
    scale * log2(e); with it (flash-attn / Gemma 2: softcap * tanh(scale * q.k / softcap))
    ``qk_scale`` is scale / softcap and ``cap`` softcap * log2(e), and the tanh term is what
    the backward's chain rule needs (1 - t^2)."""
    if SOFTCAP:
        b_t = _tanh(b_qk * qk_scale)
        return cap * b_t, b_t
    else:
        return b_qk * qk_scale, b_qk


@triton.jit
def _fwd_scores(b_q, b_k, qk_scale, cap, SOFTCAP: tl.constexpr, PREC: tl.constexpr):
    """(scores, the scale exp2's FMA still applies) of a key block, for both forwards. Without SOFTCAP the
    scores stay raw and the scale enters through the max (qk_scale > 0, so max(s) * scale is the max of
    the scaled scores) and exp2's FMA: scaling Q would round it again."""
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)  # (named: aot.py reads dots by their variable)
    if SOFTCAP:
        b_s, _ = _scores(b_s, qk_scale, cap, SOFTCAP)
        return b_s, 1.0
    else:
        return b_s, qk_scale


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
def _store_rows(p_base, n_rows, stride, b_x, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store the ``[BLOCK_R, BLOCK_D]`` tile ``b_x`` to rows ``p_base + r * stride``, r < ``n_rows``, columns
    < HEAD_DIM. Offsets and mask are rebuilt here from scalars: an epilogue that reused the prologue's
    ``[rows, D]`` int64 offsets kept them live in registers across the main loop (spills)."""
    o_r = tl.arange(0, BLOCK_R)
    o_d = tl.arange(0, BLOCK_D)
    tl.store(p_base + o_r[:, None] * stride + o_d[None, :], b_x,
             mask=(o_r < n_rows)[:, None] & (o_d < HEAD_DIM)[None, :])


@triton.jit
def _rows_desc(p_base, n_rows, stride, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tensor descriptor of the ``[n_rows, HEAD_DIM]`` rows ``p_base + r * stride`` in ``[BLOCK_R, BLOCK_D]``
    blocks (reads past its bounds give 0, writes there are dropped). ``p_base`` and ``stride`` 16-byte aligned."""
    return tl.make_tensor_descriptor(p_base, shape=[n_rows, HEAD_DIM], strides=[stride, 1],
                                     block_shape=[BLOCK_R, BLOCK_D])


@triton.jit
def _in_window(o_q, o_k, win_left, win_right):
    """Sliding window (flash-attn's window_size within one sequence): query i sees key j iff
    i - left <= j <= i + right (causal: right = 0; unbounded sides arrive as >= the length)."""
    return (o_k >= o_q - win_left) & (o_k <= o_q + win_right)


@triton.jit
def _window_range(start, BLOCK: tl.constexpr, before, after, L):
    """[lo, hi): the rows from ``before`` ahead of the block [start, start + BLOCK) to ``after``
    past it, clipped to the sequence [0, L)."""
    return tl.maximum(start - before, 0), tl.minimum(start + BLOCK + after, L)


@triton.jit
def _program_block(p_work, p_cu, HEADS, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The prologue of the three blocked kernels: this program's (sequence, block) entry of the work
    list and head (the 1-D grid runs heads fastest, so the first entries' blocks of every head start
    first), then its rows. Returns (sequence, head, block, bos, L, o_r, o_d, m_r, m_rd): the sequence
    is -1 for a padding entry of the upper-bound work list (its caller returns; it reads sequence 0's
    bounds meanwhile), bos / L its first token and length, ``o_r`` the block's rows, ``o_d`` the
    head-dim columns, ``m_r`` rows < L, ``m_rd`` that and columns < HEAD_DIM."""
    i_pid = tl.program_id(0)
    i_w = i_pid // HEADS
    i_b = tl.load(p_work + 2 * i_w)
    i_blk = tl.load(p_work + 2 * i_w + 1).to(tl.int64)
    i_s = tl.maximum(i_b, 0)
    bos = tl.load(p_cu + i_s).to(tl.int64)
    L = tl.load(p_cu + i_s + 1).to(tl.int64) - bos
    o_r = i_blk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_r = o_r < L
    return i_b, i_pid % HEADS, i_blk, bos, L, o_r, o_d, m_r, m_r[:, None] & (o_d < HEAD_DIM)[None, :]


# --------------------------------------------------------------------------- forward
@triton.jit
def _fwd_inner(b_acc, b_l, b_m, b_q, p_k, p_v, stride_kv, o_m, lo, hi, L, qk_scale, cap, win_left, win_right,
               SOFTCAP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
               DOT_T: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr,
               MASK_CAUSAL: tl.constexpr = False, MASK_LEN: tl.constexpr = False, MASK_WINDOW: tl.constexpr = False):
    """Online softmax over keys [lo, hi); score masks exist only in the diagonal / tail
    instantiations (MASK_CAUSAL / MASK_LEN) and the sliding-window one (MASK_WINDOW, which also
    masks the length). Loads always predicate rows < L (one compare per row), so no
    instantiation can read the next sequence."""
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    L32 = L.to(tl.int32)
    for start in range(lo, hi, BLOCK_N):
        o_n32 = (start + tl.arange(0, BLOCK_N)).to(tl.int32)  # int32 for the masks (as in _dkdv_inner)
        o_n = o_n32.to(tl.int64)
        m_kv = (o_n32 < L32)[:, None] & m_d[None, :]
        b_k = tl.load(p_k + o_n[:, None] * stride_kv + o_d[None, :], mask=m_kv, other=0.0).to(DOT_T)
        b_v = tl.load(p_v + o_n[:, None] * stride_kv + o_d[None, :], mask=m_kv, other=0.0)
        if MASK_CAUSAL or MASK_WINDOW:
            b_v = _finite_or_zero(b_v)  # (the score mask below replaces a masked key's NaN score)
        b_s, b_scale = _fwd_scores(b_q, b_k, qk_scale, cap, SOFTCAP=SOFTCAP, PREC=PREC)
        if MASK_WINDOW:
            b_s = tl.where(_in_window(o_m[:, None], o_n32[None, :], win_left, win_right) & (o_n32[None, :] < L32),
                           b_s, float("-inf"))
        elif MASK_CAUSAL:
            b_s = tl.where((o_m[:, None] >= o_n32[None, :]) & (o_n32[None, :] < L32), b_s, float("-inf"))
        elif MASK_LEN:
            b_s = tl.where(o_n32[None, :] < L32, b_s, float("-inf"))
        b_acc, b_l, b_m = _softmax_step(b_acc, b_l, b_m, b_s, b_scale, b_v, DOT_T=DOT_T, PREC=PREC,
                                        INTERPRET=INTERPRET, MASKED=MASK_CAUSAL or MASK_LEN or MASK_WINDOW)
    return b_acc, b_l, b_m


@triton.jit
def _softmax_step(b_acc, b_l, b_m, b_s, b_scale, b_v, DOT_T: tl.constexpr, PREC: tl.constexpr,
                  INTERPRET: tl.constexpr, MASKED: tl.constexpr):
    """One key block of the online softmax (both forwards): running max, sum and output updated with
    the block's scores ``b_s`` (scaled by ``b_scale`` inside exp2's FMA, -inf where MASKED out)."""
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1) * b_scale)
    if MASKED:
        # A row that has seen only masked keys keeps m = -inf; shifting by 0 instead
        # gives p = 0 and alpha = 0 rather than exp2(-inf + inf) = NaN.
        b_shift = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    else:
        b_shift = b_m_new
    b_p = tl.exp2(tl.fma(b_s, b_scale, -b_shift[:, None]))  # one rounding (see _shifted)
    b_alpha = tl.exp2(b_m - b_shift)
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    # P is rounded to the input dtype as flash attention does, then fed as DOT_T.
    b_pv = tl.dot(_cast(b_p, b_v.dtype, INTERPRET).to(DOT_T), b_v.to(DOT_T), input_precision=PREC)
    return b_acc * b_alpha[:, None] + b_pv, b_l, b_m_new


@triton.autotune(configs=_inner_configs("fwd", "BLOCK_N"), key=["HEAD_DIM", "IS_CAUSAL", "LOCAL", "SOFTCAP", "DOT_T"],
                 prune_configs_by=_prune("fwd", "BLOCK_N"))
@triton.jit
def _varlen_attention_fwd_kernel(
    p_q, p_k, p_v, p_o, p_lse, p_cu, p_work, T, Hq, GROUP, qk_scale, cap, win_left, win_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, LOCAL: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_T: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One (query block, query head) per program."""
    i_b, i_h, i_m, bos, L, o_m, o_d, m_row, m_q = _program_block(p_work, p_cu, Hq, BLOCK_M, HEAD_DIM, BLOCK_D)
    if i_b < 0:
        return
    stride_q = Hq * HEAD_DIM
    stride_kv = (Hq // GROUP) * HEAD_DIM
    p_qh = p_q + bos * stride_q + i_h * HEAD_DIM
    p_kh = p_k + bos * stride_kv + (i_h // GROUP) * HEAD_DIM
    p_vh = p_v + bos * stride_kv + (i_h // GROUP) * HEAD_DIM

    o_m32 = o_m.to(tl.int32)  # (_fwd_inner's masks)
    b_q = tl.load(p_qh + o_m[:, None] * stride_q + o_d[None, :], mask=m_q, other=0.0).to(DOT_T)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if LOCAL:  # sliding window: only the keys some row of the block sees, all masked
        lo, hi = _window_range(i_m * BLOCK_M, BLOCK_M, win_left, win_right, L)
        b_acc, b_l, b_m = _fwd_inner(
            b_acc, b_l, b_m, b_q, p_kh, p_vh, stride_kv, o_m32, lo=lo, hi=hi, L=L, qk_scale=qk_scale, cap=cap,
            win_left=win_left, win_right=win_right, SOFTCAP=SOFTCAP, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
            BLOCK_N=BLOCK_N, DOT_T=DOT_T, PREC=PREC, INTERPRET=INTERPRET, MASK_WINDOW=True)
    else:
        # Unmasked keys [0, mid), then masked [mid, hi). Causal: the keys before the block's first row
        # (visible to every row, inside the sequence), then the diagonal block. Else: whole inner
        # blocks, then the tail.
        mid = i_m * BLOCK_M if IS_CAUSAL else (L // BLOCK_N) * BLOCK_N
        hi = tl.minimum(mid + BLOCK_M, L) if IS_CAUSAL else L
        b_acc, b_l, b_m = _fwd_inner(
            b_acc, b_l, b_m, b_q, p_kh, p_vh, stride_kv, o_m32, lo=0, hi=mid, L=L, qk_scale=qk_scale, cap=cap,
            win_left=win_left, win_right=win_right, SOFTCAP=SOFTCAP, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
            BLOCK_N=BLOCK_N, DOT_T=DOT_T, PREC=PREC, INTERPRET=INTERPRET)
        b_acc, b_l, b_m = _fwd_inner(
            b_acc, b_l, b_m, b_q, p_kh, p_vh, stride_kv, o_m32, lo=mid, hi=hi, L=L, qk_scale=qk_scale, cap=cap,
            win_left=win_left, win_right=win_right, SOFTCAP=SOFTCAP, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
            BLOCK_N=BLOCK_N, DOT_T=DOT_T, PREC=PREC, INTERPRET=INTERPRET, MASK_CAUSAL=IS_CAUSAL, MASK_LEN=True)

    b_l_safe = tl.where(b_l == 0.0, 1.0, b_l)
    b_o = b_acc / b_l_safe[:, None]
    _store_rows(p_o + (bos + i_m * BLOCK_M) * stride_q + i_h * HEAD_DIM, L - i_m * BLOCK_M, stride_q,
                _cast(b_o, p_o.dtype.element_ty, INTERPRET), BLOCK_M, HEAD_DIM, BLOCK_D)
    # Base-2 lse, the units the backward recomputes P in (the public function converts); into an fp64
    # p_lse (fp32 inputs) the sum is not rounded to fp32 (see _exp2_shifted).
    if p_lse.dtype.element_ty == tl.float64:
        b_lse = b_m.to(tl.float64) + tl.log2(b_l_safe).to(tl.float64)
    else:
        b_lse = b_m + tl.log2(b_l_safe)
    b_lse = tl.where(b_l == 0.0, float("-inf"), b_lse)
    tl.store(p_lse + i_h.to(tl.int64) * T + bos + o_m, b_lse, mask=m_row)


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
                 key=["HEAD_DIM", "IS_CAUSAL", "LOCAL", "SOFTCAP", "ATOMIC_DQ", "DOT_T"],
                 prune_configs_by=_prune("dkdv", "BLOCK_M"), reset_to_zero=["p_dq"])
@triton.jit
def _varlen_attention_bwd_dkdv_kernel(
    p_q, p_k, p_v, p_do, p_lse, p_delta, p_dk, p_dv, p_dq, p_cu, p_work, T, Hkv, GROUP, qk_scale, sm_scale,
    cap, win_left, win_right,
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


@triton.autotune(configs=_inner_configs("dq", "BLOCK_N"), key=["HEAD_DIM", "IS_CAUSAL", "LOCAL", "SOFTCAP", "DOT_T"],
                 prune_configs_by=_prune("dq", "BLOCK_N"))
@triton.jit
def _varlen_attention_bwd_dq_kernel(
    p_q, p_k, p_v, p_do, p_lse, p_delta, p_dq, p_cu, p_work, T, Hq, GROUP, qk_scale, sm_scale,
    cap, win_left, win_right,
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
