"""dk.fused_linear_policy_loss against the float64 full-logits reference (verl's actor loss),
within 2x plain torch's own error (the worst of its usual log-prob ways, swapped into the
reference's log-prob step); no-grad, masked, upstream-grad and bad-input behaviour."""
from unittest import mock

import pytest
import torch

import dapo_kernels as dk
import dapo_kernels.reference.fused_linear_policy_loss as ref_fused
from dapo_kernels.reference import fused_linear_policy_loss_ref, linear_log_probs_ref
from tests.helpers import backend, cu_seqlens_from
from tests.linear_log_probs_ways import TORCH_WAYS, fused_inputs, make_linear
from tests.tolerance import assert_close_to_ref, worst_of


FUSED_CASES = [
    # mode, entropy_coeff, kl_coef, kl_type, packed cu_seqlens lengths, rollout IS weights
    ("token-mean", 0.0, 0.0, "low_var_kl", None, False),
    ("token-mean", 0.01, 0.1, "low_var_kl", None, False),
    ("token-sum", 0.0, 0.05, "kl", None, False),
    ("seq-mean-token-sum", 0.02, 0.1, "abs", [10, 0, 27], False),
    ("seq-mean-token-mean", 0.0, 0.1, "mse", [1, 20, 16], False),
    ("seq-mean-token-sum-norm", 0.01, 0.0, "low_var_kl", [30, 7], False),
    ("token-mean", 0.01, 0.1, "low_var_kl", None, True),
    ("seq-mean-token-mean", 0.0, 0.0, "low_var_kl", [1, 20, 16], True),
    ("seq-mean-token-sum-norm", 0.02, 0.1, "abs", [30, 7], True),
]


def _fused_id(c):
    return f"{c[0]}-ent{c[1]}-kl{c[2]}-{c[3]}" + ("-is_weights" if c[5] else "")


def is_weights(n: int) -> torch.Tensor:
    """Rollout IS weights in [0.1, 2], a few exact 0 (rejected) and 1 (seeded by the caller)."""
    r, kind = 0.1 + 1.9 * torch.rand(n), torch.randint(0, 8, (n,))
    return torch.where(kind == 0, 0.0, torch.where(kind == 1, 1.0, r))


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("mode,ec,kc,kl_type,lengths,is_w", [pytest.param(*c, id=_fused_id(c)) for c in FUSED_CASES])
def test_fused_matches_reference(be, mode, ec, kc, kl_type, lengths, is_w):
    """Loss, dH, dW, log-prob, metrics within the tolerance rule; IS weights scale the pg term only and get
    no gradient."""
    N, H, V = 37, 32, 200
    hidden, weight, labels = make_linear(N, H, V, torch.float32)
    tok = fused_inputs(N, V)
    kw = dict(temperature=0.6, loss_agg_mode=mode, entropy_coeff=ec, kl_coef=kc, kl_type=kl_type,
              cu_seqlens=cu_seqlens_from(lengths) if lengths else None, **tok)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if is_w:
        kw["rollout_is_weights"] = is_weights(N).requires_grad_()
    with backend(be):
        loss, metrics = dk.fused_linear_policy_loss(h, w, labels, **kw)
        dh, dw, *d_r = torch.autograd.grad(loss, [h, w, *([kw["rollout_is_weights"]] if is_w else [])],
                                           allow_unused=True)
    assert d_r == ([None] if is_w else []), "rollout_is_weights are constants: no gradient"

    def ref(dt, llp=linear_log_probs_ref):
        kw_dt = {k: (v.detach().to(dt) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                 for k, v in kw.items()}
        h, w = hidden.to(dt).requires_grad_(), weight.to(dt).requires_grad_()
        with mock.patch.object(ref_fused, "linear_log_probs_ref", llp):  # the reference's log-prob step
            r_loss, r_met, r_lp, r_ent = fused_linear_policy_loss_ref(h, w, labels, **kw_dt)
        return (r_loss, r_lp, r_ent, *torch.autograd.grad(r_loss, [h, w]),
                *(r_met[k] for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")))

    r_loss, r_lp, r_ent, r_dh, r_dw, *r_met = r64 = ref(torch.float64)
    t_loss, t_lp, t_ent, t_dh, t_dw, *t_met = worst_of([ref(torch.float32, f) for f in TORCH_WAYS], r64)
    r_met, t_met = (dict(zip(("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"), m)) for m in (r_met, t_met))
    assert_close_to_ref(loss, r_loss, t_loss, name="loss")
    assert_close_to_ref(dh, r_dh, t_dh, name="dhidden")
    assert_close_to_ref(dw, r_dw, t_dw, name="dweight")
    assert_close_to_ref(metrics["log_prob"], r_lp, t_lp, name="log_prob")
    for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        assert_close_to_ref(metrics[k], r_met[k], t_met[k], name=k)
    assert ("entropy" in metrics) == bool(ec) and ("kl_loss" in metrics) == bool(kc)
    if ec:
        assert_close_to_ref(metrics["entropy"], r_ent, t_ent, name="entropy")


@pytest.mark.parametrize("be", ["torch", "triton"])
def test_fused_no_grad_same_loss_and_all_masked_zero(be):
    hidden, weight, labels = make_linear(12, 16, 150, torch.float32)
    tok = fused_inputs(12, 150, ref=False)
    with backend(be):
        with torch.no_grad():
            a, ma = dk.fused_linear_policy_loss(hidden, weight, labels, **tok)
        h = hidden.clone().requires_grad_()
        b, mb = dk.fused_linear_policy_loss(h, weight, labels, **tok)
        assert torch.allclose(a, b, rtol=0, atol=0) and torch.equal(ma["log_prob"], mb["log_prob"])
        tok["response_mask"] = torch.zeros(12, dtype=torch.bool)
        for mode in ("token-mean", "seq-mean-token-mean"):
            w = weight.clone().requires_grad_()
            z, _ = dk.fused_linear_policy_loss(h, w, labels, loss_agg_mode=mode,
                                               cu_seqlens=torch.tensor([0, 5, 12]) if mode != "token-mean" else None,
                                               **tok)
            g, g_w = torch.autograd.grad(z, [h, w])
            assert z.item() == 0.0 and torch.equal(g, torch.zeros_like(g)) and torch.equal(g_w, torch.zeros_like(g_w))


@pytest.mark.parametrize("case,exc,match", [
    ("mismatched-N", ValueError, "labels"),
    ("label-out-of-range", ValueError, "labels must lie"),
    ("negative-label", ValueError, "labels must lie"),
    ("int-hidden", ValueError, "hidden"),
    ("weight-dtype", ValueError, "weight"),
    ("complex-mask", ValueError, "response_mask"),
    ("kl-without-ref", ValueError, "ref_log_prob"),
    ("bad-kl-type", ValueError, "kl_type"),
    ("zero-temperature", ValueError, "temperature"),
])
def test_bad_input(case, exc, match):
    hidden, weight, labels = make_linear(6, 16, 100, torch.float32)
    tok = fused_inputs(6, 100, ref=False)
    kw = {}
    if case == "mismatched-N":
        labels = labels[:5]
    elif case == "label-out-of-range":
        labels[2] = 100
    elif case == "negative-label":
        labels[0] = -5
    elif case == "int-hidden":
        hidden = hidden.long()
    elif case == "weight-dtype":
        weight = weight.double()
    elif case == "complex-mask":
        tok["response_mask"] = tok["response_mask"].to(torch.complex64)
    elif case == "kl-without-ref":
        kw["kl_coef"] = 0.1
    elif case == "bad-kl-type":
        kw["kl_type"] = "full"
    elif case == "zero-temperature":
        kw["temperature"] = 0.0
    with pytest.raises(exc, match=match):
        dk.fused_linear_policy_loss(hidden, weight, labels, **tok, **kw)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(entropy_coeff=float("nan")), ValueError, "entropy_coeff must be finite"),
    (dict(entropy_coeff=float("inf")), ValueError, "entropy_coeff must be finite"),
    (dict(kl_coef=float("nan"), with_ref=True), ValueError, "kl_coef must be finite"),
    (dict(kl_coef=float("nan")), ValueError, "kl_coef must be finite"),
    (dict(clip_ratio_high=float("nan")), ValueError, "clip_ratio_high"),
    (dict(clip_ratio_c=float("nan")), ValueError, "clip_ratio_c"),
    (dict(num_tokens=float("nan")), ValueError, "num_tokens"),
    (dict(num_tokens=torch.tensor(-5.0)), RuntimeError, "num_tokens"),
    (dict(loss_scale_factor=0, loss_agg_mode="seq-mean-token-sum-norm", packed=True), ValueError,
     "loss_scale_factor"),
    (dict(loss_scale_factor=torch.tensor(0.0), loss_agg_mode="seq-mean-token-sum-norm", packed=True),
     RuntimeError, "loss_scale_factor"),
], ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else None)
@pytest.mark.parametrize("be", ["torch", "triton"])
def test_bad_scalar_names_argument(be, kw, exc, match):
    """Issue 16 item 5: NaN / inf coefficients and bad counts (a tensor count: device-side assert)."""
    kw = dict(kw)
    hidden, weight, labels = make_linear(6, 16, 100, torch.float32)
    tok = fused_inputs(6, 100, ref=kw.pop("with_ref", False))
    if kw.pop("packed", False):
        kw["cu_seqlens"] = cu_seqlens_from([2, 4])
    with backend(be), pytest.raises(exc, match=match):
        dk.fused_linear_policy_loss(hidden.requires_grad_(), weight, labels, **tok, **kw)


@pytest.mark.parametrize("be", ["torch", "triton"])
def test_global_count_below_local_tokens_is_refused(be):
    """num_tokens below the tokens this call selects would scale the loss up (8 tokens, num_tokens=2:
    4x): a Python count is a ValueError naming num_tokens and the local count, a tensor count (no
    host read) a NaN loss; a count equal to the local one is the plain token mean."""
    torch.manual_seed(0)
    hidden, weight, labels = make_linear(8, 16, 100, torch.float32)
    tok = fused_inputs(8, 100, ref=False)
    tok["response_mask"] = torch.ones(8, dtype=torch.bool)
    with backend(be):
        with pytest.raises(ValueError, match="num_tokens=2 is below the 8 tokens"):
            dk.fused_linear_policy_loss(hidden, weight, labels, **tok, num_tokens=2)
        assert torch.isnan(dk.fused_linear_policy_loss(hidden, weight, labels, **tok, num_tokens=torch.tensor(2))[0])
        local, _ = dk.fused_linear_policy_loss(hidden, weight, labels, **tok)
        exact, _ = dk.fused_linear_policy_loss(hidden, weight, labels, **tok, num_tokens=8)
    assert torch.equal(local, exact)


@pytest.mark.parametrize("be", ["torch", "triton"])
def test_fused_upstream_grad_scales_and_second_backward_refused(be):
    """The gradients are computed in the forward and scaled in place by the upstream grad: a
    loss weight must reach them, and a retained graph must not hand over the buffers twice."""
    hidden, weight, labels = make_linear(12, 16, 150, torch.float32)
    tok = fused_inputs(12, 150, ref=False)
    grads = []
    for scale in (1.0, 0.25):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with backend(be):
            loss, _ = dk.fused_linear_policy_loss(h, w, labels, **tok)
        (scale * loss).backward(retain_graph=True)
        grads.append((h.grad, w.grad))
    # x 0.25 is exact in binary floating point
    assert torch.equal(grads[1][0], 0.25 * grads[0][0]) and torch.equal(grads[1][1], 0.25 * grads[0][1])
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


@pytest.mark.parametrize("be", ["torch", "triton"])
def test_on_policy_old_log_prob_none_is_ratio_one(be):
    """old_log_prob=None: the op's own log-probs, detached, are the old ones (ratio exactly 1), as if a
    separate no-grad pass had supplied them; calculate_entropy returns the entropy without a coefficient."""
    n, v = 29, 50
    hidden, weight, labels = make_linear(n, 24, v, torch.float32)
    adv, mask = torch.randn(n), torch.rand(n) > 0.3
    with backend(be):
        h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, m = dk.fused_linear_policy_loss(h1, w1, labels, None, adv, mask, calculate_entropy=True)
        loss.backward()
        lp, ent = dk.linear_log_probs(hidden, weight, labels, return_entropy=True)
        h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss2, m2 = dk.fused_linear_policy_loss(h2, w2, labels, lp.detach(), adv, mask)
        loss2.backward()
    assert m["ppo_kl"] == 0 and m["pg_clipfrac"] == 0 and m["pg_clipfrac_lower"] == 0
    # A separate pass's fp32 log-prob puts each ratio within half an ulp of that log-prob of 1 (the op's
    # own log-prob is finer than fp32): the loss moves by at most sum_t w_t |adv_t| ulp(lp_t) / 2, plus
    # its own rounding to fp32; the gradients by as little.
    assert torch.equal(m["log_prob"], lp)
    ulp = torch.nextafter(lp.abs(), torch.tensor(float("inf"))) - lp.abs()
    w = mask.double() / mask.sum()
    bound = (w * adv.double().abs() * ulp.double() / 2).sum() + (torch.nextafter(loss2.abs(), loss2.abs() + 1)
                                                                  - loss2.abs()).double()
    assert (loss - loss2).abs().double() <= bound, f"loss {loss.item()!r} vs {loss2.item()!r}, bound {bound.item():.3e}"
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(m["entropy"], ent, rtol=1e-6, atol=1e-6)
    assert "entropy_loss" not in m and "entropy" not in m2  # no coefficient: no entropy term


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_all_ones_is_weights_are_bit_identical(be, mode):
    """rollout_is_weights of ones gives the bits of no weights: loss, every metric, dH and dW."""
    torch.manual_seed(0)
    hidden, weight, labels = make_linear(23, 16, 120, torch.float32)
    tok = fused_inputs(23, 120)
    kw = dict(loss_agg_mode=mode, entropy_coeff=0.01, kl_coef=0.1, cu_seqlens=cu_seqlens_from([9, 0, 14]), **tok)
    outs = []
    for r in (None, torch.ones(23)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with backend(be):
            loss, metrics = dk.fused_linear_policy_loss(h, w, labels, rollout_is_weights=r, **kw)
            outs.append((loss, metrics, *torch.autograd.grad(loss, [h, w])))
    (a, ma, *ga), (b, mb, *gb) = outs
    assert torch.equal(a, b) and ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))


@pytest.mark.parametrize("value,exc", [(torch.ones(5), ValueError), (torch.ones(6, 1), ValueError),
                                       (torch.ones(6, dtype=torch.int32), ValueError),
                                       (torch.ones(6, device="meta"), ValueError), ([1.0] * 6, TypeError)],
                         ids=["short", "2d", "int", "other-device", "list"])
def test_bad_is_weights_name_the_argument(value, exc):
    hidden, weight, labels = make_linear(6, 16, 100, torch.float32)
    with pytest.raises(exc, match="rollout_is_weights"):
        dk.fused_linear_policy_loss(hidden, weight, labels, **fused_inputs(6, 100, ref=False), rollout_is_weights=value)
