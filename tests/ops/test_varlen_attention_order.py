"""varlen_attention's work-list order: an argument of the Triton launchers (``longest_first``), part
of the work-list cache key, and free of effect on the results."""
from __future__ import annotations

import pytest
import torch

from dapo_kernels.ops.varlen_attention import launch
from dapo_kernels.ops.varlen_attention.launch import _work_list
from tests.helpers import cu_seqlens_from

LENGTHS = [0, 70, 1, 33, 0, 64, 5]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "nocausal"])
@pytest.mark.parametrize("per_key", [False, True], ids=["queryblocks", "keyblocks"])
def test_orders_differ_and_cover_the_same_blocks(causal, per_key):
    """On one ``cu_seqlens`` tensor (one cache slot), longest-first and sequence order are two
    different lists of the same (sequence, block) pairs; sequence order is sorted by (sequence,
    block), padding last in both."""
    cu = cu_seqlens_from(LENGTHS)
    T, block = int(cu[-1]), 16
    lpt = _work_list(cu, T, block, causal, per_key, True)
    seq = _work_list(cu, T, block, causal, per_key, False)
    assert lpt.shape == seq.shape
    assert not torch.equal(lpt, seq), "the two orders must not share a cache entry"
    real_lpt, real_seq = (w[w[:, 0] >= 0].tolist() for w in (lpt, seq))
    assert sorted(real_lpt) == real_seq
    assert (lpt[len(real_lpt):, 0] == -1).all() and (seq[len(real_seq):, 0] == -1).all()
    # Asked again, each order comes back unchanged (the cache holds both).
    assert torch.equal(_work_list(cu, T, block, causal, per_key, True), lpt)
    assert torch.equal(_work_list(cu, T, block, causal, per_key, False), seq)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "nocausal"])
def test_launchers_give_equal_results_in_either_order(causal):
    """Every output element has one writer whose arithmetic does not depend on when its program
    runs, so the forward and the deterministic backward are bitwise equal in both orders."""
    g = torch.Generator().manual_seed(0)
    cu = cu_seqlens_from([0, 40, 1, 33, 5])
    T, Hq, Hkv, D = int(cu[-1]), 2, 1, 16
    q, dout = (torch.randn(T, Hq, D, generator=g) for _ in range(2))
    k, v = (torch.randn(T, Hkv, D, generator=g) for _ in range(2))
    runs = []
    for longest_first in (True, False):
        out, lse = launch.fwd_triton(q, k, v, cu, 40, causal, D ** -0.5, -1, -1, 0.0, longest_first)
        grads = launch.bwd_triton(dout, q, k, v, out, lse, cu, 40, causal, D ** -0.5, -1, -1, 0.0, True,
                                  longest_first)
        runs.append((out, lse, *grads))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), name
