"""DAPO's soft overlong punishment on the device: ``overlong_penalty``, one elementwise kernel.

``min(-(L - (max_response_length - overlong_buffer_len)) / overlong_buffer_len * penalty_factor, 0)``
per response, computed in float64 and returned in float32; a NaN length gives NaN on both backends
(as torch's ``clamp_max``), and so does a negative one (checked on the device: no host
read). Not differentiable: rewards are constants of the policy-gradient loss.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._alloc import empty_output
from .._registry import dispatch, register
from .._validation import FLOAT_DTYPES, INT_DTYPES, check_float, check_int, check_tensor
from ._triton_utils import cdiv

# Elements per program (4 warps): coalesced loads.
_BLOCK = 512
# ptxas register budget (maxnreg): left to pick one from the block size, ptxas aims below what the
# float64 math needs and spills (benchmarks/gpu/aot.py checks for spills).
_MAX_REGS = 128


@triton.jit
def _overlong_penalty_fwd_kernel(p_len, p_out, N, expected_len, buf, factor, BLOCK: tl.constexpr):
    i_b = tl.program_id(0)
    o_n = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m_n = o_n < N
    b_l = tl.load(p_len + o_n, mask=m_n, other=0).to(tl.float64)
    b_p = -(b_l - expected_len) / buf * factor
    b_p = tl.where(b_p > 0, 0.0, b_p)  # min(p, 0) that keeps a NaN, as torch's clamp_max
    b_p = tl.where(b_l < 0, float("nan"), b_p)  # an impossible length: NaN, not a silent reward
    tl.store(p_out + o_n, b_p.to(tl.float32), mask=m_n)


@register("overlong_penalty", "triton")
def _overlong_penalty_triton(lengths, expected_len, buf, factor):
    out = empty_output(lengths.shape, dtype=torch.float32, device=lengths.device)
    N = lengths.numel()
    if N:
        _overlong_penalty_fwd_kernel[(cdiv(N, _BLOCK),)](
            lengths.contiguous(), out, N, float(expected_len), float(buf), float(factor), BLOCK=_BLOCK,
            maxnreg=_MAX_REGS,
        )
    return out


@register("overlong_penalty", "torch")
def _overlong_penalty_torch(lengths, expected_len, buf, factor):
    penalty = (-(lengths.double() - expected_len) / buf * factor).clamp_max(0.0)
    return torch.where(lengths < 0, torch.nan, penalty).float()


@torch.library.custom_op("dapo::overlong_penalty", mutates_args=())
def _overlong_penalty_op(lengths: torch.Tensor, expected_len: float, buf: float, factor: float) -> torch.Tensor:
    return dispatch("overlong_penalty", lengths.device)(lengths, expected_len, buf, factor)


@_overlong_penalty_op.register_fake
def _(lengths, expected_len, buf, factor):
    return lengths.new_empty(lengths.shape, dtype=torch.float32)


_overlong_penalty_op.register_autograd(lambda ctx, grad: (None, None, None, None))


def overlong_penalty(
    response_lengths: torch.Tensor,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward of each response.

    ``min(-(L - (max_response_length - overlong_buffer_len)) / overlong_buffer_len * penalty_factor, 0)``:
    0 up to ``max_response_length - overlong_buffer_len`` tokens, then linear down to
    ``-penalty_factor`` at ``max_response_length``.

    Args:
        response_lengths: ``[*]`` integer (or float) valid response lengths ``L``.
        max_response_length, overlong_buffer_len: ints, ``0 < buffer <= max``.
        penalty_factor: float >= 0.
    Returns float32 of the shape of ``response_lengths`` (computed in float64); a NaN length gives
    NaN, as torch's ``clamp_max`` does, and a negative length NaN too, on both backends.
    """
    check_tensor("response_lengths", response_lengths, dtypes=INT_DTYPES + FLOAT_DTYPES)
    max_len = check_int("max_response_length", max_response_length, minimum=1)
    buf = check_int("overlong_buffer_len", overlong_buffer_len, minimum=1)
    if buf > max_len:
        raise ValueError(f"overlong_buffer_len ({buf}) must be <= max_response_length ({max_len})")
    factor = check_float("penalty_factor", penalty_factor, valid=lambda v: math.isfinite(v) and v >= 0.0,
                         expected="a finite number >= 0.0")
    return _overlong_penalty_op(response_lengths.detach(), float(max_len - buf), float(buf), factor)
