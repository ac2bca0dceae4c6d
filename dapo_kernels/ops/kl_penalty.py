"""verl's KL estimators between the policy and the reference log-probs, elementwise.

:func:`kl_terms` (value and derivative) is also the KL term of the fused loss head.
"""
from __future__ import annotations

import torch

from .._validation import FLOAT_DTYPES, check_tensor

KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "low_var_kl+", "k3+")


def kl_terms(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str, dtype: torch.dtype = torch.float32):
    """(verl ``kl_penalty`` value, its derivative w.r.t. ``log_prob``), elementwise, in ``dtype``."""
    base = kl_type[:-1] if kl_type.endswith("+") else kl_type
    d = log_prob.to(dtype) - ref_log_prob.to(dtype)
    if base in ("kl", "k1"):
        val, grad = d, torch.ones_like(d)
    elif base == "abs":
        val, grad = d.abs(), torch.sign(d)
    elif base in ("mse", "k2"):
        val, grad = 0.5 * d * d, d
    else:  # low_var_kl / k3: clamp(exp(k) - k - 1, -10, 10) with k = clamp(-d, -20, 20)
        k = (-d).clamp(-20.0, 20.0)
        r = torch.exp(k)
        val = r - k - 1
        grad = torch.where((d.abs() <= 20.0) & (val <= 10.0), 1.0 - r, 0.0)
        val = val.clamp(-10.0, 10.0)
    if kl_type.endswith("+"):
        grad = d  # straight-through: k2's gradient under the estimator's value
    return val, grad


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str = "low_var_kl") -> torch.Tensor:
    """verl's ``kl_penalty`` estimators (``kl``/``k1``, ``abs``, ``mse``/``k2``, ``low_var_kl``/``k3``,
    and ``+`` straight-through variants), elementwise on same-shape float tensors; fp32 result,
    differentiable w.r.t. ``log_prob``. NaN in, NaN out, elementwise; the gradient at a NaN is
    that of torch's autograd of verl's estimator (e.g. 0 where ``low_var_kl`` clamps it)."""
    check_tensor("log_prob", log_prob, dtypes=FLOAT_DTYPES)
    check_tensor("ref_log_prob", ref_log_prob, dtypes=FLOAT_DTYPES, device=log_prob.device,
                 shape=tuple(log_prob.shape))
    if kl_type not in KL_TYPES:
        raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")
    val, grad = kl_terms(log_prob.detach(), ref_log_prob, kl_type)
    # Value of the estimator, gradient of kl_terms: first-order straight-through.
    return val + (log_prob.float() - log_prob.detach().float()) * grad
