"""GEMM units of the Triton path of the lm_head ops, counted on its CPU run: a unit is one
``[N, H] x [H, V]`` product, 2 N H V FLOPs. ``torch.utils.flop_counter`` counts the torch matmuls
(cuBLAS on a GPU), around the ops and inside their device implementations (a dispatch mode sees a
custom op as one call, so the implementations run under a counter of their own); the two Triton
kernels over the logits are elementwise and declare no matmul work (no ``tl.dot``:
tests/test_aot_compile.py's EXPECTED_DOTS lists none of them), so the count is the whole matmul
work. The fused loss: 3 units for forward and backward (logits, dH, dW; the floor of an exact
method), 1 without grad; linear_log_probs: 1 for its forward, 3 for its backward (its upstream
gradient is unknown in the forward, so the backward recomputes the logits)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import dapo_kernels as dk
import dapo_kernels.ops.linear_log_probs as llp
from tests.helpers import backend
from tests.linear_log_probs_ways import fused_loss_step, make_linear

N, H, V = 23, 16, 120


_IMPLS = ("fused_linear_policy_loss", "linear_log_probs_stats", "linear_log_probs_grads")
_inner = []  # FLOPs counted inside the implementations
_seen = set()  # aten ops the implementations called


class _Ops(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        _seen.add(func._overloadpacket)
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def counted_impls(monkeypatch):
    from dapo_kernels._registry import _impls

    def counted(fn):
        def run(*args):
            with FlopCounterMode(display=False) as fc, _Ops():
                out = fn(*args)
            _inner.append(fc.get_total_flops())
            return out
        return run

    for op in _IMPLS:
        monkeypatch.setitem(_impls[op], "triton", counted(_impls[op]["triton"]))


def _units(fn) -> float:
    _inner.clear()
    with FlopCounterMode(display=False) as fc:
        fn()
    assert _inner, "no implementation ran under the counter"
    # The counter knows the out-of-place matmuls only (aten.addmm, not aten.addmm_): none may hide
    # (aten.matmul is composite: it reaches the counter as mm / bmm).
    hidden = {str(op) for op in _seen if "mm" in str(op) or "dot" in str(op)} - {str(op) for op in flop_registry}
    assert not hidden, f"matmuls the counter does not see: {hidden}"
    return (fc.get_total_flops() + sum(_inner)) / (2 * N * H * V)


@pytest.fixture(params=[N, 5], ids=["one-chunk", "five-chunks"])
def chunked(request, monkeypatch):
    monkeypatch.setattr(llp, "_CHUNK_BYTES", request.param * 4 * V)
    assert llp.chunk_rows(N, V) == request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_loss_forward_backward_is_three_units(chunked, dtype):
    (hidden, weight, labels, tok, h, w), step = fused_loss_step(N, H, V, dtype)
    with backend("triton"):
        assert _units(step) == 3
        with torch.no_grad():
            assert _units(lambda: dk.fused_linear_policy_loss(hidden, weight, labels, **tok)) == 1
    assert h.grad is not None and w.grad is not None and bool(h.grad.abs().sum() > 0)


def test_linear_log_probs_forward_one_unit_backward_three(chunked):
    hidden, weight, labels = make_linear(N, H, V, torch.float32)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with backend("triton"):
        with torch.no_grad():
            assert _units(lambda: dk.linear_log_probs(hidden, weight, labels, return_entropy=True)) == 1
        lp, ent = dk.linear_log_probs(h, w, labels, return_entropy=True)
        assert _units(lambda: (lp.sum() + ent.sum()).backward()) == 3
