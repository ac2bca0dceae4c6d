"""dapo_kernels._alloc: poisoned outputs and huge-page CPU bulk outputs."""
import gc

import pytest
import torch

from dapo_kernels import _alloc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool], ids=str)
@pytest.mark.parametrize("rows", [3, 5000], ids=["small", "bulk"])  # bulk: over _BULK_MIN_BYTES for 4-byte types
def test_cpu_bulk_output_zeroed_and_poisoned(dtype, rows):
    shape = (rows, 1031)  # not a multiple of any page
    z = _alloc.cpu_bulk_output(shape, dtype=dtype, zeroed=True)
    assert z.shape == shape and z.dtype == dtype and z.is_contiguous()
    assert not z.any()
    with _alloc.poison_outputs(True):
        p = _alloc.cpu_bulk_output(shape, dtype=dtype)
    assert p.shape == shape and p.dtype == dtype
    if dtype.is_floating_point:
        assert p.isnan().all()
    elif dtype == torch.bool:
        assert p.all()
    else:
        assert (p == _alloc.INT_POISON).all()


def test_cpu_bulk_output_is_huge_page_aligned_and_outlives_its_mapping():
    t = _alloc.cpu_bulk_output((4096, 1024), dtype=torch.float32)
    if _alloc._bulk_enabled():
        assert t.data_ptr() % _alloc._HUGE_PAGE == 0
    view = t[7:9]
    del t
    gc.collect()
    view.fill_(2.5)  # the mapping must still be alive through the view
    assert float(view.sum()) == 2.5 * view.numel()


def test_cpu_bulk_output_can_be_disabled(monkeypatch):
    monkeypatch.setenv("DAPO_KERNELS_HUGEPAGES", "0")
    t = _alloc.cpu_bulk_output((4096, 1024), dtype=torch.float32, zeroed=True)
    assert not t.any() and t.untyped_storage().nbytes() == t.numel() * 4
