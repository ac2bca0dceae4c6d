"""The ``torch`` (CPU) path of ``varlen_attention``: length buckets through torch's fused CPU flash kernel.

Sequences are bucketed by length (within 1.5x), each bucket gathered into a padded ``[n, S]``
view with one index tensor and run through ``aten._scaled_dot_product_flash_attention_for_cpu``
and its backward, which take grouped KV heads natively. The loop is over the few buckets, not
over sequences; on a 12-sequence 16..768-token mix it matched a per-sequence SDPA loop and ran
3-4x faster than one padded call (benchmarks/bench_varlen_attention.py). The lse is in natural
log units, the unit these kernels produce and consume. The backward of 16-bit inputs runs in
float32 (see :func:`_bwd_torch`).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .._alloc import empty_output
from .._cache import per_tensor_cache
from .._registry import register

# Sequences whose lengths differ by less than this factor share one padded SDPA call
# (padding costs at most this factor in length; fewer, bigger calls).
_BUCKET_RATIO = 1.5
_LOW_PRECISION = (torch.float16, torch.bfloat16)


@per_tensor_cache  # once per batch, not per layer
def _length_buckets(cu_seqlens: torch.Tensor, total_tokens: int) -> list:
    """Group sequences of similar length into padded ``[n, S]`` views of the packed stream.

    Returns ``[(gather [n, S] int64, valid [n, S] bool, rows, slots)]``: slot ``(i, p)`` reads packed
    row ``gather[i, p]`` (clamped for padding slots, whose results are dropped); ``slots`` are the
    flat indices of the valid slots and ``rows`` their packed rows (integer indices: writing back
    through a boolean mask would read it to the host in every layer). Sequences are
    bucketed by ``ceil(log_BUCKET_RATIO(L))``, so a bucket pads at most ``BUCKET_RATIO``x
    in length; the loop runs over the few buckets, not over sequences. Empty sequences own
    no rows and are skipped.
    """
    cu = cu_seqlens.long()
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    bucket = torch.ceil(torch.log(lengths.double()) / math.log(_BUCKET_RATIO) - 1e-9).long()
    out = []
    for b in torch.unique(bucket).tolist():  # CPU path: reading it costs nothing
        sel = bucket == b
        st, ln = starts[sel], lengths[sel]
        pos = torch.arange(int(ln.max()), device=cu.device)
        gather, valid = (st[:, None] + pos[None, :]).clamp_(max=total_tokens - 1), pos[None, :] < ln[:, None]
        slots = valid.reshape(-1).nonzero()[:, 0]
        out.append((gather, valid, gather.reshape(-1)[slots], slots))
    return out


def _padded(x: torch.Tensor, gather: torch.Tensor, valid: Optional[torch.Tensor] = None, fill: float = 0.0):
    """Packed ``[T, H, ...]`` -> padded ``[n, H, S, ...]``; with ``valid``, padding slots = fill.

    NaN / inf read as 0: torch's kernels multiply masked keys (and padding slots, which hold the
    next sequence's rows) by a zero probability, and 0 * inf = NaN would reach queries that do not
    attend them; the op marks what does attend them NaN."""
    p = x[gather].nan_to_num_(0.0, 0.0, 0.0)
    if valid is not None:
        p = p.masked_fill(~valid.view(valid.shape + (1,) * (p.dim() - 2)), fill)
    return p.transpose(1, 2)


def _unpad_into(dst: torch.Tensor, src: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """dst[rows] = padded ``src [n, H, S, ...]`` at the valid slots."""
    dst[rows] = src.transpose(1, 2).flatten(0, 1)[slots].to(dst.dtype)


def _key_padding_mask(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive ``[n, 1, 1, S]`` mask hiding padding keys (non-causal only: with a causal
    mask a real query never sees a key past its own sequence's end)."""
    mask = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
    return mask.masked_fill_(~valid, float("-inf"))[:, None, None, :]


@register("varlen_attention_fwd", "torch")
def _fwd_torch(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale):
    T, Hq, _ = q.shape
    out = empty_output(q.shape, dtype=q.dtype, device=q.device)
    # Natural-log lse, the unit torch's CPU kernels produce and consume: converting would add
    # an fp32 rounding of a value ~10 to every probability the backward recomputes.
    lse_nat = empty_output((T, Hq), dtype=torch.float32, device=q.device)
    for gather, valid, rows, slots in _length_buckets(cu_seqlens, T):
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _padded(q, gather), _padded(k, gather), _padded(v, gather), 0.0, causal,
            attn_mask=None if causal else _key_padding_mask(valid, q.dtype), scale=softmax_scale,
        )
        _unpad_into(out, o, rows, slots)
        _unpad_into(lse_nat, lse, rows, slots)
    return out, lse_nat.t().contiguous()


@register("varlen_attention_bwd", "torch")
def _bwd_torch(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale, deterministic=True):
    # ``deterministic`` selects the Triton backward's dQ path; torch's CPU kernels have one.
    T = q.shape[0]
    grads = [empty_output(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)]
    lse_nat = lse.t()
    if q.dtype in _LOW_PRECISION:
        # torch's CPU flash backward loses precision on 16-bit inputs (and sums a KV group's
        # dK/dV in 16 bits): its errors reached 6x plain torch's in the same dtype (MHA as
        # well as GQA, worst with causal MQA), where flash-attn's rule allows 3x. On fp32
        # copies each gradient is rounded once, in _unpad_into (measured: <= 0.7x the rule's
        # bound), and it is faster: fwd+bwd of bench_varlen_attention.py's batch went from
        # 122 to 52 ms in bf16, 584 to 50 ms in fp16 (1 thread; fp32 itself 47 ms).
        dout, q, k, v, out = (t.float() for t in (dout, q, k, v, out))
    for gather, valid, rows, slots in _length_buckets(cu_seqlens, T):
        # Padding rows get dO = 0 and lse = +inf, so their probabilities are exactly 0 and
        # they add nothing to dK/dV; padding slots' own gradients are dropped.
        bucket_grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _padded(dout, gather, valid), _padded(q, gather), _padded(k, gather), _padded(v, gather),
            _padded(out, gather, valid), _padded(lse_nat, gather, valid, float("inf")), 0.0, causal,
            attn_mask=None if causal else _key_padding_mask(valid, q.dtype), scale=softmax_scale,
        )
        for dst, src in zip(grads, bucket_grads):
            _unpad_into(dst, src, rows, slots)
    return tuple(grads)
