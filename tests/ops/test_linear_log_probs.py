"""dk.linear_log_probs / dk.fused_linear_policy_loss / dk.kl_penalty against float64 full-logits references."""
import math
from unittest import mock

import pytest
import torch

import dapo_kernels as dk
import dapo_kernels.reference.fused_linear_policy_loss as ref_fused
from dapo_kernels.reference import fused_linear_policy_loss_ref, kl_penalty_ref, linear_log_probs_ref
from tests.helpers import assert_close_to_ref, backend, case_id, cu_seqlens_from, max_abs_err


def _llp_token_chunks(hidden, weight, labels, temperature=1.0, rows=8):
    """linear_log_probs_ref over chunks of 8 tokens (dW summed chunk by chunk, as chunked losses do)."""
    outs = [linear_log_probs_ref(hidden[i:i + rows], weight, labels[i:i + rows], temperature)
            for i in range(0, hidden.shape[0], rows)]
    return tuple(torch.cat(o) for o in zip(*outs))


def _llp_scaled_weight(hidden, weight, labels, temperature=1.0):
    """The temperature on the weight instead of the logits, log-probs as logits - logsumexp."""
    logits = hidden @ (weight.t() / temperature)
    logp_all = logits - torch.logsumexp(logits, -1, keepdim=True)
    return logp_all.gather(-1, labels[:, None].long())[:, 0], -(torch.softmax(logits, -1) * logp_all).sum(-1)


def _llp_vocab_chunks(hidden, weight, labels, temperature=1.0, cols=64):
    """Logits by vocab chunks of 64, logsumexp of the chunks' logsumexps, as tiled kernels walk the
    vocabulary (dhidden summed chunk by chunk)."""
    zs = [hidden @ weight[v:v + cols].t() / temperature for v in range(0, weight.shape[0], cols)]
    lse = torch.logsumexp(torch.stack([torch.logsumexp(z, -1) for z in zs], -1), -1)[:, None]
    logp_all = torch.cat(zs, -1) - lse
    entropy = -sum(((z - lse).exp() * (z - lse)).sum(-1) for z in zs)
    return logp_all.gather(-1, labels[:, None].long())[:, 0], entropy


def _llp_reordered_hidden(hidden, weight, labels, temperature=1.0, shift=None):
    """linear_log_probs_ref with the hidden dimension summed in another order (rolled by ``shift``,
    reversed when None): the same math, an independent fp32 rounding of every logit."""
    def order(t):
        return t.flip(-1) if shift is None else t.roll(shift, -1)
    return linear_log_probs_ref(order(hidden), order(weight), labels, temperature)


def _llp_rolled_hidden(hidden, weight, labels, temperature=1.0):
    return _llp_reordered_hidden(hidden, weight, labels, temperature, shift=hidden.shape[-1] // 2 + 1)


# Plain torch's usual ways to compute log-probs / entropy. At these sizes each output's max error is
# the max of a handful of heavy-tailed rounding errors - often one token's, whose gradient dwarfs
# the others' - and one summation order can be lucky (dW's ratio between two orders reaches 3.5x
# over 30 seeds); torch's own error for the tolerance is the least accurate of these, as
# tests/ops/test_varlen_attention.py's _torch_in_dtype does. The first four share most of their
# logits' rounding (same hidden-dim order); the last two sum the hidden dimension in other orders,
# so the set samples that rounding three times instead of once.
TORCH_WAYS = (linear_log_probs_ref, _llp_token_chunks, _llp_scaled_weight, _llp_vocab_chunks,
              _llp_reordered_hidden, _llp_rolled_hidden)


def worst_of(candidates, refs):
    """Per quantity, the candidate farthest from its float64 reference: ``candidates`` is one tuple
    of outputs per way, ``refs`` the float64 outputs in the same order."""
    return tuple(max(c, key=lambda t, r=r: max_abs_err(t, r)) for c, r in zip(zip(*candidates), refs))


def make_linear(n, h, v, dtype, logit_std=2.0):
    hidden = torch.randn(n, h).to(dtype)
    weight = (torch.randn(v, h) * logit_std / math.sqrt(h)).to(dtype)
    return hidden, weight, torch.randint(0, v, (n,))


def grads_of(fn, hidden, weight, *cot):
    """Outputs of fn(h, w) and d(sum(out_i * cot_i))/d(h, w)."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    outs = fn(h, w)
    dh, dw = torch.autograd.grad(sum((o * c.to(o.dtype)).sum() for o, c in zip(outs, cot)), [h, w])
    return outs, dh, dw


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("N,H,V,dtype,temp", [
    pytest.param(*c, id=case_id(N=c[0], H=c[1], V=c[2], dtype=c[3], T=c[4])) for c in
    [(37, 40, 260, torch.float32, 0.6), (70, 48, 300, torch.float32, 1.0),
     (37, 40, 260, torch.bfloat16, 1.0)]])
def test_linear_log_probs_matches_reference(be, N, H, V, dtype, temp):
    hidden, weight, labels = make_linear(N, H, V, dtype)
    cot = (torch.randn(N), torch.randn(N))
    with backend(be):
        (lp, ent), dh, dw = grads_of(lambda h, w: dk.linear_log_probs(h, w, labels, temperature=temp,
                                                                       return_entropy=True), hidden, weight, *cot)
    assert lp.dtype == ent.dtype == torch.float32 and dh.dtype == dw.dtype == dtype
    (r_lp, r_ent), r_dh, r_dw = grads_of(lambda h, w: linear_log_probs_ref(h, w, labels, temp),
                                         hidden.double(), weight.double(), *cot)
    ways = [grads_of(lambda h, w, f=f: f(h, w, labels, temp), hidden, weight, *cot) for f in TORCH_WAYS]
    t_lp, t_ent, t_dh, t_dw = worst_of([(*o, dh_, dw_) for o, dh_, dw_ in ways], (r_lp, r_ent, r_dh, r_dw))
    assert_close_to_ref(lp, r_lp, t_lp, name="log_prob")
    assert_close_to_ref(ent, r_ent, t_ent, name="entropy")
    assert_close_to_ref(dh, r_dh, t_dh, name="dhidden")
    assert_close_to_ref(dw, r_dw, t_dw, name="dweight")


@pytest.mark.parametrize("be", ["torch", "triton"])
def test_single_token(be):
    """N = 1. One value is one sample of rounding error, so torch's error is measured on 64
    rows of the same distribution (row 0 is the token under test)."""
    hidden, weight, labels = make_linear(64, 48, 300, torch.float32)
    cot = (torch.randn(64), torch.randn(64))
    with backend(be):
        (lp, ent), dh, dw = grads_of(lambda h, w: dk.linear_log_probs(h, w, labels[:1], return_entropy=True),
                                     hidden[:1], weight, cot[0][:1], cot[1][:1])
    ref = [grads_of(lambda h, w: linear_log_probs_ref(h, w, labels), hidden.to(dt), weight.to(dt), *cot)
           for dt in (torch.float64, torch.float32)]
    ref1 = grads_of(lambda h, w: linear_log_probs_ref(h, w, labels[:1]), hidden[:1].double(), weight.double(),
                    cot[0][:1].double(), cot[1][:1].double())
    for name, ours, r1, r, t in (("log_prob", lp, ref1[0][0], ref[0][0][0], ref[1][0][0]),
                                 ("entropy", ent, ref1[0][1], ref[0][0][1], ref[1][0][1]),
                                 ("dhidden", dh, ref1[1], ref[0][1], ref[1][1])):
        bound = 2 * max(max_abs_err(t, r), torch.finfo(torch.float32).eps * r.abs().max().item())
        assert max_abs_err(ours, r1) <= bound, f"{name}: {max_abs_err(ours, r1):.3e} > {bound:.3e}"


@pytest.mark.parametrize("be", ["torch", "triton"])
def test_bf16_large_logits_log_prob_error_below_1e3(be):
    """The issue's bound: logits of std 4 from bf16 inputs, log-prob error < 1e-3 nats."""
    hidden, weight, labels = make_linear(64, 48, 300, torch.bfloat16, logit_std=4.0)
    with backend(be):
        lp, _ = dk.linear_log_probs(hidden, weight, labels)
    ref, _ = linear_log_probs_ref(hidden.double(), weight.double(), labels)
    assert (hidden.double() @ weight.double().t()).std() > 3.0
    assert (lp.double() - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("be", ["torch", "triton"])
def test_log_prob_only_gradient(be):
    hidden, weight, labels = make_linear(9, 16, 130, torch.float32)
    cot = (torch.randn(9),)
    with backend(be):
        (lp,), dh, dw = grads_of(lambda h, w: dk.linear_log_probs(h, w, labels)[:1], hidden, weight, *cot)
    (r,), r_dh, r_dw = grads_of(lambda h, w: linear_log_probs_ref(h, w, labels)[:1], hidden.double(),
                                weight.double(), *cot)
    t_dh, t_dw = worst_of([grads_of(lambda h, w, f=f: f(h, w, labels)[:1], hidden, weight, *cot)[1:]
                           for f in TORCH_WAYS], (r_dh, r_dw))
    assert_close_to_ref(dh, r_dh, t_dh, name="dhidden")
    assert_close_to_ref(dw, r_dw, t_dw, name="dweight")


def fused_inputs(n, v, *, ref=True):
    old = -3 * torch.rand(n)
    # log-ratios around 0 and past the clip bounds, relative to the (unknown) new log-prob
    return dict(old_log_prob=old, advantages=torch.randn(n), response_mask=torch.rand(n) > 0.2,
                ref_log_prob=(old + 0.3 * torch.randn(n)) if ref else None)


FUSED_CASES = [
    # mode, entropy_coeff, kl_coef, kl_type, packed cu_seqlens lengths
    ("token-mean", 0.0, 0.0, "low_var_kl", None),
    ("token-mean", 0.01, 0.1, "low_var_kl", None),
    ("token-sum", 0.0, 0.05, "kl", None),
    ("seq-mean-token-sum", 0.02, 0.1, "abs", [10, 0, 27]),
    ("seq-mean-token-mean", 0.0, 0.1, "mse", [1, 20, 16]),
    ("seq-mean-token-sum-norm", 0.01, 0.0, "low_var_kl", [30, 7]),
]


def _fused_id(c):
    return f"{c[0]}-ent{c[1]}-kl{c[2]}-{c[3]}"


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("mode,ec,kc,kl_type,lengths", [pytest.param(*c, id=_fused_id(c)) for c in FUSED_CASES])
def test_fused_matches_reference(be, mode, ec, kc, kl_type, lengths):
    N, H, V = 37, 32, 200
    hidden, weight, labels = make_linear(N, H, V, torch.float32)
    tok = fused_inputs(N, V)
    kw = dict(temperature=0.6, loss_agg_mode=mode, entropy_coeff=ec, kl_coef=kc, kl_type=kl_type,
              cu_seqlens=cu_seqlens_from(lengths) if lengths else None, **tok)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with backend(be):
        loss, metrics = dk.fused_linear_policy_loss(h, w, labels, **kw)
        dh, dw = torch.autograd.grad(loss, [h, w])

    def ref(dt, llp=linear_log_probs_ref):
        kw_dt = {k: (v.to(dt) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
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


@pytest.mark.parametrize("be", ["torch", "triton"])
def test_empty_tokens(be):
    hidden, weight, _ = make_linear(0, 16, 100, torch.float32)
    with backend(be):
        lp, ent = dk.linear_log_probs(hidden, weight, torch.zeros(0, dtype=torch.long), return_entropy=True)
    assert lp.shape == ent.shape == (0,)


@pytest.mark.parametrize("case,exc,match", [
    ("mismatched-N", ValueError, "labels"),
    ("label-out-of-range", ValueError, "labels must lie"),
    ("negative-label", ValueError, "labels must lie"),
    ("int-hidden", ValueError, "hidden"),
    ("weight-dtype", ValueError, "weight"),
    ("float-mask", ValueError, "response_mask"),
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
        labels[0] = -100
    elif case == "int-hidden":
        hidden = hidden.long()
    elif case == "weight-dtype":
        weight = weight.double()
    elif case == "float-mask":
        tok["response_mask"] = tok["response_mask"].float()
    elif case == "kl-without-ref":
        kw["kl_coef"] = 0.1
    elif case == "bad-kl-type":
        kw["kl_type"] = "full"
    elif case == "zero-temperature":
        kw["temperature"] = 0.0
    with pytest.raises(exc, match=match):
        dk.fused_linear_policy_loss(hidden, weight, labels, **tok, **kw)


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
