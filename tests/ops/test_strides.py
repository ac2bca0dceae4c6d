"""Every public tensor op on both backends with each tensor argument non-contiguous: a strided view
(a slice of a bigger tensor) and, where a valid input can have that shape, an expanded stride-0
tensor. The result must be identical to the same call on a contiguous copy of the same values:
a launcher makes each kernel argument contiguous (or the kernel addresses it through its strides),
so the same kernel runs on the same values (a kernel indexing a non-contiguous ``labels`` or
``indices`` as if contiguous would read other elements: wrong log-probs, dH or ``pad_input``
gradient).
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from tests.helpers import BACKENDS
from tests.op_cases import CASES, run_case

# Arguments whose expanded (repeated-row) form is not a valid input: pad_input's indices must be
# distinct, cu_seqlens must rise from 0 to T.
_NO_EXPAND = {"indices", "cu_seqlens"}


def _strided(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The same values as a view whose every stride is doubled (every other element of a tensor
    twice as large in each dimension); None for 0-d tensors."""
    if t.dim() == 0:
        return None
    big = t.new_zeros([2 * s for s in t.shape])
    view = big[tuple(slice(None, None, 2) for _ in t.shape)]
    view.copy_(t)
    return view


def _expanded(name: str, t: torch.Tensor) -> Optional[torch.Tensor]:
    """``t``'s first row repeated along dim 0 with stride 0, where that is a valid input."""
    if name in _NO_EXPAND or t.dim() == 0 or t.shape[0] < 2:
        return None
    return t[:1].expand_as(t)


def _assert_identical(got, want, where: str) -> None:
    assert got.keys() == want.keys(), where
    for k in want:
        a, b = got[k], want[k]
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {k} dtype/shape differ"
        same = torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                     and torch.equal(a.nan_to_num(), b.nan_to_num()))
        if not same:
            err = (a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max().item()
            raise AssertionError(f"{where}: {k} differs from the contiguous call (max abs diff {err:.3e})")


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("case", [c for c in CASES], ids=lambda c: c.name)
def test_noncontiguous_arguments_match_contiguous(case, be):
    args = case.make()
    tensors = [n for n, t in args.items() if isinstance(t, torch.Tensor)]
    assert tensors, f"{case.name} has no tensor argument"
    base = run_case(case, args, be)
    checked = 0
    for name in tensors:
        for kind, view in (("strided", _strided(args[name])), ("expanded", _expanded(name, args[name]))):
            if view is None:
                continue
            assert not view.is_contiguous(), f"{name} {kind}: the view should be non-contiguous"
            where = f"{case.name} [{be}] {name} {kind}"
            want = base if kind == "strided" else run_case(case, {**args, name: view.contiguous()}, be)
            _assert_identical(run_case(case, {**args, name: view}, be), want, where)
            checked += 1
    assert checked >= len(tensors)
