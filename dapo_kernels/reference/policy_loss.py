"""Reference of ``policy_loss``: verl 0.9.1's ``compute_policy_loss_vanilla`` + ``agg_loss``, written out plainly.

Every function computes in the dtype of its inputs, so ``f(x.double())`` is the
float64 reference and ``f(x)`` is what plain torch costs in ``x``'s dtype (the
comparator of ``tests.helpers.assert_close_to_ref``). One deliberate difference from
verl: an all-masked batch (or sequence) aggregates to 0 instead of NaN.
"""
from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def packed_to_padded_ref(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[N] packed -> [B, max_len] right-padded with zeros (a Python loop over sequences)."""
    cu = cu_seqlens.tolist()
    lens = [e - s for s, e in zip(cu[:-1], cu[1:])]
    out = x.new_zeros((len(lens), max(lens, default=0)))
    for b, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        out[b, : e - s] = x[s:e]
    return out


def agg_loss_ref(loss_mat, mask, mode, *, num_tokens=None, num_seqs=None, loss_scale_factor=None):
    """verl ``agg_loss`` on ``[B, T]``: ``num_tokens``/``num_seqs`` play verl's global counts."""
    m = mask.to(loss_mat.dtype)
    masked = torch.where(mask.bool(), loss_mat, torch.zeros_like(loss_mat)) * m
    if mode == "token-mean":
        n = m.sum() if num_tokens is None else num_tokens
        return masked.sum() / max(float(n), 1.0)
    if mode == "token-sum":
        return masked.sum()
    tok = m.sum(-1)
    seq_present = (tok > 0).to(loss_mat.dtype)
    nseq = max(float(seq_present.sum() if num_seqs is None else num_seqs), 1.0)
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        loss = (masked.sum(-1) * seq_present).sum() / nseq
        if mode == "seq-mean-token-sum-norm":
            loss = loss / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    if mode == "seq-mean-token-mean":
        seq_mean = masked.sum(-1) / tok.clamp(min=1)
        return (seq_mean * seq_present).sum() / nseq
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


def _masked_mean(x, mask):
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def pg_losses_ref(log_prob, old_log_prob, advantages, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0):
    """verl ``compute_policy_loss_vanilla``'s per-token loss and its metric indicators."""
    neg_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip1 = torch.maximum(pg1, pg2)
    pg3 = -advantages * clip_ratio_c
    clip2 = torch.min(pg3, clip1)
    losses = torch.where(advantages < 0, clip2, clip1)
    clipped = torch.gt(pg2, pg1)
    clipped_lower = torch.gt(clip1, pg3) & (advantages < 0)
    return losses, clipped, clipped_lower, neg_kl


def policy_loss_ref(log_prob, old_log_prob, advantages, response_mask, *, clip_ratio_low=0.2, clip_ratio_high=0.28,
                    clip_ratio_c=3.0, loss_agg_mode="token-mean", num_tokens=None, num_seqs=None, cu_seqlens=None,
                    loss_scale_factor=None, rollout_is_weights=None):
    """(loss, metrics) as verl; 1-D inputs with ``cu_seqlens`` are padded per sequence first.
    ``rollout_is_weights`` (same shape, detached) multiply the per-token losses before ``agg_loss``."""
    is_w = torch.ones_like(log_prob) if rollout_is_weights is None else rollout_is_weights.detach()
    if log_prob.dim() == 1 and cu_seqlens is not None:
        log_prob, old_log_prob, advantages, response_mask, is_w = (
            packed_to_padded_ref(t, cu_seqlens) for t in (log_prob, old_log_prob, advantages, response_mask, is_w))
    elif log_prob.dim() == 1:
        log_prob, old_log_prob, advantages, response_mask, is_w = (
            t[None] for t in (log_prob, old_log_prob, advantages, response_mask, is_w))
    losses, clipped, clipped_lower, neg_kl = pg_losses_ref(
        log_prob, old_log_prob, advantages, clip_ratio_low, clip_ratio_high, clip_ratio_c)
    if rollout_is_weights is not None:
        losses = losses * is_w
    loss = agg_loss_ref(losses, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                        loss_scale_factor=loss_scale_factor)
    dt = log_prob.dtype
    metrics = {
        "pg_clipfrac": _masked_mean(clipped.to(dt), response_mask),
        "pg_clipfrac_lower": _masked_mean(clipped_lower.to(dt), response_mask),
        "ppo_kl": _masked_mean(-neg_kl, response_mask),
    }
    return loss, metrics


def agg_values_ref(values, mask, *, loss_agg_mode, num_tokens, num_seqs, cu_seqlens, loss_scale_factor):
    """``agg_loss_ref`` of per-token ``values`` ``[N]`` (packed with ``cu_seqlens``) or ``[B, T]``."""
    if values.dim() == 1 and cu_seqlens is not None:
        values, mask = packed_to_padded_ref(values, cu_seqlens), packed_to_padded_ref(mask, cu_seqlens)
    elif values.dim() == 1:
        values, mask = values[None], mask[None]
    return agg_loss_ref(values, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                        loss_scale_factor=loss_scale_factor)
