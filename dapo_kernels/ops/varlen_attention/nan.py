"""NaN in, NaN out, whatever the backend's block sizes: which rows of the outputs a non-finite input
reaches, from the attention pattern alone (the backends read non-finite values as 0 where they are
not attended, and the custom ops mark these rows NaN)."""
from __future__ import annotations

import torch

from ..._cache import per_tensor_cache


def _nonfinite_rows(x: torch.Tensor, triton: bool) -> torch.Tensor:
    """bool ``[T, H]``: the (token, head) rows of contiguous ``x [T, H, D]`` that hold a NaN or an inf."""
    if triton:
        return nan_triton().nonfinite_rows(x)
    # amax / amin propagate NaN and keep +-inf: two reads, no full-size temporary (isfinite makes three).
    # Times 0 they are 0 unless non-finite (NaN): four small kernels, where two isfinite made ten.
    hi, lo = x.amax(-1), x.amin(-1)
    return lo.mul_(0).add_(hi.mul_(0)).ne(0)


def mark_rows_nan_(x: torch.Tensor, rows: torch.Tensor, triton: bool) -> torch.Tensor:
    """``x [T, H, D]`` (contiguous) with the rows flagged in bool ``rows [T, H]`` set to NaN, in place."""
    if triton:
        return nan_triton().mark_rows_nan_(x, rows)
    return x.masked_fill_(rows[..., None], float("nan"))


def nan_triton():
    """The Triton versions (:mod:`.nan_triton`), imported on first use: the torch path needs no Triton."""
    from . import nan_triton as module
    return module


@per_tensor_cache  # once per batch, not per layer
def _token_bounds(cu_seqlens: torch.Tensor, total_tokens: int):
    """int64 ``[T]`` each (token index, its sequence's start, its sequence's end)."""
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    t = torch.arange(total_tokens, device=cu.device)
    return (t, torch.repeat_interleave(cu[:-1], lens, output_size=total_tokens),
            torch.repeat_interleave(cu[1:], lens, output_size=total_tokens))


def _attending(flag: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool, window_left: int, window_right: int,
               keys: bool) -> torch.Tensor:
    """bool ``[T, H]``: the queries that attend a key flagged in ``flag [T, H]`` or, with ``keys``, the
    keys that a flagged query attends; within each sequence, query ``i`` attends key ``j`` iff
    ``i - left <= j <= i + right`` (causal: right = 0; -1 = unbounded). Prefix counts on the
    device, no host sync."""
    T = flag.shape[0]
    t, start, end = _token_bounds(cu_seqlens, T)
    left = T if window_left < 0 else window_left
    right = 0 if causal else (T if window_right < 0 else window_right)
    before, after = (right, left) if keys else (left, right)  # a key is attended by i in [j - right, j + left]
    lo = torch.maximum(start, t - before)
    hi = torch.minimum(end, t + after + 1)
    count = torch.nn.functional.pad(torch.cumsum(flag, 0, dtype=torch.int32), (0, 0, 1, 0))  # flagged rows < t
    return count[hi] > count[lo]


def poisoned_queries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool,
                     window_left: int, window_right: int, triton: bool = False) -> torch.Tensor:
    """bool ``[T, Hq]``: the queries whose ``q``, or the ``k`` / ``v`` of a key they attend, hold a NaN or
    inf; ``triton``: the row flags by the Triton kernel (same result)."""
    attends_bad = _attending(_nonfinite_rows(k, triton) | _nonfinite_rows(v, triton), cu_seqlens, causal,
                             window_left, window_right, keys=False)
    return _nonfinite_rows(q, triton) | attends_bad.repeat_interleave(q.shape[1] // k.shape[1], 1)


def poisoned_grads(dout: torch.Tensor, lse: torch.Tensor, kv_heads: int, cu_seqlens: torch.Tensor, causal: bool,
                   window_left: int, window_right: int, triton: bool = False):
    """(bool ``[T, Hq]``, bool ``[T, Hkv]``): the queries whose ``lse`` is NaN (the forward's mark) or
    whose ``dout`` holds a NaN or inf, and the keys such a query attends; ``triton`` as above."""
    T, Hq, _ = dout.shape
    bad = lse.isnan().t() | _nonfinite_rows(dout, triton)
    keys = _attending(bad.reshape(T, kv_heads, Hq // kv_heads).any(-1), cu_seqlens, causal, window_left,
                      window_right, keys=True)
    return bad, keys
