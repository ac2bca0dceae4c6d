"""DAPO policy loss: PPO's clipped surrogate with decoupled clip bounds and dual clip.

Same semantics as verl 0.9.1 ``compute_policy_loss_vanilla`` + ``agg_loss``. Every
aggregation mode is a weighted token sum ``loss = sum_i w_i * mask_i * L_i``: the
weights ``w`` (one scalar for the token modes, one value per token for the seq modes)
are built from the mask with a few vectorised torch ops, and one kernel computes the
per-token loss, the weighted sum and the metric counts; the backward is one more
elementwise kernel, ``d loss / d log_prob_i = w_i * mask_i * dL_i``. Optional rollout
importance-sampling weights ``r`` (verl's ``rollout_is_weights``) scale ``L_i`` and ``dL_i``
inside the same two kernels (one more load per token, no extra pass). The per-token terms,
the weights and the sums are fp64 in both backends; the gradient is written in
``log_prob``'s dtype.
"""
from __future__ import annotations

import math
from typing import Dict, NamedTuple, Optional, Tuple

import numpy as np
import torch
import triton
import triton.language as tl

from .._alloc import empty_output
from .._registry import dispatch, register
from .._validation import (FLOAT_DTYPES, check_cu_seqlens, check_float_or_tensor, check_mask,
                           check_tensor, tracing)
from ..validation import check_clip_ratios as check_clips
from ._triton_utils import cdiv

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# verl clamps the log-ratio to +-20 "for stability": exp(20) is still finite in fp32.
_LOG_RATIO_CLAMP = 20.0
# Tokens per program: a 4 KiB fp32 tile per input keeps loads vectorised; the partial
# sums buffer stays ~N/1024 rows, summed by torch deterministically.
_BLOCK = 1024


class PolicyLossSums(NamedTuple):
    """fp64 0-dim sums over the selected tokens; the custom op returns ``torch.stack(sums)`` (the Triton
    kernel stores them in this field order), read back with ``PolicyLossSums._make(t.unbind())``."""
    loss: torch.Tensor  # sum(w * mask * r * L), r the rollout IS weights (1 without)
    clipped: torch.Tensor  # count
    clipped_lower: torch.Tensor  # count (dual clip)
    neg_log_ratio: torch.Tensor  # sum of -log(ratio), unweighted
    tokens: torch.Tensor  # count


_NUM_SUMS = len(PolicyLossSums._fields)


# --------------------------------------------------------------------------- kernels
# torch's min / max / clamp propagate NaN; Triton's return the other operand (and their
# NaN-propagating flavour has no fp64 instruction to lower to on NVIDIA GPUs), hence these.
@triton.jit
def _max_nan(a, b):
    return tl.where(a != a, a, tl.where(b != b, b, tl.maximum(a, b)))


@triton.jit
def _min_nan(a, b):
    return tl.where(a != a, a, tl.where(b != b, b, tl.minimum(a, b)))


@triton.jit
def _clamp_nan(x, lo, hi):
    return tl.where(x != x, x, tl.minimum(tl.maximum(x, lo), hi))


@triton.jit
def _f64(hi, lo):
    """An fp64 scalar from its two fp32 halves (a float kernel argument is fp32 on the GPU)."""
    return tl.cast(hi, tl.float64) + tl.cast(lo, tl.float64)


@triton.jit
def _pg_token_terms(b_lp, b_old, b_adv, clip_ratio_low, clip_ratio_high, clip_ratio_c):
    """Per-token loss, dL/dlog_prob and the metric indicators (inputs already fp64)."""
    b_d = b_lp - b_old
    b_nkl = _clamp_nan(b_d, -20.0, 20.0)
    b_ratio = tl.exp(b_nkl)
    b_pg1 = -b_adv * b_ratio
    b_pg2 = -b_adv * _clamp_nan(b_ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    b_c1 = _max_nan(b_pg1, b_pg2)
    b_pg3 = -b_adv * clip_ratio_c
    b_neg = b_adv < 0
    b_loss = tl.where(b_neg, _min_nan(b_pg3, b_c1), b_c1)
    # Gradient flows through pg1 where it wins the max (pg2 wins only where the clamp
    # saturates, so its gradient is zero) and not where the dual clip pg3 wins; a non-finite
    # advantage passes its NaN / inf on, as torch's autograd of verl's loss does.
    b_pass = (b_d >= -20.0) & (b_d <= 20.0) & (
        (tl.abs(b_adv) == float("inf")) | (b_adv != b_adv) | ((b_pg1 >= b_pg2) & ((~b_neg) | (b_c1 < b_pg3))))
    b_dl = tl.where(b_pass, b_pg1, 0.0)
    b_clip = (b_pg2 > b_pg1).to(tl.float64)
    b_clip_low = ((b_c1 > b_pg3) & b_neg).to(tl.float64)
    return b_loss, b_dl, b_clip, b_clip_low, b_nkl


@triton.jit
def _load_token_block(p_lp, p_old, p_adv, p_mask, p_w, i_b, n_tok, W_STRIDE: tl.constexpr, BLOCK: tl.constexpr):
    """Offsets, bounds mask and the block's tokens as fp64 (mask as bool).

    fp64 token math: free next to the loads, and the loss sums terms of both signs whose
    fp32 rounding errors would dominate its error."""
    o_t = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m_t = o_t < n_tok
    b_lp = tl.load(p_lp + o_t, mask=m_t, other=0).to(tl.float64)
    b_old = tl.load(p_old + o_t, mask=m_t, other=0).to(tl.float64)
    b_adv = tl.load(p_adv + o_t, mask=m_t, other=0).to(tl.float64)
    b_m = tl.load(p_mask + o_t, mask=m_t, other=0) != 0
    b_w = tl.load(p_w + o_t * W_STRIDE, mask=m_t, other=0).to(tl.float64)
    return o_t, m_t, b_lp, b_old, b_adv, b_m, b_w


@triton.jit
def _policy_loss_fwd_kernel(
    p_lp, p_old, p_adv, p_mask, p_w, p_is, p_part, n_tok, clip_low_hi, clip_low_lo, clip_high_hi,
    clip_high_lo, clip_c_hi, clip_c_lo,
    W_STRIDE: tl.constexpr, HAS_IS: tl.constexpr, BLOCK: tl.constexpr, NUM_SUMS: tl.constexpr,
):
    """This block's partial sums into row ``i_b`` of ``p_part``, in PolicyLossSums' field order."""
    i_b = tl.program_id(0)
    o_t, m_t, b_lp, b_old, b_adv, b_m, b_w = _load_token_block(p_lp, p_old, p_adv, p_mask, p_w, i_b, n_tok,
                                                               W_STRIDE, BLOCK)
    b_m = b_m.to(tl.float64)
    b_loss, b_dl, b_clip, b_clip_low, b_nkl = _pg_token_terms(
        b_lp, b_old, b_adv, _f64(clip_low_hi, clip_low_lo), _f64(clip_high_hi, clip_high_lo),
        _f64(clip_c_hi, clip_c_lo))
    if HAS_IS:  # verl: pg_losses * rollout_is_weights, before the aggregation
        b_loss = b_loss * tl.load(p_is + o_t, mask=m_t, other=0).to(tl.float64)
    p_out = p_part + i_b.to(tl.int64) * NUM_SUMS
    tl.store(p_out + 0, tl.sum(tl.where(b_m > 0, b_w * b_loss, 0.0), axis=0))
    tl.store(p_out + 1, tl.sum(b_m * b_clip, axis=0))
    tl.store(p_out + 2, tl.sum(b_m * b_clip_low, axis=0))
    tl.store(p_out + 3, tl.sum(tl.where(b_m > 0, -b_nkl, 0.0), axis=0))  # selected away, as NaN * 0 is not
    tl.store(p_out + 4, tl.sum(b_m, axis=0))


@triton.jit
def _policy_loss_bwd_kernel(
    p_g, p_lp, p_old, p_adv, p_mask, p_w, p_is, p_dlp, n_tok, clip_low_hi, clip_low_lo, clip_high_hi,
    clip_high_lo, clip_c_hi, clip_c_lo,
    W_STRIDE: tl.constexpr, HAS_IS: tl.constexpr, BLOCK: tl.constexpr,
):
    i_b = tl.program_id(0)
    o_t, m_t, b_lp, b_old, b_adv, b_m, b_w = _load_token_block(p_lp, p_old, p_adv, p_mask, p_w, i_b, n_tok,
                                                               W_STRIDE, BLOCK)
    b_g = tl.load(p_g).to(tl.float64)
    b_loss, b_dl, b_clip, b_clip_low, b_nkl = _pg_token_terms(
        b_lp, b_old, b_adv, _f64(clip_low_hi, clip_low_lo), _f64(clip_high_hi, clip_high_lo),
        _f64(clip_c_hi, clip_c_lo))
    if HAS_IS:  # the weights are constants: d (r L) / d lp = r dL
        b_dl = b_dl * tl.load(p_is + o_t, mask=m_t, other=0).to(tl.float64)
    b_grad = tl.where(b_m, b_g * b_w * b_dl, 0.0)
    # Through fp32: triton 3.9's interpreter converts fp64 -> bf16 wrongly (NaN, garbage).
    tl.store(p_dlp + o_t, b_grad.to(tl.float32).to(p_dlp.dtype.element_ty), mask=m_t)


# --------------------------------------------------------------------------- launchers
def _fp32_pair(x: float):
    """``(hi, lo)`` fp32-exact halves of ``x`` with ``hi + lo`` = x to ~2^-48: the kernels rebuild the
    clip ratios in fp64 (their bounds 1 - clip_ratio_low etc. must not round to fp32)."""
    hi = float(np.float32(x))
    return hi, float(np.float32(x - hi))


def _clip_args(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float):
    return (*_fp32_pair(clip_ratio_low), *_fp32_pair(clip_ratio_high), *_fp32_pair(clip_ratio_c))


def _dense(*ts: torch.Tensor):
    """The kernels address token ``i`` of every input at offset ``i``."""
    return [t.contiguous() for t in ts]


def _token_args(lp, old, adv, mask, w, is_w):
    """The kernels' token pointers and constexprs; without IS weights ``lp`` stands in (never read)."""
    lp, old, adv, mask, w = _dense(lp, old, adv, mask, w)
    ptrs = [lp, old, adv, mask.view(torch.uint8), w, lp if is_w is None else is_w.contiguous()]
    return ptrs, dict(W_STRIDE=int(w.numel() != 1), HAS_IS=is_w is not None, BLOCK=_BLOCK)


@register("policy_loss_sums", "triton")
def _sums_triton(lp, old, adv, mask, w, clip_ratio_low, clip_ratio_high, clip_ratio_c, is_w=None):
    ptrs, meta = _token_args(lp, old, adv, mask, w, is_w)
    n = lp.numel()
    part = empty_output((max(cdiv(n, _BLOCK), 1), _NUM_SUMS), dtype=torch.float64, device=lp.device)
    if n == 0:
        return part.zero_()[0]
    _policy_loss_fwd_kernel[(cdiv(n, _BLOCK),)](
        *ptrs, part, n, *_clip_args(clip_ratio_low, clip_ratio_high, clip_ratio_c), NUM_SUMS=_NUM_SUMS, **meta)
    return part.sum(0)


@register("policy_loss_grad", "triton")
def _grad_triton(g, lp, old, adv, mask, w, clip_ratio_low, clip_ratio_high, clip_ratio_c, is_w=None):
    ptrs, meta = _token_args(lp, old, adv, mask, w, is_w)
    n = lp.numel()
    dlp = empty_output(lp.shape, dtype=lp.dtype, device=lp.device)
    if n:
        _policy_loss_bwd_kernel[(cdiv(n, _BLOCK),)](
            g.reshape(1), *ptrs, dlp, n, *_clip_args(clip_ratio_low, clip_ratio_high, clip_ratio_c), **meta)
    return dlp


def pg_token_terms(lp, old, adv, clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float):
    """Torch twin of the kernels' ``_pg_token_terms``: fp64 (loss, dL/dlp, clip, clip_lower, log-ratio).

    fp64 because the loss sums terms of both signs (log-ratios reach +-20 while their mean is
    ~0.01), where fp32 rounding of each term would dominate; it is cheap next to the loads.
    """
    lp, old, adv = lp.double(), old.double(), adv.double()
    d = lp - old
    nkl = d.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = nkl.exp()
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    c1 = torch.maximum(pg1, pg2)
    pg3 = -adv * clip_ratio_c
    neg = adv < 0
    loss = torch.where(neg, torch.minimum(pg3, c1), c1)
    passes = (d.abs() <= _LOG_RATIO_CLAMP) & (~torch.isfinite(adv) | ((pg1 >= pg2) & (~neg | (c1 < pg3))))
    dl = torch.where(passes, pg1, 0.0)
    return loss, dl, (pg2 > pg1).double(), ((c1 > pg3) & neg).double(), nkl


def is_scaled(loss, dl, is_w):
    """``(r * loss, r * dl)`` for rollout IS weights ``r`` (None or empty: unchanged), in fp64 as the kernels:
    verl multiplies each token's loss by its weight before aggregating, and the weights are constants."""
    if is_w is None or is_w.numel() == 0:
        return loss, dl
    r = is_w.double()
    return loss * r, dl * r


def metric_sums(mask, clip, clip_low, nkl) -> Dict[str, torch.Tensor]:
    """fp64 counts and sum of -log-ratio over the tokens ``mask`` selects, keyed by the sums' field names;
    the others are selected away (a NaN log-ratio there must not reach ``ppo_kl`` through NaN * 0)."""
    m = mask.double()
    return dict(clipped=m @ clip, clipped_lower=m @ clip_low, neg_log_ratio=torch.where(mask, -nkl, 0.0).sum(),
                tokens=m.sum())


@register("policy_loss_sums", "torch")
def _sums_torch(lp, old, adv, mask, w, clip_ratio_low, clip_ratio_high, clip_ratio_c, is_w=None):
    loss, _, clip, clip_low_ind, nkl = pg_token_terms(lp, old, adv, clip_ratio_low, clip_ratio_high, clip_ratio_c)
    loss, _ = is_scaled(loss, loss, is_w)
    wl = torch.where(mask, w.double() * loss, 0.0)
    return torch.stack(PolicyLossSums(loss=wl.sum(), **metric_sums(mask, clip, clip_low_ind, nkl)))


@register("policy_loss_grad", "torch")
def _grad_torch(g, lp, old, adv, mask, w, clip_ratio_low, clip_ratio_high, clip_ratio_c, is_w=None):
    _, dl, _, _, _ = pg_token_terms(lp, old, adv, clip_ratio_low, clip_ratio_high, clip_ratio_c)
    _, dl = is_scaled(dl, dl, is_w)
    return torch.where(mask, g.double() * w.double() * dl, 0.0).to(lp.dtype)


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("dapo::policy_loss_sums", mutates_args=())
def policy_loss_sums(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, w: torch.Tensor,
                     clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float,
                     is_w: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.stack(PolicyLossSums)`` (fp64) over flat ``[N]`` inputs; ``is_w`` the optional rollout IS
    weights ``[N]`` (any float dtype), each token's loss scaled by its weight before the sum.

    Per-token math and sums in fp64 (log-ratio terms reach +-20 while their mean is ~0.01).
    """
    return dispatch("policy_loss_sums", lp.device)(lp, old, adv, mask, w, clip_ratio_low, clip_ratio_high, clip_ratio_c,
                                                   is_w)


@policy_loss_sums.register_fake
def _(lp, old, adv, mask, w, clip_ratio_low, clip_ratio_high, clip_ratio_c, is_w=None):
    return lp.new_empty((_NUM_SUMS,), dtype=torch.float64)


@torch.library.custom_op("dapo::policy_loss_grad", mutates_args=())
def policy_loss_grad(g: torch.Tensor, lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                     w: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float,
                     clip_ratio_c: float, is_w: Optional[torch.Tensor] = None) -> torch.Tensor:
    """d(g * sums.loss) / d lp (``PolicyLossSums``), in lp's dtype."""
    return dispatch("policy_loss_grad", lp.device)(g, lp, old, adv, mask, w, clip_ratio_low, clip_ratio_high,
                                                   clip_ratio_c, is_w)


@policy_loss_grad.register_fake
def _(g, lp, old, adv, mask, w, clip_ratio_low, clip_ratio_high, clip_ratio_c, is_w=None):
    return torch.empty_like(lp)


def _sums_setup(ctx, inputs, output):
    lp, old, adv, mask, w, *clips, is_w = inputs
    ctx.save_for_backward(lp, old, adv, mask, w, is_w)
    ctx.clips = clips


def _sums_backward(ctx, grad):
    lp, old, adv, mask, w, is_w = ctx.saved_tensors
    g = PolicyLossSums._make(grad.unbind()).loss  # the only sum policy_loss differentiates
    dlp = policy_loss_grad(g.contiguous(), lp, old, adv, mask, w, *ctx.clips, is_w)
    # The loss depends on lp - old only; the IS weights are constants (no gradient).
    dold = -dlp if ctx.needs_input_grad[1] else None
    return dlp, dold, None, None, None, None, None, None, None


policy_loss_sums.register_autograd(_sums_backward, setup_context=_sums_setup)


# --------------------------------------------------------------------------- aggregation weights
def _as_count(name: str, value, device, *, positive: bool = False) -> torch.Tensor:
    """A count / divisor (Python number or 1-element tensor) as fp64 0-dim; NaN, inf and negatives
    (and 0 if ``positive``) rejected, a tensor on the device without a host sync."""
    if positive:
        return check_float_or_tensor(name, value, valid=lambda v: (v > 0) & (v < math.inf),
                                     expected="finite and > 0", device=device)
    return check_float_or_tensor(name, value, valid=lambda v: (v >= 0) & (v < math.inf),
                                 expected="finite and >= 0", device=device)


def _nan_if_zero(w: torch.Tensor, count: Optional[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """``w``, or NaN where a given count is 0 while the mask selects tokens: the clamp to 1 would
    silently turn the mean into a sum. No host sync; the trainer's non-finite guard refuses the step
    (a Python 0 is refused before, on the host)."""
    return w if count is None else torch.where((count == 0) & mask.any(), torch.nan, w)


def _not_below_local(raw, count: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``num_tokens`` as given, or NaN where it is below the tokens ``mask`` selects in this call (the
    token mean would be scaled up by their ratio). No host read: a Python number on the CPU is a
    ``ValueError`` (the comparison asserted in place; the count read only to word the error), else
    the NaN loss is refused by the trainer's non-finite guard, as a zero tensor count is."""
    local = mask.sum(dtype=torch.float64)
    if isinstance(raw, (int, float)) and mask.device.type == "cpu" and not tracing():
        try:
            torch._assert_async(count >= local)
        except RuntimeError:
            raise ValueError(f"num_tokens={raw} is below the {int(local)} tokens the mask selects in this call: "
                             f"a global count covers every micro-batch and rank, so it is >= each call's") from None
    return torch.where(count < local, torch.nan, count)


def _seq_lengths(mask: torch.Tensor, cu_seqlens: Optional[torch.Tensor]):
    """(masked tokens per sequence [B], sequence id per token or None, horizon)."""
    if mask.dim() == 2:
        horizon = torch.tensor(float(mask.shape[-1]), dtype=torch.float64, device=mask.device)
        return mask.sum(-1, dtype=torch.float64), None, horizon
    cu = cu_seqlens.long()
    csum = torch.nn.functional.pad(torch.cumsum(mask, 0, dtype=torch.float64), (1, 0))
    lens = cu[1:] - cu[:-1]
    seq_id = torch.repeat_interleave(torch.arange(lens.numel(), device=mask.device), lens, output_size=mask.numel())
    horizon = lens.max().double() if lens.numel() else torch.zeros((), dtype=torch.float64, device=mask.device)
    return csum[cu[1:]] - csum[cu[:-1]], seq_id, horizon


def aggregation_weights(mask: torch.Tensor, mode: str, *, num_tokens=None, num_seqs=None,
                        cu_seqlens: Optional[torch.Tensor] = None, loss_scale_factor=None) -> torch.Tensor:
    """Per-token weights ``w`` with ``loss = sum(w * mask * L)`` for ``mode`` (fp64, 1 or N elements).

    ``mask`` is bool ``[B, T]`` or packed ``[N]`` (then ``cu_seqlens`` for the seq modes).
    Counts that are zero are clamped to 1: an all-masked batch then sums to exactly 0.
    """
    dev = mask.device
    # Every count passed is checked, also where the mode does not use it.
    for name, raw in (("num_tokens", num_tokens), ("num_seqs", num_seqs)):
        if isinstance(raw, (int, float)) and raw == 0 and bool(mask.any()):
            raise ValueError(f"{name}=0 but the mask selects tokens: a global count must be > 0")
    if num_tokens is not None:
        num_tokens = _not_below_local(num_tokens, _as_count("num_tokens", num_tokens, dev), mask)
    if num_seqs is not None:
        num_seqs = _as_count("num_seqs", num_seqs, dev)
    if loss_scale_factor is not None:
        loss_scale_factor = _as_count("loss_scale_factor", loss_scale_factor, dev, positive=True)
    if mode == "token-mean":
        n = mask.sum(dtype=torch.float64) if num_tokens is None else num_tokens
        return _nan_if_zero(1.0 / n.clamp(min=1.0), num_tokens, mask).reshape(1)
    if mode == "token-sum":
        return torch.ones(1, dtype=torch.float64, device=dev)
    lens, seq_id, horizon = _seq_lengths(mask, cu_seqlens)
    present = (lens > 0).double()
    nseq = present.sum() if num_seqs is None else num_seqs
    w_seq = _nan_if_zero(present / nseq.clamp(min=1.0), num_seqs, mask)
    if mode == "seq-mean-token-mean":
        w_seq = w_seq / lens.clamp(min=1.0)
    elif mode == "seq-mean-token-sum-norm":
        # The default horizon is 0 only when every sequence is empty, where w_seq is already 0.
        scale = horizon if loss_scale_factor is None else loss_scale_factor
        w_seq = w_seq / scale.clamp(min=1e-30)
    if seq_id is None:
        return w_seq[:, None].expand(mask.shape).reshape(-1).contiguous()
    return w_seq[seq_id]


# --------------------------------------------------------------------------- public API

def check_agg(mode, shape_like: torch.Tensor, cu_seqlens) -> None:
    """Mode name, and ``cu_seqlens`` present exactly when packed 1-D inputs use a seq mode."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}")
    if shape_like.dim() == 2 and cu_seqlens is not None:
        raise ValueError("cu_seqlens is only for packed 1-D inputs; [B, T] inputs carry their sequences as rows")
    if shape_like.dim() == 1 and mode.startswith("seq") and cu_seqlens is None:
        raise ValueError(f"loss_agg_mode={mode!r} on packed 1-D inputs needs cu_seqlens")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, shape_like.shape[0], device=shape_like.device)


def check_is_weights(rollout_is_weights, like: torch.Tensor) -> Optional[torch.Tensor]:
    """``rollout_is_weights`` as the op's flat, contiguous, detached ``[N]`` (None stays None): a float tensor
    of ``like``'s shape and device. Its values are not read (no host sync): negative or non-finite
    weights reach the loss as given."""
    if rollout_is_weights is None:
        return None
    check_tensor("rollout_is_weights", rollout_is_weights, dtypes=FLOAT_DTYPES, device=like.device,
                 shape=tuple(like.shape))
    return rollout_is_weights.detach().reshape(-1).contiguous()


def metrics_from_counts(clipped, clipped_lower, neg_kl_sum, count) -> Dict[str, torch.Tensor]:
    n = count.clamp(min=1.0)
    return {"pg_clipfrac": (clipped / n).detach().float(), "pg_clipfrac_lower": (clipped_lower / n).detach().float(),
            "ppo_kl": (neg_kl_sum / n).detach().float()}


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    num_tokens=None,
    num_seqs=None,
    cu_seqlens: Optional[torch.Tensor] = None,
    loss_scale_factor=None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Decoupled-clip PPO/DAPO policy loss (verl ``compute_policy_loss_vanilla`` + ``agg_loss``).

    Args:
        log_prob, old_log_prob, advantages: float (fp16/bf16/fp32/fp64) ``[B, T]``, or packed
            ``[N]``; all the same shape. The per-token math and the sums run in fp64
            (whatever the input dtype); the loss and the metrics are returned as fp32.
        response_mask: same shape; bool, integer (nonzero = token in the loss) or float 0 / 1
            (verl's float mask; other values are rejected on the device, not used as weights).
        clip_ratio_low / clip_ratio_high: ratio clipped to ``[1 - low, 1 + high]``.
        clip_ratio_c: dual-clip bound (> 1) for negative advantages.
        loss_agg_mode: ``token-mean``, ``token-sum``, ``seq-mean-token-sum``,
            ``seq-mean-token-mean`` or ``seq-mean-token-sum-norm``.
        num_tokens / num_seqs: global token / sequence counts (int, float or 1-element tensor)
            over all micro-batches and data-parallel ranks, so that summing this loss over them
            gives the global mean (multiply by the DP world size if DP averages gradients, as
            verl's ``dp_size`` does). Default: local counts. Finite and >= 0; a tensor count is
            checked on the device (``RuntimeError`` from ``torch._assert_async``, no host sync).
            ``num_tokens`` below the tokens this call selects (which would scale the loss up) is
            a ``ValueError`` for a Python number on the CPU, else a NaN loss (no host read).
        cu_seqlens: int32/int64 ``[B+1]`` for packed 1-D inputs in the seq modes.
        loss_scale_factor: divisor of ``seq-mean-token-sum-norm`` (default ``T``; packed: the
            longest sequence); finite and > 0, checked like the counts.
        rollout_is_weights: optional float tensor of ``log_prob``'s shape, the rollout
            importance-sampling weights (``dk.rollout_correction``'s, with its masked
            ``response_mask``): each token's loss is multiplied by its weight before the
            aggregation, as verl's ``rollout_is_weights``; constants (detached, no gradient), in
            the same kernels (no extra pass). None: no correction (all ones gives the same bits).
            The metrics stay unweighted, as verl's. Values are not checked (no host read): a
            negative weight flips its token's term, a NaN / inf one makes that token's loss term
            and gradient non-finite (NaN where the gradient would be 0: inf * 0), nothing else.

    Returns:
        ``loss``: fp32 0-dim, differentiable w.r.t. ``log_prob`` (and ``old_log_prob``);
        ``metrics``: detached fp32 0-dim ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``
        (masked means; no host sync). An all-masked batch gives loss 0 and zero gradient.

    NaN / inf, on both backends: in a token the mask selects, as verl's loss under torch's autograd
    (NaN in, NaN loss; the gradient is 0 at a NaN log-ratio, which verl clamps, and NaN / inf for a
    non-finite advantage); in a masked token, nothing: it is selected away (``torch.where``), from
    the loss, the metrics and the gradient.
    """
    check_tensor("log_prob", log_prob, ndim=(1, 2), dtypes=FLOAT_DTYPES)
    for name, t in (("old_log_prob", old_log_prob), ("advantages", advantages)):
        check_tensor(name, t, dtypes=FLOAT_DTYPES, device=log_prob.device, shape=tuple(log_prob.shape))
    mask = check_mask("response_mask", response_mask, device=log_prob.device, shape=tuple(log_prob.shape))
    clips = check_clips(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    check_agg(loss_agg_mode, log_prob, cu_seqlens)
    is_w = check_is_weights(rollout_is_weights, log_prob)
    w = aggregation_weights(mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, cu_seqlens=cu_seqlens,
                            loss_scale_factor=loss_scale_factor)
    flat = [t.reshape(-1).contiguous() for t in (log_prob, old_log_prob, advantages, mask)]
    sums = PolicyLossSums._make(policy_loss_sums(*flat, w, *clips, is_w).unbind())
    return sums.loss.float(), metrics_from_counts(sums.clipped, sums.clipped_lower, sums.neg_log_ratio, sums.tokens)
