"""Sequence-length balancing: data-parallel partitions, token-capped micro-batches.

Host-side C++ (``csrc/balancing.cpp``, bound into ``dapo_kernels._C``), exact in int64
and deterministic (the same input always gives the same output). Drop-in for verl's
``get_seqlen_balanced_partitions`` / ``rearrange_micro_batches`` index logic:

* :func:`balanced_partitions` - Karmarkar-Karp's largest differencing method, then a
  refinement pass that moves / swaps items between the heaviest and the lightest
  partition. The refinement never raises the largest sum nor lowers the smallest, so the
  spread is never worse than plain Karmarkar-Karp's on the same input.
* :func:`micro_batches` - the fewest micro-batches the search finds whose token sums
  stay <= ``max_token_len`` (a hard guarantee), balanced by ``workloads``; O(n log n)
  up to log factors.
* :func:`attention_workload` - ``6*h*L + L*L``: dense-layer plus attention cost.
* :func:`pipeline_order` - the order to run micro-batches in under pipeline parallelism.

Inputs (``workloads`` / ``seqlens``) may be a list, a numpy array or a tensor of any
integer dtype on any device; they reach C++ as one int64 buffer without per-element
Python work (a tensor is copied to the host once).

The extension is imported on the first call, so ``import dapo_kernels`` and the tensor ops
work without it; a call without it raises ``ImportError`` saying how to build it.
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np
import torch

from ._validation import check_flag, check_int

_INT64_MAX = np.iinfo(np.int64).max
_BUILD_HINT = ("build it from the repository root with `pip install -e .` (or `make install`), "
               "which needs a C++17 compiler and pybind11")


def _extension():
    """``dapo_kernels._C``, imported here rather than at module load: only these functions need it."""
    try:
        from . import _C
    except ImportError as e:
        raise ImportError(f"dapo_kernels' balancing functions need the compiled C++ extension dapo_kernels._C, "
                          f"which did not import ({e}); {_BUILD_HINT}") from e
    return _C


def _as_int64(name: str, values) -> np.ndarray:
    """1-D int64 numpy view/copy of a list, numpy array or tensor of integers."""
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise ValueError(f"{name} must have an integer dtype, got {values.dtype}")
        values = values.detach().cpu().numpy()
    elif not isinstance(values, np.ndarray):
        if not isinstance(values, (list, tuple, range)):
            raise TypeError(f"{name} must be a list, numpy array or torch.Tensor, got {type(values).__name__}")
        try:
            values = np.asarray(values) if len(values) else np.empty(0, dtype=np.int64)
        except (OverflowError, ValueError) as e:
            raise ValueError(f"{name} must hold integers in the int64 range: {e}") from None
    if values.dtype.kind == "O":  # Python ints past the uint64 range
        raise ValueError(f"{name} must hold integers in the int64 range")
    if values.dtype.kind not in "iu":
        raise ValueError(f"{name} must have an integer dtype, got {values.dtype}")
    if values.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {list(values.shape)}")
    if values.dtype == np.uint64 and values.size and values.max() > _INT64_MAX:
        raise ValueError(f"{name} holds values past the int64 range (max {int(values.max())})")
    return np.ascontiguousarray(values, dtype=np.int64)


def balanced_partitions(workloads, k_partitions: int, equal_size: bool = False) -> List[List[int]]:
    """Split ``range(n)`` into ``k_partitions`` groups with balanced workload sums.

    Args:
        workloads: ``[n]`` non-negative integers (list / numpy / tensor, any int dtype).
        k_partitions: number of groups, ``1 <= k_partitions <= n``.
        equal_size: every group gets exactly ``n // k_partitions`` items (``n`` must be a
            multiple of ``k_partitions``).

    Returns:
        ``list[list[int]]``: ``k_partitions`` non-empty groups covering every index once,
        each ascending, groups ordered by their smallest index.

    Raises:
        ValueError: ``k_partitions`` out of range, ``n % k_partitions != 0`` with
            ``equal_size``, a negative or non-integer workload.
    """
    w = _as_int64("workloads", workloads)
    k = check_int("k_partitions", k_partitions, minimum=1)
    return _extension().balanced_partitions(w, k, check_flag("equal_size", equal_size))


def micro_batches(
    seqlens,
    max_token_len: int,
    *,
    workloads=None,
    min_num_micro_batches: int = 1,
    num_micro_batches_multiple_of: int = 1,
) -> List[List[int]]:
    """Split a batch into micro-batches of at most ``max_token_len`` tokens each.

    The count starts at a lower bound no packing can beat (``ceil(sum / cap)``; at most p
    sequences longer than ``cap / (p + 1)`` share a micro-batch; ``min_num_micro_batches``),
    rounded up to ``num_micro_batches_multiple_of``. A best-fit-decreasing packing gives an
    upper bound ``P`` (rounded up the same way). Below ``P`` the counts are tried one by one
    from the lower bound, at most 8 of them (past 32k sequences ``2**18 // n``, at least
    one), and the first where a Karmarkar-Karp partition of the workloads (or, failing that,
    of the tokens) fits the cap wins; otherwise the count is ``P``, with a Karmarkar-Karp
    partition if one fits, else the packing. Within the chosen count, workload sums are
    balanced by moves / swaps that keep every micro-batch under the cap. Each try is
    O(n log^2 n), and there are at most 9 (n = 1e6: 2-3 s of CPU). The count is never
    above that of verl's search (Karmarkar-Karp from ``ceil(sum / cap)`` upward until it
    fits) unless that search stops strictly between the last count tried and ``P``.

    For data-parallel training where every rank must run the same number of micro-batches,
    call once, all-reduce ``len(result)`` with MAX, and call again with
    ``min_num_micro_batches`` set to it (``num_micro_batches_multiple_of``: e.g. the
    virtual pipeline size). A count above ``n`` is an error, never clamped, as in verl's
    ``rearrange_micro_batches`` (it asserts ``num_micro_batches <= batch size``): clamping
    would silently give this rank fewer micro-batches than the others wait for.

    Args:
        seqlens: ``[n]`` tokens per sequence, non-negative integers (list / numpy / tensor).
        max_token_len: token cap per micro-batch, >= 1.
        workloads: ``[n]`` non-negative integers to balance (default: ``seqlens``); see
            :func:`attention_workload` for attention-heavy long sequences.
        min_num_micro_batches: at least this many micro-batches, ``1 <= . <= n``.
        num_micro_batches_multiple_of: the count is a multiple of this, ``1 <= . <= n``.

    Returns:
        ``list[list[int]]``: non-empty micro-batches covering every index once, each
        ascending, ordered by their smallest index (see :func:`pipeline_order`).

    Raises:
        ValueError: a sequence longer than ``max_token_len`` (its index and length are
            named), ``min_num_micro_batches`` or ``num_micro_batches_multiple_of`` above
            ``n``, or the required count (rounded up to the multiple) above ``n`` (every
            micro-batch is non-empty), an empty batch, negative values, ``workloads`` of
            another length.
    """
    t = _as_int64("seqlens", seqlens)
    w = None if workloads is None else _as_int64("workloads", workloads)
    if w is not None and np.array_equal(w, t):
        w = None  # the C++ takes "workloads are the tokens" from one buffer: equal values must mean it too
    cap = check_int("max_token_len", max_token_len, minimum=1)
    lo = check_int("min_num_micro_batches", min_num_micro_batches, minimum=1)
    mult = check_int("num_micro_batches_multiple_of", num_micro_batches_multiple_of, minimum=1)
    # Here too, not only in C++: a Python int past int64 could not reach it.
    for name, count in (("min_num_micro_batches", lo), ("num_micro_batches_multiple_of", mult)):
        if len(t) and count > len(t):
            raise ValueError(f"{name} = {count} exceeds the number of sequences ({len(t)}): "
                             "cannot make that many non-empty micro-batches")
    return _extension().micro_batches(t, w, cap, lo, mult)


def attention_workload(seqlens, hidden_size: int) -> np.ndarray:
    """Relative cost of a sequence of ``L`` tokens: ``6*h*L + L*L``.

    ``6*h*L`` stands for the dense layers (linear in L), ``L*L`` for attention scores;
    with ``h = 4096`` this is verl's ``24576*L + L**2``.

    Args:
        seqlens: ``[n]`` non-negative integers (list / numpy / tensor).
        hidden_size: model hidden size ``h``, >= 1.

    Returns:
        ``np.ndarray`` int64 ``[n]`` (ValueError if a value overflows int64).
    """
    lengths = _as_int64("seqlens", seqlens)
    return _extension().attention_workload(lengths, check_int("hidden_size", hidden_size, minimum=1))


def pipeline_order(micro_batches: Sequence[Sequence[int]], workloads) -> List[int]:
    """Order in which to run micro-batches under a pipeline-parallel (1F1B) schedule.

    Micro-batches are ranked by total workload, heaviest first (ties: lower position
    first), and laid out as ``[..., r4, r2, r0, r1, r3, ...]``: the heaviest in the
    middle, the lightest at both ends, and neighbours at most two ranks apart. Why:

    * the warm-up bubble is the first micro-batch's forward through every earlier stage
      and the cool-down bubble the last one's backward, so light ends shrink both;
    * in the steady state consecutive stages work on consecutive micro-batches, so
      neighbours of similar weight keep adjacent stages from waiting on each other.

    Args:
        micro_batches: ``list[list[int]]`` of sequence indices (e.g. from
            :func:`micro_batches`).
        workloads: ``[n]`` per-sequence non-negative integers the indices refer to.

    Returns:
        ``list[int]``: a permutation of ``range(len(micro_batches))``; run
        ``micro_batches[i] for i in order``.
    """
    if not isinstance(micro_batches, (list, tuple)):
        raise TypeError(f"micro_batches must be a list of lists of ints, got {type(micro_batches).__name__}")
    return _extension().pipeline_order(micro_batches, _as_int64("workloads", workloads))


__all__ = ["balanced_partitions", "micro_batches", "attention_workload", "pipeline_order"]
