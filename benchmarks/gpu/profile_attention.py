"""Where the public ``varlen_attention``'s time goes beside its kernels (GPU only): the op timed
against its launchers alone, its NaN marks timed alone, and a profiler table of two forward +
backward passes. ``python benchmarks/gpu/profile_attention.py [OUT_DIR]`` (writes
``profile_attention.txt`` there)."""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import dapo_kernels as dk  # noqa: E402
from benchmarks.gpu.common import cuda_time_ms  # noqa: E402
from dapo_kernels.ops.varlen_attention import launch, nan  # noqa: E402

HQ, HKV, D = 32, 8, 128


def _ms(fn) -> str:
    return f"{cuda_time_ms(fn, warmup=2, iters=5):9.3f} ms"


def _case(B: int, S: int, g: torch.Generator, say) -> None:
    """One batch of ``B`` sequences of ``S`` tokens, bf16, causal."""
    T, scale = B * S, D ** -0.5
    q, k, v = (torch.randn(T, h, D, device="cuda", generator=g, dtype=torch.bfloat16) for h in (HQ, HKV, HKV))
    cu = torch.arange(0, T + 1, S, device="cuda", dtype=torch.int32)
    say(f"## B{B} S{S} T{T} bf16 Hq{HQ} Hkv{HKV} D{D} causal")
    with torch.no_grad(), dk.use_backend("triton"):
        rows = [
            ("public fwd", lambda: dk.varlen_attention(q, k, v, cu, S)),
            ("launch.fwd_triton auto", lambda: launch.fwd_triton(q, k, v, cu, S, True, scale, -1, -1, 0.0)),
            ("poisoned_queries (triton)", lambda: nan.poisoned_queries(q, k, v, cu, True, -1, -1, True)),
            ("poisoned_queries (torch ops)", lambda: nan.poisoned_queries(q, k, v, cu, True, -1, -1, False)),
            ("isfinite(q).all(-1) (before)", lambda: torch.isfinite(q).all(-1)),
            ("q.clone()", lambda: q.clone()),
        ]
        for name, fn in rows:
            say(f"{name:34s} {_ms(fn)}")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with dk.use_backend("triton"):
        out = dk.varlen_attention(*leaves, cu, S)
        dout = torch.randn_like(out)
        say(f"{'public bwd':34s} {_ms(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))}")
        o, lse = launch.fwd_triton(q, k, v, cu, S, True, scale, -1, -1, 0.0)
        say(f"{'launch.bwd_triton det=False':34s} "
            f"{_ms(lambda: launch.bwd_triton(dout, q, k, v, o, lse, cu, S, True, scale, -1, -1, 0.0, False))}")
        say(f"{'poisoned_grads (triton)':34s} "
            f"{_ms(lambda: nan.poisoned_grads(dout, lse, HKV, cu, True, -1, -1, True))}")
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                torch.autograd.grad(dk.varlen_attention(*leaves, cu, S), leaves, dout)
            torch.cuda.synchronize()
        say(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))


def main(out_dir: str) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    lines = []

    def say(s):
        print(s, flush=True)
        lines.append(s)

    for B, S in ((1, 16384), (8, 8192)):
        _case(B, S, g, say)
        torch.cuda.empty_cache()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "profile_attention.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
