"""Fused lm_head -> log-prob (+ entropy) (+ DAPO loss), never materialising ``[N, V]``.

Per token ``i`` with logits ``z = hidden @ weight.T / temperature`` (fp32-accumulated):

* ``lse = log sum_v exp(z_v)``, ``log_prob = z[label] - lse``,
  ``entropy = -sum_v p_v (z_v - lse)``, accumulated as ``log s - t / s`` with
  ``s = sum exp(z - max)`` and ``t = sum exp(z - max) (z - max)`` (no cancellation of
  two large numbers);
* ``d/dz_v = g_lp * (onehot_v - p_v) - g_ent * p_v * (z_v - lse + entropy)``.

Matmuls accumulate in fp32 (``tl.dot`` / ``torch.mm``); ``lse``, ``entropy`` and ``log_prob``
(``[N]`` vectors, cheap) stay fp64 from the row statistics into the loss head and the backward,
and are returned in fp32: rounded to fp32 there, ``lse`` / ``entropy`` would be off by up to
half an ulp of ~log V, the same for every vocab entry of a row, a coherent error in dH / dW.
Two logits per row are summed in fp64 (N x H dots): the target's and the largest one's. The
log-prob's error is the probability-weighted rounding of the logits, and these two usually carry
most of it: the target's, times ``1 - p_t``, and the argmax's, times ``p_max``. Both enter ``lse``
and the log-prob, and the backward takes its ``dz`` entries for them from the same fp64 values,
so the row's softmax still sums to one.

Five statistics per row (running max, sum-exp, sum-exp * z, target logit, argmax index) are
reduced online over vocab tiles, then over the vocab splits of the grid, then over the ranks of
an optional vocab-parallel ``process_group`` with one MAX and one SUM all-reduce.

Backends: ``torch`` (CPU) walks chunks of tokens with a ``[chunk, V]`` fp32 logits buffer;
``triton`` (CUDA) reduces the statistics in one kernel over ``tokens x vocab`` tiles, and
its backward recomputes logits tiles into ``dz`` for a chunk of the vocabulary, then does
``dW`` and ``dH`` with tensor-core matmuls. ``fused_linear_policy_loss`` knows its per-token
gradient as soon as a token's log-prob is known, so it returns ``dH``/``dW`` from the
forward (torch: the logits chunk is reused, three matmuls in all).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl

from .._alloc import empty_output
from .._registry import dispatch, register
from .._validation import check_tensor
from ._triton_utils import INTERPRET, cdiv
from .policy_loss import (aggregation_weights, check_agg, check_clips, check_mask, metrics_from_counts,
                          pg_token_terms)

# CPU chunk: the [C, V] fp32 work buffers (one, two with entropy) in 64 MiB keep each matmul
# at >= 512 rows at V = 32k (full speed: measured no faster at 1024) for an eighth of naive's
# [N, V] logits at N = 4k.
_TORCH_CHUNK_BYTES = 64 << 20
# GPU backward: the dz buffer of one vocab chunk; 1 GiB keeps the two cuBLAS matmuls large
# while the extra memory stays far below [N, V] logits (10 GB at N=16k, V=152k).
_TRITON_DZ_BYTES = 1 << 30
# Tile shape: 64 x 128 fp32 accumulator = 32 KiB of registers over 8 warps, K-steps of 64.
_BLOCK_M, _BLOCK_V, _BLOCK_K = 64, 128, 64
_NUM_WARPS = 8
# Row statistics: running max, sum exp(z - max), sum exp(z - max) * (z - max), target logit,
# index of the max (within this vocab shard; the first on ties).
_NUM_STATS = 5
# Partial sums of the fused loss: total, pg, #clipped, #dual-clipped, sum(-log-ratio),
# #tokens, entropy, kl (each weighted like the loss except the counts).
_NUM_SUMS = 8
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "low_var_kl+", "k3+")


# --------------------------------------------------------------------------- kernels
@triton.jit
def _logits_tile(p_h, p_w, o_m, m_m, o_v, m_v, H, inv_temp,
                 BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 ``hidden[o_m] @ weight[o_v].T * inv_temp`` as a [BLOCK_M, BLOCK_V] tile."""
    b_acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    for k in range(0, H, BLOCK_K):
        o_k = k + tl.arange(0, BLOCK_K).to(tl.int64)
        m_k = o_k < H
        b_h = tl.load(p_h + o_m[:, None] * H + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0)
        b_w = tl.load(p_w + o_v[None, :] * H + o_k[:, None], mask=m_v[None, :] & m_k[:, None], other=0)
        if UPCAST:
            b_h = b_h.to(tl.float32)
            b_w = b_w.to(tl.float32)
        b_acc = tl.dot(b_h, b_w, b_acc, input_precision=PRECISION)
    return b_acc * inv_temp


@triton.jit
def _linear_log_probs_fwd_kernel(
    p_h, p_w, p_lab, p_stats, N, V, H, vocab_start, inv_temp, tiles_per_split,
    ENTROPY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, NUM_STATS: tl.constexpr,
):
    """Online row statistics over this program's vocab split -> stats[i_s, rows, 0:NUM_STATS]."""
    i_m = tl.program_id(0)
    i_s = tl.program_id(1)
    o_m = i_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    m_m = o_m < N
    b_lab = tl.load(p_lab + o_m, mask=m_m, other=-1).to(tl.int64) - vocab_start
    b_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # fp64 running sums: one add per row per tile, and log s - t / s keeps its digits.
    b_sum = tl.zeros([BLOCK_M], dtype=tl.float64)
    b_t = tl.zeros([BLOCK_M], dtype=tl.float64)
    b_tgt = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_arg = tl.zeros([BLOCK_M], dtype=tl.int64)
    for t in range(0, tiles_per_split):
        o_v = (i_s.to(tl.int64) * tiles_per_split + t) * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
        m_v = o_v < V
        b_z = _logits_tile(p_h, p_w, o_m, m_m, o_v, m_v, H, inv_temp, BLOCK_M, BLOCK_V, BLOCK_K, UPCAST, PRECISION)
        b_z = tl.where(m_v[None, :], b_z, float("-inf"))
        # m_v too: a label of another rank's shard may point past this shard's end.
        b_tgt += tl.sum(tl.where((o_v[None, :] == b_lab[:, None]) & m_v[None, :], b_z, 0.0), axis=1)
        b_tile_max, b_tile_arg = tl.max(b_z, axis=1, return_indices=True, return_indices_tie_break_left=True)
        # Strictly greater: an equal max in a later tile keeps the first index.
        b_arg = tl.where(b_tile_max > b_max, (i_s.to(tl.int64) * tiles_per_split + t) * BLOCK_V
                         + b_tile_arg.to(tl.int64), b_arg)
        b_new = tl.maximum(b_max, b_tile_max)
        # A tile past the end of the vocab leaves the max at -inf; shift by 0 there.
        b_ref = tl.where(b_new == float("-inf"), 0.0, b_new)
        b_scale = tl.exp(b_max - b_ref).to(tl.float64)
        b_p = tl.exp(b_z - b_ref[:, None])
        if ENTROPY:
            # t moves with the max: t' = scale * (t + (m_old - m_new) * s_old).
            b_shift = (tl.where(b_max == float("-inf"), b_ref, b_max) - b_ref).to(tl.float64) * b_sum
            b_zc = tl.where(m_v[None, :], b_z - b_ref[:, None], 0.0)
            b_t = (b_t + b_shift) * b_scale + tl.sum(b_p * b_zc, axis=1).to(tl.float64)
        b_sum = b_sum * b_scale + tl.sum(b_p, axis=1).to(tl.float64)
        b_max = b_new
    p_out = p_stats + (i_s.to(tl.int64) * N + o_m) * NUM_STATS
    tl.store(p_out + 0, b_max.to(tl.float64), mask=m_m)
    tl.store(p_out + 1, b_sum, mask=m_m)
    tl.store(p_out + 2, b_t, mask=m_m)
    tl.store(p_out + 3, b_tgt.to(tl.float64), mask=m_m)
    tl.store(p_out + 4, b_arg.to(tl.float64), mask=m_m)


@triton.jit
def _linear_log_probs_bwd_kernel(
    p_h, p_w, p_lab, p_arg, p_lse_hi, p_lse_lo, p_c_hi, p_c_lo, p_glp, p_gent, p_dzt, p_dza, p_dz,
    N, V, H, vocab_start, inv_temp,
    v0, n_cols, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """dz[:, v - v0] = d loss / d logits for vocab columns [v0, v0 + n_cols), recomputed.

    ``lse`` and ``c = lse - entropy`` come as fp32 pairs ``hi + lo`` of their fp64 values, so that
    ``log p = (z - lse_hi) - lse_lo`` and ``log p + entropy = (z - c_hi) - c_lo`` carry only fp32
    roundings relative to their own (small, where p is large) size: an fp32 ``lse`` or ``entropy``
    would be off by up to half an ulp of ~log V, the same for every entry of a row (a coherent
    error in dH / dW, and one that differs between vocab-sharded and unsharded runs). ``g_lp`` /
    ``g_ent`` come with the temperature folded in (fp64, rounded once). The target entry is
    ``dzt`` and the argmax entry (``arg``, local index) ``dza`` (fp32 ``[N]`` each, from their
    fp64 logits), not recomputed from fp32 logits.
    """
    i_m = tl.program_id(0)
    i_v = tl.program_id(1)
    o_m = i_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    m_m = o_m < N
    o_c = i_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
    o_v = v0 + o_c
    m_v = (o_c < n_cols) & (o_v < V)
    b_z = _logits_tile(p_h, p_w, o_m, m_m, o_v, m_v, H, inv_temp, BLOCK_M, BLOCK_V, BLOCK_K, UPCAST, PRECISION)
    b_lab = tl.load(p_lab + o_m, mask=m_m, other=-1).to(tl.int64) - vocab_start
    b_lse_hi = tl.load(p_lse_hi + o_m, mask=m_m, other=0)
    b_lse_lo = tl.load(p_lse_lo + o_m, mask=m_m, other=0)
    b_c_hi = tl.load(p_c_hi + o_m, mask=m_m, other=0)
    b_c_lo = tl.load(p_c_lo + o_m, mask=m_m, other=0)
    b_glp = tl.load(p_glp + o_m, mask=m_m, other=0)
    b_gent = tl.load(p_gent + o_m, mask=m_m, other=0)
    b_dzt = tl.load(p_dzt + o_m, mask=m_m, other=0)
    b_dza = tl.load(p_dza + o_m, mask=m_m, other=0)
    b_arg = tl.load(p_arg + o_m, mask=m_m, other=-1)
    b_p = tl.exp((b_z - b_lse_hi[:, None]) - b_lse_lo[:, None])
    b_q = (b_z - b_c_hi[:, None]) - b_c_lo[:, None]  # log p + entropy
    b_dz = -b_p * (b_glp[:, None] + b_gent[:, None] * b_q)
    b_dz = tl.where(o_v[None, :] == b_arg[:, None], b_dza[:, None], b_dz)
    b_dz = tl.where(o_v[None, :] == b_lab[:, None], b_dzt[:, None], b_dz)
    tl.store(p_dz + o_m[:, None] * n_cols + o_c[None, :], b_dz.to(p_dz.dtype.element_ty),
             mask=m_m[:, None] & m_v[None, :])


# --------------------------------------------------------------------------- process groups
# Custom ops take strings, not ProcessGroup objects: groups are registered here by key.
_GROUPS: Dict[str, object] = {}


def _group_key(group) -> str:
    if group is None:
        return ""
    key = f"pg{id(group)}"
    _GROUPS[key] = group
    return key


def _all_reduce(t: torch.Tensor, key: str, op: str = "sum") -> torch.Tensor:
    if key:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=_GROUPS[key])
    return t


def _rescale(m_part, s_part, t_part, m):
    """(s, t) of partials taken relative to their own max ``m_part``, moved to max ``m``."""
    scale = torch.exp(m_part - m)  # -inf partials (empty splits) -> 0
    shift = torch.where(scale > 0, (m_part - m) * s_part, 0.0)
    return s_part * scale, (t_part + shift) * scale


def exact_logits(hidden: torch.Tensor, weight: torch.Tensor, index: torch.Tensor, inv_temp: float,
                 vocab_start: int = 0) -> torch.Tensor:
    """fp64 ``[N]`` logits ``hidden_i . weight[index_i - vocab_start] * inv_temp`` summed in fp64 (0 where
    the index lies outside this vocab shard): N*H work, chunked so the gathered rows stay ~32 MiB."""
    n, h = hidden.shape
    v = weight.shape[0]
    out = torch.zeros(n, dtype=torch.float64, device=hidden.device)
    step = max(1, (32 << 20) // (16 * max(h, 1)))
    for r0 in range(0, n, step):
        idx = index[r0:r0 + step] - vocab_start
        inside = (idx >= 0) & (idx < v)
        rows = weight.index_select(0, idx.clamp(0, max(v - 1, 0))).double()
        dot = torch.einsum("nh,nh->n", hidden[r0:r0 + step].double(), rows) * inv_temp
        out[r0:r0 + step] = torch.where(inside, dot, 0.0)
    return out


def local_argmax(stats: torch.Tensor) -> torch.Tensor:
    """int64 ``[N]`` index (within this vocab shard) of each row's largest fp32 logit, from fp64
    ``stats [S, N, 5]``: the index stored by the split with the largest max (the first on ties)."""
    split = stats[..., 0].argmax(0)
    return stats[..., 4].gather(0, split[None])[0].long()


def combine_stats(stats: torch.Tensor, key: str = "", dtype: torch.dtype = torch.float32,
                  exact: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``stats [S, N, 4 or 5]`` partial row statistics -> ``(lse, log_prob, entropy)`` over splits and ranks.

    ``exact`` (optional) = ``(target, argmax, arg, local_labels)``: fp64 ``[N]`` logits summed in fp64
    (:func:`exact_logits`) at the label (0 outside this vocab shard) and at ``arg`` (this shard's
    :func:`local_argmax`), and ``labels - vocab_start`` (-1 outside this shard). Each rank swaps
    them for its fp32 ones in the sum-exp and in ``t`` before the all-reduce (the argmax's only
    where it is not the target), and the log-prob takes the exact target logit. With fp32 logits
    only, the log-prob's error is the probability-weighted rounding of the logits, and these two
    usually carry most of it (the target's times ``1 - p_t``, the argmax's times ``p_max``); the
    PPO ratio and the KL gradient pass it on to every per-token gradient.

    ``lse`` and the entropy are then those of the fp32 logits with the exact ones swapped in: the
    backward's softmax (and ``log p + entropy``) is consistent with them - its entries sum to
    zero - when its entries at those two positions come from the same fp64 values
    (:func:`_exact_dlogits`) and the others from recomputed fp32 logits.
    """
    m_part = stats[..., 0]
    m_local = m_part.amax(0)
    finite = torch.isfinite(m_local)
    m_local = torch.where(finite, m_local, torch.zeros_like(m_local))
    s, t = _rescale(m_part, stats[..., 1], stats[..., 2], m_local)
    s, t, tgt = s.sum(0), t.sum(0), stats[..., 3].sum(0)
    if exact is not None:
        target, argmax, arg, local_labels = exact
        # swap exp(a) a for exp(b) b in t and exp(a) for exp(b) in s, a / b the fp32 / fp64 logit
        # minus the local max; the argmax's fp32 logit is that max (a = 0).
        inside = local_labels >= 0
        a, b = (torch.where(inside, x - m_local, 0.0) for x in (tgt, target))
        s = s + torch.exp(a) * torch.expm1(b - a)
        t = t + (torch.exp(b) * b - torch.exp(a) * a)
        b = torch.where(finite & (arg != local_labels), argmax - m_local, 0.0)
        s = s + torch.expm1(b)
        t = t + torch.exp(b) * b
        tgt = target
    sums = torch.stack([s, t, tgt])  # one all-reduce for all of them
    if key:
        m = _all_reduce(m_local.clone(), key, "max")
        sums[0], sums[1] = _rescale(m_local, sums[0], sums[1], m)
        m_local = m
    s, t, tgt = _all_reduce(sums, key)
    log_s = torch.log(s)
    return (m_local + log_s).to(dtype), ((tgt - m_local) - log_s).to(dtype), (log_s - t / s).to(dtype)


# Rows of the fp64 per-token results that the backward takes (``rows [5, N]``).
_LSE, _ENT, _LOGP, _ARG, _ZARG = range(5)
_NUM_ROWS = 5


def _row_results(stats, key, hidden, weight, labels, inv_temp: float, vocab_start: int,
                 entropy: bool) -> torch.Tensor:
    """fp64 ``[5, N]``: lse, entropy (zeros unless ``entropy``), log-prob (with the fp64 target and
    argmax logits), the argmax's local index and its fp64 logit."""
    arg = local_argmax(stats)
    z_arg = exact_logits(hidden, weight, arg, inv_temp)
    local = labels - vocab_start
    local = torch.where((local >= 0) & (local < weight.shape[0]), local, -1)
    lse, log_prob, ent = combine_stats(stats, key, torch.float64,
                                       (exact_logits(hidden, weight, local, inv_temp), z_arg, arg, local))
    return torch.stack([lse, ent if entropy else torch.zeros_like(ent), log_prob, arg.double(), z_arg])


def _exact_dlogits(rows, g_lp, g_ent, inv_temp: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp64 ``[N]`` d loss / d (raw) logit at the target and at the argmax, from ``rows``' fp64 values.

    ``dz_v = g_lp (onehot_v - p_v) - g_ent p_v (log p_v + ent)``, times the temperature factor. At
    the target ``1 - p_t`` is ``-expm1(log p_t)``, so a likely target keeps its digits (``g_lp -
    g_lp p_t`` in fp32 would cancel them); neither entry carries its fp32 logit's rounding.
    """
    lse, ent, lp, z_arg = rows[_LSE], rows[_ENT], rows[_LOGP], rows[_ZARG]
    g_lp, g_ent = g_lp.double(), g_ent.double()
    d_t = -g_lp * torch.expm1(lp) - g_ent * torch.exp(lp) * (lp + ent)
    lp_a = z_arg - lse
    d_a = -torch.exp(lp_a) * (g_lp + g_ent * (lp_a + ent))
    return d_t * inv_temp, d_a * inv_temp


def _set_exact_entries(dz: torch.Tensor, lab: torch.Tensor, rows, g_lp, g_ent, inv_temp: float) -> torch.Tensor:
    """Overwrite ``dz [C, V]``'s argmax and target entries (the target last: it wins where they
    coincide) with :func:`_exact_dlogits`; rows whose target lies in another vocab shard write
    their own entry back (no host sync)."""
    d_t, d_a = _exact_dlogits(rows, g_lp, g_ent, inv_temp)
    r = torch.arange(dz.shape[0], device=dz.device)
    dz[r, rows[_ARG].long()] = d_a.float()
    inside = (lab >= 0) & (lab < dz.shape[1])
    idx = (r, lab.clamp(0, dz.shape[1] - 1))
    dz.index_put_(idx, torch.where(inside, d_t.float(), dz[idx]))
    return dz


# --------------------------------------------------------------------------- torch backend
def _chunk_rows(n_cols: int, n_rows: int, n_buffers: int = 1) -> int:
    return max(1, min(n_rows, _TORCH_CHUNK_BYTES // (4 * n_buffers * max(n_cols, 1))))


def _token_chunks(hidden: torch.Tensor, n_cols: int, two_buffers: bool):
    """Yield ``(rows, fp32 hidden rows, z, e)`` per token chunk; ``z``/``e`` are ``[C, V]`` fp32 views of
    buffers allocated once (``e is z`` unless ``two_buffers``).

    A fresh buffer per chunk would page-fault on first touch of every 4 KiB page, which on a busy
    CPU costs as much as an elementwise pass; reused buffers stay resident.
    """
    n = hidden.shape[0]
    step = _chunk_rows(n_cols, n, 2 if two_buffers else 1)
    z_buf = torch.empty((min(step, n), n_cols), dtype=torch.float32, device=hidden.device)
    e_buf = torch.empty_like(z_buf) if two_buffers else z_buf
    for r0 in range(0, n, step):
        c = min(step, n - r0)
        yield slice(r0, r0 + c), hidden[r0:r0 + c].float(), z_buf[:c], e_buf[:c]


def _target(z: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
    """``z[i, lab_i]``, 0 where the label lies outside this vocab shard."""
    inside = (lab >= 0) & (lab < z.shape[1])
    return torch.where(inside, z.gather(1, lab.clamp(0, z.shape[1] - 1)[:, None])[:, 0], 0.0)


def _logits(x, w32, inv_temp: float, z):
    """fp32 ``x @ w32.T * inv_temp`` into ``z``; the temperature scales the logits, as the reference does."""
    torch.mm(x, w32.t(), out=z)
    return z.mul_(inv_temp) if inv_temp != 1.0 else z


def _chunk_stats(x, w32, lab, inv_temp: float, z, e, entropy: bool) -> torch.Tensor:
    """fp64 ``[C, 5]`` row statistics of the logits ``x @ w32.T * inv_temp``.

    Leaves ``z - rowmax`` in ``z`` and, without ``entropy`` (``e`` is then ``z``'s buffer),
    ``exp(z - rowmax)`` in ``e``; with it, ``e`` is scratch.
    """
    tgt = _target(_logits(x, w32, inv_temp, z), lab)
    m, arg = z.max(1)  # the first index on ties
    torch.exp(z.sub_(m[:, None]), out=e)
    # torch's CPU row sums are cascaded (error ~eps log V), so fp32 keeps log s - t / s's digits
    # without an fp64 copy of the chunk; every term of t has one sign, nothing cancels.
    s = e.sum(1)
    t = e.mul_(z).sum(1) if entropy else torch.zeros_like(s)
    return torch.stack([m.double(), s.double(), t.double(), tgt.double(), arg.double()], dim=1)


def _chunk_dlogits(z, e, shift, ent, g_lp, g_ent, inv_temp: float, entropy: bool) -> torch.Tensor:
    """d loss / d logits over the chunk's buffer, given ``e = exp(zc)`` and ``z = zc`` with
    ``log p = zc + shift`` per row (only ``e`` is read without ``entropy``), except at the target
    and argmax entries (:func:`_set_exact_entries` writes those).

    ``dz = -p (g_lp + g_ent (log p + ent))``, the temperature and ``exp(shift)`` folded into
    per-row factors in fp64 (``shift`` / ``ent`` fp64 ``[C]``, each factor rounded once): one
    pass over ``[C, V]`` without entropy, three with it.
    """
    k = torch.exp(shift) * -inv_temp  # p = e * exp(shift)
    if entropy:
        # log p + ent first, as the chain rule through log_softmax groups it: both are ~log V,
        # their difference small, so summing the two products separately would cancel digits.
        z.add_((shift + ent).float()[:, None])
        dz = torch.addcmul((k * g_lp.double()).float()[:, None], z, (k * g_ent.double()).float()[:, None],
                           out=z).mul_(e)
    else:
        dz = e.mul_((k * g_lp.double()).float()[:, None])
    return dz


def _dlogits_(z: torch.Tensor, p: torch.Tensor, lab, lse, ent, g_lp, g_ent, inv_temp: float) -> torch.Tensor:
    """d loss / d logits written over ``z`` (fp32 ``[C, V]``); ``p`` the probabilities (npu_ops' path)."""
    z.sub_(lse[:, None]).add_(ent[:, None]).mul_(g_ent[:, None]).add_(g_lp[:, None]).mul_(p).neg_()
    inside = (lab >= 0) & (lab < z.shape[1])
    rows = torch.arange(z.shape[0], device=z.device)
    z.index_put_((rows, lab.clamp(0, z.shape[1] - 1)), torch.where(inside, g_lp, 0.0), accumulate=True)
    return z.mul_(inv_temp)


def _grad_buffers(hidden, weight):
    """fp32 dH and dW; dW's first chunk overwrites it (``beta=0``), so it is zeroed only for N = 0."""
    d_h = torch.empty((hidden.shape[0], hidden.shape[1]), dtype=torch.float32, device=hidden.device)
    alloc = torch.zeros if hidden.shape[0] == 0 else torch.empty
    return d_h, alloc(weight.shape, dtype=torch.float32, device=weight.device)


def _accumulate_grads(dz, x, w32, d_h, d_w, sl: slice, live: Optional[torch.Tensor] = None):
    """dH rows of the chunk and dW += dz^T x; ``live``: rows that have a gradient at all."""
    beta = 0 if sl.start == 0 else 1
    if live is not None and not bool(live.all()):
        # Masked tokens (prompts in a packed batch) and clipped ones have dz = 0: leaving them out
        # of both matmuls saves their share of two thirds of the FLOPs, for a [k, V] copy.
        idx = live.nonzero()[:, 0]
        dz, x = dz.index_select(0, idx), x.index_select(0, idx)
        d_h[sl] = 0
        d_h[sl].index_copy_(0, idx, torch.mm(dz, w32))
        d_w.addmm_(dz.t(), x, beta=beta)
        return
    torch.mm(dz, w32, out=d_h[sl])
    d_w.addmm_(dz.t(), x, beta=beta)


@register("linear_log_probs_stats", "torch")
def _stats_torch(hidden, weight, labels, inv_temp, vocab_start, entropy):
    w32 = weight.float()
    stats = torch.empty((1, hidden.shape[0], _NUM_STATS), dtype=torch.float64, device=hidden.device)
    for sl, x, z, e in _token_chunks(hidden, weight.shape[0], entropy):
        stats[0, sl] = _chunk_stats(x, w32, labels[sl] - vocab_start, inv_temp, z, e, entropy)
    return stats


@register("linear_log_probs_grads", "torch")
def _grads_torch(hidden, weight, labels, inv_temp, vocab_start, rows, g_lp, g_ent):
    """(dH fp32 [N, H], dW [V, H]) by recomputing fp32 logits chunk by chunk.

    ``rows`` fp64 ``[5, N]`` from :func:`_row_results`: the logits are shifted by ``lse`` rounded to
    fp32, and the rest of it, ``shift = fp32(lse) - lse`` (fp64), goes into the per-row factors, so
    ``log p`` carries no row-coherent rounding of ``lse`` (nor ``log p + ent`` one of ``ent``).
    """
    w32 = weight.float()
    entropy = bool(g_ent.any())
    lse, ent = rows[_LSE], rows[_ENT]
    lse32 = lse.float()
    shift = lse32.double() - lse
    d_h, d_w = _grad_buffers(hidden, weight)
    for sl, x, z, e in _token_chunks(hidden, weight.shape[0], entropy):
        torch.exp(_logits(x, w32, inv_temp, z).sub_(lse32[sl, None]), out=e)  # z = log p - shift, e = p / exp(shift)
        dz = _chunk_dlogits(z, e, shift[sl], ent[sl], g_lp[sl], g_ent[sl], inv_temp, entropy)
        _set_exact_entries(dz, labels[sl] - vocab_start, rows[:, sl], g_lp[sl], g_ent[sl], inv_temp)
        _accumulate_grads(dz, x, w32, d_h, d_w, sl)
    return d_h, d_w.to(weight.dtype)


# --------------------------------------------------------------------------- triton backend
def _dot_flags(dtype: torch.dtype):
    # fp32 inputs: exact fp32 products (tf32 would cost ~1e-3 of logit); the 3.9
    # interpreter multiplies raw bits for 16-bit dot operands, so it gets fp32 ones.
    return dict(UPCAST=INTERPRET, PRECISION="ieee" if dtype == torch.float32 else "tf32")


def _num_splits(n_row_blocks: int, n_tiles: int, device: torch.device) -> int:
    if device.type != "cuda":
        return min(n_tiles, 2)  # interpreter: exercise the split combine, keep programs few
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(n_tiles, cdiv(4 * sms, n_row_blocks)))


@register("linear_log_probs_stats", "triton")
def _stats_triton(hidden, weight, labels, inv_temp, vocab_start, entropy):
    hidden, weight = hidden.contiguous(), weight.contiguous()
    (n, h), v = hidden.shape, weight.shape[0]
    n_tiles = cdiv(v, _BLOCK_V)
    splits = _num_splits(cdiv(n, _BLOCK_M), n_tiles, hidden.device)
    per_split = cdiv(n_tiles, splits)
    splits = cdiv(n_tiles, per_split)
    stats = empty_output((splits, n, _NUM_STATS), dtype=torch.float64, device=hidden.device)
    if n:
        _linear_log_probs_fwd_kernel[(cdiv(n, _BLOCK_M), splits)](
            hidden, weight, labels, stats, n, v, h, vocab_start, inv_temp, per_split,
            ENTROPY=entropy, BLOCK_M=_BLOCK_M, BLOCK_V=_BLOCK_V, BLOCK_K=_BLOCK_K,
            NUM_STATS=_NUM_STATS, num_warps=_NUM_WARPS, **_dot_flags(hidden.dtype),
        )
    return stats


def _hi_lo(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp64 ``x`` as fp32 ``hi + lo`` (``hi`` = x rounded, ``lo`` = the rest rounded: ~48 bits)."""
    x = x.double()
    hi = x.float()
    return hi.contiguous(), (x - hi.double()).float().contiguous()


@register("linear_log_probs_grads", "triton")
def _grads_triton(hidden, weight, labels, inv_temp, vocab_start, rows, g_lp, g_ent):
    """dz per vocab chunk (Triton, recomputed logits), then dW rows and dH with cuBLAS; ``rows`` fp64
    ``[5, N]`` from :func:`_row_results` (lse and lse - entropy go to the kernel as fp32 hi / lo pairs)."""
    hidden, weight = hidden.contiguous(), weight.contiguous()
    (n, h), v = hidden.shape, weight.shape[0]
    cols = max(_BLOCK_V, _TRITON_DZ_BYTES // (hidden.element_size() * max(n, 1)) // _BLOCK_V * _BLOCK_V)
    d_w = empty_output(weight.shape, dtype=weight.dtype, device=weight.device)
    d_h = torch.zeros((n, h), dtype=torch.float32, device=hidden.device)
    args = [rows[_ARG].long(), *_hi_lo(rows[_LSE]), *_hi_lo(rows[_LSE] - rows[_ENT]),
            *((g.double() * inv_temp).float().contiguous() for g in (g_lp, g_ent)),
            *(d.float().contiguous() for d in _exact_dlogits(rows, g_lp, g_ent, inv_temp))]
    for v0 in range(0, v, cols):
        nc = min(cols, v - v0)
        dz = empty_output((n, nc), dtype=hidden.dtype, device=hidden.device)
        if n:
            _linear_log_probs_bwd_kernel[(cdiv(n, _BLOCK_M), cdiv(nc, _BLOCK_V))](
                hidden, weight, labels, *args, dz, n, v, h, vocab_start, inv_temp, v0, nc,
                BLOCK_M=_BLOCK_M, BLOCK_V=_BLOCK_V, BLOCK_K=_BLOCK_K, num_warps=_NUM_WARPS,
                **_dot_flags(hidden.dtype),
            )
        torch.mm(dz.t(), hidden, out=d_w[v0:v0 + nc])
        # dH sums over vocab chunks: accumulate each chunk's product in fp32.
        d_h += torch.mm(dz, weight[v0:v0 + nc])
    return d_h, d_w


# --------------------------------------------------------------------------- loss head
def kl_terms(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str, dtype: torch.dtype = torch.float32):
    """(verl ``kl_penalty`` value, its derivative w.r.t. ``log_prob``), elementwise, in ``dtype``."""
    base = kl_type[:-1] if kl_type.endswith("+") else kl_type
    d = log_prob.to(dtype) - ref_log_prob.to(dtype)
    if base in ("kl", "k1"):
        val, grad = d, torch.ones_like(d)
    elif base == "abs":
        val, grad = d.abs(), torch.sign(d)
    elif base in ("mse", "k2"):
        val, grad = 0.5 * d * d, d
    else:  # low_var_kl / k3: clamp(exp(k) - k - 1, -10, 10) with k = clamp(-d, -20, 20)
        k = (-d).clamp(-20.0, 20.0)
        r = torch.exp(k)
        val = r - k - 1
        grad = torch.where((d.abs() <= 20.0) & (val <= 10.0), 1.0 - r, 0.0)
        val = val.clamp(-10.0, 10.0)
    if kl_type.endswith("+"):
        grad = d  # straight-through: k2's gradient under the estimator's value
    return val, grad


class _LossHead:
    """Per-token DAPO loss: gradients w.r.t. log-prob / entropy and weighted partial sums."""

    def __init__(self, tokens: List[torch.Tensor], params: List[float], kl_type: str):
        self.old, self.adv, self.mask, self.w, self.ref = tokens
        self.clips = params[1:4]
        self.ent_coef, self.kl_coef = params[4], params[5]
        self.kl_type = kl_type

    def __call__(self, lp: torch.Tensor, ent: torch.Tensor, sl: slice):
        mask = self.mask[sl]
        w = self.w if self.w.numel() == 1 else self.w[sl]
        loss, dl, clip, clip_low, nkl = pg_token_terms(lp, self.old[sl], self.adv[sl], *self.clips)
        wm = torch.where(mask, w, 0.0)
        g_lp = wm * dl
        m = mask.double()
        zero = m.new_zeros(())
        ent_sum, kl_sum, g_ent = zero, zero, torch.zeros_like(lp)
        # fp64 token math and sums, as in policy_loss.
        if self.ent_coef:
            ent_sum = torch.where(mask, wm * ent.double(), 0.0).sum()
            g_ent = -self.ent_coef * wm
        if self.kl_coef:
            kl_val, kl_grad = kl_terms(lp, self.ref[sl], self.kl_type, torch.float64)
            kl_sum = torch.where(mask, wm * kl_val.double(), 0.0).sum()
            g_lp = g_lp + self.kl_coef * wm * kl_grad
        pg_sum = torch.where(mask, wm * loss, 0.0).sum()
        sums = torch.stack([pg_sum - self.ent_coef * ent_sum + self.kl_coef * kl_sum, pg_sum, m @ clip,
                            m @ clip_low, m @ -nkl, m.sum(), ent_sum, kl_sum])
        return g_lp.float(), g_ent.float(), sums


@register("fused_linear_policy_loss", "torch")
def _fused_torch(hidden, weight, labels, head, inv_temp, vocab_start, key, entropy, compute_grad):
    """One pass over token chunks; each fp32 logits chunk serves the loss and its gradient."""
    n = hidden.shape[0]
    w32 = weight.float()
    log_prob = torch.empty(n, dtype=torch.float32, device=hidden.device)
    ent = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    sums = torch.zeros(_NUM_SUMS, dtype=torch.float64, device=hidden.device)
    if compute_grad:
        d_h, d_w = _grad_buffers(hidden, weight)
    else:
        d_h, d_w = hidden.new_empty((0, hidden.shape[1]), dtype=torch.float32), w32.new_empty((0, weight.shape[1]))
    for sl, x, z, e in _token_chunks(hidden, weight.shape[0], entropy):
        lab = labels[sl] - vocab_start
        stats = _chunk_stats(x, w32, lab, inv_temp, z, e, entropy)
        # fp64 lse, entropy and log-prob: the softmax shift and log p + entropy below keep their
        # digits, and the head's ratio / KL gradient see the log-prob before its fp32 rounding.
        rows = _row_results(stats[None], key, hidden[sl], weight, labels[sl], inv_temp, vocab_start, entropy)
        lse, lp, ent_c = rows[_LSE], rows[_LOGP], rows[_ENT]
        log_prob[sl] = lp
        ent[sl] = ent_c
        g_lp, g_ent, part = head(lp, ent_c, sl)
        sums += part
        if compute_grad:
            if entropy:
                torch.exp(z, out=e)
            dz = _chunk_dlogits(z, e, stats[:, 0] - lse, ent_c, g_lp, g_ent, inv_temp, entropy)
            _set_exact_entries(dz, lab, rows, g_lp, g_ent, inv_temp)
            _accumulate_grads(dz, x, w32, d_h, d_w, sl, (g_lp != 0) | (g_ent != 0))
    return sums, log_prob, ent, d_h, d_w.to(weight.dtype)


@register("fused_linear_policy_loss", "triton")
def _fused_triton(hidden, weight, labels, head, inv_temp, vocab_start, key, entropy, compute_grad):
    """Statistics kernel over all tokens, the loss head, then the recomputing backward."""
    # fp64 lse / entropy / log-prob into the head and the backward; fp32 outputs.
    stats = _stats_triton(hidden, weight, labels, inv_temp, vocab_start, entropy)
    rows = _row_results(stats, key, hidden, weight, labels, inv_temp, vocab_start, entropy)
    g_lp, g_ent, sums = head(rows[_LOGP], rows[_ENT], slice(None))
    if not compute_grad:
        d_h, d_w = hidden.new_empty((0, hidden.shape[1]), dtype=torch.float32), weight.new_empty((0, weight.shape[1]))
    else:
        d_h, d_w = _grads_triton(hidden, weight, labels, inv_temp, vocab_start, rows, g_lp, g_ent)
    return sums, rows[_LOGP].float(), rows[_ENT].float(), d_h, d_w


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("dapo::linear_log_probs", mutates_args=())
def _linear_log_probs_op(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                         entropy: bool, vocab_start: int, group: str
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``[N]`` log_prob, fp32 ``[N]`` entropy (zeros unless ``entropy``), and the fp64 ``[5, N]``
    rows of :func:`_row_results` for the backward: rounded to fp32 there, lse / entropy would be off
    by up to half an ulp of ~log V, the same for every vocab entry of a row (a coherent error in dH
    / dW), and the target / argmax entries would lose their fp64 logits' digits."""
    stats = dispatch("linear_log_probs_stats", hidden.device)(hidden, weight, labels, 1.0 / temperature,
                                                              vocab_start, entropy)
    rows = _row_results(stats, group, hidden, weight, labels, 1.0 / temperature, vocab_start, entropy)
    return rows[_LOGP].float(), rows[_ENT].float(), rows


@_linear_log_probs_op.register_fake
def _(hidden, weight, labels, temperature, entropy, vocab_start, group):
    n = hidden.shape[0]
    return (hidden.new_empty((n,), dtype=torch.float32), hidden.new_empty((n,), dtype=torch.float32),
            hidden.new_empty((_NUM_ROWS, n), dtype=torch.float64))


@torch.library.custom_op("dapo::linear_log_probs_bwd", mutates_args=())
def _linear_log_probs_bwd_op(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor,
                             g_lp: torch.Tensor, g_ent: torch.Tensor, temperature: float, vocab_start: int,
                             group: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dH in hidden's dtype, summed over the group; dW of the local vocab shard); ``rows`` the fp64
    ``[5, N]`` saved by the forward."""
    d_h, d_w = dispatch("linear_log_probs_grads", hidden.device)(hidden, weight, labels, 1.0 / temperature,
                                                                 vocab_start, rows, g_lp, g_ent)
    return _all_reduce(d_h, group).to(hidden.dtype), d_w


@_linear_log_probs_bwd_op.register_fake
def _(hidden, weight, labels, rows, g_lp, g_ent, temperature, vocab_start, group):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _llp_setup(ctx, inputs, output):
    hidden, weight, labels, temperature, entropy, vocab_start, group = inputs
    ctx.save_for_backward(hidden, weight, labels, output[2])
    ctx.args = (temperature, vocab_start, group)


def _llp_backward(ctx, g_lp, g_ent, g_rows):
    hidden, weight, labels, rows = ctx.saved_tensors
    d_h, d_w = _linear_log_probs_bwd_op(hidden, weight, labels, rows, g_lp.float().contiguous(),
                                        g_ent.float().contiguous(), *ctx.args)
    return d_h, d_w, None, None, None, None, None


_linear_log_probs_op.register_autograd(_llp_backward, setup_context=_llp_setup)


@torch.library.custom_op("dapo::fused_linear_policy_loss", mutates_args=())
def _fused_op(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, tokens: List[torch.Tensor],
              params: List[float], kl_type: str, vocab_start: int, group: str, entropy: bool, compute_grad: bool
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sums fp64 [8], log_prob [N], entropy [N], dH, dW); dH/dW are empty unless ``compute_grad``.

    ``tokens`` = [old_log_prob, advantages, mask (bool), weights (1 or N), ref_log_prob];
    ``params`` = [temperature, clip_low, clip_high, clip_c, entropy_coeff, kl_coef].
    """
    head = _LossHead(tokens, params, kl_type)
    sums, log_prob, ent, d_h, d_w = dispatch("fused_linear_policy_loss", hidden.device)(
        hidden, weight, labels, head, 1.0 / params[0], vocab_start, group, entropy, compute_grad)
    return sums, log_prob, ent, _all_reduce(d_h, group).to(hidden.dtype), d_w


@_fused_op.register_fake
def _(hidden, weight, labels, tokens, params, kl_type, vocab_start, group, entropy, compute_grad):
    n = hidden.shape[0]
    f32 = dict(dtype=torch.float32)
    d_h = torch.empty_like(hidden) if compute_grad else hidden.new_empty((0, hidden.shape[1]))
    d_w = torch.empty_like(weight) if compute_grad else weight.new_empty((0, weight.shape[1]))
    return hidden.new_empty((_NUM_SUMS,), dtype=torch.float64), hidden.new_empty((n,), **f32), hidden.new_empty((n,), **f32), d_h, d_w


def _fused_setup(ctx, inputs, output):
    # Only the loss is differentiable: no zero-filled [V, H] cotangent for the dW output.
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    # Detached (no reference cycle through grad_fn), not saved: backward scales them in place and
    # lets go, so autograd can take them as .grad without a copy.
    ctx.grads = [output[3].detach(), output[4].detach()]
    ctx.n_tokens = len(inputs[3])


def _fused_backward(ctx, g_sums, *_):
    if ctx.grads is None:
        raise RuntimeError("fused_linear_policy_loss computes its gradients in the forward and hands them over "
                           "in the first backward; a second backward (retain_graph) needs a new forward")
    d_h, d_w = ctx.grads
    ctx.grads = None
    if g_sums is None:
        d_h = d_w = None
    else:
        g = g_sums[0]
        d_h, d_w = d_h.mul_(g), d_w.mul_(g)
    return (d_h, d_w, None, [None] * ctx.n_tokens, None, None, None, None, None, None)


_fused_op.register_autograd(_fused_backward, setup_context=_fused_setup)


# --------------------------------------------------------------------------- public API
def _check_linear_inputs(hidden, weight, labels, temperature, process_group):
    """Validate; return (vocab_start, group key). One host sync for the label range."""
    check_tensor("hidden", hidden, ndim=2, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    check_tensor("weight", weight, ndim=2, dtypes=(hidden.dtype,), device=hidden.device,
                 shape=(None, hidden.shape[1]))
    if weight.shape[0] < 1:
        raise ValueError("weight must have at least one vocab row, got shape [0, H]")
    check_tensor("labels", labels, ndim=1, dtypes=(torch.int64, torch.int32), device=hidden.device,
                 shape=(hidden.shape[0],))
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rank, world = 0, 1
    if process_group is not None:
        import torch.distributed as dist

        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    vocab = weight.shape[0] * world
    if labels.numel():
        lo, hi = torch.stack(torch.aminmax(labels)).tolist()
        if lo < 0 or hi >= vocab:
            raise ValueError(f"labels must lie in [0, V) = [0, {vocab}), got range [{lo}, {hi}]")
    return rank * weight.shape[0], _group_key(process_group)


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    process_group=None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probability of ``labels`` under ``softmax(hidden @ weight.T / temperature)``, without ``[N, V]``.

    Args:
        hidden: ``[N, H]`` fp16/bf16/fp32 (packed tokens).
        weight: ``[V, H]`` lm_head, same dtype; with ``process_group``, this rank's vocab shard
            (Megatron vocab-parallel: rank ``r`` holds rows ``[r*V, (r+1)*V)`` of the full head).
        labels: ``[N]`` int64 (or int32) token ids in ``[0, V_total)``.
        temperature: logits are divided by it (> 0).
        return_entropy: also return the entropy of the distribution.
        process_group: optional ``torch.distributed`` group over which ``weight`` is sharded by
            vocab; the results equal the unsharded ones. ``hidden``'s gradient is all-reduced
            over the group (do not add a Megatron copy-to-TP-region on top).

    Returns:
        ``log_prob`` fp32 ``[N]`` and ``entropy`` fp32 ``[N]`` (or None), from fp32-accumulated
        logits. Differentiable w.r.t. ``hidden`` and ``weight`` through both outputs.
    """
    vocab_start, key = _check_linear_inputs(hidden, weight, labels, temperature, process_group)
    log_prob, ent, _ = _linear_log_probs_op(hidden, weight, labels, float(temperature), bool(return_entropy),
                                               vocab_start, key)
    return log_prob, (ent if return_entropy else None)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str = "low_var_kl") -> torch.Tensor:
    """verl's ``kl_penalty`` estimators (``kl``/``k1``, ``abs``, ``mse``/``k2``, ``low_var_kl``/``k3``,
    and ``+`` straight-through variants), elementwise on same-shape float tensors; fp32 result,
    differentiable w.r.t. ``log_prob``."""
    check_tensor("log_prob", log_prob, dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64))
    check_tensor("ref_log_prob", ref_log_prob, device=log_prob.device, shape=tuple(log_prob.shape))
    if kl_type not in KL_TYPES:
        raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")
    val, grad = kl_terms(log_prob.detach(), ref_log_prob, kl_type)
    # Value of the estimator, gradient of kl_terms: first-order straight-through.
    return val + (log_prob.float() - log_prob.detach().float()) * grad


def _check_token_inputs(n: int, hidden, old_log_prob, advantages, response_mask, ref_log_prob, kl_coef, kl_type):
    for name, t in (("old_log_prob", old_log_prob), ("advantages", advantages)):
        check_tensor(name, t, dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
                     device=hidden.device, shape=(n,))
    mask = check_mask("response_mask", response_mask, old_log_prob)
    if kl_type not in KL_TYPES:
        raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")
    if kl_coef and ref_log_prob is None:
        raise ValueError("kl_coef != 0 needs ref_log_prob [N]")
    if ref_log_prob is not None:
        check_tensor("ref_log_prob", ref_log_prob, dtypes=(torch.float16, torch.bfloat16, torch.float32,
                                                           torch.float64), device=hidden.device, shape=(n,))
    return mask


def fused_linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    num_tokens=None,
    num_seqs=None,
    cu_seqlens: Optional[torch.Tensor] = None,
    loss_scale_factor=None,
    entropy_coeff: float = 0.0,
    ref_log_prob: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
    kl_type: str = "low_var_kl",
    process_group=None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """lm_head -> log-prob -> DAPO loss in one op: ``pg_loss - entropy_coeff * agg(entropy) + kl_coef * agg(kl)``.

    ``hidden [N, H]``, ``weight [V, H]``, ``labels [N]``, ``temperature`` and ``process_group``
    as in :func:`linear_log_probs`; ``old_log_prob``, ``advantages``, ``ref_log_prob`` float
    ``[N]``, ``response_mask`` bool/int ``[N]``; the loss arguments as in
    :func:`dapo_kernels.policy_loss` (``cu_seqlens`` ``[B+1]`` for the seq modes; the entropy and
    kl terms use the same aggregation, as verl's actor does). ``kl_type`` in ``KL_TYPES``.

    Returns ``loss`` (fp32 0-dim; gradients for ``hidden`` and ``weight``, computed during the
    forward when grad is enabled) and detached ``metrics``: ``pg_clipfrac``,
    ``pg_clipfrac_lower``, ``ppo_kl``, ``pg_loss``, ``log_prob`` ``[N]``, plus ``entropy_loss``
    and ``entropy`` ``[N]`` when ``entropy_coeff != 0``, ``kl_loss`` when ``kl_coef != 0``.
    """
    vocab_start, key = _check_linear_inputs(hidden, weight, labels, temperature, process_group)
    n = hidden.shape[0]
    mask = _check_token_inputs(n, hidden, old_log_prob, advantages, response_mask, ref_log_prob, kl_coef, kl_type)
    clips = check_clips(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    check_agg(loss_agg_mode, old_log_prob, cu_seqlens)
    for name, v in (("entropy_coeff", entropy_coeff), ("kl_coef", kl_coef)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{name} must be a float, got {type(v).__name__}")
    w = aggregation_weights(mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, cu_seqlens=cu_seqlens,
                            loss_scale_factor=loss_scale_factor)
    ref = ref_log_prob if (kl_coef and ref_log_prob is not None) else old_log_prob.new_zeros(0)
    tokens = [old_log_prob.contiguous(), advantages.contiguous(), mask.contiguous(), w, ref.contiguous()]
    params = [float(temperature), *clips, float(entropy_coeff), float(kl_coef)]
    compute_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    entropy = bool(entropy_coeff)
    sums, log_prob, ent, _, _ = _fused_op(hidden, weight, labels, tokens, params, kl_type, vocab_start, key,
                                          entropy, compute_grad)
    metrics = metrics_from_counts(sums[2], sums[3], sums[4], sums[5])
    metrics.update(pg_loss=sums[1].detach().float(), log_prob=log_prob.detach())
    if entropy:
        metrics.update(entropy_loss=sums[6].detach().float(), entropy=ent.detach())
    if kl_coef:
        metrics["kl_loss"] = sums[7].detach().float()
    return sums[0].float(), metrics
