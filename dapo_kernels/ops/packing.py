"""Remove-padding packing: ``unpad_input`` / ``pad_input`` / ``packed_position_ids``.

Drop-in for flash-attn's ``bert_padding`` (>= 2.7 return convention). Both directions
move whole rows of ``F = prod(x.shape[2:])`` elements through one row-map kernel:

* unpad: ``out[i] = x[indices[i]]`` for ``i < nnz``;
* pad:   ``out[p] = x_unpad[inv[p]]`` where ``inv[p] >= 0`` and zero elsewhere, so the
  padded output is written exactly once (no separate zero fill).

Index metadata (``cu_seqlens``, ``indices``, ``seqused``) is built on the device with
``cumsum`` and ``searchsorted``, never ``nonzero()``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .._alloc import cpu_bulk_output, empty_output
from .._cache import per_tensor_cache
from .._registry import dispatch, register
from .._validation import check_int, check_mask, check_tensor, cu_seqlens_boundaries, tracing
from ._triton_utils import cdiv, next_pow2

# Elements per program: a [rows, BLOCK_F] tile of 8192 (32 per thread over 8 warps: 64 registers
# for float64, no spills on sm_80 / sm_90), so narrow rows come many to a program (up to 128
# rows at F <= 64) and one launch of few programs moves a whole batch; wide rows >= 4 per program.
_TILE_ELEMS = 8192
_NUM_WARPS = 8
# Widest feature tile: 2048 elements = 4-16 KiB per row per program, long vectorised
# loads; wider rows are split over the grid's second axis.
_MAX_BLOCK_F = 2048


# --------------------------------------------------------------------------- kernels
@triton.jit
def _pack_rows_fwd_kernel(
    p_src,
    p_dst,
    p_row_map,
    n_dst_rows,
    n_feat,
    PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """dst[r, :] = src[row_map[r], :]; with PAD, rows whose row_map is -1 become zeros."""
    i_r = tl.program_id(0)
    i_f = tl.program_id(1)
    o_r = i_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    o_f = i_f.to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F).to(tl.int64)
    m_r = o_r < n_dst_rows
    m_f = o_f < n_feat
    b_src_row = tl.load(p_row_map + o_r, mask=m_r, other=-1).to(tl.int64)
    if PAD:
        m_load = m_r & (b_src_row >= 0)
    else:
        m_load = m_r
    b_x = tl.load(
        p_src + b_src_row[:, None] * n_feat + o_f[None, :],
        mask=m_load[:, None] & m_f[None, :],
        other=0,
    )
    tl.store(p_dst + o_r[:, None] * n_feat + o_f[None, :], b_x, mask=m_r[:, None] & m_f[None, :])


# --------------------------------------------------------------------------- launchers
def _as_storable(t: torch.Tensor) -> torch.Tensor:
    # bool has no Triton pointer type of its own here; move it as bytes.
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _launch_pack_rows(src: torch.Tensor, row_map: torch.Tensor, n_dst_rows: int, pad: bool) -> torch.Tensor:
    # The kernel addresses both as dense: row r of src at r * n_feat, entry r of row_map at r.
    src, row_map = src.contiguous(), row_map.contiguous()
    n_feat = src.shape[1]
    dst = empty_output((n_dst_rows, n_feat), dtype=src.dtype, device=src.device)
    if n_dst_rows == 0 or n_feat == 0:
        return dst
    block_f = min(next_pow2(n_feat), _MAX_BLOCK_F)
    block_r = _TILE_ELEMS // block_f
    grid = (cdiv(n_dst_rows, block_r), cdiv(n_feat, block_f))
    _pack_rows_fwd_kernel[grid](
        _as_storable(src), _as_storable(dst), row_map, n_dst_rows, n_feat,
        PAD=pad, BLOCK_R=block_r, BLOCK_F=block_f, num_warps=_NUM_WARPS,
    )
    return dst


def _inverse_row_map(indices: torch.Tensor, num_rows: int) -> torch.Tensor:
    """inv[p] = i where indices[i] == p, else -1."""
    inv = torch.full((num_rows,), -1, dtype=torch.int64, device=indices.device)
    inv.scatter_(0, indices, torch.arange(indices.numel(), device=indices.device))
    return inv


@register("index_rows", "triton")
def _index_rows_triton(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return _launch_pack_rows(x, indices, indices.numel(), pad=False)


@register("index_rows", "torch")
def _index_rows_torch(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cpu":
        return x.index_select(0, indices)
    out = cpu_bulk_output((indices.shape[0], x.shape[1]), dtype=x.dtype)
    return torch.index_select(x, 0, indices, out=out)


@register("scatter_rows", "triton")
def _scatter_rows_triton(x: torch.Tensor, indices: torch.Tensor, num_rows: int) -> torch.Tensor:
    return _launch_pack_rows(x, _inverse_row_map(indices, num_rows), num_rows, pad=True)


def _first_position_reaching(count: torch.Tensor, n: int) -> torch.Tensor:
    """positions p_i = min{p : count[p] >= i + 1} for i < n, given a running count (int64 [n])."""
    targets = torch.arange(1, n + 1, device=count.device, dtype=count.dtype)
    return torch.searchsorted(count, targets)


@register("scatter_rows", "torch")
def _scatter_rows_torch(x: torch.Tensor, indices: torch.Tensor, num_rows: int) -> torch.Tensor:
    # Zero fill + index_copy_: faster than index_put_, a zero-row gather, or copy + index_fill_ of
    # the complement (benchmarks/bench_packing.py); on the CPU a fresh huge-page mapping is already zero.
    if x.device.type != "cpu":
        return x.new_zeros((num_rows, x.shape[1])).index_copy_(0, indices, x)
    return cpu_bulk_output((num_rows, x.shape[1]), dtype=x.dtype, zeroed=True).index_copy_(0, indices, x)


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("dapo::index_rows", mutates_args=())
def index_rows(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``x[indices]`` for 2-D ``x [R, F]`` and int64 ``indices [n]`` (the unpad direction)."""
    return dispatch("index_rows", x.device)(x, indices)


@index_rows.register_fake
def _(x, indices):
    return x.new_empty((indices.shape[0], x.shape[1]))


@torch.library.custom_op("dapo::scatter_rows", mutates_args=())
def scatter_rows(x: torch.Tensor, indices: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``out = zeros(num_rows, F); out[indices] = x`` for ``x [n, F]`` (the pad direction)."""
    return dispatch("scatter_rows", x.device)(x, indices, num_rows)


@scatter_rows.register_fake
def _(x, indices, num_rows):
    return x.new_empty((num_rows, x.shape[1]))


def _index_rows_setup(ctx, inputs, output):
    x, indices = inputs
    ctx.save_for_backward(indices)
    ctx.num_rows = x.shape[0]


def _index_rows_backward(ctx, grad):
    (indices,) = ctx.saved_tensors
    return scatter_rows(grad.contiguous(), indices, ctx.num_rows), None


def _scatter_rows_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _scatter_rows_backward(ctx, grad):
    (indices,) = ctx.saved_tensors
    return index_rows(grad.contiguous(), indices), None, None


index_rows.register_autograd(_index_rows_backward, setup_context=_index_rows_setup)
scatter_rows.register_autograd(_scatter_rows_backward, setup_context=_scatter_rows_setup)


@torch.library.custom_op("dapo::packed_position_ids", mutates_args=())
def _packed_position_ids_op(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    return dispatch("packed_position_ids", cu_seqlens.device)(cu_seqlens, total_tokens)


@_packed_position_ids_op.register_fake
def _(cu_seqlens, total_tokens):
    return cu_seqlens.new_empty((total_tokens,), dtype=torch.int64)


@register("packed_position_ids", "torch")
def _packed_position_ids_torch(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    cu = cu_seqlens.long()
    starts = cu[:-1]
    lengths = cu[1:] - starts
    # output_size avoids the host sync repeat_interleave would need to size its output.
    seq_start = torch.repeat_interleave(starts, lengths, output_size=total_tokens)
    return torch.arange(total_tokens, device=cu.device) - seq_start


# --------------------------------------------------------------------------- public API
def _check_mask(name: str, mask, x: torch.Tensor) -> torch.Tensor:
    check_tensor(name, mask, ndim=2)
    if tuple(mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"{name} must have shape [B, S] = {list(x.shape[:2])} (x.shape[:2]), got {list(mask.shape)}")
    return check_mask(name, mask, device=x.device)


def unpad_input(
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor,
    unused_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Remove padding: gather the tokens selected by ``attention_mask`` into one packed stream.

    Args:
        hidden_states: ``[B, S, *]``, any dtype (floats, and integer ids such as
            ``input_ids.unsqueeze(-1)``).
        attention_mask: ``[B, S]`` bool, integer (nonzero = token) or float 0 / 1 (other values
            rejected on the device); any pattern (right or left padding, holes, empty rows).
        unused_mask: optional ``[B, S]``, tokens that are allocated but not attended to
            (flash-attn's meaning): packed and counted in ``cu_seqlens`` but not in ``seqused``.

    Returns (as flash-attn >= 2.7):
        ``x_unpad [nnz, *]`` tokens in row-major order of the mask,
        ``indices`` int64 ``[nnz]`` flat positions in ``B*S``,
        ``cu_seqlens`` int32 ``[B+1]``, ``max_seqlen`` Python int,
        ``seqused`` int32 ``[B]`` (tokens per row that ``attention_mask`` selects).

    NaN / inf are copied like any value: only those at positions the masks select reach ``x_unpad``.
    Host synchronisation: exactly one, reading ``(nnz, max_seqlen)`` together; ``nnz``
    sizes the output and ``max_seqlen`` is returned as a Python int. ``cu_seqlens`` and
    ``indices`` are built on the device by cumsum + searchsorted (no ``nonzero()``).
    Differentiable w.r.t. ``hidden_states``; the backward is :func:`pad_input`.
    """
    check_tensor("hidden_states", hidden_states)
    if hidden_states.dim() < 2:
        raise ValueError(f"hidden_states must be [B, S, *] (at least 2-D), got shape {tuple(hidden_states.shape)}")
    mask = _check_mask("attention_mask", attention_mask, hidden_states)
    all_mask = mask
    if unused_mask is not None:
        all_mask = mask | _check_mask("unused_mask", unused_mask, hidden_states)
    B, S = mask.shape
    seqused = mask.sum(dim=1, dtype=torch.int32)
    seqlens = all_mask.sum(dim=1, dtype=torch.int32) if unused_mask is not None else seqused
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = all_mask.reshape(-1)
    count = torch.cumsum(flat, dim=0)  # tokens up to and including each position
    max_len = seqlens.max() if B > 0 else seqlens.new_zeros(())
    # First and last selected positions ride along in the same transfer: the exact range of
    # ``indices``, so that pad_input can check them later without reading them.
    if flat.numel():
        first, last = flat.int().argmax(), flat.numel() - 1 - flat.flip(0).int().argmax()
        head = [count[-1], first.to(count.dtype), last.to(count.dtype)]
    else:
        head = [count.new_zeros(())] * 3
    # The i-th token sits at the first position whose running count reaches i+1: computed for
    # every possible i before the read, so that after it (the GPU idles until the host has nnz)
    # only the gather kernel launches; the first nnz entries are a view.
    indices = _first_position_reaching(count, flat.numel())
    nnz, lo, hi, max_seqlen = torch.stack(head + [max_len.to(count.dtype)]).tolist()
    if tracing():  # torch.compile: nnz and max_seqlen are unbacked sizes (what unpad guarantees of them)
        torch._check(nnz >= 0)
        torch._check(nnz <= B * S)
        torch._check(max_seqlen >= 0)
    indices = indices[:nnz]
    feat_shape = hidden_states.shape[2:]
    # Explicit widths: reshape(-1) is ambiguous for empty tensors and new_empty would cut the graph.
    x2d = hidden_states.reshape(B * S, feat_shape.numel())
    x_unpad = index_rows(x2d, indices).reshape((nnz,) + tuple(feat_shape))
    # Valid by construction: checking them again (pad_input, a packed model's layers) reads nothing.
    if not tracing() and nnz:
        _index_stats.prime(indices, B * S, value=(lo, hi, nnz))
    cu_seqlens_boundaries.prime(cu_seqlens, value=(0, nnz, 0))
    return x_unpad, indices, cu_seqlens, int(max_seqlen), seqused


@per_tensor_cache  # indices from unpad_input are primed there: checking them reads nothing
def _index_stats(indices: torch.Tensor, num_rows: int) -> tuple:
    """(min, max, distinct positions) of non-empty ``indices``, in one read. Distinct positions =
    positions marked (clamped: an out-of-range index is reported by the range). Duplicates have no
    defined result: flash-attn's ``output[indices] = values`` leaves the winner to the scatter, and
    its gather backward would give every duplicate the gradient."""
    marked = torch.zeros(num_rows, dtype=torch.bool, device=indices.device)
    marked[indices.clamp(0, num_rows - 1)] = True
    return tuple(torch.stack([*torch.aminmax(indices), marked.sum()]).tolist())


def check_indices(indices: torch.Tensor, num_rows: int, *, distinct: bool, bound: str = "") -> None:
    """Non-empty ``indices`` lie in ``[0, num_rows)`` (and are ``distinct``): one read per tensor
    (:func:`_index_stats`), on the device under ``torch.compile`` (``RuntimeError``). ``bound``
    names ``num_rows`` in the message."""
    if tracing():
        torch._assert_async(((indices >= 0) & (indices < num_rows)).all(),
                            "indices must lie in [0, number of rows) (checked on the device)")
        if distinct:
            marked = torch.zeros(num_rows, dtype=torch.bool, device=indices.device)
            marked[indices.clamp(0, max(num_rows - 1, 0))] = True
            torch._assert_async(marked.sum() == indices.numel(),
                                "indices must be distinct positions (checked on the device)")
        return
    lo, hi, marked = _index_stats(indices, num_rows)
    if lo < 0 or hi >= num_rows:
        named = f"{bound}) = [0, " if bound else ""
        raise ValueError(f"indices must lie in [0, {named}{num_rows}), got range [{lo}, {hi}]")
    if distinct and marked != indices.numel():
        raise ValueError(f"indices must be distinct positions, got {indices.numel() - marked} repeated among "
                         f"{indices.numel()}")


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of :func:`unpad_input`: scatter packed tokens back to ``[batch, seqlen, *]``.

    Args:
        hidden_states: ``[nnz, *]`` packed tokens, any dtype.
        indices: int64 (or int32) ``[nnz]``, distinct flat positions in ``[0, batch*seqlen)``,
            as returned by :func:`unpad_input`.
        batch, seqlen: the padded shape.

    Returns ``[batch, seqlen, *]`` with zeros at positions not in ``indices``; NaN / inf are copied
    like any value.
    Host synchronisation: one, for the range and distinctness check of ``indices`` (a repeated
    position is a ``ValueError``), unless they are those :func:`unpad_input` returned for this
    ``batch * seqlen`` (valid by construction: none).
    Differentiable w.r.t. ``hidden_states``; the backward is a gather (:func:`unpad_input`'s op).
    """
    check_tensor("hidden_states", hidden_states)
    if hidden_states.dim() < 1:
        raise ValueError("hidden_states must be [nnz, *] (at least 1-D), got a 0-d tensor")
    batch = check_int("batch", batch, minimum=0)
    seqlen = check_int("seqlen", seqlen, minimum=0)
    check_tensor("indices", indices, ndim=1, dtypes=(torch.int64, torch.int32), device=hidden_states.device)
    nnz = hidden_states.shape[0]
    if indices.shape[0] != nnz:
        raise ValueError(f"indices must have length nnz = hidden_states.shape[0] = {nnz}, got {indices.shape[0]}")
    num_rows = batch * seqlen
    if tracing():  # nnz may be unbacked (unpad_input's): a runtime assert, where it is not known statically
        torch._check(nnz <= num_rows, lambda: "hidden_states has more tokens than batch*seqlen")
        check_indices(indices, num_rows, distinct=True, bound="batch*seqlen")
    elif nnz > num_rows:
        raise ValueError(f"hidden_states has {nnz} tokens, more than batch*seqlen = {num_rows}")
    elif nnz:
        check_indices(indices, num_rows, distinct=True, bound="batch*seqlen")
    feat_shape = hidden_states.shape[1:]
    x2d = hidden_states.reshape(nnz, feat_shape.numel())
    out = scatter_rows(x2d, indices.long(), num_rows)
    return out.reshape((batch, seqlen) + tuple(feat_shape))


def packed_position_ids(cu_seqlens: torch.Tensor, total_tokens: Optional[int] = None) -> torch.Tensor:
    """Position of each packed token inside its sequence: ``0..L_i-1`` per sequence, int64 ``[T]``.

    Args:
        cu_seqlens: int32/int64 ``[B+1]`` cumulative lengths starting at 0.
        total_tokens: ``T`` (= ``cu_seqlens[-1]``); pass it to avoid the host sync that
            reading it would cost. ``cu_seqlens`` is validated against it (one sync).
    """
    from .._validation import check_cu_seqlens

    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int32, torch.int64))
    if total_tokens is None:
        total_tokens = int(cu_seqlens[-1]) if cu_seqlens.numel() else 0
        if tracing():
            torch._check(total_tokens >= 0)
    total_tokens = check_int("total_tokens", total_tokens, minimum=0)
    check_cu_seqlens(cu_seqlens, total_tokens)
    return _packed_position_ids_op(cu_seqlens, total_tokens)
