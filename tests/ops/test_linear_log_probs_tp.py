"""Vocab-parallel linear_log_probs / fused_linear_policy_loss: 2 CPU processes on gloo == unsharded."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, seed: int, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(seed)  # same full inputs on both ranks
        n, h, v = 21, 24, 2 * 130
        hidden = torch.randn(n, h)
        weight = torch.randn(v, h) * 0.4
        labels = torch.randint(0, v, (n,))
        old, adv, mask = -3 * torch.rand(n), torch.randn(n), torch.rand(n) > 0.2
        cot = torch.randn(n), torch.randn(n)
        shard = slice(rank * v // WORLD, (rank + 1) * v // WORLD)
        kw = dict(old_log_prob=old, advantages=adv, response_mask=mask, entropy_coeff=0.01,
                  ref_log_prob=old + 0.1, kl_coef=0.1, temperature=0.7)
        for be in ("torch", "triton"):
            _compare(rank, be, hidden, weight, labels, shard, cot, kw, errors)
    finally:
        dist.destroy_process_group()


def _compare(rank, be, hidden, weight, labels, shard, cot, kw, errors):
    import dapo_kernels as dk

    results = {}
    for name, w_full, group in (("full", weight, None), ("tp", weight[shard].contiguous(), dist.group.WORLD)):
        hh, ww = hidden.clone().requires_grad_(), w_full.clone().requires_grad_()
        with dk.use_backend(be):
            lp, ent = dk.linear_log_probs(hh, ww, labels, return_entropy=True, temperature=0.7,
                                          process_group=group)
            dh, dw = torch.autograd.grad((lp * cot[0] + ent * cot[1]).sum(), [hh, ww])
            loss, met = dk.fused_linear_policy_loss(hh, ww, labels, process_group=group, **kw)
            fdh, fdw = torch.autograd.grad(loss, [hh, ww])
        if name == "full":
            dw, fdw = dw[shard], fdw[shard]
        results[name] = dict(lp=lp, ent=ent, dh=dh, dw=dw, loss=loss, fdh=fdh, fdw=fdw,
                             flp=met["log_prob"], fent=met["entropy"])
    for k, full in results["full"].items():
        tp = results["tp"][k]
        # Sharding only regroups fp32 sums: a few ulps of the value's scale.
        tol = 8 * torch.finfo(torch.float32).eps * max(full.abs().max().item(), 1.0)
        err = (tp - full).abs().max().item()
        if not err <= tol:
            errors.append(f"rank {rank} {be} {k}: {err:.3e} > {tol:.3e}")


@pytest.mark.timeout(180)
def test_vocab_parallel_equals_unsharded(_seed_per_test):
    """Both backends in one spawn (the process start-up is the expensive part)."""
    errors = mp.Manager().list()
    mp.spawn(_worker, args=(_free_port(), _seed_per_test, errors), nprocs=WORLD, join=True)
    assert not list(errors), "\n".join(errors)
