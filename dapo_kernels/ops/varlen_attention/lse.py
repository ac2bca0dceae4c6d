"""The dtype of the ops' row statistics: the lse (the softmax statistic the backward recomputes
probabilities from) and the backward's delta (rowsum(dO * O), subtracted from dP)."""
from __future__ import annotations

import torch

# fp32 inputs keep both in fp64: fp32 rounding of either sets fp32 gradients' error (NOTES.md, "fp64 lse/dP ...").
STAT_DTYPES = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The ops' lse dtype for inputs of ``dtype`` (the public function returns float32)."""
    return STAT_DTYPES[dtype]


def delta_dtype(dtype: torch.dtype) -> torch.dtype:
    """The backward's delta dtype for inputs of ``dtype``; fp64 also sums dP in fp64 (the kernels' DP_F64)."""
    return STAT_DTYPES[dtype]
