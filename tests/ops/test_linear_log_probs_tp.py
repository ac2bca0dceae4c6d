"""Vocab-parallel linear_log_probs / fused_linear_policy_loss on 2 CPU processes (gloo) equal the
unsharded op within 2x plain torch's own fp32 error."""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import spawn_process_group

WORLD = 2


def _worker(rank: int, seed: int, errors):
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


def _references(hidden, weight, labels, cot, kw):
    """float64 references and plain torch's own fp32 result (the worst of its usual ways) of every
    compared quantity, unsharded: {name: (ref64, torch_fp32)}."""
    from unittest import mock

    import dapo_kernels.reference.fused_linear_policy_loss as ref_fused
    from dapo_kernels.reference import fused_linear_policy_loss_ref
    from tests.linear_log_probs_ways import TORCH_WAYS, grads_of, llp_vocab_chunks
    from tests.tolerance import worst_of

    # Plus torch the Megatron way: log-softmax combined from per-shard statistics.
    def per_shard(h, w, lab, t):
        return llp_vocab_chunks(h, w, lab, t, cols=w.shape[0] // WORLD)

    ways = TORCH_WAYS + (per_shard,)

    def run(dt, llp):
        h, w = hidden.to(dt), weight.to(dt)
        (lp, ent), dh, dw = grads_of(lambda a, b: llp(a, b, labels, 0.7), h, w, *cot)
        kw_dt = {k: (v.to(dt) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with mock.patch.object(ref_fused, "linear_log_probs_ref", llp):
            loss, _, flp, fent = fused_linear_policy_loss_ref(hh, ww, labels, **kw_dt)
        fdh, fdw = torch.autograd.grad(loss, [hh, ww])
        return lp, ent, dh, dw, loss, fdh, fdw, flp, fent

    names = ("lp", "ent", "dh", "dw", "loss", "fdh", "fdw", "flp", "fent")
    r64 = run(torch.float64, TORCH_WAYS[0])
    t32 = worst_of([run(torch.float32, f) for f in ways], r64)
    return {n: (r, t) for n, r, t in zip(names, r64, t32)}


def _run_op(be, hidden, weight, labels, cot, kw, group):
    import dapo_kernels as dk

    hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with dk.use_backend(be):
        lp, ent = dk.linear_log_probs(hh, ww, labels, return_entropy=True, temperature=0.7, process_group=group)
        dh, dw = torch.autograd.grad((lp * cot[0] + ent * cot[1]).sum(), [hh, ww])
        loss, met = dk.fused_linear_policy_loss(hh, ww, labels, process_group=group, **kw)
        fdh, fdw = torch.autograd.grad(loss, [hh, ww])
    return dict(lp=lp, ent=ent, dh=dh, dw=dw, loss=loss, fdh=fdh, fdw=fdw, flp=met["log_prob"], fent=met["entropy"])


def _compare(rank, be, hidden, weight, labels, shard, cot, kw, errors):
    """Sharding only regroups the vocab sums, so the vocab-sharded result may differ from the same op
    unsharded by at most 2x the error plain torch itself makes in fp32 (the worst of its usual ways,
    Megatron's per-shard log-softmax included) against the float64 reference."""
    from tests.tolerance import max_abs_err

    refs = _references(hidden, weight, labels, cot, kw)
    full = _run_op(be, hidden, weight, labels, cot, kw, None)
    tp = _run_op(be, hidden, weight[shard].contiguous(), labels, cot, kw, dist.group.WORLD)
    for k, out in tp.items():
        r64, t32 = refs[k]
        ref_full = full[k]
        if k in ("dw", "fdw"):
            r64, t32, ref_full = r64[shard], t32[shard], ref_full[shard]
        bound = 2 * max(max_abs_err(t32, r64), torch.finfo(torch.float32).eps * r64.abs().max().item())
        err = max_abs_err(out, ref_full)
        if not err <= bound or out.isnan().any():
            errors.append(f"rank {rank} {be} {k}: sharded - unsharded {err:.3e} > 2x torch's fp32 error ({bound / 2:.3e})")


@pytest.mark.timeout(180)
def test_vocab_parallel_equals_unsharded(_seed_per_test):
    """Both backends in one spawn (the process start-up is the expensive part)."""
    errors = mp.Manager().list()
    spawn_process_group(_worker, WORLD, _seed_per_test, errors)
    errors = list(errors)
    assert not errors, "\n".join(errors)
