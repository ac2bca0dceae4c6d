"""Pipeline parallelism (actor.pipeline_model_parallel_size) on gloo CPU processes.

A 4-layer tiny model; one trainer step at PP=2 (1F1B), PP=2 x 2 virtual stages (interleaved
1F1B), PP=2 with the KL loss and two epochs (old and reference log-probs through forward-only
pipelines), and at 4 processes PP=2 x DP=2 (DDP per stage, and FSDP2), PP=2 x TP=2 and tied
embeddings at PP=2 x DP=2: the train batch equal to one process's, the metrics and the updated
weights (which carry the gradients: one AdamW step from the same state) equal within fp32
reduction noise. Every rank holds a sampling replica and samples its own share. PP=2 and
PP=2 x DP=2 also train CURVE_STEPS steps: every step's metrics equal one process's (CURVE_ATOL).
"""
from __future__ import annotations

import datetime
import json
import os

import pytest
import torch

from dapo_trainer.config import load_config
from dapo_trainer.parallel import (expert_parallel_group, expert_shard_names, tensor_parallel_group, tp_shard_dims,
                                   unshard)
from dapo_trainer.parallel.expert import unshard_experts
from dapo_trainer.hf_io import load_hf_model
from dapo_trainer.parallel.pipeline import split_model, stage_keep, stage_layers
from dapo_trainer.memory_model import stage_params
from dapo_trainer.trainer import DAPOTrainer
from tests.helpers import spawn_process_group
from tests.trainer.tiny import micro_setup, write_tiny_model

RUN = ["trainer.total_training_steps=1", "trainer.seed=7", "data.gen_batch_size=4", "trainer.save_freq=-1",
       "trainer.test_freq=-1", "data.val_files=[]"]
PP = ["actor_rollout_ref.actor.pipeline_model_parallel_size=2"]
KL = ["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.ppo_epochs=2"]
SCENARIOS_2 = {
    "pp2": PP,
    "pp2v2": PP + ["actor_rollout_ref.actor.virtual_pipeline_model_parallel_size=2"],
    "pp2_kl": PP + KL,
    # Fixed-size micro-batches: one of all 8 rows without PP, re-split into one per stage under PP.
    "pp2_fixed": PP + ["actor_rollout_ref.actor.use_dynamic_bsz=false",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"],
}
SCENARIOS_4 = {
    "pp2xdp2": PP,
    "pp2xfsdp2": PP + ["actor_rollout_ref.actor.strategy=fsdp2"],
    "pp2xtp2": PP + ["actor_rollout_ref.actor.tensor_model_parallel_size=2"],
}
EXACT = ("critic/rewards/mean", "acc/mean", "response_length/mean", "train/gen_tokens", "actor/num_updates")
CLOSE = ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac")
RTOL, ATOL = 1e-5, 1e-7
# Mixture-of-experts models' router load: sums over every token, whatever the layout (PP logs none).
MOE_LOAD = ("actor/moe_load_max", "actor/moe_load_min", "actor/moe_idle_experts")
# Adam's first step is lr * g / (|g| + eps): an entry whose gradient is at the noise floor moves by a
# fraction of lr (seen: 3e-5 under TP) although the gradients agree to 1e-6; those are compared directly.
WEIGHT_ATOL = 1e-4
GRAD_RTOL = 1e-5  # of the parameter's largest gradient entry: fp32 sums in another order (micro-batch padding)
CURVE_STEPS = 3
# Per step of a curve: what depends on the micro-batch layout or the clock, not on the model.
LAYOUT_KEYS = ("actor/num_micro_batches", "actor/micro_batch_utilization", "train/local_response_tokens")
# The float metrics are means of O(1) per-token terms (ratio x advantage, entropy, log-ratio) summed in
# another order; the loss and ppo_kl nearly cancel (advantages centred), so the bound is absolute:
# 16 fp32 roundings (2^-24 each) of O(1) terms, plus RTOL for the accumulated drift of the weights
# (per-step updates equal to ~1e-7 relative, the demo's 10 steps drift to 3e-6 relative in grad_norm).
CURVE_ATOL = 16 * 2.0 ** -24


def _setup(root: str, *, tied: bool = False) -> list:
    base = micro_setup(root) + RUN
    write_tiny_model(os.path.join(root, "model"), layers=4)
    if tied:
        cfg_path = os.path.join(root, "model", "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg["tie_word_embeddings"] = True
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
    return base


def _run(overrides) -> dict:
    trainer = DAPOTrainer(load_config(overrides=overrides))
    batches = []
    collect = trainer.generation.collect

    def keeping_collect(step):
        batch, metrics = collect(step)
        batches.append({k: v.clone() for k, v in batch.tensors().items()})
        return batch, metrics

    trainer.generation.collect = keeping_collect
    initial = {k: v.detach().clone() for k, v in trainer.full_state().items()}
    metrics = trainer.train_step()
    weights = {k: v.detach().clone() for k, v in trainer.full_state().items()}
    # This rank's gradients after the step's last backward (clipped), unsharded over TP / FSDP2 / EP
    # (each rank's expert slice gathered, so every slice is compared with one process's).
    model, shard_dims, tp_group = trainer.model, tp_shard_dims(trainer.model), tensor_parallel_group(trainer.model)
    experts, ep_group = expert_shard_names(model), expert_parallel_group(model)
    grads = {n: (unshard_experts(p.grad, ep_group) if n in experts else unshard(p.grad, shard_dims.get(n), tp_group))
             .clone() for n, p in model.named_parameters()}
    # The sampling replica (PP, SP) refreshed after the update; None where the engine samples from the
    # training model itself (TP, DP).
    replica = (None if trainer.rollout_model is trainer.model else
               {k: v.detach().clone() for k, v in trainer.rollout_model.state_dict().items()})
    return {"metrics": metrics, "batch": batches[0], "weights": weights, "initial": initial, "grads": grads,
            "replica": replica, "pp": trainer.actor.dims.pp}


def _fit_curve(overrides) -> list:
    """CURVE_STEPS steps of ``fit``; the rows of its metrics.jsonl (rank 0 writes them)."""
    from dapo_trainer.metrics import read_metrics

    trainer = DAPOTrainer(load_config(overrides=overrides + [f"trainer.total_training_steps={CURVE_STEPS}"]))
    trainer.fit()
    return read_metrics(trainer.run_dir)


def _worker(rank: int, root: str, base: list, scenarios: dict, curves: dict, refusals: dict):
    torch.set_num_threads(1)
    out = {name: _run(base + [f"trainer.default_local_dir={root}/{name}"] + extra) for name, extra in scenarios.items()}
    out["curves"] = {name: _fit_curve(base + [f"trainer.default_local_dir={root}/{name}"] + extra)
                     for name, extra in curves.items()}
    out["refusals"] = {}
    for name, extra in refusals.items():  # layouts refused at start-up: the message (None: accepted)
        try:
            DAPOTrainer(load_config(overrides=base + [f"trainer.default_local_dir={root}/{name}"] + extra))
            out["refusals"][name] = None
        except ValueError as e:
            out["refusals"][name] = str(e)
    torch.save(out, os.path.join(root, f"rank{rank}.pt"))


def _compare_curve(single: list, got: list, name: str) -> list:
    """Every step's metrics: sampling, rewards and counts equal; the update's (actor/*) within
    RTOL + CURVE_ATOL."""
    fails, worst = [], 0.0
    if [r["step"] for r in got] != [r["step"] for r in single] or len(single) != CURVE_STEPS:
        return [f"{name}: steps {[r['step'] for r in got]} vs {[r['step'] for r in single]}"]
    for ref, row in zip(single, got):
        keys = [k for k in ref if not k.startswith(("timing_s/", "perf/")) and k not in LAYOUT_KEYS]
        if set(keys) - set(row):
            fails.append(f"{name} step {ref['step']}: metrics {sorted(set(keys) - set(row))} missing")
        for k in set(keys) & set(row):
            a, b = ref[k], row[k]
            if not k.startswith("actor/") or k in EXACT or k == "actor/lr":  # sampling, rewards, counts
                ok = a == b
            else:  # the model's numerics
                worst = max(worst, abs(a - b) / (RTOL * abs(a) + CURVE_ATOL))
                ok = abs(a - b) <= RTOL * abs(a) + CURVE_ATOL
            if not ok:
                fails.append(f"{name} step {ref['step']}: {k} {b} vs {a}")
    print(f"{name:10s} {CURVE_STEPS}-step curve: worst float difference {worst:.2e} of the bound")
    return fails


def _compare(single: dict, got: dict, name: str) -> list:
    fails = []
    for key, t in single["batch"].items():
        g = got["batch"][key]
        ok = g.shape == t.shape and ((g - t).abs().max() <= 1e-5 if key == "log_probs" else torch.equal(g, t))
        if not ok:
            fails.append(f"{name}: train batch {key!r} differs from 1 process")
    m, ref = got["metrics"], single["metrics"]
    for key in EXACT:
        if m[key] != ref[key]:
            fails.append(f"{name}: {key} {m[key]} != {ref[key]}")
    for key in (k for k in MOE_LOAD if k in ref):
        if key not in m and got["pp"] == 1:
            fails.append(f"{name}: {key} missing")
        elif key in m and abs(m[key] - ref[key]) > RTOL * abs(ref[key]) + ATOL:
            fails.append(f"{name}: {key} {m[key]} vs {ref[key]}")
    for key in CLOSE + (("actor/kl_loss",) if "actor/kl_loss" in ref else ()):
        if abs(m[key] - ref[key]) > RTOL * abs(ref[key]) + ATOL:
            fails.append(f"{name}: {key} {m[key]} vs {ref[key]}")
    if set(got["weights"]) != set(single["weights"]):
        fails.append(f"{name}: parameter names {sorted(set(got['weights']) ^ set(single['weights']))} differ")
    worst = max((got["weights"][k] - v).abs().max().item() for k, v in single["weights"].items()
                if k in got["weights"])
    moved = max((v - single["initial"][k]).abs().max().item() for k, v in single["weights"].items())
    if worst > WEIGHT_ATOL:
        fails.append(f"{name}: updated weights differ by {worst:.2e} (the update moved them by {moved:.2e})")
    replica_err = max(((got["replica"][k] - single["weights"][k]).abs().max().item() for k in got["replica"] or ()),
                      default=0.0)
    if replica_err > WEIGHT_ATOL:
        fails.append(f"{name}: the sampling replica differs from the updated weights by {replica_err:.2e}")
    print(f"{name:10s} worst weight diff {worst:.1e} (update {moved:.1e}), grad_norm {m['actor/grad_norm']:.6g} "
          f"vs {ref['actor/grad_norm']:.6g}")
    return fails


def _spawn_and_compare(tmp_path, world: int, scenarios: dict, *, tied: bool = False, curves=None, refusals=None,
                       setup=_setup) -> list:
    """Every scenario (extra overrides) on ``world`` processes against one process (the same overrides
    but the layout's); ``refusals``: overrides whose trainer is only built, on every rank. Returns each
    rank's ``{refusal name: error message or None}``."""
    base = setup(str(tmp_path), tied=tied)
    curves = curves or {}
    layout = ("pipeline_model_parallel_size", "tensor_model_parallel_size", "strategy",  # not in the 1-process run
              "ulysses_sequence_parallel_size", "expert_model_parallel_size")
    extra_single = {name: [o for o in extra if not o.split("=")[0].endswith(layout)]
                    for name, extra in scenarios.items()}
    singles = {}
    for name, extra in extra_single.items():
        key = tuple(extra)
        if key not in singles:
            singles[key] = _run(base + [f"trainer.default_local_dir={tmp_path}/single"] + extra)
    single_curve = _fit_curve(base + [f"trainer.default_local_dir={tmp_path}/single_curve"]) if curves else None
    spawn_process_group(_worker, world, str(tmp_path), base, scenarios, curves, refusals or {},
                        timeout=datetime.timedelta(seconds=300))
    fails, grads, refused = [], {name: {} for name in scenarios}, []
    curve_rows = torch.load(tmp_path / "rank0.pt", weights_only=False)["curves"]
    for name in curves:
        fails += _compare_curve(single_curve, curve_rows[name], name)
    for r in range(world):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        refused.append(res["refusals"])
        for name in scenarios:
            fails += [f"rank {r} {f}" for f in _compare(singles[tuple(extra_single[name])], res[name], name)]
            grads[name].update(res[name]["grads"])  # the stages' parameters: every one on some rank
    for name in scenarios:
        ref = singles[tuple(extra_single[name])]["grads"]
        missing = set(ref) - set(grads[name])
        worst = max((grads[name][k] - g).abs().max().item() / max(g.abs().max().item(), 1e-12)
                    for k, g in ref.items() if k in grads[name])
        print(f"{name:10s} worst relative gradient diff {worst:.1e} over {len(ref)} parameters")
        if missing or worst > GRAD_RTOL:
            fails.append(f"{name}: gradients differ from 1 process (worst {worst:.1e}), missing {sorted(missing)}")
    assert not fails, "\n".join(fails)
    return refused


def test_stage_layers_split_and_refusal():
    """Equal contiguous layer ranges per stage; a count the stages do not divide is refused naming both keys."""
    assert stage_layers(8, 2, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=2 x .*virtual_pipeline_model_parallel_size=2"):
        stage_layers(6, 2, 2)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("pp,v", [(2, 1), (2, 2), (4, 1)])
def test_rank_loads_only_its_stages(tmp_path, pp, v, tied):
    """A pipeline rank reads and materialises only its stages' parameters (stage_keep): before the cut
    the non-meta parameters number stage_params(config, pp, rank) and equal the checkpoint's, the rest
    are meta; after split_model none is meta, and the stages chained over the ranks give the whole
    model's hidden states (tied: the last stage's lm_head is the embedding's values)."""
    _setup(str(tmp_path), tied=tied)
    path = str(tmp_path / "model")
    full = load_hf_model(path)
    ref = full.state_dict()
    chunks = {}
    for rank in range(pp):
        model = load_hf_model(path, keep=stage_keep(rank, pp, v))
        params = {id(p): p for p in model.parameters()}.values()
        real = [p for p in params if not p.is_meta]
        assert sum(p.numel() for p in real) == stage_params(full.config, pp, rank), rank
        assert len(real) < len(params)  # the other stages' parameters were never read
        for name, p in model.named_parameters():
            assert p.is_meta or torch.equal(p, ref[name]), name
        for k, chunk in enumerate(split_model(model, rank, pp, v)):
            chunks[rank + k * pp] = chunk
        assert not any(p.is_meta for p in model.parameters()), rank
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 12, 13], dtype=torch.int32)
    ids = torch.randint(0, full.config.vocab_size, (13,), generator=g)
    with torch.no_grad():
        want = full(ids, cu, 7)
        h = ids
        for s in range(pp * v):
            h = chunks[s](h, cu.reshape(1, -1), torch.tensor([7]))
    assert (h - want).abs().max() <= 1e-6
    assert torch.equal(chunks[pp * v - 1].lm_head.weight, ref["lm_head.weight"])


def test_rank_checks_the_weights_it_does_not_read(tmp_path):
    """The checkpoint is checked whole on every rank: another stage's weight missing, or of the wrong
    shape (read from the safetensors header), is refused by name as without PP."""
    from safetensors.torch import load_file, save_file

    _setup(str(tmp_path))
    file = tmp_path / "model" / "model.safetensors"
    tensors = load_file(str(file))
    keep = stage_keep(0, 2)
    name = "model.layers.3.mlp.up_proj.weight"  # stage 1's
    save_file({k: v for k, v in tensors.items() if k != name}, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing 1 weight.*layers.3.mlp.up_proj"):
        load_hf_model(str(tmp_path / "model"), keep=keep)
    save_file({**tensors, name: tensors[name][:-1].contiguous()}, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="layers.3.mlp.up_proj.weight has shape"):
        load_hf_model(str(tmp_path / "model"), keep=keep)


def test_config_refuses_sp_with_pp_and_too_few_rows():
    """SP x PP is refused naming both keys; a mini-batch needs a row per pipeline stage."""
    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size=2.*not supported"):
        load_config(overrides=PP + ["actor_rollout_ref.actor.sp_size=2"])
    with pytest.raises(ValueError, match="ppo_mini_batch_size.*pipeline_model_parallel_size=4"):
        load_config(overrides=["actor_rollout_ref.actor.pipeline_model_parallel_size=4", "data.train_batch_size=1",
                               "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.rollout.n=2"])
    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size.*needs"):
        load_config(overrides=["actor_rollout_ref.actor.virtual_pipeline_model_parallel_size=2"])


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_pp2_equals_one_process(tmp_path):
    """PP=2 (1F1B), PP=2 x 2 virtual stages (interleaved), PP=2 with KL + 2 epochs (forward-only
    pipelines for old / ref log-probs) and with fixed-size micro-batches: first step's batch, metrics,
    gradients and updated weights equal one process's; at PP=2 every step of a CURVE_STEPS-step run too."""
    _spawn_and_compare(tmp_path, 2, SCENARIOS_2, curves={"pp2_curve": PP})


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_pp2_with_dp2_tp2_equals_one_process(tmp_path):
    """PP=2 x DP=2 (DDP per stage; FSDP2 per stage) and PP=2 x TP=2: first step equal to one process;
    at PP=2 x DP=2 every step of a CURVE_STEPS-step run too."""
    _spawn_and_compare(tmp_path, 4, SCENARIOS_4, curves={"pp2xdp2_curve": PP})


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_tied_embeddings_pp2(tmp_path):
    """Tied embeddings at PP=2: the last stage's copy's gradient is summed with the first's, so the
    update equals one process's and both copies stay equal (the gathered state has the same weights)."""
    _spawn_and_compare(tmp_path, 2, {"pp2_tied": PP}, tied=True)


def _checkpoint_worker(rank: int, root: str, base: list):
    """2 steps at PP=2 saving after each; then a run resumed from step 1 to step 2."""
    torch.set_num_threads(1)
    run = base + PP + ["trainer.total_training_steps=2", "trainer.save_freq=1"]
    straight = DAPOTrainer(load_config(overrides=run + [f"trainer.default_local_dir={root}/straight"]))
    straight.fit()
    final = {k: v.clone() for k, v in straight.full_state().items()}
    resumed = DAPOTrainer(load_config(overrides=run + [
        f"trainer.default_local_dir={root}/resumed", "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={root}/straight/checkpoints/global_step_1"]))
    step = resumed.global_step
    resumed.fit()
    torch.save({"final": final, "resumed_step": step, "resumed": resumed.full_state()},
               os.path.join(root, f"ckpt{rank}.pt"))


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_checkpoint_across_the_stage_split(tmp_path):
    """A PP=2 checkpoint is an ordinary HF model directory (every stage's weights, HF names): one
    process loads it and sees the PP=2 run's weights (and the PP=2 runs start from a directory
    save_hf_model wrote, as a one-process checkpoint's); a PP=2 run resumed from its step-1
    checkpoint ends where the uninterrupted run ends."""
    from dapo_trainer import load_hf_model

    base = _setup(str(tmp_path))
    spawn_process_group(_checkpoint_worker, 2, str(tmp_path), base, timeout=datetime.timedelta(seconds=300))
    res = torch.load(tmp_path / "ckpt0.pt", weights_only=False)
    assert res["resumed_step"] == 1
    hf = load_hf_model(str(tmp_path / "straight" / "checkpoints" / "global_step_2" / "model")).state_dict()
    assert set(hf) == set(res["final"])
    for k, v in res["final"].items():
        assert torch.equal(hf[k], v), k  # HF format at PP=1: the same tensors
        assert (res["resumed"][k] - v).abs().max() <= 1e-6, k
    # Back: the PP=2 checkpoint as a one-process run's model (PP=1), and the trainer accepts it.
    single = DAPOTrainer(load_config(overrides=base + [
        f"actor_rollout_ref.model.path={tmp_path}/straight/checkpoints/global_step_2/model",
        f"trainer.default_local_dir={tmp_path}/single"]))
    for k, v in single.model.state_dict().items():
        assert torch.equal(v, res["final"][k]), k
