"""Small helpers shared by the Triton op files."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._registry import triton_interpreted

# Captured at import, like Triton itself does: kernels read it as a constexpr so the
# interpreter path can avoid what the 3.9 interpreter gets wrong (bf16 tl.dot multiplies
# raw bits; upcasting dot operands to fp32 is exact since bf16 products fit fp32).
INTERPRET: bool = triton_interpreted()
# The Triton dtype of each float input dtype the kernels load.
TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else triton.next_power_of_2(int(n))


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def tl_dtype_supported(dtype: torch.dtype) -> bool:
    """Dtypes our Triton kernels load and store (bool goes through uint8 views)."""
    return dtype in (
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
        torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
    )
