"""Varlen (packed-sequence) flash attention: ``varlen_attention``, forward and backward, GQA.

Same meaning as flash-attn's ``flash_attn_varlen_func`` with ``cu_seqlens_q ==
cu_seqlens_k``: ``T`` packed tokens, sequence ``b`` owns rows
``cu_seqlens[b]:cu_seqlens[b+1]`` and attends only to itself; query head ``h`` reads
KV head ``h // (Hq // Hkv)``.

Backends:

* ``torch`` (CPU default): the sequences are gathered into a ``[B, S_max]`` padded
  view with one index tensor and run through torch's fused CPU flash kernel
  (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, which take
  grouped KV heads natively); no Python loop over sequences.
* ``triton`` (CUDA default): flash-attention-2 style kernels over a work list of
  (sequence, block) pairs built on the device and ordered longest first.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from .._alloc import empty_output
from .._registry import dispatch, register
from .._validation import check_cu_seqlens, check_int, check_tensor

# Head dims the kernels are tested with; others are refused at the boundary.
SUPPORTED_HEAD_DIMS = (16, 32, 64, 96, 128, 256)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------- torch path
def _padded_layout(cu_seqlens: torch.Tensor, total_tokens: int):
    """Index maps between the packed stream and a ``[B, S]`` padded view.

    Returns ``(gather [B, S] int64, flat [T] int64, S)``: padded slot ``(b, p)`` reads packed
    row ``gather[b, p]`` (clamped for padding slots, whose results are dropped) and packed
    row ``t`` lives at flat padded slot ``flat[t]``.
    """
    cu = cu_seqlens.long()
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    B = lengths.numel()
    S = int(lengths.max()) if B and total_tokens else 0  # CPU path: reading it costs nothing
    pos = torch.arange(S, device=cu.device)
    gather = (starts[:, None] + pos[None, :]).clamp_(max=max(total_tokens - 1, 0))
    seq_of_token = torch.repeat_interleave(torch.arange(B, device=cu.device), lengths, output_size=total_tokens)
    flat = seq_of_token * S + (torch.arange(total_tokens, device=cu.device) - starts[seq_of_token])
    return gather, flat, S, lengths


def _to_padded(x: torch.Tensor, gather: torch.Tensor) -> torch.Tensor:
    """Packed ``[T, H, D]`` -> padded ``[B, H, S, D]`` (a strided view of the gather)."""
    return x[gather].transpose(1, 2)


def _to_packed(x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """Padded ``[B, H, S, ...]`` -> packed ``[T, H, ...]``."""
    B, H, S = x.shape[:3]
    return x.transpose(1, 2).reshape((B * S, H) + tuple(x.shape[3:]))[flat]


def _scatter_padded(x: torch.Tensor, flat: torch.Tensor, B: int, S: int, fill: float) -> torch.Tensor:
    """Packed ``[T, H, ...]`` -> padded ``[B, H, S, ...]`` with ``fill`` in padding slots."""
    out = x.new_full((B * S,) + tuple(x.shape[1:]), fill)
    out.index_copy_(0, flat, x)
    return out.reshape((B, S) + tuple(x.shape[1:])).transpose(1, 2)


def _key_padding_mask(lengths: torch.Tensor, S: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive ``[B, 1, 1, S]`` mask hiding padding keys (non-causal only: with a causal
    mask a real query never sees a key past its own sequence's end). Key 0 stays visible
    so padding rows of an empty sequence are not all-masked (their results are dropped)."""
    pos = torch.arange(S, device=lengths.device)
    hidden = (pos[None, :] >= lengths[:, None]) & (pos[None, :] > 0)
    mask = torch.zeros(hidden.shape, dtype=dtype, device=lengths.device)
    return mask.masked_fill_(hidden, float("-inf"))[:, None, None, :]


@register("varlen_attention_fwd", "torch")
def _fwd_torch(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale):
    T, Hq, _ = q.shape
    gather, flat, S, lengths = _padded_layout(cu_seqlens, T)
    if T == 0:
        return torch.empty_like(q), q.new_empty((Hq, 0), dtype=torch.float32)
    mask = None if causal else _key_padding_mask(lengths, S, q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _to_padded(q, gather), _to_padded(k, gather), _to_padded(v, gather),
        0.0, causal, attn_mask=mask, scale=softmax_scale,
    )
    return _to_packed(out, flat), _to_packed(lse, flat).t().contiguous()


@register("varlen_attention_bwd", "torch")
def _bwd_torch(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale):
    T, Hq, _ = q.shape
    if T == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    gather, flat, S, lengths = _padded_layout(cu_seqlens, T)
    B = lengths.numel()
    mask = None if causal else _key_padding_mask(lengths, S, q.dtype)
    # Padding rows get dO = 0 and lse = +inf, so their probabilities are exactly 0 and
    # they add nothing to dK/dV.
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _scatter_padded(dout, flat, B, S, 0.0), _to_padded(q, gather), _to_padded(k, gather),
        _to_padded(v, gather), _scatter_padded(out, flat, B, S, 0.0),
        _scatter_padded(lse.t(), flat, B, S, float("inf")),
        0.0, causal, attn_mask=mask, scale=softmax_scale,
    )
    # dK/dV of padding slots are exactly zero, and every real row has one slot: the
    # packed gradient is the gather at ``flat``.
    return _to_packed(dq, flat), _to_packed(dk, flat), _to_packed(dv, flat)


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("dapo::varlen_attention_fwd", mutates_args=())
def _varlen_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
    max_seqlen: int, causal: bool, softmax_scale: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, Hq, D], lse float32 [Hq, T])`` on validated, contiguous inputs."""
    return dispatch("varlen_attention_fwd", q.device)(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale)


@_varlen_attention_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("dapo::varlen_attention_bwd", mutates_args=())
def _varlen_attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, causal: bool, softmax_scale: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``; grouped query heads' dK/dV are summed into their KV head."""
    return dispatch("varlen_attention_bwd", q.device)(
        dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale
    )


@_varlen_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fwd_setup(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.args = (max_seqlen, causal, softmax_scale)
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = _varlen_attention_bwd(dout.contiguous(), q, k, v, out, lse, cu_seqlens, *ctx.args)
    return dq, dk, dv, None, None, None, None


_varlen_attention_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


# --------------------------------------------------------------------------- public API
def _check_qkv(q, k, v) -> None:
    check_tensor("q", q, ndim=3, dtypes=_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=q.device)
    check_tensor("v", v, shape=list(k.shape), dtypes=(q.dtype,), device=q.device)
    T, Hq, D = q.shape
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k must have shape [T, Hkv, D] = [{T}, *, {D}] (T and D of q), got {list(k.shape)}")
    if k.shape[1] == 0 or Hq % k.shape[1] != 0:
        raise ValueError(f"the number of query heads ({Hq}) must be a multiple of the KV heads ({k.shape[1]})")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim D must be one of {SUPPORTED_HEAD_DIMS}, got {D}")


def _check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _check_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a finite positive number, got {softmax_scale}")
    return float(softmax_scale)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Attention inside each packed sequence (flash-attn ``flash_attn_varlen_func`` semantics).

    Args:
        q: ``[T, Hq, D]`` float16 / bfloat16 / float32.
        k, v: ``[T, Hkv, D]``, same dtype and device as ``q``; ``Hq % Hkv == 0`` (GQA/MQA:
            query head ``h`` uses KV head ``h // (Hq // Hkv)``).
        cu_seqlens: int32 (or int64) ``[B+1]``: 0, non-decreasing, last = ``T``. Empty and
            length-1 sequences are fine.
        max_seqlen: int, an upper bound on the longest sequence (flash-attn compatibility;
            neither backend needs it to be exact).
        causal: query ``i`` attends keys ``j <= i`` of its own sequence (default), else all
            keys of its sequence.
        softmax_scale: scale of ``q @ k^T``; default ``1 / sqrt(D)``.
        return_lse: also return the log-sum-exp (natural log) of the scaled scores.

    ``D`` must be one of ``SUPPORTED_HEAD_DIMS`` = (16, 32, 64, 96, 128, 256).

    Returns:
        ``out [T, Hq, D]`` in ``q``'s dtype; with ``return_lse``, ``(out, lse)`` with ``lse``
        float32 ``[Hq, T]`` (not differentiable).

    Raises:
        TypeError / ValueError naming the argument, before any work (see
        :mod:`dapo_kernels._validation`). Validating ``cu_seqlens`` costs one host sync.

    Differentiable for ``q``, ``k``, ``v``; the backward is deterministic.
    """
    _check_qkv(q, k, v)
    check_cu_seqlens(cu_seqlens, q.shape[0], device=q.device)
    max_seqlen = check_int("max_seqlen", max_seqlen, minimum=0)
    causal = _check_flag("causal", causal)
    return_lse = _check_flag("return_lse", return_lse)
    scale = _check_scale(softmax_scale, q.shape[2])
    out, lse = _varlen_attention_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens.to(torch.int32).contiguous(),
        max_seqlen, causal, scale,
    )
    return (out, lse) if return_lse else out
