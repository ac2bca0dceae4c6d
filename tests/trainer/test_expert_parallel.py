"""Expert parallelism at the block level (2 gloo processes): a Qwen3-MoE model's experts split over the
ranks, each rank's own tokens dispatched by all-to-all, equal the unsharded model run on both ranks'
tokens together, output and gradients; the collectives are counted and their tensors checked against a
simulated accelerator (NCCL takes no host tensor).

Rank 1 replays a routing that sends every choice to expert 0 (rank 0's), twice per token: nothing goes
from rank 1 to itself, rank 1's experts see only rank 0's tokens, and a token picks one expert twice.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from dapo_trainer import ModelConfig, Transformer
from dapo_trainer.parallel import apply_expert_parallel, expert_shard_names
from tests.helpers import spawn_process_group
from tests.trainer.collective_audit import CollectiveAudit

CFG = dict(model_type="qwen3_moe", qk_norm=True, vocab_size=64, hidden_size=32, intermediate_size=48, num_heads=4,
           num_kv_heads=2, head_dim=16, num_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           norm_topk_prob=True)
TOKENS = (7, 5)  # rank r's token count
# Per sparse layer forward: the counts, the rows, their expert ids, the outputs back; backward: the
# outputs' and the rows' gradients, each the reverse exchange.
PER_LAYER = {("forward", "all_to_all_single"): 4, ("backward", "all_to_all_single"): 2}
RTOL = 1e-5  # of the tensor's largest entry: fp32 sums in another order


def _inputs(rank: int):
    dev = torch.device("cpu")  # a device tensor for the audit (module doc of collective_audit)
    x = torch.randn(TOKENS[rank], CFG["hidden_size"], generator=torch.Generator().manual_seed(rank), device=dev)
    replay = torch.full((TOKENS[rank], 2), 0 if rank else -1, dtype=torch.long, device=dev)
    return x, replay


def _worker(rank: int, out: str):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ref = Transformer(ModelConfig(**CFG)).init_weights(0.1)
    model = Transformer(ModelConfig(**CFG))
    model.load_state_dict(ref.state_dict())
    apply_expert_parallel(model, dist.group.WORLD)
    block, ref_block = model.sparse_blocks()[0], ref.sparse_blocks()[0]
    x, replay = _inputs(rank)
    x.requires_grad_(True)
    block.replay = replay
    with CollectiveAudit(simulate="cuda") as audit:
        audit.phase = "forward"
        y = block(x)
        audit.phase = "backward"
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    # One process: both ranks' tokens (each with its replay) through the whole block.
    xs, replays = zip(*(_inputs(r) for r in range(2)))
    x_all = torch.cat(xs).requires_grad_(True)
    ref_block.replay = torch.cat(replays)
    y_all = ref_block(x_all)
    sum((yr * torch.linspace(-1, 1, yr.numel()).view_as(yr)).sum() for yr in y_all.split(TOKENS)).backward()
    grads = {}
    shards = expert_shard_names(model)
    for name, p in model.named_parameters():
        if p.grad is None:  # outside the block
            continue
        g = p.grad.clone()
        if name in shards:  # the owner's gradient, scaled by 1/EP for the DP average (expert.py)
            g = g * 2
        else:  # this rank's part of a replicated weight's gradient: DDP would sum (average) them
            dist.all_reduce(g)
        grads[name] = g
    torch.save({"y": y.detach(), "y_ref": y_all.detach().split(TOKENS)[rank], "dx": x.grad,
                "dx_ref": x_all.grad.split(TOKENS)[rank], "grads": grads, "counts": dict(audit.counts()),
                "ref_grads": {n: p.grad for n, p in ref.named_parameters() if p.grad is not None},
                "shards": shards, "rows": block.experts.gate_up_proj.shape[0]},
               os.path.join(out, f"rank{rank}.pt"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_expert_parallel_block_equals_one_process_and_communicates_per_layer(tmp_path):
    spawn_process_group(_worker, 2, str(tmp_path))
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert {k: v for k, v in res["counts"].items() if v} == PER_LAYER, res["counts"]
        assert res["rows"] == CFG["num_experts"] // 2 and res["shards"]
        worst = {"y": _rel(res["y"], res["y_ref"]), "dx": _rel(res["dx"], res["dx_ref"])}
        for name, g in res["grads"].items():
            ref = res["ref_grads"][name]
            if name in res["shards"]:
                rows = g.shape[0]
                ref = ref[r * rows:(r + 1) * rows]
            assert g.abs().max() > 0 or ref.abs().max() == 0, name
            worst[name] = _rel(g, ref)
        print(f"rank {r}: worst relative difference {max(worst.values()):.1e}", worst)
        assert max(worst.values()) <= RTOL, worst


def _ckpt_worker(rank: int, root: str, base: list):
    from dapo_trainer.config import load_config
    from dapo_trainer.hf_io import load_hf_model
    from dapo_trainer.trainer import DAPOTrainer

    torch.set_num_threads(1)
    ep = ["actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"]
    trainer = DAPOTrainer(load_config(overrides=base + ep))
    trainer.train_step()
    path = trainer.save()
    full = {k: v.detach().clone() for k, v in trainer.full_state().items()}
    del trainer
    saved = load_hf_model(os.path.join(path, "model")).state_dict()
    resumed = DAPOTrainer(load_config(overrides=base + ep + ["trainer.total_training_steps=2"]))
    mine = {n: p.detach().clone() for n, p in resumed.model.named_parameters()}
    shards = expert_shard_names(resumed.model)
    del resumed
    try:  # the same checkpoint at EP=1 (DP=2 still): per-rank optimiser state of another layout
        DAPOTrainer(load_config(overrides=base + ["trainer.total_training_steps=2"]))
        refusal = None
    except ValueError as e:
        refusal = str(e)
    torch.save({"full": full, "saved": saved, "mine": mine, "shards": shards, "refusal": refusal},
               os.path.join(root, f"ckpt{rank}.pt"))


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_expert_parallel_checkpoint_is_layout_free_and_resume_needs_the_saved_ep(tmp_path):
    """A checkpoint saved at EP=2 holds every expert (the gathered state, as one process saves it); a
    resume at EP=2 gives each rank its slice of it; a resume at EP=1 is refused naming both layouts."""
    from tests.trainer.test_families_parallel import write_family_model
    from tests.trainer.test_pipeline import RUN
    from tests.trainer.tiny import micro_setup

    root = str(tmp_path)
    base = micro_setup(root) + RUN + [f"actor_rollout_ref.model.path={write_family_model(root + '/moe', 'qwen3-moe')}"]
    spawn_process_group(_ckpt_worker, 2, root, base)
    for r in range(2):
        res = torch.load(tmp_path / f"ckpt{r}.pt", weights_only=False)
        assert set(res["saved"]) == set(res["full"]) and res["shards"]
        for k, v in res["full"].items():
            assert torch.equal(res["saved"][k], v), k
        for name, p in res["mine"].items():
            want = res["saved"][name]
            if name in res["shards"]:
                assert want.shape[0] == 2 * p.shape[0], name
                want = want[r * p.shape[0]:(r + 1) * p.shape[0]]
            assert torch.equal(p, want), name
        msg = res["refusal"]
        assert msg is not None and "SP=1 x EP=2; this run has 2 processes" in msg and "EP=1" in msg, msg
