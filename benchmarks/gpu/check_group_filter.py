"""GPU check for group_filter / overlong_penalty: correctness, no host sync, timing vs peers.

Cases (n = 16 responses per prompt unless random): N = 8,192, 131,072 and 1,000,000.
* correctness: the Triton kernels (group_index path and the contiguous ``group_size``
  path) against the torch path on the same GPU (both compute in float64 and round
  once to float32, so advantages agree to a few float32 ulps; keep masks exactly);
* no host sync: the Triton call runs under ``torch.cuda.set_sync_debug_mode("error")``;
* timing: Triton (both layouts), the torch path on CUDA, and verl 0.9.1's vectorised
  GRPO advantage when verl is importable. Budget: well under 30 s.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

import torch

import dapo_kernels as dk

from gpu.common import cuda_time_ms

OP = "group_filter"
N_PER_PROMPT = 16
SIZES = (8192, 131072, 1_000_000)


@contextlib.contextmanager
def _no_host_sync():
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def _inputs(N: int, shuffled: bool):
    G = N // N_PER_PROMPT
    gi = torch.arange(G, device="cuda").repeat_interleave(N_PER_PROMPT)
    p = torch.rand(G, device="cuda")[gi] * 1.4 - 0.2
    scores = (torch.rand(N, device="cuda") < p).float()
    if shuffled:
        perm = torch.randperm(N, device="cuda")
        scores, gi = scores[perm], gi[perm]
    return scores, gi, G


def _compare(res, ref) -> str:
    """'' when equal within tolerance, else what differs."""
    for name in ("keep", "group_keep", "group_size", "num_kept_groups", "num_invalid", "num_out_of_range"):
        if not torch.equal(getattr(res, name), getattr(ref, name)):
            return f"{name} differs"
    for name in ("advantages", "group_mean", "group_std"):
        a, b = getattr(res, name), getattr(ref, name)
        tol = 4 * torch.finfo(torch.float32).eps * max(1.0, b.abs().max().item() if b.numel() else 1.0)
        err = (a - b).abs().max().item() if a.numel() else 0.0
        if not err <= tol:
            return f"{name} max err {err:.2e} > {tol:.2e}"
    return ""


def _verl_vectorized():
    if importlib.util.find_spec("ray") is None:  # verl imports ray at module level; use the stub
        sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_stubs"))
    try:
        from verl.trainer.ppo.core_algos import compute_grpo_vectorized_outcome_advantage
    except Exception:  # verl is a benchmark-only peer; its absence is reported, not fatal
        return None
    return compute_grpo_vectorized_outcome_advantage


def _check_size(report, N: int, verl_fn) -> None:
    scores, gi, G = _inputs(N, shuffled=True)
    with dk.use_backend("torch"):
        ref = dk.group_filter(scores, gi, G)
        ref_contig = dk.group_filter(scores, group_size=N_PER_PROMPT)
    case = f"N={N} n={N_PER_PROMPT}"
    calls = {
        "triton index": lambda: dk.group_filter(scores, gi, G),
        "triton group_size": lambda: dk.group_filter(scores, group_size=N_PER_PROMPT),
    }
    for impl, fn in calls.items():
        with report.section(OP, case, impl=impl), dk.use_backend("triton"):
            fn()  # compile outside the sync check
            with _no_host_sync():
                res = fn()
            bad = _compare(res, ref if impl == "triton index" else ref_contig)
            report.add(OP, case, impl=impl, ms=cuda_time_ms(fn), metric=f"kept {int(res.num_kept_groups)}/{G}",
                       status="FAIL" if bad else "ok", note=bad or "no host sync")
    with report.section(OP, case, impl="torch path (cuda)"), dk.use_backend("torch"):
        report.add(OP, case, impl="torch path (cuda)", ms=cuda_time_ms(lambda: dk.group_filter(scores, gi, G)))
    if verl_fn is not None:
        with report.section(OP, case, impl="verl grpo_vectorized"):
            rewards, mask = scores[:, None], torch.ones(N, 1, device="cuda")
            report.add(OP, case, impl="verl grpo_vectorized", ms=cuda_time_ms(lambda: verl_fn(rewards, mask, gi)),
                       note="advantages only")


def _check_invalid(report) -> None:
    scores, gi, G = _inputs(4096, shuffled=True)
    scores[7] = float("nan")
    with dk.use_backend("triton"):
        with _no_host_sync():
            res = dk.group_filter(scores, gi, G)
    bad_group = int(gi[7])
    ok = int(res.num_invalid) == 1 and not bool(res.group_keep[bad_group]) and not bool(res.keep[gi == bad_group].any())
    report.add(OP, "NaN score, N=4096", impl="triton index", status="ok" if ok else "FAIL",
               note="flagged on device, group dropped" if ok else "NaN group not flagged/dropped")


def _check_overlong(report) -> None:
    lengths = torch.randint(0, 20480, (131072,), device="cuda")
    with dk.use_backend("torch"):
        ref = dk.overlong_penalty(lengths, 20480, 4096, 1.0)
    with dk.use_backend("triton"):
        out = dk.overlong_penalty(lengths, 20480, 4096, 1.0)
        ms = cuda_time_ms(lambda: dk.overlong_penalty(lengths, 20480, 4096, 1.0))
    ok = torch.equal(out, ref)
    report.add("overlong_penalty", "N=131072", impl="triton", ms=ms, status="ok" if ok else "FAIL",
               note="" if ok else "differs from torch path")


def run(report) -> None:
    verl_fn = _verl_vectorized()
    if verl_fn is None:
        report.add(OP, "peers", impl="verl", status="skip", note="verl not importable on this machine")
    with report.section(OP, "NaN score, N=4096", impl="triton index"):  # correctness first
        _check_invalid(report)
    with report.section("overlong_penalty", "N=131072", impl="triton"):
        _check_overlong(report)
    for N in SIZES:
        with report.section(OP, f"N={N} n={N_PER_PROMPT}", impl="inputs and torch reference"):
            _check_size(report, N, verl_fn)
