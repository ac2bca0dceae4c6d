"""lm_head -> log-prob -> DAPO loss in one op, never materialising ``[N, V]``.

The loss of each token is known as soon as its log-prob is, so the op returns ``dH`` / ``dW``
from the forward: the torch path reuses each fp32 logits chunk for the loss and its gradient
(three matmuls in all); the Triton path does the same per row chunk with the pieces of
:mod:`dapo_kernels.ops.linear_log_probs`: fp32 logits by one GEMM, the statistics kernel, the
per-token loss head, dz written over the logits, then dH and dW by two GEMMs (three GEMM units
for forward and backward; the backward only scales them by the upstream gradient).
The per-token loss is :func:`dapo_kernels.ops.policy_loss.pg_token_terms`, aggregated with
:func:`dapo_kernels.ops.policy_loss.aggregation_weights`, in fp64 on ``[N]`` vectors.

The custom op takes lists and returns a tensor; :class:`LossTokens`, :class:`LossParams` and
:class:`LossSums` name their entries, converted at the boundary with ``list(x)`` /
``X._make(list)`` and ``torch.stack(sums)`` / ``LossSums._make(t.unbind())``.
"""
from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch._subclasses.fake_tensor import is_fake

from .._registry import dispatch, register
from .._validation import check_flag, check_float, check_mask, check_tensor
from ._row_stats import (ENT, LOGP, LSE, accumulate_grads, all_reduce, check_linear_inputs, chunk_dlogits,
                         chunk_stats, grad_buffers, live_rows, row_results, set_exact_entries, token_chunks)
from .kl_penalty import KL_TYPES, kl_terms
from .linear_log_probs import grads_chunk, logit_chunks, row_stats_triton, triton_grad_buffers
from .policy_loss import (aggregation_weights, check_agg, check_clips, check_is_weights, is_scaled, metric_sums,
                          metrics_from_counts, pg_token_terms)


# --------------------------------------------------------------------------- op arguments
class LossTokens(NamedTuple):
    """Per-token inputs of the fused loss, ``[N]`` each unless noted; the custom op takes ``list(tokens)``."""
    old_log_prob: torch.Tensor  # empty: on-policy, the old log-probs are this forward's own
    advantages: torch.Tensor
    mask: torch.Tensor  # bool
    weights: torch.Tensor  # fp64 aggregation weights, 1 element (token modes) or N
    ref_log_prob: torch.Tensor  # empty unless kl_coef != 0
    is_weights: torch.Tensor  # rollout IS weights (pg term only); empty: no correction


class LossParams(NamedTuple):
    """Scalars of the fused loss, named as the public arguments; the custom op takes ``list(params)``."""
    temperature: float
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    entropy_coeff: float
    kl_coef: float


class LossSums(NamedTuple):
    """fp64 0-dim sums over the selected tokens, weighted like the loss except the counts and the log-ratio;
    the custom op returns ``torch.stack(sums)``, read back with ``LossSums._make(t.unbind())``."""
    total: torch.Tensor  # the loss: pg - entropy_coeff * entropy + kl_coef * kl
    pg: torch.Tensor
    clipped: torch.Tensor  # count
    clipped_lower: torch.Tensor  # count (dual clip)
    neg_log_ratio: torch.Tensor  # sum of -log(ratio), unweighted
    tokens: torch.Tensor  # count
    entropy: torch.Tensor
    kl: torch.Tensor


_NUM_SUMS = len(LossSums._fields)
_TOTAL = LossSums._fields.index("total")


# --------------------------------------------------------------------------- loss head
class LossHead:
    """Per-token DAPO loss: gradients w.r.t. log-prob / entropy and weighted partial sums."""

    def __init__(self, tokens: LossTokens, params: LossParams, kl_type: str):
        self.tokens, self.params, self.kl_type = tokens, params, kl_type

    def __call__(self, lp: torch.Tensor, ent: torch.Tensor, sl: slice):
        """``(d loss / d lp, d loss / d ent, torch.stack(LossSums))`` for the tokens ``sl``."""
        tok, p = self.tokens, self.params
        mask = tok.mask[sl]
        w = tok.weights if tok.weights.numel() == 1 else tok.weights[sl]
        # On-policy: old = this forward's own log-prob, so the ratio is exactly 1.
        old = tok.old_log_prob[sl] if tok.old_log_prob.numel() else lp
        loss, dl, clip, clip_low, nkl = pg_token_terms(lp, old, tok.advantages[sl], p.clip_ratio_low,
                                                       p.clip_ratio_high, p.clip_ratio_c)
        loss, dl = is_scaled(loss, dl, tok.is_weights[sl] if tok.is_weights.numel() else None)
        # Masked tokens are selected away (torch.where), in the sums and in the gradients: a NaN
        # there reaches neither (NaN * 0 would); fp64 token math and sums, as in policy_loss.
        wm = torch.where(mask, w, 0.0)
        g_lp = wm * dl
        zero = wm.new_zeros(())
        ent_sum, kl_sum, g_ent = zero, zero, torch.zeros_like(lp)
        if p.entropy_coeff:
            ent_sum = torch.where(mask, wm * ent.double(), 0.0).sum()
            g_ent = -p.entropy_coeff * wm
        if p.kl_coef:
            kl_val, kl_grad = kl_terms(lp, tok.ref_log_prob[sl], self.kl_type, torch.float64)
            kl_sum = torch.where(mask, wm * kl_val.double(), 0.0).sum()
            g_lp = g_lp + p.kl_coef * wm * kl_grad
        g_lp = torch.where(mask, g_lp, 0.0)
        pg_sum = torch.where(mask, wm * loss, 0.0).sum()
        total = pg_sum  # the terms whose coefficient is 0 are left out
        if p.entropy_coeff:
            total = total - p.entropy_coeff * ent_sum
        if p.kl_coef:
            total = total + p.kl_coef * kl_sum
        sums = LossSums(total=total, pg=pg_sum,
                        entropy=ent_sum, kl=kl_sum, **metric_sums(mask, clip, clip_low, nkl))
        return g_lp.float(), g_ent.float(), torch.stack(sums)


@register("fused_linear_policy_loss", "torch")
def _fused_torch(hidden, weight, labels, head, inv_temp, vocab_start, key, entropy, compute_grad):
    """One pass over token chunks; each fp32 logits chunk serves the loss and its gradient."""
    n = hidden.shape[0]
    w32 = weight.float()
    log_prob = torch.empty(n, dtype=torch.float32, device=hidden.device)
    ent = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    sums = torch.zeros(_NUM_SUMS, dtype=torch.float64, device=hidden.device)
    if compute_grad:
        d_h, d_w = grad_buffers(hidden, weight)
    else:
        d_h, d_w = hidden.new_empty((0, hidden.shape[1]), dtype=torch.float32), w32.new_empty((0, weight.shape[1]))
    for sl, x, z, e in token_chunks(hidden, weight.shape[0], entropy):
        lab = labels[sl] - vocab_start
        stats = chunk_stats(x, w32, lab, inv_temp, z, e, entropy)
        # fp64 lse, entropy and log-prob: the softmax shift and log p + entropy below keep their
        # digits, and the head's ratio / KL gradient see the log-prob before its fp32 rounding.
        rows = row_results(stats[None], key, hidden[sl], weight, labels[sl], inv_temp, vocab_start, entropy)
        lse, lp, ent_c = rows[LSE], rows[LOGP], rows[ENT]
        log_prob[sl] = lp
        ent[sl] = ent_c
        g_lp, g_ent, part = head(lp, ent_c, sl)
        sums += part
        if compute_grad:
            if entropy:
                torch.exp(z, out=e)
            dz = chunk_dlogits(z, e, stats[:, 0] - lse, ent_c, g_lp, g_ent, inv_temp, entropy)
            set_exact_entries(dz, lab, rows, g_lp, g_ent, inv_temp)
            accumulate_grads(dz, x, w32, d_h, d_w, sl, live_rows(g_lp, g_ent))
    return sums, log_prob, ent, d_h, d_w.to(weight.dtype)


@register("fused_linear_policy_loss", "triton")
def _fused_triton(hidden, weight, labels, head, inv_temp, vocab_start, key, entropy, compute_grad):
    """Per row chunk: the fp32 logits (one GEMM unit), the statistics kernel, the row results and
    the loss head on ``[C]`` vectors, then dz in place and dH / dW (two GEMM units)."""
    n = hidden.shape[0]
    log_prob = torch.empty(n, dtype=torch.float32, device=hidden.device)
    ent = torch.empty(n, dtype=torch.float32, device=hidden.device)
    sums = torch.zeros(_NUM_SUMS, dtype=torch.float64, device=hidden.device)
    if compute_grad:
        d_h, d_w = triton_grad_buffers(hidden, weight)
    else:
        d_h, d_w = hidden.new_empty((0, hidden.shape[1]), dtype=torch.float32), weight.new_empty((0, weight.shape[1]))
    for sl, z in logit_chunks(hidden, weight):
        stats = row_stats_triton(z, labels[sl], inv_temp, vocab_start, entropy)
        # fp64 lse / entropy / log-prob into the head and dz; fp32 outputs.
        rows = row_results(stats[None], key, hidden[sl], weight, labels[sl], inv_temp, vocab_start, entropy)
        log_prob[sl], ent[sl] = rows[LOGP], rows[ENT]
        g_lp, g_ent, part = head(rows[LOGP], rows[ENT], sl)
        sums += part
        if compute_grad:
            grads_chunk(z, hidden[sl], weight, labels[sl], rows, g_lp, g_ent, inv_temp, vocab_start, d_h[sl], d_w,
                        sl.start == 0)
    return sums, log_prob, ent, d_h, d_w


# --------------------------------------------------------------------------- custom op
@torch.library.custom_op("dapo::fused_linear_policy_loss", mutates_args=())
def _fused_op(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, tokens: List[torch.Tensor],
              params: List[float], kl_type: str, vocab_start: int, group: str, entropy: bool, compute_grad: bool
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(``torch.stack(LossSums)`` fp64, log_prob [N], entropy [N], dH, dW); dH/dW are empty unless
    ``compute_grad``. ``tokens`` = ``list(LossTokens)``, ``params`` = ``list(LossParams)``."""
    p = LossParams._make(params)
    head = LossHead(LossTokens._make(tokens), p, kl_type)
    sums, log_prob, ent, d_h, d_w = dispatch("fused_linear_policy_loss", hidden.device)(
        hidden, weight, labels, head, 1.0 / p.temperature, vocab_start, group, entropy, compute_grad)
    return sums, log_prob, ent, all_reduce(d_h, group).to(hidden.dtype), d_w


@_fused_op.register_fake
def _(hidden, weight, labels, tokens, params, kl_type, vocab_start, group, entropy, compute_grad):
    n = hidden.shape[0]
    f32 = dict(dtype=torch.float32)
    d_h = torch.empty_like(hidden) if compute_grad else hidden.new_empty((0, hidden.shape[1]))
    d_w = torch.empty_like(weight) if compute_grad else weight.new_empty((0, weight.shape[1]))
    return (hidden.new_empty((_NUM_SUMS,), dtype=torch.float64), hidden.new_empty((n,), **f32),
            hidden.new_empty((n,), **f32), d_h, d_w)


def _fused_setup(ctx, inputs, output):
    # Only the loss is differentiable: no zero-filled [V, H] cotangent for the dW output.
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    # Detached (no reference cycle through grad_fn), not saved: backward scales them in place and
    # lets go, so autograd can take them as .grad without a copy.
    ctx.grads = [output[3].detach(), output[4].detach()]


def _fused_backward(ctx, g_sums, *_):
    if ctx.grads is None:
        raise RuntimeError("fused_linear_policy_loss computes its gradients in the forward and hands them over "
                           "in the first backward; a second backward (retain_graph) needs a new forward")
    d_h, d_w = ctx.grads
    ctx.grads = None
    if g_sums is None:
        d_h = d_w = None
    else:
        g = LossSums._make(g_sums.unbind()).total  # the only sum the public API differentiates
        if is_fake(d_h):  # traced (torch.compile, opcheck): a graph may not write into a forward output
            d_h, d_w = d_h * g, d_w * g
        else:
            d_h, d_w = d_h.mul_(g), d_w.mul_(g)
    return (d_h, d_w, None, [None] * len(LossTokens._fields), None, None, None, None, None, None)


_fused_op.register_autograd(_fused_backward, setup_context=_fused_setup)


# --------------------------------------------------------------------------- public API
def _check_token_inputs(n: int, hidden, old_log_prob, advantages, response_mask, ref_log_prob, kl_coef, kl_type):
    for name, t in (("old_log_prob", old_log_prob), ("advantages", advantages)):
        if t is not None or name != "old_log_prob":
            check_tensor(name, t, dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
                         device=hidden.device, shape=(n,))
    mask = check_mask("response_mask", response_mask, device=advantages.device, shape=tuple(advantages.shape))
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
    old_log_prob: Optional[torch.Tensor],
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
    rollout_is_weights: Optional[torch.Tensor] = None,
    entropy_coeff: float = 0.0,
    ref_log_prob: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
    kl_type: str = "low_var_kl",
    process_group=None,
    calculate_entropy: bool = False,
    ignore_index: Optional[int] = -100,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """lm_head -> log-prob -> DAPO loss in one op: ``pg_loss - entropy_coeff * agg(entropy) + kl_coef * agg(kl)``.

    ``hidden [N, H]``, ``weight [V, H]``, ``labels [N]``, ``temperature`` and ``process_group``
    as in :func:`linear_log_probs`; ``old_log_prob``, ``advantages``, ``ref_log_prob`` float
    ``[N]``, ``response_mask`` ``[N]`` (bool, integer or float 0 / 1, as in :func:`dapo_kernels.policy_loss`);
    the loss arguments as in
    :func:`dapo_kernels.policy_loss` (``cu_seqlens`` ``[B+1]`` for the seq modes; the entropy and
    kl terms use the same aggregation, as verl's actor does). ``kl_type`` in ``KL_TYPES``.
    ``old_log_prob=None`` is the on-policy update (one epoch over one mini-batch): the old
    log-probs are this forward's own, detached, so the ratio is exactly 1 and no separate
    log-prob pass is needed. ``calculate_entropy`` computes the entropy (for metrics) even when
    ``entropy_coeff`` is 0. Tokens whose label is ``ignore_index`` (default -100; None: none) are
    masked out as ``response_mask`` would (no loss, no gradient, not counted) and get ``log_prob``
    and ``entropy`` 0. ``rollout_is_weights`` (float ``[N]``, optional; e.g. ``dk.rollout_correction``'s,
    with its masked ``response_mask``) scale each token's policy-gradient term before the
    aggregation, as in :func:`dapo_kernels.policy_loss` (constants; not the entropy / KL terms nor
    the metrics, as verl; values not checked).

    Returns ``loss`` (fp32 0-dim; gradients for ``hidden`` and ``weight``, computed during the
    forward when grad is enabled) and detached ``metrics``: ``pg_clipfrac``,
    ``pg_clipfrac_lower``, ``ppo_kl``, ``pg_loss``, ``log_prob`` ``[N]``, plus ``entropy``
    ``[N]`` when ``entropy_coeff != 0`` or ``calculate_entropy``, ``entropy_loss`` when
    ``entropy_coeff != 0``, ``kl_loss`` when ``kl_coef != 0``.

    NaN / inf as :func:`dapo_kernels.policy_loss` and :func:`linear_log_probs`: NaN in a selected
    token's inputs (or in ``weight``) gives a NaN loss; a masked token is selected away, so a NaN
    there reaches only its own ``log_prob`` / ``entropy`` metric, not the loss nor the gradients.
    """
    vocab_start, key, ignored = check_linear_inputs(hidden, weight, labels, temperature, process_group, ignore_index)
    n = hidden.shape[0]
    # Before the token inputs: kl_coef decides whether ref_log_prob is needed.
    entropy_coeff, kl_coef = (check_float(name, v, valid=math.isfinite, expected="finite")
                              for name, v in (("entropy_coeff", entropy_coeff), ("kl_coef", kl_coef)))
    mask = _check_token_inputs(n, hidden, old_log_prob, advantages, response_mask, ref_log_prob, kl_coef, kl_type)
    is_w = check_is_weights(rollout_is_weights, advantages)
    if ignored is not None:
        labels, mask = labels.masked_fill(ignored, 0), mask & ~ignored
    clip_ratio_low, clip_ratio_high, clip_ratio_c = check_clips(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    check_agg(loss_agg_mode, advantages, cu_seqlens)
    w = aggregation_weights(mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, cu_seqlens=cu_seqlens,
                            loss_scale_factor=loss_scale_factor)
    ref = ref_log_prob if (kl_coef and ref_log_prob is not None) else advantages.new_zeros(0)
    old = advantages.new_zeros(0) if old_log_prob is None else old_log_prob
    tokens = LossTokens(old_log_prob=old.contiguous(), advantages=advantages.contiguous(), mask=mask.contiguous(),
                        weights=w, ref_log_prob=ref.contiguous(),
                        is_weights=advantages.new_zeros(0) if is_w is None else is_w)
    params = LossParams(temperature=float(temperature), clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                        clip_ratio_c=clip_ratio_c, entropy_coeff=float(entropy_coeff), kl_coef=float(kl_coef))
    compute_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    entropy = bool(entropy_coeff) or check_flag("calculate_entropy", calculate_entropy)
    stacked, log_prob, ent, _, _ = _fused_op(hidden, weight, labels, list(tokens), list(params), kl_type,
                                             vocab_start, key, entropy, compute_grad)
    # Only the total is differentiated: the metrics come from a detached copy (no autograd nodes recorded).
    sums = LossSums._make(stacked.detach().unbind())
    metrics = metrics_from_counts(sums.clipped, sums.clipped_lower, sums.neg_log_ratio, sums.tokens)
    if ignored is not None:
        log_prob, ent = log_prob.masked_fill(ignored, 0.0), ent.masked_fill(ignored, 0.0)
    metrics.update(pg_loss=sums.pg.detach().float(), log_prob=log_prob.detach())
    if entropy:
        metrics["entropy"] = ent.detach()
    if entropy_coeff:
        metrics["entropy_loss"] = sums.entropy.detach().float()
    if kl_coef:
        metrics["kl_loss"] = sums.kl.detach().float()
    return stacked[_TOTAL].float(), metrics
