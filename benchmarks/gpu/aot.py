"""Compile every Triton kernel of dapo_kernels for sm_90 / sm_80 without a GPU, and read what
``ptxas`` made of it: per ``tl.dot`` the tensor-core instructions and their shapes, registers,
spills, shared memory, occupancy, and a static performance estimate.

    python benchmarks/gpu/aot.py [--set full|test] [--arch 90 80] [--ops OP ...] [--jobs N] [--markdown F]

Triton compiles to a cubin on any machine (it ships ``ptxas``); only the launch needs the GPU.
This process (never under ``TRITON_INTERPRET``: the kernels must be decorated for real) installs
a stand-in driver that names the target architecture, makes ``JITFunction.run`` compile without
launching and ``Autotuner.run`` compile every config its ``early_config_prune`` keeps (the
configs the autotuner would time), then calls each op's registered Triton launcher on small CPU
tensors. Every kernel is reached through its real launcher, so constexprs, block sizes and
configs are exactly those a GPU run compiles (Triton also specialises integer arguments on
divisibility by 16; the sizes here are multiples of 16, the common case).

Per compiled kernel: registers and stack frame from the cubin (``cuobjdump
--dump-resource-usage``; these kernels call no functions and keep no local arrays, so a stack frame
only ever holds spilled registers: ``ptxas -v`` reports as many spill-store bytes; on a GPU,
``--driver`` also loads each cubin and records the driver's ``n_regs`` / ``n_spills``), shared
memory = Triton's dynamic allocation + the cubin's static one, per dot the
``wgmma m64nNk16`` N values / ``mma.sync`` shapes / CUDA-core FMA read from the PTX's line
information, resident blocks per SM, and the model's predicted TFLOP/s (an ESTIMATE; the model
is stated in benchmarks/gpu/aot_model.py).

Rules (:func:`violations`; documented breaks in the one table :data:`EXCEPTIONS`): shared memory
within the chip's per-block limit, no spills, and on sm_90 every dot of a 16-bit matmul kernel a
``wgmma`` with N >= 64 and no ``mma.sync`` in any kernel.

``--jsonl F`` appends each kernel's record to ``F`` as it is compiled (worker i of ``--jobs``: ``F.i``), so
a run killed or failed part-way keeps what it compiled (:func:`read_jsonl`; ``device_run.py`` rebuilds
``aot.json`` from it); with ``--jobs``, a failed worker's records are merged all the same and the run
exits 1.

``--set full`` (default) is the sweep recorded in benchmarks/RESULTS.md; ``--set test`` the subset
tests/test_aot_compile.py compiles (see :func:`cases`). Compiled kernels are cached on disk by
Triton (``TRITON_CACHE_DIR``, default ``.cache/triton-aot`` in the checkout).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu import aot_model  # noqa: E402
from gpu.aot_cases import ATTN_HEAD_DIMS, OPS_DIR, Case, cases, jit_kernels  # noqa: E402,F401

ARCHS = (90, 80)
# Opt-in shared memory per block (CUDA programming guide, compute capabilities table).
SMEM_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
# wgmma's narrowest N that runs the tensor cores near their rate (aot_model.wgmma_efficiency).
MIN_WGMMA_N = 64
# Kernels with a tl.dot on their hot path: on sm_90 each dot of their 16-bit instances must be a
# wgmma with N >= MIN_WGMMA_N. fp32 inputs run input_precision="ieee" (exact fp32 products), which
# no tensor-core instruction computes: those dots are FMA by design.
MATMUL_KERNELS = (
    "_varlen_attention_fwd_kernel", "_varlen_attention_bwd_dkdv_kernel", "_varlen_attention_bwd_dq_kernel",
    "_varlen_attention_fwd_hopper_kernel", "_moe_gate_up_fwd_kernel", "_moe_rows_gemm_kernel",
    "_moe_gate_up_bwd_kernel", "_moe_weight_grad_kernel",
)
B16 = ("float16", "bfloat16")
# Kernels a launcher starts on one arch only (the rest compile on every arch in ARCHS).
KERNEL_ARCHS = {"_varlen_attention_fwd_hopper_kernel": 90}  # (the descriptor forward: sm_90's TMA)


@dataclasses.dataclass(frozen=True)
class Allowed:
    """A known, documented rule break: ``kernel`` on ``sm_<arch>`` for inputs of ``dtypes`` whose head
    dim uses a tile row in ``rows`` (varlen_attention's _GPU_TILES; empty: any), violations whose rule
    (text before the first ':') is in ``rules``, on the dots named in ``dots`` (empty: any)."""
    kernel: str
    arch: int
    dtypes: Tuple[str, ...]
    rules: Tuple[str, ...]
    reason: str
    dots: Tuple[str, ...] = ()
    rows: Tuple[int, ...] = ()
    triton_below: Tuple[int, int] = (99, 0)  # only under Triton versions below this (major, minor)


_F32_DP_SPILLS = (
    "fp32 backward: dP = dO V^T is summed in fp64 (exact products; varlen_attention.lse.delta_dtype: its "
    "fp32 rounding did not cancel against delta where a query sees one key, 2.9x torch's error); the fp64 "
    "mma operands and accumulator spill 8-3056 B in most fp32 dK/dV and dQ tiles (D=256 most). "
    "Correctness first: fp32 attention is not the GPU training path (16-bit inputs are, unchanged)")
_F64_MMA = ("fp32 backward: dP summed in fp64 (see the spills entry); fp64 has no wgmma, mma.sync m8n8k4.f64 "
            "is Hopper's only fp64 tensor-core instruction")
_ISSUE31 = "issue 31 (Hopper retiling) removes it: "
# The one table of known rule breaks. tests/test_aot_compile.py fails on any other break, and on an
# entry that no longer happens for inputs the test set compiles (then delete it).
_FWD, _DKDV, _DQ = ("_varlen_attention_fwd_kernel", "_varlen_attention_bwd_dkdv_kernel",
                     "_varlen_attention_bwd_dq_kernel")
_NARROW = ("narrow wgmma",)
_NOT_WGMMA = ("no wgmma", "mma.sync")
EXCEPTIONS: Tuple[Allowed, ...] = (
    Allowed(_DKDV, 90, B16, _NARROW, "issue 31: 128 keys x 32 queries at 8 warps gives N=32 per warpgroup for S^T "
            "and dP^T at D = 96-128: today's tiles, kept as autotune candidates beside the all-n64 tile of 64 "
            "queries (TMA form), so autotuning can only pick something at least as fast",
            dots=("b_st", "b_dpt"), rows=(96, 128)),
    Allowed(_DKDV, 90, B16, _NARROW, _ISSUE31 + "128 keys x 32 queries (the spill-free tiles at D <= 32) "
            "give S^T and dP^T N=32 per warpgroup", dots=("b_st", "b_dpt"), rows=(16, 32)),
    Allowed(_DKDV, 90, B16, _NARROW, "dV += P^T dO and dK += dS^T Q have N = the head dim: below 64 at "
            "D <= 32", dots=("b_dv", "b_dk"), rows=(16, 32)),
    Allowed(_DKDV, 90, B16, _NARROW + _NOT_WGMMA, _ISSUE31 + "atomic dQ = dS K has M = the query block "
            "(16-32 rows at D <= 32, under wgmma's 64 per warpgroup: mma.sync), and N = D / 2 where 64 queries "
            "split over 8 warps' 2 warpgroups (8 at D=16, 32 at D=64)",
            dots=("b_dq",), rows=(16, 32, 64)),
    Allowed(_DQ, 90, B16, _NARROW, _ISSUE31 + "at D = 32 the dQ tile of 32 keys at 4 warps gives S and dP N = 32",
            dots=("b_s", "b_dp"), rows=(32,)),
    Allowed(_DQ, 90, B16, _NARROW, "dQ += dS K has N = the head dim: below 64 at D <= 32",
            dots=("b_dq",), rows=(16, 32)),
    Allowed(_FWD, 90, B16, _NARROW, "O += P V has N = the head dim: below 64 at D <= 32", dots=("b_pv",),
            rows=(16, 32)),
    Allowed(_FWD, 90, B16, _NARROW, _ISSUE31 + "at D = 256 the key block is 16-32 (32 x 256 K and V tiles "
            "already take 132 KB of shared memory at 3 stages), so S = Q K^T has N = 8-16", dots=("b_s",),
            rows=(256,)),
    Allowed(_DKDV, 90, B16, _NOT_WGMMA, "every dK/dV tile with >= 64 rows (wgmma's minimum per warpgroup) "
            "spills at D = 256 (32 rows spill too since the NaN masking); the spill-free 16-row tile runs "
            "mma.sync", rows=(256,)),
    Allowed(_DQ, 90, B16, _NOT_WGMMA, "the 64-row dQ tile spills at D = 256 (80-176 B, with the NaN masking "
            "of the diagonal tile); the spill-free 32-row tile runs mma.sync", rows=(256,)),
    *(Allowed(k, 90, ("float32",), ("mma.sync",), _F64_MMA, dots=("b_acc",)) for k in (_DKDV, _DQ)),
    *(Allowed(k, arch, ("float32",), ("spills",), _F32_DP_SPILLS) for k in (_DKDV, _DQ) for arch in ARCHS),
)


# --------------------------------------------------------------------------- compiling
class _FakeDriver:
    """The few calls JITFunction.run / create_binder make of the active driver, for a GPU that
    is not there: the compile target is ``cuda:<cc>``."""

    def __init__(self, cc: int):
        self.cc = cc

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", self.cc, 32)

    def get_current_device(self):
        return self.cc  # one binder cache per architecture

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


@dataclasses.dataclass
class Record:
    kernel: str
    config: str
    op: str
    dtype: str
    inputs: str
    arch: int
    case: int = 0
    regs: int = 0
    stack: int = 0  # bytes of stack frame = spilled registers (see the module docstring)
    smem: int = 0
    mma: str = "-"  # summary: wgmma / mma (mma.sync) / wgmma+mma / - (CUDA cores only)
    compile_s: float = 0.0
    threads: int = 0
    dots: Dict[str, Dict[str, int]] = dataclasses.field(default_factory=dict)  # aot_model.dot_shapes
    mma_sync: int = 0  # mma.sync instructions in the PTX
    blocks: int = 0  # resident blocks per SM (aot_model.occupancy)
    limiter: str = ""  # what limits them
    model: Optional[dict] = None  # aot_model.predict: the estimate at the reference problem
    driver: Optional[dict] = None  # --driver on a GPU: the driver's n_regs / n_spills of the loaded cubin

    @property
    def head_dim(self) -> Optional[int]:
        m = re.search(r"D=(\d+)", self.inputs)
        return int(m.group(1)) if m else None

    @property
    def tile_row(self) -> Optional[int]:
        """The _GPU_TILES row serving this head dim (the smallest tabled one at or above it)."""
        d = self.head_dim
        return None if d is None else next((t for t in ATTN_HEAD_DIMS if t >= d), None)


_CONFIG_KEYS = re.compile(r"^(BLOCK_[A-Z]+|ATOMIC_DQ|TMA|FINITE_QDO|num_warps|num_stages)$")


@contextlib.contextmanager
def _aot_mode(arch: int, on_compile):
    """Inside: kernels compile for ``sm_<arch>`` and never launch; ``on_compile(name, kwargs,
    kernel, seconds)`` sees each distinct compiled kernel once."""
    from triton.runtime import driver
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction
    orig_jit_run, orig_at_run, orig_driver = JITFunction.run, Autotuner.run, driver._active
    seen = set()

    def jit_run(self, *args, grid, warmup, **kwargs):
        t0 = time.perf_counter()
        kernel = orig_jit_run(self, *args, grid=grid, warmup=True, **kwargs)
        if (self.fn.__name__, kernel.hash) not in seen:
            seen.add((self.fn.__name__, kernel.hash))
            on_compile(self.fn.__name__, kwargs, kernel, time.perf_counter() - t0)
        return kernel

    def at_run(self, *args, grid, warmup=False, **kwargs):
        # What Autotuner.run would time: the configs left by the kernel's pruning.
        self.nargs = dict(zip(self.arg_names, args))
        for cfg in self.prune_configs(kwargs):
            self.fn.run(*args, **kwargs, **cfg.all_kwargs(), grid=grid, warmup=True)
        self.nargs = None

    driver.set_active(_FakeDriver(arch))
    JITFunction.run, Autotuner.run = jit_run, at_run
    try:
        yield
    finally:
        JITFunction.run, Autotuner.run = orig_jit_run, orig_at_run
        driver.set_active(orig_driver)


def _cuobjdump() -> str:
    import triton
    shipped = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return shipped if os.path.exists(shipped) else shutil.which("cuobjdump") or shipped


def _resources(kernel, arch: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        pathlib.Path(cubin).write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
        found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", usage)
        regs, stack, static_smem = (int(x) for x in found.groups())
    dots = aot_model.dot_shapes(kernel.asm["ptx"])
    kinds = {k.split()[0] for shapes in dots.values() for k in shapes}
    mma = "+".join(k for k in ("wgmma", "mma") if k in kinds) or "-"
    smem = kernel.metadata.shared + static_smem
    threads = 32 * kernel.metadata.num_warps * getattr(kernel.metadata, "num_ctas", 1)
    blocks, limiter = aot_model.occupancy(regs, threads, smem, arch)
    return dict(regs=regs, stack=stack, smem=smem, mma=mma, threads=threads, dots=dots,
                mma_sync=aot_model.mma_sync_count(dots), blocks=blocks, limiter=limiter)


def _driver_resources(drv, kernel) -> dict:
    """The real driver's view of the cubin (a GPU of the compiled arch must be present)."""
    try:
        loaded = drv.utils.load_binary(kernel.name, kernel.asm["cubin"], kernel.metadata.shared,
                                       drv.get_current_device())
        return dict(n_regs=loaded[2], n_spills=loaded[3])
    except Exception as e:  # a Triton whose load_binary differs: recorded, not fatal
        return dict(error=f"{type(e).__name__}: {e}"[:200])


def compile_cases(arch: int, selected: List[Tuple[int, Case]], log=None, driver_check=False) -> List[Record]:
    """Compile the ``(case number, case)`` pairs for ``sm_<arch>``; one Record per distinct compiled
    kernel (a kernel two cases share, e.g. the delta preprocess of causal and non-causal, once).
    ``driver_check``: also load each cubin with the real driver (on a GPU of that arch)."""
    from triton.runtime import driver
    real_driver = driver.active if driver_check else None
    records: List[Record] = []
    current: List[Tuple[int, Case]] = []

    def on_compile(name, kwargs, kernel, seconds):
        i, case = current[0]
        cfg = " ".join(f"{k.replace('num_', '')}={v}" for k, v in kwargs.items() if _CONFIG_KEYS.match(k))
        rec = Record(name, cfg, case.op, case.dtype, case.inputs, arch, i, compile_s=round(seconds, 2),
                     **_resources(kernel, arch))
        if arch == 90:  # the model is the H200's
            rec.model = aot_model.predict(rec.kernel, rec.dtype, rec.inputs, rec.dots, rec.blocks, rec.threads // 32,
                                          rec.config)
        if real_driver is not None:
            rec.driver = _driver_resources(real_driver, kernel)
        records.append(rec)
        if log:
            log(rec)

    with _aot_mode(arch, on_compile):
        for pair in selected:
            current[:] = [pair]
            pair[1].call()
    return records


def violations(rec: Record) -> List[str]:
    """The rules every offered config must meet; each text is ``rule: detail`` (per dot: ``rule:
    label ...``, label as aot_model.dot_shapes names it)."""
    out = []
    if rec.smem > SMEM_LIMIT[rec.arch]:
        out.append(f"shared memory: {rec.smem} B > {SMEM_LIMIT[rec.arch]} B")
    if rec.stack:
        out.append(f"spills: {rec.stack} B of stack")
    if rec.arch != 90:
        return out
    for label, shapes in rec.dots.items():
        if rec.kernel in MATMUL_KERNELS and rec.dtype in B16:
            ns = aot_model.wgmma_ns(shapes)
            if not ns:
                out.append(f"no wgmma: {label} ({', '.join(shapes)})")
            elif min(ns) < MIN_WGMMA_N:
                out.append(f"narrow wgmma: {label} n{min(ns)} < n{MIN_WGMMA_N}")
        syncs = {k: n for k, n in shapes.items() if k.startswith("mma ")}
        if syncs:
            out.append(f"mma.sync: {label} ({', '.join(f'{k} x{n}' for k, n in syncs.items())})")
    return out


def _triton_version() -> Tuple[int, int]:
    import triton

    return tuple(int(x) for x in triton.__version__.split(".")[:2])


def _applies(entry: Allowed, rec: Record) -> bool:
    """``entry`` covers ``rec``'s kernel, arch, dtype and head dim under the Triton that compiled it."""
    return ((rec.kernel, rec.arch) == (entry.kernel, entry.arch) and rec.dtype in entry.dtypes
            and (not entry.rows or rec.tile_row in entry.rows) and _triton_version() < entry.triton_below)


def exception_of(rec: Record, violation: str) -> Optional[Allowed]:
    """The EXCEPTIONS entry that documents this violation of ``rec``, if any."""
    rule, _, detail = violation.partition(": ")
    dot = detail.split(":")[0]
    for entry in EXCEPTIONS:
        if _applies(entry, rec) and rule in entry.rules and (not entry.dots or dot in entry.dots):
            return entry
    return None


def due_exceptions(records: List[Record], arch: int) -> set:
    """The EXCEPTIONS entries for ``sm_<arch>`` that some compiled record falls under (kernel, dtype,
    head dim, and a dot they name): each must still be observed, else its entry is stale."""
    return {e for e in EXCEPTIONS if e.arch == arch and any(
        _applies(e, r) and (not e.dots or any(label.split(":")[0] in e.dots for label in r.dots)) for r in records)}


def _dot_cell(shapes: Dict[str, int]) -> str:
    """``n64 x16`` (wgmma N x count), ``sync m16n8k16 bf16 x8`` (mma.sync), ``fma x512``."""
    return " ".join(f"{k.replace('wgmma ', '').replace('mma ', 'sync ')} x{n}" for k, n in shapes.items())


def shapes_table(records: List[Record]) -> str:
    """The instruction-shape table: one row per compiled matmul kernel config."""
    lines = ["| kernel | config | arch | dtype | inputs | per dot: instruction x count | mma.sync | regs | "
             "spills (B) | smem (B) | blocks/SM (limit) | predicted TFLOP/s (estimate) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r.kernel not in MATMUL_KERNELS:
            continue
        dots = "; ".join(f"{label.split(':')[0]} {_dot_cell(s)}" for label, s in r.dots.items()) or "-"
        pred = f"{r.model['tflops']:.0f} ({r.model['fraction']:.2f}, {r.model['bound']})" if r.model else "-"
        lines.append(f"| {r.kernel.replace('_varlen_attention_', 'attn_').replace('_linear_log_probs_', 'lm_')} | "
                     f"{r.config or '-'} | sm_{r.arch} | {r.dtype} | {r.inputs} | {dots} | {r.mma_sync} | {r.regs} | "
                     f"{r.stack} | {r.smem} | {r.blocks} ({r.limiter}) | {pred} |")
    return "\n".join(lines)


def markdown(records: List[Record]) -> str:
    lines = ["| kernel | config | op: dtype, inputs | arch | registers | shared memory (B) | "
             "spills (stack B) | MMA | blocks/SM | rule |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        broken = violations(r)
        rule = "; ".join(("exception: " if exception_of(r, v) else "FAIL: ") + v for v in broken) or "ok"
        lines.append(f"| {r.kernel} | {r.config or '-'} | {r.op}: {r.dtype}, {r.inputs} | sm_{r.arch} | {r.regs} | "
                     f"{r.smem} | {r.stack} | {r.mma} | {r.blocks} ({r.limiter}) | {rule} |")
    return "\n".join(lines)


def summary(records: List[Record]) -> str:
    """One row per kernel and arch: kernels compiled, the largest registers / shared memory, how
    many spill, the MMA instructions used, and the rule breaks (documented exceptions apart)."""
    lines = ["| kernel | arch | compiled | max registers | max shared memory (B) | spilling | MMA | "
             "rule breaks (exceptions) |", "|---|---|---|---|---|---|---|---|"]
    for arch in ARCHS:
        for kernel in dict.fromkeys(r.kernel for r in records if r.arch == arch):
            rs = [r for r in records if (r.kernel, r.arch) == (kernel, arch)]
            broken = [(r, v) for r in rs for v in violations(r)]
            excepted = sum(1 for r, v in broken if exception_of(r, v))
            spilling = sum(1 for r in rs if r.stack)
            mma = ", ".join(sorted({r.mma for r in rs}))
            lines.append(f"| {kernel} | sm_{arch} | {len(rs)} | {max(r.regs for r in rs)} | {max(r.smem for r in rs)} "
                         f"| {spilling} | {mma} | {len(broken) - excepted} ({excepted}) |")
    return "\n".join(lines)


def read_jsonl(prefix: str) -> List[Record]:
    """The records appended to ``prefix`` and its workers' ``prefix.i`` (``--jsonl``); a line cut short by a
    killed writer is skipped."""
    records = []
    for path in sorted(p for p in glob.glob(glob.escape(prefix) + "*") if p == prefix or
                       re.fullmatch(r"\.\d+", p[len(prefix):])):
        for line in pathlib.Path(path).read_text().splitlines():
            try:
                records.append(Record(**json.loads(line)))
            except (ValueError, TypeError):
                continue
    return records


def write_files(records: List[Record], json_path: Optional[str], md_path: Optional[str]) -> None:
    """Sort ``records`` (stable: compile order within a case) and write the JSON and markdown where given."""
    records.sort(key=lambda r: (ARCHS.index(r.arch), r.case))
    if json_path:
        pathlib.Path(json_path).write_text(json.dumps([dataclasses.asdict(r) for r in records]))
    if md_path:
        pathlib.Path(md_path).write_text("\n\n".join([
            summary(records), "Instruction shapes, occupancy and the model's estimate (aot_model):",
            shapes_table(records), aot_model.summarize(records), markdown(records)]) + "\n")


def _write(records: List[Record], args) -> int:
    write_files(records, args.json, args.markdown)
    unexpected = [f"{r.kernel} [{r.config}] {r.dtype} {r.inputs} sm_{r.arch}: {v}"
                  for r in records for v in violations(r) if not exception_of(r, v)]
    print(shapes_table(records) + "\n\n" + aot_model.summarize(records))
    print(f"rule breaks outside EXCEPTIONS: {len(unexpected)}", *unexpected, sep="\n")
    return 1 if args.check and unexpected else 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", default="full", choices=("full", "test"))
    ap.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), choices=ARCHS)
    ap.add_argument("--ops", nargs="+", help="only the cases of these ops (default: all)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (cases dealt round-robin)")
    ap.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--jsonl", help="append each record here as it is compiled (worker i of --jobs: F.i)")
    ap.add_argument("--die-after", type=int, default=0, help=argparse.SUPPRESS)  # tests: SIGKILL after N records
    ap.add_argument("--markdown", help="write the table here")
    ap.add_argument("--check", action="store_true", help="exit 1 on a rule break outside EXCEPTIONS")
    ap.add_argument("--driver", action="store_true",
                    help="on a GPU: also load each cubin and record the driver's n_regs / n_spills")
    args = ap.parse_args(argv)
    # Before dapo_kernels is imported: real (not interpreted) kernels, and the on-disk cache.
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_CACHE_DIR", str(ROOT / ".cache" / "triton-aot"))
    sys.path.insert(0, str(ROOT))
    if args.jobs > 1:
        return _run_jobs(args)
    import dapo_kernels  # noqa: F401  (registers the launchers)
    shard, shards = (int(x) for x in args.shard.split("/"))
    t0 = time.perf_counter()
    selected = [(i, c) for i, c in enumerate(cases(args.set)) if not args.ops or c.op in args.ops][shard::shards]
    records = []

    def log(r: Record) -> None:
        print(f"{r.kernel:36s} {r.config:40s} {r.dtype:8s} {r.inputs:18s} sm_{r.arch} regs={r.regs:3d} "
              f"stack={r.stack} smem={r.smem} blocks={r.blocks} {r.mma} {r.compile_s}s {'; '.join(violations(r))}",
              file=sys.stderr, flush=True)
        if args.jsonl:  # one line per kernel as it finishes: a killed run keeps these
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(dataclasses.asdict(r)) + "\n")
        n_done[0] += 1
        if n_done[0] == args.die_after:
            os.kill(os.getpid(), signal.SIGKILL)

    n_done = [0]
    if args.jsonl:
        open(args.jsonl, "w").close()  # this run's records only
    for arch in args.arch:
        records += compile_cases(arch, selected, driver_check=args.driver, log=log)
    print(f"compiled {len(records)} kernels in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return _write(records, args)


def _run_jobs(args) -> int:
    """Deal the cases to ``--jobs`` processes, then merge their records."""
    with tempfile.TemporaryDirectory() as tmp:
        prefix = args.jsonl or f"{tmp}/part"
        procs = [subprocess.Popen([sys.executable, __file__, "--set", args.set, "--arch", *map(str, args.arch),
                                   *(["--ops", *args.ops] if args.ops else []), "--shard", f"{i}/{args.jobs}",
                                   *(["--driver"] if args.driver else []), "--jsonl", f"{prefix}.{i}",
                                   *(["--die-after", str(args.die_after)] if args.die_after else [])],
                                  stdout=subprocess.DEVNULL) for i in range(args.jobs)]
        failed = [(i, rc) for i, rc in enumerate(p.wait() for p in procs) if rc]
        records = read_jsonl(prefix)  # a failed worker's compiled kernels are kept too
    rc = _write(records, args)
    for i, code in failed:
        print(f"aot worker {i}/{args.jobs} failed (exit {code}); the kernels it compiled are kept", file=sys.stderr)
    return 1 if failed else rc


if __name__ == "__main__":
    sys.exit(main())
