"""dk.linear_log_probs against the float64 full-logits reference, within 2x plain torch's own error
(the worst of its usual ways, tests/linear_log_probs_ways.py)."""
import pytest
import torch

import dapo_kernels as dk
from dapo_kernels.reference import linear_log_probs_ref
from tests.helpers import backend, case_id
from tests.linear_log_probs_ways import TORCH_WAYS, grads_of, make_linear
from tests.tolerance import assert_close_to_ref, max_abs_err, worst_of


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


@pytest.mark.parametrize("be", ["torch", "triton"])
def test_empty_tokens(be):
    hidden, weight, _ = make_linear(0, 16, 100, torch.float32)
    with backend(be):
        lp, ent = dk.linear_log_probs(hidden, weight, torch.zeros(0, dtype=torch.long), return_entropy=True)
    assert lp.shape == ent.shape == (0,)


@pytest.mark.parametrize("rows", [1, 3, 7])
def test_row_chunks_cover_every_token_once(rows, monkeypatch):
    """The Triton path walks row chunks (1, 3 or 7 rows: several chunks, the last one partial, dW
    summed over them): log-probs, entropy and both gradients match the reference as with one chunk."""
    import dapo_kernels.ops.linear_log_probs as llp
    N, H, V = 17, 24, 150
    hidden, weight, labels = make_linear(N, H, V, torch.float32)
    cot = (torch.randn(N), torch.randn(N))
    monkeypatch.setattr(llp, "_CHUNK_BYTES", rows * 4 * V)
    assert llp.chunk_rows(N, V) == rows
    with backend("triton"):
        (lp, ent), dh, dw = grads_of(lambda h, w: dk.linear_log_probs(h, w, labels, return_entropy=True),
                                     hidden, weight, *cot)
    (r_lp, r_ent), r_dh, r_dw = grads_of(lambda h, w: linear_log_probs_ref(h, w, labels), hidden.double(),
                                         weight.double(), *cot)
    ways = [grads_of(lambda h, w, f=f: f(h, w, labels), hidden, weight, *cot) for f in TORCH_WAYS]
    t_lp, t_ent, t_dh, t_dw = worst_of([(*o, dh_, dw_) for o, dh_, dw_ in ways], (r_lp, r_ent, r_dh, r_dw))
    for name, o, r, t in (("log_prob", lp, r_lp, t_lp), ("entropy", ent, r_ent, t_ent), ("dhidden", dh, r_dh, t_dh),
                          ("dweight", dw, r_dw, t_dw)):
        assert_close_to_ref(o, r, t, name=name)
