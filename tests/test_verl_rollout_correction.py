"""dk.rollout_correction against verl 0.9.1's compute_rollout_correction_and_rejection_mask itself.

Marked ``verl``: run in .venv-verl (``make test-verl``); elsewhere skipped with the reason printed
(tests/test_verl_integration.py's ``needs_verl``)."""
import math

import pytest
import torch

import dapo_kernels as dk
from tests.helpers import backend
from tests.ops.test_rollout_correction import BAD_OPTIONS, MODES, make_batch, mode_id
from tests.test_verl_integration import needs_verl

try:
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask as verl_rc
except Exception:  # needs_verl() reports why
    verl_rc = None

pytestmark = pytest.mark.verl


def _verl(old, roll, mask, mode):
    w, m, metrics = verl_rc(old, roll, mask, **mode)
    return (None if w is None else w.batch["rollout_is_weights"]), m, metrics


def _tolerance(key: str, value: float) -> dict:
    """verl's own rounding of a metric whose inputs are fp64: its ``.float()`` fractions (and IcePop's oob
    ratio) are fp32 (rel 6e-8); its std is sqrt(E[c^2] - E[c]^2), whose ~1e-16 rounding becomes ~1e-8
    under the root near 0."""
    if "fraction" in key or key.endswith("oob_ratio"):
        return dict(rel_tol=1e-7, abs_tol=0.0)
    if key.endswith("_std"):
        return dict(rel_tol=1e-9, abs_tol=1e-6)
    return dict(rel_tol=1e-9, abs_tol=1e-300)


@pytest.mark.parametrize("shape", [(7, 41), (1, 9), (16, 300)], ids=lambda s: f"B{s[0]}-L{s[1]}")
@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_equals_verl_fp64(mode, be, shape):
    """fp64 log-probs and mask: weights within 1e-12 relative, the same mask, every verl metric key with
    verl's value (up to verl's own fp32 fractions and std rounding)."""
    needs_verl()
    old, roll, mask = make_batch(*shape, dtype=torch.float64, empty_row=shape[0] > 2)
    mask = mask.double()
    w, m, metrics = _verl(old, roll, mask, mode)
    with backend(be):
        out = dk.rollout_correction(old, roll, mask, **mode)
    assert torch.equal(out.response_mask, m), "response_mask differs from verl's"
    assert (w is None) == (out.rollout_is_weights is None)
    if w is not None:
        rel = (out.rollout_is_weights - w).abs().max() / w.abs().max()
        assert rel <= 1e-12, f"weights: {rel:.2e} relative to verl's"
    assert set(out.metrics) == set(metrics), f"keys: {set(out.metrics) ^ set(metrics)}"
    for k, v in metrics.items():
        got = out.metrics[k].item()
        assert math.isclose(got, v, **_tolerance(k, v)), f"{k}: {got!r} vs verl {v!r}"


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_equals_verl_fp32(mode, be):
    """fp32 log-probs and mask, as verl trains: weights within 1e-5 relative of verl's fp32 ones, the same
    mask, and each metric within 2x verl's own fp32 error (verl on the same values in fp64 as the truth)."""
    needs_verl()
    old, roll, mask = make_batch(9, 57, dtype=torch.float32)
    mask = mask.float()
    w, m, metrics = _verl(old, roll, mask, mode)
    _, _, metrics64 = _verl(old.double(), roll.double(), mask, mode)
    with backend(be):
        out = dk.rollout_correction(old, roll, mask, **mode)
    assert torch.equal(out.response_mask, m), "response_mask differs from verl's"
    if w is not None:
        rel = (out.rollout_is_weights.double() - w.double()).abs().max() / w.double().abs().max()
        assert rel <= 1e-5, f"weights: {rel:.2e} relative to verl's"
    assert set(out.metrics) == set(metrics)
    for k, v in metrics.items():
        got, truth = out.metrics[k].item(), metrics64[k]
        tol = _tolerance(k, truth)  # verl's fp64 run still rounds its fractions to fp32
        bound = 2 * max(abs(v - truth), tol["rel_tol"] * abs(truth), tol["abs_tol"])
        assert abs(got - truth) <= bound, f"{k}: {got!r}, verl fp32 {v!r}, verl fp64 {truth!r}"


@pytest.mark.parametrize("kw,name", BAD_OPTIONS, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD_OPTIONS)])
def test_bad_options_are_errors_in_verl_too(kw, name):
    """Every spec dk refuses (ValueError), verl refuses too, except a NaN bound, which verl lets through."""
    needs_verl()
    old, roll, mask = make_batch(3, 5)
    if "nan" in str(kw.values()):
        verl_rc(old, roll, mask.float(), **kw)  # accepted by verl; refused here by design
        return
    with pytest.raises(ValueError):
        verl_rc(old, roll, mask.float(), **kw)


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("mode", [MODES[-2], MODES[-1]], ids=mode_id)
def test_correction_into_policy_loss_equals_verl(mode, loss_agg_mode, be):
    """dk.rollout_correction's weights and masked response_mask passed to dk.policy_loss give verl's
    compute_policy_loss_vanilla on verl's own correction (fp64 inputs): loss and gradient alike."""
    needs_verl()
    from tests.test_verl_integration import _config, core_algos
    old, roll, mask = make_batch(7, 41, dtype=torch.float64)
    lp = (old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64))
    adv = torch.randn(old.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    w, m, _ = _verl(old, roll, mask.double(), mode)
    x = lp.clone().requires_grad_()
    ref, _ = core_algos.compute_policy_loss_vanilla(old, x, adv, m, loss_agg_mode, _config(), w)
    (g_ref,) = torch.autograd.grad(ref, x)
    x = lp.clone().requires_grad_()
    with backend(be):
        out = dk.rollout_correction(old, roll, mask, **mode)
        loss, _ = dk.policy_loss(x, old, adv, out.response_mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                 loss_agg_mode=loss_agg_mode, rollout_is_weights=out.rollout_is_weights)
        (g,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-7)  # ours is rounded to fp32
    # verl divides by count + 1e-8 (~1e-9 relative here); the Triton kernel stores the gradient through fp32.
    torch.testing.assert_close(g, g_ref, rtol=1e-9 if be == "torch" else 2 ** -23, atol=1e-14)
