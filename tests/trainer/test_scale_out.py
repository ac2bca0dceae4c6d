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
RUN = ["trainer.total_training_steps=1", "trainer.seed=7", "data.gen_batch_size=4"]
SCENARIOS = {
    "dp2": [],
    "fsdp2": ["actor_rollout_ref.actor.strategy=fsdp2"],
    "tp2": ["actor_rollout_ref.actor.tensor_model_parallel_size=2"],
    "sp2": ["actor_rollout_ref.actor.sp_size=2"],
}
SCENARIOS_4 = {
    "dp4": [],
    "tp2xfsdp2": ["actor_rollout_ref.actor.tensor_model_parallel_size=2", "actor_rollout_ref.actor.strategy=fsdp2"],
    "sp2xfsdp2": ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "actor_rollout_ref.actor.strategy=fsdp2",
                  "actor_rollout_ref.model.enable_gradient_checkpointing=true",
                  "actor_rollout_ref.model.enable_activation_offload=true"],
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
        # On any accelerator backend (not only nccl) the scale is all-reduced as a device tensor.
        assert global_mean_scale(4) == 0.25
    assert audit.counts()[("", "all_reduce")] == 5


def _run_trainer(overrides) -> dict:
    """One train step and a validation under the audit; what the step generated and trained on."""
    trainer = DAPOTrainer(load_config(overrides=overrides))
    gen_tokens, batches = [], []
    generate, collect = trainer.engine.generate, trainer.generation.collect

    def counting_generate(*args, **kwargs):
        out = generate(*args, **kwargs)
        gen_tokens.append(int(out.lengths.sum()))
        return out

    def keeping_collect(step):
        batch, metrics = collect(step)
        batches.append({k: v.clone() for k, v in batch.tensors().items()})
        return batch, metrics

    trainer.engine.generate, trainer.generation.collect = counting_generate, keeping_collect
    micro, plan = [], trainer.actor.plan

    def counting_plan(batch):
        p = plan(batch)
        micro.extend(len(m.micro) for m in p)
        return p

    trainer.actor.plan = counting_plan
    with CollectiveAudit(simulate="cuda") as audit:
        if trainer.actor.ddp is not None:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counting_hook(group, bucket):  # DDP's own reduction, counted per bucket
                audit.calls.append((audit.phase, "ddp_bucket"))
                return allreduce_hook(group, bucket)

            trainer.actor.ddp.register_comm_hook(trainer.dims.grad_group, counting_hook)
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


# Decided by the batch alone: equal on any number of processes.
EXACT = ("critic/rewards/mean", "critic/advantages/mean", "acc/mean", "response_length/mean", "train/kept_groups",
         "train/num_gen_batches", "train/gen_tokens", "actor/num_updates")
# Reductions in another order (DP sums, TP partial sums, sharded norms): fp32 noise, at most a few
# ulps of the mini-batch's sums (the bound for parallel vs single process: 1e-5 relative).
CLOSE = ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac")
RTOL, ATOL = 1e-5, 1e-7
LOG_PROB_ATOL = 1e-5


def _compare(single: dict, ranks: list, scenarios: dict, tp_of: dict) -> list:
    """Failures of the parallel runs against the single-process one; prints the equality table."""
    failures, lines = [], []
    ref_tokens = single["rank_gen_tokens"]
    for name in scenarios:
        tp = tp_of[name]
        per_replica = [ranks[r][name]["rank_gen_tokens"] for r in range(0, len(ranks), tp)]
        worst = 0.0
        for r, res in enumerate(ranks):
            for key, t in single["batch"].items():
                got = res[name]["batch"][key]
                # The sampler's log-probs come from batches of another size: fp32 rounding apart
                # (on this model they come out bitwise equal); everything else must be equal.
                same = (got.shape == t.shape and (got - t).abs().max() <= LOG_PROB_ATOL) \
                    if key == "log_probs" else torch.equal(got, t)
                if not same:
                    failures.append(f"{name} rank {r}: train batch {key!r} differs from 1 process")
            m = res[name]["metrics"]
            for key in EXACT:
                if m[key] != single["metrics"][key]:
                    failures.append(f"{name} rank {r}: {key} {m[key]} != {single['metrics'][key]}")
            for key in CLOSE:
                err = abs(m[key] - single["metrics"][key])
                worst = max(worst, err / max(abs(single["metrics"][key]), ATOL / RTOL))
                if err > RTOL * abs(single["metrics"][key]) + ATOL:
                    failures.append(f"{name} rank {r}: {key} {m[key]} vs {single['metrics'][key]}")
            if res[name]["rank_gen_tokens"] != per_replica[r // tp]:
                failures.append(f"{name} rank {r}: TP ranks of one replica sampled different shares")
            if m["train/local_response_tokens"] != res[name]["rank_gen_tokens"]:
                failures.append(f"{name} rank {r}: train/local_response_tokens is not what the engine sampled")
        if sum(per_replica) != ref_tokens or min(per_replica) == 0:
            failures.append(f"{name}: replicas sampled {per_replica} response tokens, 1 process {ref_tokens}")
        lines.append(f"{name:10s} {len(ranks)} procs  batch identical: "
                     f"{not any(f.startswith(name + ' ') and 'batch' in f for f in failures)}  "
                     f"worst rel diff of {'/'.join(k.split('/')[1] for k in CLOSE)}: {worst:.1e}  "
                     f"response tokens per replica {per_replica} (1 process: {ref_tokens})")
    print("\n".join(lines))
    return failures


def _spawn_and_compare(tmp_path, world: int, scenarios: dict) -> None:
    base = micro_setup(str(tmp_path)) + RUN
    single = _run_trainer(base + [f"trainer.default_local_dir={tmp_path}/single"])
    spawn_process_group(_worker, world, str(tmp_path), base, scenarios, timeout=datetime.timedelta(seconds=300))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    # Ranks per replica (a TP group): they sample the same share (SP ranks each hold a replica: their own share).
    group_keys = ("tensor_model_parallel_size",)
    tp_of = {name: 2 if any(o.split("=")[0].endswith(group_keys) and o.endswith("=2") for o in extra) else 1
             for name, extra in scenarios.items()}
    failures = _compare(single, ranks, scenarios, tp_of)
    for name in scenarios:
        for r, res in enumerate(ranks):
            counts = res[name]["collectives"]
            print(name, "rank", r, "collectives:", counts)
            # Validation is split over the DP replicas: reduced when there are several (TP-sharded
            # sampling has collectives of its own; an SP group's ranks validate the same rows alone).
            if len(ranks) // tp_of[name] > 1:
                assert any(phase == "validate" for phase, _ in counts), (name, counts)
            # Sequence parallel: the Ulysses all-to-alls ran in the step (and only there).
            assert any(c == "all_to_all_single" for _, c in counts) == name.startswith("sp"), (name, counts)
    assert not failures, "\n".join(failures)


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_two_processes_equal_one_under_simulated_accelerator(tmp_path):
    """DP=2 (DDP), DP=2 (FSDP2), TP=2, SP=2 (DDP over the SP ranks): first step's batch and metrics
    equal one process's."""
    _spawn_and_compare(tmp_path, 2, SCENARIOS)
    # DDP: one gradient all-reduce per optimizer update (the tiny model fits DDP's first
    # bucket), although each update accumulates several micro-batches.
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)["dp2"]
        updates, micro = res["metrics"]["actor/num_updates"], res["micro_batches"]
        assert len(micro) == updates and sum(micro) > updates, micro
        assert res["collectives"].get(("step", "ddp_bucket")) == updates


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_four_processes_equal_one(tmp_path):
    """DP=4 (DDP), TP=2 x DP=2 (FSDP2 on the 2-D mesh) and SP=2 x DP=2 (FSDP2 over all ranks,
    checkpointing with activation offload): first step equal to one process."""
    _spawn_and_compare(tmp_path, 4, SCENARIOS_4)


def _construct_worker(rank: int, root: str, base: list, cases: dict):
    """Build a trainer per case; record the error message, or None when it was accepted."""
    torch.set_num_threads(1)
    out = {}
    for name, extra in cases.items():
        try:
            DAPOTrainer(load_config(overrides=base + [f"trainer.default_local_dir={root}/{name}"] + extra))
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    torch.save(out, os.path.join(root, f"construct{rank}.pt"))


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_more_dp_ranks_than_mini_batch_rows_rejected_at_start(tmp_path):
    """ppo_mini_batch_size x rollout.n < DP would leave a rank without a micro-batch (its peers then
    wait in DDP's all-reduce): the trainer refuses at construction, naming the keys."""
    base = micro_setup(str(tmp_path)) + ["data.train_batch_size=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1"]
    cases = {"too_few": ["actor_rollout_ref.rollout.n=1"],                 # 1 row, DP 2
             "enough": ["actor_rollout_ref.rollout.n=2"],                  # 2 rows, DP 2
             "tp2": ["actor_rollout_ref.rollout.n=1",                      # 1 row, DP 1
                     "actor_rollout_ref.actor.tensor_model_parallel_size=2"]}
    spawn_process_group(_construct_worker, 2, str(tmp_path), base, cases, timeout=datetime.timedelta(seconds=120))
    for r in range(2):
        got = torch.load(tmp_path / f"construct{r}.pt")
        assert got["enough"] is None and got["tp2"] is None, got
        msg = got["too_few"]
        assert msg is not None, "2 DP ranks with 1 row per mini-batch were accepted"
        for key in ("actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.rollout.n", "data-parallel"):
            assert key in msg, msg
