"""The tolerance rule of the tests and the error measures it is written in.

An op in dtype ``d`` may differ from the float64 reference by at most 2x the error that plain torch
makes computing the same thing in ``d`` (``assert_close_to_ref``); the bound never comes from a number
picked to pass. Where torch has several usual ways to compute a quantity, its error is that of the
least accurate one (``worst_of``): each way's max error is one draw of a heavy-tailed statistic.
Where one output gathers every op's rounding (a whole model's gradients), the rule bounds the
2-norm of the error over all of it (``assert_norm_close_to_ref``) instead of the max.
"""
from __future__ import annotations

import torch

from tests.helpers import assert_no_nan

FACTOR = 2.0  # how many times torch's own error in the dtype an op may make


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64; 0 for empty tensors, and a zero ``b`` counts as 1e-30
    (so ``a == b == 0`` is 0, not NaN)."""
    if b.numel() == 0:
        return 0.0
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def worst_of(candidates, refs):
    """Per quantity, the candidate farthest from its float64 reference: ``candidates`` is one tuple
    of outputs per way, ``refs`` the float64 outputs in the same order."""
    return tuple(max(c, key=lambda t, r=r: max_abs_err(t, r)) for c, r in zip(zip(*candidates), refs))


def assert_close_to_ref(
    out: torch.Tensor,
    ref64: torch.Tensor,
    torch_out: torch.Tensor,
    *,
    name: str = "output",
    factor: float = FACTOR,
) -> None:
    """|out - ref64| <= factor * max(|torch_out - ref64|, one ulp of the result's scale).

    ``torch_out`` is plain torch computing the same quantity in the same low precision as
    ``out``; its error against the float64 reference is what that dtype costs. The ulp
    floor covers cases where torch happens to be exact (e.g. tiny sizes), where any
    correct kernel still rounds once.
    """
    assert out.shape == ref64.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref64.shape)}"
    assert_no_nan(out, name)
    torch_err = max_abs_err(torch_out, ref64)
    scale = ref64.abs().max().item() if ref64.numel() else 0.0
    floor = eps(out.dtype if out.dtype.is_floating_point else torch.float32) * max(scale, 1e-30)
    bound = factor * max(torch_err, floor)
    err = max_abs_err(out, ref64)
    assert err <= bound, (
        f"{name}: max abs error {err:.3e} vs float64 reference exceeds {factor}x torch's own "
        f"error in {out.dtype} ({torch_err:.3e}, ulp floor {floor:.3e})"
    )


def assert_norm_close_to_ref(outs, refs64, ways, *, name: str = "outputs", factor: float = FACTOR) -> None:
    """||outs - refs64||_2 <= factor * the largest ||way - refs64||_2 of torch's ``ways``, each norm over
    all the tensors together (``outs``, ``refs64`` and each way: sequences of tensors in one order).

    For outputs in which a different op changes the rounding of everything downstream (a model's
    logits and gradients): their max error is set by a few elements and differs several-fold between
    torch's own ways, while the norm sums every element's error."""
    def err(ts):
        assert len(ts) == len(refs64), f"{name}: {len(ts)} tensors vs {len(refs64)} references"
        for t, r in zip(ts, refs64):
            assert t.shape == r.shape, f"{name}: shape {tuple(t.shape)} != reference {tuple(r.shape)}"
        return torch.cat([(t.double() - r.double()).flatten() for t, r in zip(ts, refs64)]).norm().item()

    for t in outs:
        assert_no_nan(t, name)
    torch_err = max(err(w) for w in ways)
    got = err(outs)
    assert got <= factor * torch_err, (
        f"{name}: error norm {got:.3e} vs float64 reference exceeds {factor}x torch's own ({torch_err:.3e})")
