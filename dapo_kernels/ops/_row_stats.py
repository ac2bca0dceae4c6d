"""Row statistics shared by ``linear_log_probs`` and ``fused_linear_policy_loss``.

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

Here: the combine of partial statistics over vocab splits and ranks (:func:`combine_stats`), the
fp64 target / argmax refinement (:func:`row_results`, :func:`set_exact_entries`), the torch
backend's chunked logits and ``dz`` (:func:`token_chunks`, :func:`chunk_stats`,
:func:`chunk_dlogits`), the input checks both ops share, and the process-group registry the
custom ops use (they take a string key, not a ``ProcessGroup``). Backends outside this package
get these through :mod:`dapo_kernels.backend_api`.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .._validation import check_float, check_int, check_tensor, tracing, value_range, value_range_except

# CPU token chunk: [C, V] fp32 work buffers (two with entropy) of 64 MiB keep each matmul at full speed
# (sizing in NOTES_fused_loss.md).
TORCH_CHUNK_BYTES = 64 << 20
# Row statistics: running max, sum exp(z - max), sum exp(z - max) * (z - max), target logit,
# index of the max (within this vocab shard; the first on ties).
NUM_STATS = 5


# --------------------------------------------------------------------------- process groups
# Custom ops take strings, not ProcessGroup objects: groups are registered here by key.
GROUPS: Dict[str, object] = {}


def group_key(group) -> str:
    if group is None:
        return ""
    key = f"pg{id(group)}"
    GROUPS[key] = group
    return key


def all_reduce(t: torch.Tensor, key: str, op: str = "sum") -> torch.Tensor:
    if key:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=GROUPS[key])
    return t


def rescale(m_part, s_part, t_part, m):
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
    step = max(1, (32 << 20) // (16 * max(h, 1)))
    out = torch.zeros(n, dtype=torch.float64, device=hidden.device) if n == 0 or n > step else None
    for r0 in range(0, n, step):
        idx = index[r0:r0 + step] - vocab_start
        inside = (idx >= 0) & (idx < v)
        rows = weight.index_select(0, idx.clamp(0, max(v - 1, 0))).double()
        # Elementwise product and row sum, not a batched matmul: N*H work, no GEMM (the counted units).
        dot = rows.mul_(hidden[r0:r0 + step].double()).sum(1) * inv_temp
        if out is None:  # one chunk: the result itself
            return torch.where(inside, dot, 0.0)
        out[r0:r0 + step] = torch.where(inside, dot, 0.0)
    return out


def local_argmax(stats: torch.Tensor) -> torch.Tensor:
    """int64 ``[N]`` index (within this vocab shard) of each row's largest fp32 logit, from fp64
    ``stats [S, N, 5]``: the index stored by the split with the largest max (the first on ties)."""
    if stats.shape[0] == 1:  # one split: its index
        return stats[0, :, 4].long()
    split = stats[..., 0].argmax(0)
    return stats[..., 4].gather(0, split[None])[0].long()


def combine_stats(stats: torch.Tensor, key: str = "", dtype: torch.dtype = torch.float32,
                  exact: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                  split_lse: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    (:func:`exact_dlogits`) and the others from recomputed fp32 logits.

    ``split_lse``: ``lse`` comes as the pair ``(hi, lo)`` with ``hi + lo = max + log(sum)`` exactly
    (:func:`two_sum`), for fp32 statistics: ``hi`` alone carries a rounding of ~ulp(lse) (~5e-7 at
    lse ~ 8) into every ``z - lse`` of the backward, where the logits ``z`` themselves are exact to
    ~ulp(z - max) after the max is subtracted.
    """
    m_part = stats[..., 0]
    m_local = m_part.amax(0)
    finite = torch.isfinite(m_local)
    m_local = torch.where(finite, m_local, torch.zeros_like(m_local))
    if stats.shape[0] == 1:
        # One split: where its max is finite it is m_local (scale 1, shift 0: s and t as they are);
        # where not, s is NaN (0 for an all -inf row, with t 0) and the results NaN either way.
        s, t = stats[0, :, 1], stats[0, :, 2]
    else:
        s, t = rescale(m_part, stats[..., 1], stats[..., 2], m_local)
        s, t = s.sum(0), t.sum(0)
    tgt = stats[..., 3].sum(0)
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
    if key:
        sums = torch.stack([s, t, tgt])  # one all-reduce for all of them
        m = all_reduce(m_local.clone(), key, "max")
        sums[0], sums[1] = rescale(m_local, sums[0], sums[1], m)
        m_local = m
        s, t, tgt = all_reduce(sums, key)
    log_s = torch.log(s)
    lse = two_sum(m_local.to(dtype), log_s.to(dtype)) if split_lse else (m_local + log_s).to(dtype)
    return lse, ((tgt - m_local) - log_s).to(dtype), (log_s - t / s).to(dtype)


def two_sum(a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)`` with ``hi = fl(a + b)`` and ``hi + lo = a + b`` exactly (Knuth's TwoSum, any
    magnitudes; plain arithmetic in the inputs' dtype)."""
    hi = a + b
    b_virtual = hi - a
    return hi, (a - (hi - b_virtual)) + (b - b_virtual)


# Rows of the fp64 per-token results that the backward takes (``rows [5, N]``).
LSE, ENT, LOGP, ARG, ZARG = range(5)
NUM_ROWS = 5


def row_results(stats, key, hidden, weight, labels, inv_temp: float, vocab_start: int,
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


def exact_dlogits(rows, g_lp, g_ent, inv_temp: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp64 ``[N]`` d loss / d (raw) logit at the target and at the argmax, from ``rows``' fp64 values.

    ``dz_v = g_lp (onehot_v - p_v) - g_ent p_v (log p_v + ent)``, times the temperature factor. At
    the target ``1 - p_t`` is ``-expm1(log p_t)``, so a likely target keeps its digits (``g_lp -
    g_lp p_t`` in fp32 would cancel them); neither entry carries its fp32 logit's rounding.
    """
    lse, ent, lp, z_arg = rows[LSE], rows[ENT], rows[LOGP], rows[ZARG]
    g_lp, g_ent = g_lp.double(), g_ent.double()
    d_t = -g_lp * torch.expm1(lp) - g_ent * torch.exp(lp) * (lp + ent)
    lp_a = z_arg - lse
    d_a = -torch.exp(lp_a) * (g_lp + g_ent * (lp_a + ent))
    return d_t * inv_temp, d_a * inv_temp


def set_exact_entries(dz: torch.Tensor, lab: torch.Tensor, rows, g_lp, g_ent, inv_temp: float) -> torch.Tensor:
    """Overwrite ``dz [C, V]``'s argmax and target entries (the target last: it wins where they
    coincide) with :func:`exact_dlogits`; rows whose target lies in another vocab shard write
    their own entry back (no host sync)."""
    d_t, d_a = exact_dlogits(rows, g_lp, g_ent, inv_temp)
    r = torch.arange(dz.shape[0], device=dz.device)
    dz[r, rows[ARG].long()] = d_a.float()
    inside = (lab >= 0) & (lab < dz.shape[1])
    idx = (r, lab.clamp(0, dz.shape[1] - 1))
    dz.index_put_(idx, torch.where(inside, d_t.float(), dz[idx]))
    return dz


# --------------------------------------------------------------------------- torch backend
def torch_chunk_rows(n_cols: int, n_rows: int, n_buffers: int = 1) -> int:
    """Rows of one torch-backend token chunk: ``n_buffers`` fp32 ``[rows, n_cols]`` buffers within
    TORCH_CHUNK_BYTES (the GPU backend sizes its own: ``linear_log_probs.chunk_rows``)."""
    return max(1, min(n_rows, TORCH_CHUNK_BYTES // (4 * n_buffers * max(n_cols, 1))))


def token_chunks(hidden: torch.Tensor, n_cols: int, two_buffers: bool):
    """Yield ``(rows, fp32 hidden rows, z, e)`` per token chunk; ``z``/``e`` are ``[C, V]`` fp32 views of
    buffers allocated once (``e is z`` unless ``two_buffers``).

    A fresh buffer per chunk would page-fault on first touch of every 4 KiB page, which on a busy
    CPU costs as much as an elementwise pass; reused buffers stay resident.
    """
    n = hidden.shape[0]
    step = torch_chunk_rows(n_cols, n, 2 if two_buffers else 1)
    z_buf = torch.empty((min(step, n), n_cols), dtype=torch.float32, device=hidden.device)
    e_buf = torch.empty_like(z_buf) if two_buffers else z_buf
    for r0 in range(0, n, step):
        c = min(step, n - r0)
        yield slice(r0, r0 + c), hidden[r0:r0 + c].float(), z_buf[:c], e_buf[:c]


def target(z: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
    """``z[i, lab_i]``, 0 where the label lies outside this vocab shard."""
    inside = (lab >= 0) & (lab < z.shape[1])
    return torch.where(inside, z.gather(1, lab.clamp(0, z.shape[1] - 1)[:, None])[:, 0], 0.0)


def logits(x, w32, inv_temp: float, z):
    """fp32 ``x @ w32.T * inv_temp`` into ``z``; the temperature scales the logits, as the reference does."""
    torch.mm(x, w32.t(), out=z)
    return z.mul_(inv_temp) if inv_temp != 1.0 else z


def chunk_stats(x, w32, lab, inv_temp: float, z, e, entropy: bool) -> torch.Tensor:
    """fp64 ``[C, 5]`` row statistics of the logits ``x @ w32.T * inv_temp``.

    Leaves ``z - rowmax`` in ``z`` and, without ``entropy`` (``e`` is then ``z``'s buffer),
    ``exp(z - rowmax)`` in ``e``; with it, ``e`` is scratch.
    """
    tgt = target(logits(x, w32, inv_temp, z), lab)
    m, arg = z.max(1)  # the first index on ties
    torch.exp(z.sub_(m[:, None]), out=e)
    # torch's CPU row sums are cascaded (error ~eps log V), so fp32 keeps log s - t / s's digits
    # without an fp64 copy of the chunk; every term of t has one sign, nothing cancels.
    s = e.sum(1)
    t = e.mul_(z).sum(1) if entropy else torch.zeros_like(s)
    return torch.stack([m.double(), s.double(), t.double(), tgt.double(), arg.double()], dim=1)


def chunk_dlogits(z, e, shift, ent, g_lp, g_ent, inv_temp: float, entropy: bool) -> torch.Tensor:
    """d loss / d logits over the chunk's buffer, given ``e = exp(zc)`` and ``z = zc`` with
    ``log p = zc + shift`` per row (only ``e`` is read without ``entropy``), except at the target
    and argmax entries (:func:`set_exact_entries` writes those).

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


def dlogits_(logp: torch.Tensor, p: torch.Tensor, lab, ent, g_lp, g_ent, inv_temp: float) -> torch.Tensor:
    """d loss / d logits written over ``logp`` (fp32 ``[C, V]``, the logits minus their lse: both parts of
    a split lse, :func:`combine_stats`); ``p = exp(logp)`` the probabilities (npu_ops' path)."""
    logp.add_(ent[:, None]).mul_(g_ent[:, None]).add_(g_lp[:, None]).mul_(p).neg_()
    inside = (lab >= 0) & (lab < logp.shape[1])
    rows = torch.arange(logp.shape[0], device=logp.device)
    logp.index_put_((rows, lab.clamp(0, logp.shape[1] - 1)), torch.where(inside, g_lp, 0.0), accumulate=True)
    return logp.mul_(inv_temp)


def grad_buffers(hidden, weight):
    """fp32 dH and dW; dW's first chunk overwrites it (``beta=0``), so it is zeroed only for N = 0."""
    d_h = torch.empty((hidden.shape[0], hidden.shape[1]), dtype=torch.float32, device=hidden.device)
    alloc = torch.zeros if hidden.shape[0] == 0 else torch.empty
    return d_h, alloc(weight.shape, dtype=torch.float32, device=weight.device)


def live_rows(g_lp: torch.Tensor, g_ent: torch.Tensor) -> torch.Tensor:
    """Tokens with a gradient at all (``g_lp`` or ``g_ent`` nonzero; NaN counts): the others - masked
    away, or clipped - add nothing to dH / dW, not even the NaN of non-finite logits."""
    return (g_lp != 0) | (g_ent != 0)


def accumulate_grads(dz, x, w32, d_h, d_w, sl: slice, live: Optional[torch.Tensor] = None):
    """dH rows of the chunk and dW += dz^T x; ``live``: rows that have a gradient at all."""
    beta = 0 if sl.start == 0 else 1
    if live is not None and not bool(live.all()):
        # Rows with dz = 0 (masked, clipped) add nothing: leave them out of both matmuls, for a [k, V] copy.
        idx = live.nonzero()[:, 0]
        dz, x = dz.index_select(0, idx), x.index_select(0, idx)
        d_h[sl] = 0
        d_h[sl].index_copy_(0, idx, torch.mm(dz, w32))
        d_w.addmm_(dz.t(), x, beta=beta)
        return
    torch.mm(dz, w32, out=d_h[sl])
    d_w.addmm_(dz.t(), x, beta=beta)


def check_linear_inputs(hidden, weight, labels, temperature, process_group, ignore_index=None):
    """Validate; return (vocab_start, group key, bool ``[N]`` of the labels equal to ``ignore_index``,
    or None when there are none: known from the label range, so the common case costs nothing).
    One host sync for the label range (two the first time a tensor holds ``ignore_index``); under
    ``torch.compile`` none: the range is checked on the device."""
    check_tensor("hidden", hidden, ndim=2, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    check_tensor("weight", weight, ndim=2, dtypes=(hidden.dtype,), device=hidden.device,
                 shape=(None, hidden.shape[1]))
    if weight.shape[0] < 1:
        raise ValueError("weight must have at least one vocab row, got shape [0, H]")
    check_tensor("labels", labels, ndim=1, dtypes=(torch.int64, torch.int32), device=hidden.device,
                 shape=(hidden.shape[0],))
    check_float("temperature", temperature, valid=lambda v: v > 0, expected="> 0")
    rank, world = 0, 1
    if process_group is not None:
        import torch.distributed as dist

        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    vocab = weight.shape[0] * world
    if ignore_index is not None:
        ignore_index = check_int("ignore_index", ignore_index)
    ignored = None
    if tracing():  # no range to read: every label in range or ignored, checked on the device
        ok = (labels >= 0) & (labels < vocab)
        if ignore_index is not None:
            ignored = labels == ignore_index
            ok = ok | ignored
        torch._assert_async(ok.all(), f"labels must lie in [0, V) or equal ignore_index={ignore_index} "
                                      "(checked on the device)")
    elif labels.numel():
        lo, hi = value_range(labels)
        if ignore_index is not None and lo <= ignore_index <= hi:
            ignored = labels == ignore_index
            if lo < 0 or hi >= vocab:  # the range without the ignored labels
                lo, hi = value_range_except(labels, ignore_index)
        if lo <= hi and (lo < 0 or hi >= vocab):
            extra = f" (except ignore_index={ignore_index})" if ignore_index is not None else ""
            raise ValueError(f"labels must lie in [0, V) = [0, {vocab}){extra}, got range [{lo}, {hi}]")
    return rank * weight.shape[0], group_key(process_group), ignored
