"""make ablation: the task family's checker and data, the summary statistics, and the whole
machinery (every task's two rungs, ablation.json, the side-by-side report) on a toy budget."""
import dataclasses
import json
import math
import os

import pytest

from dapo_trainer.demo import ablation
from dapo_trainer.demo.ablation_reward import compute_score
from dapo_trainer.demo.assets import DemoConfig
from dapo_trainer.demo.arithmetic import TaskConfig
from dapo_trainer.tools.report import ablation_summary, ablation_table, mean_ci, write_report


def test_checker_accepts_both_conventions_of_showing_work_and_pays_rare_answers_half():
    info = {"prompt": "sort:3141="}
    assert compute_score("sort", "1134", "1134", info) == {"score": 1.0, "acc": 1.0}
    assert compute_score("sort", "3141:1134", "1134", info) == {"score": 1.0, "acc": 1.0}
    assert compute_score("sort", "3142:1134", "1134", info)["score"] == 0.0  # work that is not the input
    assert compute_score("sort", "4311", "1134", info)["score"] == 0.0
    assert compute_score("sort_rare", "4311", "1134", info) == {"score": 0.5, "acc": 0.0}
    assert compute_score("sort_rare", "3141:4311", "1134", info)["score"] == 0.5
    assert compute_score("sort_rare", "113", "1134", info)["score"] == 0.0
    # One repeated digit: both orders are the same answer, the full reward.
    assert compute_score("sort_rare", "77", "77", {"prompt": "sort:77="})["score"] == 1.0


def test_rows_are_held_out_seeded_and_in_their_buckets():
    task = next(t for t in ablation.TASKS if t.name == "vanishing")
    train0, val0 = ablation.make_rows(task, 0, 500)
    train1, val1 = ablation.make_rows(task, 1, 500)
    assert val0 == val1  # the held-out set does not depend on the training seed
    assert train0 != train1 and train0 == ablation.make_rows(task, 0, 500)[0]
    held = {r["prompt"] for rows in val0.values() for r in rows}
    assert not held & {r["prompt"] for r in train0}
    lengths = [len(r["prompt"]) - len("sort:=") for r in train0]
    assert set(lengths) <= {1, 3, 4, 5, 14, 15, 16} and lengths.count(1) > 100 and max(lengths) == 16
    assert [len(v) for v in val0.values()] == [0, 0, 96]
    assert all(r["answer"] == "".join(sorted(r["prompt"][5:-1])) for r in train0)


def test_mean_ci():
    m, h = mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and h == pytest.approx(4.303 / math.sqrt(3))
    assert math.isnan(mean_ci([0.5])[1])


def test_ablation_runs_end_to_end_on_a_toy_budget(tmp_path, monkeypatch):
    """Every task's two rungs for two seeds (one step each on a 3-step warm start, 4 held-out
    prompts per bucket), then the table and the report. Filtering is off in every rung here (an
    untrained model samples no mixed groups, and dynamic sampling would re-sample forever); the
    budget logic still runs."""
    monkeypatch.setattr(ablation, "TASKS", tuple(
        dataclasses.replace(t, buckets=tuple((name, lens, w, min(c, 4)) for name, lens, w, c in t.buckets))
        for t in ablation.TASKS))
    family = DemoConfig(seed=0, task=TaskConfig(sort_len=(1, 12)), hidden_size=64, intermediate_size=128,
                        num_layers=1, num_heads=1, head_dim=64, num_train=300, num_val=4, warm_start_steps=3,
                        warm_start_batch_size=8, warm_start_verbose=0.4)
    run_dir = str(tmp_path / "ablation")
    over = ["data.train_batch_size=2", "data.gen_batch_size=4", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1", "algorithm.filter_groups.enable=false",
            "trainer.test_freq=0", "trainer.val_before_train=false"]
    result = ablation.run_ablation(run_dir, [0, 1], 1, cache_dir=str(tmp_path / "cache"), overrides=over,
                                   family=family, progress=False)
    with open(os.path.join(run_dir, "ablation.json")) as f:
        assert json.load(f) == result
    assert [t["name"] for t in result["tasks"]] == ["entropy", "length", "truncation", "vanishing"]
    assert len(result["runs"]) == 4 * 2 * 2
    for run in result["runs"]:
        assert run["samples"] == run["steps"] * 2 * 4  # equal budget: no filtering, one batch per step
        rows = [json.loads(line) for line in open(os.path.join(run["run_dir"], "metrics.jsonl"))]
        assert [r["step"] for r in rows] == list(range(1, run["steps"] + 1)) and "val/acc" in rows[-1]
        last = rows[-1]
        assert last["train/gen_responses"] == 8 and 0.0 <= last["train/gen_truncated_frac"] <= 1.0
        assert 0 <= last["train/effective_batch"] <= 8 and "actor/entropy" in last
        assert set(run["after"]) == set(run["before"]) and all(0.0 <= v <= 1.0 for v in run["after"].values())
    # The rungs differ by exactly the component: the effective settings say so.
    rows = ablation_summary(result)
    assert [(r["task"], r["with"]) for r in rows] == [(t, w) for t in ("entropy", "length", "truncation", "vanishing")
                                                       for w in (False, True)]
    length = next(r for r in rows if r["task"] == "length" and r["with"])
    assert set(length["acc_by_bucket"]) == {"2-3", "9-11"}
    assert all(not math.isnan(v[1]) for r in rows for v in r["metric_value"] if not math.isnan(v[0]))
    table = ablation_table(rows)
    assert table.count("\n") == 2 + 8 - 1 and "DAPO - clip-higher" in table and "± " in table
    page = write_report(run_dir)
    html = open(page).read()
    for t in result["tasks"]:
        png = os.path.join(run_dir, "report", f"ablation_{t['name']}.png")
        assert os.path.getsize(png) > 1000 and f"ablation_{t['name']}.png" in html
    assert "DAPO - dynamic sampling" in html


def test_rung_settings_remove_exactly_one_component():
    from dapo_trainer.config import load_config

    for task in ablation.TASKS:
        with_ = load_config(ablation.DEFAULT_CONFIG, ablation.DAPO + list(task.common))
        without = load_config(ablation.DEFAULT_CONFIG, ablation.DAPO + list(task.common) + list(task.without))
        a, b = with_.actor_rollout_ref.actor, without.actor_rollout_ref.actor
        ob_a, ob_b = with_.reward_model.overlong_buffer, without.reward_model.overlong_buffer
        diff = {"clip-higher": (a.clip_ratio_high, b.clip_ratio_high),
                "token-level loss": (a.loss_agg_mode, b.loss_agg_mode),
                "overlong shaping": (ob_a.enable, ob_b.enable),
                "dynamic sampling": (with_.algorithm.filter_groups.enable, without.algorithm.filter_groups.enable)}
        changed = [k for k, (x, y) in diff.items() if x != y]
        assert changed == [task.component], task.name
        assert diff[task.component] in ((0.28, 0.2), ("token-mean", "seq-mean-token-mean"), (True, False))
