"""Rollout correction: verl 0.9.1's ``compute_rollout_correction_and_rejection_mask`` as one op.

The rollout engine's log-probs (``rollout_log_prob``) differ from the trainer's (``old_log_prob``):
other kernels, other precision, or older weights. Per token ``lr = old - rollout``:

* importance-sampling weights (``rollout_is``): ``exp(lr)`` per token or ``exp(sum lr)`` per
  sequence (log-ratios clamped to +-20), truncated at an upper bound (TIS) or zeroed outside
  ``[lower, upper]`` (IcePop), optionally divided by their batch mean;
* rejection sampling (``rollout_rs``): tokens or whole sequences whose divergence estimate
  (``k1 = -lr``, ``k2 = lr^2 / 2``, ``k3 = exp(lr) - 1 - lr``; per token, or a sequence's sum,
  mean or max) leaves its bounds are dropped from the response mask;
* verl's metrics under verl's names (``rollout_corr/...``), as device tensors.

Both backends make two passes over the tokens, sequence by sequence (a padded ``[B, L]`` batch is
``B`` sequences of ``L`` tokens): the first sums each sequence's per-token terms (the
:data:`SUM_COLS` and :data:`MAX_COLS` of a ``[B, C]`` table, fp64), torch code on those ``[B]``
vectors derives the metrics and each sequence's weight / verdict (:func:`finish`), the second
writes the per-token weights and mask. The Triton path runs each pass as one kernel with a
program per sequence; the torch path reduces ``[N, C]`` token tables with ``index_add_``. No
tensor value is read on the host.
"""
from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from .._alloc import empty_output
from .._registry import dispatch, register
from .._validation import FLOAT_DTYPES, check_cu_seqlens, check_flag, check_mask, check_tensor
from .._rollout_spec import (PREFIX, RS_OPTIONS, SAFETY_BOUND, TOKEN_RS, CorrectionParams, make_params,
                            metric_names)
from .policy_loss import _clamp_nan, _max_nan, _min_nan

# Per-sequence sums over the tokens the mask selects; k{j}_* are the token-level rejection options'
# terms (kept / clamped to their bounds for the std / above / below the bounds).
SUM_COLS = ("count", "lr", "old", "rollout", "k3kl", "rho2", "k1", "k2", "k3", "w", "wc", "wc2", "raw",
            "is_high", "is_low", "any_fail") + tuple(
    f"{k}_{s}" for k in ("k1", "k2", "k3") for s in ("fail", "clamp", "clamp2", "high", "low"))
# Per-sequence maxima (a minimum is kept as the maximum of the negated term); -inf if empty, NaN-propagating.
MAX_COLS = ("k1_max", "k2_max", "k3_max", "k1_negmin", "k2_negmin", "k3_negmin", "w_max", "w_negmin")
_NS, _NM = 32, 8  # the kernel's padded widths of the two tables
# Tokens per loop step of a sequence's program: fp64 terms of 256 tokens over 4 warps.
_BLOCK = 256


class RolloutCorrectionResult(NamedTuple):
    """Output of :func:`rollout_correction`, all on the inputs' device (nothing read on the host)."""
    rollout_is_weights: Optional[torch.Tensor]  # input shape, promoted input dtype; None without rollout_is
    response_mask: torch.Tensor  # input shape and dtype, rejected tokens set to 0
    metrics: Dict[str, torch.Tensor]  # verl's keys ("rollout_corr/..."), fp64 0-dim


# --------------------------------------------------------------------------- thresholds
def _thresholds(p: CorrectionParams) -> List[float]:
    """[is_upper, is_lower, then per token option (k1, k2, k3): keep-above, keep-below, clamp-above, on]."""
    out = [p.is_upper, p.is_lower]
    for j, opt in enumerate(TOKEN_RS):
        lo, hi = p.rs_lower[j], p.rs_upper[j]
        on = not math.isnan(hi)
        out += [lo if on else -math.inf, hi if on else math.inf, (lo if j == 0 else 0.0) if on else 0.0, float(on)]
    return out


# --------------------------------------------------------------------------- Triton
@triton.jit
def _seg_max(acc, x, m):
    """``acc`` combined with the max of ``x`` over ``m`` (NaN if any selected ``x`` is NaN)."""
    has_nan = tl.max(((x != x) & m).to(tl.int32), axis=0) > 0
    v = tl.max(tl.where(m, x, float("-inf")), axis=0)
    return _max_nan(acc, tl.where(has_nan, float("nan"), v))


@triton.jit
def _add(acc, cols, k: tl.constexpr, x, m):
    """``acc[k] += sum(x over m)`` (selected with ``tl.where``: a NaN outside ``m`` stays out)."""
    return acc + tl.where(cols == k, tl.sum(tl.where(m, x, 0.0), axis=0), 0.0)


@triton.jit
def _rollout_corr_kernel(p_old, p_roll, p_mask, p_cu, p_thr, p_sums, p_maxs, p_seqw, p_seqkeep, p_factor, p_w,
                         p_keep, ICEPOP: tl.constexpr, LEVEL: tl.constexpr, WRITE: tl.constexpr,
                         OUT_F64: tl.constexpr, NSUM: tl.constexpr, NS: tl.constexpr, NM: tl.constexpr,
                         BLOCK: tl.constexpr):
    """One program per sequence. ``WRITE=False``: its SUM_COLS / MAX_COLS rows (column numbers as in
    those tuples); ``WRITE=True``: its tokens' weights and mask from ``finish``'s per-sequence results."""
    b = tl.program_id(0).to(tl.int64)
    start = tl.load(p_cu + b).to(tl.int64)
    end = tl.load(p_cu + b + 1).to(tl.int64)
    up = tl.load(p_thr + 0)
    lo = tl.load(p_thr + 1)
    cols = tl.arange(0, NS)
    mcols = tl.arange(0, NM)
    acc = tl.zeros([NS], dtype=tl.float64)
    mx = tl.full([NM], float("-inf"), dtype=tl.float64)
    seq_keep = tl.load(p_seqkeep + b) != 0
    factor = tl.load(p_factor)
    seq_w = tl.load(p_seqw + b)
    for s0 in range(start, end, BLOCK):
        o = s0 + tl.arange(0, BLOCK).to(tl.int64)
        m_in = o < end
        old = tl.load(p_old + o, mask=m_in, other=0).to(tl.float64)
        roll = tl.load(p_roll + o, mask=m_in, other=0).to(tl.float64)
        valid = m_in & (tl.load(p_mask + o, mask=m_in, other=0) != 0)
        lr = old - roll
        lrc = _clamp_nan(lr, -20.0, 20.0)
        rho = tl.exp(lrc)
        if ICEPOP:
            w = tl.where((rho >= lo) & (rho <= up), rho, 0.0)
        else:
            w = _min_nan(rho, up)
        fails = o < 0
        for j in tl.static_range(3):
            if j == 0:
                stat = -lrc
            elif j == 1:
                stat = 0.5 * lrc * lrc
            else:
                stat = rho - 1.0 - lrc
            k_lo = tl.load(p_thr + 2 + 4 * j)
            k_hi = tl.load(p_thr + 3 + 4 * j)
            k_on = (tl.zeros([BLOCK], dtype=tl.float64) + tl.load(p_thr + 5 + 4 * j)) != 0
            fail = k_on & ~((stat >= k_lo) & (stat <= k_hi))
            fails = fails | fail
            if not WRITE:
                c = _clamp_nan(stat, tl.load(p_thr + 4 + 4 * j), k_hi)
                acc = _add(acc, cols, 6 + j, stat, valid)
                acc = _add(acc, cols, 16 + 5 * j, 1.0, valid & fail)
                acc = _add(acc, cols, 17 + 5 * j, c, valid)
                acc = _add(acc, cols, 18 + 5 * j, c * c, valid)
                acc = _add(acc, cols, 19 + 5 * j, 1.0, valid & (stat > k_hi))
                acc = _add(acc, cols, 20 + 5 * j, 1.0, valid & (stat < k_lo))
                mx = tl.where(mcols == j, _seg_max(mx, stat, valid), mx)
                mx = tl.where(mcols == 3 + j, _seg_max(mx, -stat, valid), mx)
        if WRITE:
            if LEVEL == 1:
                wt = tl.where(valid, w / factor, 0.0)
            else:
                wt = tl.where(valid, seq_w / factor, 0.0)
            if LEVEL > 0:
                if OUT_F64:
                    tl.store(p_w + o, wt, mask=m_in)
                else:  # through fp32: the interpreter's fp64 -> 16-bit conversion is wrong (policy_loss)
                    tl.store(p_w + o, wt.to(tl.float32).to(p_w.dtype.element_ty), mask=m_in)
            tl.store(p_keep + o, (valid & ~fails & seq_keep).to(tl.uint8), mask=m_in)
        else:
            wc = _clamp_nan(w, 0.0, up)
            acc = _add(acc, cols, 0, 1.0, valid)
            acc = _add(acc, cols, 1, lr, valid)
            acc = _add(acc, cols, 2, old, valid)
            acc = _add(acc, cols, 3, roll, valid)
            acc = _add(acc, cols, 4, tl.exp(lr) - lr - 1.0, valid)
            acc = _add(acc, cols, 5, rho * rho, valid)
            acc = _add(acc, cols, 9, w, valid)
            acc = _add(acc, cols, 10, wc, valid)
            acc = _add(acc, cols, 11, wc * wc, valid)
            acc = _add(acc, cols, 12, rho, valid)
            acc = _add(acc, cols, 13, 1.0, valid & (rho > up))
            acc = _add(acc, cols, 14, 1.0, valid & (rho < lo))
            acc = _add(acc, cols, 15, 1.0, valid & fails)
            mx = tl.where(mcols == 6, _seg_max(mx, w, valid), mx)
            mx = tl.where(mcols == 7, _seg_max(mx, -w, valid), mx)
    if not WRITE:
        tl.store(p_sums + b * NSUM + cols, acc, mask=cols < NSUM)
        tl.store(p_maxs + b * NM + mcols, mx)


def _launch(old, roll, mask, cu, thr, p: CorrectionParams, tables, seq_w, seq_keep, factor, w=None, keep=None):
    """The kernel over every sequence: the stats pass without ``keep``, the write pass with it."""
    if cu.numel() > 1:
        write = keep is not None
        _rollout_corr_kernel[(cu.numel() - 1,)](
            old, roll, mask.view(torch.uint8), cu, thr, *tables, seq_w, seq_keep.view(torch.uint8), factor,
            w if write and w.numel() else thr, keep.view(torch.uint8) if write else thr,
            ICEPOP=bool(p.icepop), LEVEL=int(p.is_level), WRITE=write, OUT_F64=not write or w.dtype == torch.float64,
            NSUM=len(SUM_COLS), NS=_NS, NM=_NM, BLOCK=_BLOCK)


@register("rollout_correction", "triton")
def _triton(old, roll, mask, cu, params):
    p = CorrectionParams.from_list(params)
    old, roll, mask = old.contiguous(), roll.contiguous(), mask.contiguous()
    dev, B = old.device, cu.numel() - 1
    thr = torch.tensor(_thresholds(p), dtype=torch.float64, device=dev)  # a copy to the device, no read
    tables = (torch.empty(B, len(SUM_COLS), dtype=torch.float64, device=dev),
              torch.empty(B, _NM, dtype=torch.float64, device=dev))
    ones = torch.ones(max(B, 1), dtype=torch.float64, device=dev)
    _launch(old, roll, mask, cu, thr, p, tables, ones, ones != 0, ones)
    metrics, seq_keep, seq_w, factor = finish(*tables, p)
    w, keep = _alloc_outputs(old, roll, p)
    _launch(old, roll, mask, cu, thr, p, tables, seq_w, seq_keep, factor, w, keep)
    return w, keep, metrics


def _alloc_outputs(old, roll, p):
    n = old.shape[0] if p.is_level else 0
    w = empty_output((n,), dtype=torch.promote_types(old.dtype, roll.dtype), device=old.device)
    return w, empty_output(old.shape, dtype=torch.bool, device=old.device)


# --------------------------------------------------------------------------- torch
def _token_terms(old, roll, valid, p: CorrectionParams):
    """Torch twin of the kernel's per-token math: (sum table [N, SUM_COLS], max table [N, MAX_COLS],
    token IS weight [N], token-option failures [N] bool), fp64, selected by ``valid``."""
    old, roll = old.double(), roll.double()
    lr = old - roll
    lrc = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    rho = lrc.exp()
    if p.icepop:
        w = torch.where((rho >= p.is_lower) & (rho <= p.is_upper), rho, 0.0)
    else:
        w = rho.clamp(max=p.is_upper)
    wc = w.clamp(0.0, p.is_upper)
    stats = (-lrc, 0.5 * lrc * lrc, rho - 1.0 - lrc)
    thr = _thresholds(p)
    fails = torch.zeros_like(valid)
    cols = {"count": torch.ones_like(lr), "lr": lr, "old": old, "rollout": roll, "k3kl": lr.exp() - lr - 1.0,
            "rho2": rho * rho, "w": w, "wc": wc, "wc2": wc * wc, "raw": rho, "is_high": (rho > p.is_upper).double(),
            "is_low": (rho < p.is_lower).double()}
    for j, stat in enumerate(stats):
        k_lo, k_hi, k_clo, k_on = thr[2 + 4 * j:6 + 4 * j]
        fail = ~((stat >= k_lo) & (stat <= k_hi)) & bool(k_on)
        fails = fails | fail
        c = stat.clamp(k_clo, k_hi)
        cols.update({f"k{j + 1}": stat, f"k{j + 1}_fail": fail.double(), f"k{j + 1}_clamp": c,
                     f"k{j + 1}_clamp2": c * c, f"k{j + 1}_high": (stat > k_hi).double(),
                     f"k{j + 1}_low": (stat < k_lo).double(), f"k{j + 1}_max": stat, f"k{j + 1}_negmin": -stat})
    cols.update(any_fail=fails.double(), w_max=w, w_negmin=-w)
    v = valid[:, None]
    sums = torch.where(v, torch.stack([cols[c] for c in SUM_COLS], 1), 0.0)
    maxs = torch.where(v, torch.stack([cols[c] for c in MAX_COLS], 1), -math.inf)
    return sums, maxs, w, fails


def seq_ids(cu: torch.Tensor, n: int) -> torch.Tensor:
    """Sequence index of each of the ``n`` tokens (no read: the output size is given)."""
    lens = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens, output_size=n)


@register("rollout_correction", "torch")
def _torch(old, roll, mask, cu, params):
    p = CorrectionParams.from_list(params)
    B = cu.numel() - 1
    sid = seq_ids(cu.long(), old.shape[0])
    tok_sums, tok_maxs, w_tok, fails = _token_terms(old, roll, mask, p)
    sums = tok_sums.new_zeros((B, len(SUM_COLS))).index_add_(0, sid, tok_sums)
    maxs = tok_maxs.new_full((B, len(MAX_COLS)), -math.inf).scatter_reduce_(
        0, sid[:, None].expand_as(tok_maxs), tok_maxs, "amax")
    metrics, seq_keep, seq_w, factor = finish(sums, maxs, p)
    keep = mask & ~fails & seq_keep[sid]
    w, _ = _alloc_outputs(old, roll, p)
    if p.is_level:
        wt = torch.where(mask, (w_tok if p.is_level == 1 else seq_w[sid]) / factor, 0.0)
        w = wt if w.dtype == torch.float64 else wt.float().to(w.dtype)  # through fp32, as the kernel
    return w, keep, metrics


# --------------------------------------------------------------------------- per-sequence results
def _over(x: torch.Tensor, sel: torch.Tensor, n: torch.Tensor):
    """(mean, unbiased std (0 for n <= 1), max, min) of ``x`` over ``sel`` (``n`` selected), NaN-propagating."""
    mean = torch.where(sel, x, 0.0).sum() / n.clamp(min=1.0)
    var = torch.where(sel, (x - mean) ** 2, 0.0).sum() / (n - 1.0).clamp(min=1.0)
    std = torch.where(n > 1, var.sqrt(), 0.0)
    return mean, std, torch.where(sel, x, -math.inf).amax(), torch.where(sel, x, math.inf).amin()


def _std(c_sum, c2_sum, den, n):
    """verl's clamped-statistic std: sqrt(max(E[c^2] - E[c]^2, 0)) over the tokens, 0 for <= 1 token."""
    mean = c_sum / den
    return torch.where(n > 1, (c2_sum / den - mean * mean).clamp(min=0.0).sqrt(), 0.0)


def finish(sums: torch.Tensor, maxs: torch.Tensor, p: CorrectionParams):
    """From the ``[B, C]`` tables: (metrics fp64 ``[K]`` in ``metric_names(p)`` order, sequence keep
    ``[B]`` bool, sequence IS weight ``[B]`` fp64, batch-norm divisor ``[1]`` fp64)."""
    S = dict(zip(SUM_COLS, sums.unbind(1)))
    M = dict(zip(MAX_COLS, maxs.unbind(1)))
    c = S["count"]
    n = c.sum()
    # verl's masked means divide by count + 1e-8 in the mask's float type (the 1e-8 is lost in fp32);
    # with no token the numerator is 0, and so is the mean.
    den = torch.where(n > 0, n + p.mask_eps, 1.0)
    valid = c > 0
    nv = valid.double().sum()
    c_den = torch.where(valid, c + p.mask_eps, 1.0)
    row = lambda x: x / c_den  # noqa: E731 - a row's masked mean
    zero = sums.new_zeros(())
    out: Dict[str, torch.Tensor] = {}
    seq_w = sums.new_zeros(sums.shape[0])
    factor = sums.new_ones(1)
    if p.is_level:
        if p.is_level == 1:
            wsum, wcsum, wc2sum, rawsum = S["w"], S["wc"], S["wc2"], S["raw"]
            hi_n, lo_n = S["is_high"], S["is_low"]
            is_max, is_min = M["w_max"].amax(), -M["w_negmin"].amax()
            frac_hi, frac_lo = hi_n.sum() / den, lo_n.sum() / den
        else:
            s = S["lr"]
            raw = s.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
            if p.icepop:
                seq_w = torch.where((raw >= p.is_lower) & (raw <= p.is_upper), raw, 0.0)
            else:
                seq_w = raw.clamp(max=p.is_upper)
            wc = seq_w.clamp(0.0, p.is_upper)
            wsum, wcsum, wc2sum, rawsum = c * seq_w, c * wc, c * wc * wc, c * raw
            hi_n, lo_n = c * (raw > p.is_upper), c * (raw < p.is_lower)
            is_max, is_min = s.amax().clamp(max=SAFETY_BOUND).exp(), s.amin().exp()
            frac_hi, frac_lo = (s > p.is_log_upper).double().mean(), (s < p.is_log_lower).double().mean()
        mc = wcsum.sum() / den
        seq_mean = row(wsum)
        raw_mean = row(rawsum)
        vals = [wsum.sum() / den, is_max, is_min, frac_hi, frac_lo, _std(wcsum.sum(), wc2sum.sum(), den, n),
                1.0 / (wc2sum.sum() / (mc + 1e-8) ** 2 / den), seq_mean.mean(),
                seq_mean.std() if seq_mean.numel() > 1 else zero, seq_mean.amax(), seq_mean.amin(),
                (seq_mean - 1.0).abs().amax(), (raw_mean > p.is_upper).double().mean(),
                (raw_mean < p.is_lower).double().mean()]
        if p.icepop:
            vals.append((hi_n + lo_n).sum() / den)
        if p.batch_normalize:
            mean = wsum.sum() / den if p.is_level == 1 else torch.where(valid, seq_mean, 0.0).sum() / nv.clamp(
                min=1e-8)
            factor = torch.where(mean > 1e-8, mean, 1.0).reshape(1)
            vals.append(factor[0])
        out.update(zip([nm for nm in metric_names(p) if nm.startswith("rollout_is_")], vals))
    seq_keep = torch.ones_like(valid)
    rejected = S["any_fail"]
    seq_rejected = torch.zeros_like(valid)
    for opt in p.rs_enabled():
        i = RS_OPTIONS.index(opt)
        lo, hi = p.rs_lower[i], p.rs_upper[i]
        k = opt[-2:]
        clo = lo if k == "k1" else 0.0
        token = opt in TOKEN_RS
        if token:
            sv = row(S[k])
            vals = [S[k].sum() / den, M[f"{k}_max"].amax(), -M[f"{k}_negmin"].amax(), S[f"{k}_high"].sum() / den,
                    S[f"{k}_low"].sum() / den if k == "k1" else zero,
                    _std(S[f"{k}_clamp"].sum(), S[f"{k}_clamp2"].sum(), den, n)]
            fail_seq = S[f"{k}_fail"] > 0
            masked = S[f"{k}_fail"].sum() / den
        else:
            sv = {"sum": S[k], "mean": row(S[k]), "max": torch.where(valid, M[f"{k}_max"], 0.0)}[opt.split("_")[1]]
            keep = (sv >= lo) & (sv <= hi)
            seq_keep = seq_keep & keep
            seq_rejected = seq_rejected | ~keep
            cl = sv.clamp(clo, hi)
            vm, _, vmax, vmin = _over(sv, valid, nv)
            vals = [torch.where(valid, c * sv, 0.0).sum() / den, vmax, vmin,
                    torch.where(valid, sv > hi, False).double().sum() / nv.clamp(min=1.0),
                    torch.where(valid, sv < lo, False).double().sum() / nv.clamp(min=1.0) if k == "k1" else zero,
                    _std(torch.where(valid, c * cl, 0.0).sum(), torch.where(valid, c * cl * cl, 0.0).sum(), den, n)]
            fail_seq = ~keep
            masked = torch.where(keep, 0.0, c).sum() / den
        vm, vstd, vmax, vmin = _over(sv, valid, nv)
        vals += [vm, vstd, vmax, vmin, torch.where(valid, sv.abs(), -math.inf).amax(),
                 torch.where(valid, sv > hi, False).double().sum() / nv.clamp(min=1.0)]
        if k == "k1":
            vals.append(torch.where(valid, sv < lo, False).double().sum() / nv.clamp(min=1.0))
        vals += [masked, torch.where(nv > 0, (fail_seq & valid).double().sum() / nv.clamp(min=1.0), 0.0)]
        prefix = f"rollout_rs_{opt}_"
        out.update(zip([nm for nm in metric_names(p) if nm.startswith(prefix)], vals))
    if p.rs_enabled():
        rejected = torch.where(seq_rejected, c, rejected)
        out["rollout_rs_masked_fraction"] = rejected.sum() / den
        out["rollout_rs_seq_masked_fraction"] = (rejected > 0).double().mean()
    out.update(_offpolicy(S, row, den))
    return torch.stack([out[k] for k in metric_names(p)]), seq_keep, seq_w, factor


def _offpolicy(S, row, den) -> Dict[str, torch.Tensor]:
    """verl's KL / perplexity / chi^2 diagnostics from the per-sequence sums (means over all B rows)."""
    train, roll = row(S["old"]), row(S["rollout"])
    diff = roll - train
    chi2_seq = (2.0 * S["lr"].clamp(-SAFETY_BOUND, SAFETY_BOUND)).exp().mean() - 1.0
    return {"training_ppl": (-train).exp().mean(), "training_log_ppl": (-train).mean(), "kl": -S["lr"].sum() / den,
            "k3_kl": S["k3kl"].sum() / den, "rollout_ppl": (-roll).exp().mean(), "rollout_log_ppl": (-roll).mean(),
            "log_ppl_diff": diff.mean(), "log_ppl_abs_diff": diff.abs().mean(), "log_ppl_diff_max": diff.amax(),
            "log_ppl_diff_min": diff.amin(), "ppl_ratio": diff.exp().mean(), "chi2_token": S["rho2"].sum() / den - 1.0,
            "chi2_seq": chi2_seq}


# --------------------------------------------------------------------------- custom op
@torch.library.custom_op("dapo::rollout_correction", mutates_args=())
def _rollout_correction_op(old: torch.Tensor, roll: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor,
                           params: List[float]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(IS weights ``[N]`` or ``[0]``, keep ``[N]`` bool, metrics fp64 ``[K]``) of flat ``[N]`` inputs in the
    sequences ``cu_seqlens``; ``params`` is ``CorrectionParams.as_list()``."""
    return dispatch("rollout_correction", old.device)(old, roll, mask, cu_seqlens, params)


@_rollout_correction_op.register_fake
def _(old, roll, mask, cu_seqlens, params):
    p = CorrectionParams.from_list(params)
    w = old.new_empty((old.shape[0] if p.is_level else 0,), dtype=torch.promote_types(old.dtype, roll.dtype))
    return w, old.new_empty(old.shape, dtype=torch.bool), old.new_empty((len(metric_names(p)),),
                                                                          dtype=torch.float64)


# --------------------------------------------------------------------------- public API
def rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: Optional[str] = None,
    rollout_is_threshold=2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: Optional[str] = None,
    rollout_rs_threshold=None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> RolloutCorrectionResult:
    """IS weights, rejection mask and metrics of verl 0.9.1's ``compute_rollout_correction_and_rejection_mask``.

    Args:
        old_log_prob: the trainer's log-probs, float (fp16 / bf16 / fp32 / fp64) ``[B, L]`` (padded, as
            verl) or ``[N]`` (packed, with ``cu_seqlens``).
        rollout_log_prob: the rollout engine's log-probs, same shape, any float dtype.
        response_mask: same shape; bool, integer (nonzero = token) or float 0 / 1.
        rollout_is: ``None`` (no weights), ``"token"`` or ``"sequence"``.
        rollout_is_threshold: a number (or numeric string): weights clamped to it (TIS); ``"lower_upper"``:
            IcePop, weights outside ``[lower, upper]`` set to 0. ``None`` turns the weights off (verl).
        rollout_is_batch_normalize: divide the weights by their mean over the batch's tokens (``token``)
            or sequences (``sequence``) when it is > 1e-8.
        rollout_rs: ``None`` or comma-separated options of ``token_k1..3``, ``seq_sum_k1..3``,
            ``seq_mean_k1..3``, ``seq_max_k2 / k3``; a token or sequence must pass every one.
        rollout_rs_threshold: one spec for all options or one per option, comma-separated; ``*_k1``
            options take ratio bounds ``"lower_upper"`` (or ``u`` for ``1/u_u``), the others an upper bound.
        cu_seqlens: int32 / int64 ``[B+1]`` for packed inputs (required there, refused for ``[B, L]``).

    Returns a :class:`RolloutCorrectionResult`: ``rollout_is_weights`` in the inputs' shape and promoted
    dtype (``None`` without ``rollout_is``; 0 at tokens the mask drops), ``response_mask`` with the
    rejected tokens set to 0 (its shape and dtype), ``metrics`` ``{"rollout_corr/<verl's name>": fp64 0-dim}``.
    Computed in fp64. Nothing is read on the host (a packed batch's ``cu_seqlens`` is checked once per
    tensor, one read); not differentiable (verl detaches the weights).

    Differences from verl, by design: a NaN / inf log-prob at a token the mask drops reaches nothing (verl
    multiplies by the mask, NaN * 0 = NaN in its weights); an all-masked batch is not refused (verl raises;
    that takes a host read): its metrics are those of the formulas with no token, its weights 0; NaN
    thresholds are refused. ``torch.distributed`` is not consulted: the batch mean is this batch's.
    Bad options raise ``ValueError`` naming the argument (wrong Python types ``TypeError``, as verl).
    """
    check_tensor("old_log_prob", old_log_prob, ndim=(1, 2), dtypes=FLOAT_DTYPES)
    shape = tuple(old_log_prob.shape)
    check_tensor("rollout_log_prob", rollout_log_prob, dtypes=FLOAT_DTYPES, device=old_log_prob.device, shape=shape)
    mask = check_mask("response_mask", response_mask, device=old_log_prob.device, shape=shape)
    check_flag("rollout_is_batch_normalize", rollout_is_batch_normalize)
    p = make_params(rollout_is, rollout_is_threshold, rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold,
                    response_mask.dtype == torch.float64)
    if old_log_prob.numel() == 0:
        raise ValueError("response_mask must select at least one token; the batch is empty")
    if old_log_prob.dim() == 2:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens is only for packed 1-D inputs; [B, L] inputs carry their sequences as rows")
        B, L = shape
        cu = torch.arange(0, (B + 1) * L, L, dtype=torch.int64, device=old_log_prob.device)
    else:
        if cu_seqlens is None:
            raise ValueError("packed 1-D inputs need cu_seqlens")
        check_cu_seqlens(cu_seqlens, shape[0], device=old_log_prob.device)
        cu = cu_seqlens
    flat = [t.detach().reshape(-1).contiguous() for t in (old_log_prob, rollout_log_prob, mask)]
    w, keep, vec = _rollout_correction_op(*flat, cu.contiguous(), p.as_list())
    metrics = {PREFIX + k: v for k, v in zip(metric_names(p), vec.unbind())}
    keep = keep.reshape(shape) if response_mask.dtype == torch.bool else keep.reshape(shape).to(response_mask.dtype)
    return RolloutCorrectionResult(w.reshape(shape) if p.is_level else None, keep, metrics)
