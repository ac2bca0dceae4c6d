"""dk.kl_penalty against verl's kl_penalty in float64, within 2x plain torch's fp32 error."""
import pytest
import torch

import dapo_kernels as dk
from dapo_kernels.reference import kl_penalty_ref
from tests.tolerance import assert_close_to_ref


@pytest.mark.parametrize("kl_type", ["kl", "abs", "mse", "low_var_kl", "k3+"])
def test_kl_penalty_matches_verl(kl_type):
    lp = torch.cat([torch.randn(40), torch.tensor([25.0, -25.0])])
    ref = torch.cat([torch.randn(40), torch.zeros(2)])
    x = lp.clone().requires_grad_()
    out = dk.kl_penalty(x, ref, kl_type)
    (g,) = torch.autograd.grad(out.sum(), x)
    refs = []
    for dt in (torch.float64, torch.float32):
        r = lp.to(dt).requires_grad_()
        ro = kl_penalty_ref(r, ref.to(dt), kl_type)
        refs.append((ro, torch.autograd.grad(ro.sum(), r)[0]))
    assert_close_to_ref(out, refs[0][0], refs[1][0], name="kl")
    assert_close_to_ref(g, refs[0][1], refs[1][1], name="dkl")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_non_float_ref_log_prob_rejected(dtype):
    """An integer or bool ref_log_prob is a mix-up, not a log-prob: rejected naming it."""
    with pytest.raises(ValueError, match="ref_log_prob"):
        dk.kl_penalty(torch.randn(5), torch.ones(5, dtype=dtype))
