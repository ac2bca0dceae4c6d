"""varlen attention on the CPU: dk.varlen_attention (torch path) against the ways plain torch
can run the same packed batch, forward and forward+backward, fp32, causal, GQA 8:2, D=64.

Batch: 12 sequences with lengths log-uniform in [16, 768] (an RL length mix scaled to the
CPU), seeded. Peers, all torch's fused CPU SDPA kernel underneath:

* ``padded``: SDPA on a ``[B, H, S_max, D]`` zero-padded batch with a key-padding + causal
  mask (what a model without unpadding runs; the padding copies are not timed);
* ``per_sequence``: a Python loop of SDPA calls, one per sequence;
* ``block_diag``: one SDPA call over the whole packed stream with a ``[T, T]``
  block-diagonal causal mask.

``pytest benchmarks/bench_attention.py --benchmark-only -p no:xdist``
"""
import math

import pytest
import torch
import torch.nn.functional as F

import dapo_kernels as dk

HQ, HKV, D = 8, 2, 64
N_SEQ, MIN_LEN, MAX_LEN = 12, 16, 768
ROUNDS = 5


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(0)
    u = torch.rand(N_SEQ, generator=g)
    lengths = torch.exp(math.log(MIN_LEN) + u * (math.log(MAX_LEN) - math.log(MIN_LEN))).long().tolist()
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    T = int(cu[-1])
    q = torch.randn(T, HQ, D, generator=g)
    k, v = (torch.randn(T, HKV, D, generator=g) for _ in range(2))
    return lengths, cu, q, k, v


def _padded(lengths, cu, *xs):
    """Zero-padded [B, H, S, D] copies and the boolean causal + key-padding mask."""
    S = max(lengths)
    out = []
    for x in xs:
        p = x.new_zeros((len(lengths), x.shape[1], S, x.shape[2]))
        for i, (s, L) in enumerate(zip(cu.tolist(), lengths)):
            p[i, :, :L] = x[s:s + L].transpose(0, 1)
        out.append(p)
    pos = torch.arange(S)
    mask = (pos[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :] & (pos[None, :] <= pos[:, None])
    return out, mask


def _block_diag_mask(lengths):
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(seq.numel())
    return (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])


def _impls(lengths, cu, q, k, v):
    (qp, kp, vp), mask = _padded(lengths, cu, q, k, v)
    bd_mask = _block_diag_mask(lengths)
    bounds = cu.tolist()
    to_bhd = lambda x: x.transpose(0, 1)  # noqa: E731  [T, H, D] -> [H, T, D]
    return {
        "dk_torch_path": ((q, k, v), lambda q, k, v: dk.varlen_attention(q, k, v, cu, max(lengths))),
        "padded": ((qp, kp, vp), lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                 enable_gqa=True)),
        "per_sequence": ((q, k, v), lambda q, k, v: torch.cat([
            to_bhd(F.scaled_dot_product_attention(to_bhd(q[s:e]), to_bhd(k[s:e]), to_bhd(v[s:e]),
                                                  is_causal=True, enable_gqa=True))
            for s, e in zip(bounds[:-1], bounds[1:])])),
        "block_diag": ((q, k, v), lambda q, k, v: to_bhd(F.scaled_dot_product_attention(
            to_bhd(q), to_bhd(k), to_bhd(v), attn_mask=bd_mask, enable_gqa=True))),
    }


def _flops(lengths, backward):
    fwd = 2 * sum(L * L for L in lengths) * HQ * D  # causal: half of 4 * L^2 * D per head
    return fwd * (3.5 if backward else 1.0)


@pytest.mark.parametrize("impl", ["dk_torch_path", "padded", "per_sequence", "block_diag"])
@pytest.mark.parametrize("pass_", ["fwd", "fwd_bwd"])
def test_varlen_attention_cpu(benchmark, batch, impl, pass_):
    lengths, cu, q, k, v = batch
    benchmark.group = f"varlen_attention-{pass_}-T{int(cu[-1])}"
    inputs, fn = _impls(lengths, cu, q, k, v)[impl]
    if pass_ == "fwd":
        with torch.no_grad():
            benchmark.pedantic(fn, args=inputs, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    else:
        leaves = [x.detach().requires_grad_() for x in inputs]

        def step():
            out = fn(*leaves)
            out.backward(torch.ones_like(out))

        benchmark.pedantic(step, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    benchmark.extra_info["GFLOP/s (useful, best)"] = round(_flops(lengths, pass_ == "fwd_bwd")
                                                           / benchmark.stats.stats.min / 1e9, 2)


def test_outputs_agree(batch):
    """The peers compute the same thing (checked once, outside the timings)."""
    lengths, cu, q, k, v = batch
    impls = _impls(lengths, cu, q, k, v)
    want = impls["per_sequence"][1](*impls["per_sequence"][0])
    for name in ("dk_torch_path", "block_diag"):
        torch.testing.assert_close(impls[name][1](*impls[name][0]), want, rtol=1e-4, atol=1e-4)
    out_pad = impls["padded"][1](*impls["padded"][0])
    got = torch.cat([out_pad[i, :, :L].transpose(0, 1) for i, L in enumerate(lengths)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
