"""Varlen (packed-sequence) flash attention: ``varlen_attention``, forward and backward, GQA.

Same meaning as flash-attn's ``flash_attn_varlen_func`` with ``cu_seqlens_q ==
cu_seqlens_k``: ``T`` packed tokens, sequence ``b`` owns rows
``cu_seqlens[b]:cu_seqlens[b+1]`` and attends only to itself; query head ``h`` reads
KV head ``h // (Hq // Hkv)``.

Backends:

* ``torch`` (CPU default): length buckets of padded views through torch's fused CPU flash
  kernel, in :mod:`dapo_kernels.ops._varlen_attention_cpu` (registered by importing it below).
* ``triton`` (CUDA default): flash-attention-2 style kernels over a work list of
  (sequence, block) pairs built on the device and ordered longest first.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl
from triton.runtime import driver

from .._alloc import empty_output
from .._cache import per_tensor_cache
from .._registry import backend_kernel_serves, current_backend, dispatch, register, use_backend
from .._validation import check_cu_seqlens, check_flag, check_float, check_int, check_tensor
from . import _varlen_attention_cpu  # noqa: F401  (registers the torch path)
from ._triton_utils import INTERPRET, cdiv

# Head dims: any multiple of 8 up to 256 (Llama 128, Phi 80, Gemma 256, ...). The kernels run the
# next power-of-two block (BLOCK_D >= 16, tl.dot's minimum) with the columns past D masked.
SUPPORTED_HEAD_DIMS = tuple(range(8, 257, 8))
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Exponentials run in base 2 (one MUFU ex2 each): the softmax scale is folded with log2(e)
# (the kernels keep scores and lse in base-2 units throughout; see _varlen_attention_fwd).
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
# Rows a program owns (outer block) in the interpreter: tiny, so CPU tests cover several blocks
# (and partial ones) per sequence. The GPU's are in _GPU_TILES.
_OUTER_BLOCK_INTERPRET = 32
# Elements of the delta preprocess per program: [rows, D] tiles of O and dO, multiplied and summed
# in fp64 over 8 warps (32 rows at D <= 128; 16 at D = 256, where 32 spilled on sm_80).
_DELTA_ELEMS = 4096


def _dtype_meta(dtype: torch.dtype) -> dict:
    """Constexprs every kernel takes: DOT_T is the ``tl.dot`` operand type (fp32 in the
    interpreter, whose 3.9 version multiplies raw bits of 16-bit dot operands; exact since
    16-bit products fit fp32), PREC keeps fp32 attention IEEE instead of silently TF32, and
    INTERPRET selects the bf16 rounding fix of :func:`_cast`."""
    return dict(DOT_T=tl.float32 if INTERPRET else _TL_DTYPES[dtype],
                PREC="ieee" if dtype == torch.float32 else "tf32", INTERPRET=INTERPRET)


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
# delta's dtype per input dtype. The backward's dS = P (dP - delta) cancels: dP and delta are
# ~|dO| |v| while their difference is ~0 where a query's probability sits on one key (a length-1
# sequence: exactly 0; narrow windows). fp32 accumulation of dP over D leaves ~ulp(|dO| |v|) there,
# which plain softmax backward does not have (its delta sums P * dP over the same rounded dP, so a
# lone key gets exactly 0): fp32 dQ / dK reached 2.9x torch's error on ~1 draw in 25 (D=192,
# softcap). So for fp32 inputs (DP_F64) dP is summed in fp64 (exact products; _dot_f64) and delta
# stays fp64; 16-bit inputs' own rounding dwarfs the term.
_DELTA_DTYPES = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}


# GPU tiles per (kernel, arch family, input element size), by head dim: the outer block (rows a
# program owns; its work list is built for it) and the (inner block, warps, stages) configs the
# autotuner times. Each one compiled without register spills, within the chip's shared memory,
# causal and not, in the AOT sweep (benchmarks/gpu/aot.py; table in benchmarks/RESULTS.md;
# tests/test_aot_compile.py checks again); every other config is pruned before launch (_prune).
# Family 90 is Hopper, 80 every other chip (compiled for sm_80). 16-bit inputs on Hopper keep
# outer blocks >= 64 (wgmma computes 64 rows per warpgroup), except dK/dV and dQ at D = 256: they
# spill at every such tile, so they run 16- / 32-row blocks on mma.sync. fp32 inputs multiply in IEEE fp32 on
# the CUDA cores, with whole rows of the operand tiles in registers: small tiles. ptxas allocates
# differently per head dim (96 is not 128) and per arch, hence the table.
_F16_DKDV = {16: (128, ((32, 4, 2), (32, 8, 3), (64, 8, 2))), 32: (128, ((32, 8, 3),)), 64: (64, ((16, 8, 3),)),
             **dict.fromkeys((96, 128), (64, ((16, 8, 2),))), 256: (16, ((16, 8, 3),))}
_F32_FWD = {16: (64, ((32, 4, 2), (32, 8, 2))), **dict.fromkeys((32, 64), (64, ((16, 8, 2), (32, 8, 2)))),
            **dict.fromkeys((96, 128), (32, ((16, 8, 1),))), 256: (16, ((16, 8, 2),))}
# fp32 tiles take 1 stage where 2 spilled: without the software pipeline ptxas keeps far fewer
# registers live (the dQ kernel at D = 128: 80 instead of 255 + 232 B of stack).
_F32_DKDV = {16: (64, ((16, 4, 2),)), 32: (16, ((16, 8, 2),)), 64: (32, ((16, 8, 2),)), 96: (16, ((16, 8, 1),)),
             128: (16, ((16, 8, 2),)), 256: (16, ((16, 8, 1),))}
_F32_DQ = {16: (64, ((32, 4, 2), (32, 8, 2))), 32: (64, ((32, 8, 2),)), 64: (64, ((16, 8, 2),)),
           **dict.fromkeys((96, 128), (32, ((16, 8, 1),))), 256: (16, ((16, 8, 1), (16, 4, 1)))}
# sm_80 allocates the fp32 dQ tiles differently: 1 stage still spilled 16-32 B at D = 96-256.
_F32_DQ_80 = {**_F32_DQ, **dict.fromkeys((96, 128), (16, ((16, 8, 2),))), 256: (16, ((16, 4, 1),))}
_SMALL_D = (128, ((64, 4, 3), (64, 8, 3), (128, 8, 3)))
_GPU_TILES = {
    ("fwd", 90, 2): {**dict.fromkeys((16, 32), _SMALL_D), 64: (128, ((64, 8, 3), (128, 8, 3))),
                     **dict.fromkeys((96, 128), (128, ((64, 8, 3),))), 256: (64, ((16, 8, 3), (32, 8, 3)))},
    ("fwd", 80, 2): {16: _SMALL_D, 32: (128, ((32, 4, 3), (64, 8, 3))), 64: (128, ((64, 8, 3),)),
                     **dict.fromkeys((96, 128), (128, ((32, 8, 3),))), 256: (64, ((16, 8, 3), (32, 8, 3)))},
    ("dkdv", 90, 2): _F16_DKDV,
    ("dkdv", 80, 2): _F16_DKDV,
    ("dq", 90, 2): {16: _SMALL_D, 32: (128, ((32, 4, 3), (64, 8, 3), (128, 8, 3))), 64: (128, ((32, 4, 3), (64, 8, 3))),
                    **dict.fromkeys((96, 128), (64, ((32, 8, 3), (64, 8, 3)))), 256: (32, ((16, 8, 3),))},
    ("dq", 80, 2): {16: _SMALL_D, **dict.fromkeys((32, 64), (128, ((32, 8, 3), (64, 8, 3)))),
                    **dict.fromkeys((96, 128), (64, ((32, 8, 3), (64, 8, 3)))), 256: (32, ((16, 8, 3),))},
    ("fwd", 90, 4): _F32_FWD,
    ("fwd", 80, 4): _F32_FWD,
    ("dkdv", 90, 4): _F32_DKDV,
    ("dkdv", 80, 4): _F32_DKDV,
    ("dq", 90, 4): _F32_DQ,
    ("dq", 80, 4): _F32_DQ_80,
    # dK/dV with dQ added by atomics (deterministic=False) holds a dQ tile and its addresses too:
    # rows only where it compiled without spills; elsewhere the dQ kernel runs instead.
    ("dkdv_dq", 90, 2): {d: _F16_DKDV[d] for d in (16, 32, 64)},
    ("dkdv_dq", 80, 2): {d: _F16_DKDV[d] for d in (32, 64)},
    # fp32: D = 32 only since dP is summed in fp64 (_dot_f64: 64 and 96 then spilled 16-280 B).
    ("dkdv_dq", 90, 4): {d: _F32_DKDV[d] for d in (32,)},
    ("dkdv_dq", 80, 4): {d: _F32_DKDV[d] for d in (32,)},
}
# The head dims _GPU_TILES has rows for (each row serves the head dims up to it).
TILE_HEAD_DIMS = (16, 32, 64, 96, 128, 256)
# LPT order of the work lists; False keeps (sequence, block) order (GPU check compares).
_LONGEST_FIRST = True
_ARCH_FAMILY = {}


def _arch_family() -> int:
    """90 on Hopper, else 80: the _GPU_TILES family of the GPU Triton compiles for."""
    device = driver.active.get_current_device()
    if device not in _ARCH_FAMILY:
        _ARCH_FAMILY[device] = 90 if driver.active.get_current_target().arch == 90 else 80
    return _ARCH_FAMILY[device]


def _tile_dim(head_dim: int) -> int:
    """The _GPU_TILES row of a head dim: the smallest tabled one >= it (same BLOCK_D; 96 is
    tabled apart from 128 because ptxas allocates them differently)."""
    return next(d for d in TILE_HEAD_DIMS if d >= head_dim)


def _tiles(kernel: str, dtype: torch.dtype, head_dim: int):
    """(outer block, ((inner block, warps, stages), ...)) of ``kernel`` for these inputs on this GPU."""
    return _GPU_TILES[kernel, _arch_family(), dtype.itemsize][_tile_dim(head_dim)]


def _inner_configs(kernel: str, name: str):
    """Autotune space of the inner (streamed) block ``name``: every config _GPU_TILES has for
    ``kernel`` (each launch is pruned to its own); the interpreter gets one small config
    (autotuning interpreted kernels would run every config on the CPU)."""
    if INTERPRET:
        return [triton.Config({name: 16}, num_warps=1, num_stages=1)]
    tiles = {c for (k, _, _), by_d in _GPU_TILES.items() if k.split("_")[0] == kernel
             for _, cs in by_d.values() for c in cs}
    return [triton.Config({name: bn}, num_warps=w, num_stages=s) for bn, w, s in sorted(tiles)]


def _prune(kernel: str, name: str) -> dict:
    """``prune_configs_by``: keep the configs _GPU_TILES lists for this launch's arch, dtype and
    head dim. The autotune key holds all three (HEAD_DIM, DOT_T; one arch per process)."""
    def early_config_prune(configs, named_args, **kwargs):
        if INTERPRET:
            return configs
        tiles = kernel + "_dq" if kwargs.get("ATOMIC_DQ") else kernel  # dK/dV with atomic dQ: its own
        offered = _tiles(tiles, named_args["p_q"].dtype, kwargs["HEAD_DIM"])[1]
        return [c for c in configs if (c.kwargs[name], c.num_warps, c.num_stages) in offered]
    return {"early_config_prune": early_config_prune}


def _outer_block(kernel: str, dtype: torch.dtype, head_dim: int) -> int:
    return _OUTER_BLOCK_INTERPRET if INTERPRET else _tiles(kernel, dtype, head_dim)[0]


def _atomic_dq_offered(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether dQ by atomics (deterministic=False) has a tile for these inputs on this GPU: where
    none compiles without spills (_GPU_TILES has no "dkdv_dq" row), the dQ kernel runs instead."""
    return INTERPRET or _tile_dim(head_dim) in _GPU_TILES["dkdv_dq", _arch_family(), dtype.itemsize]


# --------------------------------------------------------------------------- kernels
@triton.jit
def _cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``x.to(dtype)`` rounding to nearest even. GPU casts round; the 3.9 interpreter
    truncates fp32 -> bf16 (twice the error), so there the fp32 bits are rounded first and
    the truncation is then exact."""
    if INTERPRET and dtype == tl.bfloat16:
        b_bits = x.to(tl.uint32, bitcast=True)
        b_bits = (b_bits + 0x7FFF + ((b_bits >> 16) & 1)) & 0xFFFF0000
        x = b_bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _finite_or_zero(x):
    """``x`` with non-finite entries read as 0. For the diagonal blocks' tiles, where a query row
    does not attend every key the tile holds: a masked key's inf / NaN would still reach the row
    through a zero probability (0 * inf = NaN). What does attend it is marked NaN by the op."""
    return tl.where(tl.abs(x) < float("inf"), x, 0.0).to(x.dtype)


@triton.jit
def _tanh(x):
    """fp32 tanh without libdevice (the interpreter has none): an odd Taylor polynomial for
    |x| < 0.4, where 1 - 2 / (e^2x + 1) would lose x's leading digits to cancellation (the
    polynomial's first omitted term is < 1e-8 relative there), that form beyond. NaN stays NaN."""
    x2 = x * x
    b_poly = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * (0.021869488536155203 + x2 * (-0.008863235529902197
                                                               + x2 * 0.003592128036572481))))))
    b_big = 1.0 - 2.0 / (tl.exp2(tl.abs(x) * 2.8853900817779268) + 1.0)  # 2 * log2(e)
    return tl.where(tl.abs(x) < 0.4, b_poly, tl.where(x < 0, -b_big, b_big))


@triton.jit
def _scores(b_qk, qk_scale, cap, SOFTCAP: tl.constexpr):
    """(base-2 scores, tanh term) of raw dot products. Without SOFTCAP ``qk_scale`` is
    scale * log2(e); with it (flash-attn / Gemma 2: softcap * tanh(scale * q.k / softcap))
    ``qk_scale`` is scale / softcap and ``cap`` softcap * log2(e), and the tanh term is what
    the backward's chain rule needs (1 - t^2)."""
    if SOFTCAP:
        b_t = _tanh(b_qk * qk_scale)
        return cap * b_t, b_t
    else:
        return b_qk * qk_scale, b_qk


@triton.jit
def _shifted(b_s, b_t, qk_scale, b_shift, SOFTCAP: tl.constexpr):
    """``scores - shift`` for exp2 (``_scores``' pair): without SOFTCAP ``b_t`` is the raw dot product
    and the scaling is fused, ``fma(qk, scale, -shift)``, one rounding of a result that is small near
    the row max. The GPU build contracts ``qk * scale - shift`` into that FMA anyway; the interpreter
    rounded twice (ulp(qk * scale) / 2 in every exponent: p up to ~1.4 ulp less accurate than
    torch's exp(s * scale - max) with a power-of-two scale)."""
    if SOFTCAP:
        return b_s - b_shift
    else:
        return tl.fma(b_t, qk_scale, -b_shift)


@triton.jit
def _dsoftcap(b_ds, b_t, SOFTCAP: tl.constexpr):
    """d(scores) -> d(uncapped scores): times d tanh = 1 - t^2 under SOFTCAP."""
    if SOFTCAP:
        b_ds = b_ds * (1.0 - b_t * b_t)
    return b_ds


@triton.jit
def _dot_f64(p_a, o_a, m_a, p_b, o_b, m_b, FINITE_B: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    """fp64 ``[BLOCK_A, BLOCK_B]``: sum_d a[i, d] * b[j, d] of the rows at ``p_a + o_a[i]`` and
    ``p_b + o_b[j]`` (masked rows read 0; ``FINITE_B``: b's non-finite entries read 0). Loaded
    from memory (cache-resident tiles) 16 columns at a time: fp64 tiles of the whole head dim
    spilled registers on sm_80 / sm_90 wherever they were held (up to 5 KB at D=256)."""
    b_acc = tl.zeros([BLOCK_A, BLOCK_B], dtype=tl.float64)
    for c in tl.static_range(0, BLOCK_D, 16):
        o_c = c + tl.arange(0, 16)
        m_c = o_c < HEAD_DIM
        b_a = tl.load(p_a + o_a[:, None] + o_c[None, :], mask=m_a[:, None] & m_c[None, :], other=0.0)
        b_b = tl.load(p_b + o_b[:, None] + o_c[None, :], mask=m_b[:, None] & m_c[None, :], other=0.0)
        if FINITE_B:
            b_b = _finite_or_zero(b_b)
        b_acc = tl.dot(b_a.to(tl.float64), tl.trans(b_b.to(tl.float64)), b_acc)
    return b_acc


@triton.jit
def _in_window(o_q, o_k, win_left, win_right):
    """Sliding window (flash-attn's window_size within one sequence): query i sees key j iff
    i - left <= j <= i + right (causal: right = 0; unbounded sides arrive as >= the length)."""
    return (o_k >= o_q - win_left) & (o_k <= o_q + win_right)


@triton.jit
def _fwd_inner(b_acc, b_l, b_m, b_q, p_k, p_v, stride_kv, o_m, lo, hi, L, qk_scale, cap, win_left, win_right,
               MASK_CAUSAL: tl.constexpr, MASK_LEN: tl.constexpr, MASK_WINDOW: tl.constexpr,
               SOFTCAP: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr,
               INTERPRET: tl.constexpr):
    """Online softmax over keys [lo, hi); score masks exist only in the diagonal / tail
    instantiations (MASK_CAUSAL / MASK_LEN) and the sliding-window one (MASK_WINDOW, which also
    masks the length). Loads always predicate rows < L (one compare per row), so no
    instantiation can read the next sequence."""
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        o_n = start + tl.arange(0, BLOCK_N).to(tl.int64)
        m_kv = (o_n < L)[:, None] & m_d[None, :]
        b_k = tl.load(p_k + o_n[:, None] * stride_kv + o_d[None, :], mask=m_kv, other=0.0).to(DOT_T)
        b_v = tl.load(p_v + o_n[:, None] * stride_kv + o_d[None, :], mask=m_kv, other=0.0)
        if MASK_CAUSAL or MASK_WINDOW:
            b_v = _finite_or_zero(b_v)  # (the score mask below replaces a masked key's NaN score)
        # Without SOFTCAP the scores stay raw: the scale enters once per row through the max
        # (qk_scale > 0, so max(s) * scale is the max of the scaled scores) and once per element
        # inside exp2's argument, s * scale - m, one FMA (scaling Q instead would round Q once
        # more in 16 bits). Soft-capped scores come scaled (b_scale = 1).
        if SOFTCAP:
            b_s, _ = _scores(tl.dot(b_q, tl.trans(b_k), input_precision=PREC), qk_scale, cap, SOFTCAP)
            b_scale = 1.0
        else:
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
            b_scale = qk_scale
        if MASK_WINDOW:
            b_s = tl.where(_in_window(o_m[:, None], o_n[None, :], win_left, win_right) & (o_n[None, :] < L),
                           b_s, float("-inf"))
        elif MASK_CAUSAL:
            b_s = tl.where((o_m[:, None] >= o_n[None, :]) & (o_n[None, :] < L), b_s, float("-inf"))
        elif MASK_LEN:
            b_s = tl.where(o_n[None, :] < L, b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1) * b_scale)
        if MASK_CAUSAL or MASK_LEN or MASK_WINDOW:
            # A row that has seen only masked keys keeps m = -inf; shifting by 0 instead
            # gives p = 0 and alpha = 0 rather than exp2(-inf + inf) = NaN.
            b_shift = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        else:
            b_shift = b_m_new
        b_p = tl.exp2(tl.fma(b_s, b_scale, -b_shift[:, None]))  # one rounding (see _shifted)
        b_alpha = tl.exp2(b_m - b_shift)
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        # P is rounded to the input dtype as flash attention does, then fed as DOT_T.
        b_pv = tl.dot(_cast(b_p, b_v.dtype, INTERPRET).to(DOT_T), b_v.to(DOT_T), input_precision=PREC)
        b_acc = b_acc * b_alpha[:, None] + b_pv
        b_m = b_m_new
    return b_acc, b_l, b_m


@triton.autotune(configs=_inner_configs("fwd", "BLOCK_N"), key=["HEAD_DIM", "IS_CAUSAL", "LOCAL", "SOFTCAP", "DOT_T"],
                 prune_configs_by=_prune("fwd", "BLOCK_N"))
@triton.jit
def _varlen_attention_fwd_kernel(
    p_q, p_k, p_v, p_o, p_lse, p_cu, p_work, T, Hq, GROUP, qk_scale, cap, win_left, win_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, LOCAL: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_T: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One (query block, query head) per program; the 1-D grid runs heads fastest over a
    work list sorted longest first, so the longest blocks of every head start first."""
    i_pid = tl.program_id(0)
    i_w = i_pid // Hq
    i_h = i_pid % Hq
    i_b = tl.load(p_work + 2 * i_w)
    if i_b < 0:  # padding entry of the upper-bound work list
        return
    i_m = tl.load(p_work + 2 * i_w + 1).to(tl.int64)
    bos = tl.load(p_cu + i_b).to(tl.int64)
    L = tl.load(p_cu + i_b + 1).to(tl.int64) - bos
    stride_q = Hq * HEAD_DIM
    stride_kv = (Hq // GROUP) * HEAD_DIM
    p_qh = p_q + bos * stride_q + i_h * HEAD_DIM
    p_kh = p_k + bos * stride_kv + (i_h // GROUP) * HEAD_DIM
    p_vh = p_v + bos * stride_kv + (i_h // GROUP) * HEAD_DIM

    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_q = (o_m < L)[:, None] & (o_d < HEAD_DIM)[None, :]
    b_q = tl.load(p_qh + o_m[:, None] * stride_q + o_d[None, :], mask=m_q, other=0.0).to(DOT_T)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if LOCAL:
        # Sliding window: only the keys some row of the block can see, all masked.
        b_acc, b_l, b_m = _fwd_inner(b_acc, b_l, b_m, b_q, p_kh, p_vh, stride_kv, o_m,
                                     tl.maximum(i_m * BLOCK_M - win_left, 0),
                                     tl.minimum(i_m * BLOCK_M + BLOCK_M + win_right, L), L,
                                     qk_scale, cap, win_left, win_right,
                                     False, False, True, SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_T, PREC, INTERPRET)
    elif IS_CAUSAL:
        # Keys before the block's first row are visible to every row and lie inside the
        # sequence: no score mask. Then the diagonal block, masked.
        diag = i_m * BLOCK_M
        b_acc, b_l, b_m = _fwd_inner(b_acc, b_l, b_m, b_q, p_kh, p_vh, stride_kv, o_m, 0, diag, L,
                                     qk_scale, cap, win_left, win_right,
                                     False, False, False, SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_T, PREC, INTERPRET)
        b_acc, b_l, b_m = _fwd_inner(b_acc, b_l, b_m, b_q, p_kh, p_vh, stride_kv, o_m, diag,
                                     tl.minimum(diag + BLOCK_M, L), L, qk_scale, cap, win_left, win_right,
                                     True, True, False, SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_T, PREC, INTERPRET)
    else:
        full = (L // BLOCK_N) * BLOCK_N
        b_acc, b_l, b_m = _fwd_inner(b_acc, b_l, b_m, b_q, p_kh, p_vh, stride_kv, o_m, 0, full, L,
                                     qk_scale, cap, win_left, win_right,
                                     False, False, False, SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_T, PREC, INTERPRET)
        b_acc, b_l, b_m = _fwd_inner(b_acc, b_l, b_m, b_q, p_kh, p_vh, stride_kv, o_m, full, L, L,
                                     qk_scale, cap, win_left, win_right,
                                     False, True, False, SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_T, PREC, INTERPRET)

    b_l_safe = tl.where(b_l == 0.0, 1.0, b_l)
    b_o = b_acc / b_l_safe[:, None]
    tl.store(p_o + bos * stride_q + i_h * HEAD_DIM + o_m[:, None] * stride_q + o_d[None, :],
             _cast(b_o, p_o.dtype.element_ty, INTERPRET), mask=m_q)
    # Base-2 lse, the units the backward recomputes P in (the public function converts).
    b_lse = tl.where(b_l == 0.0, float("-inf"), b_m + tl.log2(b_l_safe))
    tl.store(p_lse + i_h.to(tl.int64) * T + bos + o_m, b_lse, mask=o_m < L)


@triton.jit
def _varlen_attention_bwd_delta_kernel(p_o, p_do, p_delta, T, Hq,
                                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """delta[h, t] = sum_d dO[t, h, d] * O[t, h, d] (in p_delta's dtype), over rows r = t * Hq + h."""
    o_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_r = o_r < T * Hq
    m = m_r[:, None] & (o_d < HEAD_DIM)[None, :]
    # fp64 products and sum, rounded once: delta's error reaches dQ / dK as delta_err * sum_j p_j k_j,
    # a term that does not cancel (it is ~0 in plain softmax backward, which sums p * dP from the
    # same p), so it is kept to the rounding of O and of delta itself (not rounded at all for fp32
    # inputs, whose delta stays fp64: _DELTA_DTYPES). Memory-bound: fp64 is free.
    b_o = tl.load(p_o + o_r[:, None] * HEAD_DIM + o_d[None, :], mask=m, other=0.0).to(tl.float64)
    b_do = tl.load(p_do + o_r[:, None] * HEAD_DIM + o_d[None, :], mask=m, other=0.0).to(tl.float64)
    tl.store(p_delta + (o_r % Hq) * T + o_r // Hq, tl.sum(b_o * b_do, 1).to(p_delta.dtype.element_ty), mask=m_r)


@triton.jit
def _dkdv_inner(b_dk, b_dv, b_k, b_v, p_v, stride_kv, p_q, p_do, p_lse, p_delta, p_dq, stride_q, o_n, lo, hi, L,
                qk_scale, sm_scale, cap, win_left, win_right, MASK_CAUSAL: tl.constexpr, MASK_WINDOW: tl.constexpr,
                SOFTCAP: tl.constexpr, ATOMIC_DQ: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_M: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr, DP_F64: tl.constexpr,
                INTERPRET: tl.constexpr):
    """Accumulate dK, dV of one key block over query rows [lo, hi) of one head, on
    transposed scores [keys, queries] so no tile is transposed twice. Query rows past the
    sequence end read q = dO = 0 and lse = +inf: their probabilities are exactly 0, no
    score mask needed for the length. ``ATOMIC_DQ``: also add this key block's share of dQ,
    dS @ K * scale, into the fp32 buffer ``p_dq`` (rows of this head) with atomics."""
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    for start in range(lo, hi, BLOCK_M):
        o_m = start + tl.arange(0, BLOCK_M).to(tl.int64)
        m_row = o_m < L
        m_q = m_row[:, None] & m_d[None, :]
        b_q = tl.load(p_q + o_m[:, None] * stride_q + o_d[None, :], mask=m_q, other=0.0).to(DOT_T)
        b_do = tl.load(p_do + o_m[:, None] * stride_q + o_d[None, :], mask=m_q, other=0.0).to(DOT_T)
        if MASK_CAUSAL or MASK_WINDOW:
            b_q, b_do = _finite_or_zero(b_q), _finite_or_zero(b_do)
        b_lse = tl.load(p_lse + o_m, mask=m_row, other=float("inf"))
        b_delta = tl.load(p_delta + o_m, mask=m_row, other=0.0)
        b_st, b_tt = _scores(tl.dot(b_k, tl.trans(b_q), input_precision=PREC), qk_scale, cap, SOFTCAP)
        b_pt = tl.exp2(_shifted(b_st, b_tt, qk_scale, b_lse[None, :], SOFTCAP))
        if MASK_WINDOW:
            m_att = _in_window(o_m[None, :], o_n[:, None], win_left, win_right)
        else:
            m_att = o_m[None, :] >= o_n[:, None]
        if MASK_CAUSAL or MASK_WINDOW:
            b_pt = tl.where(m_att, b_pt, 0.0)
        b_dv += tl.dot(_cast(b_pt, p_do.dtype.element_ty, INTERPRET).to(DOT_T), b_do, input_precision=PREC)
        if DP_F64:  # dP - delta in fp64, then fp32 (_DELTA_DTYPES)
            b_dpt = _dot_f64(p_v, o_n * stride_kv, o_n < L, p_do, o_m * stride_q, m_row, MASK_CAUSAL or MASK_WINDOW,
                             HEAD_DIM, BLOCK_D, b_k.shape[0], BLOCK_M)
        else:
            b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision=PREC)
        b_dst = _dsoftcap(b_pt * (b_dpt - b_delta[None, :]).to(tl.float32), b_tt, SOFTCAP)
        if MASK_CAUSAL or MASK_WINDOW:  # a query's NaN lse / delta must not reach the keys it does not attend
            b_dst = tl.where(m_att, b_dst, 0.0)
        b_dst = _cast(b_dst, p_q.dtype.element_ty, INTERPRET).to(DOT_T)
        b_dk += tl.dot(b_dst, b_q, input_precision=PREC)
        if ATOMIC_DQ:  # (b_k comes with non-finite entries zeroed where tiles are masked: see the kernel)
            b_dq = tl.dot(tl.trans(b_dst), b_k, input_precision=PREC) * sm_scale
            tl.atomic_add(p_dq + o_m[:, None] * stride_q + o_d[None, :], b_dq, mask=m_q, sem="relaxed")
    return b_dk, b_dv


# reset_to_zero: timing a config adds into the dQ buffer (ATOMIC_DQ); the autotuner zeroes it
# before each timed run and before the run that counts.
@triton.autotune(configs=_inner_configs("dkdv", "BLOCK_M"),
                 key=["HEAD_DIM", "IS_CAUSAL", "LOCAL", "SOFTCAP", "ATOMIC_DQ", "DOT_T"],
                 prune_configs_by=_prune("dkdv", "BLOCK_M"), reset_to_zero=["p_dq"])
@triton.jit
def _varlen_attention_bwd_dkdv_kernel(
    p_q, p_k, p_v, p_do, p_lse, p_delta, p_dk, p_dv, p_dq, p_cu, p_work, T, Hkv, GROUP, qk_scale, sm_scale,
    cap, win_left, win_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, LOCAL: tl.constexpr, SOFTCAP: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    DOT_T: tl.constexpr, PREC: tl.constexpr, DP_F64: tl.constexpr, INTERPRET: tl.constexpr,
):
    """dK, dV of one (key block, KV head): loops over the GROUP query heads sharing the KV
    head and over their query blocks, summing in registers; one writer per element, so
    dK / dV are deterministic and need no atomics or zero-init. ``ATOMIC_DQ`` (flash-attn's
    ``deterministic=False``): dQ too, added with fp32 atomics into the zeroed buffer ``p_dq``
    (5 matmuls per tile pair in all instead of 7 with the separate dQ kernel; the order of the
    atomic adds, hence dQ's last bits, varies from run to run)."""
    i_pid = tl.program_id(0)
    i_w = i_pid // Hkv
    i_hk = i_pid % Hkv
    i_b = tl.load(p_work + 2 * i_w)
    if i_b < 0:
        return
    i_n = tl.load(p_work + 2 * i_w + 1).to(tl.int64)
    bos = tl.load(p_cu + i_b).to(tl.int64)
    L = tl.load(p_cu + i_b + 1).to(tl.int64) - bos
    stride_q = Hkv * GROUP * HEAD_DIM
    stride_kv = Hkv * HEAD_DIM

    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_kv = (o_n < L)[:, None] & (o_d < HEAD_DIM)[None, :]
    o_kv = (bos + o_n)[:, None] * stride_kv + i_hk * HEAD_DIM + o_d[None, :]
    b_k = tl.load(p_k + o_kv, mask=m_kv, other=0.0).to(DOT_T)
    if (IS_CAUSAL or LOCAL) and ATOMIC_DQ:
        # dQ += dS @ K over a masked tile reaches queries that do not attend every key of the
        # block: a non-finite key would make their zero dS NaN. Zeroed once here (not per tile,
        # which would keep a second K tile live): such a key's own dK / dV rows change from NaN to
        # finite, and the op marks them NaN anyway (its own query attends it and is marked).
        b_k = _finite_or_zero(b_k)
    b_v = tl.load(p_v + o_kv, mask=m_kv, other=0.0).to(DOT_T)
    b_dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Causal: queries on the block's diagonal see part of it (masked), later ones all of it.
    lo = i_n * BLOCK_N if IS_CAUSAL else 0
    mid = tl.minimum(lo + BLOCK_N, L) if IS_CAUSAL else 0
    for g in range(GROUP):
        i_h = (i_hk * GROUP + g).to(tl.int64)
        p_qh = p_q + bos * stride_q + i_h * HEAD_DIM
        p_doh = p_do + bos * stride_q + i_h * HEAD_DIM
        p_lseh = p_lse + i_h * T + bos
        p_vh = p_v + bos * stride_kv + i_hk * HEAD_DIM
        p_deltah = p_delta + i_h * T + bos
        p_dqh = p_dq + bos * stride_q + i_h * HEAD_DIM
        if LOCAL:  # sliding window: the queries that see some key of the block, all masked
            b_dk, b_dv = _dkdv_inner(b_dk, b_dv, b_k, b_v, p_vh, stride_kv, p_qh, p_doh, p_lseh, p_deltah, p_dqh,
                                     stride_q, o_n,
                                     tl.maximum(i_n * BLOCK_N - win_right, 0),
                                     tl.minimum(i_n * BLOCK_N + BLOCK_N + win_left, L), L,
                                     qk_scale, sm_scale, cap, win_left, win_right, False, True, SOFTCAP, ATOMIC_DQ,
                                     HEAD_DIM, BLOCK_D, BLOCK_M, DOT_T, PREC, DP_F64, INTERPRET)
        else:
            if IS_CAUSAL:
                b_dk, b_dv = _dkdv_inner(b_dk, b_dv, b_k, b_v, p_vh, stride_kv, p_qh, p_doh, p_lseh, p_deltah,
                                         p_dqh, stride_q,
                                         o_n, lo, mid, L, qk_scale, sm_scale, cap, win_left, win_right, True, False,
                                         SOFTCAP, ATOMIC_DQ, HEAD_DIM, BLOCK_D, BLOCK_M, DOT_T, PREC, DP_F64, INTERPRET)
            b_dk, b_dv = _dkdv_inner(b_dk, b_dv, b_k, b_v, p_vh, stride_kv, p_qh, p_doh, p_lseh, p_deltah, p_dqh,
                                     stride_q, o_n,
                                     mid, L, L, qk_scale, sm_scale, cap, win_left, win_right, False, False,
                                     SOFTCAP, ATOMIC_DQ, HEAD_DIM, BLOCK_D, BLOCK_M, DOT_T, PREC, DP_F64, INTERPRET)
    tl.store(p_dk + o_kv, _cast(b_dk * sm_scale, p_dk.dtype.element_ty, INTERPRET), mask=m_kv)
    tl.store(p_dv + o_kv, _cast(b_dv, p_dv.dtype.element_ty, INTERPRET), mask=m_kv)


@triton.jit
def _dq_inner(b_dq, b_q, b_do, p_do, stride_q, b_lse, b_delta, p_k, p_v, stride_kv, o_m, lo, hi, L, qk_scale, cap,
              win_left, win_right, MASK_CAUSAL: tl.constexpr, MASK_LEN: tl.constexpr, MASK_WINDOW: tl.constexpr,
              SOFTCAP: tl.constexpr, HEAD_DIM: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr,
              DP_F64: tl.constexpr, INTERPRET: tl.constexpr):
    """Accumulate dQ of one query block over keys [lo, hi) (keys past the end read 0 and
    would get p = exp2(-lse) != 0, hence the MASK_LEN score mask on the tail)."""
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        o_n = start + tl.arange(0, BLOCK_N).to(tl.int64)
        m_kv = (o_n < L)[:, None] & m_d[None, :]
        b_k = tl.load(p_k + o_n[:, None] * stride_kv + o_d[None, :], mask=m_kv, other=0.0).to(DOT_T)
        b_v = tl.load(p_v + o_n[:, None] * stride_kv + o_d[None, :], mask=m_kv, other=0.0).to(DOT_T)
        if MASK_CAUSAL or MASK_WINDOW:
            b_k, b_v = _finite_or_zero(b_k), _finite_or_zero(b_v)
        b_s, b_t = _scores(tl.dot(b_q, tl.trans(b_k), input_precision=PREC), qk_scale, cap, SOFTCAP)
        b_p = tl.exp2(_shifted(b_s, b_t, qk_scale, b_lse[:, None], SOFTCAP))
        if MASK_WINDOW:
            b_p = tl.where(_in_window(o_m[:, None], o_n[None, :], win_left, win_right) & (o_n[None, :] < L), b_p, 0.0)
        elif MASK_CAUSAL:
            b_p = tl.where((o_m[:, None] >= o_n[None, :]) & (o_n[None, :] < L), b_p, 0.0)
        elif MASK_LEN:
            b_p = tl.where(o_n[None, :] < L, b_p, 0.0)
        if DP_F64:  # (as in _dkdv_inner)
            b_dp = _dot_f64(p_do, o_m * stride_q, o_m < L, p_v, o_n * stride_kv, o_n < L, MASK_CAUSAL or MASK_WINDOW,
                            HEAD_DIM, BLOCK_D, b_q.shape[0], BLOCK_N)
        else:
            b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
        b_ds = _dsoftcap(b_p * (b_dp - b_delta[:, None]).to(tl.float32), b_t, SOFTCAP)
        b_dq += tl.dot(_cast(b_ds, p_k.dtype.element_ty, INTERPRET).to(DOT_T), b_k, input_precision=PREC)
    return b_dq


@triton.autotune(configs=_inner_configs("dq", "BLOCK_N"), key=["HEAD_DIM", "IS_CAUSAL", "LOCAL", "SOFTCAP", "DOT_T"],
                 prune_configs_by=_prune("dq", "BLOCK_N"))
@triton.jit
def _varlen_attention_bwd_dq_kernel(
    p_q, p_k, p_v, p_do, p_lse, p_delta, p_dq, p_cu, p_work, T, Hq, GROUP, qk_scale, sm_scale,
    cap, win_left, win_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, LOCAL: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_T: tl.constexpr, PREC: tl.constexpr, DP_F64: tl.constexpr, INTERPRET: tl.constexpr,
):
    """dQ of one (query block, query head), recomputing P from the saved lse: two extra
    matmuls instead of an fp32 atomic dQ buffer (deterministic, no zero-init, no cast)."""
    i_pid = tl.program_id(0)
    i_w = i_pid // Hq
    i_h = i_pid % Hq
    i_b = tl.load(p_work + 2 * i_w)
    if i_b < 0:
        return
    i_m = tl.load(p_work + 2 * i_w + 1).to(tl.int64)
    bos = tl.load(p_cu + i_b).to(tl.int64)
    L = tl.load(p_cu + i_b + 1).to(tl.int64) - bos
    stride_q = Hq * HEAD_DIM
    stride_kv = (Hq // GROUP) * HEAD_DIM
    p_kh = p_k + bos * stride_kv + (i_h // GROUP) * HEAD_DIM
    p_vh = p_v + bos * stride_kv + (i_h // GROUP) * HEAD_DIM

    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_row = o_m < L
    m_q = m_row[:, None] & (o_d < HEAD_DIM)[None, :]
    o_q = (bos + o_m)[:, None] * stride_q + i_h * HEAD_DIM + o_d[None, :]
    b_q = tl.load(p_q + o_q, mask=m_q, other=0.0).to(DOT_T)
    b_do = tl.load(p_do + o_q, mask=m_q, other=0.0).to(DOT_T)
    p_doh = p_do + bos * stride_q + i_h * HEAD_DIM
    o_stat = i_h.to(tl.int64) * T + bos + o_m
    b_lse = tl.load(p_lse + o_stat, mask=m_row, other=float("inf"))
    b_delta = tl.load(p_delta + o_stat, mask=m_row, other=0.0)
    b_dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if LOCAL:
        b_dq = _dq_inner(b_dq, b_q, b_do, p_doh, stride_q, b_lse, b_delta, p_kh, p_vh, stride_kv, o_m,
                         tl.maximum(i_m * BLOCK_M - win_left, 0), tl.minimum(i_m * BLOCK_M + BLOCK_M + win_right, L),
                         L, qk_scale, cap, win_left, win_right,
                         False, False, True, SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_T, PREC, DP_F64, INTERPRET)
    elif IS_CAUSAL:
        diag = i_m * BLOCK_M
        b_dq = _dq_inner(b_dq, b_q, b_do, p_doh, stride_q, b_lse, b_delta, p_kh, p_vh, stride_kv, o_m, 0, diag, L,
                         qk_scale, cap, win_left, win_right,
                         False, False, False, SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_T, PREC, DP_F64, INTERPRET)
        b_dq = _dq_inner(b_dq, b_q, b_do, p_doh, stride_q, b_lse, b_delta, p_kh, p_vh, stride_kv, o_m, diag,
                         tl.minimum(diag + BLOCK_M, L), L, qk_scale, cap, win_left, win_right,
                         True, True, False, SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_T, PREC, DP_F64, INTERPRET)
    else:
        full = (L // BLOCK_N) * BLOCK_N
        b_dq = _dq_inner(b_dq, b_q, b_do, p_doh, stride_q, b_lse, b_delta, p_kh, p_vh, stride_kv, o_m, 0, full, L,
                         qk_scale, cap, win_left, win_right,
                         False, False, False, SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_T, PREC, DP_F64, INTERPRET)
        b_dq = _dq_inner(b_dq, b_q, b_do, p_doh, stride_q, b_lse, b_delta, p_kh, p_vh, stride_kv, o_m, full, L, L,
                         qk_scale, cap, win_left, win_right,
                         False, True, False, SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_T, PREC, DP_F64, INTERPRET)
    tl.store(p_dq + o_q, _cast(b_dq * sm_scale, p_dq.dtype.element_ty, INTERPRET), mask=m_q)


# --------------------------------------------------------------------------- launchers
@per_tensor_cache  # once per batch, not per layer
def _work_list(cu_seqlens: torch.Tensor, total_tokens: int, block: int, causal: bool, per_key: bool):
    """int32 ``[n, 2]`` (sequence, block) pairs, most expensive first (LPT), built on the
    device without a host sync.

    ``n = cdiv(T, block) + B`` bounds the true count (sum of per-sequence ceilings); the
    surplus rows are ``(-1, *)`` and sort last, their programs exit at once. Cost = key
    blocks a query block walks (causal: its index + 1) or, ``per_key``, query blocks a key
    block walks (causal: blocks from it to the end); non-causal: the sequence's block count.
    """
    cu = cu_seqlens.long()
    B = cu.numel() - 1
    n = cdiv(total_tokens, block) + B
    nblk = (cu[1:] - cu[:-1] + block - 1) // block
    cum = torch.cumsum(nblk, 0)
    item = torch.arange(n, device=cu.device)
    seq = torch.searchsorted(cum, item, right=True).clamp_(max=max(B - 1, 0))
    blk = item - (cum[seq] - nblk[seq])
    if causal:
        cost = nblk[seq] - blk if per_key else blk + 1
    else:
        cost = nblk[seq]
    valid = item < cum[-1]
    work = torch.stack([torch.where(valid, seq, -1), blk], 1)
    if _LONGEST_FIRST:
        work = work[torch.argsort(torch.where(valid, cost, -1), descending=True, stable=True)]
    return work.to(torch.int32).contiguous()


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _mask_args(T: int, causal: bool, window_left: int, window_right: int, softmax_scale: float, softcap: float):
    """Runtime scalars and constexprs of the score math: (qk_scale, cap, left, right) and LOCAL /
    SOFTCAP. Unbounded window sides (-1) become T + 1, beyond any key; causal sets right = 0."""
    left = T + 1 if window_left < 0 else window_left
    right = 0 if causal else (T + 1 if window_right < 0 else window_right)
    local = window_left >= 0 or (not causal and window_right >= 0)
    if softcap > 0:
        return (softmax_scale / softcap, softcap * _LOG2E, left, right), dict(LOCAL=local, SOFTCAP=True)
    return (softmax_scale * _LOG2E, 1.0, left, right), dict(LOCAL=local, SOFTCAP=False)


@register("varlen_attention_fwd", "triton")
def _fwd_triton(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, window_left, window_right, softcap):
    q, k, v, cu_seqlens = (t.contiguous() for t in (q, k, v, cu_seqlens))  # the kernels address them as dense
    T, Hq, D = q.shape
    out = empty_output(q.shape, dtype=q.dtype, device=q.device)
    lse = empty_output((Hq, T), dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    block = _outer_block("fwd", q.dtype, D)
    work = _work_list(cu_seqlens, T, block, causal, False)
    scalars, flags = _mask_args(T, causal, window_left, window_right, softmax_scale, softcap)
    _varlen_attention_fwd_kernel[(work.shape[0] * Hq,)](
        q, k, v, out, lse, cu_seqlens, work, T, Hq, Hq // k.shape[1], *scalars,
        HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_M=block, IS_CAUSAL=causal, **flags, **_dtype_meta(q.dtype),
    )
    return out, lse


def _launch_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    T, Hq, D = out.shape
    delta = empty_output((Hq, T), dtype=_DELTA_DTYPES[out.dtype], device=out.device)
    rows = min(32, _DELTA_ELEMS // _block_d(D))
    _varlen_attention_bwd_delta_kernel[(cdiv(T * Hq, rows),)](
        out, dout, delta, T, Hq, HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_R=rows, num_warps=8,
    )
    return delta


@register("varlen_attention_bwd", "triton")
def _bwd_triton(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale, window_left, window_right,
                softcap, deterministic=True):
    dout, q, k, v, out, lse, cu_seqlens = (t.contiguous() for t in (dout, q, k, v, out, lse, cu_seqlens))
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    dq = empty_output(q.shape, dtype=q.dtype, device=q.device)
    dk = empty_output(k.shape, dtype=k.dtype, device=k.device)
    dv = empty_output(v.shape, dtype=v.dtype, device=v.device)
    if T == 0:
        return dq, dk, dv
    delta = _launch_delta(out, dout)
    (qk_scale, *masking), flags = _mask_args(T, causal, window_left, window_right, softmax_scale, softcap)
    meta = dict(HEAD_DIM=D, BLOCK_D=_block_d(D), IS_CAUSAL=causal, **flags, **_dtype_meta(q.dtype))
    meta["DP_F64"] = _DELTA_DTYPES[q.dtype] is torch.float64
    scales = (qk_scale, softmax_scale, *masking)
    atomic = not deterministic and _atomic_dq_offered(q.dtype, D)
    # fp32 dQ accumulates in place; 16-bit dQ in an fp32 buffer, rounded once at the end.
    dq_acc = (dq if q.dtype == torch.float32 else torch.empty(q.shape, dtype=torch.float32, device=q.device)
              ).zero_() if atomic else dq
    block = _outer_block("dkdv_dq" if atomic else "dkdv", q.dtype, D)
    work_kv = _work_list(cu_seqlens, T, block, causal, True)
    _varlen_attention_bwd_dkdv_kernel[(work_kv.shape[0] * Hkv,)](
        q, k, v, dout, lse, delta, dk, dv, dq_acc, cu_seqlens, work_kv, T, Hkv, Hq // Hkv, *scales, BLOCK_N=block,
        ATOMIC_DQ=atomic, **meta,
    )
    if atomic:
        return (dq if dq_acc is dq else dq.copy_(dq_acc)), dk, dv
    block = _outer_block("dq", q.dtype, D)
    work_q = _work_list(cu_seqlens, T, block, causal, False)
    _varlen_attention_bwd_dq_kernel[(work_q.shape[0] * Hq,)](
        q, k, v, dout, lse, delta, dq, cu_seqlens, work_q, T, Hq, Hq // Hkv, *scales, BLOCK_M=block, **meta,
    )
    return dq, dk, dv


# --------------------------------------------------------------------------- non-finite inputs
def _nonfinite_rows(x: torch.Tensor) -> torch.Tensor:
    """bool ``[T, H]``: the (token, head) rows of ``x [T, H, D]`` that hold a NaN or an inf."""
    return ~torch.isfinite(x).all(-1)


@per_tensor_cache  # once per batch, not per layer
def _token_bounds(cu_seqlens: torch.Tensor, total_tokens: int):
    """int64 ``[T]`` each (token index, its sequence's start, its sequence's end)."""
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    t = torch.arange(total_tokens, device=cu.device)
    return (t, torch.repeat_interleave(cu[:-1], lens, output_size=total_tokens),
            torch.repeat_interleave(cu[1:], lens, output_size=total_tokens))


def _attending(flag: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool, window_left: int, window_right: int,
               keys: bool) -> torch.Tensor:
    """bool ``[T, H]``: the queries that attend a key flagged in ``flag [T, H]`` or, with ``keys``, the
    keys that a flagged query attends; within each sequence, query ``i`` attends key ``j`` iff
    ``i - left <= j <= i + right`` (causal: right = 0; -1 = unbounded). Prefix counts on the
    device, no host sync."""
    T = flag.shape[0]
    t, start, end = _token_bounds(cu_seqlens, T)
    left = T if window_left < 0 else window_left
    right = 0 if causal else (T if window_right < 0 else window_right)
    before, after = (right, left) if keys else (left, right)  # a key is attended by i in [j - right, j + left]
    lo = torch.maximum(start, t - before)
    hi = torch.minimum(end, t + after + 1)
    count = torch.nn.functional.pad(torch.cumsum(flag, 0, dtype=torch.int32), (0, 0, 1, 0))  # flagged rows < t
    return count[hi] > count[lo]


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("dapo::varlen_attention_fwd", mutates_args=())
def _varlen_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
    max_seqlen: int, causal: bool, softmax_scale: float, window_left: int = -1, window_right: int = -1,
    softcap: float = 0.0, deterministic: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, Hq, D], lse float32 [Hq, T])`` on validated, contiguous inputs.

    ``lse`` is in the unit of the kernel that ran, the one its backward recomputes
    probabilities in, so it is rounded to fp32 exactly once: base 2 (``lse / ln 2``) for
    Triton, natural log for the torch path (torch's CPU kernels) and for out-of-tree kernels
    (e.g. npu_ops, which run whatever backend is forced). The public function converts to
    natural log; autograd runs the backward on the forward's backend, with ``deterministic``
    (which the forward does not use).

    NaN in, NaN out, whatever the backend's block sizes: the rows of ``out`` and ``lse`` of a
    query whose ``q``, or the ``k`` / ``v`` of a key it attends, hold a NaN or inf are NaN, and
    no other (the backends read such values as 0 where a query does not attend them).

    ``window_left`` / ``window_right`` (-1: unbounded) and ``softcap`` (0: none) as flash-attn's."""
    window = (window_left, window_right)
    out, lse = dispatch("varlen_attention_fwd", q.device)(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale,
                                                          *window, softcap)
    attends_bad = _attending(_nonfinite_rows(k) | _nonfinite_rows(v), cu_seqlens, causal, *window, keys=False)
    poisoned = _nonfinite_rows(q) | attends_bad.repeat_interleave(q.shape[1] // k.shape[1], 1)
    return out.masked_fill_(poisoned[..., None], float("nan")), lse.masked_fill_(poisoned.t(), float("nan"))


@_varlen_attention_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0,
      deterministic=True):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("dapo::varlen_attention_bwd", mutates_args=())
def _varlen_attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, causal: bool, softmax_scale: float,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0, deterministic: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``; grouped query heads' dK/dV are summed into their KV head.
    ``deterministic=False`` lets the Triton backend add dQ with fp32 atomics (faster, last bits
    vary between runs); the torch path is deterministic either way.

    A query whose ``lse`` is NaN (the forward's mark of a non-finite input it depends on) or whose
    ``dout`` holds a NaN or inf gets NaN ``dq``, and the keys it attends NaN ``dk`` / ``dv``; nothing
    else does (the backends read non-finite values as 0 where they are not attended)."""
    window = (window_left, window_right)
    dq, dk, dv = dispatch("varlen_attention_bwd", q.device)(
        dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale, *window, softcap, deterministic
    )
    T, Hq, _ = q.shape
    bad = lse.isnan().t() | _nonfinite_rows(dout)
    keys = _attending(bad.reshape(T, k.shape[1], Hq // k.shape[1]).any(-1), cu_seqlens, causal, *window,
                      keys=True)
    return (dq.masked_fill_(bad[..., None], float("nan")), dk.masked_fill_(keys[..., None], float("nan")),
            dv.masked_fill_(keys[..., None], float("nan")))


@_varlen_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale, window_left=-1, window_right=-1,
      softcap=0.0, deterministic=True):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fwd_setup(ctx, inputs, output):
    q, k, v, cu_seqlens, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.args = tuple(args)
    ctx.backend = current_backend(q.device)  # lse's unit depends on it
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    with use_backend(ctx.backend):
        dq, dk, dv = _varlen_attention_bwd(dout.contiguous(), q, k, v, out, lse, cu_seqlens, *ctx.args)
    return (dq, dk, dv) + (None,) * (1 + len(ctx.args))


_varlen_attention_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


# --------------------------------------------------------------------------- public API
def _check_qkv(q, k, v) -> None:
    check_tensor("q", q, ndim=3, dtypes=_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=q.device)
    check_tensor("v", v, shape=list(k.shape), dtypes=(q.dtype,), device=q.device)
    T, Hq, D = q.shape
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k must have shape [T, Hkv, D] = [{T}, *, {D}] (T and D of q), got {list(k.shape)}")
    if k.shape[1] == 0 or Hq % k.shape[1] != 0:
        raise ValueError(f"the number of query heads ({Hq}) must be a multiple of the KV heads ({k.shape[1]})")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim D must be a multiple of 8 in [8, 256], got {D}")


def _check_scale(softmax_scale, head_dim: int) -> float:
    scale = check_float("softmax_scale", softmax_scale, valid=lambda v: math.isfinite(v) and v > 0,
                        expected="a finite positive number", or_none=True)
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def check_window(window_size) -> Tuple[int, int]:
    """flash-attn's ``window_size = (left, right)``: two ints, each -1 (unbounded) or >= 0."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair of ints, got {window_size!r}")
    left, right = (check_int(f"window_size[{i}]", w, minimum=-1) for i, w in enumerate(window_size))
    return left, right


def check_softcap(softcap) -> float:
    return check_float("softcap", softcap, valid=lambda v: math.isfinite(v) and v >= 0,
                       expected="finite and >= 0 (0: no soft-capping)")


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    return_lse: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Attention inside each packed sequence (flash-attn ``flash_attn_varlen_func`` semantics).

    Args:
        q: ``[T, Hq, D]`` float16 / bfloat16 / float32.
        k, v: ``[T, Hkv, D]``, same dtype and device as ``q``; ``Hq % Hkv == 0`` (GQA/MQA:
            query head ``h`` uses KV head ``h // (Hq // Hkv)``).
        cu_seqlens: int32 (or int64) ``[B+1]``: 0, non-decreasing, last = ``T``. Empty and
            length-1 sequences are fine.
        max_seqlen: int, an upper bound on the longest sequence (flash-attn compatibility;
            neither backend needs it to be exact).
        causal: query ``i`` attends keys ``j <= i`` of its own sequence (default), else all
            keys of its sequence.
        softmax_scale: scale of ``q @ k^T``; default ``1 / sqrt(D)``.
        return_lse: also return the log-sum-exp (natural log) of the scaled (and capped) scores.
        window_size: ``(left, right)`` sliding window (flash-attn's, Mistral / Qwen2 / Gemma 2):
            query ``i`` attends keys ``j`` of its sequence with ``i - left <= j <= i + right``;
            -1 = unbounded on that side; with ``causal`` the right side is 0 whatever is given.
        softcap: logit soft-capping (flash-attn's, Gemma 2): scores become
            ``softcap * tanh(softmax_scale * q.k / softcap)``; 0 = off.
        deterministic: flash-attn's flag, same default. ``False``: the Triton backward adds dQ
            with fp32 atomics inside the dK/dV kernel (5 matmuls per tile pair, not 7; where the
            GPU has no spill-free tile for that, the dQ kernel runs anyway); its last bits may
            differ between runs. ``True``: a separate dQ kernel, bitwise reproducible. The
            torch (CPU) path is deterministic either way.

    ``D`` must be a multiple of 8 up to 256 (``SUPPORTED_HEAD_DIMS``).

    Returns:
        ``out [T, Hq, D]`` in ``q``'s dtype; with ``return_lse``, ``(out, lse)`` with ``lse``
        float32 ``[Hq, T]`` (not differentiable).

    Raises:
        TypeError / ValueError naming the argument, before any work (see
        :mod:`dapo_kernels._validation`). Validating ``cu_seqlens`` costs one host sync.

    Differentiable for ``q``, ``k``, ``v``.

    NaN / inf: a query's ``out`` / ``lse`` / ``dq`` rows are NaN when its ``q``, or the ``k`` / ``v``
    of a key it attends (its sequence; causal: that key and the earlier ones), hold a NaN or inf,
    and so are the ``dk`` / ``dv`` rows of the keys such a query attends; nothing else changes
    (other sequences, earlier queries), on both backends, whatever their block sizes.
    """
    _check_qkv(q, k, v)
    check_cu_seqlens(cu_seqlens, q.shape[0], device=q.device)
    max_seqlen = check_int("max_seqlen", max_seqlen, minimum=0)
    causal = check_flag("causal", causal)
    return_lse = check_flag("return_lse", return_lse)
    scale = _check_scale(softmax_scale, q.shape[2])
    window = check_window(window_size)
    softcap = check_softcap(softcap)
    deterministic = check_flag("deterministic", deterministic)
    out, lse = _varlen_attention_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens.to(torch.int32).contiguous(),
        max_seqlen, causal, scale, *window, softcap, deterministic,
    )
    if not return_lse:
        return out
    # Base 2 only if the Triton kernel ran: an out-of-tree kernel (NPU) runs even when
    # triton is forced, and its lse is natural.
    triton_ran = current_backend(q.device) == "triton" and not backend_kernel_serves(
        "dapo::varlen_attention_fwd", q.device)
    return out, (lse * _LN2 if triton_ran else lse)
