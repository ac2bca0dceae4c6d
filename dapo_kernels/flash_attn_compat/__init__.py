"""flash-attn's names on dapo_kernels' ops: replace ``from flash_attn import flash_attn_varlen_func``
(and ``flash_attn.bert_padding``) with ``from dapo_kernels.flash_attn_compat import ...``.

:func:`flash_attn_varlen_func` has flash-attn 2's signature and defaults (``causal=False`` here,
whereas :func:`dapo_kernels.varlen_attention` defaults to causal) and returns what it returns:
``out``, or with ``return_attn_probs=True`` the 3-tuple ``(out, softmax_lse [Hq, T], None)``
(flash-attn gives the softmax matrix only with dropout, which is not supported here).

Differences from flash-attn, each a clear error rather than a silent change:

* self-attention over one packing only: ``cu_seqlens_k`` must be ``cu_seqlens_q`` (the same tensor,
  or equal values, checked on the device without a host sync: a ``RuntimeError`` from
  ``torch._assert_async``), ``k`` / ``v`` the same tokens as ``q``;
* ``dropout_p > 0``, ``alibi_slopes`` and ``block_table`` (paged KV) raise ``NotImplementedError``;
* ``window_size`` entries are -1 or >= 0 (flash-attn reads any negative number as unbounded);
  ``window_size`` may be a tensor of two integers, as flash-attn's own tests pass one
  (``torch.randint``): its values are read to the host once per call (a sync for a device tensor);
* ``deterministic`` is passed on: ``False`` (the default, as flash-attn) adds dQ with atomics in
  the Triton backward, ``True`` runs the bitwise-reproducible dQ kernel.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._validation import check_flag, check_float, check_int, check_tensor
from ..ops.varlen_attention import varlen_attention
from . import bert_padding

__all__ = ["flash_attn_varlen_func", "bert_padding"]


def _unsupported(name: str, why: str):
    return NotImplementedError(f"dapo_kernels.flash_attn_compat: {name} is not supported ({why})")


def _host_window(window_size):
    """``window_size`` as given, or the ``(left, right)`` ints of a 2-element integer tensor (one read)."""
    if not isinstance(window_size, torch.Tensor):
        return window_size
    if tuple(window_size.shape) != (2,) or window_size.is_floating_point() or window_size.is_complex() \
            or window_size.dtype == torch.bool:
        raise ValueError("window_size as a tensor must hold 2 integers (left, right), got "
                         f"{window_size.dtype} of shape {list(window_size.shape)}")
    return tuple(int(x) for x in window_size.tolist())


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
):
    """flash-attn's ``flash_attn_varlen_func`` on :func:`dapo_kernels.varlen_attention` (both backends).

    ``q [T, Hq, D]``, ``k`` / ``v`` ``[T, Hkv, D]`` (GQA), ``cu_seqlens_q`` = ``cu_seqlens_k`` int32
    ``[B+1]``, ``max_seqlen_*`` upper bounds; ``softmax_scale`` default ``1/sqrt(D)``; ``window_size``
    ``(left, right)`` sliding window (-1 = unbounded; a tuple or a 2-element integer tensor);
    ``softcap > 0`` soft-caps the scores. Returns ``out [T, Hq, D]``, or ``(out, softmax_lse fp32 [Hq, T],
    None)`` with ``return_attn_probs``.
    """
    if check_float("dropout_p", dropout_p, valid=lambda p: 0.0 <= p <= 1.0, expected="in [0, 1]") > 0:
        raise _unsupported("dropout_p > 0", "attention dropout is not implemented; pass 0.0")
    if alibi_slopes is not None:
        raise _unsupported("alibi_slopes", "ALiBi biases are not implemented")
    if block_table is not None:
        raise _unsupported("block_table", "no paged KV cache: pass packed k / v")
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32, torch.int64))
    if cu_seqlens_k is not cu_seqlens_q:
        check_tensor("cu_seqlens_k", cu_seqlens_k, ndim=1, dtypes=(torch.int32, torch.int64),
                     device=cu_seqlens_q.device, shape=tuple(cu_seqlens_q.shape))
        if k.shape[0] != q.shape[0]:
            raise _unsupported("cross-attention (k / v tokens != q tokens)", "self-attention of one packing only")
        torch._assert_async((cu_seqlens_k == cu_seqlens_q).all(),
                            "cu_seqlens_k must equal cu_seqlens_q (self-attention of one packing only)")
    window_size = _host_window(window_size)
    max_seqlen = max(check_int("max_seqlen_q", max_seqlen_q, minimum=0),
                     check_int("max_seqlen_k", max_seqlen_k, minimum=0))
    result = varlen_attention(q, k, v, cu_seqlens_q, max_seqlen, causal=causal, softmax_scale=softmax_scale,
                              return_lse=check_flag("return_attn_probs", return_attn_probs),
                              window_size=window_size, softcap=softcap, deterministic=deterministic)
    return (*result, None) if return_attn_probs else result
