"""Hardware group: the real torch_npu kernels against the float64 references (Atlas A2/A3).

Skipped, with the reason printed in pytest's summary, unless ``torch_npu`` imports and
``torch.npu.is_available()``. On an Atlas machine::

    pip install torch_npu==<the build matching torch> && source /usr/local/Ascend/ascend-toolkit/set_env.sh
    python -m pytest tests/npu_hardware -v -rs

Tolerances follow the project rule (tests/tolerance.py): at most 2x the error plain torch
makes in the same dtype, computed here on the CPU.
"""
import math

import pytest
import torch

from tests.helpers import cu_seqlens_from
from tests.tolerance import assert_close_to_ref


def _npu_or_skip_reason():
    try:
        import torch_npu  # noqa: F401
    except Exception as exc:  # ImportError, or OSError without the CANN libraries
        return f"torch_npu not importable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if not torch.npu.is_available():
        return "torch_npu imported but torch.npu.is_available() is False (no Ascend device visible)"
    return None


_REASON = _npu_or_skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
DEV = "npu"

import dapo_kernels as dk  # noqa: E402
from dapo_kernels.reference import (fused_linear_policy_loss_ref, group_filter_ref, linear_log_probs_ref,  # noqa: E402
                                    policy_loss_ref, varlen_attention_ref)


def _grads_ref(fn, inputs, cots, compute_dtype):
    leaves = [t.detach().cpu().to(compute_dtype).requires_grad_() for t in inputs]
    outs = fn(*leaves)
    grads = torch.autograd.grad(sum((o * c.cpu().to(o.dtype)).sum() for o, c in zip(outs, cots)), leaves)
    return [o.detach() for o in outs], list(grads)


def test_dispatch_reaches_the_npu_kernels():
    import npu_ops

    assert all(npu_ops.registered().values())
    assert torch.device(DEV).type == torch._C._get_privateuse1_backend_name() == "npu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lengths,Hq,Hkv,D", [([130, 0, 2100, 7], 8, 2, 128), ([64, 64, 1], 4, 4, 64)])
def test_varlen_attention(lengths, Hq, Hkv, D, causal, dtype):
    """Includes a sequence longer than the 2048 compressed mask and an empty one."""
    T = sum(lengths)
    q, k, v = (torch.randn(T, h, D, dtype=dtype) for h in (Hq, Hkv, Hkv))
    cu = cu_seqlens_from(lengths)
    dout = torch.randn(T, Hq, D, dtype=dtype)
    leaves = [t.to(DEV).requires_grad_() for t in (q, k, v)]
    out, lse = dk.varlen_attention(*leaves, cu.to(DEV), max(lengths), causal=causal, return_lse=True)
    out.backward(dout.to(DEV))

    def fn(q_, k_, v_):
        return varlen_attention_ref(q_, k_, v_, cu, causal=causal, compute_dtype=q_.dtype)

    ref64 = _grads_ref(fn, (q, k, v), (dout, torch.zeros(Hq, T)), torch.float64)
    low = _grads_ref(fn, (q, k, v), (dout, torch.zeros(Hq, T)), dtype)  # plain torch in dtype
    assert_close_to_ref(out.cpu().float(), ref64[0][0], low[0][0].float(), name="out")
    assert_close_to_ref(lse.cpu(), ref64[0][1], low[0][1].float(), name="lse")
    for name, leaf, r, lo in zip(("dq", "dk", "dv"), leaves, ref64[1], low[1]):
        assert_close_to_ref(leaf.grad.cpu().float(), r, lo.float(), name=name)


def test_linear_log_probs_and_fused_loss():
    N, H, V = 3000, 256, 32000
    hidden = torch.randn(N, H, dtype=torch.bfloat16)
    weight = (torch.randn(V, H) * 2 / math.sqrt(H)).to(torch.bfloat16)
    labels = torch.randint(0, V, (N,))
    old, adv, mask = -torch.rand(N) * 3, torch.randn(N), torch.rand(N) > 0.2
    h, w = (t.to(DEV).requires_grad_() for t in (hidden, weight))
    lp, ent = dk.linear_log_probs(h, w, labels.to(DEV), return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    ref64 = _grads_ref(lambda a, b: linear_log_probs_ref(a, b, labels), (hidden, weight),
                       (torch.ones(N), torch.ones(N)), torch.float64)
    low = _grads_ref(lambda a, b: linear_log_probs_ref(a, b, labels), (hidden, weight),
                     (torch.ones(N), torch.ones(N)), torch.float32)
    assert_close_to_ref(lp.cpu(), ref64[0][0], low[0][0], name="log_prob")
    assert_close_to_ref(ent.cpu(), ref64[0][1], low[0][1], name="entropy")
    assert_close_to_ref(h.grad.cpu().float(), ref64[1][0], low[1][0].bfloat16().float(), name="dH")
    assert_close_to_ref(w.grad.cpu().float(), ref64[1][1], low[1][1].bfloat16().float(), name="dW")

    h, w = (t.to(DEV).requires_grad_() for t in (hidden, weight))
    loss, _ = dk.fused_linear_policy_loss(h, w, labels.to(DEV), old.to(DEV), adv.to(DEV), mask.to(DEV))
    loss.backward()

    def fused(a, b):
        return fused_linear_policy_loss_ref(a, b, labels, old, adv, mask)[:1]

    ref64 = _grads_ref(fused, (hidden, weight), (torch.ones(()),), torch.float64)
    low = _grads_ref(fused, (hidden, weight), (torch.ones(()),), torch.float32)
    assert_close_to_ref(loss.cpu(), ref64[0][0], low[0][0], name="loss")
    assert_close_to_ref(h.grad.cpu().float(), ref64[1][0], low[1][0].bfloat16().float(), name="fused dH")


def test_policy_loss_packing_group_filter():
    lp, old, adv = (torch.randn(4, 50) for _ in range(3))
    mask = torch.rand(4, 50) > 0.3
    x = lp.to(DEV).requires_grad_()
    loss, _ = dk.policy_loss(x, old.to(DEV), adv.to(DEV), mask.to(DEV))
    loss.backward()
    ref = policy_loss_ref(lp.double().requires_grad_(), old.double(), adv.double(), mask)[0]
    torch.testing.assert_close(loss.cpu().double(), ref.detach(), rtol=1e-5, atol=1e-6)

    hs = torch.randn(3, 7, 5)
    am = torch.rand(3, 7) > 0.4
    xu, idx, cu, _, _ = dk.unpad_input(hs.to(DEV), am.to(DEV))
    assert torch.equal(xu.cpu(), hs[am]) and torch.equal(dk.pad_input(xu, idx, 3, 7).cpu(), hs * am[..., None])

    scores = torch.tensor([1., 0, 1, 1, 0.5, 0.5, 0, 1])
    gi = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    got = dk.group_filter(scores.to(DEV), gi.to(DEV), 4)
    keep, adv_ref = group_filter_ref(scores, gi, 4)[:2]
    assert torch.equal(got.keep.cpu(), keep)
    torch.testing.assert_close(got.advantages.cpu().double(), adv_ref, rtol=1e-6, atol=1e-6)


def test_model_ops_match_the_torch_code():
    from dapo_trainer import model as m
    from dapo_trainer import npu_model_ops as model_ops

    T, N, D, H, I = 37, 4, 128, 256, 512
    x = torch.randn(T, N, D, dtype=torch.bfloat16)
    cos, sin = torch.randn(T, D).cos().bfloat16(), torch.randn(T, D).sin().bfloat16()
    ref = m.apply_rope(x, cos, sin)
    got = model_ops.rotary(x.to(DEV), cos.to(DEV), sin.to(DEV))
    torch.testing.assert_close(got.cpu(), ref, rtol=2e-2, atol=2e-2)

    norm = m.RMSNorm(H, 1e-6).bfloat16()
    h = torch.randn(T, H, dtype=torch.bfloat16)
    torch.testing.assert_close(norm.to(DEV)(h.to(DEV)).cpu(), norm.cpu()(h), rtol=2e-2, atol=2e-2)

    gate, up = torch.randn(T, I, dtype=torch.bfloat16), torch.randn(T, I, dtype=torch.bfloat16)
    got = model_ops.swiglu(gate.to(DEV), up.to(DEV))
    torch.testing.assert_close(got.cpu(), torch.nn.functional.silu(gate) * up, rtol=2e-2, atol=2e-2)
