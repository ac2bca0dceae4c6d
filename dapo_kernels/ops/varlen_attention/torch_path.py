"""The ``torch`` (CPU) path of ``varlen_attention``: length buckets through torch's fused CPU flash kernel.

Sequences are bucketed by length (within 1.5x), each bucket gathered into a padded ``[n, S]``
view with one index tensor and run through ``aten._scaled_dot_product_flash_attention_for_cpu``
and its backward, which take grouped KV heads natively. The loop is over the few buckets, not
over sequences (timings against a per-sequence loop and one padded call: NOTES.md). The lse is in
natural log units, the unit these kernels produce and consume. The backward of 16-bit inputs runs
in float32 (see :func:`_bwd_torch`).

A sliding window or soft-capping (which torch's fused kernel does not have), and the backward of fp32
inputs (whose dQ torch's fused backward rounds poorly), take the same buckets through plain softmax
attention instead, in fp32 as plain torch computes it (per-head 3-D products, head-major ``[H * n, S,
D]`` copies), query rows in chunks so the score tile stays bounded (:func:`_fwd_math` / :func:`_bwd_math`).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..._alloc import empty_output
from ..._cache import per_tensor_cache
from ..._registry import register
from .lse import lse_dtype

# Sequences whose lengths differ by less than this factor share one padded SDPA call
# (padding costs at most this factor in length; fewer, bigger calls).
_BUCKET_RATIO = 1.5
_LOW_PRECISION = (torch.float16, torch.bfloat16)
# Score elements per chunk of the math path (64 MiB of fp32 scores).
_MATH_CHUNK = 1 << 24
# Compute dtype of the math path, whatever the inputs' (16-bit inputs on fp32 copies, rounded once on the
# way out): fp32 in plain torch's per-head 3-D products is plain torch's own error (NOTES.md, "Torch path").
_MATH_DTYPE = torch.float32


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


def _math_chunks(valid: torch.Tensor, heads: int):
    """Query-row slices of a bucket whose score tile ``[heads * n, rows, S]`` stays under _MATH_CHUNK."""
    n, S = valid.shape
    step = max(1, _MATH_CHUNK // max(n * heads * S, 1))
    return [slice(r, min(r + step, S)) for r in range(0, S, step)]


def _heads_major(x: torch.Tensor, gather: torch.Tensor, dtype: torch.dtype, heads: Optional[int] = None,
                 valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Packed ``[T, H, D]`` -> ``[heads * n, S, D]`` (head-major, contiguous, in ``dtype``): per head the
    bucket's padded sequences, each head repeated ``heads // H`` times (a KV head for its query heads, as
    plain torch's ``repeat_interleave``); with ``valid``, padding slots are 0. NaN / inf read as 0 (see
    :func:`_padded`)."""
    H, D = x.shape[1], x.shape[2]
    heads = heads or H
    p = x.transpose(0, 1)[:, gather].to(dtype).nan_to_num_(0.0, 0.0, 0.0)  # [H, n, S, D]
    if valid is not None:
        p.masked_fill_(~valid[None, :, :, None], 0.0)
    if heads != H:
        p = p[:, None].expand(H, heads // H, *p.shape[1:])
    return p.reshape(heads * gather.shape[0], gather.shape[1], D)


def _unpad_heads_into(dst: torch.Tensor, src: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """dst[rows] = head-major padded ``src [H * n, S, ...]`` at the valid slots (``dst [T, H, ...]``)."""
    H = dst.shape[1]
    dst.transpose(0, 1)[:, rows] = src.reshape(H, -1, *dst.shape[2:])[:, slots].to(dst.dtype)


def _math_scores(q, k, valid, rows: slice, scale, window, softcap):
    """(scores, tanh term) ``[Hq * n, rows, S]`` of query rows ``rows`` of a bucket (head-major ``q`` / ``k``
    of :func:`_heads_major`), masked (padding keys, window) to -inf. Per-head 3-D products in plain torch's
    order, ``(q @ k^T) * scale`` then ``softcap * tanh(s / softcap)``: the CPU BLAS's fp32 rounding depends
    on the product's shape and layout (NOTES.md, "Torch path")."""
    n, S = valid.shape
    s = torch.bmm(q[:, rows], k.transpose(1, 2)).mul_(scale)
    if softcap:
        t = torch.tanh(s / softcap)
        s = t * softcap
    else:
        t = None
    left, right = window
    i = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
    j = torch.arange(S, device=q.device)[None, :]
    seen = (j >= i - left) & (j <= i + right) & valid[:, None, :]  # [n, rows, S]
    s.view(-1, n, *s.shape[1:]).masked_fill_(~seen, float("-inf"))
    return s, t


def _math_softmax(s: torch.Tensor) -> torch.Tensor:
    """Softmax over keys, 0 (not NaN) in padding rows that see no key. Normalised by the row sum as
    torch's softmax is, not exp(s - lse): an fp32 lse ~10 would add ~10 ulp to every probability."""
    return torch.softmax(s, -1).nan_to_num_(0.0)


def _window(S: int, causal: bool, window_left: int, window_right: int):
    """(left, right) within a bucket of length S; unbounded sides (-1) as S, causal right = 0."""
    return (S if window_left < 0 else window_left), (0 if causal else (S if window_right < 0 else window_right))


def _fwd_math(q, k, v, gather, valid, causal, scale, window_left, window_right, softcap):
    """Softmax attention of one bucket in ``_MATH_DTYPE``: head-major (out [Hq * n, S, D],
    lse [Hq * n, S])."""
    Hq, dtype = q.shape[1], _MATH_DTYPE
    qh = _heads_major(q, gather, dtype)
    kh, vh = (_heads_major(t, gather, dtype, Hq) for t in (k, v))
    window = _window(valid.shape[1], causal, window_left, window_right)
    outs, lses = [], []
    for rows in _math_chunks(valid, Hq):
        s, _ = _math_scores(qh, kh, valid, rows, scale, window, softcap)
        outs.append(torch.bmm(_math_softmax(s), vh))
        lses.append(torch.logsumexp(s, -1))
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, 1), torch.cat(lses, 1)


def _bwd_math(dout, q, k, v, gather, valid, causal, scale, window_left, window_right, softcap, dtype):
    """Gradients of one bucket in ``dtype``, head-major (dq [Hq * n, S, D], dk / dv [Hkv * n, S, D]), the
    probabilities recomputed. Plain torch's backward, op for op: dS = torch's softmax backward
    (P * (dP - rowsum(P * dP)); rowsum(dO * O) would carry O's rounding), tanh's backward under soft-capping,
    times the scale, per-head 3-D products, a KV group's dK / dV summed over its query heads last. Padding
    rows have dO = 0."""
    Hq, Hkv = q.shape[1], k.shape[1]
    qh = _heads_major(q, gather, dtype)
    doh = _heads_major(dout, gather, dtype, valid=valid)
    kh, vh = (_heads_major(t, gather, dtype, Hq) for t in (k, v))
    window = _window(valid.shape[1], causal, window_left, window_right)
    dqs, dk, dv = [], None, None
    for rows in _math_chunks(valid, Hq):
        s, t = _math_scores(qh, kh, valid, rows, scale, window, softcap)
        p = _math_softmax(s)
        ds = torch._softmax_backward_data(torch.bmm(doh[:, rows], vh.transpose(1, 2)), p, -1, p.dtype)
        if t is not None:
            ds = torch.ops.aten.tanh_backward(ds, t)
        ds.mul_(scale)
        dqs.append(torch.bmm(ds, kh))
        if dk is None:
            dk, dv = torch.bmm(ds.transpose(1, 2), qh[:, rows]), torch.bmm(p.transpose(1, 2), doh[:, rows])
        else:
            dk.baddbmm_(ds.transpose(1, 2), qh[:, rows])
            dv.baddbmm_(p.transpose(1, 2), doh[:, rows])
    if Hq != Hkv:
        n, S, D = *valid.shape, q.shape[2]
        dk, dv = (g.view(Hkv, Hq // Hkv, n * S * D).sum(1) for g in (dk, dv))
    return (dqs[0] if len(dqs) == 1 else torch.cat(dqs, 1)), dk, dv


def _plain(window_left: int, window_right: int, softcap: float, causal: bool) -> bool:
    """No window and no soft-capping: torch's fused kernel serves."""
    return window_left < 0 and (causal or window_right < 0) and not softcap


@register("varlen_attention_fwd", "torch")
def _fwd_torch(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, window_left=-1, window_right=-1,
               softcap=0.0):
    T, Hq, _ = q.shape
    out = empty_output(q.shape, dtype=q.dtype, device=q.device)
    # Natural-log lse, the unit torch's CPU kernels produce and consume: converting would add
    # an fp32 rounding of a value ~10 to every probability the backward recomputes.
    lse_nat = empty_output((T, Hq), dtype=lse_dtype(q.dtype), device=q.device)
    plain = _plain(window_left, window_right, softcap, causal)
    for gather, valid, rows, slots in _length_buckets(cu_seqlens, T):
        if plain:
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                _padded(q, gather), _padded(k, gather), _padded(v, gather), 0.0, causal,
                attn_mask=None if causal else _key_padding_mask(valid, q.dtype), scale=softmax_scale,
            )
            _unpad_into(out, o, rows, slots)
            _unpad_into(lse_nat, lse, rows, slots)
        else:
            o, lse = _fwd_math(q, k, v, gather, valid, causal, softmax_scale, window_left, window_right, softcap)
            _unpad_heads_into(out, o, rows, slots)
            _unpad_heads_into(lse_nat, lse, rows, slots)
    return out, lse_nat.t().contiguous()


@register("varlen_attention_bwd", "torch")
def _bwd_torch(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale, window_left=-1,
               window_right=-1, softcap=0.0, deterministic=True):
    # ``deterministic`` selects the Triton backward's dQ path; torch's CPU kernels have one.
    T = q.shape[0]
    grads = [empty_output(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)]
    lse_nat = lse.t()  # (float32: only 16-bit inputs' backward reads it)
    # fp32 inputs take the math path: torch's CPU flash backward gave their dQ up to 3.5x plain fp32
    # torch's error (NOTES.md, "Torch path"); only 16-bit inputs (on fp32 copies) use it.
    fused = _plain(window_left, window_right, softcap, causal) and q.dtype in _LOW_PRECISION
    if fused:
        # torch's CPU flash backward loses precision on 16-bit inputs (and sums a KV group's dK/dV in
        # 16 bits), beyond flash-attn's 3x rule; on fp32 copies each gradient is rounded once, in
        # _unpad_into, and it runs faster (NOTES.md, "Torch path").
        dout, q, k, v, out = (t.float() for t in (dout, q, k, v, out))
    for gather, valid, rows, slots in _length_buckets(cu_seqlens, T):
        if fused:
            # Padding rows get dO = 0 and lse = +inf, so their probabilities are exactly 0 and
            # they add nothing to dK/dV; padding slots' own gradients are dropped.
            bucket_grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                _padded(dout, gather, valid), _padded(q, gather), _padded(k, gather), _padded(v, gather),
                _padded(out, gather, valid), _padded(lse_nat, gather, valid, float("inf")), 0.0, causal,
                attn_mask=None if causal else _key_padding_mask(valid, q.dtype), scale=softmax_scale,
            )
            for dst, src in zip(grads, bucket_grads):
                _unpad_into(dst, src, rows, slots)
        else:
            bucket_grads = _bwd_math(dout, q, k, v, gather, valid, causal, softmax_scale, window_left, window_right,
                                     softcap, _MATH_DTYPE)
            for dst, src in zip(grads, bucket_grads):
                _unpad_heads_into(dst, src, rows, slots)
    return tuple(grads)
