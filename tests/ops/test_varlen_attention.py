"""varlen_attention: both backends against a float64 per-sequence softmax reference.

The Triton kernels run interpreted on the CPU, so shapes are tiny (T <= ~110) and the
matrix is spread rather than crossed: every head dim, GQA ratio, dtype, causal flag and
length pattern (empty and length-1 sequences, one long + many short) appears, with the
interpreter's 32-row outer / 16-row inner blocks making sequences span several blocks,
partial ones included.
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
import triton

import dapo_kernels as dk
import dapo_kernels.ops.varlen_attention as va
from dapo_kernels.ops.varlen_attention import tiles, triton_bwd, triton_kernels
from dapo_kernels.ops.varlen_attention.launch import _work_list
from dapo_kernels.reference import varlen_attention_ref
from tests.helpers import backend, case_id, cu_seqlens_from
from tests.tolerance import assert_close_to_ref, max_abs_err, worst_of

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16


def _lengths(kind: str) -> list:
    """Sequence lengths of a packed batch, shuffled, always with an empty and a length-1 one."""
    if kind == "mixed":       # a few medium sequences, partial blocks
        lengths = [random.randint(2, 40) for _ in range(3)] + [0, 1]
    elif kind == "longshort":  # one long sequence over several blocks + many short ones
        lengths = [random.randint(60, 75)] + [random.randint(0, 5) for _ in range(6)] + [0, 1]
    elif kind == "tiny":      # only empty and very short sequences
        lengths = [1, 0, 1, 2, 0, 1]
    else:
        raise ValueError(kind)
    random.shuffle(lengths)
    return lengths


# (D, Hq, Hkv, causal, dtype, lengths): each axis value appears at least once.
CASES = [
    (16, 2, 2, True, FP32, "mixed"),
    (32, 4, 2, True, BF16, "longshort"),
    (32, 8, 1, False, BF16, "tiny"),
    (64, 4, 1, False, FP16, "mixed"),
    (64, 2, 2, True, BF16, "longshort"),
    (96, 8, 1, True, BF16, "mixed"),
    (96, 4, 2, False, FP32, "longshort"),
    (128, 2, 2, False, BF16, "longshort"),
    (128, 4, 1, True, FP32, "mixed"),
    (128, 2, 1, True, FP16, "tiny"),
    (256, 2, 1, True, FP16, "mixed"),
    (256, 2, 2, False, BF16, "longshort"),
]
assert {c[0] for c in CASES} == {16, 32, 64, 96, 128, 256}
assert {c[1] // c[2] for c in CASES} == {1, 2, 4, 8}


def _inputs(lengths, D, Hq, Hkv, dtype):
    cu = cu_seqlens_from(lengths)
    T = int(cu[-1])
    q, k, v = (torch.randn(T, h, D, dtype=dtype).requires_grad_() for h in (Hq, Hkv, Hkv))
    return q, k, v, cu


def _run(impl, q, k, v, cu, max_seqlen, causal, scale, **kw):
    """``impl``: a backend name, or ``triton-deterministic`` (the Triton backward's dQ kernel
    instead of the default atomic dQ)."""
    name, _, det = impl.partition("-")
    with backend(name):
        out, lse = dk.varlen_attention(q, k, v, cu, max_seqlen, causal=causal, softmax_scale=scale, return_lse=True,
                                       deterministic=bool(det), **kw)
        dout = torch.randn_like(out)
        grads = _grads(out, q, k, v, dout)
    return out, lse, grads, dout


def _grads(out, q, k, v, dout):
    return torch.autograd.grad(out, (q, k, v), dout.to(out.dtype)) if out.numel() else (q * 0, k * 0, v * 0)


def _ref(q, k, v, cu, causal, scale, dout, compute_dtype, **kw):
    """(out, lse, dq, dk, dv) of the plain softmax reference in ``compute_dtype``."""
    out, lse = varlen_attention_ref(q, k, v, cu, causal=causal, softmax_scale=scale, compute_dtype=compute_dtype,
                                    **kw)
    return (out, lse) + _grads(out, q, k, v, dout)


def _sdpa_padded(q, k, v, cu, causal, scale, dout, window=(-1, -1)):
    """(out, dq, dk, dv) of torch's fused SDPA on the zero-padded [B, H, S, D] batch with a
    key-padding (and causal, and sliding-window) mask, in the inputs' dtype: what a torch user runs."""
    spans = [(s, e) for s, e in zip(cu.tolist()[:-1], cu.tolist()[1:]) if e > s]
    if not spans:
        out = q * 0
        return (out,) + _grads(out, q, k, v, dout)
    S = max(e - s for s, e in spans)
    padded = []
    for t in (q, k, v):
        p = t.new_zeros((len(spans), t.shape[1], S, t.shape[2]))
        for i, (s, e) in enumerate(spans):
            p[i, :, : e - s] = t[s:e].transpose(0, 1)
        padded.append(p)
    pos = torch.arange(S)
    mask = (pos[None, :] < torch.tensor([e - s for s, e in spans])[:, None])[:, None, None, :]
    if causal:
        mask = mask & (pos[None, :] <= pos[:, None])
    if window[0] >= 0:
        mask = mask & (pos[None, :] >= pos[:, None] - window[0])
    if window[1] >= 0 and not causal:
        mask = mask & (pos[None, :] <= pos[:, None] + window[1])
    o = F.scaled_dot_product_attention(*padded, attn_mask=mask, scale=scale, enable_gqa=True)
    out = torch.cat([o[i, :, : e - s].transpose(0, 1) for i, (s, e) in enumerate(spans)])
    return (out,) + _grads(out, q, k, v, dout)


def _sdpa_per_sequence(q, k, v, cu, causal, scale, dout):
    """(out, dq, dk, dv) of torch's fused SDPA run on each sequence alone (no padding)."""
    outs = []
    for s, e in zip(cu.tolist()[:-1], cu.tolist()[1:]):
        if e == s:
            outs.append(q[s:e] * 0)
            continue
        o = F.scaled_dot_product_attention(*(t[s:e].transpose(0, 1) for t in (q, k, v)), is_causal=causal,
                                           scale=scale, enable_gqa=True)
        outs.append(o.transpose(0, 1))
    out = torch.cat(outs) if outs else q * 0
    return (out,) + _grads(out, q, k, v, dout)


def _flash_style(q, k, v, cu, causal, scale, dout, **kw):
    """(out, lse, dq, dk, dv) the way torch's fused (flash) kernels compute attention in the inputs'
    dtype, for an option its SDPA lacks (soft-capping): fp32 inside, outputs rounded to the dtype,
    and the backward's delta = rowsum(dO * out) taken from the *rounded* out (as SDPA's CPU flash
    backward, flash-attn and our kernels do; the naive softmax backward sums p * dP instead). That
    delta differs from the exact one by d_i = dO_i . (out16_i - out32_i), which adds -d_i * p_ij to
    dS_ij: the gradient of -sum_i d_i * lse_i (d held constant) on top of the fp32 one."""
    dtype = q.dtype
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out32, lse = varlen_attention_ref(*leaves, cu, causal=causal, softmax_scale=scale, compute_dtype=torch.float32,
                                      **kw)
    out = out32.detach().to(dtype)
    d = (dout.float() * (out.float() - out32.detach())).sum(-1).t()  # [Hq, T], a constant
    objective = (out32 * dout.float()).sum() - (d * torch.where(torch.isfinite(lse), lse, 0.0)).sum()
    grads = torch.autograd.grad(objective, leaves) if out.numel() else tuple(t * 0 for t in leaves)
    return (out.detach(), lse.detach()) + tuple(g.to(dtype) for g in grads)


def _torch_in_dtype(q, k, v, cu, causal, scale, dout, ref64, window=(-1, -1)):
    """Plain torch in the inputs' dtype, for the tolerance: per quantity, the least accurate
    of torch's usual ways (naive softmax attention, flash-attn's test convention; fused SDPA
    on the padded batch and on each sequence alone, whose CPU kernel approximates exp in
    fp32 and whose rounding depends on the padded length). SDPA has no lse, so lse is
    naive only. With a sliding ``window`` the padded SDPA gets it in its mask (the per-sequence
    call has no mask)."""
    naive = _ref(q, k, v, cu, causal, scale, dout, q.dtype, window_size=window)
    ways = (naive[:1] + naive[2:], _sdpa_padded(q, k, v, cu, causal, scale, dout, window))
    if window == (-1, -1):
        ways += (_sdpa_per_sequence(q, k, v, cu, causal, scale, dout),)
    worse = worst_of(ways, ref64[:1] + ref64[2:])
    return (worse[0], naive[1]) + tuple(worse[1:])


@pytest.mark.parametrize("impl", ["torch", "triton", "triton-deterministic"])
@pytest.mark.parametrize(
    "D,Hq,Hkv,causal,dtype,kind", CASES,
    ids=[case_id(D=c[0], Hq=c[1], Hkv=c[2], causal=c[3], dtype=c[4], L=c[5]) for c in CASES],
)
def test_matches_reference(impl, D, Hq, Hkv, causal, dtype, kind):
    lengths = _lengths(kind)
    q, k, v, cu = _inputs(lengths, D, Hq, Hkv, dtype)
    # Every other case uses a non-default scale and a loose max_seqlen upper bound.
    scale = None if D in (16, 64, 128) else 0.7 / D ** 0.5
    out, lse, grads, dout = _run(impl, q, k, v, cu, max(lengths) + (D % 3), causal, scale)
    ref = _ref(q, k, v, cu, causal, scale, dout, torch.float64)
    low = _torch_in_dtype(q, k, v, cu, causal, scale, dout, ref)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (Hq, q.shape[0])
    assert_close_to_ref(out, ref[0], low[0], name="out")
    assert_close_to_ref(lse, ref[1], low[1].float(), name="lse")
    for name, g, r, t in zip(("dq", "dk", "dv"), grads, ref[2:], low[2:]):
        assert g.dtype == dtype
        assert_close_to_ref(g, r, t, name=name)


# Sliding window (flash-attn's window_size), soft-capping (Gemma 2) and head dims that
# are multiples of 8 but not powers of two (the kernels mask the columns of the next block).
# (D, Hq, Hkv, causal, dtype, lengths, window_size, softcap). Plain torch in the dtype for the
# tolerance is the naive reference only: torch's SDPA has neither soft-capping nor windows.
LOCAL_CASES = [
    (80, 4, 2, True, BF16, "longshort", (9, -1), 0.0),     # Mistral-style causal window
    (112, 2, 1, False, FP32, "mixed", (5, 3), 0.0),        # two-sided window
    (40, 2, 2, False, FP16, "mixed", (-1, 4), 0.0),        # right side only
    (8, 4, 1, True, FP32, "longshort", (1, -1), 0.0),      # each query sees itself and the one before
    (160, 2, 2, True, BF16, "mixed", (-1, -1), 5.0),        # Gemma 2: causal + softcap
    (192, 4, 2, False, FP32, "mixed", (-1, -1), 2.0),
    (200, 2, 1, True, FP16, "tiny", (3, -1), 1.0),         # window + softcap together
    (24, 4, 4, True, FP32, "longshort", (20, 7), 30.0),
]


@pytest.mark.parametrize("impl", ["torch", "triton", "triton-deterministic"])
@pytest.mark.parametrize(
    "D,Hq,Hkv,causal,dtype,kind,window,softcap", LOCAL_CASES,
    ids=[case_id(D=c[0], Hq=c[1], Hkv=c[2], causal=c[3], dtype=c[4], L=c[5], W="_".join(map(str, c[6])),
                 cap=c[7]) for c in LOCAL_CASES],
)
def test_window_softcap_head_dims_match_reference(impl, D, Hq, Hkv, causal, dtype, kind, window, softcap):
    lengths = _lengths(kind)
    q, k, v, cu = _inputs(lengths, D, Hq, Hkv, dtype)
    if softcap:  # scores well past the cap, so the tanh saturates for some keys
        q = (q.detach() * 3).requires_grad_()
    kw = dict(window_size=window, softcap=softcap)
    out, lse, grads, dout = _run(impl, q, k, v, cu, max(lengths), causal, None, **kw)
    ref = _ref(q, k, v, cu, causal, None, dout, torch.float64, **kw)
    # Torch's error: its naive softmax, and without soft-capping (which SDPA lacks) also SDPA with
    # the window in its mask. The flash-style backward computes delta = dO . O (O rounded): its
    # rounding reaches dq as delta_err * sum_j p_j k_j, which does not cancel when a query sees
    # 2 keys (window (1, -1)); naive softmax's backward sums p * dP from the same p and lacks that
    # term, so the naive way alone understates what torch's own flash kernel does. With
    # soft-capping (SDPA has none) torch's ways are therefore the naive softmax in the dtype and
    # the flash kernels' algorithm (_flash_style).
    if softcap:
        ways = (_ref(q, k, v, cu, causal, None, dout, dtype, **kw), _flash_style(q, k, v, cu, causal, None, dout, **kw))
        low = worst_of(ways, ref)
    else:
        low = _torch_in_dtype(q, k, v, cu, causal, None, dout, ref, window)
    assert out.dtype == dtype and lse.shape == (Hq, q.shape[0])
    for name, got, r, t in zip(("out", "lse", "dq", "dk", "dv"), (out, lse) + grads, ref, low):
        assert_close_to_ref(got, r, t.float() if name == "lse" else t, name=name)


def test_window_and_softcap_change_the_result():
    """The options are not ignored: each one changes out (guards the comparisons above)."""
    q, k, v, cu = _inputs([30, 7], 16, 2, 2, FP32)
    for impl in ("torch", "triton"):
        with backend(impl):
            base = dk.varlen_attention(q, k, v, cu, 30)
            assert not torch.allclose(dk.varlen_attention(q, k, v, cu, 30, window_size=(4, -1)), base)
            assert not torch.allclose(dk.varlen_attention(q, k, v, cu, 30, softcap=0.5), base)
            # A window at least as long as the sequence is no window; right is ignored when causal.
            torch.testing.assert_close(dk.varlen_attention(q, k, v, cu, 30, window_size=(30, 3)), base)
            # Window (0, 0): each query sees only its own key, so out = v (exactly one probability 1).
            torch.testing.assert_close(dk.varlen_attention(q, k, v, cu, 30, causal=False, window_size=(0, 0)),
                                       v.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "nocausal"])
def test_window_nan_reaches_only_the_queries_that_see_it(impl, causal):
    """A NaN key poisons exactly the queries whose window holds it (and their keys' gradients)."""
    q, k, v, cu = _inputs([24, 9], 16, 2, 1, FP32)
    k = k.detach().clone()
    k[10, 0, 3] = float("nan")
    k.requires_grad_()
    left, right = 3, 2
    with backend(impl):
        out = dk.varlen_attention(q, k, v, cu, 24, causal=causal, window_size=(left, right))
        out.sum().backward()
    i = torch.arange(q.shape[0])
    hi = 10 + left
    lo = 10 if causal else 10 - right
    want = (i >= lo) & (i <= hi)
    assert torch.equal(out.isnan().any(-1).any(-1), want)
    assert torch.equal(q.grad.isnan().any(-1).any(-1), want)


# flash-attn's accuracy rule (its varlen tests): the max error against the float32 reference
# may be at most 3x that of plain torch computing in the inputs' own dtype. Its GQA matrix:
# 6 query heads over 6, 3, 2 or 1 KV heads. The interpreted Triton kernels get shorter
# sequences (the rule does not depend on length; the torch path failed it more often on
# longer ones, so it gets the longer mix and more draws).
FLASH_ATTN_FACTOR = 3.0
FLASH_ATTN_SIZES = {"torch": (200, 4), "triton": (40, 1)}  # (longest sequence, draws)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "nocausal"])
@pytest.mark.parametrize("Hkv", [6, 3, 2, 1])
def test_flash_attn_accuracy_rule(impl, Hkv, causal, dtype):
    max_len, draws = FLASH_ATTN_SIZES[impl]
    for _ in range(draws):
        lengths = [random.randint(1, max_len) for _ in range(4)]
        q, k, v, cu = _inputs(lengths, 64, 6, Hkv, dtype)
        out, _, grads, dout = _run(impl, q, k, v, cu, max_len, causal, None)
        ref = _ref(q, k, v, cu, causal, None, dout, torch.float32)
        low = _ref(q, k, v, cu, causal, None, dout, dtype)
        for name, got, r, t in zip(("out", "dq", "dk", "dv"), (out,) + grads, ref[:1] + ref[2:], low[:1] + low[2:]):
            err, torch_err = max_abs_err(got, r), max_abs_err(t, r)
            assert err <= FLASH_ATTN_FACTOR * torch_err, (
                f"{name}: error {err:.3g} against fp32 > {FLASH_ATTN_FACTOR:g}x plain torch's {torch_err:.3g} "
                f"(lengths {lengths})")


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "nocausal"])
def test_no_tokens(impl, causal):
    """T = 0 (with and without empty sequences) gives empty outputs and gradients."""
    for lengths in ([], [0, 0]):
        q, k, v, cu = _inputs(lengths, 64, 4, 2, BF16)
        with backend(impl):
            out, lse = dk.varlen_attention(q, k, v, cu, 0, causal=causal, return_lse=True)
            out.sum().backward()
        assert out.shape == (0, 4, 64) and lse.shape == (4, 0)
        assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_triton_backward_is_deterministic():
    q, k, v, cu = _inputs([37, 1, 0, 20], 32, 4, 1, BF16)
    out, _, grads, dout = _run("triton-deterministic", q, k, v, cu, 37, True, None)
    with backend("triton"):
        again = torch.autograd.grad(dk.varlen_attention(q, k, v, cu, 37, deterministic=True), (q, k, v), dout)
    for g, h in zip(grads, again):
        assert torch.equal(g, h)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "nocausal"])
@pytest.mark.parametrize("per_key", [False, True], ids=["queryblocks", "keyblocks"])
def test_work_list_covers_every_block_once_longest_first(causal, per_key):
    lengths = [0, 70, 1, 33, 0, 64, 5]
    cu = cu_seqlens_from(lengths)
    block = 16
    work = _work_list(cu, int(cu[-1]), block, causal, per_key)
    real = work[work[:, 0] >= 0].tolist()
    expected = {(b, i) for b, L in enumerate(lengths) for i in range(-(-L // block))}
    assert len(real) == len(expected) and set(map(tuple, real)) == expected
    assert (work[len(real):, 0] == -1).all(), "padding entries must come last"
    nblk = [-(-L // block) for L in lengths]
    if causal:
        cost = [nblk[b] - i if per_key else i + 1 for b, i in real]
    else:
        cost = [nblk[b] for b, _ in real]
    assert cost == sorted(cost, reverse=True)


def test_matches_padded_sdpa():
    """The flash-attn contract seen from another angle: equal-length sequences equal
    torch's SDPA on the [B, S] view (GQA through enable_gqa)."""
    B, S, Hq, Hkv, D = 3, 20, 4, 2, 64
    q, k, v, cu = _inputs([S] * B, D, Hq, Hkv, FP32)
    want = torch.nn.functional.scaled_dot_product_attention(
        *(t.detach().reshape(B, S, -1, D).transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=True
    ).transpose(1, 2).reshape(B * S, Hq, D)
    for impl in ("torch", "triton"):
        with backend(impl):
            got = dk.varlen_attention(q, k, v, cu, S)
        torch.testing.assert_close(got, want)


# --------------------------------------------------------------------------- GPU tiles
_TILE_PAIRS = sorted({(outer, inner) for by_d in tiles._GPU_TILES.values() for outer, cs in by_d.values()
                      for inner, _, _ in cs})
_GPU_ONLY_PAIRS = [p for p in _TILE_PAIRS if p != (tiles._OUTER_BLOCK_INTERPRET, 16)]  # 32 / 16: every test


def test_gpu_tiles_cover_every_head_dim_and_nest():
    """Every arch family / dtype / head dim has tiles, and each inner block divides its outer
    block (the causal kernels walk the diagonal block in inner steps)."""
    for kernel in ("fwd", "dkdv", "dq"):
        for arch in (90, 80):
            for dtype in va._DTYPES:
                by_d = tiles._GPU_TILES[kernel, arch, dtype.itemsize]
                assert set(tiles.TILE_HEAD_DIMS) <= set(by_d), (kernel, arch, dtype)
    assert all(tiles._tile_dim(d) >= d for d in va.SUPPORTED_HEAD_DIMS) and tiles.TILE_HEAD_DIMS[-1] == 256
    assert all(outer % inner == 0 for outer, inner in _TILE_PAIRS), _TILE_PAIRS


@pytest.mark.parametrize("outer,inner", _GPU_ONLY_PAIRS, ids=[f"outer{o}-inner{i}" for o, i in _GPU_ONLY_PAIRS])
def test_gpu_tile_shapes_match_reference(outer, inner, monkeypatch):
    """The interpreter runs 32 / 16 blocks; the GPU's (outer, inner) pairs of _GPU_TILES run
    here too, so a tile shape only the GPU uses (inner = outer, 4 or 8 inner steps per outer
    block) is proven on the CPU: sequences span several outer blocks, partial ones included."""
    monkeypatch.setattr(tiles, "_OUTER_BLOCK_INTERPRET", outer)
    for kernel, name in ((triton_kernels._varlen_attention_fwd_kernel, "BLOCK_N"),
                         (triton_bwd._varlen_attention_bwd_dkdv_kernel, "BLOCK_M"),
                         (triton_bwd._varlen_attention_bwd_dq_kernel, "BLOCK_N")):
        monkeypatch.setattr(kernel, "configs", [triton.Config({name: inner}, num_warps=1, num_stages=1)])
    lengths = [2 * outer + inner // 2 + 3, 0, 1, outer - 1, 5]
    for causal in (True, False):
        q, k, v, cu = _inputs(lengths, 16, 2, 1, FP32)
        out, lse, grads, dout = _run("triton", q, k, v, cu, max(lengths), causal, None)
        ref = _ref(q, k, v, cu, causal, None, dout, torch.float64)
        low = _torch_in_dtype(q, k, v, cu, causal, None, dout, ref)
        assert_close_to_ref(out, ref[0], low[0], name="out")
        assert_close_to_ref(lse, ref[1], low[1].float(), name="lse")
        for name, g, r, t in zip(("dq", "dk", "dv"), grads, ref[2:], low[2:]):
            assert_close_to_ref(g, r, t, name=name)


# --------------------------------------------------------------------------- bad input
def _good():
    q, k, v, cu = _inputs([3, 0, 2], 32, 4, 2, BF16)
    return dict(q=q.detach(), k=k.detach(), v=v.detach(), cu_seqlens=cu, max_seqlen=3)


def _call(args):
    kw = {n: args.pop(n) for n in ("causal", "softmax_scale", "return_lse", "window_size", "softcap", "deterministic")
          if n in args}
    return dk.varlen_attention(args["q"], args["k"], args["v"], args["cu_seqlens"], args["max_seqlen"], **kw)


BAD = [
    ("cu-start", lambda g: dict(cu_seqlens=torch.tensor([1, 3, 3, 5], dtype=torch.int32)), ValueError, r"cu_seqlens\[0\]"),
    ("cu-decreasing", lambda g: dict(cu_seqlens=torch.tensor([0, 3, 2, 5], dtype=torch.int32)), ValueError,
     "non-decreasing"),
    ("cu-last", lambda g: dict(cu_seqlens=torch.tensor([0, 3, 3, 4], dtype=torch.int32)), ValueError, r"cu_seqlens\[-1\]"),
    ("cu-dtype", lambda g: dict(cu_seqlens=g["cu_seqlens"].float()), ValueError, "cu_seqlens must have dtype"),
    ("cu-2d", lambda g: dict(cu_seqlens=g["cu_seqlens"][None]), ValueError, "cu_seqlens must be 1-D"),
    ("heads", lambda g: dict(q=torch.randn(5, 3, 32, dtype=BF16)), ValueError, "multiple of the KV heads"),
    ("head-dim", lambda g: dict(q=torch.randn(5, 4, 44, dtype=BF16), k=torch.randn(5, 2, 44, dtype=BF16),
                                v=torch.randn(5, 2, 44, dtype=BF16)), ValueError, "head dim D must be a multiple of 8"),
    ("head-dim-big", lambda g: dict(q=torch.randn(5, 4, 264, dtype=BF16), k=torch.randn(5, 2, 264, dtype=BF16),
                                    v=torch.randn(5, 2, 264, dtype=BF16)), ValueError, "head dim D must be a multiple"),
    ("window-type", lambda g: dict(window_size=4), TypeError, "window_size must be a"),
    ("window-len", lambda g: dict(window_size=(1, 2, 3)), TypeError, "window_size must be a"),
    ("window-neg", lambda g: dict(window_size=(-2, 0)), ValueError, r"window_size\[0\] must be >= -1"),
    ("window-float", lambda g: dict(window_size=(4, 1.5)), TypeError, r"window_size\[1\] must be an int"),
    ("softcap-neg", lambda g: dict(softcap=-1.0), ValueError, "softcap must be finite and >= 0"),
    ("softcap-nan", lambda g: dict(softcap=float("nan")), ValueError, "softcap must be finite"),
    ("q-dtype", lambda g: dict(q=g["q"].double()), ValueError, "q must have dtype"),
    ("kv-dtype", lambda g: dict(v=g["v"].half()), ValueError, "v must have dtype"),
    ("kv-shape", lambda g: dict(v=g["v"][:, :1]), ValueError, "v must have shape"),
    ("tokens", lambda g: dict(k=g["k"][:4], v=g["v"][:4]), ValueError, r"k must have shape \[T, Hkv, D\]"),
    ("q-ndim", lambda g: dict(q=g["q"][0]), ValueError, "q must be 3-D"),
    ("q-type", lambda g: dict(q=g["q"].tolist()), TypeError, "q must be a torch.Tensor"),
    ("max-seqlen-type", lambda g: dict(max_seqlen=3.0), TypeError, "max_seqlen must be an int"),
    ("causal-type", lambda g: dict(causal=1), TypeError, "causal must be a bool"),
    ("deterministic-type", lambda g: dict(deterministic=None), TypeError, "deterministic must be a bool"),
    ("scale", lambda g: dict(softmax_scale=-1.0), ValueError, "softmax_scale must be a finite positive"),
    ("scale-type", lambda g: dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a float"),
]


@pytest.mark.parametrize("over,exc,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises(over, exc, match):
    good = _good()
    with pytest.raises(exc, match=match):
        _call({**good, **over(good)})


def test_int64_cu_seqlens_accepted():
    good = _good()
    want = _call(dict(good))
    torch.testing.assert_close(_call({**good, "cu_seqlens": good["cu_seqlens"].long()}), want, rtol=0, atol=0)


@pytest.mark.parametrize("poisoned", ["q", "dout"])
@pytest.mark.parametrize("window", [(-1, -1), (3, -1)], ids=["causal", "window"])
def test_16bit_nonfinite_gradients_reach_only_what_attends_it(poisoned, window):
    """bf16, causal (and windowed), Triton, deterministic: an inf in one query's q or dO makes NaN exactly
    that query's dQ and the dK / dV of the keys it attends; every other gradient is bitwise the clean
    run's (keys of the same blocks it does not attend included: the dK/dV kernel's masked steps read
    non-finite q / dO as 0)."""
    q, k, v, cu = _inputs([40, 9], 16, 2, 1, BF16)
    dout = torch.randn(q.shape, dtype=BF16)
    bad_q, bad_dout = q.detach().clone(), dout.clone()
    (bad_q if poisoned == "q" else bad_dout)[5, 0, 3] = float("inf")
    grads = []
    for qq, do in ((q.detach(), dout), (bad_q, bad_dout)):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (qq, k, v))
        with backend("triton"):
            out = dk.varlen_attention(qq, kk, vv, cu, 40, causal=True, window_size=window, deterministic=True)
        grads.append(_grads(out, qq, kk, vv, do))
    t = torch.arange(q.shape[0])
    keys = (t <= 5) & (t >= 5 - (window[0] if window[0] >= 0 else 5))  # the keys query 5 attends
    want = {"dq": (t == 5)[:, None] & (torch.arange(2) == 0)[None, :], "dk": keys[:, None], "dv": keys[:, None]}
    for name, clean, got in zip(("dq", "dk", "dv"), *grads):
        nan_rows = got.isnan().any(-1)
        assert torch.equal(nan_rows, want[name]), f"{name}: NaN rows {nan_rows.nonzero().tolist()}"
        assert torch.equal(got[~nan_rows], clean[~nan_rows]), f"{name}: a row it does not reach changed"
