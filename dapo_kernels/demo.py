"""Packing demo: unpad a padded RL-style batch, pack it, pad it back, and print a table.

``python -m dapo_kernels.demo`` (``make demo`` runs the project's main job; until the
trainer lands that is this demo). Checks exactness against the reference and times the
torch path against a flash-attn-style ``nonzero()`` gather.
"""
from __future__ import annotations

import time

import torch

import dapo_kernels as dk
from dapo_kernels.reference import pad_input_ref, unpad_input_ref


def _best_ms(fn, rounds=5):
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    torch.manual_seed(0)
    rows = []
    for B, S, H, pad_side in [(8, 512, 256, "right"), (32, 1024, 512, "left"), (64, 2048, 256, "right")]:
        lens = torch.randint(S // 8, S + 1, (B,))
        ar = torch.arange(S)
        mask = ar[None] < lens[:, None] if pad_side == "right" else ar[None] >= (S - lens)[:, None]
        x = torch.randn(B, S, H)
        xu, idx, cu, max_seqlen, _ = dk.unpad_input(x, mask)
        pos = dk.packed_position_ids(cu, xu.shape[0])
        back = dk.pad_input(xu, idx, B, S)
        exact = torch.equal(xu, unpad_input_ref(x, mask)[0]) and torch.equal(back, pad_input_ref(xu, idx, B, S))
        t_ours = _best_ms(lambda: dk.unpad_input(x, mask))
        t_peer = _best_ms(lambda: x.reshape(B * S, H)[mask.flatten().nonzero().flatten()])
        rows.append((f"B{B} S{S} H{H} {pad_side}-pad", xu.shape[0], 100 * (1 - xu.shape[0] / (B * S)), max_seqlen,
                     int(pos.max()) + 1, exact, t_ours, t_peer))
    hdr = (f"{'batch':28s} {'tokens':>8s} {'padding':>8s} {'max_len':>8s} {'pos_max+1':>9s} {'exact':>6s} "
           f"{'unpad ms':>9s} {'nonzero ms':>10s}")
    print(hdr)
    print("-" * len(hdr))
    for name, nnz, padp, mx, pmax, exact, t1, t2 in rows:
        print(f"{name:28s} {nnz:8d} {padp:7.1f}% {mx:8d} {pmax:9d} {str(exact):>6s} {t1:9.2f} {t2:10.2f}")
    if not all(r[5] for r in rows):
        raise SystemExit("packing demo: results differ from the reference")


if __name__ == "__main__":
    main()
