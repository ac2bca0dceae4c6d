"""GPU-faithful fp32 emulation of the Triton ``varlen_attention`` softcap arithmetic, on the CPU.

The interpreter's tests sum fp32 ``tl.dot`` in fp64 (tests/interpreter_dot.py), which hides part of a
GPU's fp32 rounding; this script redoes the kernels' elementwise arithmetic in fp32 torch ops (fp32
matmuls, the kernels' tanh polynomial, base-2 scores) and reports dV / dK error against float64 as a
multiple of plain fp32 torch's, for each way of keeping the lse (issue 31, "Precision"):

* ``fp32-lse``: the lse rounded to fp32 in base-2 units, subtracted from recomputed base-2 scores;
* ``fp64-lse``: the lse kept in fp64 (a hi + lo fp32 pair in the kernels), subtracted in two steps;
* ``natural``: as ``fp64-lse`` with natural-unit scores (softcap * tanh), scaled by log2(e) after the
  lse is subtracted (an alternative not taken: it changes the forward too, for little).

Usage: python benchmarks/emulate_varlen_attention_softcap.py [--first 0] [--seeds 12]
"""
from __future__ import annotations

import argparse
import math

import torch

LOG2E = 1.4426950408889634
_POLY = (-0.3333333333333333, 0.13333333333333333, -0.05396825396825397, 0.021869488536155203,
         -0.008863235529902197, 0.003592128036572481)


def _tanh32(x: torch.Tensor) -> torch.Tensor:
    """The kernels' ``_tanh`` in fp32 ops."""
    x2 = x * x
    acc = torch.full_like(x, _POLY[-1])
    for c in reversed(_POLY[:-1]):
        acc = c + x2 * acc
    poly = x * (1.0 + x2 * acc)
    big = 1.0 - 2.0 / (torch.exp2(x.abs() * 2.8853900817779268) + 1.0)
    return torch.where(x.abs() < 0.4, poly, torch.where(x < 0, -big, big))


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def kernel_emulation(q, k, v, dout, scale, softcap, lse_mode):
    """(dk, dv) of one causal sequence [H, L, D] the way the Triton kernels compute them in fp32."""
    natural = lse_mode == "natural"
    qk_scale, cap, log2e = _f32(scale / softcap), _f32(softcap if natural else softcap * LOG2E), _f32(LOG2E)
    L = q.shape[1]
    hidden = torch.ones(L, L, dtype=torch.bool).triu(1)
    t = _tanh32((q @ k.transpose(1, 2)) * qk_scale)
    s2 = (cap * t).masked_fill(hidden, float("-inf"))          # base-2 scores (natural: natural-unit ones)
    m = s2.amax(-1, keepdim=True)
    p_fwd = torch.exp2((s2 - m) * log2e) if natural else torch.exp2(s2 - m)
    l = p_fwd.sum(-1, keepdim=True)
    out = (p_fwd @ v) / l
    if natural:
        lse64 = m.double() + torch.log(l.double())
        hi = lse64.float()
        p = torch.exp2(((s2 - hi) - (lse64 - hi.double()).float()) * log2e)
    elif lse_mode == "fp32-lse":
        lse = m + torch.log2(l)
        p = torch.exp2(s2 - lse)
    else:  # fp64 lse: hi + lo pair, the large parts cancel exactly (Sterbenz) where p matters
        lse64 = m.double() + torch.log2(l).double()
        hi = lse64.float()
        lo = (lse64 - hi.double()).float()
        p = torch.exp2((s2 - hi) - lo)
    dv = p.transpose(1, 2) @ dout
    dp = (dout.double() @ v.double().transpose(1, 2))
    delta = (dout.double() * out.double()).sum(-1, keepdim=True)
    ds = (p * (dp - delta).float()) * (1.0 - t * t)
    dk = (ds.transpose(1, 2) @ q) * _f32(scale)
    return dk, dv


def torch_plain(q, k, v, dout, scale, softcap, dtype):
    """(dk, dv) of plain softcap softmax attention in ``dtype`` (torch autograd)."""
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    L = q.shape[1]
    s = softcap * torch.tanh(q @ k.transpose(1, 2) * scale / softcap)
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ v
    _, dk, dv = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
    return dk, dv


MODES = ("fp32-lse", "fp64-lse", "natural")


def ratios(seed, T=40, H=4, D=64, q_mult=50.0, softcap=50.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(H, T, D, generator=g) for _ in range(4))
    q = q * q_mult
    scale = 1.0 / math.sqrt(D)
    ref = torch_plain(q, k, v, dout, scale, softcap, torch.float64)
    plain = torch_plain(q, k, v, dout, scale, softcap, torch.float32)
    err = lambda a, b: (a.double() - b).abs().max().item()  # noqa: E731
    row = {}
    for mode in MODES:
        got = kernel_emulation(q, k, v, dout, scale, softcap, mode)
        row[mode] = tuple(err(x, r) / err(y, r) for x, y, r in zip(got, plain, ref))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=12)
    args = ap.parse_args()
    print("seed  " + "   ".join(f"{m:>8} dK/torch dV/torch" for m in MODES))
    rows = []
    for seed in range(args.first, args.first + args.seeds):
        row = ratios(seed)
        rows.append([row[m] for m in MODES])
        print(f"{seed:4d}  " + "   ".join(f"{row[m][0]:17.2f} {row[m][1]:8.2f}" for m in MODES))
    t = torch.tensor(rows)  # [seeds, modes, (dK, dV)]
    for label, x in (("max", t.max(0).values), ("median", t.median(0).values), ("n > 2", (t > 2).sum(0))):
        print(f"{label:6s}" + "   ".join(f"{float(a):17.2f} {float(b):8.2f}" for a, b in x.tolist()))


if __name__ == "__main__":
    main()
