"""Compile every Triton kernel of dapo_kernels for sm_90 / sm_80 without a GPU, and read what
``ptxas`` made of it: registers, spills, shared memory, tensor-core instructions.

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
only ever holds spilled registers: ``ptxas -v`` reports as many spill-store bytes), shared memory =
Triton's dynamic allocation + the cubin's static one, and the MMA instruction in the PTX
(``wgmma`` on Hopper, ``mma`` = mma.sync, ``-`` = CUDA-core FMA only).

``--set full`` (default) is the sweep recorded in benchmarks/RESULTS.md; ``--set test`` the subset
tests/test_aot_compile.py compiles (see :func:`cases`). Compiled kernels are cached on disk by
Triton (``TRITON_CACHE_DIR``, default ``.cache/triton-aot`` in the checkout).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[2]
OPS_DIR = ROOT / "dapo_kernels" / "ops"
ARCHS = (90, 80)
# Opt-in shared memory per block (CUDA programming guide, compute capabilities table).
SMEM_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
# Kernels with a tl.dot on their hot path: their 16-bit instances must use wgmma on sm_90. fp32
# inputs run input_precision="ieee" (exact fp32 products), which no tensor-core instruction
# computes: those instances are FMA by design.
MATMUL_KERNELS = (
    "_varlen_attention_fwd_kernel", "_varlen_attention_bwd_dkdv_kernel", "_varlen_attention_bwd_dq_kernel",
    "_linear_log_probs_fwd_kernel", "_linear_log_probs_bwd_kernel",
)
ATTN_HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # the rows of varlen_attention's _GPU_TILES
# Head dims between the rows (multiples of 8, masked columns): they compile to other kernels.
ODD_HEAD_DIMS = (8, 40, 80, 112, 160, 200)
# Contiguous group_filter: each power of two up to the widest tile (the kernel's tile shape), and
# sizes that are not multiples of 16 (Triton specialises integer arguments on that).
GROUP_SIZES = (1, 2, 3, 4, 8, 16, 24, 32, 64, 128, 256, 512, 1024, 2048, 3000, 4096)
# Rule breaks that are known and documented (benchmarks/RESULTS.md): (kernel, arch, dtypes,
# inputs prefix, rule prefix) -> why. tests/test_aot_compile.py fails on any other break, and on
# an exception that no longer happens.
_F32_DP_SPILLS = (
    "fp32 backward: dP = dO V^T is summed in fp64 (exact products; varlen_attention._DELTA_DTYPES: its "
    "fp32 rounding did not cancel against delta where a query sees one key, 2.9x torch's error); the fp64 "
    "mma operands and accumulator spill 8-3056 B in most fp32 dK/dV and dQ tiles (D=256 most). "
    "Correctness first: fp32 attention is not the GPU training path (16-bit inputs are, unchanged)")
EXCEPTIONS = {
    ("_varlen_attention_bwd_dkdv_kernel", 90, ("float16", "bfloat16"), "D=256", "no wgmma"):
        "every dK/dV tile with >= 64 rows (wgmma's minimum per warpgroup) spills at D = 256 (32 rows "
        "spill too since the NaN masking); the spill-free 16-row tile runs mma.sync",
    ("_varlen_attention_bwd_dq_kernel", 90, ("float16", "bfloat16"), "D=256", "no wgmma"):
        "the 64-row dQ tile spills at D = 256 (80-176 B, with the NaN masking of the diagonal tile); "
        "the spill-free 32-row tile runs mma.sync",
    **{(f"_varlen_attention_bwd_{k}_kernel", arch, ("float32",), "D=", "spills"): _F32_DP_SPILLS
       for k in ("dkdv", "dq") for arch in ARCHS},
}


def jit_kernels() -> Dict[str, str]:
    """``{kernel name: module file}`` for every ``@triton.jit`` function in dapo_kernels/ops that a
    launcher starts with ``kernel[grid](...)`` (the other jit functions are inlined helpers). An op
    package (a folder) is one unit: its kernels and launchers may sit in different files."""
    found = {}
    for unit in sorted(OPS_DIR.glob("*.py")) + sorted(p for p in OPS_DIR.iterdir() if p.is_dir()):
        trees = {path: ast.parse(path.read_text()) for path in ([unit] if unit.is_file() else unit.rglob("*.py"))}
        launched = {n.func.value.id for tree in trees.values() for n in ast.walk(tree) if isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Subscript) and isinstance(n.func.value, ast.Name)}
        for path, tree in trees.items():
            jitted = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                      and any(ast.unparse(d).startswith("triton.jit") for d in f.decorator_list)}
            found.update({name: str(path.relative_to(OPS_DIR)) for name in sorted(jitted & launched)})
    return found


# --------------------------------------------------------------------------- launches
@dataclasses.dataclass
class Case:
    """One call of registered Triton launchers on CPU tensors."""
    op: str
    dtype: str
    inputs: str
    call: Callable[[], object]


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _attention(specs) -> Iterator[Case]:
    """``specs``: (dtype, head dim, causal[, variant]) tuples; forward and backward (delta, dK/dV
    with and without atomic dQ, dQ). ``variant`` "local" adds a sliding window and soft-capping
    (the LOCAL / SOFTCAP instances of every kernel); default "plain"."""
    import torch
    from dapo_kernels._registry import _impls
    T, Hq, Hkv = 256, 4, 2  # GROUP = 2: the GQA loop of the dK/dV kernel
    for dt, D, causal, *variant in specs:
        local = variant == ["local"]
        masking = (48, -1 if causal else 16, 30.0) if local else (-1, -1, 0.0)  # window left/right, softcap

        def run(dt=dt, D=D, causal=causal, masking=masking):
            q = torch.randn(T, Hq, D, dtype=dt)
            k, v = torch.randn(T, Hkv, D, dtype=dt), torch.randn(T, Hkv, D, dtype=dt)
            cu = torch.tensor([0, 96, T], dtype=torch.int32)
            out, lse = _impls["varlen_attention_fwd"]["triton"](q, k, v, cu, 160, causal, D ** -0.5, *masking)
            for deterministic in (True, False):  # the dQ kernel; dQ by atomics in the dK/dV kernel
                _impls["varlen_attention_bwd"]["triton"](torch.randn_like(q), q, k, v, out, lse, cu, 160, causal,
                                                         D ** -0.5, *masking, deterministic)
        yield Case("varlen_attention", _name(dt),
                   f"D={D} {'causal' if causal else 'full'}{' window+softcap' if local else ''}", run)


def _linear(dtypes) -> Iterator[Case]:
    """Statistics (with and without entropy) and the dlogits recompute of the lm_head ops."""
    import torch
    from dapo_kernels.ops.linear_log_probs import grads_triton, stats_triton
    N, H, V = 128, 256, 512
    for dt in dtypes:
        def run(dt=dt):
            h, w, lab = torch.randn(N, H, dtype=dt), torch.randn(V, H, dtype=dt), torch.randint(0, V, (N,))
            for entropy in (False, True):
                stats_triton(h, w, lab, 1.0, 0, entropy)
            grads_triton(h, w, lab, 1.0, 0, torch.zeros(5, N, dtype=torch.float64), torch.ones(N), torch.ones(N))
        yield Case("linear_log_probs", _name(dt), "N=128 H=256 V=512", run)


def _policy_loss(dtypes) -> Iterator[Case]:
    import torch
    from dapo_kernels._registry import _impls
    n = 2048
    for dt in dtypes:
        for per_token in (False, True):  # token modes: one weight; seq modes: one per token
            def run(dt=dt, per_token=per_token):
                lp, old, adv = (torch.randn(n, dtype=dt) for _ in range(3))
                mask = torch.ones(n, dtype=torch.bool)
                w = torch.ones(n if per_token else 1, dtype=torch.float64)
                _impls["policy_loss_sums"]["triton"](lp, old, adv, mask, w, 0.2, 0.28, 3.0)
                _impls["policy_loss_grad"]["triton"](torch.ones(()), lp, old, adv, mask, w, 0.2, 0.28, 3.0)
            yield Case("policy_loss", _name(dt), f"weights [{'N' if per_token else '1'}]", run)


def _group_filter(score_dtypes, group_sizes, index_dtypes, length_dtypes) -> Iterator[Case]:
    import torch
    from dapo_kernels._registry import _impls
    gf = _impls["group_filter"]["triton"]
    for dt in score_dtypes:
        for gs in group_sizes:  # contiguous groups: the [groups, members] tile's shape follows gs
            def contig(dt=dt, gs=gs):
                for norm in (True, False):
                    gf(torch.randn(64 * gs, dtype=dt), torch.empty(0, dtype=torch.int64), 64, gs, 1e-6, norm, 0.0)
            yield Case("group_filter", _name(dt), f"group_size={gs}", contig)
        for it in index_dtypes:  # arbitrary group_index: the three atomics kernels
            def indexed(dt=dt, it=it):
                for norm in (True, False):
                    gf(torch.randn(2048, dtype=dt), torch.randint(0, 64, (2048,), dtype=it), 64, 0, 1e-6, norm, 0.0)
            yield Case("group_filter", _name(dt), f"group_index {_name(it)}", indexed)
    for dt in length_dtypes:
        def overlong(dt=dt):
            _impls["overlong_penalty"]["triton"](torch.arange(2048).to(dt), 96.0, 32.0, 1.0)
        yield Case("overlong_penalty", _name(dt), "lengths", overlong)


def _packing(dtypes, widths) -> Iterator[Case]:
    import torch
    from dapo_kernels._registry import _impls
    for dt in dtypes:
        for F in widths:  # the feature tile is min(next_pow2(F), 2048) wide
            def run(dt=dt, F=F):
                x, idx = torch.zeros(256, F, dtype=dt), torch.arange(0, 256, 2)
                _impls["index_rows"]["triton"](x, idx)
                _impls["scatter_rows"]["triton"](x[:128], idx, 256)
            yield Case("packing", _name(dt), f"F={F}", run)


def cases(which: str) -> List[Case]:
    """The launches of ``--set which``.

    ``full``: every dtype each op accepts; attention at every supported head dim, causal and not.
    ``test`` (the CPU test's budget): every kernel and every config the pruning keeps for the
    inputs compiled; attention at every head dim once per dtype class, causal and non-causal
    alternating (16-bit: bf16 D=16/64/128 causal, fp16 D=32/96/128 non-causal, bf16 D=256
    non-causal; fp32: D=32/96/256 causal, D=16/64/128 non-causal), two head dims between the
    rows (bf16 80, fp32 112) and two window + soft-capping instances; linear_log_probs in bf16 and
    fp32; the elementwise kernels at one dtype each (their dtype changes only loads and stores),
    group_filter at groups of 4 and 16 (the shapes that spilled before their fix).
    """
    import torch
    f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
    ints = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
    if which == "full":
        return [*_attention([(dt, D, c) for dt in (f16, bf16, f32) for D in ATTN_HEAD_DIMS for c in (True, False)]
                            + [(dt, D, True) for dt in (bf16, f32) for D in ODD_HEAD_DIMS]
                            + [(dt, D, True, "local") for dt in (bf16, f32) for D in (64, 128, 256)]),
                *_linear((f16, bf16, f32)),
                *_policy_loss((f16, bf16, f32, f64)),
                *_group_filter((f32, f64), GROUP_SIZES, (torch.int64, torch.int32), ints + [f32, f64]),
                *_group_filter((f16, bf16), (16,), (torch.int64, torch.int32), ()),
                *_packing((torch.bool, *ints, f16, bf16, f32, f64), (64, 4096))]
    if which == "test":
        return [*_attention([(bf16, 16, True), (f16, 32, False), (bf16, 64, True), (f16, 96, False),
                             (bf16, 128, True), (f16, 128, False), (bf16, 256, False),
                             (f32, 16, False), (f32, 32, True), (f32, 64, False), (f32, 96, True),
                             (f32, 128, False), (f32, 256, True), (bf16, 80, True), (f32, 112, False),
                             (bf16, 128, True, "local"), (f32, 64, False, "local")]),
                *_linear((bf16, f32)),
                *_policy_loss((bf16,)),
                *_group_filter((f64,), (4, 16), (torch.int32,), (torch.int64,)),
                *_packing((f64,), (4096,))]
    raise ValueError(f"unknown set {which!r}")


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
    stack: int = 0
    smem: int = 0
    mma: str = "-"
    compile_s: float = 0.0


_CONFIG_KEYS = re.compile(r"^(BLOCK_[A-Z]+|ATOMIC_DQ|num_warps|num_stages)$")


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


def _resources(kernel) -> dict:
    import triton
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        pathlib.Path(cubin).write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
        found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", usage)
        regs, stack, static_smem = (int(x) for x in found.groups())
    ptx = kernel.asm["ptx"]
    mma = "wgmma" if "wgmma.mma_async" in ptx else "mma" if re.search(r"\bmma\.sync", ptx) else "-"
    return dict(regs=regs, stack=stack, smem=kernel.metadata.shared + static_smem, mma=mma)


def compile_cases(arch: int, selected: List[Tuple[int, Case]], log=None) -> List[Record]:
    """Compile the ``(case number, case)`` pairs for ``sm_<arch>``; one Record per distinct compiled
    kernel (a kernel two cases share, e.g. the delta preprocess of causal and non-causal, once)."""
    records: List[Record] = []
    current: List[Tuple[int, Case]] = []

    def on_compile(name, kwargs, kernel, seconds):
        i, case = current[0]
        cfg = " ".join(f"{k.replace('num_', '')}={v}" for k, v in kwargs.items() if _CONFIG_KEYS.match(k))
        rec = Record(name, cfg, case.op, case.dtype, case.inputs, arch, i, compile_s=round(seconds, 2),
                     **_resources(kernel))
        records.append(rec)
        if log:
            log(rec)

    with _aot_mode(arch, on_compile):
        for pair in selected:
            current[:] = [pair]
            pair[1].call()
    return records


def violations(rec: Record) -> List[str]:
    """The rules every offered config must meet."""
    out = []
    if rec.smem > SMEM_LIMIT[rec.arch]:
        out.append(f"shared memory {rec.smem} B > {SMEM_LIMIT[rec.arch]} B")
    if rec.stack:
        out.append(f"spills ({rec.stack} B of stack)")
    if rec.arch == 90 and rec.kernel in MATMUL_KERNELS and rec.dtype != "float32" and rec.mma != "wgmma":
        out.append(f"no wgmma (mma: {rec.mma})")
    return out


def exception_of(rec: Record, violation: str) -> Optional[tuple]:
    """The EXCEPTIONS key that documents this violation of ``rec``, if any."""
    for key in EXCEPTIONS:
        kernel, arch, dtypes, inputs, rule = key
        if (rec.kernel, rec.arch) == (kernel, arch) and rec.dtype in dtypes and rec.inputs.startswith(inputs) \
                and violation.startswith(rule):
            return key
    return None


def markdown(records: List[Record]) -> str:
    lines = ["| kernel | config | op: dtype, inputs | arch | registers | shared memory (B) | "
             "spills (stack B) | MMA | rule |", "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        broken = violations(r)
        rule = "; ".join(("exception: " if exception_of(r, v) else "FAIL: ") + v for v in broken) or "ok"
        lines.append(f"| {r.kernel} | {r.config or '-'} | {r.op}: {r.dtype}, {r.inputs} | sm_{r.arch} | {r.regs} | "
                     f"{r.smem} | {r.stack} | {r.mma} | {rule} |")
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


def _write(records: List[Record], args) -> None:
    records.sort(key=lambda r: (ARCHS.index(r.arch), r.case))  # stable: compile order within a case
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in records]))
    if args.markdown:
        pathlib.Path(args.markdown).write_text(summary(records) + "\n\n" + markdown(records) + "\n")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", default="full", choices=("full", "test"))
    ap.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), choices=ARCHS)
    ap.add_argument("--ops", nargs="+", help="only the cases of these ops (default: all)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (cases dealt round-robin)")
    ap.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--markdown", help="write the table here")
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
    for arch in args.arch:
        records += compile_cases(arch, selected, log=lambda r: print(
            f"{r.kernel:36s} {r.config:40s} {r.dtype:8s} {r.inputs:18s} sm_{r.arch} regs={r.regs:3d} "
            f"stack={r.stack} smem={r.smem} {r.mma} {r.compile_s}s {'; '.join(violations(r))}",
            file=sys.stderr, flush=True))
    print(f"compiled {len(records)} kernels in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    _write(records, args)
    return 0


def _run_jobs(args) -> int:
    """Deal the cases to ``--jobs`` processes, then merge their records."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = [subprocess.Popen([sys.executable, __file__, "--set", args.set, "--arch", *map(str, args.arch),
                                   *(["--ops", *args.ops] if args.ops else []), "--shard", f"{i}/{args.jobs}",
                                   "--json", f"{tmp}/{i}.json"]) for i in range(args.jobs)]
        if any(p.wait() for p in procs):
            return 1
        records = [Record(**r) for i in range(args.jobs)
                   for r in json.loads(pathlib.Path(f"{tmp}/{i}.json").read_text())]
    _write(records, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
