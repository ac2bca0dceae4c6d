"""What a compiled Triton kernel does per ``tl.dot``, how many of its blocks an SM holds, and a
static performance model of it on the H200: the instruction-level half of ``benchmarks/gpu/aot.py``.

Instruction shapes. Triton's PTX keeps line information (``.file`` / ``.loc``, inlined helpers
included), so every ``wgmma.mma_async.sync.aligned.m64nNk16``, ``mma.sync.aligned.mMnNkK`` and
``fma.rn`` instruction is charged to the source line it came from; the ``tl.dot`` calls of the ops'
sources (found by :func:`dot_sites`) name the dots: ``b_st:430`` is the ``tl.dot`` on line 430
whose result goes to ``b_st``. A dot whose line carries no MMA instruction ran on the CUDA cores
(``fma``: fp32 ``input_precision="ieee"`` dots, by design).

Occupancy (:func:`occupancy`): resident blocks per SM = the smallest of the register limit (64K
32-bit registers per SM in 4 quarters of 16K, allocated per warp in units of 256), the shared
memory limit (228 KB per SM on sm_90, 164 KB on sm_80, 1 KB reserved per block), 2048 threads
and 32 blocks.

Performance model (:func:`predict`). AN ESTIMATE from the compiled structure, to be checked
against the first GPU run; it is stated here so that the run can refute it.

* Work at a reference problem per kernel (:data:`PROBLEMS`): attention, one causal sequence of
  16,384 tokens, 32 query / 8 KV heads; lm_head passes, N=16,384, H=4,096, V=151,936. Every dot
  of an attention kernel does ``2 D`` FLOPs per (query, key) score, the lm_head dot ``2 H`` per
  logit; one exponential per score / logit; HBM bytes = each input read and each output written
  once (re-reads hit the 50 MB L2: next item but two).
* Dot time = its FLOPs / its rate. 16-bit ``wgmma`` runs at ``R = 790 TFLOP/s`` (cuBLAS bf16
  measured on this H200, KINDS.md) times ``e(N) / e(256)``, ``e(N) = (N/2) / (N/2 + 16)``: an
  ``m64nNk16`` does N/2 clocks of math per SM, and about 16 clocks go to feeding its 2 KB A
  operand from shared memory (128 B/clock) whatever N is, so narrow N wastes the tensor cores
  (N=128: 0.90, 64: 0.75, 32: 0.56, 16: 0.38, 8: 0.23). An instruction mix weights by N.
  16-bit ``mma.sync`` runs at 0.62 R (Hopper's legacy MMA path: FlashAttention-2 peaks near
  370-400 TFLOP/s on H100s where cuBLAS reaches 750+); fp64 ``mma.sync`` at 67 TFLOP/s and
  CUDA-core ``fma`` dots at half the 67 TFLOP/s fp32 peak (datasheet figures, H100 SXM = H200).
* Exponentials run on the SFU at 132 SMs x 16 / clock x 1.98 GHz = 4.2e12 /s; with ``wg``
  warpgroups resident per SM, all but ``1/wg`` of that time overlaps another warpgroup's MMAs.
* None of these kernels is warp-specialised, so a warpgroup waits on its own loads, MMA completions
  and softmax: the compute term is divided by a latency-hiding factor ``h`` per instruction family
  (:data:`LATENCY_HIDING`), fitted by ``benchmarks/gpu/calibrate.py`` to the forward anchors of that
  family (minimax relative error over their causal and non-causal figures) and checked on the backward
  anchors, which the fit does not see. The same ``h`` at every occupancy: the anchors show no gain
  from more resident warpgroups. The anchors span 2-4 warpgroups per SM and 2-5 pipeline stages; a
  kernel outside that (1 warpgroup, ``num_stages=1``, or no tensor-core dot) is flagged
  ``outside_calibration`` in its estimate.
* Operand re-reads go through L2 at ``L2_TBS`` = 7 TB/s (H100 figures reported between 5.5 and 10:
  a lead): a tile's FLOPs per byte loaded are, for an lm_head tile, ``2 BM BV / ((BM + BV) e)``
  (e = element bytes); for attention, dots x (rows the program owns) / e (the other operand
  streams past them: queries for dK/dV, keys for the forward and dQ).
* ``t = max((t_dots + t_exp / wg) / h, bytes / 4.8 TB/s, FLOPs / (intensity x L2_TBS))``;
  predicted TFLOP/s = FLOPs / t.

Calibration: ``benchmarks/gpu/calibrate.py`` compiles anchor designs written from public descriptions
(``anchors.py``: the Triton tutorial's forward and backward, FlashAttention-2's mma.sync forward and
fused atomic-dQ backward), prices them with this model and prints the error against their published
H100 figures, causal and non-causal apart; the table and the resulting error band are in
benchmarks/RESULTS.md, and every estimate quoted carries that band. The L2 term puts the lm_head passes
(64 x 128 tiles: 43 FLOP/B) at ~300 TFLOP/s (no anchor: uncalibrated).
"""
from __future__ import annotations

import ast
import functools
import math
import pathlib
import re
from collections import Counter, defaultdict
from typing import Dict, Optional

PEAK_TFLOPS = 790.0  # bf16 dense through cuBLAS, measured on this workplace's H200 (KINDS.md)
HBM_TBS = 4.8  # H200 datasheet (a device-to-device copy measured 4.3 here)
L2_TBS = 7.0  # L2 -> SM operand bandwidth: a lead (H100 reports range 5.5-10 TB/s)
EXP_PER_S = 132 * 16 * 1.98e9  # SFU ex2 per second: SMs x per-SM-clock x boost clock
# Compute-term efficiency without warp specialisation, per instruction family: calibrate.py's fit (the values
# it prints; `calibrate.py --check` fails when they differ). FMA-only kernels borrow mma's (no anchor).
LATENCY_HIDING = {"wgmma": 0.63, "mma": 0.80}
CALIBRATED_WARPGROUPS = (2, 4)  # resident warpgroups per SM the anchors span
CALIBRATED_STAGES = (2, 5)  # pipeline stages the anchors span
MMA_SYNC_TFLOPS = 0.62 * PEAK_TFLOPS
F64_MMA_TFLOPS = 67.0
FMA_TFLOPS = 0.5 * 67.0
# Per-SM resources (CUDA programming guide, compute capability table).
SM = {90: dict(regs=65536, smem=228 * 1024, threads=2048, blocks=32),
      80: dict(regs=65536, smem=164 * 1024, threads=2048, blocks=32)}

_WGMMA = re.compile(r"\bwgmma\.mma_async\.sync\.aligned\.m(\d+)n(\d+)k(\d+)")
_MMA_SYNC = re.compile(r"\bmma\.sync\.aligned\.(m\d+n\d+k\d+)\.[\w.]*?\.(f64|f16|bf16|tf32|s8|e4m3|e5m2)\b")
_FMA = re.compile(r"^\s*(?:@%p\d+\s+)?fma\.rn(?:\.ftz)?\.(f32|f64)")
_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\s+\d+")
_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"')


@functools.lru_cache(maxsize=None)
def dot_sites(path: str) -> Dict[int, str]:
    """``{line: label}`` of the ``tl.dot`` calls in the Python file ``path``; the label is the name
    the statement assigns (its first target) and the line, e.g. ``b_st:430``."""
    try:
        tree = ast.parse(pathlib.Path(path).read_text())
    except (OSError, SyntaxError):
        return {}
    sites = {}
    for stmt in ast.walk(tree):
        if not isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return, ast.Expr)):
            continue
        target = (stmt.targets[0] if isinstance(stmt, ast.Assign) else getattr(stmt, "target", None))
        if isinstance(target, ast.Tuple):
            target = target.elts[0]
        name = target.id if isinstance(target, ast.Name) else "dot"
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("tl.dot", "triton.language.dot"):
                sites[node.lineno] = f"{name}:{node.lineno}"
    return sites


def dot_shapes(ptx: str) -> Dict[str, Dict[str, int]]:
    """``{dot label: {instruction: count}}`` for every ``tl.dot`` the PTX compiled: instruction is
    ``wgmma n<N>`` (m64nNk16 per warpgroup), ``mma <shape> <type>`` (mma.sync) or ``fma`` (the dot's
    line holds no MMA instruction: CUDA-core products; the count is its FMA instructions)."""
    files: Dict[str, str] = {}
    loc: Optional[tuple] = None
    per_site: Dict[tuple, Counter] = defaultdict(Counter)
    for line in ptx.splitlines():
        m = _FILE.match(line)
        if m:
            files[m.group(1)] = m.group(2)
            continue
        m = _LOC.match(line)
        if m:
            loc = (m.group(1), int(m.group(2)))
            continue
        if loc is None:
            continue
        w = _WGMMA.search(line)
        if w:
            per_site[loc][f"wgmma n{w.group(2)}"] += 1
            continue
        s = _MMA_SYNC.search(line)
        if s:
            per_site[loc][f"mma {s.group(1)} {s.group(2)}"] += 1
            continue
        if _FMA.match(line):
            per_site[loc]["fma"] += 1
        else:
            per_site[loc]["other"] += 0  # the line was compiled (a dot whose products went elsewhere)
    dots: Dict[str, Dict[str, int]] = {}
    for (file_id, lineno), counts in sorted(per_site.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        label = dot_sites(files.get(file_id, ""))
        if lineno not in label:
            continue
        mma = {k: v for k, v in counts.items() if not k.startswith(("fma", "other"))}
        dots[label[lineno]] = mma or {"fma": counts.get("fma", 0)}
    return dots


def mma_sync_count(dots: Dict[str, Dict[str, int]]) -> int:
    return sum(n for shapes in dots.values() for k, n in shapes.items() if k.startswith("mma "))


def wgmma_ns(shapes: Dict[str, int]) -> Dict[int, int]:
    """``{N: count}`` of one dot's wgmma instructions."""
    return {int(k.split("n")[1]): n for k, n in shapes.items() if k.startswith("wgmma n")}


def occupancy(regs: int, threads: int, smem: int, arch: int) -> tuple:
    """(resident blocks per SM, what limits them: regs / smem / threads / blocks)."""
    sm = SM[arch]
    warps = max(1, math.ceil(threads / 32))
    per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    warps_by_regs = (sm["regs"] // 4 // per_warp) * 4  # each SM quarter holds its own warps' registers
    limits = {"regs": warps_by_regs // warps, "smem": sm["smem"] // (smem + 1024),
              "threads": sm["threads"] // threads if threads else 0, "blocks": sm["blocks"]}
    limiter = min(limits, key=limits.get)
    return limits[limiter], limiter


def _e(n: int) -> float:
    return (n / 2) / (n / 2 + 16)


def wgmma_efficiency(n: int) -> float:
    """Fraction of ``PEAK_TFLOPS`` an ``m64nNk16`` stream reaches (see the module docstring)."""
    return min(1.0, _e(n) / _e(256))


def _dot_rate(shapes: Dict[str, int]) -> float:
    """TFLOP/s of one dot from its instruction mix (wgmma weighted by the work each does)."""
    ns = wgmma_ns(shapes)
    if ns:
        work = sum(n * c for n, c in ns.items())
        return PEAK_TFLOPS * work / sum(n * c / wgmma_efficiency(n) for n, c in ns.items())
    kinds = " ".join(shapes)
    if "mma" in kinds:
        return F64_MMA_TFLOPS if "f64" in kinds else MMA_SYNC_TFLOPS
    return FMA_TFLOPS


def instruction_family(dots: Dict[str, Dict[str, int]]) -> str:
    """``wgmma`` if any dot runs wgmma, else ``mma`` (mma.sync), else ``fma`` (CUDA cores)."""
    kinds = {k.split()[0] for shapes in dots.values() for k in shapes}
    return "wgmma" if "wgmma" in kinds else "mma" if "mma" in kinds else "fma"


def _attention(kernel: str, D: int, causal: bool, dtype_bytes: int) -> dict:
    T, Hq, Hkv = 16384, 32, 8
    scores = Hq * T * T * (0.5 if causal else 1.0)
    qo, kv = Hq * T * D * dtype_bytes, Hkv * T * D * dtype_bytes
    if "_fwd" in kernel:
        nbytes = 2 * qo + 2 * kv + Hq * T * 4
    elif "_delta" in kernel:  # (qo: with FINITE_QDO it also reads Q and writes Q, dO copies, see predict)
        return dict(problem="T=16384 Hq=32", flops_per_dot=0, exps=0, bytes=2 * qo + Hq * T * 8, qo=qo)
    else:  # q, do, k, v, lse, delta in; dK + dV or dQ out
        nbytes = 2 * qo + 2 * kv + Hq * T * 8 + (2 * kv if "dkdv" in kernel else Hq * T * D * 4)
    return dict(problem=f"T=16384 Hq=32 Hkv=8 {'causal' if causal else 'full'}", flops_per_dot=2 * D * scores,
                exps=scores, bytes=nbytes)


def _lm_head(kernel: str, dtype_bytes: int) -> dict:
    N, H, V = 16384, 4096, 151936
    nbytes = (N + V) * H * dtype_bytes + (N * V * dtype_bytes if "bwd" in kernel else 0)
    return dict(problem="N=16384 H=4096 V=151936", flops_per_dot=2 * N * H * V, exps=N * V, bytes=nbytes)


_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def problem(kernel: str, dtype: str, inputs: str) -> Optional[dict]:
    """The reference problem's work for a kernel (None: no model, e.g. the elementwise ops)."""
    nbytes = _BYTES.get(dtype, 4)
    if kernel.startswith("_varlen_attention"):
        m = re.search(r"D=(\d+)", inputs)
        return _attention(kernel, int(m.group(1)) if m else 128, "causal" in inputs, nbytes) if m else None
    if kernel.startswith("_linear_log_probs"):
        return _lm_head(kernel, nbytes)
    return None


def _intensity(kernel: str, config: str, n_dots: int, elt: int) -> Optional[float]:
    """FLOPs per byte of operand tiles loaded (through L2), from the config's block sizes."""
    blocks = {k: int(v) for k, v in re.findall(r"BLOCK_([A-Z]+)=(\d+)", config)}
    if kernel.startswith("_linear_log_probs") and {"M", "V"} <= blocks.keys():
        return 2 * blocks["M"] * blocks["V"] / ((blocks["M"] + blocks["V"]) * elt)
    owned = blocks.get("N" if "dkdv" in kernel else "M")
    return n_dots * owned / elt if owned and n_dots else None


def predict(kernel: str, dtype: str, inputs: str, dots: Dict[str, Dict[str, int]], blocks: int,
            warps: int, config: str = "") -> Optional[dict]:
    """The model's estimate for one compiled kernel at its reference problem: FLOPs, bytes, time
    (ms), TFLOP/s, the fraction of ``PEAK_TFLOPS`` and which term bounds it; None where no work
    model exists."""
    work = problem(kernel, dtype, inputs)
    if work is None:
        return None
    if "FINITE_QDO=True" in config and "qo" in work:  # the delta kernel's Q, dO copies (read Q, write both)
        work = {**work, "bytes": work["bytes"] + 3 * work["qo"]}
    flops = work["flops_per_dot"] * len(dots)
    t_dots = sum(work["flops_per_dot"] / (_dot_rate(s) * 1e12) for s in dots.values())
    wg = max(1, blocks * warps // 4)
    family = instruction_family(dots)
    h = LATENCY_HIDING.get(family, LATENCY_HIDING["mma"])
    m = re.search(r"stages=(\d+)", config)
    outside = []
    if dots:  # (kernels without dots are bandwidth-bound: no compute term to calibrate)
        if not CALIBRATED_WARPGROUPS[0] <= wg <= CALIBRATED_WARPGROUPS[1]:
            outside.append(f"{wg} warpgroup(s)/SM")
        if family not in LATENCY_HIDING:
            outside.append("no tensor-core dot")
        if m and not CALIBRATED_STAGES[0] <= int(m.group(1)) <= CALIBRATED_STAGES[1]:
            outside.append(f"{m.group(1)} stage(s)")
    t_exp = work["exps"] / EXP_PER_S if dots else 0.0
    intensity = _intensity(kernel, config, len(dots), _BYTES.get(dtype, 4))
    terms = {"compute": (t_dots + t_exp / wg) / h, "HBM": work["bytes"] / (HBM_TBS * 1e12),
             "L2": flops / (intensity * L2_TBS * 1e12) if intensity else 0.0}
    bound = max(terms, key=terms.get)
    t = terms[bound]
    tflops = flops / t / 1e12 if t else 0.0
    return dict(problem=work["problem"], flops=flops, flops_per_dot=work["flops_per_dot"], bytes=work["bytes"],
                ms=t * 1e3, tflops=round(tflops, 1), fraction=round(tflops / PEAK_TFLOPS, 3), bound=bound,
                outside_calibration=", ".join(outside))


def _best(records, prefix: str, need: str = "", avoid: str = ""):
    """The fastest predicted config of the kernels named ``prefix*`` (what autotuning would pick)."""
    rs = [r for r in records if r.kernel.startswith(prefix) and r.model and need in r.config
          and not (avoid and avoid in r.config)]
    return min(rs, key=lambda r: r.model["ms"]) if rs else None


def estimates(records) -> Dict[tuple, dict]:
    """Per (op, dtype, inputs) on sm_90, the model's end-to-end estimate from the fastest config of each kernel
    (see :func:`summarize`): attention ``fwd``, ``bwd_det``, ``bwd_atomic`` TFLOP/s (None where a kernel is
    missing); lm_head ``stats`` and ``dlogits`` TFLOP/s, ``ms`` and ``matmuls_ms`` of the fused step and its
    ``tflops`` (6 N H V FLOPs); each with ``problem``."""
    rs = [r for r in records if r.arch == 90 and r.model]
    out = {}
    for (op, dtype, inputs) in dict.fromkeys((r.op, r.dtype, r.inputs) for r in rs):
        group = [r for r in rs if (r.op, r.dtype, r.inputs) == (op, dtype, inputs)]
        est = dict(problem=group[0].model["problem"])
        if op == "varlen_attention":
            fwd, delta = _best(group, "_varlen_attention_fwd"), _best(group, "_varlen_attention_bwd_delta")
            det, dq = _best(group, "_varlen_attention_bwd_dkdv", avoid="ATOMIC_DQ=True"), _best(
                group, "_varlen_attention_bwd_dq")
            atomic = _best(group, "_varlen_attention_bwd_dkdv", need="ATOMIC_DQ=True")
            fpd = (fwd or det or atomic or group[0]).model["flops_per_dot"]
            t_delta = delta.model["ms"] if delta else 0.0
            est.update(fwd=fwd.model["tflops"] if fwd else None,
                       bwd_det=5 * fpd / (t_delta + det.model["ms"] + dq.model["ms"]) / 1e9 if det and dq else None,
                       bwd_atomic=5 * fpd / (t_delta + atomic.model["ms"]) / 1e9 if atomic else None)
        elif op == "linear_log_probs":
            stats, grads = _best(group, "_linear_log_probs_fwd"), _best(group, "_linear_log_probs_bwd")
            if not (stats and grads):
                continue
            fpd = stats.model["flops_per_dot"]
            t_mm = fpd / (PEAK_TFLOPS * 1e9)  # ms of one [N, H] x [H, V] matmul at cuBLAS speed
            t_ours = stats.model["ms"] + grads.model["ms"] + 2 * t_mm
            est.update(stats=stats.model["tflops"], dlogits=grads.model["tflops"], ms=t_ours, matmuls_ms=3 * t_mm,
                       tflops=3 * fpd / t_ours / 1e9)
        out[op, dtype, inputs] = est
    return out


def summarize(records) -> str:
    """Per op and inputs on sm_90, the model's end-to-end estimate from the fastest config of each
    kernel. Attention: forward FLOPs 4 D per score; backward counted as FlashAttention counts it,
    5 products (10 D per score) whatever the kernels recompute; deterministic = delta + dK/dV + dQ
    kernels, atomic = delta + the dK/dV kernel with atomic dQ. lm_head: the Triton statistics and
    dlogits passes plus dH and dW by cuBLAS at ``PEAK_TFLOPS``, against the three bare matmuls."""
    lines = ["| op | dtype | inputs (model problem) | forward TFLOP/s | backward TFLOP/s: deterministic | "
             "atomic dQ | vs the three bare matmuls |", "|---|---|---|---|---|---|---|"]
    for (op, dtype, inputs), e in estimates(records).items():
        if op == "varlen_attention":
            bwd_det = f"{e['bwd_det']:.0f}" if e["bwd_det"] else "-"
            bwd_atomic = f"{e['bwd_atomic']:.0f}" if e["bwd_atomic"] else "- (dQ kernel)"
            lines.append(f"| {op} | {dtype} | {inputs} ({e['problem']}) | {e['fwd'] or '-'} | {bwd_det} | "
                         f"{bwd_atomic} | |")
        elif op == "linear_log_probs":
            lines.append(f"| {op} / fused loss | {dtype} | {inputs} ({e['problem']}) | stats {e['stats']} | "
                         f"dlogits {e['dlogits']} + dH, dW at {PEAK_TFLOPS:.0f} | | "
                         f"{e['ms']:.1f} ms vs {e['matmuls_ms']:.1f} ms: {e['ms'] / e['matmuls_ms']:.2f}x |")
    return "\n".join(lines)
