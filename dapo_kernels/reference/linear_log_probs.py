"""Reference of ``linear_log_probs``: full ``[N, V]`` logits, in the inputs' dtype."""
from __future__ import annotations

import torch


def linear_log_probs_ref(hidden, weight, labels, temperature=1.0):
    """Full logits in the inputs' dtype: (log_prob [N], entropy [N])."""
    logits = (hidden @ weight.t()) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    log_prob = logp_all.gather(-1, labels[:, None].long())[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return log_prob, entropy
