"""dapo_trainer.npu_model_ops against the fake torch_npu: the fused rotary kernel is called only
inside the limits of the operator compile mode in force (jit_compile=True: head dim 128 only),
and the model's torch code runs otherwise."""
import pytest
import torch

from dapo_trainer import model as m
from dapo_trainer import npu_model_ops as model_ops


@pytest.fixture
def on_npu(monkeypatch):
    """The fake computes on CPU tensors: let the model ops take them for NPU tensors."""
    monkeypatch.setattr(model_ops, "is_npu", lambda t: True)


def _rope_inputs(D):
    x = torch.randn(7, 3, D)
    angles = torch.randn(7, D)
    return x, angles.cos(), angles.sin()


@pytest.mark.parametrize("jit_compile", [False, True], ids=["binary", "jit"])
@pytest.mark.parametrize("D", [64, 128])
def test_rotary_follows_the_compile_mode(fake_npu, on_npu, jit_compile, D):
    fake_npu.npu.set_compile_mode(jit_compile=jit_compile)
    x, cos, sin = _rope_inputs(D)
    got = model_ops.rotary(x, cos, sin)
    if jit_compile and D != 128:
        assert got is None and not fake_npu.calls["npu_rotary_mul"], "jit mode: D != 128 must use the torch code"
    else:
        torch.testing.assert_close(got, m.apply_rope(x, cos, sin))
        assert len(fake_npu.calls["npu_rotary_mul"]) == 1


@pytest.mark.parametrize("D", [64, 128])
def test_rotary_without_a_readable_mode_keeps_to_the_jit_limits(fake_npu, on_npu, monkeypatch, D):
    """Older torch_npu without ``npu.is_jit_compile_false``: only D = 128 is safe in both modes."""
    monkeypatch.delattr(fake_npu, "npu")
    x, cos, sin = _rope_inputs(D)
    got = model_ops.rotary(x, cos, sin)
    assert (got is not None) == (D == 128)
    assert len(fake_npu.calls["npu_rotary_mul"]) == (D == 128)
