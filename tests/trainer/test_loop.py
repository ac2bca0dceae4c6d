"""The DAPO loop end to end on a tiny random model: micro run, exhaustion error, kill-and-resume."""
import os

import pytest
import torch

import dapo_kernels as dk
from dapo_trainer.checkpoint import load_state_file
from dapo_trainer.config import load_config
from dapo_trainer.hf_io import load_hf_model
from dapo_trainer.metrics import read_metrics
from dapo_trainer.trainer import DAPOTrainer
from tests.trainer.tiny import ZERO_REWARD, micro_setup

# Every metric issue 9 names (and the kernel issues' pg_clipfrac_lower / ppo_kl).
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
    real_update = DAPOTrainer.update

    def crash_in_step_3(self, batch):
        if self.global_step == 2:
            raise KeyboardInterrupt("killed")  # as a SIGINT mid-step would
        return real_update(self, batch)

    monkeypatch.setattr(DAPOTrainer, "update", crash_in_step_3)
    with pytest.raises(KeyboardInterrupt):
        DAPOTrainer(load_config(overrides=overrides)).fit()
    monkeypatch.setattr(DAPOTrainer, "update", real_update)
    run = os.path.join(str(tmp_path), "run")
    assert [m["step"] for m in read_metrics(run)] == [0, 1, 2]
    carried = load_state_file(os.path.join(run, "checkpoints", "global_step_2", "state_rank0.safetensors"))[
        "accumulator"]["num_buffered_groups"]
    resumed = DAPOTrainer(load_config(overrides=overrides))
    assert resumed.global_step == 2 and resumed.accumulator.num_buffered_groups == carried
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
