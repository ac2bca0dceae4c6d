"""Output allocation for kernels, with optional poisoning for tests.

Kernels allocate their outputs with :func:`empty_output` instead of ``torch.empty``.
When poisoning is on (``DAPO_KERNELS_POISON=1``, set by the test suite, or
:func:`poison_outputs`), fresh outputs are filled with NaN (floats) or a sentinel
(integers), so an element a kernel forgets to write fails the test instead of
passing by luck with whatever memory held.

:func:`cpu_bulk_output` allocates large CPU outputs on transparent huge pages: a fresh
1 GiB ``torch.empty`` on the CPU costs ~262k page faults on first touch, which dominate
a copy like packing (benchmarks/bench_packing.py); 2 MiB pages cut that 512-fold. Anonymous mappings
are zero-filled by the kernel, so a zeroed output costs no extra pass either.
"""
from __future__ import annotations

import contextlib
import math
import mmap
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
    if _poison_on():
        _poison(t)
    return t


def _poison(t: torch.Tensor) -> None:
    if t.numel():
        if t.dtype.is_floating_point or t.dtype.is_complex:
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.fill_(True)
        elif t.dtype == torch.uint8:
            t.fill_(0xA5)
        else:
            t.fill_(INT_POISON)


_HUGE_PAGE = 2 << 20  # x86-64 / aarch64 transparent huge page size; the mapping is aligned to it
_BULK_MIN_BYTES = 8 << 20  # below this the page-fault cost is small and mmap's syscalls are not worth it


def _bulk_enabled() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("DAPO_KERNELS_HUGEPAGES", "1") != "0"


def cpu_bulk_output(shape, *, dtype: torch.dtype, zeroed: bool = False) -> torch.Tensor:
    """A CPU output tensor of ``shape``/``dtype``, on huge pages when it is large.

    ``zeroed=True`` returns zeros (free for a fresh mapping); otherwise the contents are
    unspecified and poisoned like :func:`empty_output` when poisoning is on. Small sizes,
    non-Linux hosts and ``DAPO_KERNELS_HUGEPAGES=0`` fall back to the default allocator.
    The memory is returned to the OS when the last tensor viewing it is freed.
    """
    nbytes = math.prod(int(d) for d in shape) * dtype.itemsize
    if nbytes < _BULK_MIN_BYTES or not _bulk_enabled():
        if zeroed:
            return torch.zeros(shape, dtype=dtype)
        return empty_output(shape, dtype=dtype, device="cpu")
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP compiled out: still a valid (zeroed) mapping, just 4 KiB pages
        pass
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive; unmapped with the last view
    offset = (-raw.data_ptr()) % _HUGE_PAGE
    t = raw[offset:offset + nbytes].view(dtype).view(shape)
    if not zeroed and _poison_on():
        _poison(t)
    return t
