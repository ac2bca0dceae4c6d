"""Argument checks shared by the public ops.

Every check raises before any output is written: ``TypeError`` when an argument has
the wrong Python type, ``ValueError`` when a tensor has the wrong shape, dtype,
device or contents. Messages name the argument and what was expected.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

import torch

from ._cache import per_tensor_cache

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def tracing() -> bool:
    """True while ``torch.compile`` traces the op (no values to read: checks that read values are
    made on the device with ``torch._assert_async`` instead, a ``RuntimeError`` naming the argument)."""
    return torch.compiler.is_compiling()


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    t,
    *,
    ndim: Optional[int | Sequence[int]] = None,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    device: Optional[torch.device] = None,
    shape: Optional[Sequence[Optional[int]]] = None,
) -> torch.Tensor:
    """Check that ``t`` is a tensor with the given rank, dtype, device and shape.

    ``shape`` entries that are None match any size.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            want = " or ".join(str(a) for a in allowed)
            raise ValueError(f"{name} must be {want}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in ({_dtype_names(dtypes)}), got {t.dtype}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    return t


def check_int(name: str, value, *, minimum: Optional[int] = None) -> int:
    """Check a Python integer argument (bool rejected)."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
            value = int(value)
        else:
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_flag(name: str, value) -> bool:
    """Check a Python bool argument (0 / 1 and tensors rejected: a flag passed positionally in the
    wrong place should fail, not be read as a truth value)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_float(name: str, value, *, valid: Optional[Callable[[float], bool]] = None, expected: str = "",
                or_none: bool = False) -> Optional[float]:
    """Check a Python real-number argument (bool rejected) and return it as a float.

    ``valid(v)`` False raises ``ValueError("{name} must be {expected}, got {value}")``; NaN fails
    any comparison-based ``valid``. ``or_none``: None is accepted and returned as is.
    """
    if value is None and or_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float{' or None' if or_none else ''}, got {type(value).__name__}")
    if valid is not None and not valid(float(value)):
        raise ValueError(f"{name} must be {expected}, got {value}")
    return float(value)


def check_float_or_tensor(name: str, value, *, valid: Callable, expected: str, device=None) -> torch.Tensor:
    """A real number given as a Python int / float or a 1-element int / float tensor, returned as
    a 0-dim fp64 tensor on ``device``.

    ``valid`` is applied to the number (a ``ValueError`` as in :func:`check_float`) or to the fp64
    tensor on the device, so write it with operators that work on both (``(v >= 0) & (v < inf)``).
    A tensor is checked with ``torch._assert_async`` (no host sync): a ``RuntimeError`` naming the
    argument, at once on the CPU; on an accelerator a device-side assert at the next
    synchronisation, which leaves that device unusable for the process (CUDA's rule).
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a 1-element tensor, got shape {tuple(value.shape)}")
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name} must be a real number or a 1-element int / float tensor, got {value.dtype}")
        t = value.reshape(()).to(device=device, dtype=torch.float64)
        torch._assert_async(valid(t), f"{name} must be {expected} (checked on the device)")
        return t
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be an int, a float or a 1-element tensor, got {type(value).__name__}")
    return torch.tensor(check_float(name, value, valid=lambda v: bool(valid(v)), expected=expected),
                        dtype=torch.float64, device=device)


MASK_DTYPES = (torch.bool,) + INT_DTYPES + FLOAT_DTYPES


def check_mask(name: str, mask, *, ndim=None, device=None, shape=None) -> torch.Tensor:
    """A token mask as bool: bool, integer (nonzero = selected) or float 0 / 1 (verl's
    ``response_mask`` / ``attention_mask`` are float or int64 in places).

    A float mask holding any other value (0.5, NaN, ...) is rejected, not read as a weight: checked
    on the device with ``torch._assert_async`` (no host sync; a ``RuntimeError`` naming the argument,
    at once on the CPU, at the next synchronisation on an accelerator). Shape / dtype / device
    errors are ``ValueError`` / ``TypeError`` as in :func:`check_tensor`.
    """
    check_tensor(name, mask, ndim=ndim, dtypes=MASK_DTYPES, device=device, shape=shape)
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        torch._assert_async(((mask == 0) | (mask == 1)).all(),
                            f"{name}: a float mask must hold only 0 and 1 (checked on the device)")
    return mask != 0


@per_tensor_cache
def cu_seqlens_boundaries(cu_seqlens: torch.Tensor) -> tuple:
    """(first, last, number of decreasing steps) of a non-empty ``cu_seqlens``: one transfer of three
    scalars, read once per batch (every layer of a packed model passes the same tensor)."""
    c = cu_seqlens.detach()
    steps = (c[1:] < c[:-1]).sum().long() if c.numel() > 1 else c[0].long() * 0
    return tuple(torch.stack([c[0].long(), c[-1].long(), steps]).tolist())


@per_tensor_cache
def value_range(t: torch.Tensor) -> tuple:
    """(min, max) of a non-empty tensor: one read per tensor (the label range check of the log-prob
    ops, which a packed batch's micro-batches reuse across epochs)."""
    return tuple(torch.stack(torch.aminmax(t)).tolist())


@per_tensor_cache
def value_range_except(t: torch.Tensor, excluded: int) -> tuple:
    """(min, max) of the entries of a non-empty integer tensor other than ``excluded`` (the log-prob
    ops' ``ignore_index``), in one read; (1, 0) (min > max) if every entry is ``excluded``."""
    keep = t != excluded
    info = torch.iinfo(t.dtype)
    lo, hi, any_kept = torch.stack([torch.where(keep, t, info.max).min(), torch.where(keep, t, info.min).max(),
                                    keep.any().to(t.dtype)]).tolist()
    return (lo, hi) if any_kept else (1, 0)


def to_device_checked(t: torch.Tensor, device) -> torch.Tensor:
    """``t.to(device)``, with the facts the ops check of an integer tensor (its range; as
    ``cu_seqlens``, its boundaries) read from ``t`` while it is still on the host, where that
    costs no sync: checking the device copy then reads nothing. For data built on the host
    (packed ids, labels, ``cu_seqlens``), the way a trainer feeds micro-batches."""
    check_tensor("t", t)
    out = t.to(device)
    if t.device.type == "cpu" and t.dim() == 1 and t.numel() and not t.is_floating_point() and not t.is_complex():
        value_range.prime(out, value=value_range(t))
        cu_seqlens_boundaries.prime(out, value=cu_seqlens_boundaries(t))
    return out


def check_cu_seqlens(cu_seqlens, total_tokens: int, *, name: str = "cu_seqlens", device=None) -> int:
    """Validate cumulative sequence lengths; return the batch size.

    Expected: int32 (or int64) 1-D ``[B+1]``, ``cu_seqlens[0] == 0``, non-decreasing,
    ``cu_seqlens[-1] == total_tokens``. Reading the tensor costs one host sync the first time a
    given tensor (at a given version) is checked; later checks of it read nothing. Under
    ``torch.compile`` the values are checked on the device (:func:`tracing`).
    """
    check_tensor(name, cu_seqlens, ndim=1, dtypes=(torch.int32, torch.int64), device=device)
    if cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must have at least one element (B+1 with B >= 0), got 0")
    if tracing():
        c = cu_seqlens.long()
        torch._assert_async(c[0] == 0, f"{name}[0] must be 0 (checked on the device)")
        torch._assert_async((c[1:] >= c[:-1]).all(), f"{name} must be non-decreasing (checked on the device)")
        torch._assert_async(c[-1] == total_tokens,
                            f"{name}[-1] must equal the number of tokens (checked on the device)")
        return cu_seqlens.numel() - 1
    first, last, bad = cu_seqlens_boundaries(cu_seqlens)
    if first != 0:
        raise ValueError(f"{name}[0] must be 0, got {first}")
    if bad:
        raise ValueError(f"{name} must be non-decreasing, found {bad} decreasing step(s)")
    if last != total_tokens:
        raise ValueError(f"{name}[-1] must equal the number of tokens {total_tokens}, got {last}")
    return cu_seqlens.numel() - 1
