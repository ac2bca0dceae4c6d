"""varlen_attention's descriptor (TMA) forward, forced through the launcher's ``variant``: it runs in the
interpreter on the attention tests' 16-bit cases, matches the float64 reference within torch's own error
and is bitwise equal to the pointer forward (same arithmetic in the same order); its autotune space holds
today's sm_90 configs; the variant argument and the alignment rule are checked."""
from __future__ import annotations

import math

import pytest
import torch

from dapo_kernels.ops.varlen_attention import launch, tiles, triton_fwd_tma
from tests.helpers import case_id, cu_seqlens_from
from tests.ops.test_varlen_attention import CASES, LOCAL_CASES, _inputs, _lengths, _ref, _torch_in_dtype
from tests.tolerance import assert_close_to_ref

# (D, Hq, Hkv, causal, dtype, lengths, window, softcap): the 16-bit cases of both tables (the descriptor
# forward is offered for 16-bit inputs only).
TMA_CASES = ([c + ((-1, -1), 0.0) for c in CASES if c[4] != torch.float32]
             + [c for c in LOCAL_CASES if c[4] != torch.float32])


def _fwd(q, k, v, cu, causal, scale, window, softcap, variant):
    return launch.fwd_triton(q, k, v, cu, int((cu[1:] - cu[:-1]).max()), causal, scale, *window, softcap,
                             True, variant)


@pytest.mark.parametrize(
    "D,Hq,Hkv,causal,dtype,kind,window,softcap", TMA_CASES,
    ids=[case_id(D=c[0], Hq=c[1], Hkv=c[2], causal=c[3], dtype=c[4], L=c[5], W="_".join(map(str, c[6])),
                 cap=c[7]) for c in TMA_CASES],
)
def test_tma_forward_matches_reference_and_pointer_kernel(D, Hq, Hkv, causal, dtype, kind, window, softcap):
    lengths = _lengths(kind)
    q, k, v, cu = _inputs(lengths, D, Hq, Hkv, dtype)
    if softcap:  # scores past the cap, as in the attention tests
        q = (q.detach() * 3).requires_grad_()
    scale = D ** -0.5
    args = (q.detach(), k.detach(), v.detach(), cu, causal, scale, window, softcap)
    out, lse = _fwd(*args, "tma")
    base_out, base_lse = _fwd(*args, "pointer")
    assert torch.equal(out, base_out) and torch.equal(lse, base_lse)
    kw = dict(window_size=window, softcap=softcap)
    dout = torch.randn_like(q)
    ref = _ref(q, k, v, cu, causal, scale, dout, torch.float64, **kw)
    low = _ref(q, k, v, cu, causal, scale, dout, dtype, **kw) if softcap else _torch_in_dtype(
        q, k, v, cu, causal, scale, dout, ref, window)
    assert_close_to_ref(out, ref[0], low[0], name="out")
    assert_close_to_ref(lse * math.log(2), ref[1], low[1].float(), name="lse")  # (the launcher's lse is base 2)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "nocausal"])
def test_tma_forward_keeps_a_non_finite_key_from_queries_that_do_not_see_it(causal):
    """A NaN / inf key or value reaches no query that does not attend it; with the other rows equal to the
    pointer forward's (the op marks the rows that do attend it NaN: nan.py)."""
    cu = cu_seqlens_from([40, 9])
    q, k, v = (torch.randn(49, h, 32, dtype=torch.bfloat16) for h in (2, 1, 1))
    k[20, 0, 3], v[20, 0, 5] = float("nan"), float("inf")
    out, lse = _fwd(q, k, v, cu, causal, 32 ** -0.5, (-1, -1), 0.0, "tma")
    base_out, base_lse = _fwd(q, k, v, cu, causal, 32 ** -0.5, (-1, -1), 0.0, "pointer")
    blind = torch.arange(49) < 20 if causal else torch.arange(49) >= 40  # rows that never see key 20
    assert torch.isfinite(out[blind]).all() and torch.isfinite(lse[:, blind]).all()
    assert torch.equal(out[blind], base_out[blind]) and torch.equal(lse[:, blind], base_lse[:, blind])


def test_tma_autotune_space_holds_todays_configs():
    """On sm_90 the descriptor configs are offered beside every pointer config of the 16-bit forward, so
    autotuning can only pick something at least as fast; each shares the pointer row's outer block."""
    configs = triton_fwd_tma._configs(interpret=False)
    pointer = {(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in configs if not c.kwargs["TMA"]}
    assert pointer == {t for _, ts in tiles._GPU_TILES["fwd", 90, 2].values() for t in ts}
    assert any(c.kwargs["TMA"] for c in configs)
    for kernel in ("tma_fwd", "tma_fwd_masked", "tma_fwd_plain"):
        for d, (outer, inner) in tiles._GPU_TILES.get((kernel, 90, 2), {}).items():
            assert outer == tiles._GPU_TILES["fwd", 90, 2][d][0] and all(outer % t[0] == 0 for t in inner)


def test_masked_launches_get_the_masked_descriptor_rows():
    """With a window or softcap a launch is offered the pointer row and the descriptor row's masked form (a
    subset of tma_fwd where the table has one), never the register-capped plain row; without either, all three."""
    assert triton_fwd_tma._rows(False, False) == ("fwd", "tma_fwd", "tma_fwd_plain")
    for local, softcap in ((True, False), (False, True), (True, True)):
        rows = triton_fwd_tma._rows(local, softcap)
        assert rows[0] == "fwd" and rows[1] in ("tma_fwd", "tma_fwd_masked") and len(rows) == 2
    masked = tiles._GPU_TILES.get(("tma_fwd_masked", 90, 2))
    if masked is not None:  # (Triton < 3.8: the D = 256 descriptor tile spills with a mask)
        assert all(tiles._GPU_TILES["tma_fwd", 90, 2][d] == c for d, c in masked.items())
        assert 256 in tiles._GPU_TILES["tma_fwd", 90, 2] and 256 not in masked


def test_tma_offered_needs_16_byte_alignment_and_a_tile_row():
    q = torch.zeros(9, 2, 128, dtype=torch.bfloat16)
    assert triton_fwd_tma.tma_offered(q, q, q, 90)
    shifted = torch.zeros(9 * 2 * 128 + 4, dtype=torch.bfloat16)[4:].view(9, 2, 128)  # 8 bytes off
    assert not triton_fwd_tma.tma_offered(shifted, q, q, 90)
    assert not triton_fwd_tma.tma_offered(q, q, q, 80)
    assert not triton_fwd_tma.tma_offered(q.float(), q.float(), q.float(), 90)


def test_bad_variant_raises():
    q = torch.zeros(3, 2, 16)
    cu = cu_seqlens_from([3])
    with pytest.raises(ValueError, match="variant must be one of"):
        launch.fwd_triton(q, q, q, cu, 3, True, 0.25, -1, -1, 0.0, True, "cuda")
    with pytest.raises(ValueError, match="variant='tma' has no tile for torch.float32"):
        launch.fwd_triton(q, q, q, cu, 3, True, 0.25, -1, -1, 0.0, True, "tma")
