"""The NaN marks of :mod:`.nan` on the Triton backend: one read of each input for its row flags and
stores into the flagged rows only, in place of torch's ``isfinite`` (five full-size passes and three
full-size temporaries per tensor) and ``masked_fill_`` (a read and write of the whole output)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_utils import cdiv, next_pow2

_ELEMS = 8192  # elements per program: a row block of BLOCK_D columns


@triton.jit
def _nonfinite_rows_kernel(x_ptr, flag_ptr, R, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    inside = (rows[:, None] < R) & (cols[None, :] < D)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    bad = (x != x) | (tl.abs(x) == float("inf"))
    tl.store(flag_ptr + rows, tl.max(bad.to(tl.int8), axis=1), mask=rows < R)


@triton.jit
def _mark_rows_nan_kernel(x_ptr, flag_ptr, R, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    flagged = tl.load(flag_ptr + rows, mask=rows < R, other=0) != 0
    # Built in fp32 and cast: Triton 3.6's interpreter has no bf16 constant (InterpreterBuilder.get_bf16).
    nan = tl.full([BLOCK_R, BLOCK_D], float("nan"), tl.float32).to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], nan,
             mask=flagged[:, None] & (cols[None, :] < D))


def _blocks(x: torch.Tensor):
    D = x.shape[-1]
    block_d = next_pow2(D)
    return x.numel() // max(D, 1), D, max(1, _ELEMS // block_d), block_d


def nonfinite_rows(x: torch.Tensor) -> torch.Tensor:
    """bool ``x.shape[:-1]``: the rows of contiguous ``x`` that hold a NaN or an inf."""
    R, D, block_r, block_d = _blocks(x)
    flags = torch.empty(x.shape[:-1], dtype=torch.int8, device=x.device)
    if R and D:
        _nonfinite_rows_kernel[(cdiv(R, block_r),)](x, flags, R, D=D, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)
    else:
        flags.zero_()
    return flags.view(torch.bool)


def mark_rows_nan_(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x`` with its rows flagged in bool ``rows [x.shape[:-1]]`` set to NaN (in place; contiguous ``x``)."""
    R, D, block_r, block_d = _blocks(x)
    if R and D:
        _mark_rows_nan_kernel[(cdiv(R, block_r),)](x, rows.contiguous().view(torch.int8), R, D=D, BLOCK_R=block_r,
                                                    BLOCK_D=block_d, num_warps=4)
    return x
