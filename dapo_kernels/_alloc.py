"""Output allocation for kernels, with optional poisoning for tests.

Kernels allocate their outputs with :func:`empty_output` instead of ``torch.empty``.
When poisoning is on (``DAPO_KERNELS_POISON=1``, set by the test suite, or
:func:`poison_outputs`), fresh outputs are filled with NaN (floats) or a sentinel
(integers), so an element a kernel forgets to write fails the test instead of
passing by luck with whatever memory held.
"""
from __future__ import annotations

import contextlib
import os

import torch

INT_POISON = -0x5EED  # negative, so it is never a valid index or count


def _poison_on() -> bool:
    return _forced if _forced is not None else os.environ.get("DAPO_KERNELS_POISON", "0") == "1"


_forced = None


@contextlib.contextmanager
def poison_outputs(enabled: bool = True):
    global _forced
    prev, _forced = _forced, enabled
    try:
        yield
    finally:
        _forced = prev


def empty_output(shape, *, dtype: torch.dtype, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if _poison_on() and t.numel():
        if t.dtype.is_floating_point or t.dtype.is_complex:
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.fill_(True)
        elif t.dtype == torch.uint8:
            t.fill_(0xA5)
        else:
            t.fill_(INT_POISON)
    return t
