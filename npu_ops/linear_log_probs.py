"""``linear_log_probs`` / ``fused_linear_policy_loss`` on Ascend: chunked torch, fp32 statistics.

Kernels for the ``privateuseone`` key of ``dapo::linear_log_probs``,
``dapo::linear_log_probs_bwd`` and ``dapo::fused_linear_policy_loss`` (same signatures
and results as the ops' torch path). The formulation is the torch path's: tiles of
tokens, one ``[chunk, V]`` fp32 logits matmul each (the cube unit's work), online row
statistics combined by :func:`dapo_kernels.backend_api.combine_stats`, never an
``[N, V]`` tensor. Two things differ, both for the NPU:

* Row sums stay in fp32. The CPU path sums ``[chunk, V]`` terms in fp64, but Ascend's
  vector unit has no fp64 arithmetic (torch_npu would run it on the AI CPU, if at all);
  fp32 sums of ``V`` terms in ``[0, 1]`` keep ~1e-7 * sqrt(V) relative error.
* Chunks are sized for device memory (``CHUNK_BYTES`` of fp32 logits, ~3 such buffers
  live), not for a CPU cache, so each matmul is large.

``torch_npu.npu_cross_entropy_loss`` is not used: besides the loss it always returns the
``[N, C]`` log-probs of its input (API reference, "torch_npu.npu_cross_entropy_loss"),
gives no entropy, and whether it beats the matmul + reductions per chunk is unmeasured.

The per-token loss head (``LossHead``, fp64 on ``[N]`` vectors) is the op's own, from
:mod:`dapo_kernels.backend_api`.
"""
from __future__ import annotations

import torch

from dapo_kernels.backend_api import LossHead, LossParams, LossTokens, all_reduce, combine_stats, dlogits_

# fp32 logits per chunk: large matmuls for the cube unit, ~3 such buffers far below device memory
# (sizing in dapo_kernels/ops/NOTES_fused_loss.md).
CHUNK_BYTES = 512 << 20


def _chunk_rows(n_cols: int, n_rows: int) -> int:
    return max(1, min(n_rows, CHUNK_BYTES // (4 * max(n_cols, 1))))


def _row_stats(z: torch.Tensor, lab: torch.Tensor, entropy: bool):
    """fp32 ``[C, 4]`` (row max, sum exp(z - max), sum exp(z - max) (z - max), target logit)
    of a logits chunk, and ``exp(z - max)`` for the gradient."""
    m = z.amax(1)
    zc = z - m[:, None]
    e = torch.exp(zc)
    s = e.sum(1)
    t = zc.mul_(e).sum(1) if entropy else torch.zeros_like(s)
    inside = (lab >= 0) & (lab < z.shape[1])  # labels of another rank's vocab shard
    tgt = torch.where(inside, z.gather(1, lab.clamp(0, z.shape[1] - 1)[:, None])[:, 0], 0.0)
    return torch.stack([m, s, t, tgt], dim=1), e


def _logits(x: torch.Tensor, w32: torch.Tensor, inv_temp: float) -> torch.Tensor:
    return torch.mm(x.float(), w32.t()).mul_(inv_temp)


def linear_log_probs(hidden, weight, labels, temperature, entropy, vocab_start, group):
    """fp32 ``[N]`` log_prob and entropy (or zeros), and ``[5, N]`` rows for the backward (lse, entropy,
    log_prob, lse's low part - ``combine_stats(split_lse=True)`` - and zeros), fp64 by the op's
    contract (here fp32 values: the statistics are fp32 on the NPU)."""
    n, v = hidden.shape[0], weight.shape[0]
    w32 = weight.float()
    stats = hidden.new_empty((1, n, 4), dtype=torch.float32)
    step = _chunk_rows(v, n)
    for r0 in range(0, n, step):
        z = _logits(hidden[r0:r0 + step], w32, 1.0 / temperature)
        stats[0, r0:r0 + step] = _row_stats(z, labels[r0:r0 + step] - vocab_start, entropy)[0]
    (lse, lse_lo), log_prob, ent = combine_stats(stats, group, split_lse=True)
    ent = ent if entropy else torch.zeros_like(lse)
    return log_prob, ent, torch.stack([lse, ent, log_prob, lse_lo, torch.zeros_like(lse)]).double()


def linear_log_probs_bwd(hidden, weight, labels, rows, g_lp, g_ent, temperature, vocab_start, group):
    """``(dH in hidden's dtype, all-reduced over group; dW of this vocab shard)``, logits recomputed per chunk.

    Only ``rows``' lse (both parts) and entropy are read: with fp32 statistics, the target entry comes from the
    recomputed logits like every other one (the CUDA / CPU paths refine it and the argmax's in fp64)."""
    n, v = hidden.shape[0], weight.shape[0]
    inv_temp = 1.0 / temperature
    lse, ent, lse_lo = rows[0].float(), rows[1].float(), rows[3].float()  # fp64 by contract; fp32 math here
    w32 = weight.float()
    d_h = hidden.new_empty(hidden.shape, dtype=torch.float32)
    d_w = torch.zeros_like(w32)
    step = _chunk_rows(v, n)
    for r0 in range(0, n, step):
        sl = slice(r0, r0 + step)
        x = hidden[sl].float()
        z = _logits(x, w32, inv_temp)
        logp = z.sub_(lse[sl, None]).sub_(lse_lo[sl, None])
        dz = dlogits_(logp, torch.exp(logp), labels[sl] - vocab_start, ent[sl], g_lp[sl], g_ent[sl], inv_temp)
        torch.mm(dz, w32, out=d_h[sl])
        d_w.addmm_(dz.t(), x)
    return all_reduce(d_h, group).to(hidden.dtype), d_w.to(weight.dtype)


def fused_linear_policy_loss(hidden, weight, labels, tokens, params, kl_type, vocab_start, group, entropy,
                             compute_grad):
    """``(torch.stack(LossSums) fp64, log_prob, entropy, dH, dW)``; one pass, each logits chunk serves loss and
    gradient. ``tokens`` / ``params`` are the custom op's lists of ``LossTokens`` / ``LossParams``."""
    params = LossParams._make(params)
    head = LossHead(LossTokens._make(tokens), params, kl_type)
    (n, h), v = hidden.shape, weight.shape[0]
    inv_temp = 1.0 / params.temperature
    w32 = weight.float()
    log_prob = hidden.new_empty((n,), dtype=torch.float32)
    ent = hidden.new_zeros((n,), dtype=torch.float32)
    sums = None
    d_h = hidden.new_empty((n, h) if compute_grad else (0, h), dtype=torch.float32)
    d_w = torch.zeros_like(w32) if compute_grad else w32.new_zeros((0, h))
    step = _chunk_rows(v, n)
    for r0 in range(0, n, step):
        sl = slice(r0, r0 + step)
        x = hidden[sl].float()
        lab = labels[sl] - vocab_start
        z = _logits(x, w32, inv_temp)
        stats, e = _row_stats(z, lab, entropy)
        (lse, lse_lo), log_prob[sl], ent_c = combine_stats(stats[None], group, split_lse=True)
        if entropy:
            ent[sl] = ent_c
        g_lp, g_ent, part = head(log_prob[sl], ent[sl], sl)
        sums = part if sums is None else sums + part
        if compute_grad:
            p = e.mul_(torch.exp((stats[:, 0] - lse) - lse_lo)[:, None])
            dz = dlogits_(z.sub_(lse[:, None]).sub_(lse_lo[:, None]), p, lab, ent[sl], g_lp, g_ent, inv_temp)
            torch.mm(dz, w32, out=d_h[sl])
            d_w.addmm_(dz.t(), x)
    if sums is None:  # no tokens: the head's sums of nothing
        _, _, sums = head(log_prob, ent, slice(None))
    return sums, log_prob, ent, all_reduce(d_h, group).to(hidden.dtype), d_w.to(weight.dtype)
