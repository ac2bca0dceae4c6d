"""npu_ops.linear_log_probs (the NPU kernels of linear_log_probs / fused_linear_policy_loss) on CPU tensors:
pure torch, so it runs here as it would on the NPU; checked against the float64 references
with several token chunks per call."""
from unittest import mock

import pytest
import torch

import dapo_kernels.reference.fused_linear_policy_loss as ref_fused

from dapo_kernels.backend_api import LossParams, LossSums, LossTokens
from dapo_kernels.ops.policy_loss import aggregation_weights
from dapo_kernels.reference import fused_linear_policy_loss_ref
from npu_ops import linear_log_probs as loss
from tests.helpers import case_id
from tests.linear_log_probs_ways import TORCH_WAYS, make_linear
from tests.tolerance import assert_close_to_ref, worst_of

N, H, V = 37, 24, 50
CHUNK_ROWS = 8  # 5 chunks, the last one partial


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(loss, "CHUNK_BYTES", 4 * V * CHUNK_ROWS)


def _ref_grads(fn, hidden, weight, compute_dtype):
    """fn's outputs in compute_dtype and the gradients of sum(outputs_i * cot_i) w.r.t. (hidden, weight)."""
    h, w = (t.detach().to(compute_dtype).requires_grad_() for t in (hidden, weight))
    outs, cots = fn(h, w)
    dh, dw = torch.autograd.grad(sum((o * c.to(o.dtype)).sum() for o, c in zip(outs, cots)), [h, w])
    return [o.detach() for o in outs], dh, dw


def _torch_low(fn, hidden, weight, ref64):
    """Plain torch's own fp32 result per quantity: the worst of its usual log-prob formulations
    (tests/linear_log_probs_ways.py), in ``_ref_grads``' layout."""
    n_out = len(ref64[0])
    runs = []
    for way in TORCH_WAYS:
        with mock.patch.object(ref_fused, "linear_log_probs_ref", way):
            outs, dh, dw = _ref_grads(fn, hidden, weight, torch.float32)
        runs.append((*outs, dh, dw))
    flat = worst_of(runs, (*ref64[0], ref64[1], ref64[2]))
    return list(flat[:n_out]), flat[n_out], flat[n_out + 1]


@pytest.mark.parametrize("dtype,temp", [(torch.float32, 0.7), (torch.bfloat16, 1.0)],
                         ids=[case_id(dtype=torch.float32), case_id(dtype=torch.bfloat16)])
def test_linear_log_probs_forward_backward(dtype, temp):
    hidden, weight, labels = make_linear(N, H, V, dtype)
    log_prob, ent, rows = loss.linear_log_probs(hidden, weight, labels, temp, True, 0, "")
    assert rows.dtype == torch.float64 and rows.shape == (5, N)  # the op's contract: fp64 rows for the backward
    g_lp, g_ent = torch.randn(N), torch.randn(N)
    d_h, d_w = loss.linear_log_probs_bwd(hidden, weight, labels, rows, g_lp, g_ent, temp, 0, "")
    assert d_h.dtype == dtype and d_w.dtype == dtype

    def fn(h, w):
        return ref_fused.linear_log_probs_ref(h, w, labels, temp), (g_lp, g_ent)

    ref64 = _ref_grads(fn, hidden, weight, torch.float64)
    low = _torch_low(fn, hidden, weight, ref64)
    assert_close_to_ref(log_prob, ref64[0][0], low[0][0], name="log_prob")
    assert_close_to_ref(ent, ref64[0][1], low[0][1], name="entropy")
    # dH/dW are rounded to the inputs' dtype: compare in that dtype's terms.
    assert_close_to_ref(d_h, ref64[1], low[1].to(dtype), name="dH")
    assert_close_to_ref(d_w, ref64[2], low[2].to(dtype), name="dW")


def test_linear_log_probs_without_entropy_and_vocab_shard():
    """A vocab shard [vocab_start, vocab_start + V): labels outside it give no target logit."""
    hidden, weight, labels = make_linear(N, H, V, torch.float32)
    lp_sh, ent_sh, (lse_sh, *_) = loss.linear_log_probs(hidden, weight[20:], labels, 1.0, False, 20, "")
    full_lp, _, (full_lse, *_) = loss.linear_log_probs(hidden, weight, labels, 1.0, False, 0, "")
    lse_sh, full_lse = lse_sh.float(), full_lse.float()
    assert torch.equal(ent_sh, torch.zeros(N))
    shard_lse = torch.logsumexp(hidden @ weight[20:].t(), -1)
    torch.testing.assert_close(lse_sh, shard_lse, rtol=1e-5, atol=1e-5)
    inside = labels >= 20
    torch.testing.assert_close(lp_sh[inside], (full_lp + full_lse - shard_lse)[inside], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ent_coef,kl_coef,is_weights", [(0.0, 0.0, False), (0.01, 0.1, False), (0.01, 0.1, True)],
                         ids=["pg", "pg-ent-kl", "pg-ent-kl-is_weights"])
def test_fused_linear_policy_loss(ent_coef, kl_coef, is_weights):
    hidden, weight, labels = make_linear(N, H, V, torch.float32)
    old = -torch.rand(N) * 3
    adv, ref = torch.randn(N), -torch.rand(N) * 3
    mask = torch.rand(N) > 0.2
    is_w = 0.5 + 1.5 * torch.rand(N) if is_weights else None  # rollout IS weights: the pg term only
    clips = (0.2, 0.28, 3.0)
    w = aggregation_weights(mask, "token-mean")
    tokens = LossTokens(old_log_prob=old, advantages=adv, mask=mask, weights=w,
                        ref_log_prob=ref if kl_coef else old.new_zeros(0),
                        is_weights=old.new_zeros(0) if is_w is None else is_w)
    params = LossParams(temperature=0.9, clip_ratio_low=clips[0], clip_ratio_high=clips[1], clip_ratio_c=clips[2],
                        entropy_coeff=ent_coef, kl_coef=kl_coef)
    stacked, log_prob, ent, d_h, d_w = loss.fused_linear_policy_loss(
        hidden, weight, labels, list(tokens), list(params), "low_var_kl", 0, "", bool(ent_coef), True)
    assert stacked.dtype == torch.float64 and stacked.shape == (len(LossSums._fields),)
    sums = LossSums._make(stacked.unbind())

    def fn(h, w_):
        out = fused_linear_policy_loss_ref(h, w_, labels, old, adv, mask, temperature=0.9, clip_ratio_low=clips[0],
                                           clip_ratio_high=clips[1], clip_ratio_c=clips[2], entropy_coeff=ent_coef,
                                           ref_log_prob=ref, kl_coef=kl_coef, rollout_is_weights=is_w)
        return (out[0], out[2], out[3]), (torch.ones(()), torch.zeros(N), torch.zeros(N))

    ref64 = _ref_grads(fn, hidden, weight, torch.float64)
    low = _torch_low(fn, hidden, weight, ref64)
    # The loss as the op returns it: dk.fused_linear_policy_loss rounds sums.total to fp32. Torch's sum
    # of fp32 per-token terms can by luck sit orders below one fp32 ulp of the loss; compared in fp64,
    # ours would be held to that luck (benchmarks/RESULTS.md, "the NPU fused-loss xfail").
    assert_close_to_ref(sums.total.float(), ref64[0][0], low[0][0], name="loss")
    assert_close_to_ref(log_prob, ref64[0][1], low[0][1], name="log_prob")
    if ent_coef:
        assert_close_to_ref(ent, ref64[0][2], low[0][2], name="entropy")
    assert sums.tokens.item() == mask.sum().item()
    # Known gap, reported as xfail: dH / dW can exceed 2x plain torch's error. The loss head's
    # d loss / d log_prob comes from the fp32 log-probs, which share one rounding of 1/T: a bias every
    # token's gradient carries alike, so it adds up in dW = sum_t dz_t x_t (the CUDA / CPU paths
    # refine the target logit in fp64 for this; figures: benchmarks/RESULTS.md, "the NPU fused-loss xfail").
    gaps = []
    for name, out, r, t in (("dH", d_h, ref64[1], low[1]), ("dW", d_w, ref64[2], low[2])):
        try:
            assert_close_to_ref(out, r, t, name=name)
        except AssertionError as e:
            gaps.append(str(e).splitlines()[0])
    if gaps:
        pytest.xfail("known NPU-path fused-loss gradient gap: " + "; ".join(gaps))


def test_fused_without_grad_or_tokens():
    hidden, weight, labels = make_linear(N, H, V, torch.float32)
    mask = torch.zeros(0, dtype=torch.bool)
    tokens = LossTokens(old_log_prob=torch.zeros(0), advantages=torch.zeros(0), mask=mask,
                        weights=aggregation_weights(mask, "token-mean"), ref_log_prob=torch.zeros(0),
                        is_weights=torch.zeros(0))
    params = LossParams(temperature=1.0, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                        entropy_coeff=0.0, kl_coef=0.0)
    sums, log_prob, ent, d_h, d_w = loss.fused_linear_policy_loss(
        hidden[:0], weight, labels[:0], list(tokens), list(params), "low_var_kl", 0, "", False, False)
    assert torch.equal(sums, torch.zeros(len(LossSums._fields), dtype=torch.float64))
    assert log_prob.shape == (0,) and d_h.shape == (0, H) and d_w.shape == (0, H)
