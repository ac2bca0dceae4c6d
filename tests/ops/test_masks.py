"""Masks as verl passes them: every op that takes a mask accepts bool, integer and
float 0 / 1 with the same result, and rejects a float mask holding another value on the device
(``torch._assert_async``: a RuntimeError naming the argument, no host read)."""
import math

import pytest
import torch

import dapo_kernels as dk
from tests.helpers import backend
from tests.sync_counter import count_host_syncs

MASK_DTYPES = [torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
               torch.float64]


def _policy_loss(mask, be):
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(3, 9, generator=g)).requires_grad_()
    old, adv = -torch.rand(3, 9, generator=g), torch.randn(3, 9, generator=g)
    with backend(be):
        loss, metrics = dk.policy_loss(lp, old, adv, mask, loss_agg_mode="seq-mean-token-mean")
        loss.backward()
    return [loss, lp.grad, *metrics.values()]


def _fused_loss(mask, be):
    g = torch.Generator().manual_seed(1)
    n, h, v = 27, 8, 19
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    old, adv = -torch.rand(n, generator=g), torch.randn(n, generator=g)
    with backend(be):
        loss, metrics = dk.fused_linear_policy_loss(hidden, weight, labels, old, adv, mask.reshape(-1))
        loss.backward()
    return [loss, hidden.grad, metrics["pg_clipfrac"], metrics["ppo_kl"]]


def _unpad(mask, be):
    x = torch.arange(27 * 2, dtype=torch.float32).reshape(3, 9, 2)
    with backend(be):
        x_unpad, indices, cu, max_len, used = dk.unpad_input(x, mask, unused_mask=torch.zeros_like(mask))
    return [x_unpad, indices, cu, torch.tensor(max_len), used]


def _accumulator(mask, be):
    acc = dk.DynamicBatchAccumulator(train_batch_size=9, n_per_prompt=3, max_num_gen_batches=0)
    keep = mask[:, 0].repeat_interleave(3)  # whole groups of 3
    acc.add({"v": torch.arange(9)}, torch.arange(3).repeat_interleave(3), keep)
    return [torch.tensor(acc.num_buffered_groups)]


OPS = {"policy_loss": (_policy_loss, "response_mask"), "fused_linear_policy_loss": (_fused_loss, "response_mask"),
       "unpad_input": (_unpad, "attention_mask"), "DynamicBatchAccumulator.add": (_accumulator, "keep")}


def _bool_mask():
    m = torch.rand(3, 9, generator=torch.Generator().manual_seed(2)) > 0.4
    m[:, 0] = torch.tensor([True, False, True])
    return m


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("dtype", MASK_DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_integer_and_float_masks_equal_bool(op, dtype, be):
    fn, _ = OPS[op]
    mask = _bool_mask()
    want = fn(mask, be)
    got = fn(mask.to(dtype), be)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{op} output {i}: {dtype} mask differs from the bool mask"


@pytest.mark.parametrize("bad", [0.5, 2.0, -1.0, math.nan, math.inf])
@pytest.mark.parametrize("op", OPS)
def test_float_mask_with_other_values_rejected_on_device(op, bad):
    fn, name = OPS[op]
    mask = _bool_mask().float()
    mask[2, 0] = bad
    with pytest.raises(RuntimeError, match=f"{name}: a float mask must hold only 0 and 1"):
        fn(mask, "torch")


def test_float_mask_check_reads_nothing():
    """The value check of a float mask is a device-side assert: a float mask costs no more host
    reads than the bool mask (policy_loss: none)."""
    mask = _bool_mask()
    counts = []
    for m in (mask, mask.float()):
        with count_host_syncs() as c:
            _policy_loss(m, "triton")
        counts.append(c.count)
    assert counts == [0, 0], counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_mask_still_checked_for_shape_and_device(dtype):
    x = torch.zeros(3, 9)
    with pytest.raises(ValueError, match="response_mask must have shape"):
        dk.policy_loss(x, x, x, torch.ones(3, 8, dtype=dtype))
    with pytest.raises(ValueError, match="response_mask must have dtype"):
        dk.policy_loss(x, x, x, torch.ones(3, 9, dtype=torch.complex64))
