"""MoE: routing, permutation, the experts' grouped GEMMs (both backends) and the auxiliary loss against
the float64 per-expert loop of dapo_kernels/reference/moe.py, and parity with transformers' Qwen3-MoE.

The Triton kernels run interpreted on the CPU, so sizes are tiny; the interpreter's 16-row tiles
still make experts span several row blocks, partial ones included, and leave experts without rows.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dapo_kernels as dk
from dapo_kernels.reference import (moe_experts_ref, moe_load_balancing_loss_ref, moe_route_ref,
                                    moe_tokens_per_expert_ref)
from tests.helpers import BACKENDS, assert_equal, backend, case_id
from tests.sync_counter import count_host_syncs
from tests.tolerance import assert_close_to_ref, worst_of

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16


def _ids(kind: str, T: int, E: int, k: int) -> torch.Tensor:
    """int64 ``[T, k]`` expert ids of a routing pattern."""
    if kind == "random":      # distinct experts per token, as top-k gives them
        return torch.rand(T, E).argsort(-1)[:, :k]
    if kind == "skewed":      # most tokens to expert 1, experts 0 and E-1 get nothing
        ids = torch.rand(T, E - 2).argsort(-1)[:, :k] + 1
        ids[: 3 * T // 4, 0] = 1
        ids[: 3 * T // 4, 1:] = torch.randint(2, E - 1, (3 * T // 4, k - 1))
        return ids
    if kind == "duplicates":  # a token picking one expert twice (possible through moe_experts' ids)
        ids = torch.randint(0, E, (T, k))
        ids[:, 1] = ids[:, 0]
        return ids
    if kind == "invalid":     # ids outside [0, E) select no expert (-1: vLLM, E: transformers' sentinel)
        ids = torch.rand(T, E).argsort(-1)[:, :k]
        ids[::3, 0] = -1
        ids[1::4, k - 1] = E
        return ids
    raise ValueError(kind)


def _weights(T, H, I, E, dtype):
    x = torch.randn(T, H).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H) / H ** 0.5).to(dtype)
    down = (torch.randn(E, H, I) / I ** 0.5).to(dtype)
    return x, gate_up, down


def _grads(out, inputs, dout):
    if out.numel() == 0:
        return tuple(torch.zeros_like(t) for t in inputs)
    return torch.autograd.grad(out, inputs, dout.to(out.dtype), allow_unused=True)


def _leaves(*ts, dtype=None):
    return [t.detach().to(dtype or t.dtype).requires_grad_() for t in ts]


def _batched_way(x, gate_up, down, w, ids, compute_dtype):
    """transformers' other experts implementation ("batched_mm" in transformers.integrations.moe): each
    (token, choice) row through its expert's gathered weights by ``bmm``, the k rows summed; in ``compute_dtype``."""
    T, k = ids.shape
    E = gate_up.shape[0]
    valid = ((ids >= 0) & (ids < E)).reshape(-1, 1)
    e = ids.clamp(0, E - 1).reshape(-1)
    xs = x.to(compute_dtype).repeat_interleave(k, 0)
    g, u = torch.bmm(gate_up.to(compute_dtype)[e], xs.unsqueeze(-1)).squeeze(-1).chunk(2, -1)
    y = torch.bmm(down.to(compute_dtype)[e], (F.silu(g) * u).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, y * w.to(compute_dtype).reshape(-1, 1), 0.0).view(T, k, x.shape[1]).sum(1)


NAMES = ("out", "d_hidden_states", "d_gate_up_proj", "d_down_proj", "d_topk_weights")

# (T, H, I, E, k, dtype, ids): every dtype, odd sizes, T = 0 / 1, skewed (experts with 0 and > 16 rows),
# duplicates in a token, invalid ids.
CASES = [
    (19, 24, 20, 6, 2, FP32, "random"),
    (33, 16, 16, 5, 3, BF16, "skewed"),
    (21, 40, 12, 4, 2, FP16, "random"),
    (17, 32, 24, 6, 2, FP32, "skewed"),
    (12, 16, 8, 4, 2, BF16, "duplicates"),
    (14, 24, 16, 5, 2, FP32, "invalid"),
    (1, 16, 16, 4, 2, FP32, "random"),
    (1, 8, 8, 3, 3, BF16, "random"),
    (0, 16, 16, 4, 2, FP32, "random"),
]


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("T,H,I,E,k,dtype,kind", CASES,
                         ids=[case_id(T=c[0], H=c[1], I=c[2], E=c[3], k=c[4], dtype=c[5]) + "-" + c[6] for c in CASES])
def test_experts_match_reference(be, T, H, I, E, k, dtype, kind):
    x, gate_up, down = _weights(T, H, I, E, dtype)
    ids = _ids(kind, T, E, k) if T else torch.zeros(0, k, dtype=torch.int64)
    w = torch.rand(T, k).to(dtype)
    dout = torch.randn(T, H)
    leaves = _leaves(x, gate_up, down, w)
    with backend(be):
        out = dk.moe_experts(*leaves[:3], leaves[3], ids)
        got = (out,) + _grads(out, leaves, dout)
    ref_leaves = _leaves(x, gate_up, down, w, dtype=torch.float64)
    ref = moe_experts_ref(*ref_leaves, ids)
    ref = (ref,) + _grads(ref, ref_leaves, dout.double())
    ways = []  # torch's usual ways in the dtype: transformers' loop over experts, and its batched_mm
    for way in (moe_experts_ref, _batched_way):
        plain_leaves = _leaves(x, gate_up, down, w)
        plain = way(*plain_leaves, ids, compute_dtype=dtype)
        ways.append((plain,) + _grads(plain, plain_leaves, dout))
    for name, a, r, p in zip(NAMES, got, ref, worst_of(ways, ref)):
        assert a.dtype == p.dtype, f"{name}: dtype {a.dtype}"
        assert_close_to_ref(a, r, p, name=name)


@pytest.mark.parametrize("be", BACKENDS)
def test_experts_without_tokens_get_zero_gradients(be):
    T, H, I, E, k = 10, 16, 8, 6, 2
    x, gate_up, down = _weights(T, H, I, E, FP32)
    ids = torch.randint(0, 3, (T, k))  # experts 3..5 receive nothing
    ids[:, 1] = (ids[:, 0] + 1) % 3
    leaves = _leaves(x, gate_up, down, torch.rand(T, k))
    with backend(be):
        out = dk.moe_experts(*leaves, ids)
        _, dgu, ddown, _ = torch.autograd.grad(out, leaves, torch.randn(T, H))
    assert torch.equal(dgu[3:], torch.zeros_like(dgu[3:])) and torch.equal(ddown[3:], torch.zeros_like(ddown[3:]))
    assert dgu[:3].abs().sum() > 0


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("norm", [True, False])
def test_fused_moe_matches_reference(be, dtype, norm):
    """Router gradients included: the logits' gradient flows through the routing weights."""
    T, H, I, E, k = 18, 16, 16, 6, 3
    x, gate_up, down = _weights(T, H, I, E, dtype)
    logits = torch.randn(T, E).to(dtype)
    dout = torch.randn(T, H)
    leaves = _leaves(x, logits, gate_up, down)
    with backend(be):
        out = dk.fused_moe(*leaves, k, norm)
        got = (out,) + _grads(out, leaves, dout)

    def plain(compute):
        ls = _leaves(x, logits, gate_up, down, dtype=compute)
        w, ids = moe_route_ref(ls[1], k, norm, compute_dtype=torch.float64 if compute == torch.float64 else FP32)
        o = moe_experts_ref(ls[0], ls[2], ls[3], w, ids, compute_dtype=compute)
        return (o,) + _grads(o, ls, dout.to(compute)), ids

    ref, ref_ids = plain(torch.float64)
    p, _ = plain(dtype)
    assert torch.equal(dk.moe_route(logits, k, norm)[1], moe_route_ref(logits, k, norm)[1])
    for name, a, r, q in zip(("out", "d_hidden_states", "d_router_logits", "d_gate_up_proj", "d_down_proj"),
                             got, ref, p):
        assert_close_to_ref(a, r, q, name=name)


@pytest.mark.parametrize("dtype", [FP32, BF16, FP16])
@pytest.mark.parametrize("norm", [True, False])
def test_route_matches_transformers_router(dtype, norm):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = _config(norm_topk_prob=norm)
    router = Qwen3MoeTopKRouter(cfg).to(dtype)
    torch.nn.init.normal_(router.weight)
    h = torch.randn(23, cfg.hidden_size).to(dtype)
    logits, weights, ids = router(h)
    w, i = dk.moe_route(logits, cfg.num_experts_per_tok, norm)
    assert_equal(i, ids, "topk_ids")
    assert_equal(w, weights, "topk_weights")


def _config(**kw):
    from transformers import Qwen3MoeConfig

    base = dict(hidden_size=32, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True,
                hidden_act="silu", intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=32)
    base.update(kw)
    return Qwen3MoeConfig(**base)


@pytest.mark.parametrize("be", BACKENDS)
def test_parity_with_transformers_sparse_moe_block(be):
    """Qwen3MoeSparseMoeBlock (fp32, tiny random config) forward and backward: ours is at most 2x as far from
    the float64 reference as transformers' expert loop, for the output and every gradient."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = _config()
    block = Qwen3MoeSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    h = torch.randn(2, 9, cfg.hidden_size)
    dout = torch.randn(2, 9, cfg.hidden_size)
    hx = h.clone().requires_grad_()
    theirs_out = block(hx)
    theirs = (theirs_out,) + torch.autograd.grad(theirs_out, (hx, block.gate.weight, block.experts.gate_up_proj,
                                                              block.experts.down_proj), dout)

    ours_leaves = _leaves(h, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj)
    with backend(be):
        x = ours_leaves[0].view(-1, cfg.hidden_size)
        out = dk.fused_moe(x, F.linear(x, ours_leaves[1]), ours_leaves[2], ours_leaves[3], cfg.num_experts_per_tok,
                           cfg.norm_topk_prob).view(h.shape)
        ours = (out,) + torch.autograd.grad(out, ours_leaves, dout)

    ref_leaves = _leaves(h, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj,
                         dtype=torch.float64)
    x64 = ref_leaves[0].view(-1, cfg.hidden_size)
    w, ids = moe_route_ref(F.linear(x64, ref_leaves[1]), cfg.num_experts_per_tok, True, compute_dtype=torch.float64)
    _, their_ids = moe_route_ref(F.linear(h.view(-1, cfg.hidden_size), block.gate.weight), cfg.num_experts_per_tok)
    assert torch.equal(ids, their_ids), "pick a seed without near-ties in the top-k"
    ref_out = moe_experts_ref(x64, ref_leaves[2], ref_leaves[3], w, ids).view(h.shape)
    ref = (ref_out,) + torch.autograd.grad(ref_out, ref_leaves, dout.double())
    for name, a, r, t in zip(("out", "d_hidden_states", "d_gate.weight", "d_gate_up_proj", "d_down_proj"),
                             ours, ref, theirs):
        assert_close_to_ref(a, r, t, name=name)


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_matches_transformers(masked):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    B, S, E, k = 3, 7, 8, 2
    logits = torch.randn(B * S, E, requires_grad=True)
    mask = (torch.rand(B, S) > 0.3).long() if masked else None
    mask is not None and mask.view(-1).__setitem__(0, 1)
    theirs = load_balancing_loss_func((logits,), E, k, mask)
    ours = dk.moe_load_balancing_loss(logits, k, attention_mask=mask)
    ref = moe_load_balancing_loss_ref(logits.detach(), k, mask)
    assert ours.dtype == FP32
    torch.testing.assert_close(ours.double(), ref, rtol=4 * torch.finfo(FP32).eps, atol=0)
    torch.testing.assert_close(ours, theirs, rtol=4 * torch.finfo(FP32).eps, atol=0)
    g_ours, = torch.autograd.grad(ours, logits)
    g_theirs, = torch.autograd.grad(theirs, logits)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-5, atol=1e-7)


def test_tokens_per_expert_and_permutation():
    T, H, E, k = 26, 8, 7, 3
    ids = _ids("invalid", T, E, k)
    assert_equal(dk.moe_tokens_per_expert(ids, E), moe_tokens_per_expert_ref(ids, E), "tokens_per_expert")
    x = torch.randn(T, H, requires_grad=True)
    w = torch.rand(T, k, requires_grad=True)
    permuted, perm = dk.moe_permute(x, ids, E)
    counts = moe_tokens_per_expert_ref(ids, E)
    assert_equal(perm.expert_offsets, torch.cat([torch.zeros(1), counts.cumsum(0)]).int(), "expert_offsets")
    for e in range(E):  # each expert's rows: its tokens, in token order
        rows = slice(int(perm.expert_offsets[e]), int(perm.expert_offsets[e + 1]))
        tok = torch.where((ids == e).any(1))[0]
        assert_equal(permuted[rows].detach(), x.detach()[tok], f"expert {e}'s rows")
    assert_equal(perm.slot_row[perm.row_slot.long()], torch.arange(T * k, dtype=torch.int32), "inverse")
    y = permuted * 2
    out = dk.moe_unpermute(y, perm, w)
    valid = ((ids >= 0) & (ids < E)).float()
    expect = 2 * (w * valid)[..., None].mul(x[:, None]).sum(1)
    torch.testing.assert_close(out, expect)
    gx, gw = torch.autograd.grad(out.square().sum(), (x, w))
    gx2, gw2 = torch.autograd.grad(expect.square().sum(), (x, w))
    torch.testing.assert_close(gx, gx2)
    torch.testing.assert_close(gw, gw2)


@pytest.mark.parametrize("be", BACKENDS)
def test_non_contiguous_inputs(be):
    T, H, I, E, k = 15, 16, 16, 4, 2
    x, gate_up, down = _weights(T, H, I, E, FP32)
    ids, w = _ids("random", T, E, k), torch.rand(T, k)
    with backend(be):
        dense = dk.moe_experts(x, gate_up, down, w, ids)
        views = (x.t().contiguous().t(), gate_up.transpose(1, 2).contiguous().transpose(1, 2),
                 torch.cat([down, down], 2)[..., :I], w.t().contiguous().t(), ids.t().contiguous().t())
        assert not any(v.is_contiguous() for v in views)
        assert_equal(dk.moe_experts(*views), dense, "out")


@pytest.mark.parametrize("be", BACKENDS)
def test_deterministic(be):
    T, H, I, E, k = 20, 16, 16, 4, 2
    x, gate_up, down = _weights(T, H, I, E, BF16)
    ids, w = _ids("skewed", T, E, k), torch.rand(T, k).to(BF16)

    def run():
        leaves = _leaves(x, gate_up, down, w)
        with backend(be):
            out = dk.moe_experts(*leaves, ids)
            return (out,) + torch.autograd.grad(out, leaves, torch.ones_like(out))

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


def test_triton_path_reads_nothing():
    """fused_moe forward + backward, the aux loss and the load metric: 0 host reads on the Triton path."""
    T, H, I, E, k = 16, 16, 16, 4, 2
    x, gate_up, down = _leaves(*_weights(T, H, I, E, BF16))
    logits = torch.randn(T, E, requires_grad=True)
    with backend("triton"), count_host_syncs() as c:
        out = dk.fused_moe(x, logits, gate_up, down, k)
        loss = out.float().square().sum() + 0.01 * dk.moe_load_balancing_loss(logits, k)
        loss.backward()
        ids = dk.moe_route(logits, k)[1]
        dk.moe_tokens_per_expert(ids, E)
        permuted, perm = dk.moe_permute(x, ids, E)
        dk.moe_unpermute(permuted, perm, torch.rand(T, k)).sum().backward()
    assert c.count == 0, c.report()


def _bad(**kw):
    T, H, I, E, k = 4, 8, 4, 3, 2
    a = dict(hidden_states=torch.randn(T, H), gate_up_proj=torch.randn(E, 2 * I, H), down_proj=torch.randn(E, H, I),
             topk_weights=torch.rand(T, k), topk_ids=torch.zeros(T, k, dtype=torch.long))
    a.update(kw)
    return a


@pytest.mark.parametrize("kw,err,match", [
    (dict(hidden_states=torch.randn(4, 8, 1)), ValueError, "hidden_states must be 2-D"),
    (dict(hidden_states=torch.randn(4, 8).double()), ValueError, "hidden_states must have dtype"),
    (dict(hidden_states=[1.0]), TypeError, "hidden_states must be a torch.Tensor"),
    (dict(gate_up_proj=torch.randn(3, 7, 8)), ValueError, r"gate_up_proj must have shape \[E, 2I, H\]"),
    (dict(gate_up_proj=torch.randn(3, 8, 9)), ValueError, "gate_up_proj must have shape"),
    (dict(gate_up_proj=torch.randn(3, 8, 8).half()), ValueError, "gate_up_proj must have dtype"),
    (dict(down_proj=torch.randn(3, 4, 8)), ValueError, "down_proj must have shape"),
    (dict(topk_weights=torch.rand(5, 2)), ValueError, "topk_weights must have shape"),
    (dict(topk_weights=torch.rand(4, 2).long()), ValueError, "topk_weights must have dtype"),
    (dict(topk_ids=torch.zeros(4, 3, dtype=torch.long)), ValueError, "topk_ids must have topk_weights' shape"),
    (dict(topk_ids=torch.zeros(4, 2)), ValueError, "topk_ids must have dtype"),
])
def test_moe_experts_rejects_bad_arguments(kw, err, match):
    with pytest.raises(err, match=match):
        dk.moe_experts(**_bad(**kw))


@pytest.mark.parametrize("call,err,match", [
    (lambda x, lg, gu, dn: dk.fused_moe(x, lg, gu, dn, 4), ValueError, r"top_k must be <= the number of experts \(3\)"),
    (lambda x, lg, gu, dn: dk.fused_moe(x, lg, gu, dn, 0), ValueError, "top_k must be >= 1"),
    (lambda x, lg, gu, dn: dk.fused_moe(x, lg, gu, dn, 2.0), TypeError, "top_k must be an int"),
    (lambda x, lg, gu, dn: dk.fused_moe(x, lg, gu, dn, 2, 1), TypeError, "norm_topk_prob must be a bool"),
    (lambda x, lg, gu, dn: dk.fused_moe(x, lg[:, :2], gu, dn, 2), ValueError,
     r"router_logits must have shape \[T, E\]"),
    (lambda x, lg, gu, dn: dk.fused_moe(x, lg[:3], gu, dn, 2), ValueError, "router_logits must have shape"),
    (lambda x, lg, gu, dn: dk.moe_route(lg[:, :0], 1), ValueError, "router_logits must have at least one expert"),
    (lambda x, lg, gu, dn: dk.moe_load_balancing_loss(lg, 2, torch.ones(5)), ValueError,
     "attention_mask must have T = 4"),
    (lambda x, lg, gu, dn: dk.moe_tokens_per_expert(lg, 3), ValueError, "topk_ids must have dtype"),
    (lambda x, lg, gu, dn: dk.moe_tokens_per_expert(lg.long(), 0), ValueError, "num_experts must be >= 1"),
    (lambda x, lg, gu, dn: dk.moe_unpermute(x, (1, 2, 3), lg[:, :2]), TypeError,
     "permutation must be a MoEPermutation"),
])
def test_fused_moe_and_helpers_reject_bad_arguments(call, err, match):
    a = _bad()
    with pytest.raises(err, match=match):
        call(a["hidden_states"], torch.randn(4, 3), a["gate_up_proj"], a["down_proj"])
