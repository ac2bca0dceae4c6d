"""varlen_attention in fp32 where flash-attn's own test suite found it least accurate (issue 31):
soft-capped scores far past the cap (the backward's probabilities recomputed from a saved lse ~50-72),
and, on the torch path, plain attention, whose dQ torch's CPU flash backward rounds poorly.

The tolerance is the project rule (tests/tolerance.py): at most 2x plain torch's own error in fp32
against float64.
"""
from __future__ import annotations

import pytest
import torch

import dapo_kernels as dk
from dapo_kernels.reference import varlen_attention_ref
from tests.helpers import backend, cu_seqlens_from
from tests.tolerance import assert_close_to_ref

# flash-attn's soft-capping setup (its test_flash_attn_varlen_output with softcap): q scaled by 50,
# softcap 50, causal, so most scores sit at the cap, lse ~ 50 (base 2: ~72).
LENGTHS, HEADS, D, Q_MULT, SOFTCAP = [40, 23], 4, 64, 50.0, 50.0
IMPLS = ["torch", "triton", "triton-deterministic"]


def _softcap_inputs():
    cu = cu_seqlens_from(LENGTHS)
    T = int(cu[-1])
    q = (torch.randn(T, HEADS, D) * Q_MULT).requires_grad_()
    k, v = (torch.randn(T, HEADS, D).requires_grad_() for _ in range(2))
    return q, k, v, cu


def _softcap_grads(impl, q, k, v, cu, dout):
    """(out, dq, dk, dv) of ``impl`` (a backend, or ``triton-deterministic``: the dQ kernel)."""
    name, _, det = impl.partition("-")
    with backend(name):
        out = dk.varlen_attention(q, k, v, cu, max(LENGTHS), causal=True, softcap=SOFTCAP, deterministic=bool(det))
        return (out,) + torch.autograd.grad(out, (q, k, v), dout)


def _plain(q, k, v, cu, dout, dtype):
    out, _ = varlen_attention_ref(q, k, v, cu, causal=True, softcap=SOFTCAP, compute_dtype=dtype)
    return (out,) + torch.autograd.grad(out, (q, k, v), dout.to(dtype))


@pytest.mark.parametrize("impl", IMPLS)
def test_fp32_softcap_recomputed_probabilities_sum_to_one(impl):
    """Each query's probabilities, as the backward recomputes them from the saved lse, sum to 1 within
    2x plain fp32 torch's error: with dO one-hot on query i's column i, summing dV over the sequence's
    keys gives sum_j P_ij. An lse rounded to fp32 (~72 in base 2) shifts a whole row's P by up to
    ulp(72) / 2 * ln 2 = 2.6e-6 relative: 17x torch's error here. This measures that rounding directly;
    the gradients' error against float64 (next test) hides it in the interpreter, whose tl.dot sums in
    fp64 (tests/interpreter_dot.py), unlike a GPU (benchmarks/emulate_varlen_attention_softcap.py)."""
    q, k, v, cu = _softcap_inputs()
    T = q.shape[0]
    pos = torch.cat([torch.arange(n) for n in LENGTHS])  # each query's index in its sequence
    dout = torch.zeros(T, HEADS, D)
    dout[torch.arange(T), :, pos] = 1.0

    def row_sums(dv):  # [queries, heads] sum_j P_ij of every query, from dV's per-sequence key sums
        sums = [dv[s:e].double().sum(0)[:, : e - s].t() for s, e in zip(cu.tolist()[:-1], cu.tolist()[1:])]
        return torch.cat(sums)

    got = row_sums(_softcap_grads(impl, q, k, v, cu, dout)[3])
    plain = row_sums(_plain(q, k, v, cu, dout, torch.float32)[3])
    assert_close_to_ref(got.float(), torch.ones(T, HEADS, dtype=torch.float64), plain.float(), name="sum_j P_ij")


@pytest.mark.parametrize("impl", IMPLS)
def test_fp32_softcap_grads_match_reference(impl):
    """flash-attn's soft-capping setup in fp32: out, dQ, dK and dV within 2x plain fp32 torch's error against
    float64 (two draws). On a GPU the fp32-lse kernels gave dV up to 3x torch's error here (issue 31)."""
    for _ in range(2):
        q, k, v, cu = _softcap_inputs()
        dout = torch.randn_like(q)
        got = _softcap_grads(impl, q, k, v, cu, dout)
        ref = _plain(q, k, v, cu, dout, torch.float64)
        plain = _plain(q, k, v, cu, dout, torch.float32)
        for name, g, r, t in zip(("out", "dq", "dk", "dv"), got, ref, plain):
            assert_close_to_ref(g, r, t, name=name)


def test_torch_path_fp32_grads_match_reference():
    """Plain fp32 attention on the torch path, causal GQA at D = 216 (flash-attn's varlen matrix, longer
    sequences): dQ, dK, dV within 2x plain fp32 torch's error against float64 in each of 6 draws. Torch's
    CPU flash backward gave dQ up to 3.5x there (4 draws in 9 over 2x), so fp32 runs the math path (fp32, plain
    torch's per-head products: its own error, NOTES.md "Torch path")."""
    for draw in range(6):
        lengths = torch.randint(1, 201, (4,)).tolist()
        cu = cu_seqlens_from(lengths)
        T, Hkv = int(cu[-1]), (3, 2, 1)[draw % 3]
        q = torch.randn(T, 6, 216, requires_grad=True)
        k, v = (torch.randn(T, Hkv, 216, requires_grad=True) for _ in range(2))
        dout = torch.randn_like(q)
        with backend("torch"):
            out = dk.varlen_attention(q, k, v, cu, max(lengths), causal=True)
            got = (out,) + torch.autograd.grad(out, (q, k, v), dout)
        ways = []
        for dtype in (torch.float64, torch.float32):
            ref_out, _ = varlen_attention_ref(q, k, v, cu, causal=True, compute_dtype=dtype)
            ways.append((ref_out,) + torch.autograd.grad(ref_out, (q, k, v), dout.to(dtype)))
        for name, g, r, t in zip(("out", "dq", "dk", "dv"), got, *ways):
            assert_close_to_ref(g, r, t, name=f"{name} (draw {draw}, lengths {lengths}, Hkv {Hkv})")
