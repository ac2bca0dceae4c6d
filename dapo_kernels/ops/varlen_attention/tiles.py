"""GPU tile tables of the attention kernels: per (kernel, arch family, input element size) and head
dim, the outer block (rows a program owns; its work list is built for it) and the (inner block,
warps, stages) configs the autotuner times; every other config is pruned before launch.

Every offered tile compiles without register spills and within the chip's shared memory, causal
and not (benchmarks/gpu/aot.py; tests/test_aot_compile.py checks again). How each entry was
chosen is in NOTES.md ("Tile tables").
"""
from __future__ import annotations

import torch
import triton
from triton.runtime import driver

from .._triton_utils import INTERPRET

# Outer block in the interpreter: small, so CPU tests cover several (and partial) blocks per sequence.
_OUTER_BLOCK_INTERPRET = 32

# Family 90 is Hopper, 80 every other chip (compiled for sm_80). 16-bit inputs on Hopper keep outer
# blocks >= 64 (wgmma computes 64 rows per warpgroup) except where every such tile spills (dK/dV and dQ
# at D = 256); fp32 inputs multiply in IEEE fp32 on the CUDA cores: small tiles. ptxas allocates per
# head dim and per arch, hence one row per tabled head dim.
_F16_DKDV = {16: (128, ((32, 4, 2), (32, 8, 3), (64, 8, 2))), 32: (128, ((32, 8, 3),)), 64: (64, ((16, 8, 3),)),
             **dict.fromkeys((96, 128), (64, ((16, 8, 2),))), 256: (16, ((16, 8, 3),))}
# Hopper, 16-bit: 128 keys at 8 warps, each warpgroup 64 key rows, 64 queries: S^T / dP^T n64 (64 keys x 16
# queries gave N = 8), in the TMA form (_DKDV_TMA_ROWS). D = 96-128 at 1 stage (2 spilled in some instances);
# the 32-query tiles (n32) they had before stay offered.
_F16_DKDV_90 = {64: (128, ((64, 8, 1), (64, 8, 2))),
                **dict.fromkeys((96, 128), (128, ((64, 8, 1), (32, 8, 2), (32, 8, 3))))}
_F32_FWD = {16: (64, ((32, 4, 2), (32, 8, 2))), **dict.fromkeys((32, 64), (64, ((16, 8, 2), (32, 8, 2)))),
            **dict.fromkeys((96, 128), (32, ((16, 8, 1),))), 256: (16, ((16, 8, 2),))}
# 1 stage where 2 spilled: without the software pipeline ptxas keeps fewer registers live.
_F32_DKDV = {16: (64, ((16, 4, 2),)), 32: (16, ((16, 8, 2),)), 64: (32, ((16, 8, 2),)), 96: (16, ((16, 8, 1),)),
             128: (16, ((16, 8, 2),)), 256: (16, ((16, 8, 1),))}
_F32_DQ = {16: (64, ((32, 4, 2), (32, 8, 2))), 32: (64, ((32, 8, 2),)), 64: (64, ((16, 8, 2),)),
           **dict.fromkeys((96, 128), (32, ((16, 8, 1),))), 256: (16, ((16, 8, 1), (16, 4, 1)))}
# sm_80 allocates the fp32 dQ tiles differently: its 1-stage tiles spill at D = 96-256.
_F32_DQ_80 = {**_F32_DQ, **dict.fromkeys((96, 128), (16, ((16, 8, 2),))), 256: (16, ((16, 4, 1),))}
_SMALL_D = (128, ((64, 4, 3), (64, 8, 3), (128, 8, 3)))
_GPU_TILES = {
    ("fwd", 90, 2): {**dict.fromkeys((16, 32), _SMALL_D), 64: (128, ((64, 8, 3), (128, 8, 3))),
                     96: (128, ((64, 8, 3),)), 128: (128, ((64, 8, 3), (128, 8, 2))),  # (128 keys: D=96 spilled)
                     256: (64, ((16, 8, 3), (32, 8, 3)))},
    # The descriptor (TMA) forward on Hopper (triton_fwd_tma.py), autotuned beside the "fwd" row's configs;
    # its outer block is the "fwd" row's (the work list is built before the autotuner picks).
    # (128 keys at 3 stages: D = 128 window + softcap spilled 64 B.)
    ("tma_fwd", 90, 2): {64: (128, ((64, 8, 3), (64, 8, 4), (128, 8, 3))),
                         **dict.fromkeys((96, 128), (128, ((64, 8, 3), (64, 8, 4), (64, 8, 5), (128, 8, 2)))),
                         # D = 256: one warpgroup over 64 queries (S n64, O n256; 128 fp32 registers of O per
                         # thread); 3 stages spilled 8 B with window + softcap.
                         256: (64, ((64, 4, 2),))},
    # Offered only without window and softcap, capped at TMA_FWD_PLAIN_MAXNREG registers (2 blocks per SM):
    # spill-free plain; with softcap or a window it spilled 80-88 B.
    ("tma_fwd_plain", 90, 2): dict.fromkeys((96, 128), (128, ((64, 8, 2),))),
    ("fwd", 80, 2): {16: _SMALL_D, 32: (128, ((32, 4, 3), (64, 8, 3))), 64: (128, ((64, 8, 3),)),
                     **dict.fromkeys((96, 128), (128, ((32, 8, 3),))), 256: (64, ((16, 8, 3), (32, 8, 3)))},
    ("dkdv", 90, 2): {**_F16_DKDV, **_F16_DKDV_90},
    ("dkdv", 80, 2): _F16_DKDV,
    # 128 queries at 8 warps: with 64 (8 warps over a 64-row tile) S and dP ran N = 16-32.
    ("dq", 90, 2): {16: _SMALL_D, 32: (128, ((32, 4, 3), (64, 8, 3), (128, 8, 3))), 64: (128, ((64, 8, 3),)),
                    **dict.fromkeys((96, 128), (128, ((64, 8, 2), (64, 8, 3)))), 256: (32, ((16, 8, 3),))},
    ("dq", 80, 2): {16: _SMALL_D, **dict.fromkeys((32, 64), (128, ((32, 8, 3), (64, 8, 3)))),
                    **dict.fromkeys((96, 128), (64, ((32, 8, 3), (64, 8, 3)))), 256: (32, ((16, 8, 3),))},
    ("fwd", 90, 4): _F32_FWD,
    ("fwd", 80, 4): {**_F32_FWD, 64: (64, ((16, 8, 2),))},  # (sm_80: the 32-key tile spilled 8 B)
    ("dkdv", 90, 4): _F32_DKDV,
    ("dkdv", 80, 4): _F32_DKDV,
    ("dq", 90, 4): _F32_DQ,
    ("dq", 80, 4): _F32_DQ_80,
    # dK/dV with dQ added by atomics (deterministic=False) also holds a dQ tile and its addresses:
    # rows only where that compiles without spills; elsewhere the dQ kernel runs instead.
    ("dkdv_dq", 90, 2): {**{d: _F16_DKDV[d] for d in (16, 32)}, 64: _F16_DKDV_90[64],
                         **dict.fromkeys((96, 128), (128, ((64, 8, 1),)))},  # (32 queries: dQ on mma.sync)
    # With soft-capping the tanh term is one more [keys, queries] fp32 tile: 64 queries spilled 8-48 B at D = 96-128.
    ("dkdv_dq_softcap", 90, 2): {**{d: _F16_DKDV[d] for d in (16, 32)}, 64: _F16_DKDV_90[64]},
    ("dkdv_dq", 80, 2): {d: _F16_DKDV[d] for d in (32, 64)},
    # fp32: D = 32 only, since dP is summed in fp64 (_dot_f64), whose tiles spill at larger D.
    ("dkdv_dq", 90, 4): {d: _F32_DKDV[d] for d in (32,)},
    ("dkdv_dq", 80, 4): {d: _F32_DKDV[d] for d in (32,)},
}
# Triton 3.6-3.8 allocate registers less tightly than 3.9 (3.6: torch 2.11's, the GPU image's): their tables
# drop the tiles that spill only there (AOT test set, Triton 3.6.0 / 3.7.1 / 3.8.0: make test-triton-versions).
# On Hopper all three spill 40-88 B in dK/dV with atomic dQ and 40-96 B in dK/dV with window / softcap at
# D = 96-128, so atomic dQ falls back to the dQ kernel there and the masked dK/dV keeps its 32-query tile;
# the 128-register descriptor forward spills 16-24 B.
TRITON_VERSION = tuple(int(x) for x in triton.__version__.split(".")[:2])
if TRITON_VERSION < (3, 9):
    _GPU_TILES = {
        **_GPU_TILES,
        ("tma_fwd_plain", 90, 2): {},
        ("dkdv_dq", 90, 2): {d: r for d, r in _GPU_TILES["dkdv_dq", 90, 2].items() if d not in (96, 128)},
        ("dkdv_masked", 90, 2): {**_GPU_TILES["dkdv", 90, 2], **dict.fromkeys((96, 128), (128, ((32, 8, 2),)))},
    }
# 3.6 and 3.7 besides: 16 B on sm_80 at D = 16 (16-bit dK/dV), and 16-48 B in the D = 256 descriptor forward
# with a window or softcap (plain: 0).
if TRITON_VERSION < (3, 8):
    _GPU_TILES = {
        **_GPU_TILES,
        ("dkdv", 80, 2): {**_F16_DKDV, 16: (128, ((32, 4, 2), (32, 8, 3)))},
        ("tma_fwd_masked", 90, 2): {d: c for d, c in _GPU_TILES["tma_fwd", 90, 2].items() if d != 256},
    }
# 3.7 is tighter still on sm_80 (8-24 B: the 128-key D = 16 and 64-key D = 32 16-bit forwards, the fp32 D = 64
# forward at 2 stages).
if TRITON_VERSION[:2] == (3, 7):
    _GPU_TILES = {
        **_GPU_TILES,
        ("fwd", 80, 2): {**_GPU_TILES["fwd", 80, 2], 16: (128, ((64, 4, 3), (64, 8, 3))),
                         32: (128, ((32, 4, 3),))},
        ("fwd", 80, 4): {**_GPU_TILES["fwd", 80, 4], 64: (64, ((16, 8, 1),))},
    }
# 3.8 on Hopper: the 128-key descriptor forward at D = 96-128 spills 24 B (causal, and with window + softcap),
# the fp32 D = 64 forward with window + softcap 8 B at 2 stages.
if TRITON_VERSION[:2] == (3, 8):
    _GPU_TILES = {
        **_GPU_TILES,
        ("tma_fwd", 90, 2): {**_GPU_TILES["tma_fwd", 90, 2],
                             **dict.fromkeys((96, 128), (128, ((64, 8, 3), (64, 8, 4), (64, 8, 5))))},
        ("fwd", 90, 4): {**_GPU_TILES["fwd", 90, 4], 64: (64, ((16, 8, 1), (32, 8, 2)))},
    }
TMA_FWD_PLAIN_MAXNREG = 128  # (maxnreg of the "tma_fwd_plain" configs: 128 x 256 threads = half an SM's registers)
# (arch family, element size): the dK/dV rows whose tiles fit only in the TMA form (see _dkdv_tma).
_DKDV_TMA_ROWS = {(90, 2): (64, 96, 128)}
# The head dims _GPU_TILES has rows for (each row serves the head dims up to it).
TILE_HEAD_DIMS = (16, 32, 64, 96, 128, 256)
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


def _table(kernel: str, dtype: torch.dtype) -> dict:
    """The _GPU_TILES rows of ``kernel`` for ``dtype`` on this GPU (a "_softcap" / "_masked" table where it
    has one, else the plain kernel's)."""
    key = (kernel, _arch_family(), dtype.itemsize)
    if key in _GPU_TILES:
        return _GPU_TILES[key]
    return _GPU_TILES[(kernel.removesuffix("_softcap").removesuffix("_masked"), *key[1:])]


def _tiles(kernel: str, dtype: torch.dtype, head_dim: int):
    """(outer block, ((inner block, warps, stages), ...)) of ``kernel`` for these inputs on this GPU."""
    return _table(kernel, dtype)[_tile_dim(head_dim)]


# Autotune key entries beside the flags: the launch's longest sequence and its total tokens, each rounded up
# to a power of two (_length_buckets), so each length bucket times and keeps its own config. Kernel arguments
# that the kernels never read, left out of the compiled specialisation (do_not_specialize).
LENGTH_KEY = ["len_bucket", "tok_bucket"]


def _length_buckets(max_seqlen: int, total_tokens: int) -> tuple:
    """(max_seqlen, total tokens) rounded up to powers of two: the values of LENGTH_KEY for a launch."""
    return triton.next_power_of_2(max(int(max_seqlen), 1)), triton.next_power_of_2(max(int(total_tokens), 1))


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
        tiles = _kernel_row(kernel, kwargs.get("ATOMIC_DQ"), kwargs.get("SOFTCAP"), kwargs.get("LOCAL"))
        offered = _tiles(tiles, named_args["p_q"].dtype, kwargs["HEAD_DIM"])[1]
        return [c for c in configs if (c.kwargs[name], c.num_warps, c.num_stages) in offered]
    return {"early_config_prune": early_config_prune}


def _outer_block(kernel: str, dtype: torch.dtype, head_dim: int) -> int:
    return _OUTER_BLOCK_INTERPRET if INTERPRET else _tiles(kernel, dtype, head_dim)[0]


def _kernel_row(kernel: str, atomic_dq: bool, softcap: bool, local: bool = False) -> str:
    """The _GPU_TILES kernel name of a launch: dK/dV with atomic dQ has its own rows, and with
    soft-capping its own again (_table falls back to "_dq" where there are none); dK/dV with a window
    or soft-capping, "_masked" (falls back to the plain rows)."""
    if atomic_dq:
        return kernel + ("_dq_softcap" if softcap else "_dq")
    return kernel + "_masked" if kernel == "dkdv" and (softcap or local) else kernel


def _atomic_dq_offered(dtype: torch.dtype, head_dim: int, softcap: bool = False) -> bool:
    """Whether dQ by atomics (deterministic=False) has a tile for these inputs on this GPU: where
    none compiles without spills (_GPU_TILES has no "dkdv_dq" row), the dQ kernel runs instead."""
    return INTERPRET or _tile_dim(head_dim) in _table(_kernel_row("dkdv", True, softcap), dtype)


def _dkdv_tma(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the dK/dV kernel loads q / dO (and adds dQ) through tensor descriptors, its causal steps
    one masked loop reading q / dO copies with non-finite entries zeroed (TMA, FINITE_QDO): where its
    offered tiles need that to fit (_DKDV_TMA_ROWS); in the interpreter for 16-bit inputs, so CPU tests
    run both forms."""
    if INTERPRET:
        return dtype.itemsize == 2
    return _tile_dim(head_dim) in _DKDV_TMA_ROWS.get((_arch_family(), dtype.itemsize), ())


def _block_d(head_dim: int) -> int:
    """The kernels' head-dim block: the next power of two, >= 16 (tl.dot's minimum); columns past D masked."""
    return max(16, triton.next_power_of_2(head_dim))
