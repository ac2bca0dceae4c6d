"""Every masking path of ``varlen_attention`` on both backends with padded keys and queries and queries whose
lse lies far below 0.

A key row past a sequence's end inside its last key block reads k = 0, score 0; for a query whose lse is
below about -11 (fp16) or -88 (bf16, fp32), exp(0 - lse) overflows, and unless that key is masked its inf
reaches dQ as inf * 0 = NaN (issue 39: the atomic-dQ path of the dK/dV kernel, flash-attn's default
``causal=False, deterministic=False``). Each case here has sequence lengths that are no multiple of any
block size, a query row with lse ~ -24 and one with lse ~ -110, GQA or MQA, and checks every output and
gradient finite and within flash-attn's accuracy rule (<= 3x plain torch's error in the dtype against the
fp32 reference; plain torch's error is that of the worse of its naive softmax and the flash kernels'
algorithm, whose delta comes from the rounded output) on the torch backend and both Triton backwards.
"""
from __future__ import annotations

import pytest
import torch

from dapo_kernels.flash_attn_compat import flash_attn_varlen_func
from dapo_kernels.reference import varlen_attention_ref
from tests.helpers import backend, cu_seqlens_from
from tests.ops.test_varlen_attention import _flash_style
from tests.tolerance import max_abs_err, worst_of

FP16, BF16 = torch.float16, torch.bfloat16
FLASH_ATTN_FACTOR = 3.0  # flash-attn's varlen tests: <= 3x plain torch's error in the dtype

# (name, causal, window_size, softcap): every score mask the kernels instantiate. Non-causal full attention
# is the unmasked loop plus the length-masked last key block; causal the diagonal; a window masks every
# tile it visits (a right side reaches past the sequence end).
MASKS = [
    ("causal", True, (-1, -1), 0.0),
    ("full", False, (-1, -1), 0.0),
    ("full-softcap", False, (-1, -1), 50.0),
    ("causal-window", True, (5, -1), 0.0),
    ("window-right", False, (-1, 3), 0.0),
    ("window-both", False, (4, 6), 50.0),
]
IMPLS = ["torch", "triton", "triton-deterministic"]


def _far_below_zero_inputs(lengths, D, Hq, Hkv, dtype, seed=0):
    """q, k, v, cu: every key's first feature is >= 3, and in each sequence of length >= 3 the last-but-one
    query points against it (lse ~ -24 at q0 = -32) and the first one more so (lse ~ -110 at q0 = -150), so
    every score of those rows is far below 0."""
    g = torch.Generator().manual_seed(seed)
    cu = cu_seqlens_from(lengths)
    T = int(cu[-1])
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    k[:, :, 0] = 3 + torch.rand(T, Hkv, generator=g)
    for s, e in zip(cu.tolist()[:-1], cu.tolist()[1:]):
        if e - s >= 3:
            q[e - 2] = 0
            q[e - 2, :, 0] = -32
            q[s] = 0
            q[s, :, 0] = -150
    return [t.to(dtype).requires_grad_() for t in (q, k, v)] + [cu]


def _run(impl, q, k, v, cu, max_seqlen, causal, window, softcap, dout):
    name, _, det = impl.partition("-")
    with backend(name):
        out = flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=causal, window_size=window,
                                     softcap=softcap, deterministic=bool(det))
        return (out,) + torch.autograd.grad(out, (q, k, v), dout)


def _ref(q, k, v, cu, causal, window, softcap, dout, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, _ = varlen_attention_ref(*leaves, cu, causal=causal, compute_dtype=dtype, window_size=window,
                                  softcap=softcap)
    return (out,) + torch.autograd.grad(out, leaves, dout.to(dtype))


def _check(got, q, k, v, cu, causal, window, softcap, dout, what):
    ref = _ref(q, k, v, cu, causal, window, softcap, dout, torch.float32)
    flash = _flash_style(q, k, v, cu, causal, None, dout, window_size=window, softcap=softcap)
    low = worst_of((_ref(q, k, v, cu, causal, window, softcap, dout, q.dtype), flash[:1] + flash[2:]), ref)
    for name, g, r, t in zip(("out", "dq", "dk", "dv"), got, ref, low):
        bad = (~torch.isfinite(g)).flatten(1).any(1).nonzero().flatten().tolist()
        assert not bad, f"{what}: {name} not finite on token rows {bad}"
        err, torch_err = max_abs_err(g, r), max_abs_err(t, r)
        assert err <= FLASH_ATTN_FACTOR * torch_err, (
            f"{what}: {name} error {err:.3g} against fp32 > {FLASH_ATTN_FACTOR:g}x plain torch's {torch_err:.3g}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mask,causal,window,softcap", MASKS, ids=[m[0] for m in MASKS])
def test_padded_keys_and_far_negative_lse_stay_finite(impl, dtype, mask, causal, window, softcap):
    """Lengths 37, 1, 0, 19, 66 (partial last blocks for every tile size), GQA 4:2 at D=16 and MQA 2:1 at
    D=40 (the head dim itself padded): finite outputs and gradients within flash-attn's rule."""
    lengths = [37, 1, 0, 19, 66]
    for D, Hq, Hkv in ((16, 4, 2), (40, 2, 1)):
        q, k, v, cu = _far_below_zero_inputs(lengths, D, Hq, Hkv, dtype)
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        got = _run(impl, q, k, v, cu, max(lengths), causal, window, softcap, dout)
        _check(got, q, k, v, cu, causal, window, softcap, dout, f"D={D} Hq={Hq} Hkv={Hkv}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_issue_39_reproduction(impl, causal):
    """Issue 39's reproduction: T = 37, D = 16, one head, fp16, query 35 with lse ~ -23.8: dQ finite."""
    torch.manual_seed(0)
    T, D = 37, 16
    q, k, v = torch.randn(T, 1, D), torch.randn(T, 1, D), torch.randn(T, 1, D)
    k[:, 0, 0] += 3
    q[T - 2, 0] = 0
    q[T - 2, 0, 0] = -80
    q, k, v = (t.half().requires_grad_() for t in (q, k, v))
    cu = torch.tensor([0, T], dtype=torch.int32)
    dout = torch.ones(T, 1, D, dtype=torch.float16)
    got = _run(impl, q, k, v, cu, T, causal, (-1, -1), 0.0, dout)
    _check(got, q, k, v, cu, causal, (-1, -1), 0.0, dout, "reproduction")


# flash-attn's two failing varlen draws (issue 39), at their head dims and head layouts, softcap 50, a local
# window, non-deterministic, fp16; the sequence lengths are flash-attn's random padding of the named seqlen.
FLASH_ATTN_DRAWS = [("s40-d160-mqa", 40, 160, 4, 1), ("s113-d128-mha", 113, 128, 2, 2)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,seqlen,D,Hq,Hkv", FLASH_ATTN_DRAWS, ids=[d[0] for d in FLASH_ATTN_DRAWS])
def test_flash_attn_local_softcap_draws(impl, name, seqlen, D, Hq, Hkv):
    """flash-attn's draw structure (randn inputs, each sequence padded to a random length in
    [seqlen / 3, seqlen], a random window) plus one far-negative-lse query per sequence."""
    g = torch.Generator().manual_seed(seqlen)
    lengths = torch.randint(seqlen // 3, seqlen + 1, (3,), generator=g).tolist()
    window = tuple(torch.randint(0, seqlen, (2,), generator=g).tolist())
    q, k, v, cu = _far_below_zero_inputs(lengths, D, Hq, Hkv, FP16, seed=seqlen)
    dout = torch.randn(q.shape, generator=g).half()
    got = _run(impl, q, k, v, cu, max(lengths), False, window, 50.0, dout)
    _check(got, q, k, v, cu, False, window, 50.0, dout, f"{name} lengths {lengths} window {window}")


def test_cases_reach_the_padded_key_overflow():
    """The inputs above do what they are for: a query's lse (natural units) is below -88 (exp overflows
    even fp32 for a zero score) and another's below -16, in sequences whose length is no multiple of 16."""
    q, k, v, cu = _far_below_zero_inputs([37, 19], 16, 2, 1, FP16)
    _, lse = varlen_attention_ref(q, k, v, cu, causal=False, compute_dtype=torch.float32)
    assert lse.min() < -88 and ((lse < -16) & (lse > -88)).any()
    assert all(int(n) % 16 for n in cu.diff())
