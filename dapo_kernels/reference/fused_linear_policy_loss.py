"""Reference of ``fused_linear_policy_loss``: full logits, then verl's actor loss, in the inputs' dtype."""
from __future__ import annotations

from typing import Optional

import torch

from .kl_penalty import kl_penalty_ref
from .linear_log_probs import linear_log_probs_ref
from .policy_loss import agg_values_ref, policy_loss_ref


def fused_linear_policy_loss_ref(hidden, weight, labels, old_log_prob, advantages, response_mask, *, temperature=1.0,
                                 clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                                 loss_agg_mode="token-mean", num_tokens=None, num_seqs=None, cu_seqlens=None,
                                 loss_scale_factor=None, entropy_coeff=0.0, ref_log_prob: Optional[torch.Tensor] = None,
                                 kl_coef=0.0, kl_type="low_var_kl", rollout_is_weights=None):
    """verl's actor loss: pg_loss - entropy_coeff * agg(entropy) + kl_coef * agg(kl); the rollout IS
    weights scale the pg term's per-token losses only, as verl's policy losses do."""
    log_prob, entropy = linear_log_probs_ref(hidden, weight, labels, temperature)
    agg = dict(loss_agg_mode=loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, cu_seqlens=cu_seqlens,
               loss_scale_factor=loss_scale_factor)
    loss, metrics = policy_loss_ref(log_prob, old_log_prob, advantages, response_mask, clip_ratio_low=clip_ratio_low,
                                    clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
                                    rollout_is_weights=rollout_is_weights, **agg)
    if entropy_coeff:
        ent_loss = agg_values_ref(entropy, response_mask, **agg)
        loss = loss - entropy_coeff * ent_loss
    if kl_coef:
        kl_loss = agg_values_ref(kl_penalty_ref(log_prob, ref_log_prob, kl_type), response_mask, **agg)
        loss = loss + kl_coef * kl_loss
    return loss, metrics, log_prob, entropy
