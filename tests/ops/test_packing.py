"""unpad_input / pad_input / packed_position_ids against the reference, both backends.

Packing is a copy, so every comparison is exact. Triton outputs are allocated poisoned
(NaN / sentinel, see dapo_kernels._alloc), so an element the kernel does not write fails.
"""
import pytest
import torch

import dapo_kernels as dk
from dapo_kernels.reference import pad_input_ref, packed_position_ids_ref, unpad_input_ref
from tests.helpers import BACKENDS, assert_equal, assert_unchanged, backend, case_id, snapshot

MASK_KINDS = ("right", "left", "holes", "zeros", "ones", "mixed")


def make_mask(kind: str, B: int, S: int, dtype=torch.bool) -> torch.Tensor:
    if kind == "ones":
        m = torch.ones(B, S, dtype=torch.bool)
    elif kind == "zeros":
        m = torch.zeros(B, S, dtype=torch.bool)
    elif kind in ("right", "left"):
        lens = torch.randint(0, S + 1, (B,))
        ar = torch.arange(S)
        m = ar[None, :] < lens[:, None] if kind == "right" else ar[None, :] >= (S - lens)[:, None]
    elif kind == "holes":
        m = torch.rand(B, S) < 0.6
    else:  # mixed: one row of each pattern where B allows
        m = torch.rand(B, S) < 0.5
        if B > 1:
            m[0] = False
        if B > 2:
            m[1] = True
        if B > 3:
            m[2] = torch.arange(S) >= S // 2
    return m.to(dtype)


# (B, S, feature shape, dtype, mask kind): 60+ cases over the edge cases of the issue.
CASES = []
for B, S in [(1, 1), (1, 7), (3, 1), (2, 5), (4, 33), (5, 64), (7, 129), (16, 17), (1, 300), (9, 2)]:
    for kind in MASK_KINDS:
        CASES.append((B, S, (3,), torch.float32, kind))
CASES += [
    (2, 9, (), torch.float32, "holes"),            # x [B, S] without feature dims
    (3, 11, (4, 5), torch.float16, "right"),      # multi-dim features
    (2, 13, (2049,), torch.bfloat16, "left"),     # wider than one feature tile, odd
    (4, 8, (64,), torch.float64, "holes"),
    (9, 700, (3,), torch.float32, "mixed"),      # narrow rows: 2048 per program, several programs
    (2, 6, (3,), torch.int64, "right"),           # input_ids-style integer payload
    (3, 4, (1,), torch.bool, "holes"),
    (0, 5, (3,), torch.float32, "ones"),          # B = 0
    (3, 0, (3,), torch.float32, "ones"),          # S = 0
    (2, 4, (0,), torch.float32, "holes"),         # zero-width features
]
IDS = [case_id(B=B, S=S, F="x".join(map(str, f)) or "0d", dtype=dt, mask=k) for B, S, f, dt, k in CASES]


def _rand(shape, dtype):
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape) < 0.5
    return torch.randint(-1000, 1000, shape, dtype=dtype)


@pytest.mark.parametrize("bk", BACKENDS)
@pytest.mark.parametrize("B,S,feat,dtype,kind", CASES, ids=IDS)
def test_unpad_pad_roundtrip(bk, B, S, feat, dtype, kind):
    x = _rand((B, S) + feat, dtype)
    mask = make_mask(kind, B, S) if B * S else torch.ones(B, S, dtype=torch.bool)
    with backend(bk):
        x_unpad, indices, cu, max_seqlen, seqused = dk.unpad_input(x, mask)
    r_unpad, r_idx, r_cu, r_max, r_used = unpad_input_ref(x, mask)
    assert_equal(x_unpad, r_unpad, "x_unpad")
    assert_equal(indices, r_idx, "indices")
    assert_equal(cu, r_cu, "cu_seqlens")
    assert_equal(seqused, r_used, "seqused")
    assert isinstance(max_seqlen, int) and max_seqlen == r_max
    with backend(bk):
        padded = dk.pad_input(x_unpad, indices, B, S)
    assert_equal(padded, pad_input_ref(r_unpad, r_idx, B, S), "pad_input")
    with backend(bk):
        pos = dk.packed_position_ids(cu, x_unpad.shape[0])
    assert_equal(pos, packed_position_ids_ref(cu, x_unpad.shape[0]), "position_ids")


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.int32, torch.uint8, torch.bool], ids=str)
def test_integer_masks_match_bool(mask_dtype):
    x = torch.randn(4, 10, 3)
    mask = make_mask("holes", 4, 10)
    # Nonzero means "token", as flash-attn's nonzero() does; 2 is a token too.
    weird = mask.to(mask_dtype) * (2 if mask_dtype != torch.bool else 1)
    for bk in BACKENDS:
        with backend(bk):
            got = dk.unpad_input(x, weird)
        ref = unpad_input_ref(x, mask)
        assert_equal(got[0], ref[0])
        assert_equal(got[2], ref[2])


def test_unused_mask_matches_flash_attn_semantics():
    B, S = 3, 12
    x = torch.randn(B, S, 2)
    attn = make_mask("right", B, S)
    unused = (~attn) & (torch.rand(B, S) < 0.5)
    for bk in BACKENDS:
        with backend(bk):
            xu, idx, cu, mx, used = dk.unpad_input(x, attn, unused)
        r = unpad_input_ref(x, attn, unused)
        for a, b, n in zip((xu, idx, cu, used), (r[0], r[1], r[2], r[4]), ("x", "indices", "cu", "seqused")):
            assert_equal(a, b, n)
        assert mx == r[3]


@pytest.mark.parametrize("bk", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: case_id(dtype=d))
@pytest.mark.parametrize("kind", ["left", "holes", "zeros"])
def test_gradients_both_directions(bk, dtype, kind):
    B, S, F = 5, 19, 7
    x = torch.randn(B, S, F).to(dtype).requires_grad_()
    mask = make_mask(kind, B, S)
    with backend(bk):
        xu, idx, _, _, _ = dk.unpad_input(x, mask)
    g = torch.randn_like(xu)
    (gx,) = torch.autograd.grad(xu, x, g)
    # d(unpad)/dx scatters the incoming gradient back: zeros at padded positions.
    assert_equal(gx, pad_input_ref(g, idx, B, S), "grad of unpad_input")

    xu2 = torch.randn(xu.shape).to(dtype).requires_grad_()
    with backend(bk):
        padded = dk.pad_input(xu2, idx, B, S)
    gp = torch.randn_like(padded)
    (gxu,) = torch.autograd.grad(padded, xu2, gp)
    assert_equal(gxu, gp.reshape(B * S, F)[idx], "grad of pad_input")


def test_gradcheck_float64():
    x = torch.randn(3, 6, 2, dtype=torch.float64, requires_grad=True)
    mask = make_mask("holes", 3, 6)
    for bk in BACKENDS:
        with backend(bk):
            assert torch.autograd.gradcheck(lambda t: dk.unpad_input(t, mask)[0], (x,))
            idx = dk.unpad_input(x, mask)[1]
            xu = torch.randn(idx.numel(), 2, dtype=torch.float64, requires_grad=True)
            assert torch.autograd.gradcheck(lambda t: dk.pad_input(t, idx, 3, 6), (xu,))


def test_triton_writes_every_element_of_poisoned_output():
    # The pad kernel writes zeros itself (no zero-filled buffer): a missed row stays NaN.
    from dapo_kernels._alloc import poison_outputs

    x = torch.randn(6, 40, 5)
    mask = make_mask("mixed", 6, 40)
    with poison_outputs(True), backend("triton"):
        xu, idx, *_ = dk.unpad_input(x, mask)
        out = dk.pad_input(xu, idx, 6, 40)
    assert not out.isnan().any()
    assert_equal(out, x * mask[..., None])


def test_fake_tensor_and_compile_trace():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dapo_kernels.ops.packing import index_rows, scatter_rows

    with FakeTensorMode():
        x = torch.empty(10, 4)
        i = torch.zeros(3, dtype=torch.int64)
        assert index_rows(x, i).shape == (3, 4)
        assert scatter_rows(x[:3], i, 10).shape == (10, 4)
    torch.library.opcheck(index_rows, (torch.randn(8, 3), torch.tensor([1, 5, 7])))
    torch.library.opcheck(scatter_rows, (torch.randn(3, 3), torch.tensor([1, 5, 7]), 8))


# --------------------------------------------------------------------------- bad input
def _bad_unpad_cases():
    x = torch.randn(2, 5, 3)
    yield "mask shape", (x, torch.ones(2, 4, dtype=torch.bool)), ValueError, "attention_mask must have shape"
    yield "mask rank", (x, torch.ones(10, dtype=torch.bool)), ValueError, "attention_mask must be 2-D"
    yield "complex mask", (x, torch.ones(2, 5, dtype=torch.complex64)), ValueError, "attention_mask must have dtype"
    yield "mask device", (x, torch.ones(2, 5, dtype=torch.bool, device="meta")), ValueError, "attention_mask must be on cpu"
    yield "mask type", (x, [[1] * 5] * 2), TypeError, "attention_mask must be a torch.Tensor"
    yield "x rank", (torch.randn(5), torch.ones(1, 5, dtype=torch.bool)), ValueError, "hidden_states must be"
    yield "x type", (x.numpy(), torch.ones(2, 5, dtype=torch.bool)), TypeError, "hidden_states must be a torch.Tensor"


@pytest.mark.parametrize("args,exc,msg", [c[1:] for c in _bad_unpad_cases()], ids=[c[0] for c in _bad_unpad_cases()])
def test_unpad_bad_input(args, exc, msg):
    before = snapshot(*[a for a in args if isinstance(a, torch.Tensor) and a.device.type != "meta"])
    with pytest.raises(exc, match=msg):
        dk.unpad_input(*args)
    assert_unchanged(before, *[a for a in args if isinstance(a, torch.Tensor) and a.device.type != "meta"])


@pytest.mark.parametrize(
    "indices,batch,seqlen,exc,msg",
    [
        (torch.tensor([0, 3, 10]), 2, 5, ValueError, r"indices must lie in \[0, batch\*seqlen\)"),
        (torch.tensor([-1, 3, 4]), 2, 5, ValueError, r"indices must lie in"),
        (torch.tensor([0, 3]), 2, 5, ValueError, "indices must have length nnz"),
        (torch.tensor([0.0, 1.0, 2.0]), 2, 5, ValueError, "indices must have dtype"),
        (torch.tensor([0, 1, 2]), 2.5, 5, TypeError, "batch must be an int"),
        (torch.tensor([0, 1, 2]), 1, 2, ValueError, "more than batch\\*seqlen"),
        (torch.tensor([0, 1, 2]), -1, 5, ValueError, "batch must be >= 0"),
    ],
    ids=["above-range", "negative", "length", "float-indices", "float-batch", "too-many-tokens", "neg-batch"],
)
def test_pad_bad_input(indices, batch, seqlen, exc, msg):
    xu = torch.randn(3, 2)
    before = snapshot(xu, indices)
    with pytest.raises(exc, match=msg):
        dk.pad_input(xu, indices, batch, seqlen)
    assert_unchanged(before, xu, indices)


@pytest.mark.parametrize("bk", BACKENDS)
@pytest.mark.parametrize("dup", [[0, 4, 0], [9, 2, 9], [5, 5, 5], [3, 1, 1]], ids=lambda d: case_id(idx=d))
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32], ids=lambda d: case_id(dtype=d))
def test_pad_duplicate_indices_rejected(bk, dup, idx_dtype):
    """A repeated position has no defined result (which row lands there, and
    which gets the gradient): rejected before the forward, so no graph or output is made."""
    xu = torch.randn(3, 2, requires_grad=True)
    indices = torch.tensor(dup, dtype=idx_dtype)
    before = snapshot(xu, indices)
    with backend(bk), pytest.raises(ValueError, match="indices must be distinct positions"):
        dk.pad_input(xu, indices, 2, 5)
    assert_unchanged(before, xu, indices)
    assert xu.grad is None


@pytest.mark.parametrize("bk", BACKENDS)
def test_pad_distinct_unsorted_indices_forward_backward(bk):
    """Distinct indices in any order stay valid (the duplicate check must not reject them)."""
    B, S, F = 3, 7, 4
    indices = torch.randperm(B * S)[:13]
    xu = torch.randn(13, F, requires_grad=True)
    with backend(bk):
        out = dk.pad_input(xu, indices, B, S)
    assert_equal(out, pad_input_ref(xu.detach(), indices, B, S), "pad_input")
    g = torch.randn_like(out)
    (gxu,) = torch.autograd.grad(out, xu, g)
    assert_equal(gxu, g.reshape(B * S, F)[indices], "grad of pad_input")


@pytest.mark.parametrize(
    "cu,total,msg",
    [
        (torch.tensor([1, 3, 5], dtype=torch.int32), 5, r"cu_seqlens\[0\] must be 0"),
        (torch.tensor([0, 4, 3, 5], dtype=torch.int32), 5, "non-decreasing"),
        (torch.tensor([0, 3, 5], dtype=torch.int32), 6, r"cu_seqlens\[-1\] must equal"),
        (torch.tensor([0.0, 3.0]), 3, "cu_seqlens must have dtype"),
    ],
    ids=["nonzero-start", "decreasing", "wrong-total", "float"],
)
def test_position_ids_bad_cu_seqlens(cu, total, msg):
    with pytest.raises(ValueError, match=msg):
        dk.packed_position_ids(cu, total)


def test_registry_backend_switch():
    import os

    assert dk.current_backend("cpu") == os.environ.get("DAPO_KERNELS_BACKEND", "torch") or os.environ.get(
        "DAPO_KERNELS_BACKEND"
    ) in (None, "", "auto")
    with dk.use_backend("triton"):
        assert dk.current_backend("cpu") == "triton"
        with dk.use_backend("torch"):
            assert dk.current_backend("cuda") == "torch"
    with pytest.raises(ValueError, match="backend must be one of"):
        with dk.use_backend("cuda"):
            pass
    assert "index_rows" in dk.registered_ops() and dk.registered_ops()["index_rows"] == ("torch", "triton")
