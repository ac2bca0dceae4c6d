"""Shared by the tests of linear_log_probs, fused_linear_policy_loss (tests/ops, tests/npu_fake)
and their vocab-parallel check: plain torch's usual ways to compute log-probs / entropy (the
tolerance is the worst of them, tests/tolerance.py), and the inputs and gradient plumbing of those tests."""
import math

import torch

import dapo_kernels as dk
from dapo_kernels.reference import linear_log_probs_ref
from tests.tolerance import worst_of


def llp_token_chunks(hidden, weight, labels, temperature=1.0, rows=8):
    """linear_log_probs_ref over chunks of 8 tokens (dW summed chunk by chunk, as chunked losses do)."""
    outs = [linear_log_probs_ref(hidden[i:i + rows], weight, labels[i:i + rows], temperature)
            for i in range(0, hidden.shape[0], rows)]
    return tuple(torch.cat(o) for o in zip(*outs))


def llp_scaled_weight(hidden, weight, labels, temperature=1.0):
    """The temperature on the weight instead of the logits, log-probs as logits - logsumexp."""
    logits = hidden @ (weight.t() / temperature)
    logp_all = logits - torch.logsumexp(logits, -1, keepdim=True)
    return logp_all.gather(-1, labels[:, None].long())[:, 0], -(torch.softmax(logits, -1) * logp_all).sum(-1)


def llp_vocab_chunks(hidden, weight, labels, temperature=1.0, cols=64):
    """Logits by vocab chunks of 64, logsumexp of the chunks' logsumexps, as tiled kernels walk the
    vocabulary (dhidden summed chunk by chunk)."""
    zs = [hidden @ weight[v:v + cols].t() / temperature for v in range(0, weight.shape[0], cols)]
    lse = torch.logsumexp(torch.stack([torch.logsumexp(z, -1) for z in zs], -1), -1)[:, None]
    logp_all = torch.cat(zs, -1) - lse
    entropy = -sum(((z - lse).exp() * (z - lse)).sum(-1) for z in zs)
    return logp_all.gather(-1, labels[:, None].long())[:, 0], entropy


def llp_reordered_hidden(hidden, weight, labels, temperature=1.0, shift=None):
    """linear_log_probs_ref with the hidden dimension summed in another order (rolled by ``shift``,
    reversed when None): the same math, an independent fp32 rounding of every logit."""
    def order(t):
        return t.flip(-1) if shift is None else t.roll(shift, -1)
    return linear_log_probs_ref(order(hidden), order(weight), labels, temperature)


def llp_rolled_hidden(hidden, weight, labels, temperature=1.0):
    return llp_reordered_hidden(hidden, weight, labels, temperature, shift=hidden.shape[-1] // 2 + 1)


# Plain torch's usual ways to compute log-probs / entropy. At these sizes each output's max error is
# the max of a handful of heavy-tailed rounding errors - often one token's, whose gradient dwarfs
# the others' - so one summation order can be lucky; torch's own error for the tolerance is the
# least accurate of these. The first four share most of their logits' rounding (same hidden-dim
# order); the last two sum the hidden dimension in other orders, so the set samples that rounding
# three times instead of once.
TORCH_WAYS = (linear_log_probs_ref, llp_token_chunks, llp_scaled_weight, llp_vocab_chunks,
              llp_reordered_hidden, llp_rolled_hidden)


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


def reference_and_torch(hidden, weight, labels, cot, temperature=1.0):
    """((log_prob, entropy, dhidden, dweight) in float64, the same from the least accurate of
    TORCH_WAYS in the inputs' dtype), for the cotangents ``cot`` of log_prob and entropy."""
    (lp, ent), dh, dw = grads_of(lambda h, w: linear_log_probs_ref(h, w, labels, temperature),
                                 hidden.double(), weight.double(), *cot)
    ref = (lp, ent, dh, dw)
    ways = [grads_of(lambda h, w, f=f: f(h, w, labels, temperature), hidden, weight, *cot) for f in TORCH_WAYS]
    return ref, worst_of([(*o, dh_, dw_) for o, dh_, dw_ in ways], ref)


def fused_loss_step(n, h, v, dtype):
    """``((hidden, weight, labels, tok, leaf_h, leaf_w), step)``: fused-loss inputs (make_linear,
    fused_inputs), leaf copies of hidden / weight, and a closure running forward + backward on the leaves
    with entropy and KL terms."""
    hidden, weight, labels = make_linear(n, h, v, dtype)
    tok = fused_inputs(n, v)
    leaf_h, leaf_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    def step():
        loss, _ = dk.fused_linear_policy_loss(leaf_h, leaf_w, labels, **tok, entropy_coeff=0.01, kl_coef=0.1)
        loss.backward()

    return (hidden, weight, labels, tok, leaf_h, leaf_w), step


def fused_inputs(n, v, *, ref=True):
    old = -3 * torch.rand(n)
    # log-ratios around 0 and past the clip bounds, relative to the (unknown) new log-prob
    return dict(old_log_prob=old, advantages=torch.randn(n), response_mask=torch.rand(n) > 0.2,
                ref_log_prob=(old + 0.3 * torch.randn(n)) if ref else None)
