"""``flash_attn.bert_padding`` names on dapo_kernels' packing ops.

``unpad_input(hidden_states, attention_mask, unused_mask=None)`` returns flash-attn >= 2.7's 5-tuple
``(x_unpad, indices, cu_seqlens, max_seqlen, seqused)``; ``pad_input(hidden_states, indices, batch,
seqlen)``; ``index_first_axis(x, indices)`` / ``index_put_first_axis(values, indices, first_axis_dim)``
as flash-attn's autograd gather / scatter (each the other's backward). Differences: the mask may
also be float 0 / 1; ``pad_input`` checks that ``indices`` are distinct and in range (flash-attn
leaves duplicates to the scatter).
"""
from __future__ import annotations

import torch

from .._validation import check_tensor
from ..ops.packing import check_indices, index_rows, pad_input, unpad_input

__all__ = ["unpad_input", "pad_input", "index_first_axis", "index_put_first_axis"]


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``x[indices]`` along the first axis (``x [N, *]``), differentiable (backward: a scatter).
    The range of ``indices`` is read once per tensor (none for those :func:`unpad_input` made)."""
    check_tensor("input", x)
    check_tensor("indices", indices, ndim=1, dtypes=(torch.int64, torch.int32), device=x.device)
    if x.dim() < 2:
        raise ValueError(f"input must be at least 2-D [N, *] (flash-attn's contract), got shape {tuple(x.shape)}")
    if indices.numel():
        check_indices(indices, x.shape[0], distinct=False)
    out = index_rows(x.reshape(x.shape[0], -1), indices.long())
    return out.reshape((indices.shape[0],) + tuple(x.shape[1:]))


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """Zeros ``[first_axis_dim, *]`` with ``values`` at rows ``indices`` (distinct), differentiable
    (backward: a gather): :func:`pad_input` with one row."""
    return pad_input(values, indices, 1, first_axis_dim)[0]
