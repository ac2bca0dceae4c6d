"""The custom ops ``dapo::varlen_attention_fwd`` / ``_bwd``: dispatch to the device's backend, the NaN
marks, fake (meta) kernels and autograd. Inputs arrive validated and contiguous (the public function)."""
from __future__ import annotations

from typing import Tuple

import torch

from ..._registry import backend_kernel_serves, current_backend, dispatch, use_backend
from . import launch, torch_path  # noqa: F401  (register the triton and torch backends)
from .lse import lse_dtype
from .nan import mark_rows_nan_, poisoned_grads, poisoned_queries


@torch.library.custom_op("dapo::varlen_attention_fwd", mutates_args=())
def _varlen_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
    max_seqlen: int, causal: bool, softmax_scale: float, window_left: int = -1, window_right: int = -1,
    softcap: float = 0.0, deterministic: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, Hq, D], lse [Hq, T])`` on validated, contiguous inputs; ``lse`` is float64 for
    float32 inputs, else float32 (:mod:`.lse`; an out-of-tree kernel's is float32).

    ``lse`` is in the unit of the kernel that ran, the one its backward recomputes
    probabilities in, so it is rounded exactly once: base 2 (``lse / ln 2``) for
    Triton, natural log for the torch path (torch's CPU kernels) and for out-of-tree kernels
    (e.g. npu_ops, which run whatever backend is forced). The public function converts to
    natural log; autograd runs the backward on the forward's backend, with ``deterministic``
    (which the forward does not use).

    NaN in, NaN out, whatever the backend's block sizes: the rows of ``out`` and ``lse`` of a
    query whose ``q``, or the ``k`` / ``v`` of a key it attends, hold a NaN or inf are NaN, and
    no other (the backends read such values as 0 where a query does not attend them).

    ``window_left`` / ``window_right`` (-1: unbounded) and ``softcap`` (0: none) as flash-attn's."""
    window = (window_left, window_right)
    out, lse = dispatch("varlen_attention_fwd", q.device)(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale,
                                                          *window, softcap)
    triton = current_backend(q.device) == "triton"  # the marks by Triton kernels there: one read per input
    poisoned = poisoned_queries(q, k, v, cu_seqlens, causal, *window, triton)
    return mark_rows_nan_(out, poisoned, triton), lse.masked_fill_(poisoned.t(), float("nan"))


@_varlen_attention_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0,
      deterministic=True):
    # An out-of-tree kernel (registered on the device's key, bypassing this op's body) returns float32.
    out_of_tree = backend_kernel_serves("dapo::varlen_attention_fwd", q.device)
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]),
                                            dtype=torch.float32 if out_of_tree else lse_dtype(q.dtype))


@torch.library.custom_op("dapo::varlen_attention_bwd", mutates_args=())
def _varlen_attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, causal: bool, softmax_scale: float,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0, deterministic: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``; grouped query heads' dK/dV are summed into their KV head.
    ``deterministic=False`` lets the Triton backend add dQ with fp32 atomics (faster, last bits
    vary between runs); the torch path is deterministic either way.

    A query whose ``lse`` is NaN (the forward's mark of a non-finite input it depends on) or whose
    ``dout`` holds a NaN or inf gets NaN ``dq``, and the keys it attends NaN ``dk`` / ``dv``; nothing
    else does (the backends read non-finite values as 0 where they are not attended)."""
    window = (window_left, window_right)
    dq, dk, dv = dispatch("varlen_attention_bwd", q.device)(
        dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale, *window, softcap, deterministic
    )
    triton = current_backend(q.device) == "triton"
    bad, keys = poisoned_grads(dout, lse, k.shape[1], cu_seqlens, causal, *window, triton)
    return mark_rows_nan_(dq, bad, triton), mark_rows_nan_(dk, keys, triton), mark_rows_nan_(dv, keys, triton)


@_varlen_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale, window_left=-1, window_right=-1,
      softcap=0.0, deterministic=True):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fwd_setup(ctx, inputs, output):
    q, k, v, cu_seqlens, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.args = tuple(args)
    ctx.backend = current_backend(q.device)  # lse's unit depends on it
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    with use_backend(ctx.backend):
        dq, dk, dv = _varlen_attention_bwd(dout.contiguous(), q, k, v, out, lse, cu_seqlens, *ctx.args)
    return (dq, dk, dv) + (None,) * (1 + len(ctx.args))


_varlen_attention_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)
