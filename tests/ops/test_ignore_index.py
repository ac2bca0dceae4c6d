"""ignore_index in dk.linear_log_probs and dk.fused_linear_policy_loss: tokens labelled ignore_index
(default -100, as transformers and Liger) get log-prob / entropy 0, add nothing to the gradients,
and are left out of the loss's token counts; both backends."""
import pytest
import torch

import dapo_kernels as dk
from tests.helpers import backend
from tests.linear_log_probs_ways import fused_inputs, grads_of, make_linear, reference_and_torch
from tests.tolerance import assert_close_to_ref

N, H, V = 29, 24, 90


def _labels_with_ignored(labels, ignore=-100):
    ignored = torch.zeros(labels.shape[0], dtype=torch.bool)
    ignored[[0, 5, 6, 17, N - 1]] = True
    return labels.masked_fill(ignored, ignore), ignored


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("ignore", [-100, -1, 7], ids=["default", "minus1", "in-vocab"])
def test_linear_log_probs_ignored_tokens(be, ignore):
    """Ignored tokens (one of them NaN) get exact zeros and no gradient; the other tokens' outputs and
    gradients are those of the batch without the ignored ones, within the tolerance rule against its
    float64 reference (a kept token's rounding may depend on where it sits in a tile)."""
    hidden, weight, labels = make_linear(N, H, V, torch.float32)
    labels = labels.masked_fill(labels == ignore, 8) if ignore >= 0 else labels
    lab, ignored = _labels_with_ignored(labels, ignore)
    hidden[5] = float("nan")  # an ignored token's NaN must reach nothing
    cot = (torch.randn(N), torch.randn(N))
    kw = {} if ignore == -100 else dict(ignore_index=ignore)
    with backend(be):
        (lp, ent), dh, dw = grads_of(lambda h, w: dk.linear_log_probs(h, w, lab, return_entropy=True, **kw),
                                     hidden, weight, *cot)
    assert torch.equal(lp[ignored], torch.zeros(5)) and torch.equal(ent[ignored], torch.zeros(5))
    assert torch.equal(dh[ignored], torch.zeros(5, H))
    keep = ~ignored
    ref, low = reference_and_torch(hidden[keep], weight, labels[keep], (cot[0][keep], cot[1][keep]))
    for name, got, r, t in zip(("log_prob", "entropy", "dhidden", "dweight"), (lp[keep], ent[keep], dh[keep], dw),
                               ref, low):
        assert_close_to_ref(got, r, t, name=name)


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_fused_loss_ignored_tokens_are_masked_out(be, mode):
    hidden, weight, labels = make_linear(N, H, V, torch.float32)
    lab, ignored = _labels_with_ignored(labels)
    tok = fused_inputs(N, V, ref=False)
    kw = dict(loss_agg_mode=mode, entropy_coeff=0.01, cu_seqlens=torch.tensor([0, 10, 20, N], dtype=torch.int32))
    with backend(be):
        (loss, metrics), dh, dw = grads_of(lambda h, w: _fused(h, w, lab, tok, kw), hidden, weight, torch.ones(()))
        masked = dict(tok, response_mask=tok["response_mask"] & ~ignored)
        (loss_m, metrics_m), dh_m, dw_m = grads_of(lambda h, w: _fused(h, w, labels, masked, kw), hidden, weight,
                                                   torch.ones(()))
    assert torch.equal(loss, loss_m) and torch.equal(dh, dh_m) and torch.equal(dw, dw_m)
    for name in ("pg_clipfrac", "ppo_kl", "pg_loss"):
        assert torch.equal(metrics[name], metrics_m[name]), name
    assert torch.equal(metrics["log_prob"][ignored], torch.zeros(5))
    assert torch.equal(metrics["entropy"][ignored], torch.zeros(5))
    assert torch.equal(metrics["log_prob"][~ignored], metrics_m["log_prob"][~ignored])


def _fused(h, w, labels, tok, kw):
    loss, metrics = dk.fused_linear_policy_loss(h, w, labels, **tok, **kw)
    return loss, metrics


@pytest.mark.parametrize("op", ["linear_log_probs", "fused_linear_policy_loss"])
def test_ignore_index_none_and_range_errors(op):
    hidden, weight, labels = make_linear(N, H, V, torch.float32)
    lab, _ = _labels_with_ignored(labels)
    tok = fused_inputs(N, V, ref=False)

    def call(lab, **kw):
        if op == "linear_log_probs":
            return dk.linear_log_probs(hidden, weight, lab, **kw)
        return dk.fused_linear_policy_loss(hidden, weight, lab, **tok, **kw)

    with pytest.raises(ValueError, match=r"labels must lie in \[0, V\) = \[0, 90\), got range \[-100"):
        call(lab, ignore_index=None)
    bad = lab.clone()
    bad[3] = V  # out of range besides the ignored ones
    with pytest.raises(ValueError, match=r"except ignore_index=-100\), got range \[\d+, 90\]"):
        call(bad)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        call(lab, ignore_index=-100.0)
    everything = torch.full((N,), -100)
    out = call(everything)
    got = out[0] if op == "linear_log_probs" else out[1]["log_prob"]
    assert torch.equal(got, torch.zeros(N))
