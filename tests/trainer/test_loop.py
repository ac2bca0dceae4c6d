"""The DAPO loop end to end on a tiny random model: micro run, exhaustion error, kill-and-resume,
no duplicated metric rows, non-finite updates skipped."""
import os

import pytest
import torch

import dapo_kernels as dk
from dapo_trainer.state_file import load_state_file
from dapo_trainer.config import load_config
from dapo_trainer.hf_io import load_hf_model
from dapo_trainer.metrics import read_metrics
from dapo_trainer.actor import Actor
from dapo_trainer.trainer import DAPOTrainer, NonFiniteTrainingError
from tests.trainer.tiny import ZERO_REWARD, micro_setup

# The metrics every training step logs (verl's names where verl has one).
REQUIRED = ["actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/entropy",
            "actor/grad_norm", "response_length/mean", "response_length/max", "response_length/clip_ratio",
            "train/num_gen_batches", "train/kept_groups", "train/seen_groups", "train/keep_rate",
            "train/all_correct_groups", "train/all_wrong_groups", "critic/score/mean", "critic/rewards/mean",
            "acc/mean", "timing_s/gen", "timing_s/reward", "timing_s/update_actor", "timing_s/step",
            "perf/tokens_per_s"]
# Two mini-batches: old log-probs are recomputed and the second update is off-policy.
STEPS3 = ["trainer.total_training_steps=3", "trainer.save_freq=1", "trainer.test_freq=3",
          "actor_rollout_ref.actor.ppo_mini_batch_size=1"]


def _no_timing(m):
    return {k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/"))}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("full"))
    overrides = micro_setup(root) + STEPS3
    final = DAPOTrainer(load_config(overrides=overrides)).fit()
    return root, overrides, final, read_metrics(os.path.join(root, "run"))


def test_micro_run_logs_every_metric_and_checkpoints(uninterrupted):
    root, _, final, lines = uninterrupted
    assert [m["step"] for m in lines] == [0, 1, 2, 3]
    assert set(lines[0]) == {"step", "val/score", "val/acc", "val/response_length"}
    for m in lines[1:]:
        missing = [k for k in REQUIRED if k not in m]
        assert not missing
        assert m["train/kept_groups"] <= m["train/seen_groups"]
        assert all(v == v for v in m.values())  # no NaN
    assert "val/acc" in lines[3] and final["val/acc"] == lines[3]["val/acc"]
    ckpts = os.path.join(root, "run", "checkpoints")
    assert open(os.path.join(ckpts, "latest_checkpointed_iteration.txt")).read() == "3"
    model = load_hf_model(os.path.join(ckpts, "global_step_3", "model"))
    start = load_hf_model(os.path.join(root, "model"))
    assert not torch.equal(model.lm_head.weight, start.lm_head.weight)  # it trained
    assert os.path.isfile(os.path.join(ckpts, "global_step_3", "model", "tokenizer.json"))
    assert not [f for f in os.listdir(ckpts) if ".tmp" in f]


def test_on_policy_step_has_ratio_one(tmp_path):
    """One mini-batch, one epoch: the old log-probs are the current ones, so nothing clips."""
    overrides = micro_setup(str(tmp_path)) + ["trainer.total_training_steps=1", "trainer.val_before_train=false",
                                              "data.val_files=[]", "actor_rollout_ref.actor.ppo_mini_batch_size=2"]
    m = DAPOTrainer(load_config(overrides=overrides)).fit()
    assert m["actor/pg_clipfrac"] == 0.0 and m["actor/pg_clipfrac_lower"] == 0.0
    assert abs(m["actor/ppo_kl"]) < 1e-5
    assert m["timing_s/old_log_prob"] < m["timing_s/update_actor"]


def test_exhausted_sampling_names_keep_rate(tmp_path):
    overrides = micro_setup(str(tmp_path), ZERO_REWARD) + [
        "trainer.total_training_steps=1", "trainer.val_before_train=false",
        "algorithm.filter_groups.max_num_gen_batches=2", "data.gen_batch_size=2"]
    with pytest.raises(dk.DynamicSamplingExhausted, match=r"keep rate 0\.0% of 4 groups.*4 all-wrong"):
        DAPOTrainer(load_config(overrides=overrides)).fit()


def test_kill_and_resume_matches_uninterrupted(uninterrupted, tmp_path, monkeypatch):
    root_full, _, _, full_lines = uninterrupted
    overrides = micro_setup(str(tmp_path)) + STEPS3
    # The model, data and reward files are regenerated identically under the new root.
    real_update, calls = Actor.update, []

    def crash_in_step_3(self, batch):  # one update per step
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")  # as a SIGINT mid-step would
        return real_update(self, batch)

    monkeypatch.setattr(Actor, "update", crash_in_step_3)
    with pytest.raises(KeyboardInterrupt):
        DAPOTrainer(load_config(overrides=overrides)).fit()
    monkeypatch.setattr(Actor, "update", real_update)
    run = os.path.join(str(tmp_path), "run")
    assert [m["step"] for m in read_metrics(run)] == [0, 1, 2]
    carried = load_state_file(os.path.join(run, "checkpoints", "global_step_2", "state_rank0.safetensors"))[
        "accumulator"]["num_buffered_groups"]
    resumed = DAPOTrainer(load_config(overrides=overrides))
    assert resumed.global_step == 2 and resumed.generation.accumulator.num_buffered_groups == carried
    resumed.fit()
    lines = read_metrics(run)
    assert [m["step"] for m in lines] == [0, 1, 2, 3]
    assert [_no_timing(m) for m in lines] == [_no_timing(m) for m in full_lines]


def test_bad_resume_path_and_missing_model(tmp_path):
    overrides = micro_setup(str(tmp_path)) + ["trainer.total_training_steps=1", "trainer.val_before_train=false"]
    with pytest.raises(ValueError, match="resume_from_path"):
        DAPOTrainer(load_config(overrides=overrides + ["trainer.resume_mode=resume_path",
                                                       f"trainer.resume_from_path={tmp_path}/nope"]))
    with pytest.raises(ValueError, match="model.path"):
        DAPOTrainer(load_config(overrides=overrides + ["actor_rollout_ref.model.path=''"]))


def test_kl_loss_epochs_seq_mode_fixed_micro_batches(tmp_path):
    """The non-default paths: reference model + KL loss, 2 epochs, a seq-mean mode, fixed micro-batch size."""
    overrides = micro_setup(str(tmp_path)) + [
        "trainer.total_training_steps=1", "trainer.val_before_train=false", "data.val_files=[]",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
        "actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        "actor_rollout_ref.actor.use_dynamic_bsz=false", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
        "actor_rollout_ref.actor.entropy_coeff=0.01", "algorithm.filter_groups.enable=false"]
    m = DAPOTrainer(load_config(overrides=overrides)).fit()
    assert m["actor/num_updates"] == 2
    # Epoch 1 starts at the reference weights (KL 0), epoch 2 has moved away from them.
    assert m["actor/kl_loss"] > 0 and "timing_s/ref" in m
    assert m["train/keep_rate"] == 1.0 and m["train/num_gen_batches"] == 1


def test_killed_before_the_first_checkpoint_never_repeats_a_step(tmp_path, monkeypatch):
    """Three kills in step 1 (after step 0's validation row), then a full run: one row per step."""
    overrides = micro_setup(str(tmp_path)) + ["trainer.total_training_steps=1"]
    run = os.path.join(str(tmp_path), "run")
    real_update = Actor.update

    def killed(self, batch):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(Actor, "update", killed)
    for _ in range(3):
        with pytest.raises(KeyboardInterrupt):
            DAPOTrainer(load_config(overrides=overrides)).fit()
        assert [m["step"] for m in read_metrics(run)] == [0]
    monkeypatch.setattr(Actor, "update", real_update)
    DAPOTrainer(load_config(overrides=overrides)).fit()
    assert [m["step"] for m in read_metrics(run)] == [0, 1]


class _InfGrad(torch.autograd.Function):
    """Identity forward; backward turns the gradient non-finite (the loss stays finite)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


def _poison(monkeypatch, bad_steps, kind):
    """Make the policy loss of steps ``bad_steps`` non-finite (``kind="loss"``: the value only,
    the gradient stays finite) or their gradient non-finite (``kind="grad"``)."""
    real_loss, real_update = dk.fused_linear_policy_loss, Actor.update
    current = {"step": 0}

    def update(self, batch):  # one update per step, from step 1
        current["step"] += 1
        current["bad"] = current["step"] in bad_steps
        return real_update(self, batch)

    def loss_fn(hidden, *args, **kwargs):
        if current["bad"] and kind == "grad":
            hidden = _InfGrad.apply(hidden)
        loss, m = real_loss(hidden, *args, **kwargs)
        if current["bad"] and kind == "loss":
            loss = loss + torch.tensor(float("nan"))  # no gradient path: only the value is NaN
        return loss, m

    monkeypatch.setattr(Actor, "update", update)
    monkeypatch.setattr(dk, "fused_linear_policy_loss", loss_fn)


def _weights(root, step):
    return load_hf_model(os.path.join(root, "run", "checkpoints", f"global_step_{step}", "model")).state_dict()


def test_non_finite_loss_skips_the_update(tmp_path, monkeypatch):
    """Step 2's loss is NaN (its gradient finite): both of its updates are skipped and logged,
    its checkpoint holds step 1's weights, and step 3 trains on."""
    root = str(tmp_path)
    overrides = micro_setup(root) + STEPS3 + ["trainer.val_before_train=false", "data.val_files=[]"]
    _poison(monkeypatch, {2}, "loss")
    DAPOTrainer(load_config(overrides=overrides)).fit()
    lines = read_metrics(os.path.join(root, "run"))
    assert [(m["step"], m["actor/skipped_updates"], m["actor/num_updates"]) for m in lines] == [
        (1, 0, 2), (2, 2, 0), (3, 0, 2)]
    assert lines[1]["actor/skip_reason"] == ("epoch 1 mini-batch 1: non-finite loss nan; "
                                             "epoch 1 mini-batch 2: non-finite loss nan")
    assert "actor/skip_reason" not in lines[0] and "actor/skip_reason" not in lines[2]
    w1, w2, w3 = (_weights(root, s) for s in (1, 2, 3))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert not torch.equal(w3["lm_head.weight"], w2["lm_head.weight"])
    assert all(torch.isfinite(v).all() for v in w3.values())


def test_non_finite_gradients_stop_the_run_after_max_nonfinite_steps(tmp_path, monkeypatch):
    root = str(tmp_path)
    overrides = micro_setup(root) + STEPS3 + ["trainer.val_before_train=false", "data.val_files=[]",
                                              "trainer.max_nonfinite_steps=2"]
    with pytest.raises(ValueError, match="trainer.max_nonfinite_steps.* must be >= 1, got 0"):  # at load time
        load_config(overrides=overrides + ["trainer.max_nonfinite_steps=0"])
    _poison(monkeypatch, {1, 2, 3}, "grad")
    with pytest.raises(NonFiniteTrainingError, match=r"trainer.max_nonfinite_steps=2: 2 steps in a row \(the last: "
                                                     r"step 2, epoch 1 mini-batch 1: non-finite gradient norm"):
        DAPOTrainer(load_config(overrides=overrides)).fit()
    lines = read_metrics(os.path.join(root, "run"))
    assert [(m["step"], m["actor/skipped_updates"]) for m in lines] == [(1, 2), (2, 2)]
    # Step 1 was saved with the initial weights; the run stopped before saving step 2.
    start = load_hf_model(os.path.join(root, "model")).state_dict()
    w1 = _weights(root, 1)
    assert all(torch.equal(start[k], w1[k]) for k in start)
    assert not os.path.exists(os.path.join(root, "run", "checkpoints", "global_step_2"))


@pytest.mark.parametrize("routes", [0, 6])
def test_rollout_share_pack_unpack_round_trip(routes):
    """A rollout share read back from its packed float64 table has every field's values and dtype (routes:
    router replay R3's expert ids per token, 0 without)."""
    from dataclasses import fields

    from dapo_trainer.generation import RolloutShare

    g = torch.Generator().manual_seed(0)
    N, P, R = 5, 3, 4
    share = RolloutShare(
        prompt_ids=torch.randint(0, 2**40, (N, P), generator=g),
        response_ids=torch.randint(0, 2**40, (N, R), generator=g),
        log_probs=-torch.rand(N, R, generator=g), sampled=torch.rand(N, R, generator=g) > 0.5,
        prompt_len=torch.randint(1, P + 1, (N,), generator=g), response_len=torch.randint(0, R + 1, (N,), generator=g),
        stopped=torch.rand(N, generator=g) > 0.5, score=torch.randn(N, generator=g, dtype=torch.float64),
        acc=torch.rand(N, generator=g, dtype=torch.float64), reward=torch.randn(N, generator=g, dtype=torch.float64),
        filter_metric=torch.randn(N, generator=g, dtype=torch.float64), failed=torch.rand(N, generator=g) > 0.5,
        turns=torch.randint(1, 4, (N,), generator=g).double(),
        routed_experts=torch.randint(-1, 128, (N, (P + R) * routes), generator=g))
    table = share.pack()
    assert table.dtype == torch.float64 and table.shape == (N, P + 3 * R + 9 + (P + R) * routes)
    back = RolloutShare.unpack(table, P, R, routes)
    for f in fields(RolloutShare):
        a, b = getattr(share, f.name), getattr(back, f.name)
        assert a.dtype == b.dtype and torch.equal(a, b), f.name
    empty = RolloutShare.empty(P, R, routes)
    assert empty.prompt_ids.shape == (0, P) and empty.sampled.shape == (0, R) and empty.score.shape == (0,)
    assert empty.routed_experts.shape == (0, (P + R) * routes)
