"""Flash-attention-2 style Triton forward of ``varlen_attention`` and the jit helpers both passes share;
the backward kernels (delta preprocess, dK/dV with optional atomic dQ, dQ) are in :mod:`.triton_bwd`.

Names follow FLA: ``p_`` pointers, ``o_`` offsets, ``m_`` masks, ``b_`` block (register) tensors,
``i_`` program indices. Scores and lse are in base-2 units throughout (one MUFU ex2 per exponential;
the softmax scale arrives folded with log2(e)); the lse is fp64 for fp32 inputs (see ``_exp2_shifted``).
The launchers are in :mod:`.launch`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .tiles import LENGTH_KEY, _inner_configs, _prune


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
def _store_rows(p_base, n_rows, stride, b_x, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store the ``[BLOCK_R, BLOCK_D]`` tile ``b_x`` to rows ``p_base + r * stride``, r < ``n_rows``, columns
    < HEAD_DIM. Offsets and mask are rebuilt here from scalars: an epilogue that reused the prologue's
    ``[rows, D]`` int64 offsets kept them live in registers across the main loop (spills)."""
    o_r = tl.arange(0, BLOCK_R)
    o_d = tl.arange(0, BLOCK_D)
    tl.store(p_base + o_r[:, None] * stride + o_d[None, :], b_x,
             mask=(o_r < n_rows)[:, None] & (o_d < HEAD_DIM)[None, :])


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


@triton.autotune(configs=_inner_configs("fwd", "BLOCK_N"),
                 key=["HEAD_DIM", "IS_CAUSAL", "LOCAL", "SOFTCAP", "DOT_T", *LENGTH_KEY],
                 prune_configs_by=_prune("fwd", "BLOCK_N"))
@triton.jit(do_not_specialize=LENGTH_KEY)
def _varlen_attention_fwd_kernel(
    p_q, p_k, p_v, p_o, p_lse, p_cu, p_work, T, Hq, GROUP, qk_scale, cap, win_left, win_right, len_bucket, tok_bucket,
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
