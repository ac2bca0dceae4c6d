"""The trainer on several gloo processes: collectives on the backend's device (checked against a
simulated accelerator), and the rollout split over data-parallel replicas.

The multi-process tests spawn the ranks once per world size and run every scenario of that
size in them (process start-up dominates the cost); each rank writes its results to a file.
"""
from __future__ import annotations

import datetime
import os
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from dapo_trainer.config import load_config
from dapo_trainer.parallel import collective_device, global_mean_scale
from dapo_trainer.trainer import DAPOTrainer
from tests.helpers import spawn_process_group
from tests.trainer.collective_audit import CollectiveAudit
from tests.trainer.tiny import micro_setup

# One step, validation included; the seed is fixed so that every world size draws the same.
RUN = ["trainer.total_training_steps=1", "trainer.seed=7"]
SCENARIOS = {
    "dp2": [],
    "fsdp2": ["actor_rollout_ref.actor.strategy=fsdp2"],
    "tp2": ["actor_rollout_ref.actor.tensor_model_parallel_size=2"],
}


@contextmanager
def _one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_audit_rejects_host_tensors_on_a_simulated_accelerator():
    with _one_rank_group(), CollectiveAudit(simulate="cuda") as audit:
        dist.all_reduce(torch.zeros(2, device=collective_device()))
        dist.all_reduce(torch.ones(3).to(collective_device()) * 2)
        with pytest.raises(AssertionError, match="host tensor"):
            dist.all_reduce(torch.zeros(2))
        with pytest.raises(AssertionError, match="host tensor"):
            dist.all_reduce(torch.zeros(2, device=collective_device()).cpu() + 1)
        # It used to all-reduce a host tensor unless the backend was nccl (hccl forgotten).
        assert global_mean_scale(4) == 0.25
    assert audit.counts()[("", "all_reduce")] == 5


def _run_trainer(overrides) -> dict:
    """One train step and a validation under the audit; what the step generated and trained on."""
    trainer = DAPOTrainer(load_config(overrides=overrides))
    gen_tokens, batches = [], []
    generate, collect = trainer.engine.generate, trainer.collect

    def counting_generate(*args, **kwargs):
        out = generate(*args, **kwargs)
        gen_tokens.append(int(out.lengths.sum()))
        return out

    def keeping_collect(step):
        batch, metrics = collect(step)
        batches.append({k: v.clone() for k, v in batch.items()})
        return batch, metrics

    trainer.engine.generate, trainer.collect = counting_generate, keeping_collect
    micro, plan = [], trainer._plan

    def counting_plan(batch):
        p = plan(batch)
        micro.extend(len(m["micro"]) for m in p)
        return p

    trainer._plan = counting_plan
    with CollectiveAudit(simulate="cuda") as audit:
        if trainer.ddp is not None:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counting_hook(group, bucket):  # DDP's own reduction, counted per bucket
                audit.calls.append((audit.phase, "ddp_bucket"))
                return allreduce_hook(group, bucket)

            trainer.ddp.register_comm_hook(trainer.dp_group, counting_hook)
        audit.phase = "step"
        metrics = trainer.train_step()
        train_tokens = sum(gen_tokens)
        audit.phase = "validate"
        metrics.update(trainer.validate())
    return {"metrics": metrics, "batch": batches[0], "rank_gen_tokens": train_tokens,
            "collectives": dict(audit.counts()), "micro_batches": micro}


def _worker(rank: int, root: str, base: list, scenarios: dict):
    torch.set_num_threads(1)
    results = {name: _run_trainer(base + [f"trainer.default_local_dir={root}/{name}"] + extra)
               for name, extra in scenarios.items()}
    torch.save(results, os.path.join(root, f"rank{rank}.pt"))


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_two_processes_under_simulated_accelerator(tmp_path):
    base = micro_setup(str(tmp_path)) + RUN
    spawn_process_group(_worker, 2, str(tmp_path), base, SCENARIOS, timeout=datetime.timedelta(seconds=300))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for name in SCENARIOS:
        for r, res in enumerate(ranks):
            counts = res[name]["collectives"]
            print(name, "rank", r, "collectives:", counts)
            assert any(phase == "validate" for phase, _ in counts), (name, counts)
            assert res[name]["metrics"]["actor/num_updates"] >= 1
        # DDP: one gradient all-reduce per optimizer update (the tiny model fits DDP's first
        # bucket), although each update accumulates several micro-batches.
        for res in ranks:
            updates, micro = res["dp2"]["metrics"]["actor/num_updates"], res["dp2"]["micro_batches"]
            assert len(micro) == updates and sum(micro) > updates, micro
            assert res["dp2"]["collectives"].get(("step", "ddp_bucket")) == updates
