"""The MoE block on the CPU: ``dk.fused_moe`` (torch path) vs transformers' Qwen3-MoE expert loop.

    pytest benchmarks/bench_moe.py -s -p no:xdist        (or: python benchmarks/bench_moe.py)

Qwen3-30B-A3B's routing (128 experts, 8 per token, renormalised top-k) with its hidden / expert widths
scaled down 8x (H = 256, I = 96) so the 2 shared cores finish: T tokens, float32, forward + backward
of ``Qwen3MoeSparseMoeBlock`` (router linear, ``Qwen3MoeTopKRouter``, ``Qwen3MoeExperts``' loop over
the experts hit) against the same router linear + ``dk.fused_moe`` on the same weights: equal work,
same routing, same gradients (checked close before timing). The variants alternate within each
round (load on the machine hits them alike); the best of ROUNDS is reported, with the host reads of one
step counted by tests/sync_counter.py (each a device sync on a GPU: transformers' loop reads the experts
hit, then per expert one ``nonzero`` and one comparison with ``num_experts``; the torch path reads the
largest count and the valid rows once, its padded batch's shape, and the router's ``topk`` nothing).

Where transformers' time goes: besides the per-expert launches and reads, its backward of
``self.gate_up_proj[expert_idx]`` / ``self.down_proj[expert_idx]`` (indexing a 3-D parameter) makes a
zero ``[E, 2I, H]`` / ``[E, H, I]`` gradient per expert hit and adds it up: ``E`` passes over both
weights' size per step, the same at every T (hence its flat time), and the larger the model the worse.
``dk.fused_moe``'s torch path runs each matmul as one ``bmm`` over the experts padded to the largest
count (measured at ~29 GFLOP/s, as a plain ``mm`` of the same size on this CPU's one thread).

Measured (2 shared AMD EPYC cores, one thread; best of 5):

| T | transformers ms | host reads | dk.fused_moe ms | host reads | speedup |
|---|---|---|---|---|---|
| 256 | 1701.8 | 643 | 86.9 | 1 | 19.6x |
| 1024 | 1658.7 | 643 | 408.2 | 1 | 4.1x |
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import dapo_kernels as dk
from tests.sync_counter import count_host_syncs

E, K, H, I = 128, 8, 256, 96
TOKENS = (256, 1024)
ROUNDS = 5


def _block(seed: int = 0):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                         norm_topk_prob=True, hidden_act="silu", num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=32)
    block = Qwen3MoeSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return block


def _transformers_step(block, h, dout):
    out = block(h)
    out.backward(dout)
    return out


def _dk_step(block, h, dout):
    x = h.view(-1, H)
    out = dk.fused_moe(x, F.linear(x, block.gate.weight), block.experts.gate_up_proj, block.experts.down_proj, K,
                       True).view(h.shape)
    out.backward(dout)
    return out


STEPS = {"transformers Qwen3MoeSparseMoeBlock": _transformers_step, "dk.fused_moe (torch path)": _dk_step}


def _grads(block, h):
    return [h.grad] + [p.grad for p in block.parameters()]


def measure(T: int, rounds: int = ROUNDS) -> dict:
    """{variant: (best seconds of a forward + backward, host reads of one step)}."""
    block = _block()
    h = torch.randn(1, T, H, requires_grad=True)
    dout = torch.randn(1, T, H)
    grads, reads = {}, {}
    for name, step in STEPS.items():
        block.zero_grad()
        h.grad = None
        with dk.use_backend("torch"), count_host_syncs() as c:
            step(block, h, dout)
        reads[name] = c.count
        grads[name] = [g.clone() for g in _grads(block, h)]
    for a, b in zip(*grads.values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    best = {name: float("inf") for name in STEPS}
    with dk.use_backend("torch"):
        for _ in range(rounds):
            for name, step in STEPS.items():
                block.zero_grad()
                h.grad = None
                t0 = time.perf_counter()
                step(block, h, dout)
                best[name] = min(best[name], time.perf_counter() - t0)
    return {name: (best[name], reads[name]) for name in STEPS}


def table(T: int, res: dict) -> str:
    base = res["transformers Qwen3MoeSparseMoeBlock"][0]
    lines = [f"MoE block fwd+bwd, T={T}, E={E}, k={K}, H={H}, I={I}, fp32, {torch.get_num_threads()} thread(s)",
             "| variant | ms | host reads | speedup |", "|---|---|---|---|"]
    for name, (sec, reads) in res.items():
        lines.append(f"| {name} | {sec * 1e3:.1f} | {reads} | {base / sec:.2f}x |")
    return "\n".join(lines)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # the 2 CPU cores are shared: one thread measures the work
    yield
    torch.set_num_threads(prev)


@pytest.mark.parametrize("T", TOKENS, ids=[f"T{t}" for t in TOKENS])
def test_moe_block_cpu(T):
    pytest.importorskip("transformers")
    res = measure(T)
    print("\n" + table(T, res))
    assert res["dk.fused_moe (torch path)"][1] <= 1, "the torch path reads the largest count, once"


if __name__ == "__main__":
    torch.set_num_threads(1)
    for T in TOKENS:
        print(table(T, measure(T)) + "\n")
