"""Varlen (packed-sequence) flash attention: ``varlen_attention``, forward and backward, GQA.

Same meaning as flash-attn's ``flash_attn_varlen_func`` with ``cu_seqlens_q ==
cu_seqlens_k``: ``T`` packed tokens, sequence ``b`` owns rows
``cu_seqlens[b]:cu_seqlens[b+1]`` and attends only to itself; query head ``h`` reads
KV head ``h // (Hq // Hkv)``.

The package, one concern per module (imports go down this list, never up):

* this file: the public function and its validation;
* :mod:`.op`: the custom ops ``dapo::varlen_attention_fwd`` / ``_bwd`` (fake kernels, autograd);
* :mod:`.nan`: which output rows a non-finite input reaches (the ops mark them NaN);
* :mod:`.lse`: the dtype of the ops' lse (float64 for float32 inputs);
* :mod:`.torch_path`: the ``torch`` backend (CPU default): length buckets of padded views through
  torch's fused CPU flash kernel;
* :mod:`.launch`: the ``triton`` backend (CUDA default): launchers over work lists of (sequence,
  block) pairs built on the device, longest first;
* :mod:`.triton_kernels`: the flash-attention-2 style forward and the shared jit helpers;
* :mod:`.triton_bwd`: the backward kernels (delta, dK/dV with optional atomic dQ, dQ);
* :mod:`.tiles`: the GPU tile tables and the autotuner's pruning.

NOTES.md beside these files holds the measurements behind the numerics and tile choices.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from ..._registry import backend_kernel_serves, current_backend
from ..._validation import check_cu_seqlens, check_flag, check_float, check_int, check_tensor
from .op import _varlen_attention_fwd

__all__ = ["varlen_attention", "SUPPORTED_HEAD_DIMS"]

# Head dims: any multiple of 8 up to 256 (Llama 128, Phi 80, Gemma 256, ...). The kernels run the
# next power-of-two block (BLOCK_D >= 16, tl.dot's minimum) with the columns past D masked.
SUPPORTED_HEAD_DIMS = tuple(range(8, 257, 8))
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LN2 = 0.6931471805599453


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
        raise ValueError(f"head dim D must be a multiple of 8 in [8, 256], got {D}")


def _check_scale(softmax_scale, head_dim: int) -> float:
    scale = check_float("softmax_scale", softmax_scale, valid=lambda v: math.isfinite(v) and v > 0,
                        expected="a finite positive number", or_none=True)
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def _check_window(window_size) -> Tuple[int, int]:
    """flash-attn's ``window_size = (left, right)``: two ints, each -1 (unbounded) or >= 0."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair of ints, got {window_size!r}")
    left, right = (check_int(f"window_size[{i}]", w, minimum=-1) for i, w in enumerate(window_size))
    return left, right


def _check_softcap(softcap) -> float:
    return check_float("softcap", softcap, valid=lambda v: math.isfinite(v) and v >= 0,
                       expected="finite and >= 0 (0: no soft-capping)")


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
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
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
        return_lse: also return the log-sum-exp (natural log) of the scaled (and capped) scores.
        window_size: ``(left, right)`` sliding window (flash-attn's, Mistral / Qwen2 / Gemma 2):
            query ``i`` attends keys ``j`` of its sequence with ``i - left <= j <= i + right``;
            -1 = unbounded on that side; with ``causal`` the right side is 0 whatever is given.
        softcap: logit soft-capping (flash-attn's, Gemma 2): scores become
            ``softcap * tanh(softmax_scale * q.k / softcap)``; 0 = off.
        deterministic: flash-attn's flag, same default. ``False``: the Triton backward adds dQ
            with fp32 atomics inside the dK/dV kernel (5 matmuls per tile pair, not 7; where the
            GPU has no spill-free tile for that, the dQ kernel runs anyway); its last bits may
            differ between runs. ``True``: a separate dQ kernel, bitwise reproducible. The
            torch (CPU) path is deterministic either way.

    ``D`` must be a multiple of 8 up to 256 (``SUPPORTED_HEAD_DIMS``).

    Returns:
        ``out [T, Hq, D]`` in ``q``'s dtype; with ``return_lse``, ``(out, lse)`` with ``lse``
        float32 ``[Hq, T]`` (not differentiable).

    Raises:
        TypeError / ValueError naming the argument, before any work (see
        :mod:`dapo_kernels._validation`). Validating ``cu_seqlens`` costs one host sync.

    Differentiable for ``q``, ``k``, ``v``.

    NaN / inf: a query's ``out`` / ``lse`` / ``dq`` rows are NaN when its ``q``, or the ``k`` / ``v``
    of a key it attends (its sequence; causal: that key and the earlier ones), hold a NaN or inf,
    and so are the ``dk`` / ``dv`` rows of the keys such a query attends; nothing else changes
    (other sequences, earlier queries), on both backends, whatever their block sizes.
    """
    _check_qkv(q, k, v)
    check_cu_seqlens(cu_seqlens, q.shape[0], device=q.device)
    max_seqlen = check_int("max_seqlen", max_seqlen, minimum=0)
    causal = check_flag("causal", causal)
    return_lse = check_flag("return_lse", return_lse)
    scale = _check_scale(softmax_scale, q.shape[2])
    window = _check_window(window_size)
    softcap = _check_softcap(softcap)
    deterministic = check_flag("deterministic", deterministic)
    out, lse = _varlen_attention_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens.to(torch.int32).contiguous(),
        max_seqlen, causal, scale, *window, softcap, deterministic,
    )
    if not return_lse:
        return out
    # Base 2 only if the Triton kernel ran: an out-of-tree kernel (NPU) runs even when
    # triton is forced, and its lse is natural.
    triton_ran = current_backend(q.device) == "triton" and not backend_kernel_serves(
        "dapo::varlen_attention_fwd", q.device)
    return out, (lse * _LN2 if triton_ran else lse).float()
