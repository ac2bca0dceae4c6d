"""Tensor parallelism communicates as Megatron does: per decoder layer 2 all-reduces in forward
(after o_proj, after down_proj) and 2 in backward (at the attention and MLP inputs), plus the
vocabulary-parallel embedding and log-prob ones, which do not grow with depth. With per-head q/k norms
(Qwen3, Gemma 3) the same, plus one all-reduce per update whatever the depth: ``tp_grad_sync`` of
the norms' partial gradients.

The collectives of ``torch.distributed`` are wrapped and counted (2 gloo processes) at two
depths: the difference gives the per-layer count, the rest the embedding / log-prob count; the
tensors they get are checked against a simulated accelerator (NCCL takes no host tensor).
"""
from __future__ import annotations

import os

import pytest
import torch

from dapo_trainer import ModelConfig, Transformer
from dapo_trainer.parallel import parallelize, tp_grad_sync
from tests.helpers import cu_seqlens_from, spawn_process_group
from tests.trainer.collective_audit import CollectiveAudit

DEPTHS = (1, 3)
_CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=16,
            qkv_bias=True, mlp_bias=True)
# Per layer (Megatron): forward all-reduces after o_proj and down_proj; backward all-reduces of
# the attention and MLP input gradients (shared by q/k/v and by gate/up).
PER_LAYER = {("forward", "all_reduce"): 2, ("backward", "all_reduce"): 2}
# Depth-independent: the vocab-parallel embedding's forward all-reduce; the vocab-parallel
# log-softmax's forward all-reduces of its row statistics (max, then sums) and backward
# all-reduce of the hidden-state gradient (the lm_head's column-parallel input); the embedding's
# backward is local.
OUTSIDE_LAYERS = {("forward", "all_reduce"): 1, ("log_probs", "all_reduce"): 2, ("backward", "all_reduce"): 1}
# Per update, whatever the depth: the q/k norms' partial gradients, all in one all-reduce.
QK_NORM_SYNC = {("grad_sync", "all_reduce"): 1}
FAMILIES = {"llama": {}, "qwen3": dict(qk_norm=True, model_type="qwen3")}


def _counts(depth: int, group, family: dict) -> dict:
    torch.manual_seed(depth)
    model = Transformer(ModelConfig(**_CFG, num_layers=depth, **family)).init_weights(0.1)
    parallelize(model, group)
    lengths = [5, 3]
    ids = torch.randint(0, _CFG["vocab_size"], (sum(lengths),))
    cu = cu_seqlens_from(lengths)
    with CollectiveAudit(simulate="cuda") as audit:
        audit.phase = "forward"
        hidden = model(ids, cu, max(lengths))
        audit.phase = "log_probs"
        log_prob, _ = model.log_probs(hidden, torch.roll(ids, -1))
        audit.phase = "backward"
        log_prob.sum().backward()
        audit.phase = "grad_sync"
        tp_grad_sync(model)
    return dict(audit.counts())


def _worker(rank: int, out: str):
    torch.set_num_threads(1)
    import torch.distributed as dist

    torch.save({(f, d): _counts(d, dist.group.WORLD, kw) for f, kw in FAMILIES.items() for d in DEPTHS},
               os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_tp_collectives_per_layer(tmp_path):
    spawn_process_group(_worker, 2, str(tmp_path))
    lo, hi = DEPTHS
    for r, family in ((r, f) for r in range(2) for f in FAMILIES):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        counts = {d: res[(family, d)] for d in DEPTHS}
        keys = set(counts[lo]) | set(counts[hi])
        per_layer = {k: (counts[hi].get(k, 0) - counts[lo].get(k, 0)) // (hi - lo) for k in keys}
        outside = {k: counts[lo].get(k, 0) - lo * per_layer[k] for k in keys}
        print(f"rank {r} {family}: per layer {per_layer}; outside the layers {outside}; raw {counts}")
        assert {k: v for k, v in per_layer.items() if v} == PER_LAYER
        want = {**OUTSIDE_LAYERS, **(QK_NORM_SYNC if FAMILIES[family].get("qk_norm") else {})}
        assert {k: v for k, v in outside.items() if v} == want
        # Linear in depth: no count depends on it otherwise.
        assert all(counts[hi].get(k, 0) - counts[lo].get(k, 0) == (hi - lo) * per_layer[k] for k in keys)
