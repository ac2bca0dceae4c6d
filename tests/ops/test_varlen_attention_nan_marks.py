"""The NaN marks of varlen_attention: the Triton row-flag and row-mark kernels give exactly the rows
torch's isfinite gives, and write NaN into those rows and nothing else."""
from __future__ import annotations

import pytest
import torch

from dapo_kernels.ops.varlen_attention import nan

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _poisoned(T, H, D, dtype):
    """``[T, H, D]`` random values with NaN, +inf and -inf dropped on random rows (one per value kind
    and row at most), and the rows that hold any, from torch.isfinite."""
    g = torch.Generator().manual_seed(torch.initial_seed())  # the per-test seed (conftest)
    x = torch.randn(T, H, D, generator=g).to(dtype)
    for value in (float("nan"), float("inf"), -float("inf")):
        hit = torch.rand(T, H, generator=g) < 0.1
        col = torch.randint(0, D, (T, H), generator=g)
        x[hit.nonzero(as_tuple=True) + (col[hit],)] = value
    return x, ~torch.isfinite(x).all(-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,D", [(37, 3, 8), (1, 1, 80), (64, 2, 256), (0, 4, 128), (5, 1, 24)])
@pytest.mark.parametrize("triton", [False, True])
def test_nonfinite_rows_match_isfinite(T, H, D, dtype, triton):
    """Both ways (torch's amax/amin, the Triton kernel) flag exactly the rows holding a NaN or +-inf,
    for every float dtype, head dims not a power of two, one row and no rows."""
    x, expected = _poisoned(T, H, D, dtype)
    flags = nan._nonfinite_rows(x, triton)
    assert flags.dtype == torch.bool and flags.shape == (T, H)
    assert torch.equal(flags, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,D", [(37, 3, 8), (64, 2, 256), (0, 4, 128), (33, 1, 24)])
@pytest.mark.parametrize("triton", [False, True])
def test_mark_rows_nan_writes_flagged_rows_only(T, H, D, dtype, triton):
    """Flagged rows become all NaN; every other element keeps its exact bits."""
    g = torch.Generator().manual_seed(torch.initial_seed())
    x = torch.randn(T, H, D, generator=g).to(dtype)
    rows = torch.rand(T, H, generator=g) < 0.3
    before = x.clone()
    out = nan.mark_rows_nan_(x, rows, triton)
    assert out is x
    assert bool(x[rows].isnan().all())
    assert torch.equal(x[~rows], before[~rows])
