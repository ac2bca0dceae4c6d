"""Fused lm_head -> log-prob (+ entropy), never materialising ``[N, V]``.

The math (fp32-accumulated logits, fp64 row results, the exact target / argmax logits) is in
:mod:`dapo_kernels.ops._row_stats`, shared with :mod:`dapo_kernels.ops.fused_linear_policy_loss`.

Backends: ``torch`` (CPU) walks chunks of tokens with a ``[chunk, V]`` fp32 logits buffer;
``triton`` (CUDA) reduces the statistics in one kernel over ``tokens x vocab`` tiles, and
its backward recomputes logits tiles into ``dz`` for a chunk of the vocabulary, then does
``dW`` and ``dH`` with tensor-core matmuls. ``fused_linear_policy_loss`` knows its per-token
gradient as soon as a token's log-prob is known, so it returns ``dH``/``dW`` from the
forward (torch: the logits chunk is reused, three matmuls in all).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .._alloc import empty_output
from .._registry import dispatch, register
from ._row_stats import (ARG, ENT, LOGP, LSE, NUM_ROWS, NUM_STATS, accumulate_grads, all_reduce, chunk_dlogits,
                         chunk_stats, check_linear_inputs, exact_dlogits, grad_buffers, live_rows, logits,
                         row_results, set_exact_entries, token_chunks)
from ._triton_utils import INTERPRET, cdiv

# GPU backward: one vocab chunk's dz buffer, large enough for full-size cuBLAS matmuls, bounded so the
# workspace (workspace_bytes) stays under 1 GB at production sizes (NOTES_fused_loss.md).
_TRITON_DZ_BYTES = 1 << 28
# Grouped program order: the hidden rows of the programs in flight (<= this) stay in L2 while the vocab
# tiles stream past them, instead of being re-read from HBM per tile (NOTES_fused_loss.md).
_GROUP_BYTES = 16 << 20
# 64 x 128 fp32 accumulator over 8 warps; fp32 inputs step K by 16, as their register-held IEEE
# operand tiles spill at larger steps (NOTES_fused_loss.md, benchmarks/gpu/aot.py).
_BLOCK_M, _BLOCK_V = 64, 128
_BLOCK_K = {torch.float16: 64, torch.bfloat16: 64, torch.float32: 16}
_NUM_WARPS = 8


# --------------------------------------------------------------------------- kernels
@triton.jit
def _grouped_pid(i_pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(row block, column) of program ``i_pid`` in grouped order: ``GROUP_M`` row blocks walk all
    ``num_n`` columns before the next group starts; rows fastest inside a group."""
    i_g = i_pid // (GROUP_M * num_n)
    first_m = i_g * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    i_in = i_pid % (GROUP_M * num_n)
    return first_m + i_in % size_m, i_in // size_m


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
    p_h, p_w, p_lab, p_stats, N, V, H, vocab_start, inv_temp, tiles_per_split, num_splits,
    ENTROPY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, NUM_STATS: tl.constexpr,
):
    """Online row statistics over this program's vocab split -> stats[i_s, rows, 0:NUM_STATS]."""
    i_m, i_s = _grouped_pid(tl.program_id(0), tl.cdiv(N, BLOCK_M), num_splits, GROUP_M)
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
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """dz[:, v - v0] = d loss / d logits for vocab columns [v0, v0 + n_cols), recomputed.

    ``lse`` and ``c = lse - entropy`` come as fp32 pairs ``hi + lo`` of their fp64 values, so that
    ``log p = (z - lse_hi) - lse_lo`` and ``log p + entropy = (z - c_hi) - c_lo`` carry only fp32
    roundings relative to their own (small, where p is large) size: an fp32 ``lse`` or ``entropy``
    would be off by up to half an ulp of ~log V, the same for every entry of a row (a coherent
    error in dH / dW, and one that differs between vocab-sharded and unsharded runs). ``g_lp`` /
    ``g_ent`` come with the temperature folded in (fp64, rounded once). The target entry is
    ``dzt`` and the argmax entry (``arg``, local index) ``dza`` (fp32 ``[N]`` each, from their
    fp64 logits), not recomputed from fp32 logits. Rows whose ``g_lp`` and ``g_ent`` are both 0
    get ``dz = 0``.
    """
    i_m, i_v = _grouped_pid(tl.program_id(0), tl.cdiv(N, BLOCK_M), tl.cdiv(n_cols, BLOCK_V), GROUP_M)
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
    # A token without incoming gradient (masked away) has dz = 0 even where its logits are NaN.
    b_dz = tl.where(((b_glp != 0) | (b_gent != 0))[:, None], b_dz, 0.0)
    tl.store(p_dz + o_m[:, None] * n_cols + o_c[None, :], b_dz.to(p_dz.dtype.element_ty),
             mask=m_m[:, None] & m_v[None, :])


# --------------------------------------------------------------------------- torch backend
@register("linear_log_probs_stats", "torch")
def _stats_torch(hidden, weight, labels, inv_temp, vocab_start, entropy):
    w32 = weight.float()
    stats = torch.empty((1, hidden.shape[0], NUM_STATS), dtype=torch.float64, device=hidden.device)
    for sl, x, z, e in token_chunks(hidden, weight.shape[0], entropy):
        stats[0, sl] = chunk_stats(x, w32, labels[sl] - vocab_start, inv_temp, z, e, entropy)
    return stats


@register("linear_log_probs_grads", "torch")
def _grads_torch(hidden, weight, labels, inv_temp, vocab_start, rows, g_lp, g_ent):
    """(dH fp32 [N, H], dW [V, H]) by recomputing fp32 logits chunk by chunk.

    ``rows`` fp64 ``[5, N]`` from :func:`row_results`: the logits are shifted by ``lse`` rounded to
    fp32, and the rest of it, ``shift = fp32(lse) - lse`` (fp64), goes into the per-row factors, so
    ``log p`` carries no row-coherent rounding of ``lse`` (nor ``log p + ent`` one of ``ent``).
    """
    w32 = weight.float()
    entropy = bool(g_ent.any())
    lse, ent = rows[LSE], rows[ENT]
    lse32 = lse.float()
    shift = lse32.double() - lse
    d_h, d_w = grad_buffers(hidden, weight)
    for sl, x, z, e in token_chunks(hidden, weight.shape[0], entropy):
        torch.exp(logits(x, w32, inv_temp, z).sub_(lse32[sl, None]), out=e)  # z = log p - shift, e = p / exp(shift)
        dz = chunk_dlogits(z, e, shift[sl], ent[sl], g_lp[sl], g_ent[sl], inv_temp, entropy)
        set_exact_entries(dz, labels[sl] - vocab_start, rows[:, sl], g_lp[sl], g_ent[sl], inv_temp)
        accumulate_grads(dz, x, w32, d_h, d_w, sl, live_rows(g_lp[sl], g_ent[sl]))
    return d_h, d_w.to(weight.dtype)


# --------------------------------------------------------------------------- triton backend
def _dot_flags(dtype: torch.dtype):
    # fp32 inputs: exact fp32 products (tf32 would cost ~1e-3 of logit); the 3.9
    # interpreter multiplies raw bits for 16-bit dot operands, so it gets fp32 ones.
    return dict(UPCAST=INTERPRET, PRECISION="ieee" if dtype == torch.float32 else "tf32")


def _group_m(hidden: torch.Tensor) -> int:
    """Row blocks per group of the grouped program order (see _GROUP_BYTES)."""
    return max(1, _GROUP_BYTES // (_BLOCK_M * hidden.shape[1] * hidden.element_size()))


def _num_splits(n_row_blocks: int, n_tiles: int, device: torch.device) -> int:
    if device.type != "cuda":
        return min(n_tiles, 2)  # interpreter: exercise the split combine, keep programs few
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(n_tiles, cdiv(4 * sms, n_row_blocks)))


@register("linear_log_probs_stats", "triton")
def stats_triton(hidden, weight, labels, inv_temp, vocab_start, entropy):
    # The kernels address all three as dense ([N, H], [V, H], [N]).
    hidden, weight, labels = hidden.contiguous(), weight.contiguous(), labels.contiguous()
    (n, h), v = hidden.shape, weight.shape[0]
    n_tiles = cdiv(v, _BLOCK_V)
    splits = _num_splits(cdiv(n, _BLOCK_M), n_tiles, hidden.device)
    per_split = cdiv(n_tiles, splits)
    splits = cdiv(n_tiles, per_split)
    stats = empty_output((splits, n, NUM_STATS), dtype=torch.float64, device=hidden.device)
    if n:
        _linear_log_probs_fwd_kernel[(cdiv(n, _BLOCK_M) * splits,)](
            hidden, weight, labels, stats, n, v, h, vocab_start, inv_temp, per_split, splits,
            ENTROPY=entropy, BLOCK_M=_BLOCK_M, BLOCK_V=_BLOCK_V, BLOCK_K=_BLOCK_K[hidden.dtype],
            GROUP_M=_group_m(hidden), NUM_STATS=NUM_STATS, num_warps=_NUM_WARPS, **_dot_flags(hidden.dtype),
        )
    return stats


def _hi_lo(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp64 ``x`` as fp32 ``hi + lo`` (``hi`` = x rounded, ``lo`` = the rest rounded: ~48 bits)."""
    x = x.double()
    hi = x.float()
    return hi.contiguous(), (x - hi.double()).float().contiguous()


@register("linear_log_probs_grads", "triton")
def grads_triton(hidden, weight, labels, inv_temp, vocab_start, rows, g_lp, g_ent):
    """dz per vocab chunk (Triton, recomputed logits), then dW rows and dH with cuBLAS; ``rows`` fp64
    ``[5, N]`` from :func:`row_results` (lse and lse - entropy go to the kernel as fp32 hi / lo pairs)."""
    hidden, weight, labels = hidden.contiguous(), weight.contiguous(), labels.contiguous()
    (n, h), v = hidden.shape, weight.shape[0]
    cols = _dz_cols(n, hidden.element_size())
    d_w = empty_output(weight.shape, dtype=weight.dtype, device=weight.device)
    d_h = torch.zeros((n, h), dtype=torch.float32, device=hidden.device)
    args = [rows[ARG].long(), *_hi_lo(rows[LSE]), *_hi_lo(rows[LSE] - rows[ENT]),
            *((g.double() * inv_temp).float().contiguous() for g in (g_lp, g_ent)),
            *(d.float().contiguous() for d in exact_dlogits(rows, g_lp, g_ent, inv_temp))]
    # Tokens without incoming gradient (dz = 0) stay out of both products, as the torch path leaves
    # them out: a NaN in their hidden row (or in the weight) must not reach dW (dH) through NaN * 0.
    dead = ~live_rows(g_lp, g_ent)[:, None]
    hidden_live = hidden.masked_fill(dead, 0)
    for v0 in range(0, v, cols):
        nc = min(cols, v - v0)
        dz = empty_output((n, nc), dtype=hidden.dtype, device=hidden.device)
        if n:
            _linear_log_probs_bwd_kernel[(cdiv(n, _BLOCK_M) * cdiv(nc, _BLOCK_V),)](
                hidden, weight, labels, *args, dz, n, v, h, vocab_start, inv_temp, v0, nc,
                BLOCK_M=_BLOCK_M, BLOCK_V=_BLOCK_V, BLOCK_K=_BLOCK_K[hidden.dtype], GROUP_M=_group_m(hidden),
                num_warps=_NUM_WARPS, **_dot_flags(hidden.dtype),
            )
        torch.mm(dz.t(), hidden_live, out=d_w[v0:v0 + nc])
        d_h = _add_mm_fp32(d_h, dz, weight[v0:v0 + nc])
    return d_h.masked_fill_(dead, 0), d_w


def _dz_cols(n: int, item: int) -> int:
    """Vocab columns of one dz chunk of the gradient pass: _TRITON_DZ_BYTES of ``n`` rows, whole tiles."""
    return max(_BLOCK_V, _TRITON_DZ_BYTES // (item * max(n, 1)) // _BLOCK_V * _BLOCK_V)


def _add_mm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc + a @ b`` with the product accumulated and added in fp32 (``acc`` fp32), never rounded
    to ``a``'s 16-bit dtype: cuBLAS' fp32-output GEMM (``out_dtype``) where torch has one for the
    device, else fp32 copies of the operands. dH sums every vocab chunk's product this way."""
    if a.dtype != torch.float32 and a.is_cuda and hasattr(torch.ops.aten.addmm, "dtype"):
        return torch.addmm(acc, a, b, out_dtype=torch.float32)
    return acc.addmm_(a.float(), b.float())


def workspace_bytes(n: int, h: int, v: int, dtype: torch.dtype) -> int:
    """Bytes the Triton gradient pass allocates beyond the returned dH / dW: one dz chunk, the
    fp32 dH accumulator and the addmm result replacing it, the masked hidden copy, the fp64
    statistics and the small per-row vectors. gpu_check compares it with the measured peak."""
    item = torch.empty((), dtype=dtype).element_size()
    cols = min(v, _dz_cols(n, item))  # the last chunk of a smaller vocab is all of it
    return n * cols * item + 2 * n * h * 4 + n * h * item + n * 8 * (NUM_STATS * 4 + 16)


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("dapo::linear_log_probs", mutates_args=())
def _linear_log_probs_op(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                         entropy: bool, vocab_start: int, group: str
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``[N]`` log_prob, fp32 ``[N]`` entropy (zeros unless ``entropy``), and the fp64 ``[5, N]``
    rows of :func:`row_results` for the backward: rounded to fp32 there, lse / entropy would be off
    by up to half an ulp of ~log V, the same for every vocab entry of a row (a coherent error in dH
    / dW), and the target / argmax entries would lose their fp64 logits' digits."""
    stats = dispatch("linear_log_probs_stats", hidden.device)(hidden, weight, labels, 1.0 / temperature,
                                                              vocab_start, entropy)
    rows = row_results(stats, group, hidden, weight, labels, 1.0 / temperature, vocab_start, entropy)
    return rows[LOGP].float(), rows[ENT].float(), rows


@_linear_log_probs_op.register_fake
def _(hidden, weight, labels, temperature, entropy, vocab_start, group):
    n = hidden.shape[0]
    return (hidden.new_empty((n,), dtype=torch.float32), hidden.new_empty((n,), dtype=torch.float32),
            hidden.new_empty((NUM_ROWS, n), dtype=torch.float64))


@torch.library.custom_op("dapo::linear_log_probs_bwd", mutates_args=())
def _linear_log_probs_bwd_op(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor,
                             g_lp: torch.Tensor, g_ent: torch.Tensor, temperature: float, vocab_start: int,
                             group: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dH in hidden's dtype, summed over the group; dW of the local vocab shard); ``rows`` the fp64
    ``[5, N]`` saved by the forward."""
    d_h, d_w = dispatch("linear_log_probs_grads", hidden.device)(hidden, weight, labels, 1.0 / temperature,
                                                                 vocab_start, rows, g_lp, g_ent)
    return all_reduce(d_h, group).to(hidden.dtype), d_w


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


# --------------------------------------------------------------------------- public API
def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    process_group=None,
    ignore_index: Optional[int] = -100,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probability of ``labels`` under ``softmax(hidden @ weight.T / temperature)``, without ``[N, V]``.

    Args:
        hidden: ``[N, H]`` fp16/bf16/fp32 (packed tokens).
        weight: ``[V, H]`` lm_head, same dtype; with ``process_group``, this rank's vocab shard
            (Megatron vocab-parallel: rank ``r`` holds rows ``[r*V, (r+1)*V)`` of the full head).
        labels: ``[N]`` int64 (or int32) token ids in ``[0, V_total)``, or ``ignore_index``.
        temperature: logits are divided by it (> 0).
        return_entropy: also return the entropy of the distribution.
        process_group: optional ``torch.distributed`` group over which ``weight`` is sharded by
            vocab; the results equal the unsharded ones. ``hidden``'s gradient is all-reduced
            over the group (do not add a Megatron copy-to-TP-region on top).
        ignore_index: label of tokens to skip (default -100, as transformers and Liger; None:
            none): their ``log_prob`` and ``entropy`` are 0 and they add nothing to the gradients.

    Returns:
        ``log_prob`` fp32 ``[N]`` and ``entropy`` fp32 ``[N]`` (or None), from fp32-accumulated
        logits. Differentiable w.r.t. ``hidden`` and ``weight`` through both outputs.

    NaN / inf follow the logits as in torch's ``log_softmax`` (a NaN in a ``hidden`` row makes that
    token's outputs NaN, one in ``weight`` every token's), except that a token whose incoming
    gradients are both zero adds nothing to ``dH`` / ``dW``, so a token masked away downstream
    cannot poison them.
    """
    vocab_start, key, ignored = check_linear_inputs(hidden, weight, labels, temperature, process_group, ignore_index)
    if ignored is not None:
        labels = labels.masked_fill(ignored, 0)  # any in-range id: the outputs are zeroed below
    log_prob, ent, _ = _linear_log_probs_op(hidden, weight, labels, float(temperature), bool(return_entropy),
                                               vocab_start, key)
    if ignored is not None:  # zeroed outputs pass no gradient back: the op's backward skips those rows
        log_prob, ent = log_prob.masked_fill(ignored, 0.0), ent.masked_fill(ignored, 0.0)
    return log_prob, (ent if return_entropy else None)
