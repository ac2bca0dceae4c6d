"""The dtype of the ops' lse (the softmax statistic the backward recomputes probabilities from)."""
from __future__ import annotations

import torch

# fp32 inputs keep the lse in fp64: an fp32 lse (~50-72 under soft-capping) is rounded by up to
# 4e-6, an error every recomputed probability of the row shares, which put fp32 dV at up to 3x
# torch's error (NOTES.md, "fp64 lse for fp32 inputs"). 16-bit inputs' own rounding dwarfs it.
LSE_DTYPES = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The ops' lse dtype for inputs of ``dtype`` (the public function returns float32)."""
    return LSE_DTYPES[dtype]
