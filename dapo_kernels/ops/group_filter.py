"""Group-reward filtering on the device: DAPO dynamic sampling, GRPO advantages.

(DAPO's overlong shaping is :mod:`dapo_kernels.ops.overlong_penalty`.)

``group_filter`` does in one device pass, without host synchronisation, what verl does
with Python loops over uid strings:

* DAPO's dynamic-sampling keep rule (recipe/dapo): a prompt group is kept when the
  population std (ddof 0) of its metric is > ``min_std`` (0 in DAPO) or it has a single
  member; empty groups are not kept.
* GRPO outcome advantages (verl ``compute_grpo_outcome_advantage``):
  ``(s - mean) / (std + epsilon)`` with the unbiased std, singletons use mean 0 and std 1,
  ``norm_adv_by_std=False`` gives ``s - mean``.

Statistics are accumulated in float64, two-pass (sum, then sum of squared deviations), of
each group's scores divided by a power of two near their largest magnitude (exact: ordinary
scores give the same numbers; scores near +-1e308 cannot overflow the sums), and "all
members equal" is decided exactly by comparing the group's min and max: such a group has
std exactly 0 and advantages exactly 0 (``np.std`` can return rounding noise such as
1.4e-17 for ``[0.1] * 3``, which makes verl keep a group with no signal).

Scores that are NaN/inf, and group indices outside ``[0, G)``, never enter a kept
group: they are counted in the device-side flags ``num_invalid`` / ``num_out_of_range``
of the result, their group (if any) is dropped, and ``res.check()`` raises on them.

Triton: ``group_size=n`` (contiguous groups) runs one kernel, each program reducing
whole groups in registers; arbitrary ``group_index`` runs three small kernels with
atomics (sums/min/max -> squared deviations -> per-element and per-group outputs).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .._alloc import empty_output
from .._registry import dispatch, register
from .._validation import FLOAT_DTYPES, check_flag, check_float, check_int, check_tensor
from ._triton_utils import cdiv, next_pow2

# Elements per program of the atomics kernels (4 warps): coalesced loads, few atomics in flight.
# Their launches give ptxas a register budget (maxnreg): the one it picks from the block size is
# below what the float64 math needs, so it spills; within 128 nothing spills (benchmarks/gpu/aot.py).
_BLOCK = 512
_MAX_REGS = 128
# Elements per program of the contiguous kernel's [groups, members] tile, over 16 warps: 4 float64
# values (plus int64 keys and per-group sums) per thread, the largest tile whose per-group vectors
# do not spill for narrow groups (many groups per tile; benchmarks/gpu/aot.py).
_TILE = 2048
_CONTIG_WARPS = 16
# Widest group the contiguous kernel reduces in one tile; wider groups use the atomics path.
_MAX_CONTIG_GROUP = 4096
# Initial min / max of the order-preserving int64 keys of float64 values (_float_key: flipping the
# 63 low bits of negatives makes signed integer order equal float order, so min/max use integer atomics).
_KEY_MAX = 2**63 - 1
_KEY_MIN = -(2**63)


# --------------------------------------------------------------------------- kernels
@triton.jit
def _float_key(b_x):
    """int64 key with key(a) < key(b) iff a < b (and -0.0 mapped to +0.0 first)."""
    b_x = tl.where(b_x == 0, 0.0, b_x)
    b_k = b_x.to(tl.int64, bitcast=True)
    return tl.where(b_k < 0, b_k ^ 0x7FFFFFFFFFFFFFFF, b_k)


@triton.jit
def _pow2_scale(b_amax):
    """``2**floor(log2(amax))`` for ``amax >= 1``, else 1 (its exponent bits, mantissa cleared): dividing
    by it is exact and leaves magnitudes below 2, whose float64 sums and squares cannot overflow."""
    b_e = (b_amax.to(tl.int64, bitcast=True) >> 52) & 0x7FF
    return (tl.maximum(b_e, 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _key_value(b_k):
    """The float64 value of a ``_float_key`` key."""
    return tl.where(b_k < 0, b_k ^ 0x7FFFFFFFFFFFFFFF, b_k).to(tl.float64, bitcast=True)


@triton.jit
def _key_scale(b_kmin, b_kmax):
    """``_pow2_scale`` of a group's largest magnitude from its min / max keys (1 with no finite member)."""
    b_amax = tl.maximum(tl.abs(_key_value(b_kmin)), tl.abs(_key_value(b_kmax)))
    return tl.where(b_kmin <= b_kmax, _pow2_scale(b_amax), 1.0)


@triton.jit
def _group_stats(b_n, b_ninv, b_sum, b_m2, b_uniform, b_scale, min_std):
    """Per-group (keep, mean, std) from float64 sums of the finite members divided by ``b_scale``.

    mean/std are those the advantages use (verl: singletons mean 0 std 1), divided by ``b_scale``.
    """
    b_nv = tl.maximum(b_n - b_ninv, 1).to(tl.float64)
    b_mean = b_sum / b_nv
    b_m2 = tl.where(b_uniform, 0.0, b_m2)
    b_pop_std = tl.sqrt(b_m2 / b_nv) * b_scale
    b_unb_std = tl.sqrt(b_m2 / tl.maximum(b_nv - 1.0, 1.0))
    b_single = b_n == 1
    b_keep = (b_ninv == 0) & (b_single | ((b_n > 1) & (~b_uniform) & (b_pop_std > min_std)))
    b_mean = tl.where(b_single, 0.0, tl.where(b_n > 0, b_mean, 0.0))
    b_std = tl.where(b_single, 1.0 / b_scale, tl.where(b_n > 1, b_unb_std, 0.0))
    return b_keep, b_mean, b_std


@triton.jit
def _advantage(b_x, b_mean, b_std, b_scale, b_zero, eps, NORM: tl.constexpr):
    """GRPO advantage from the scaled mean / std; exactly 0 for groups whose members are all equal or
    that are invalid."""
    b_d = b_x / b_scale - b_mean
    if NORM:
        b_d = b_d / (b_std + eps / b_scale)
    else:
        b_d = b_d * b_scale
    return tl.where(b_zero, 0.0, b_d)


@triton.jit
def _load_rows(p_scores, p_gidx, N, G, BLOCK: tl.constexpr):
    """This program's rows: offsets, row mask, float64 scores, group ids, in-range and finite masks."""
    i_b = tl.program_id(0)
    o_n = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m_n = o_n < N
    b_x = tl.load(p_scores + o_n, mask=m_n, other=0).to(tl.float64)
    b_g = tl.load(p_gidx + o_n, mask=m_n, other=0).to(tl.int64)
    m_g = m_n & (b_g >= 0) & (b_g < G)
    m_fin = tl.abs(b_x) <= 1.7976931348623157e308  # false for NaN and inf
    return o_n, m_n, b_x, b_g, m_g, m_fin


@triton.jit
def _load_group(p_cnt, p_ninv, p_sum, p_m2, p_kmin, p_kmax, o_g, m_g, min_std):
    """Gather the pass-1..3 sums of groups ``o_g`` and derive (keep, scaled mean, scaled std,
    scale, zero-advantage, size)."""
    b_n = tl.load(p_cnt + o_g, mask=m_g, other=0)
    b_ninv = tl.load(p_ninv + o_g, mask=m_g, other=0)
    b_kmin, b_kmax = tl.load(p_kmin + o_g, mask=m_g, other=0), tl.load(p_kmax + o_g, mask=m_g, other=0)
    b_uni = b_kmin == b_kmax
    b_scale = _key_scale(b_kmin, b_kmax)
    b_keep, b_mean, b_std = _group_stats(
        b_n, b_ninv, tl.load(p_sum + o_g, mask=m_g, other=0), tl.load(p_m2 + o_g, mask=m_g, other=0),
        b_uni, b_scale, min_std,
    )
    b_zero = (b_ninv > 0) | (b_uni & (b_n > 1)) | ~m_g
    return b_keep & m_g, b_mean, b_std, b_scale, b_zero, b_n


@triton.jit
def _group_filter_stats_kernel(
    p_scores, p_gidx, p_cnt, p_ninv, p_kmin, p_kmax, p_flags, N, G, BLOCK: tl.constexpr,
):
    """Pass 1: per-group member count, non-finite count, min and max keys."""
    o_n, m_n, b_x, b_g, m_g, m_fin = _load_rows(p_scores, p_gidx, N, G, BLOCK)
    m_v = m_g & m_fin
    tl.atomic_add(p_cnt + b_g, 1, mask=m_g)
    tl.atomic_add(p_ninv + b_g, 1, mask=m_g & ~m_fin)
    b_k = _float_key(b_x)
    tl.atomic_min(p_kmin + b_g, b_k, mask=m_v)
    tl.atomic_max(p_kmax + b_g, b_k, mask=m_v)
    tl.atomic_add(p_flags + 1, tl.sum((m_n & ~m_fin).to(tl.int64), 0))
    tl.atomic_add(p_flags + 2, tl.sum((m_n & ~m_g).to(tl.int64), 0))


@triton.jit
def _load_scaled_rows(p_scores, p_gidx, p_kmin, p_kmax, N, G, BLOCK: tl.constexpr):
    """This program's finite in-range scores divided by their group's scale, group ids and mask."""
    o_n, m_n, b_x, b_g, m_g, m_fin = _load_rows(p_scores, p_gidx, N, G, BLOCK)
    m_v = m_g & m_fin
    b_scale = _key_scale(tl.load(p_kmin + b_g, mask=m_v, other=0), tl.load(p_kmax + b_g, mask=m_v, other=0))
    return b_x / b_scale, b_g, m_v


@triton.jit
def _group_filter_sum_kernel(p_scores, p_gidx, p_kmin, p_kmax, p_sum, N, G, BLOCK: tl.constexpr):
    """Pass 2: per-group sum of the scaled scores."""
    b_xs, b_g, m_v = _load_scaled_rows(p_scores, p_gidx, p_kmin, p_kmax, N, G, BLOCK)
    tl.atomic_add(p_sum + b_g, b_xs, mask=m_v)


@triton.jit
def _group_filter_m2_kernel(p_scores, p_gidx, p_cnt, p_ninv, p_kmin, p_kmax, p_sum, p_m2, N, G,
                            BLOCK: tl.constexpr):
    """Pass 3: per-group sum of squared deviations of the scaled scores from their mean (two-pass variance)."""
    b_xs, b_g, m_v = _load_scaled_rows(p_scores, p_gidx, p_kmin, p_kmax, N, G, BLOCK)
    b_nv = tl.load(p_cnt + b_g, mask=m_v, other=1) - tl.load(p_ninv + b_g, mask=m_v, other=0)
    b_mean = tl.load(p_sum + b_g, mask=m_v, other=0) / tl.maximum(b_nv, 1).to(tl.float64)
    b_d = b_xs - b_mean
    tl.atomic_add(p_m2 + b_g, b_d * b_d, mask=m_v)


@triton.jit
def _group_filter_fwd_kernel(
    p_scores, p_gidx, p_cnt, p_ninv, p_sum, p_m2, p_kmin, p_kmax,
    p_keep, p_adv, p_gmean, p_gstd, p_gkeep, p_gsize, p_flags,
    N, G, eps, min_std, NORM: tl.constexpr, BLOCK: tl.constexpr,
):
    """Pass 4: per-element keep/advantage for rows o < N and per-group outputs for groups o < G."""
    o, m_n, b_x, b_g, m_g, m_fin = _load_rows(p_scores, p_gidx, N, G, BLOCK)
    b_keep, b_mean, b_std, b_scale, b_zero, b_n = _load_group(p_cnt, p_ninv, p_sum, p_m2, p_kmin, p_kmax, b_g, m_g,
                                                              min_std)
    tl.store(p_keep + o, b_keep.to(tl.uint8), mask=m_n)
    tl.store(p_adv + o, _advantage(b_x, b_mean, b_std, b_scale, b_zero, eps, NORM).to(tl.float32), mask=m_n)
    m_gg = o < G
    b_keep, b_mean, b_std, b_scale, b_zero, b_n = _load_group(p_cnt, p_ninv, p_sum, p_m2, p_kmin, p_kmax, o, m_gg,
                                                              min_std)
    _store_group_outputs(p_gmean, p_gstd, p_gkeep, p_gsize, p_flags, o, m_gg, b_keep, b_mean * b_scale,
                         b_std * b_scale, b_n)


@triton.jit
def _store_group_outputs(p_gmean, p_gstd, p_gkeep, p_gsize, p_flags, o_g, m_g, b_keep, b_mean, b_std, b_n):
    b_keep = b_keep & m_g
    tl.store(p_gmean + o_g, b_mean.to(tl.float32), mask=m_g)
    tl.store(p_gstd + o_g, b_std.to(tl.float32), mask=m_g)
    tl.store(p_gkeep + o_g, b_keep.to(tl.uint8), mask=m_g)
    tl.store(p_gsize + o_g, b_n.to(tl.int64), mask=m_g)
    tl.atomic_add(p_flags + 0, tl.sum(b_keep.to(tl.int64), 0))


@triton.jit
def _group_filter_contig_fwd_kernel(
    p_scores, p_keep, p_adv, p_gmean, p_gstd, p_gkeep, p_gsize, p_flags,
    G, n, eps, min_std, NORM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Groups of ``n`` consecutive members: a [BLOCK_G, BLOCK_M] tile holds whole groups."""
    i_b = tl.program_id(0)
    o_g = i_b.to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G).to(tl.int64)
    o_m = tl.arange(0, BLOCK_M).to(tl.int64)
    m_g = o_g < G
    m_x = m_g[:, None] & (o_m < n)[None, :]
    o_x = o_g[:, None] * n + o_m[None, :]
    b_x = tl.load(p_scores + o_x, mask=m_x, other=0).to(tl.float64)
    m_fin = tl.abs(b_x) <= 1.7976931348623157e308
    m_v = m_x & m_fin
    b_scale = _pow2_scale(tl.max(tl.where(m_v, tl.abs(b_x), 0.0), 1))
    b_xv = tl.where(m_v, b_x / b_scale[:, None], 0.0)
    b_n = tl.where(m_g, n, 0)
    b_ninv = tl.sum((m_x & ~m_fin).to(tl.int32), 1)
    b_nv = tl.maximum(b_n - b_ninv, 1).to(tl.float64)
    b_sum = tl.sum(b_xv, 1)
    b_d = tl.where(m_v, b_xv - (b_sum / b_nv)[:, None], 0.0)
    b_m2 = tl.sum(b_d * b_d, 1)
    b_k = _float_key(tl.where(m_v, b_x, 0.0))
    b_uni = tl.min(tl.where(m_v, b_k, 0x7FFFFFFFFFFFFFFF), 1) == tl.max(tl.where(m_v, b_k, -0x7FFFFFFFFFFFFFFF - 1), 1)
    b_keep, b_mean, b_std = _group_stats(b_n, b_ninv, b_sum, b_m2, b_uni, b_scale, min_std)
    b_zero = (b_ninv > 0) | (b_uni & (b_n > 1))
    b_adv = _advantage(b_x, b_mean[:, None], b_std[:, None], b_scale[:, None], b_zero[:, None], eps, NORM)
    tl.store(p_keep + o_x, tl.broadcast_to((b_keep & m_g)[:, None], (BLOCK_G, BLOCK_M)).to(tl.uint8), mask=m_x)
    tl.store(p_adv + o_x, b_adv.to(tl.float32), mask=m_x)
    _store_group_outputs(p_gmean, p_gstd, p_gkeep, p_gsize, p_flags, o_g, m_g, b_keep, b_mean * b_scale,
                         b_std * b_scale, b_n)
    tl.atomic_add(p_flags + 1, tl.sum(tl.sum((m_x & ~m_fin).to(tl.int64), 1), 0))


# --------------------------------------------------------------------------- launchers
def _alloc_outputs(n: int, g: int, device):
    return (
        empty_output((n,), dtype=torch.bool, device=device),
        empty_output((n,), dtype=torch.float32, device=device),
        empty_output((g,), dtype=torch.float32, device=device),
        empty_output((g,), dtype=torch.float32, device=device),
        empty_output((g,), dtype=torch.bool, device=device),
        empty_output((g,), dtype=torch.int64, device=device),
    )


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _finish(outs, flags):
    # flags = [num_kept_groups, num_invalid, num_out_of_range]; split into views outside
    # the custom op (its outputs must not alias each other).
    return (*outs, flags)


@register("group_filter", "triton")
def _group_filter_triton(scores, group_index, num_groups, group_size, epsilon, norm_adv_by_std, min_std):
    scores, group_index = scores.contiguous(), group_index.contiguous()  # addressed as dense [N]
    N, G, dev = scores.numel(), num_groups, scores.device
    outs = _alloc_outputs(N, G, dev)
    keep, adv, gmean, gstd, gkeep, gsize = outs
    flags = torch.zeros(3, dtype=torch.int64, device=dev)
    if group_size > 0 and group_size <= _MAX_CONTIG_GROUP:
        if G:
            block_m = next_pow2(group_size)
            block_g = max(1, _TILE // block_m)
            _group_filter_contig_fwd_kernel[(cdiv(G, block_g),)](
                scores, _u8(keep), adv, gmean, gstd, _u8(gkeep), gsize, flags,
                G, group_size, float(epsilon), float(min_std),
                NORM=bool(norm_adv_by_std), BLOCK_G=block_g, BLOCK_M=block_m, num_warps=_CONTIG_WARPS,
            )
        return _finish(outs, flags)
    if group_size > 0:
        group_index = torch.arange(N, device=dev) // group_size
    cnt = torch.zeros(G, dtype=torch.int32, device=dev)
    ninv = torch.zeros(G, dtype=torch.int32, device=dev)
    s = torch.zeros(G, dtype=torch.float64, device=dev)
    m2 = torch.zeros(G, dtype=torch.float64, device=dev)
    kmin = torch.full((G,), _KEY_MAX, dtype=torch.int64, device=dev)
    kmax = torch.full((G,), _KEY_MIN, dtype=torch.int64, device=dev)
    if N:
        grid = (cdiv(N, _BLOCK),)
        _group_filter_stats_kernel[grid](scores, group_index, cnt, ninv, kmin, kmax, flags, N, G, BLOCK=_BLOCK,
                                         maxnreg=_MAX_REGS)
        _group_filter_sum_kernel[grid](scores, group_index, kmin, kmax, s, N, G, BLOCK=_BLOCK, maxnreg=_MAX_REGS)
        _group_filter_m2_kernel[grid](scores, group_index, cnt, ninv, kmin, kmax, s, m2, N, G, BLOCK=_BLOCK,
                                      maxnreg=_MAX_REGS)
    if max(N, G):
        _group_filter_fwd_kernel[(cdiv(max(N, G), _BLOCK),)](
            scores, group_index, cnt, ninv, s, m2, kmin, kmax,
            _u8(keep), adv, gmean, gstd, _u8(gkeep), gsize, flags,
            N, G, float(epsilon), float(min_std), NORM=bool(norm_adv_by_std), BLOCK=_BLOCK, maxnreg=_MAX_REGS,
        )
    return _finish(outs, flags)


def _torch_pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """Per group ``2**floor(log2(amax))`` for ``amax >= 1``, else 1 (non-finite ``amax``: 1): dividing by
    it is exact and leaves magnitudes below 2, whose float64 sums and squares cannot overflow."""
    bits = torch.where(torch.isfinite(amax), amax, 0.0).view(torch.int64)
    return (((bits >> 52) & 0x7FF).clamp_min(1023) << 52).view(torch.float64)  # Triton's _pow2_scale


def _torch_sums_indexed(x: torch.Tensor, fin: torch.Tensor, gi: torch.Tensor, slots: int):
    """float64 (count, non-finite count, sum, M2, all-equal, scale) per group slot, the sums of the
    scores divided by their group's scale; ``gi`` maps bad rows to a spare slot. Gathers use
    index_select, several times faster than ``t[gi]``."""
    vmin = x.new_full((slots,), float("inf")).scatter_reduce_(0, gi, torch.where(fin, x, float("inf")), "amin")
    vmax = x.new_full((slots,), -float("inf")).scatter_reduce_(0, gi, torch.where(fin, x, -float("inf")), "amax")
    scale = _torch_pow2_scale(torch.maximum(vmin.abs(), vmax.abs()))
    xv = torch.where(fin, x / scale.index_select(0, gi), 0.0)
    # index_add_ rather than bincount: bincount scans for the maximum first (and syncs on CUDA).
    cnt = gi.new_zeros(slots).index_add_(0, gi, torch.ones_like(gi))
    ninv = gi.new_zeros(slots).index_add_(0, gi, (~fin).long())
    s = x.new_zeros(slots).index_add_(0, gi, xv)
    d = torch.where(fin, xv - (s / (cnt - ninv).clamp_min(1)).index_select(0, gi), 0.0)
    m2 = x.new_zeros(slots).index_add_(0, gi, d * d)
    return cnt, ninv, s, m2, vmin >= vmax, scale


def _torch_sums_contiguous(x: torch.Tensor, fin: torch.Tensor, n: int):
    """Same sums for groups of ``n`` consecutive rows, as row reductions of an [G, n] view."""
    x2, fin2 = x.view(-1, n), fin.view(-1, n)
    vmin = torch.where(fin2, x2, float("inf")).amin(1)
    vmax = torch.where(fin2, x2, -float("inf")).amax(1)
    scale = _torch_pow2_scale(torch.maximum(vmin.abs(), vmax.abs()))
    xv = torch.where(fin2, x2 / scale[:, None], 0.0)
    ninv = (~fin2).sum(1)
    cnt = torch.full_like(ninv, n)
    s = xv.sum(1)
    d = torch.where(fin2, xv - (s / (cnt - ninv).clamp_min(1))[:, None], 0.0)
    m2 = (d * d).sum(1)
    return cnt, ninv, s, m2, vmin >= vmax, scale


def _torch_group_stats(cnt, ninv, s, m2, uniform, scale, min_std: float):
    """Per-group (keep, mean, std, zero-advantage) of the scaled scores (``s``, ``m2``: their sums);
    same rules as the Triton ``_group_stats``."""
    nv = (cnt - ninv).clamp_min(1).double()
    m2 = torch.where(uniform, 0.0, m2)
    pop_std = torch.sqrt(m2 / nv) * scale
    unb_std = torch.sqrt(m2 / (nv - 1).clamp_min(1))
    single = cnt == 1
    keep = (ninv == 0) & (single | ((cnt > 1) & ~uniform & (pop_std > min_std)))
    mean = torch.where(single | (cnt == 0), 0.0, s / nv)
    std = torch.where(single, 1.0 / scale, torch.where(cnt > 1, unb_std, 0.0))
    zero = (ninv > 0) | (uniform & (cnt > 1))
    return keep, mean, std, zero


@register("group_filter", "torch")
def _group_filter_torch(scores, group_index, num_groups, group_size, epsilon, norm_adv_by_std, min_std):
    G = num_groups
    x = scores.double()
    fin = torch.isfinite(x)
    if group_size > 0:
        sums = _torch_sums_contiguous(x, fin, group_size)
        in_range = torch.ones((), dtype=torch.bool, device=x.device)
        gather = lambda t: t[:, None].expand(G, group_size).reshape(-1)  # noqa: E731
    else:
        in_range = (group_index >= 0) & (group_index < G)
        gi = torch.where(in_range, group_index.long(), G)  # spare slot G collects bad rows
        sums = _torch_sums_indexed(x, fin, gi, G + 1)
        gather = lambda t: t.index_select(0, gi)  # noqa: E731
    gkeep, mean, std, zero = _torch_group_stats(*sums, float(min_std))
    scale = sums[5]
    if group_size == 0:
        gkeep[G], zero[G] = False, True
    adv = x / gather(scale) - gather(mean)
    adv = adv / (gather(std) + epsilon / gather(scale)) if norm_adv_by_std else adv * gather(scale)
    adv = torch.where(gather(zero), 0.0, adv)
    flags = torch.stack([gkeep.sum(), (~fin).sum(), (~in_range).sum()])
    mean, std = (mean * scale)[:G], (std * scale)[:G]
    outs = (gather(gkeep), adv.float(), mean.float(), std.float(), gkeep[:G].clone(), sums[0][:G].clone())
    return _finish(outs, flags)


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("dapo::group_filter", mutates_args=())
def _group_filter_op(
    scores: torch.Tensor, group_index: torch.Tensor, num_groups: int, group_size: int,
    epsilon: float, norm_adv_by_std: bool, min_std: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    fn = dispatch("group_filter", scores.device)
    return fn(scores, group_index, num_groups, group_size, epsilon, norm_adv_by_std, min_std)


@_group_filter_op.register_fake
def _(scores, group_index, num_groups, group_size, epsilon, norm_adv_by_std, min_std):
    n, g = scores.shape[0], num_groups
    return (
        scores.new_empty((n,), dtype=torch.bool), scores.new_empty((n,), dtype=torch.float32),
        scores.new_empty((g,), dtype=torch.float32), scores.new_empty((g,), dtype=torch.float32),
        scores.new_empty((g,), dtype=torch.bool), scores.new_empty((g,), dtype=torch.int64),
        scores.new_empty((3,), dtype=torch.int64),
    )


def _no_grad_backward(ctx, *grads):
    # Rewards are constants of the policy-gradient loss: nothing flows back into them.
    return None, None, None, None, None, None, None


_group_filter_op.register_autograd(_no_grad_backward)


# --------------------------------------------------------------------------- public API
def _finite_nonnegative(v: float) -> bool:
    return math.isfinite(v) and v >= 0.0


class GroupFilterResult(NamedTuple):
    """Output of :func:`group_filter`; every field is a device tensor (nothing was synced).

    keep [N] bool, advantages [N] float32, group_mean [G] float32, group_std [G] float32,
    group_keep [G] bool, group_size [G] int64, num_kept_groups / num_invalid /
    num_out_of_range 0-dim int64.
    """

    keep: torch.Tensor
    advantages: torch.Tensor
    group_mean: torch.Tensor
    group_std: torch.Tensor
    group_keep: torch.Tensor
    group_size: torch.Tensor
    num_kept_groups: torch.Tensor
    num_invalid: torch.Tensor
    num_out_of_range: torch.Tensor

    def check(self) -> "GroupFilterResult":
        """Raise ValueError if any score was NaN/inf or any group index out of range.

        Costs one host sync (both flags are read in one transfer). To avoid even that,
        stack ``num_invalid``/``num_out_of_range`` into a tensor you already transfer
        (e.g. with your step's logged metrics) and test them there. Returns ``self``.
        """
        bad_scores, bad_index = torch.stack([self.num_invalid, self.num_out_of_range]).tolist()
        if bad_scores or bad_index:
            parts = []
            if bad_scores:
                parts.append(f"{bad_scores} score(s) are NaN or inf")
            if bad_index:
                parts.append(f"{bad_index} group_index value(s) lie outside [0, num_groups)")
            raise ValueError(
                "group_filter: " + " and ".join(parts) + "; the groups containing them were dropped "
                "(keep=False, advantage 0). Fix the reward function / uid mapping that produced them."
            )
        return self


def group_filter(
    scores: torch.Tensor,
    group_index: Optional[torch.Tensor] = None,
    num_groups: Optional[int] = None,
    *,
    group_size: Optional[int] = None,
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
    min_std: float = 0.0,
) -> GroupFilterResult:
    """DAPO dynamic-sampling filter and GRPO advantages for ``N`` responses in ``G`` groups.

    Args:
        scores: ``[N]`` float16/bfloat16/float32/float64, the filter metric per response
            (``acc``, ``seq_reward``, ``seq_final_reward`` or any combination).
        group_index: ``[N]`` int64 (or int32) group id in ``[0, num_groups)`` of each
            response, in any order (a group's members need not be contiguous).
        num_groups: ``G``; groups with no member are reported with size 0, not kept.
        group_size: instead of ``group_index``/``num_groups``: groups of ``n`` consecutive
            responses (verl's interleaved repeat), ``N`` a multiple of ``n``.
        epsilon: added to the std in the advantage denominator (verl's ``epsilon``).
        norm_adv_by_std: False gives Dr.GRPO advantages ``s - mean``.
        min_std: keep a group when its population std is > ``min_std`` (DAPO: 0).

    Returns a :class:`GroupFilterResult` of device tensors. Statistics are computed in
    float64; ``group_mean``/``group_std`` are those the advantages use (singletons 0/1,
    empty groups 0/0, ``group_std`` is the unbiased std). Groups whose members are all
    equal have std 0 and advantages exactly 0.

    Non-finite scores and out-of-range indices: no host sync is spent checking them.
    Their groups are dropped and their advantages are 0; ``res.num_invalid`` and
    ``res.num_out_of_range`` count them on the device, and ``res.check()`` raises
    ValueError (one sync); no NaN reaches any output, on either backend. Not differentiable:
    rewards are constants.
    """
    check_tensor("scores", scores, ndim=1, dtypes=FLOAT_DTYPES)
    N = scores.shape[0]
    epsilon, min_std = (check_float(name, v, valid=_finite_nonnegative, expected="a finite number >= 0.0")
                        for name, v in (("epsilon", epsilon), ("min_std", min_std)))
    check_flag("norm_adv_by_std", norm_adv_by_std)
    if group_size is not None:
        if group_index is not None or num_groups is not None:
            raise ValueError("pass either group_size or (group_index, num_groups), not both")
        group_size = check_int("group_size", group_size, minimum=1)
        if N % group_size:
            raise ValueError(f"scores length {N} must be a multiple of group_size={group_size}")
        num_groups = N // group_size
        group_index = scores.new_empty((0,), dtype=torch.int64)
    else:
        if group_index is None or num_groups is None:
            raise ValueError("group_index and num_groups are required unless group_size is given")
        check_tensor("group_index", group_index, dtypes=(torch.int64, torch.int32), device=scores.device,
                     shape=[N])
        num_groups = check_int("num_groups", num_groups, minimum=0)
        group_size = 0
    out = _group_filter_op(scores.detach().contiguous(), group_index.contiguous(), num_groups, group_size,
                           epsilon, norm_adv_by_std, min_std)
    return GroupFilterResult(*out[:6], *out[6].unbind())

