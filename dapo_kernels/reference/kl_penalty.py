"""Reference of ``kl_penalty``: verl 0.9.1's estimators, in the inputs' dtype."""
from __future__ import annotations

import torch


def kl_penalty_ref(log_prob, ref_log_prob, kl_type="low_var_kl"):
    """verl ``kl_penalty`` (including the ``+`` straight-through variants)."""
    base = kl_type[:-1] if kl_type.endswith("+") else kl_type
    d = log_prob - ref_log_prob
    if base in ("kl", "k1"):
        out = d
    elif base == "abs":
        out = d.abs()
    elif base in ("mse", "k2"):
        out = 0.5 * d.square()
    elif base in ("low_var_kl", "k3"):
        kl = torch.clamp(-d, min=-20, max=20)
        out = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    else:
        raise ValueError(kl_type)
    if kl_type.endswith("+") and base not in ("mse", "k2"):
        st = 0.5 * d.square()
        out = st - st.detach() + out.detach()
    return out
