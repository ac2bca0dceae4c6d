"""npu_ops.varlen_attention against the fake torch_npu: the TND call it builds gives the reference
forward (out, lse) and backward (dq, dk, dv) when the op behaves as documented."""
import math
import random

import pytest
import torch

import dapo_kernels as dk
from dapo_kernels.reference import varlen_attention_ref
from npu_ops import varlen_attention as attention
from tests.helpers import case_id, cu_seqlens_from
from tests.tolerance import assert_close_to_ref

CASES = [  # lengths, Hq, Hkv, D, causal, dtype
    ([5, 0, 9, 1], 4, 2, 16, True, torch.float32),
    ([7, 3], 2, 2, 32, False, torch.float32),
    ([0, 6, 4, 0], 4, 1, 16, True, torch.bfloat16),
    ([8], 3, 1, 16, False, torch.float16),
]


def _inputs(lengths, Hq, Hkv, D, dtype):
    T = sum(lengths)
    q, k, v = (torch.randn(T, h, D).to(dtype) for h in (Hq, Hkv, Hkv))
    return q, k, v, cu_seqlens_from(lengths)


@pytest.mark.parametrize("lengths,Hq,Hkv,D,causal,dtype", [
    pytest.param(*c, id=case_id(B=len(c[0]), Hq=c[1], Hkv=c[2], D=c[3], causal=c[4], dtype=c[5])) for c in CASES])
def test_forward_backward_match_reference(fake_npu, lengths, Hq, Hkv, D, causal, dtype):
    q, k, v, cu = _inputs(lengths, Hq, Hkv, D, dtype)
    scale = 0.7 / math.sqrt(D)
    out, lse = attention.varlen_attention_fwd(q, k, v, cu, max(lengths), causal, scale)
    dout = torch.randn_like(out)
    dq, dk, dv = attention.varlen_attention_bwd(dout, q, k, v, out, lse, cu, max(lengths), causal, scale)

    def ref(compute_dtype):
        leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
        o, l = varlen_attention_ref(*leaves, cu, causal=causal, softmax_scale=scale, compute_dtype=compute_dtype)
        grads = torch.autograd.grad(o, leaves, dout.to(compute_dtype))
        return (o, l) + grads

    ref64, low = ref(torch.float64), ref(dtype)
    assert lse.dtype == torch.float32 and lse.shape == (Hq, q.shape[0])
    lse_natural = lse / attention.lse_unit()  # the op's own unit (natural or base 2)
    for name, got, r, lo in zip(("out", "lse", "dq", "dk", "dv"), (out, lse_natural, dq, dk, dv), ref64, low):
        assert got.dtype == (torch.float32 if name == "lse" else dtype), name
        assert_close_to_ref(got, r.to(got.dtype if name != "lse" else torch.float64).double(), lo, name=name,
                            factor=4.0 if name == "lse" else 2.0)

    (fwd_call,), (bwd_call,) = fake_npu.calls["npu_fusion_attention"], fake_npu.calls["npu_fusion_attention_grad"]
    ends = [e for e in cu_seqlens_from(lengths)[1:].tolist() if e]
    expected = dict(sparse_mode=3 if causal else 0, scale=scale)
    assert fwd_call == dict(expected, lens=sorted(set(ends)))
    assert bwd_call == expected


def test_more_sequences_than_one_call_takes(fake_npu):
    """A dynamic batch of short rollouts: 1,100 sequences (and a few empty ones) run as calls of
    at most 1,024 sequences each, on contiguous rows, with the results of one call (the torch
    path, fp32, checked against float64 in tests/ops)."""
    lengths = [random.randint(1, 3) for _ in range(1100)]
    for at in random.sample(range(1100), 5):
        lengths.insert(at, 0)
    q, k, v, cu = _inputs(lengths, 4, 2, 16, torch.float32)
    out, lse = attention.varlen_attention_fwd(q, k, v, cu, 3, True, 0.25)
    dout = torch.randn_like(out)
    grads = attention.varlen_attention_bwd(dout, q, k, v, out, lse, cu, 3, True, 0.25)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with dk.use_backend("torch"):
        o, l = dk.varlen_attention(*leaves, cu, 3, softmax_scale=0.25, return_lse=True)
    want = (o, l) + torch.autograd.grad(o, leaves, dout)
    for name, got, w in zip(("out", "lse", "dq", "dk", "dv"), (out, lse / attention.lse_unit()) + grads, want):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")

    ends = sorted({e for e in cu[1:].tolist() if e})
    fwd, bwd = fake_npu.calls["npu_fusion_attention"], fake_npu.calls["npu_fusion_attention_grad"]
    assert len(fwd) == len(bwd) == 2 and [len(c["lens"]) for c in fwd] == [1024, 1100 - 1024]
    assert fwd[0]["lens"] == ends[:1024] and [e + ends[1023] for e in fwd[1]["lens"]] == ends[1024:]


def test_fake_refuses_more_than_1024_sequences(fake_npu):
    q = torch.randn(1025, 1, 16)
    with pytest.raises(ValueError, match="at most 1024 sequences"):
        fake_npu.npu_fusion_attention(q, q, q, 1, "TND", scale=0.25, actual_seq_qlen=list(range(1, 1026)),
                                      actual_seq_kvlen=list(range(1, 1026)))


def test_softmax_statistics_are_read_in_the_ntd_layout(fake_npu):
    """Several heads, unequal lengths: each (head, token) of lse comes from its own row of the
    per-sequence [N, L, 8] blocks, not from a [T, N, 8] reading of them."""
    lengths = [3, 0, 5, 2]
    q, k, v, cu = _inputs(lengths, 3, 1, 16, torch.float32)
    _, lse = attention.varlen_attention_fwd(q, k, v, cu, 5, False, 0.25)
    want = varlen_attention_ref(q.double(), k.double(), v.double(), cu, causal=False, softmax_scale=0.25)[1]
    torch.testing.assert_close(lse.double() / attention.lse_unit(), want, rtol=1e-6, atol=1e-6)
    index = attention.stat_index(cu, 10, 3)
    # sequence 2 (rows 3..7, 5 tokens) starts at row 3 * 3 = 9, head-major
    assert index[:, 3].tolist() == [9, 14, 19] and index[2, 7].tolist() == 23
    assert sorted(index.reshape(-1).tolist()) == list(range(30))


def test_empty_batch_makes_no_call(fake_npu):
    q = torch.empty(0, 2, 16)
    out, lse = attention.varlen_attention_fwd(q, q, q, torch.zeros(3, dtype=torch.int32), 0, True, 0.25)
    grads = attention.varlen_attention_bwd(q, q, q, q, out, lse, torch.zeros(3, dtype=torch.int32), 0, True, 0.25)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0) and all(g.shape == (0, 2, 16) for g in grads)
    assert not fake_npu.calls


def test_sequence_ends_are_read_once_per_tensor():
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    ends = attention.seq_ends(cu)
    assert ends == [3, 7] and all(type(e) is int for e in ends)
    assert attention.seq_ends(cu) is ends  # every layer reuses the host list
    cu[2] = 5  # an in-place change bumps the version: read again
    assert attention.seq_ends(cu) == [3, 5, 7]
    assert attention.seq_ends(cu.clone()) is not attention.seq_ends(cu)


def test_statistics_map_is_built_once_per_tensor_and_head_count(fake_npu):
    q, k, v, cu = _inputs([4, 0, 3], 2, 1, 16, torch.float32)
    out, lse = attention.varlen_attention_fwd(q, k, v, cu, 4, True, 0.25)
    attention.varlen_attention_bwd(torch.ones_like(out), q, k, v, out, lse, cu, 4, True, 0.25)
    index = attention._stat_index(cu, 7, 2)
    assert attention._stat_index(cu, 7, 2) is index and torch.equal(index, attention.stat_index(cu, 7, 2))
    assert attention._stat_index(cu, 7, 3) is not index and attention._stat_index(cu.clone(), 7, 2) is not index


def test_inference_mode_cu_seqlens_are_served(fake_npu):
    """An inference-mode tensor has no version counter to key a cache on: planned on every call."""
    q, k, v, _ = _inputs([4, 0, 3], 2, 1, 16, torch.float32)
    with torch.inference_mode():
        cu = torch.tensor([0, 4, 4, 7], dtype=torch.int32)
        out, lse = attention.varlen_attention_fwd(q, k, v, cu, 4, True, 0.25)
        assert attention.seq_ends(cu) == [4, 7]
    want = varlen_attention_ref(q.double(), k.double(), v.double(), cu.clone(), causal=True, softmax_scale=0.25)[0]
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_causal_mask_is_built_once_per_device():
    mask = attention.causal_mask(torch.device("cpu"))
    assert mask.shape == (2048, 2048) and mask.dtype == torch.bool
    assert not mask[5, 5] and mask[5, 6] and not mask[6, 5]
    assert attention.causal_mask(torch.device("cpu")) is mask
