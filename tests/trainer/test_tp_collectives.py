"""Tensor parallelism communicates as Megatron does: per decoder layer 2 all-reduces in forward
(after o_proj, after down_proj) and 2 in backward (at the attention and MLP inputs), plus the
vocabulary-parallel embedding and log-prob ones, which do not grow with depth.

The collectives of ``torch.distributed`` are wrapped and counted (2 gloo processes) at two
depths: the difference gives the per-layer count, the rest the embedding / log-prob count.
"""
from __future__ import annotations

import os

import pytest
import torch

from dapo_trainer import ModelConfig, Transformer
from dapo_trainer.parallel import parallelize
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


def _counts(depth: int, group) -> dict:
    torch.manual_seed(depth)
    model = Transformer(ModelConfig(**_CFG, num_layers=depth)).init_weights(0.1)
    parallelize(model, group)
    lengths = [5, 3]
    ids = torch.randint(0, _CFG["vocab_size"], (sum(lengths),))
    cu = cu_seqlens_from(lengths)
    with CollectiveAudit() as audit:
        audit.phase = "forward"
        hidden = model(ids, cu, max(lengths))
        audit.phase = "log_probs"
        log_prob, _ = model.log_probs(hidden, torch.roll(ids, -1))
        audit.phase = "backward"
        log_prob.sum().backward()
    return dict(audit.counts())


def _worker(rank: int, out: str):
    torch.set_num_threads(1)
    import torch.distributed as dist

    torch.save({d: _counts(d, dist.group.WORLD) for d in DEPTHS}, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_tp_collectives_per_layer(tmp_path):
    spawn_process_group(_worker, 2, str(tmp_path))
    lo, hi = DEPTHS
    for r in range(2):
        counts = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        keys = set(counts[lo]) | set(counts[hi])
        per_layer = {k: (counts[hi].get(k, 0) - counts[lo].get(k, 0)) // (hi - lo) for k in keys}
        outside = {k: counts[lo].get(k, 0) - lo * per_layer[k] for k in keys}
        print(f"rank {r}: per layer {per_layer}; outside the layers {outside}; raw {counts}")
        assert {k: v for k, v in per_layer.items() if v} == PER_LAYER
        assert {k: v for k, v in outside.items() if v} == OUTSIDE_LAYERS
        # Linear in depth: no count depends on it otherwise.
        assert all(counts[hi].get(k, 0) - counts[lo].get(k, 0) == (hi - lo) * per_layer[k] for k in keys)
