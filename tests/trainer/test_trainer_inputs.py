"""What the trainer does with a user's inputs that could go silently wrong: the row's extra_info
reaches the reward function, a checkpoint of another model is refused, data.val_max_samples=-1
keeps every row, a failed start leaves the metrics file alone, and what a run used is recorded."""
import json
import logging

import pytest

from dapo_trainer.config import load_config
from dapo_trainer.state_file import load_state_file
from dapo_trainer.trainer import DAPOTrainer
from tests.trainer.tiny import ALTERNATING_REWARD, micro_setup, write_tiny_model

ONE_STEP = ["trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=0"]

EXTRA_INFO_REWARD = """
import json, os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.path.join(os.path.dirname(__file__), "seen.jsonl"), "a") as f:
        f.write(json.dumps(extra_info) + "\\n")
    return float(len(solution_str) % 2)
"""


def _with_extra_info(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    with open(path, "w") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps({**r, "extra_info": {"index": i, "secret": "abc"}}) + "\n")


def test_reward_function_gets_the_rows_extra_info_with_the_response_keys(tmp_path):
    overrides = micro_setup(str(tmp_path), EXTRA_INFO_REWARD) + ONE_STEP
    for name in ("train.jsonl", "val.jsonl"):
        _with_extra_info(str(tmp_path / name))
    DAPOTrainer(load_config(overrides=overrides)).fit()
    seen = [json.loads(line) for line in open(tmp_path / "seen.jsonl")]
    assert seen and all(s["secret"] == "abc" and isinstance(s["index"], int) for s in seen)
    assert all({"prompt", "response_length", "max_response_length", "truncated"} <= set(s) for s in seen)


def test_resume_with_another_model_size_names_both_shapes(tmp_path, capsys):
    overrides = micro_setup(str(tmp_path)) + ONE_STEP + ["trainer.save_freq=1", "data.val_files=[]"]
    DAPOTrainer(load_config(overrides=overrides)).fit()
    more = overrides[:] + ["trainer.total_training_steps=2"]
    DAPOTrainer(load_config(overrides=more))  # the same model resumes
    out = capsys.readouterr().out
    assert "resuming from" in out and "global_step_1" in out
    write_tiny_model(str(tmp_path / "model"), hidden=64)
    with pytest.raises(ValueError, match=r"hidden_size 64 vs 32"):
        DAPOTrainer(load_config(overrides=more))


def test_val_max_samples_minus_one_keeps_every_row(tmp_path):
    overrides = micro_setup(str(tmp_path), n_val=4) + ONE_STEP
    assert len(DAPOTrainer(load_config(overrides=overrides + ["data.val_max_samples=-1"])).val_rows) == 4
    assert len(DAPOTrainer(load_config(overrides=overrides + ["data.val_max_samples=3"])).val_rows) == 3


def test_run_records_its_config_and_a_failed_start_keeps_old_metrics(tmp_path, monkeypatch):
    overrides = micro_setup(str(tmp_path)) + ONE_STEP + ["data.val_files=[]"]
    trainer = DAPOTrainer(load_config(overrides=overrides))
    trainer.fit()
    run = tmp_path / "run"
    assert load_config(str(run / "config.yaml")).data.max_response_length == 5
    before = (run / "metrics.jsonl").read_text()
    assert before

    def boom(*a, **k):
        raise RuntimeError("generation failed")

    again = DAPOTrainer(load_config(overrides=overrides + ["trainer.total_training_steps=2"]))  # resumes step 1
    monkeypatch.setattr(again, "train_step", boom)
    with pytest.raises(RuntimeError, match="generation failed"):
        again.fit()
    assert (run / "metrics.jsonl").read_text() == before


BROKEN_ENV = """
class Broken:
    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, history):
        raise RuntimeError("the environment's service is down")
"""


def test_exhausted_sampling_counts_groups_dropped_for_environment_errors(tmp_path):
    from tests.trainer.test_multiturn import echo_setup

    overrides = echo_setup(tmp_path) + ONE_STEP + [
        "environment.name=Broken", "environment.on_error=drop", "algorithm.filter_groups.max_num_gen_batches=2",
        "data.gen_batch_size=2", "data.val_files=[]"]
    (tmp_path / "env.py").write_text(BROKEN_ENV)
    with pytest.raises(Exception, match=r"dropped for environment errors \(environment.on_error=drop\): 4\."):
        DAPOTrainer(load_config(overrides=overrides)).fit()


def test_report_says_why_carried_over_steps_have_no_dump(tmp_path):
    from dapo_trainer import rollout_dump
    from dapo_trainer.tools import batch_quality
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dump = tmp_path / "rollouts"
    rollout_dump.write_step(str(dump), 1, [{"step": 1, "gen_batch": 0, "group": 0, "sample": 0, "kept": True,
                                            "reward": 1.0, "response_length": 3, "finish_reason": "stop",
                                            "prompt": "1+1=", "response": "2"}])
    metrics = [{"step": 1, "train/num_gen_batches": 1}, {"step": 2, "train/num_gen_batches": 0}]
    _, html = batch_quality.write_analysis(plt, str(dump), metrics, str(tmp_path))
    assert "Steps 2 trained only on groups carried over" in html


BAD_REWARDS = [("'1.0'", "str"), ("1e308 * 10", "finite"), ("{'score': 1.0, 'acc': float('nan')}", "finite")]


@pytest.mark.parametrize("value,match", BAD_REWARDS)
def test_reward_that_is_not_a_real_finite_number_names_function_sample_and_row(tmp_path, value, match):
    reward = f"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return {value}\n"
    overrides = micro_setup(str(tmp_path), reward) + ONE_STEP + ["data.val_files=[]"]
    where = r"reward function 'compute_score' on sample 0 \(row \d+\)"
    with pytest.raises((TypeError, ValueError), match=rf"{where}.*{match}"):
        DAPOTrainer(load_config(overrides=overrides)).fit()


def test_checkpoint_path_that_is_a_file_fails_at_start_up(tmp_path):
    overrides = micro_setup(str(tmp_path)) + ONE_STEP
    (tmp_path / "run").write_text("not a directory")
    with pytest.raises(ValueError, match="trainer.default_local_dir"):
        DAPOTrainer(load_config(overrides=overrides))



def test_resume_with_another_rollout_n_drops_the_carried_groups_and_trains(tmp_path, caplog):
    """A checkpoint carrying over a kept group of rollout.n=4 responses, resumed with rollout.n=3: the
    group is dropped with a warning naming both values, and the next train batch holds whole groups of 3
    (before, a carried group of 4 split across the batch and the next carry-over)."""
    overrides = micro_setup(str(tmp_path), ALTERNATING_REWARD) + ONE_STEP + ["data.val_files=[]"]
    DAPOTrainer(load_config(overrides=overrides)).fit()
    state = load_state_file(str(tmp_path / "run" / "checkpoints" / "global_step_1" / "state_rank0.safetensors"))
    assert state["accumulator"]["num_buffered_groups"] == 1  # 3 kept of 3 generated, 2 trained on
    with caplog.at_level(logging.WARNING, logger="dapo_trainer.generation"):
        resumed = DAPOTrainer(load_config(overrides=overrides + ["trainer.total_training_steps=2",
                                                                 "actor_rollout_ref.rollout.n=3"]))
    assert "carries over 1 kept groups of actor_rollout_ref.rollout.n=4 responses each; this run has " \
           "rollout.n=3" in caplog.text
    batch, metrics = resumed.generation.collect(2)
    assert batch.group_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert batch.response_ids.shape[0] == 6 and metrics["train/carried_in_groups"] == 0
