"""Autotune sweep for the time left in a GPU session: every config the tile tables offer (and the candidates
beyond them) timed per length bucket, each checked against a float64 reference before its time counts;
winners per (kernel, dtype, D, mask, bucket) written so the tables can be updated from data.

    python benchmarks/gpu/sweep.py OUT_DIR [--commit C] [--toy] [--budget-s S]

The sweep runs in a worker process of its own process group (``device_run._run``): at ``budget + 30`` s the
whole group is killed, and the rows it appended to a JSONL file as they came still make the tables. The
worker itself stops cleanly when the time left is under twice its slowest config so far (``budget`` note).

Attention (``dapo_kernels.ops.varlen_attention``), per case (dtype, D, mask) of ``CASES`` and per bucket
(max_seqlen, total tokens) of ``BUCKETS``, rounded as the autotune keys round them
(``tiles._length_buckets``): ``fwd`` (the pointer rows, on sm_90 16-bit also the descriptor rows ``tma_fwd`` /
``tma_fwd_plain`` and the candidate ``WARP_SPEC`` configs at 4 warps, NOTES.md's last section, timed after
every table config), ``dkdv_dq`` (dK/dV adding dQ by atomics, ``deterministic=False``), ``dkdv`` and ``dq``
(``deterministic=True``). A config is forced by giving its autotuner that one config (Triton's autotuner runs
a single config without pruning or timing); the outer block stays the table's. Each time is the whole launcher
pass (fwd, or bwd: delta + dK/dV [+ dQ]), the kernels not swept at their own autotuned pick, so configs of one
kernel differ only in that kernel. Correctness: every config first runs a ragged check problem of the case
(partial blocks, a 1-token sequence) against a float64 reference; error within 2x the same math's in the input
dtype (the project rule, floored at eps * max|ref|), else a FAIL row, never timed, never a winner. Timed
outputs must also be finite. (An fp64 reference at 128k tokens would eat the budget: the check problem is up
to 1,764 tokens.)

Fused loss (``linear_log_probs``): its tunables are module constants, not autotuned: the row chunk
(``_CHUNK_BYTES``: fp32 logits per GEMM unit), the elementwise kernels' vocab block (``_MAX_BLOCK_V``) and
warps (``_NUM_WARPS``); each is swept alone from the defaults (fwd + bwd of ``fused_linear_policy_loss``),
checked against the torch backend (``rtol`` of the output dtype against max|ref|).

Output (4 files): sweep.json (every row, the winners), sweep.md (winners, then every row), sweep_tiles.diff
(the ``_GPU_TILES`` rows that the winners propose, as a diff of their text), sweep.log. ``--toy`` (or
``DEVICE_RUN_TOY=1``): the CPU rehearsal under the interpreter at toy sizes (tests/test_sweep.py); its times
say nothing about a GPU. ``SWEEP_FAULT=kernel:config`` multiplies that config's check output by 2 (tests).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import difflib
import json
import math
import os
import pathlib
import signal
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE.parent)]

# (dtype, head dim, causal, window (left, right), softcap): RL models' shapes, most common first.
CASES = [("bfloat16", 128, True, (-1, -1), 0.0), ("bfloat16", 64, True, (-1, -1), 0.0),
         ("bfloat16", 128, True, (4095, 0), 0.0), ("bfloat16", 128, True, (-1, -1), 50.0),
         ("float16", 128, True, (-1, -1), 0.0)]
# (max_seqlen, total tokens) of RL packs: short and long responses, small and large micro-batches.
BUCKETS = [(1024, 16384), (4096, 32768), (8192, 65536), (32768, 131072)]
HQ, HKV = 32, 8
CHECK_LENGTHS = [1000, 37, 1, 520, 77, 129]
# Fused loss: (N tokens) buckets at H, V of Qwen-7B's lm_head, and the values each tunable takes.
LOSS_N, LOSS_H, LOSS_V = (4096, 16384), 4096, 151936
LOSS_TUNABLES = {"_CHUNK_BYTES": (160 << 20, 320 << 20, 640 << 20, 1280 << 20),
                 "_MAX_BLOCK_V": (1024, 2048, 4096, 8192), "_NUM_WARPS": (4, 8, 16)}
# Warp-specialised descriptor forward: (keys, warps, stages) that compiled spill-free for sm_90 (NOTES.md).
WS_CANDIDATES = ((64, 4, 3), (128, 4, 2))
TOY = dict(CASES=[("bfloat16", 16, True, (-1, -1), 0.0), ("float16", 16, False, (-1, -1), 30.0)],
           BUCKETS=[(32, 64), (64, 128)], HQ=2, HKV=1, CHECK_LENGTHS=[40, 7, 1, 33], LOSS_N=(64,), LOSS_H=32,
           LOSS_V=200, LOSS_TUNABLES={"_CHUNK_BYTES": (32 * 800, 64 * 800), "_MAX_BLOCK_V": (64, 256)})
RTOL = {"float32": 1e-4, "bfloat16": 2 ** -6, "float16": 2 ** -9}
GRACE_S = 30
# The toy sweep's budget is counted in calls, not seconds (each timed call costs this much of it), so that
# where it stops does not depend on how fast the CPU running the tests is.
TOY_CALL_S = 1.0


def _mask_name(causal, window, softcap) -> str:
    parts = ["causal" if causal else "full"] + ([f"window{window[0]},{window[1]}"] if window != (-1, -1) else [])
    return " ".join(parts + ([f"softcap{softcap:g}"] if softcap else []))


class Sweep:
    """The worker: rows appended to ``jsonl`` as they are measured; stops when the budget is near."""

    def __init__(self, jsonl: str, toy: bool, budget: float):
        self.jsonl, self.toy, self.slowest, self.stopped, self.toy_clock = jsonl, toy, 0.0, False, 0.0
        self.deadline = self.now() + budget
        self.device = "cpu" if toy else "cuda"
        self.fault = tuple(os.environ.get("SWEEP_FAULT", "").split(":", 1)) if os.environ.get("SWEEP_FAULT") else ()
        if toy:
            globals().update(TOY)

    def add(self, **row) -> None:
        row.setdefault("status", "ok")
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)

    def now(self) -> float:
        """Wall time on the GPU; in the toy sweep TOY_CALL_S per timed call so far."""
        return self.toy_clock if self.toy else time.time()

    def time_left(self) -> bool:
        """False, once and for good, when the time left is under twice the slowest config so far (+5 s)."""
        if not self.stopped and self.deadline - self.now() < 2 * self.slowest + 5:
            self.stopped = True
            self.add(kernel="-", config="-", status="stopped", note="budget: the rest not measured")
        return not self.stopped

    def timed(self, fn):
        """(ms, output): one call on the CPU; on the GPU the median of CUDA-event timings after warm-up."""
        t0, c0 = time.time(), self.now()
        out = fn()
        if not self.toy:
            from gpu.common import cuda_time_ms
            ms = cuda_time_ms(fn, warmup=1, iters=5)
        else:
            ms = (time.time() - t0) * 1e3
            self.toy_clock += TOY_CALL_S
        self.slowest = max(self.slowest, self.now() - c0)
        return ms, out

    @contextlib.contextmanager
    def section(self, **row):
        """One config: an exception inside becomes its FAIL row carrying the error; the sweep goes on."""
        try:
            yield
        except Exception as e:  # a config that does not compile or launch costs its own row
            self.add(**row, status="FAIL", note=f"{type(e).__name__}: {e}"[:200].replace("\n", " ").replace("|", "/"))

    def faulty(self, kernel: str, label: str) -> bool:
        return self.fault == (kernel, label)


# --------------------------------------------------------------------------- attention
def _attention_ref(q, k, v, dout, lengths, causal, window, softcap, dtype):
    """(out, dq, dk, dv) of plain math attention per sequence in ``dtype``, keys masked as the op masks them."""
    import torch
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    outs, start, group = [], 0, q.shape[1] // k.shape[1]
    for L in lengths:
        qs, ks, vs = (t[start:start + L].transpose(0, 1) for t in leaves)
        ks, vs = (t.repeat_interleave(group, 0) for t in (ks, vs))
        s = qs @ ks.transpose(1, 2) * q.shape[-1] ** -0.5
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        i, j = torch.arange(L, device=q.device)[:, None], torch.arange(L, device=q.device)[None, :]
        keep = torch.ones(L, L, dtype=torch.bool, device=q.device)
        keep &= (j <= i) if causal else keep
        keep &= (j >= i - window[0]) if window[0] >= 0 else keep
        keep &= (j <= i + window[1]) if window[1] >= 0 and not causal else keep
        outs.append((torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ vs).transpose(0, 1))
        start += L
    out = torch.cat(outs)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout.to(dtype))]


def _pack(lengths, hq, hkv, d, dtype, device, seed=0):
    """(q, k, v, dout, cu_seqlens) of a pack, drawn on the device (128k tokens drawn on the host take seconds)."""
    import torch
    g = torch.Generator(device=device).manual_seed(seed)
    T = sum(lengths)
    q, k, v, dout = (torch.randn(T, h, d, generator=g, device=device).to(dtype) for h in (hq, hkv, hkv, hq))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return q, k, v, dout, cu


def _bucket_lengths(max_seqlen: int, total: int, seed: int = 0):
    """One sequence of max_seqlen, then lengths uniform in [max_seqlen / 16, max_seqlen] up to ``total``."""
    import random
    rng, lengths = random.Random(seed), [max_seqlen]
    while sum(lengths) < total:
        lengths.append(min(rng.randint(max(1, max_seqlen // 16), max_seqlen), total - sum(lengths)))
    return lengths


def _configs(kernel: str, dtype, d: int, local: bool, softcap: bool, toy: bool):
    """[(label, autotuner, triton.Config, table key or None, (inner, warps, stages))] of one kernel: the configs
    its table rows offer for these inputs, and the candidates beyond them (table key None)."""
    import triton
    from dapo_kernels.ops.varlen_attention import tiles, triton_bwd, triton_fwd_tma, triton_kernels
    inner = "BLOCK_N" if kernel in ("fwd", "dq") else "BLOCK_M"
    tuner = {"fwd": triton_kernels._varlen_attention_fwd_kernel, "dq": triton_bwd._varlen_attention_bwd_dq_kernel
             }.get(kernel, triton_bwd._varlen_attention_bwd_dkdv_kernel)
    if toy:  # the interpreter: two small tiles, the outer block the interpreter's own
        return [(f"{inner}={bn} w1 s1", tuner, triton.Config({inner: bn}, num_warps=1, num_stages=1), None,
                 (bn, 1, 1)) for bn in (16, 32)]
    arch = tiles._arch_family()
    if kernel == "fwd" and arch == 90 and dtype.itemsize == 2 and triton_fwd_tma.DESCRIPTORS and \
            tiles._tile_dim(d) in tiles._GPU_TILES["tma_fwd", 90, 2]:  # the launcher's Hopper kernel (tma_offered)
        out, hopper = [], triton_fwd_tma._varlen_attention_fwd_hopper_kernel
        for row in triton_fwd_tma._rows(local, softcap):
            cap = triton_fwd_tma._MAXNREG.get(row)
            for bn, w, s in tiles._GPU_TILES[row, 90, 2].get(tiles._tile_dim(d), (0, ()))[1]:
                out.append((f"{'TMA ' * (row != 'fwd')}BLOCK_N={bn} w{w} s{s}{f' maxnreg{cap}' * bool(cap)}", hopper,
                            triton.Config({"BLOCK_N": bn, "TMA": row != "fwd"}, num_warps=w, num_stages=s,
                                          maxnreg=cap), (row, 90, 2), (bn, w, s)))
        return out + [(f"TMA WARP_SPEC BLOCK_N={bn} w{w} s{s}", hopper, triton.Config(
            {"BLOCK_N": bn, "TMA": True, "WARP_SPEC": True}, num_warps=w, num_stages=s), None, (bn, w, s))
            for bn, w, s in WS_CANDIDATES]
    row = tiles._kernel_row("dkdv" if kernel.startswith("dkdv") else kernel, kernel == "dkdv_dq", softcap, local)
    key = (row, arch, dtype.itemsize)
    key = key if key in tiles._GPU_TILES else (row.removesuffix("_softcap").removesuffix("_masked"), *key[1:])
    return [(f"{inner}={bn} w{w} s{s}", tuner, triton.Config({inner: bn}, num_warps=w, num_stages=s), key, (bn, w, s))
            for bn, w, s in tiles._GPU_TILES[key].get(tiles._tile_dim(d), (0, ()))[1]]  # (no row: none offered)


@contextlib.contextmanager
def _only(tuner, config):
    """``tuner`` runs ``config`` alone (a single-config autotuner neither prunes nor times)."""
    saved = tuner.configs
    tuner.configs = [config]
    try:
        yield
    finally:
        tuner.configs = saved


def _attention_pass(kernel, q, k, v, dout, cu, max_len, causal, window, softcap, fwd=None):
    """The launcher pass that runs ``kernel``: (out,) forward, else (dq, dk, dv) from ``fwd`` = (out, lse)."""
    from dapo_kernels.ops.varlen_attention import launch
    args = (cu, max_len, causal, q.shape[-1] ** -0.5, *window, softcap)
    if kernel == "fwd":
        return launch.fwd_triton(q, k, v, *args)[:1]
    return launch.bwd_triton(dout, q, k, v, *fwd, *args, deterministic=kernel != "dkdv_dq")


def _within(ours, ref, plain):
    """(ok, worst err / bound): each output within 2x the plain-dtype math's error, floored at eps * max|ref|."""
    import torch
    worst = 0.0
    for o, r, p in zip(ours, ref, plain):
        if not torch.isfinite(o).all():
            return False, math.inf
        floor = torch.finfo(o.dtype).eps * r.abs().max().item()
        bound = 2 * max((p.double() - r).abs().max().item(), floor)
        worst = max(worst, (o.double() - r).abs().max().item() / bound)
    return worst <= 1.0, worst


def sweep_attention(sw: Sweep, case, candidates: bool = False) -> None:
    """Every table config of the case's kernels, or (``candidates``) only the configs beyond the tables."""
    import torch
    from dapo_kernels.ops.varlen_attention import tiles
    if candidates and sw.toy:  # (the interpreter has no candidate configs)
        return
    dtype_name, d, causal, window, softcap = case
    dtype = getattr(torch, dtype_name)
    mask = _mask_name(causal, window, softcap)
    local = window != (-1, -1)
    check = _pack(CHECK_LENGTHS, HQ, HKV, d, dtype, sw.device)
    ref = _attention_ref(*check[:4], CHECK_LENGTHS, causal, window, softcap, torch.float64)
    plain = _attention_ref(*check[:4], CHECK_LENGTHS, causal, window, softcap, dtype)
    check_fwd = _forward(check, causal, window, softcap)
    kernels = ["fwd", "dkdv", "dq"]
    if sw.toy or tiles._atomic_dq_offered(dtype, d, softcap > 0):
        kernels.insert(1, "dkdv_dq")
    packs = {}
    for kernel in kernels:
        for label, tuner, config, table, tile in _configs(kernel, dtype, d, local, softcap > 0, sw.toy):
            if (table is None and not sw.toy) != candidates:
                continue
            key = dict(kernel=kernel, dtype=dtype_name, D=d, mask=mask, config=label, table=table, tile=tile,
                       candidate=table is None and not sw.toy)
            if not sw.time_left():
                return
            with sw.section(**key, bucket="check"), _only(tuner, config):
                ours = _attention_pass(kernel, *check, max(CHECK_LENGTHS), causal, window, softcap, check_fwd)
                if sw.faulty(kernel, label):
                    ours = [o * 2 for o in ours]
                n = len(ours)
                ok, worst = _within(ours, ref[:1] if n == 1 else ref[1:], plain[:1] if n == 1 else plain[1:])
                sw.add(**key, bucket="check", status="ok" if ok else "FAIL", err_over_bound=worst)
                if not ok:
                    continue
                for max_len, total in BUCKETS:
                    if not sw.time_left():
                        return
                    bucket = "L{}-T{}".format(*tiles._length_buckets(max_len, total))
                    if (max_len, total) not in packs:  # every bucket's pack kept for the case (~3.5 GB at 128k)
                        lengths = _bucket_lengths(max_len, total)
                        p = _pack(lengths, HQ, HKV, d, dtype, sw.device, seed=1)
                        packs[max_len, total] = (p, max(lengths), _forward(p, causal, window, softcap))
                    p, m, fwd = packs[max_len, total]
                    with sw.section(**key, bucket=bucket):
                        ms, out = sw.timed(lambda: _attention_pass(kernel, *p, m, causal, window, softcap, fwd))
                        finite = all(torch.isfinite(o).all().item() for o in out)
                        sw.add(**key, bucket=bucket, ms=ms, status="ok" if finite else "FAIL",
                               note="" if finite else "non-finite output")


def _forward(pack, causal, window, softcap):
    """(out, base-2 lse) of the autotuned forward: the backward passes' input."""
    from dapo_kernels.ops.varlen_attention import launch
    q, k, v, _, cu = pack
    max_len = int((cu[1:] - cu[:-1]).max())
    return launch.fwd_triton(q, k, v, cu, max_len, causal, q.shape[-1] ** -0.5, *window, softcap)


# --------------------------------------------------------------------------- fused loss
def sweep_fused_loss(sw: Sweep) -> None:
    import torch
    import dapo_kernels as dk
    from dapo_kernels.ops import linear_log_probs as llp

    def step(inputs):
        h, w = (t.detach().requires_grad_() for t in inputs[:2])
        loss, _ = dk.fused_linear_policy_loss(h, w, *inputs[2:], temperature=0.7)
        return [loss.detach(), *torch.autograd.grad(loss, [h, w])]

    defaults = {name: getattr(llp, name) for name in LOSS_TUNABLES}
    for n in LOSS_N:
        kw = dict(generator=torch.Generator(device=sw.device).manual_seed(n), device=sw.device)  # (drawn there)
        hidden = torch.randn(n, LOSS_H, **kw).bfloat16()
        weight = (torch.randn(LOSS_V, LOSS_H, **kw) * 2 / LOSS_H ** 0.5).bfloat16()  # logits of std ~2
        labels = torch.randint(0, LOSS_V, (n,), **kw)
        old, adv = -3 * torch.rand(n, **kw), torch.randn(n, **kw)
        inputs = (hidden, weight, labels, old, adv, torch.ones(n, dtype=torch.bool, device=sw.device))
        with dk.use_backend("torch"):
            ref = step(inputs)
        for name, values in LOSS_TUNABLES.items():
            for value in values:
                key = dict(kernel="fused_loss", dtype="bfloat16", D=LOSS_H, mask=f"V{LOSS_V}", bucket=f"N{n}",
                           config=f"{name}={value}")
                if not sw.time_left():
                    return
                setattr(llp, name, value)
                try:
                    with sw.section(**key), dk.use_backend("triton"):
                        ms, ours = sw.timed(lambda: step(inputs))
                        if sw.faulty("fused_loss", key["config"]):
                            ours = [o * 2 for o in ours]
                        worst = max((o.double() - r.double()).abs().max().item()
                                    / (RTOL[str(r.dtype).split(".")[1]] * max(r.abs().max().item(), 1e-30))
                                    for o, r in zip(ours, ref))
                        ok = worst <= 1.0
                        sw.add(**key, ms=ms if ok else None, status="ok" if ok else "FAIL", err_over_bound=worst)
                finally:
                    setattr(llp, name, defaults[name])


def worker(jsonl: str, toy: bool, budget: float) -> int:
    if toy:
        os.environ["TRITON_INTERPRET"] = "1"
    sw = Sweep(jsonl, toy, budget)
    # The most common case first, then the fused loss (cheap), then the other attention cases; the candidates
    # beyond the tables last (Triton 3.9 fails to warp-specialise this forward: NOTES.md, last section).
    for i, case in [*enumerate(CASES), *((-1, c) for c in CASES)]:
        with sw.section(kernel="attention", dtype=case[0], D=case[1], mask=_mask_name(*case[2:]), bucket="-",
                        config="setup" if i >= 0 else "candidates setup"):
            sweep_attention(sw, case, candidates=i < 0)
        if i == 0:
            with sw.section(kernel="fused_loss", dtype="bfloat16", D=LOSS_H, mask="-", bucket="-", config="setup"):
                sweep_fused_loss(sw)
    return 0


# --------------------------------------------------------------------------- tables
def winners(rows):
    """{(kernel, dtype, D, mask, bucket): the fastest ok timed row}, FAIL configs (any row) excluded."""
    failed = {(r["kernel"], r["dtype"], r["D"], r["mask"], r["config"]) for r in rows if r["status"] == "FAIL"}
    best = {}
    for r in rows:
        if r["status"] != "ok" or r.get("ms") is None or (r["kernel"], r["dtype"], r["D"], r["mask"],
                                                           r["config"]) in failed:
            continue
        key = (r["kernel"], r["dtype"], r["D"], r["mask"], r["bucket"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    return best


def tiles_diff(rows, best) -> str:
    """The attention table rows the winners propose: per (table row, D), the configs that won a bucket (most
    wins first), then the offered ones never timed; offered configs timed and never winning are dropped (a row
    none of whose configs won stays, with a comment). Candidates beyond the tables that won are listed."""
    from dapo_kernels.ops.varlen_attention import tiles
    old, new, notes = [], [], []
    for key, d in sorted({(tuple(r["table"]), r["D"]) for r in rows if r.get("table")}):
        outer, offered = tiles._GPU_TILES.get(key, {}).get(tiles._tile_dim(d), (None, ()))
        won = [tuple(w["tile"]) for w in best.values() if w.get("table") and tuple(w["table"]) == key and w["D"] == d]
        timed = {tuple(r["tile"]) for r in rows if r.get("table") and tuple(r["table"]) == key and r["D"] == d
                 and r.get("ms") is not None}
        keep = sorted(set(won), key=lambda c: (-won.count(c), c))
        keep += [c for c in offered if c not in timed and c not in keep]
        if not won:
            notes.append(f"# {key}[{d}]: no config of this row won a bucket (another row's did): kept as is\n")
        old.append(f"{key}[{d}]: ({outer}, {tuple(offered)})\n")
        new.append(f"{key}[{d}]: ({outer}, {tuple(keep) if won else tuple(offered)})\n")
    text = "".join(difflib.unified_diff(old, new, "_GPU_TILES (now)", "_GPU_TILES (proposed by the winners)"))
    cands = sorted({f"# candidate beyond the tables won {k[0]} {k[1]} D={k[2]} {k[3]} {k[4]}: {w['config']}\n"
                    for k, w in best.items() if w.get("candidate")})
    if not old:
        return "no table config timed (a toy run's interpreter configs belong to no table)\n"
    return (text or "no change proposed\n") + "".join(notes + cands)


def markdown(result, best) -> str:
    lines = [f"# Autotune sweep {result['date']}, commit {result['commit']}", "",
             f"mode: {'toy (CPU, interpreter; no GPU figure)' if result['toy'] else 'GPU'} | status: "
             f"{result['status']} | {result['seconds']} s of budget {result['budget_s']} s", "",
             "Winners (fastest config checked correct, per kernel and bucket; times are the whole pass):", "",
             "| kernel | dtype | D | mask | bucket | config | ms |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {k[4]} | {w['config']} | {w['ms']:.3f} |"
              for k, w in sorted(best.items(), key=lambda kv: tuple(map(str, kv[0])))]
    lines += ["", f"Every row ({sum(r['status'] == 'FAIL' for r in result['rows'])} FAIL):", "",
              "| kernel | dtype | D | mask | bucket | config | ms | status | note |", "|---" * 9 + "|"]
    for r in result["rows"]:
        ms = "" if r.get("ms") is None else f"{r['ms']:.3f}"
        note = r.get("note", "") or (f"err/bound {r['err_over_bound']:.2f}" if "err_over_bound" in r else "")
        lines.append(f"| {r['kernel']} | {r.get('dtype', '')} | {r.get('D', '')} | {r.get('mask', '')} | "
                     f"{r.get('bucket', '')} | {r['config']} | {ms} | {r['status']} | {note} |")
    return "\n".join(lines) + "\n"


def main(out_dir: pathlib.Path, commit: str, toy: bool, budget: float) -> int:
    from gpu import device_run
    out_dir.mkdir(parents=True, exist_ok=True)
    jsonl = pathlib.Path(tempfile.mkdtemp(prefix="sweep_")) / "rows.jsonl"
    t0 = time.time()
    cmd = [sys.executable, str(HERE / "sweep.py"), "--worker", str(jsonl), "--budget-s", str(budget),
           *(["--toy"] * toy)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **({"TRITON_INTERPRET": "1"} if toy else {}))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # killed from outside: the worker's group too
        signal.signal(sig, device_run._on_signal)
    killed = ""
    with open(out_dir / "sweep.log", "w") as log:
        try:
            rc = device_run._run(cmd, budget + GRACE_S, log, env)[0]
        except device_run._Killed as e:  # (_run has killed the worker's group on the way out)
            rc, killed = None, str(e)
    rows = []
    for line in jsonl.read_text().splitlines() if jsonl.exists() else []:
        with contextlib.suppress(ValueError):  # a last line cut by the kill
            rows.append(json.loads(line))
    stopped = any(r["status"] == "stopped" for r in rows)
    status = (f"killed from outside ({killed})" if killed else "killed at the time limit" if rc is None else
              f"worker exit {rc}" if rc else "stopped by the budget" if stopped else "complete")
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=commit,
                  toy=toy, budget_s=budget, seconds=round(time.time() - t0, 1), status=status, rows=rows)
    best = winners(rows)
    result["winners"] = [dict(zip(("kernel", "dtype", "D", "mask", "bucket"), k), config=w["config"], ms=w["ms"])
                         for k, w in best.items()]
    (out_dir / "sweep.json").write_text(json.dumps(result, indent=1))
    (out_dir / "sweep.md").write_text(markdown(result, best))
    (out_dir / "sweep_tiles.diff").write_text(tiles_diff(rows, best))
    print((out_dir / "sweep.md").read_text(), flush=True)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", nargs="?")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # (the worker: its JSONL file)
    ap.add_argument("--budget-s", type=float, default=float(os.environ.get("SWEEP_BUDGET_S", 500)))
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--toy", action="store_true", default=os.environ.get("DEVICE_RUN_TOY") == "1")
    a = ap.parse_args()
    if not (a.worker or a.out_dir):
        ap.error("OUT_DIR is required")
    sys.exit(worker(a.worker, a.toy, a.budget_s) if a.worker else
             main(pathlib.Path(a.out_dir).resolve(), a.commit, a.toy, a.budget_s))
