"""overlong_penalty (DAPO's soft overlong punishment) against its float64 reference, both backends."""
import pytest
import torch

import dapo_kernels as dk
from dapo_kernels.reference import overlong_penalty_ref
from tests.helpers import backend, case_id
from tests.tolerance import assert_close_to_ref

OVERLONG = [("torch", torch.int64, (37,)), ("torch", torch.int32, (4, 9)), ("torch", torch.float32, (5,)),
            ("triton", torch.int64, (1030,)), ("triton", torch.int32, (3, 7)), ("triton", torch.int64, (0,))]


@pytest.mark.parametrize("be,dtype,shape", OVERLONG, ids=[case_id(be=b, dtype=d, N="x".join(map(str, s)))
                                                          for b, d, s in OVERLONG])
def test_overlong_penalty(be, dtype, shape):
    """float32 penalties of the lengths' shape, the float64 reference rounded once; 0 up to max - buffer."""
    max_len, buf, factor = 1000, 250, 1.5
    lengths = torch.randint(0, max_len + 50, shape).to(dtype)  # a few beyond max: no clamp below
    with backend(be):
        pen = dk.overlong_penalty(lengths, max_len, buf, factor)
    ref = overlong_penalty_ref(lengths, max_len, buf, factor)
    assert pen.dtype == torch.float32 and pen.shape == lengths.shape
    assert_close_to_ref(pen, ref, ref.float(), name="penalty")
    assert (pen[lengths <= max_len - buf] == 0).all()


def test_overlong_penalty_edges():
    """Exact values at the buffer's start, middle and end; a bad buffer or factor raises ValueError naming it."""
    pen = dk.overlong_penalty(torch.tensor([750, 751, 875, 1000]), 1000, 250)
    assert pen.tolist() == [0.0, pytest.approx(-1 / 250), -0.5, -1.0]
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        dk.overlong_penalty(torch.tensor([1]), 10, 11)
    with pytest.raises(ValueError, match="overlong_buffer_len must be >= 1"):
        dk.overlong_penalty(torch.tensor([1]), 10, 0)
    with pytest.raises(ValueError, match="penalty_factor"):
        dk.overlong_penalty(torch.tensor([1]), 10, 5, -1.0)


@pytest.mark.parametrize("be", ["torch", "triton"])
def test_negative_length_gives_nan_on_both_backends(be):
    """A negative response length is impossible: its penalty is NaN (found on the device without a
    host read, so the trainer's non-finite guard refuses the step), the others are unchanged."""
    lengths = torch.tensor([-1, 800, -1000, 1000])
    with backend(be):
        pen = dk.overlong_penalty(lengths, 1000, 250)
    assert pen.isnan().tolist() == [True, False, True, False]
    assert pen[1].item() == pytest.approx(-0.2) and pen[3].item() == -1.0
    assert overlong_penalty_ref(lengths, 1000, 250).isnan().tolist() == [True, False, True, False]
