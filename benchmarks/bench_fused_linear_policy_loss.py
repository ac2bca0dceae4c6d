"""CPU benchmark: lm_head -> log-prob -> DAPO loss, forward + backward, side by side.

    pytest benchmarks/bench_loss.py --benchmark-only -p no:xdist -s

Variants (N=4096 tokens, H=1024, V=32000, fp32):
* ``naive``: full ``[N, V]`` logits, log_softmax, gather, verl-style clipped loss (autograd);
* ``dk_fused``: ``dk.fused_linear_policy_loss`` (torch backend, token chunks, grads in the forward);
* ``liger``: Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (loss_type="dapo", no ref model).

Each measurement is one forward + backward in a fresh process (``python bench_loss.py VARIANT``),
variants alternated round by round on this shared, noisy machine; the table keeps the best time.
Peak extra memory: a thread samples the process RSS (/proc/self/statm) every millisecond during
the step, minus the RSS right before it (inputs allocated, a small-N warm-up done and its grads
dropped). It includes the dW + dH every variant returns (V*H + N*H fp32 = 141 MiB here).
ru_maxrss cannot do this: it is a high-water mark that the warm-up would already have raised.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

N, H, V = int(os.environ.get("BENCH_LOSS_N", 4096)), 1024, 32000
B = 4  # Liger wants [B, T, H] with one advantage per sequence
ROUNDS = int(os.environ.get("BENCH_LOSS_ROUNDS", 2))
VARIANTS = ("naive", "dk_fused", "liger")


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
    n = hidden.shape[0]
    out = _fn[0](hidden.view(B, n // B, H), weight, labels.view(B, n // B), mask.view(B, n // B).long(),
                 adv.view(B, n // B)[:, 0], old_per_token_logps=old.view(B, n // B))
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return loss


STEPS = {"naive": step_naive, "dk_fused": step_dk, "liger": step_liger}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRSS(threading.Thread):
    """Highest RSS seen while running; torch ops release the GIL, so the samples keep coming."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self._done = _rss(), threading.Event()

    def run(self):
        while not self._done.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return max(self.peak, _rss())


def measure(variant: str) -> dict:
    """One fwd+bwd of ``variant`` in this process: seconds and peak extra RSS (MiB)."""
    hidden, weight, labels, old, adv, mask = make_inputs()
    hidden.requires_grad_(), weight.requires_grad_()
    w = 4 * B  # warm-up: first-call costs (imports, MKL, Liger's setup) stay out of the measured step
    STEPS[variant](hidden[:w], weight, labels[:w], old[:w], adv[:w], mask[:w])
    hidden.grad = weight.grad = None
    base = _rss()
    sampler = _PeakRSS()
    sampler.start()
    t0 = time.perf_counter()
    loss = STEPS[variant](hidden, weight, labels, old, adv, mask)
    seconds = time.perf_counter() - t0
    peak = sampler.stop()
    return dict(seconds=seconds, peak_mib=(peak - base) / 2**20, loss=loss.item(),
                grad_norm=weight.grad.norm().item())


def _measure_in_subprocess(variant: str) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), variant], capture_output=True, text=True,
                         env={**os.environ, "BENCH_LOSS_N": str(N)})
    if out.returncode:
        raise RuntimeError(f"{variant} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _liger_available() -> str:
    try:
        _liger_loss()
        return ""
    except Exception as e:  # reported as a row, not a failure: Liger is a benchmark-only peer
        return f"{type(e).__name__}: {e}"[:200]


def measure_all(rounds: int = ROUNDS) -> dict:
    """{variant: best-time result (+ 'skipped' reason)}; variants alternated within every round."""
    skipped = {"liger": _liger_available()}
    runs = {v: [] for v in VARIANTS if not skipped.get(v)}
    for _ in range(rounds):
        for v in runs:
            runs[v].append(_measure_in_subprocess(v))
    best = {}
    for v, rs in runs.items():
        best[v] = dict(min(rs, key=lambda r: r["seconds"]), peak_mib_runs=[round(r["peak_mib"]) for r in rs],
                       seconds_runs=[round(r["seconds"], 2) for r in rs])
        # Other processes' noise can only add time, never memory: the memory is the same every run.
        best[v]["peak_mib"] = min(r["peak_mib"] for r in rs)
    for v, why in skipped.items():
        if why:
            best[v] = dict(skipped=why)
    return best


def table(results: dict) -> str:
    load = os.getloadavg()[0]
    lines = [f"fused linear -> DAPO loss, fwd+bwd, N={N} H={H} V={V} fp32, CPU {torch.get_num_threads()} threads, "
             f"load average {load:.1f}, best of {ROUNDS} alternated rounds",
             "| variant | time (s) | peak extra memory (MiB) | time vs naive | memory vs naive | loss | runs: s / MiB |",
             "|---|---|---|---|---|---|---|"]
    base = results["naive"]
    for name, r in results.items():
        if "skipped" in r:
            lines.append(f"| {name} | not run: {r['skipped']} | | | | | |")
            continue
        lines.append(f"| {name} | {r['seconds']:.2f} | {r['peak_mib']:.0f} | {r['seconds'] / base['seconds']:.2f}x | "
                     f"{base['peak_mib'] / max(r['peak_mib'], 1e-9):.1f}x lower | {r['loss']:.6f} | "
                     f"{r['seconds_runs']} / {r['peak_mib_runs']} |")
    return "\n".join(lines)


@pytest.mark.benchmark(group=f"fused loss N{N}-H{H}-V{V}-fp32")
def test_fused_loss_fwd_bwd(benchmark):
    # pytest-benchmark's own timing is of the whole alternated suite; the per-variant numbers are
    # the in-process step times, in extra_info and the printed table.
    results = benchmark.pedantic(measure_all, rounds=1, iterations=1)
    benchmark.extra_info.update({k: v for k, v in results.items()})
    print("\n\n" + table(results))
    naive, dk = results["naive"], results["dk_fused"]
    if N < 4096:  # the targets are the issue's, at its size: at small N the shared dW dominates both
        return
    assert dk["peak_mib"] * 5 <= naive["peak_mib"], f"peak extra memory {dk['peak_mib']:.0f} MiB vs naive {naive['peak_mib']:.0f}"
    assert dk["seconds"] <= naive["seconds"], f"fused {dk['seconds']:.2f}s slower than naive {naive['seconds']:.2f}s"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print(json.dumps(measure(sys.argv[1])))
