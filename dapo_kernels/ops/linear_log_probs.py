"""Fused lm_head -> log-prob (+ entropy), never materialising ``[N, V]``.

The math (fp32-accumulated logits, fp64 row results, the exact target / argmax logits) is in
:mod:`dapo_kernels.ops._row_stats`, shared with :mod:`dapo_kernels.ops.fused_linear_policy_loss`.

Backends: ``torch`` (CPU) walks chunks of tokens with a ``[chunk, V]`` fp32 logits buffer;
``triton`` (CUDA) walks row chunks too, in three GEMM units for a gradient: per chunk the fp32
logits by one matmul (cuBLAS' fp32-output GEMM of the 16-bit operands), the row statistics and
then ``dz`` by two elementwise Triton kernels over that buffer (``dz`` written over the logits
in place), then ``dH`` and ``dW`` by two matmuls. ``fused_linear_policy_loss`` knows each token's
gradient once its log-prob is known, so it runs all three per chunk in its forward.
``linear_log_probs``' upstream gradient is unknown in the forward: its forward is one unit, its
backward recomputes the logits (three units: four with the forward; NOTES_fused_loss.md).
"""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch
import triton
import triton.language as tl

from .._alloc import empty_output
from .._registry import dispatch, register
from ._row_stats import (ARG, ENT, LOGP, LSE, NUM_ROWS, NUM_STATS, accumulate_grads, all_reduce, chunk_dlogits,
                         chunk_stats, check_linear_inputs, exact_dlogits, grad_buffers, live_rows,
                         logits, row_results, set_exact_entries, token_chunks)
from ._triton_utils import INTERPRET, TL_DTYPES, cdiv, next_pow2

# GPU row chunk: its fp32 logits [C, V] (dz written over them) take at most this, so the workspace
# (workspace_bytes) stays under 1 GB at N = 16k, H = 4096, V = 152k (NOTES_fused_loss.md).
_CHUNK_BYTES = 640 << 20
# Chunk rows in multiples of this (cuBLAS' output tiles), when the budget allows as many.
_CHUNK_ALIGN = 128
# One row per program: a chunk of ~1k rows gives every SM several programs streaming their row;
# the interpreter pays per program, so it takes 16 rows at a time.
_ROWS_PER_PROGRAM = 16 if INTERPRET else 1
_MAX_BLOCK_V = 1024 if INTERPRET else 4096
_NUM_WARPS = 8


# --------------------------------------------------------------------------- kernels
@triton.jit
def _logits_stats_kernel(
    p_z, p_lab, p_stats, N, V, stride_z, vocab_start, inv_temp,
    ENTROPY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Row statistics of the fp32 logits ``z[rows, :V] * inv_temp`` -> ``stats[rows, 0:5]`` (fp64):
    max, sum exp(z - max), sum exp(z - max) (z - max), target logit, argmax (first on ties)."""
    o_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    m_m = o_m < N
    b_lab = tl.load(p_lab + o_m, mask=m_m, other=-1).to(tl.int64) - vocab_start
    b_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # fp64 running sums: one add per row per tile, and log s - t / s keeps its digits.
    b_sum = tl.zeros([BLOCK_M], dtype=tl.float64)
    b_t = tl.zeros([BLOCK_M], dtype=tl.float64)
    b_tgt = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_arg = tl.zeros([BLOCK_M], dtype=tl.int64)
    for v0 in range(0, V, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        m_v = o_v < V
        b_z = tl.load(p_z + o_m[:, None] * stride_z + o_v[None, :], mask=m_m[:, None] & m_v[None, :], other=0)
        b_z = tl.where(m_v[None, :], b_z * inv_temp, float("-inf"))
        b_tgt += tl.sum(tl.where(o_v[None, :] == b_lab[:, None], b_z, 0.0), axis=1)
        b_tile_max, b_tile_arg = tl.max(b_z, axis=1, return_indices=True, return_indices_tie_break_left=True)
        # Strictly greater: an equal max in a later tile keeps the first index.
        b_arg = tl.where(b_tile_max > b_max, v0 + b_tile_arg.to(tl.int64), b_arg)
        b_new = tl.maximum(b_max, b_tile_max)
        b_ref = tl.where(b_new == float("-inf"), 0.0, b_new)  # all -inf so far: shift by 0
        b_scale = tl.exp(b_max - b_ref).to(tl.float64)
        b_p = tl.exp(b_z - b_ref[:, None])
        if ENTROPY:
            # t moves with the max: t' = scale * (t + (m_old - m_new) * s_old).
            b_shift = (tl.where(b_max == float("-inf"), b_ref, b_max) - b_ref).to(tl.float64) * b_sum
            b_zc = tl.where(m_v[None, :], b_z - b_ref[:, None], 0.0)
            b_t = (b_t + b_shift) * b_scale + tl.sum(b_p * b_zc, axis=1).to(tl.float64)
        b_sum = b_sum * b_scale + tl.sum(b_p, axis=1).to(tl.float64)
        b_max = b_new
    p_out = p_stats + o_m * 5
    tl.store(p_out + 0, b_max.to(tl.float64), mask=m_m)
    tl.store(p_out + 1, b_sum, mask=m_m)
    tl.store(p_out + 2, b_t, mask=m_m)
    tl.store(p_out + 3, b_tgt.to(tl.float64), mask=m_m)
    tl.store(p_out + 4, b_arg.to(tl.float64), mask=m_m)


@triton.jit
def _logits_grad_kernel(
    p_z, p_lab, p_arg, p_lse_hi, p_lse_lo, p_c_hi, p_c_lo, p_glp, p_gent, p_dzt, p_dza,
    N, V, stride_z, stride_dz, vocab_start, inv_temp,
    DZ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """``dz`` = d loss / d logits of rows ``[N]`` written over their fp32 logits ``z`` (row stride
    ``stride_z``) as ``DZ`` elements (row stride ``stride_dz``): in place, in the first half of each
    row for 16-bit ``DZ``.

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
    o_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    m_m = o_m < N
    p_dz = p_z.to(tl.pointer_type(DZ), bitcast=True)
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
    b_live = (b_glp != 0) | (b_gent != 0)
    for v0 in range(0, V, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        m_mv = m_m[:, None] & (o_v < V)[None, :]
        b_z = tl.load(p_z + o_m[:, None] * stride_z + o_v[None, :], mask=m_mv, other=0) * inv_temp
        b_p = tl.exp((b_z - b_lse_hi[:, None]) - b_lse_lo[:, None])
        b_q = (b_z - b_c_hi[:, None]) - b_c_lo[:, None]  # log p + entropy
        b_dz = -b_p * (b_glp[:, None] + b_gent[:, None] * b_q)
        b_dz = tl.where(o_v[None, :] == b_arg[:, None], b_dza[:, None], b_dz)
        b_dz = tl.where(o_v[None, :] == b_lab[:, None], b_dzt[:, None], b_dz)
        # A token without incoming gradient (masked away) has dz = 0 even where its logits are NaN.
        b_dz = tl.where(b_live[:, None], b_dz, 0.0)
        # The store overwrites logits of this tile and earlier ones of the same rows: every warp's
        # loads of this tile come first (the earlier tiles were loaded in earlier iterations).
        tl.debug_barrier()
        tl.store(p_dz + o_m[:, None] * stride_dz + o_v[None, :], b_dz.to(DZ), mask=m_mv)


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
def chunk_rows(n: int, v: int) -> int:
    """Rows of one GPU chunk of ``n`` tokens over a ``v``-wide vocab shard: fp32 logits of at most
    _CHUNK_BYTES, a multiple of _CHUNK_ALIGN when possible (the torch backend's: ``torch_chunk_rows``)."""
    rows = _CHUNK_BYTES // (4 * max(v, 1))
    if rows >= _CHUNK_ALIGN:
        rows = rows // _CHUNK_ALIGN * _CHUNK_ALIGN
    return max(1, min(n, rows))


def _mm32(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 ``a @ b``, products exact and summed in fp32 (never rounded to a 16-bit dtype): cuBLAS'
    fp32-output GEMM of the 16-bit operands (``out_dtype``, CUDA only), else fp32 copies of them (the CPU
    run of this path). fp32 operands follow torch's fp32 matmul precision."""
    if a.dtype != torch.float32:
        if a.is_cuda:
            return torch.mm(a, b, out_dtype=torch.float32, out=out)
        a, b = a.float(), b.float()
    return torch.mm(a, b, out=out)


def _add_dw(d_w: torch.Tensor, dz: torch.Tensor, x: torch.Tensor, first: bool) -> None:
    """``d_w (+)= dz^T x`` in ``d_w``'s dtype, summed in fp32 and rounded once per chunk (``beta=0`` on
    the first: ``d_w`` need not be initialised). An fp32 accumulator for a 16-bit dW would be twice its
    size (2.5 GB at V = 152k, H = 4096), over the workspace budget (NOTES_fused_loss.md)."""
    beta = 0 if first else 1
    if d_w.is_cuda or d_w.dtype == torch.float32:
        torch.addmm(d_w, dz.t(), x, beta=beta, out=d_w)
    else:  # the CPU run of a 16-bit input: the same fp32 sum, rounded once
        d_w.copy_(torch.addmm(d_w.float(), dz.t().float(), x.float(), beta=beta))


def logit_chunks(hidden: torch.Tensor, weight: torch.Tensor) -> Iterator[Tuple[slice, torch.Tensor]]:
    """Yield ``(rows, z)``: ``z`` the fp32 logits ``hidden[rows] @ weight.T`` (before the temperature),
    one GEMM unit per chunk, in one buffer reused by every chunk."""
    n, v = hidden.shape[0], weight.shape[0]
    step = chunk_rows(n, v)
    z_buf = torch.empty((min(step, n), v), dtype=torch.float32, device=hidden.device)
    for r0 in range(0, n, step):
        c = min(step, n - r0)
        yield slice(r0, r0 + c), _mm32(hidden[r0:r0 + c], weight.t(), out=z_buf[:c])


def _tiles(v: int) -> Tuple[int, int]:
    return _ROWS_PER_PROGRAM, min(next_pow2(v), _MAX_BLOCK_V)


def row_stats_triton(z, labels, inv_temp: float, vocab_start: int, entropy: bool,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp64 ``[C, 5]`` row statistics (:data:`NUM_STATS`) of the logits ``z * inv_temp`` (fp32 ``[C, V]``)."""
    c, v = z.shape
    stats = empty_output((c, NUM_STATS), dtype=torch.float64, device=z.device) if out is None else out
    if c:
        bm, bv = _tiles(v)
        _logits_stats_kernel[(cdiv(c, bm),)](z, labels.contiguous(), stats, c, v, z.stride(0), vocab_start,
                                             inv_temp, ENTROPY=entropy, BLOCK_M=bm, BLOCK_V=bv,
                                             num_warps=_NUM_WARPS)
    return stats


def _hi_lo(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp64 ``x`` as fp32 ``hi + lo`` (``hi`` = x rounded, ``lo`` = the rest rounded: ~48 bits)."""
    x = x.double()
    hi = x.float()
    return hi.contiguous(), (x - hi.double()).float().contiguous()


def dlogits_triton(z, labels, rows, g_lp, g_ent, inv_temp: float, vocab_start: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """d loss / d logits written over ``z`` (fp32 ``[C, V]`` logits, row-contiguous), returned as a
    ``[C, V]`` view of ``dtype`` (16-bit: the first half of each fp32 row); ``rows`` fp64 ``[5, C]``
    from :func:`row_results`, ``g_lp`` / ``g_ent`` the upstream gradients."""
    c, v = z.shape
    item = torch.empty((), dtype=dtype).element_size()
    if c:
        args = [rows[ARG].long(), *_hi_lo(rows[LSE]), *_hi_lo(rows[LSE] - rows[ENT]),
                *((g.double() * inv_temp).float().contiguous() for g in (g_lp, g_ent)),
                *(d.float().contiguous() for d in exact_dlogits(rows, g_lp, g_ent, inv_temp))]
        bm, bv = _tiles(v)
        _logits_grad_kernel[(cdiv(c, bm),)](z, labels.contiguous(), *args, c, v, z.stride(0), z.stride(0) * 4 // item,
                                            vocab_start, inv_temp, DZ=TL_DTYPES[dtype], BLOCK_M=bm, BLOCK_V=bv,
                                            num_warps=_NUM_WARPS)
    return z if dtype == torch.float32 else z.view(dtype)[:, :v]


def grads_chunk(z, x, weight, labels, rows, g_lp, g_ent, inv_temp: float, vocab_start: int, d_h, d_w,
                first: bool) -> None:
    """dz over the chunk's logits ``z`` in place, then ``d_h`` (fp32 rows of the chunk) = dz W and
    ``d_w`` (+)= dz^T x: two GEMM units. Tokens without incoming gradient (dz = 0) are masked out of
    both, as the torch path leaves them out: a NaN in their hidden row (or in the weight) must not
    reach dW (dH) through NaN * 0."""
    dz = dlogits_triton(z, labels, rows, g_lp, g_ent, inv_temp, vocab_start, x.dtype)
    dead = ~live_rows(g_lp, g_ent)[:, None]
    _mm32(dz, weight, out=d_h)
    d_h.masked_fill_(dead, 0)
    _add_dw(d_w, dz, x.masked_fill(dead, 0), first)


def triton_grad_buffers(hidden: torch.Tensor, weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 dH (summed over a process group in fp32 before its rounding) and dW in the weight's dtype
    (zeros for N = 0: no chunk writes it)."""
    d_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
    alloc = torch.zeros if hidden.shape[0] == 0 else empty_output
    return d_h, alloc(weight.shape, dtype=weight.dtype, device=weight.device)


@register("linear_log_probs_stats", "triton")
def stats_triton(hidden, weight, labels, inv_temp, vocab_start, entropy):
    """fp64 ``[1, N, 5]`` row statistics: one GEMM unit (the chunks' logits) and the statistics kernel."""
    stats = empty_output((1, hidden.shape[0], NUM_STATS), dtype=torch.float64, device=hidden.device)
    for sl, z in logit_chunks(hidden, weight):
        row_stats_triton(z, labels[sl], inv_temp, vocab_start, entropy, out=stats[0, sl])
    return stats


@register("linear_log_probs_grads", "triton")
def grads_triton(hidden, weight, labels, inv_temp, vocab_start, rows, g_lp, g_ent):
    """(dH fp32 [N, H], dW [V, H]) from recomputed logits: three GEMM units; ``rows`` fp64 ``[5, N]``
    from :func:`row_results`."""
    d_h, d_w = triton_grad_buffers(hidden, weight)
    for sl, z in logit_chunks(hidden, weight):
        grads_chunk(z, hidden[sl], weight, labels[sl], rows[:, sl], g_lp[sl], g_ent[sl], inv_temp, vocab_start,
                    d_h[sl], d_w, sl.start == 0)
    return d_h, d_w


def workspace_bytes(n: int, h: int, v: int, dtype: torch.dtype) -> int:
    """Bytes the Triton path holds at its peak beyond the inputs and the returned dH / dW: the fp32
    logits chunk, the fp32 dH (unless it is the returned one), the larger of the chunk's masked
    hidden rows (dW update) and exact_logits' two fp64 ``[rows, H]`` blocks (row results), and the
    per-row vectors (fp64 statistics and results, the kernels' arguments). gpu_check and
    tests/ops/test_linear_log_probs_workspace.py compare it with measured peaks."""
    item = torch.empty((), dtype=dtype).element_size()
    c = chunk_rows(n, v)
    exact_rows = min(c, (32 << 20) // (16 * max(h, 1)))
    return (4 * c * v + (4 * n * h if item != 4 else 0) + max(c * h * item, 2 * exact_rows * h * 8)
            + 8 * n * (NUM_STATS + 2 * NUM_ROWS + 8))


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
