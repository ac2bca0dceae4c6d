"""A step's data travels as typed records: generation -> accumulator -> actor, a dict of tensors
only at the accumulator's API; ``rollout()`` takes keyword arguments only."""
import dataclasses
import inspect
from dataclasses import fields

import torch

from dapo_trainer.agent_loop import MultiTurnLoop, SingleTurnLoop, build_agent_loop
from dapo_trainer.config import load_config
from dapo_trainer.generation import GenerationStage
from dapo_trainer.records import GenerationBatch, MicroBatch, MiniBatchPlan, TrainBatch
from dapo_trainer.trainer import DAPOTrainer
from tests.trainer.tiny import micro_setup

# Two mini-batches (old log-probs recomputed) and a KL term (reference log-probs).
OFF_POLICY_KL = ["trainer.val_before_train=false", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                 "actor_rollout_ref.actor.use_kl_loss=true", "trainer.seed=3"]
ACCUMULATOR_KEYS = sorted(f.name for f in fields(TrainBatch) if f.name != "group_index")


def _tensor_dicts(obj, path="value"):
    """Paths of the dicts holding tensors inside ``obj`` (dataclasses, lists and tuples walked)."""
    if isinstance(obj, dict):
        return [path] if any(isinstance(v, torch.Tensor) for v in obj.values()) else []
    if dataclasses.is_dataclass(obj):
        return [p for f in fields(obj) for p in _tensor_dicts(getattr(obj, f.name), f"{path}.{f.name}")]
    if isinstance(obj, (list, tuple)):
        return [p for i, v in enumerate(obj) for p in _tensor_dicts(v, f"{path}[{i}]")]
    return []


def test_one_step_hands_records_between_stages(tmp_path):
    """Every hand-off of a step (generation batch, train batch, plan, micro-batches with old and
    reference log-probs) is a record, no dict of tensors inside; the accumulator receives and
    returns the TrainBatch's own field names."""
    trainer = DAPOTrainer(load_config(overrides=micro_setup(str(tmp_path)) + OFF_POLICY_KL))
    gen, actor, acc = trainer.generation, trainer.actor, trainer.generation.accumulator
    seen = {}

    def spy(owner, name):
        inner = getattr(owner, name)

        def wrapped(*args, **kwargs):
            out = inner(*args, **kwargs)
            seen.setdefault(name, []).append((args, out))
            return out

        setattr(owner, name, wrapped)

    for owner, name in [(gen, "generation_batch"), (gen, "collect"), (acc, "add"), (acc, "take"), (actor, "plan"),
                        (actor, "pack"), (actor, "_backward_mini_batch")]:
        spy(owner, name)
    metrics = trainer.train_step()

    for _, gb in seen["generation_batch"]:
        assert isinstance(gb, GenerationBatch) and isinstance(gb.batch, TrainBatch)
        assert len(gb.batch.group_index) == len(gb.keep) == len(gb.rows) * 4
    for (tensors, group_index, _), _ in seen["add"]:
        assert sorted(tensors) == ACCUMULATOR_KEYS and group_index.dtype == torch.int64
    (_, taken), = seen["take"]
    assert sorted(taken) == sorted(ACCUMULATOR_KEYS + ["group_index"])
    (_, (batch, _)), = seen["collect"]
    assert isinstance(batch, TrainBatch) and len(batch.group_index) == 2 * 4
    (_, plan), = seen["plan"]
    assert len(plan) == 2 and all(isinstance(p, MiniBatchPlan) for p in plan)
    assert all(isinstance(mb, MicroBatch) and mb.old_log_prob is None for _, mb in seen["pack"])
    assert len(seen["_backward_mini_batch"]) == 2
    for (p, mbs, on_policy, _), _ in seen["_backward_mini_batch"]:
        assert isinstance(p, MiniBatchPlan) and not on_policy
        for mb in mbs:
            assert isinstance(mb, MicroBatch)
            assert mb.old_log_prob.shape == mb.ref_log_prob.shape == mb.input_ids.shape
    handed = [(name, args, out) for name in ("generation_batch", "collect", "plan", "pack") for args, out in seen[name]]
    handed += [("_backward_mini_batch", args[:2], None) for args, _ in seen["_backward_mini_batch"]]  # (not its sums)
    for name, args, out in handed:
        assert not _tensor_dicts(args) + _tensor_dicts(out), (name, _tensor_dicts(args) + _tensor_dicts(out))
    assert metrics["actor/num_updates"] == 2 and "actor/kl_loss" in metrics


def test_rollout_and_agent_loops_take_keyword_arguments_only():
    """``GenerationStage.rollout`` and both agent loops' ``run`` name every argument."""
    for fn in (GenerationStage.rollout, SingleTurnLoop.run, MultiTurnLoop.run):
        params = list(inspect.signature(fn).parameters.values())[1:]
        assert params and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params), (fn, params)


def test_agent_loop_follows_the_environment(tmp_path):
    """Without an environment the stage samples single-turn, with one multi-turn."""
    from dapo_trainer.data import load_tokenizer

    cfg = load_config(overrides=micro_setup(str(tmp_path)))
    tok = load_tokenizer(cfg.actor_rollout_ref.model.path)
    assert isinstance(build_agent_loop(cfg, tok, engine=None), SingleTurnLoop)
    assert isinstance(build_agent_loop(cfg, tok, engine=None, env=object()), MultiTurnLoop)


def test_old_checkpoint_accumulator_keys_load_as_train_batch_fields(tmp_path):
    """Carried-over groups saved under the accumulator's former keys (``rollout_log_prob``,
    ``response_mask``, ``truncated``, ``num_turns``), and before ``routed_experts`` existed, load and are
    taken as the same TrainBatch."""
    trainer = DAPOTrainer(load_config(overrides=micro_setup(str(tmp_path)) + ["trainer.val_before_train=false"]))
    gen = trainer.generation
    gb = gen.generation_batch(1, 0)
    gen.accumulator.add(gb.batch.tensors(), gb.batch.group_index, torch.ones_like(gb.keep))
    state = gen.state_dict()
    new = {"prompt_ids": "prompt_ids", "prompt_len": "prompt_len", "response_ids": "response_ids",
           "response_len": "response_len", "log_probs": "rollout_log_prob", "sampled": "response_mask",
           "advantages": "advantages", "score": "score", "acc": "acc", "reward": "reward", "turns": "num_turns"}
    assert all(c["routed_experts"].shape[1] == 0 for c in state["accumulator"]["chunks"])  # no R3: empty
    old_chunks = [{**{new[k]: v for k, v in c.items() if k not in ("stopped", "routed_experts")},
                   "truncated": ~c["stopped"]}
                  for c in state["accumulator"]["chunks"]]
    old = {**state, "accumulator": {**state["accumulator"], "chunks": old_chunks,
                                    "keys": tuple(sorted(old_chunks[0]))}}
    want = TrainBatch.from_tensors(gen.accumulator.take(num_groups=2))
    gen.load_state_dict(old)
    got = TrainBatch.from_tensors(gen.accumulator.take(num_groups=2))
    for f in fields(TrainBatch):
        a, b = getattr(want, f.name), getattr(got, f.name)
        assert a.dtype == b.dtype and torch.equal(a, b), f.name
