"""CPU benchmark: lm_head -> log-prob -> DAPO loss, forward + backward, side by side.

    pytest benchmarks/bench_loss.py --benchmark-only -p no:xdist -s

Variants (N=4096 tokens, H=1024, V=32000, fp32):
* ``naive``: full ``[N, V]`` logits, log_softmax, gather, verl-style clipped loss (autograd);
* ``dk_fused``: ``dk.fused_linear_policy_loss`` (torch backend, token chunks, grads in the forward);
* ``liger``: Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (loss_type="dapo", no ref model).

Peak memory: each variant runs once more in a fresh subprocess; the extra peak RSS is
``ru_maxrss`` after the step minus ``ru_maxrss`` once inputs (and the fp32 weight grad
buffer every variant needs) are allocated and touched. The table prints at the end (-s).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

N, H, V = int(os.environ.get("BENCH_LOSS_N", 4096)), 1024, 32000
B = 4  # Liger wants [B, T, H] with one advantage per sequence
VARIANTS = ("naive", "dk_fused", "liger")
_RESULTS: dict = {}


def make_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H ** 0.5
    labels = torch.randint(0, V, (N,), generator=g)
    old = -3 * torch.rand(N, generator=g)
    adv = torch.randn(B, generator=g).repeat_interleave(N // B)
    mask = torch.rand(N, generator=g) > 0.1
    return hidden, weight, labels, old, adv, mask


def step_naive(hidden, weight, labels, old, adv, mask):
    logits = hidden @ weight.t()
    log_prob = torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0]
    ratio = torch.exp(torch.clamp(log_prob - old, -20, 20))
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.28))
    pg = torch.where(adv < 0, torch.minimum(-adv * 3.0, pg), pg)
    loss = (pg * mask).sum() / mask.sum()
    loss.backward()
    return loss


def step_dk(hidden, weight, labels, old, adv, mask):
    import dapo_kernels as dk

    with dk.use_backend("torch"):
        loss, _ = dk.fused_linear_policy_loss(hidden, weight, labels, old, adv, mask)
    loss.backward()
    return loss


def _liger_loss():
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    return LigerFusedLinearGRPOLoss(beta=0.0, compiled=False, use_ref_model=False, epsilon_low=0.2,
                                    epsilon_high=0.28, loss_type="dapo")


def step_liger(hidden, weight, labels, old, adv, mask, _fn=[]):
    if not _fn:
        _fn.append(_liger_loss())
    out = _fn[0](hidden.view(B, N // B, H), weight, labels.view(B, N // B), mask.view(B, N // B).long(),
                 adv.view(B, N // B)[:, 0], old_per_token_logps=old.view(B, N // B))
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return loss


STEPS = {"naive": step_naive, "dk_fused": step_dk, "liger": step_liger}


def _leaf_inputs():
    hidden, weight, labels, old, adv, mask = make_inputs()
    return hidden.requires_grad_(), weight.requires_grad_(), labels, old, adv, mask


def _measure_peak(variant: str) -> float:
    """Extra peak RSS (MiB) of one step in a fresh process."""
    code = (
        "import resource, sys, json, torch; sys.path.insert(0, %r); import bench_loss as b\n"
        "args = b._leaf_inputs()\n"
        "args[1].grad = torch.zeros_like(args[1]); args[0].grad = torch.zeros_like(args[0])\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "b.STEPS[%r](*args)\n"
        "print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024))\n"
    ) % (os.path.dirname(os.path.abspath(__file__)), variant)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", autouse=True)
def _print_table():
    yield
    if not _RESULTS:
        return
    print(f"\n\nfused linear -> DAPO loss, fwd+bwd, N={N} H={H} V={V} fp32, CPU ({torch.get_num_threads()} threads)")
    print("| variant | time (s, min) | peak extra RSS (MiB) | time vs naive | memory vs naive |")
    print("|---|---|---|---|---|")
    base = _RESULTS.get("naive")
    for name, (t, mem) in _RESULTS.items():
        rel = f"{t / base[0]:.2f}x" if base else ""
        relm = f"{base[1] / max(mem, 1e-9):.1f}x lower" if base else ""
        print(f"| {name} | {t:.2f} | {mem:.0f} | {rel} | {relm} |")


@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_loss_fwd_bwd(benchmark, variant):
    if variant == "liger":
        pytest.importorskip("liger_kernel", reason="liger-kernel not installed (requirements-bench.txt)")
    args = _leaf_inputs()

    def run():
        args[0].grad = args[1].grad = None
        return STEPS[variant](*args)

    benchmark.pedantic(run, rounds=2, iterations=1, warmup_rounds=0)
    mem = _measure_peak(variant)
    benchmark.extra_info["peak_extra_rss_mib"] = mem
    _RESULTS[variant] = (benchmark.stats.stats.min, mem)
