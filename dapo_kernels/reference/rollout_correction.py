"""Reference of ``rollout_correction``: verl 0.9.1's ``compute_rollout_correction_and_rejection_mask``
written out sequence by sequence (a Python loop over the rows of a padded batch).

Computes in the promoted dtype of the log-probs, so ``f(x.double())`` is the float64 reference and
``f(x)`` what plain torch costs in ``x``'s dtype. The options are parsed by the op's own parser
(``_rollout_spec.make_params``, tested against verl's errors separately). Deliberate differences
from verl, as the op: tokens the mask drops get weight 0 whatever their log-probs; an all-masked
batch is not refused.
"""
from __future__ import annotations

import math

import torch

from .._rollout_spec import PREFIX, RS_OPTIONS, SAFETY_BOUND, TOKEN_RS, make_params, metric_names
from .policy_loss import packed_to_padded_ref


def _over_rows(x, sel):
    """(mean, std, max, min) of the per-row values ``x`` (a list) over the rows ``sel``."""
    v = torch.stack([x[i] for i in range(len(x)) if sel[i]])
    std = v.std() if v.numel() > 1 else v.new_zeros(())
    return v.mean(), std, v.max(), v.min()


def _frac(flags, dt):
    return torch.tensor(sum(bool(f) for f in flags) / max(len(flags), 1), dtype=dt)


def rollout_correction_ref(old_log_prob, rollout_log_prob, response_mask, *, rollout_is=None,
                           rollout_is_threshold=2.0, rollout_is_batch_normalize=False, rollout_rs=None,
                           rollout_rs_threshold=None, cu_seqlens=None):
    """(weights or None, rejection-masked mask (bool), metrics ``{"rollout_corr/...": 0-dim}``), padded
    ``[B, L]`` outputs for padded inputs; packed ``[N]`` inputs (with ``cu_seqlens``) give packed outputs."""
    packed = old_log_prob.dim() == 1
    if packed:
        old_log_prob, rollout_log_prob, response_mask = (
            packed_to_padded_ref(t, cu_seqlens) for t in (old_log_prob, rollout_log_prob, response_mask))
    p = make_params(rollout_is, rollout_is_threshold, rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold,
                    response_mask.dtype == torch.float64)
    dt = torch.promote_types(old_log_prob.dtype, rollout_log_prob.dtype)
    old, roll, mask = old_log_prob.to(dt), rollout_log_prob.to(dt), response_mask != 0
    B = old.shape[0]
    lr_rows = [old[b][mask[b]] - roll[b][mask[b]] for b in range(B)]  # each row's selected tokens
    cnt = [r.numel() for r in lr_rows]
    n = sum(cnt)
    den = (n + p.mask_eps) if n else 1.0
    valid = [c > 0 for c in cnt]

    def row_mean(x, b):  # verl's per-row masked mean (0 for an empty row)
        return x.sum() / (cnt[b] + p.mask_eps) if cnt[b] else x.sum() * 0

    def tok_mean(xs):  # masked mean over every selected token
        return sum(x.sum() for x in xs) / den

    def std(cs):  # sqrt(max(E[c^2] - E[c]^2, 0)) over the tokens, 0 for <= 1 token
        m = tok_mean(cs)
        var = tok_mean([c * c for c in cs]) - m * m
        return var.clamp(min=0).sqrt() if n > 1 else m * 0

    lrc = [r.clamp(-SAFETY_BOUND, SAFETY_BOUND) for r in lr_rows]
    metrics = {}
    weights = None
    if p.is_level:
        up, lo = p.is_upper, p.is_lower
        if p.is_level == 1:
            raw = [x.exp() for x in lrc]
        else:
            sums = [r.sum() for r in lr_rows]
            raw = [s.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().expand(cnt[b]) for b, s in enumerate(sums)]
        if p.icepop:
            w = [torch.where((r >= lo) & (r <= up), r, 0.0) for r in raw]
        else:
            w = [r.clamp(max=up) for r in raw]
        wc = [x.clamp(0.0, up) for x in w]
        m_c = tok_mean(wc)
        seq_mean = torch.stack([row_mean(w[b], b) for b in range(B)])
        raw_mean = [row_mean(raw[b], b) for b in range(B)]
        if p.is_level == 1:
            every = torch.cat(w)
            hi_lo = [tok_mean([(r > up).to(dt) for r in raw]), tok_mean([(r < lo).to(dt) for r in raw]),
                     every.max(), every.min()]
        else:
            s = torch.stack(sums)
            hi_lo = [_frac(s > p.is_log_upper, dt), _frac(s < p.is_log_lower, dt),
                     s.max().clamp(max=SAFETY_BOUND).exp(), s.min().exp()]
        m = {"mean": tok_mean(w), "max": hi_lo[2], "min": hi_lo[3], "ratio_fraction_high": hi_lo[0],
             "ratio_fraction_low": hi_lo[1], "std": std(wc),
             "eff_sample_size": 1.0 / tok_mean([(x / (m_c + 1e-8)) ** 2 for x in wc]),
             "seq_mean": seq_mean.mean(), "seq_std": seq_mean.std() if B > 1 else seq_mean.sum() * 0,
             "seq_max": seq_mean.max(), "seq_min": seq_mean.min(), "seq_max_deviation": (seq_mean - 1).abs().max(),
             "seq_fraction_high": _frac([x > up for x in raw_mean], dt),
             "seq_fraction_low": _frac([x < lo for x in raw_mean], dt)}
        if p.icepop:
            m["oob_ratio"] = tok_mean([((r < lo) | (r > up)).to(dt) for r in raw])
        if p.batch_normalize:
            if p.is_level == 1:
                bm = tok_mean(w)
            else:
                bm = sum(seq_mean[b] for b in range(B) if valid[b]) / max(sum(valid), 1e-8)
            factor = bm if bm > 1e-8 else torch.ones((), dtype=dt)
            w = [x / factor for x in w]
            m["batch_norm_factor"] = factor
        metrics.update({f"rollout_is_{k}": v for k, v in m.items()})
        weights = torch.zeros_like(old)
        for b in range(B):
            weights[b][mask[b]] = w[b]
    keep = [torch.ones(c, dtype=torch.bool) for c in cnt]
    seq_masked_any = [False] * B
    for opt in RS_OPTIONS:
        i = RS_OPTIONS.index(opt)
        if math.isnan(p.rs_upper[i]):
            continue
        lo, hi = p.rs_lower[i], p.rs_upper[i]
        k1 = opt.endswith("k1")
        stat = [{"k1": -x, "k2": 0.5 * x * x, "k3": x.exp() - 1 - x}[opt[-2:]] for x in lrc]
        if opt in TOKEN_RS:
            per_tok = stat
            seq_val = [row_mean(stat[b], b) for b in range(B)]
            ok = [(x >= lo) & (x <= hi) for x in stat]
            every = torch.cat(stat)
            head = [tok_mean(stat), every.max(), every.min(), tok_mean([(x > hi).to(dt) for x in stat]),
                    tok_mean([(x < lo).to(dt) for x in stat]) if k1 else torch.zeros((), dtype=dt)]
        else:
            agg = opt.split("_")[1]
            seq_val = [{"sum": x.sum(), "mean": row_mean(x, b), "max": x.max() if cnt[b] else x.sum() * 0}[agg]
                       for b, x in enumerate(stat)]
            per_tok = [seq_val[b].expand(cnt[b]) for b in range(B)]
            ok = [((seq_val[b] >= lo) & (seq_val[b] <= hi)).expand(cnt[b]) for b in range(B)]
            sv = [seq_val[b] for b in range(B) if valid[b]]
            head = [tok_mean(per_tok), max(sv), min(sv), _frac([x > hi for x in sv], dt),
                    _frac([x < lo for x in sv], dt) if k1 else torch.zeros((), dtype=dt)]
        names = [nm for nm in metric_names(p) if nm.startswith(f"rollout_rs_{opt}_")]
        mean, sd, mx, mn = _over_rows(seq_val, valid)
        vals = head + [std([x.clamp(lo if k1 else 0.0, hi) for x in per_tok]), mean, sd, mx, mn,
                       max(abs(seq_val[b]) for b in range(B) if valid[b]),
                       _frac([seq_val[b] > hi for b in range(B) if valid[b]], dt)]
        if k1:
            vals.append(_frac([seq_val[b] < lo for b in range(B) if valid[b]], dt))
        vals += [tok_mean([(~x).to(dt) for x in ok]), _frac([(~ok[b]).any() for b in range(B) if valid[b]], dt)]
        metrics.update(zip(names, vals))
        keep = [k & o for k, o in zip(keep, ok)]
    if p.rs_enabled():
        metrics["rollout_rs_masked_fraction"] = tok_mean([(~k).to(dt) for k in keep])
        seq_masked_any = [bool((~k).any()) for k in keep]
        metrics["rollout_rs_seq_masked_fraction"] = _frac(seq_masked_any, dt)
    train = torch.stack([row_mean(old[b][mask[b]], b) for b in range(B)])
    rmean = torch.stack([row_mean(roll[b][mask[b]], b) for b in range(B)])
    diff = rmean - train
    lr_sums = torch.stack([r.sum() for r in lr_rows])
    metrics.update({
        "training_ppl": (-train).exp().mean(), "training_log_ppl": (-train).mean(),
        "kl": tok_mean([-r for r in lr_rows]), "k3_kl": tok_mean([r.exp() - r - 1 for r in lr_rows]),
        "rollout_ppl": (-rmean).exp().mean(), "rollout_log_ppl": (-rmean).mean(), "log_ppl_diff": diff.mean(),
        "log_ppl_abs_diff": diff.abs().mean(), "log_ppl_diff_max": diff.max(), "log_ppl_diff_min": diff.min(),
        "ppl_ratio": diff.exp().mean(), "chi2_token": tok_mean([(x.exp()) ** 2 for x in lrc]) - 1.0,
        "chi2_seq": (2.0 * lr_sums.clamp(-SAFETY_BOUND, SAFETY_BOUND)).exp().mean() - 1.0})
    out_mask = torch.zeros_like(mask)
    for b in range(B):
        out_mask[b][mask[b]] = keep[b]
    if packed:  # back to the packed tokens: each row's first len positions
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        inside = torch.stack([torch.arange(mask.shape[1]) < ln for ln in lens])
        out_mask = out_mask[inside]
        weights = weights[inside] if weights is not None else None
    return weights, out_mask, {PREFIX + k: torch.as_tensor(v, dtype=dt) for k, v in metrics.items()}
