"""Adaptive dynamic sampling (issue 33): the keep-rate estimator, the size rounding and ceiling, the
exhaustion warning, the short-batch option, the reward-threshold schedules, and the default path."""
import logging
import math
import os

import pytest
import torch

import dapo_kernels as dk
from dapo_trainer.adaptive_sampling import (LOW_KEEP_RATE, SamplingController, ThresholdSchedule, exhaustion_warning,
                                            gen_size_ceiling, round_counts, short_batch_groups)
from dapo_trainer.config import Config, load_config
from dapo_trainer.keep_rate import KeepRateEstimator, adaptive_gen_batch_size, round_to_multiple
from dapo_trainer.metrics import read_metrics
from dapo_trainer.model import ModelConfig
from dapo_trainer.trainer import DAPOTrainer
from tests.trainer.tiny import ALTERNATING_REWARD, ZERO_REWARD, micro_setup

ONE_STEP = ["trainer.total_training_steps=1", "trainer.val_before_train=false", "data.val_files=[]"]


# --------------------------------------------------------------------------- the estimator
def test_estimator_posterior_with_forgetting_is_exact():
    """Beta(a0 + A, b0 + B): each round's counts weigh forgetting**age."""
    e = KeepRateEstimator(forgetting=0.5, prior_keep=0.5, prior_strength=2.0)
    assert not e.ready and e.keep_rate() == 0.5
    e.update({"x": (8, 10)})
    e.update({"x": (1, 10)})
    kept, dropped = 8 * 0.5 + 1, 2 * 0.5 + 9
    assert e.ready and e.keep_rate() == pytest.approx((1 + kept) / (2 + kept + dropped))
    assert e.rounds == 2


def test_estimator_mixes_sources_by_their_share():
    """Two sources: the mean is their rates weighted by groups seen, and each keeps its own rate."""
    e = KeepRateEstimator(forgetting=1.0, prior_strength=1e-9)
    e.update({"easy": (30, 30), "hard": (0, 10)})
    rates = e.source_rates()
    assert rates["easy"] == pytest.approx(1.0) and rates["hard"] == pytest.approx(0.0, abs=1e-6)
    assert e.keep_rate() == pytest.approx(0.75)
    mean, var = e.kept_moments(100)
    assert mean == pytest.approx(75.0) and var == pytest.approx(0.0, abs=1e-3)


def test_estimator_follows_a_falling_keep_rate():
    """After the keep rate drops from 0.9 to 0.1, a few rounds bring the estimate near 0.1."""
    e = KeepRateEstimator(forgetting=0.5)
    for _ in range(20):
        e.update({"": (90, 100)})
    for _ in range(6):
        e.update({"": (10, 100)})
    assert abs(e.keep_rate() - 0.1) < 0.05


def test_estimator_state_round_trip_and_bad_input():
    e = KeepRateEstimator()
    e.update({"a": (3, 4), "b": (0, 4)})
    f = KeepRateEstimator()
    f.load_state_dict(e.state_dict())
    assert f.keep_rate() == e.keep_rate() and f.rounds == 1
    with pytest.raises(ValueError, match="kept .5. must be <= seen .4."):
        e.update({"a": (5, 4)})
    with pytest.raises(TypeError, match="counts must be a mapping"):
        e.update([(1, 2)])
    with pytest.raises(ValueError, match="forgetting must be in"):
        KeepRateEstimator(forgetting=0.0)
    with pytest.raises(ValueError, match="missing"):
        f.load_state_dict({"kept": {}})


def test_prompts_needed_grows_with_need_quantile_and_falling_keep_rate():
    e = KeepRateEstimator(forgetting=1.0)
    e.update({"": (500, 1000)})
    base = e.prompts_needed(100, 0.9)
    assert 200 < base < 260  # 100 / 0.5 plus a margin of about 1.3 sd
    assert e.prompts_needed(100, 0.5) < base < e.prompts_needed(100, 0.99)
    assert e.prompts_needed(200, 0.9) > base
    low = KeepRateEstimator(forgetting=1.0)
    low.update({"": (50, 1000)})
    assert low.prompts_needed(100, 0.9) > 1800
    assert e.prompts_needed(0) == 0


# --------------------------------------------------------------------------- rounding and ceiling
@pytest.mark.parametrize("value,multiple,floor,ceiling,expected", [
    (13, 4, 1, 100, 16),   # rounded up to the data-parallel size
    (1, 4, 1, 100, 4),     # the floor is itself a multiple
    (3, 4, 10, 100, 12),   # below the floor
    (97, 8, 1, 100, 96),   # above the ceiling: its largest multiple
    (0, 1, 1, 5, 1),
])
def test_round_to_multiple(value, multiple, floor, ceiling, expected):
    assert round_to_multiple(value, multiple, floor=floor, ceiling=ceiling) == expected


def test_round_to_multiple_without_room_names_the_bounds():
    with pytest.raises(ValueError, match="no multiple of 8 lies in .floor=3, ceiling=7."):
        round_to_multiple(5, 8, floor=3, ceiling=7)


def test_adaptive_size_never_exceeds_the_ceiling_and_is_a_multiple():
    """A keep rate near 0 asks for millions of prompts: the size stops at the ceiling's multiple."""
    e = KeepRateEstimator()
    e.update({"": (0, 64)})
    size = adaptive_gen_batch_size(e, 512, multiple=8, ceiling=1000)
    assert size == 1000 // 8 * 8
    e2 = KeepRateEstimator()
    e2.update({"": (64, 64)})  # everything kept: about the need, rounded to the multiple, above the floor
    assert adaptive_gen_batch_size(e2, 13, multiple=4, floor=20, ceiling=1000) == 20
    assert adaptive_gen_batch_size(e2, 30, multiple=4, ceiling=1000) % 4 == 0
    # Two target rounds: each about half of one round's size.
    one = adaptive_gen_batch_size(e2, 300, ceiling=10_000)
    assert adaptive_gen_batch_size(e2, 300, rounds=2, ceiling=10_000) == pytest.approx(one / 2, abs=1)


def test_memory_ceiling_is_what_the_kv_cache_fits():
    """(memory x fraction - weights) / (n x seq_len x KV bytes per token) prompts per replica, times DP."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=128)
    kv_per_token = 2 * 2 * 2 * 16 * 2  # K and V x layers x kv heads x head_dim x bf16 bytes
    weights = cfg.num_params() * 2
    per_prompt = 8 * 100 * kv_per_token
    mem = weights + 37 * per_prompt + 5
    one = gen_size_ceiling(cfg, memory_bytes=mem, fraction=1.0, n=8, seq_len=100, dtype_bytes=2)
    assert one == 37
    assert gen_size_ceiling(cfg, memory_bytes=mem, fraction=1.0, n=8, seq_len=100, dtype_bytes=2, dp=4) == 148
    assert gen_size_ceiling(cfg, memory_bytes=mem, fraction=0.5, n=8, seq_len=100, dtype_bytes=2) < one
    assert gen_size_ceiling(cfg, memory_bytes=1, fraction=1.0, n=8, seq_len=100, dtype_bytes=2, dp=2) == 2


def test_controller_sizes_rounds_within_floor_and_ceiling():
    cfg = Config()
    cfg.data.train_batch_size, cfg.data.gen_batch_size = 64, 96
    fg = cfg.algorithm.filter_groups
    fg.adaptive, fg.min_gen_batch_size, fg.max_gen_batch_size = True, 16, 400
    ctl = SamplingController(cfg, dp=8, ceiling=10_000)
    assert ctl.gen_size(0, 0) == 96  # nothing measured yet: the configured size
    ctl.observe_round({"": (48, 96)})
    first = ctl.gen_size(0, 0)
    assert first % 8 == 0 and 128 <= first <= 400
    assert ctl.gen_size(60, 1) == 16  # 4 groups missing: the floor
    ctl.observe_round({"": (0, 400)})
    ctl.observe_round({"": (0, 400)})
    assert ctl.gen_size(0, 0) == 400  # keep rate near 0: the ceiling (max_gen_batch_size)


@pytest.mark.parametrize("min_gen", [100, 1_000_000_000])
def test_controller_sizes_never_exceed_the_rows_whatever_min_gen_batch_size(min_gen):
    """A min_gen_batch_size above the 24 training rows (the ceiling here) is lowered to them; the first round,
    before any measurement, is data.gen_batch_size (3), not min_gen_batch_size."""
    cfg = Config()
    cfg.data.train_batch_size, cfg.data.gen_batch_size = 2, 3
    fg = cfg.algorithm.filter_groups
    fg.adaptive, fg.min_gen_batch_size = True, min_gen
    ctl = SamplingController(cfg, dp=1, ceiling=24)
    assert ctl.gen_size(0, 0) == 3
    for kept in (0, 3, 1):
        ctl.observe_round({"": (kept, 3)})
        assert ctl.gen_size(0, 0) == 24 and ctl.gen_size(1, 2) == 24  # the floor, held at the rows


def test_adaptive_run_with_min_gen_batch_size_over_the_rows_generates_gen_batch_size_first(tmp_path):
    """filter_groups.adaptive with min_gen_batch_size=100 on a 24-row train set: step 1 generates
    data.gen_batch_size (3) prompts per round, later rounds at most the 24 rows."""
    overrides = micro_setup(str(tmp_path)) + [
        "trainer.total_training_steps=2", "trainer.val_before_train=false", "data.val_files=[]",
        "algorithm.filter_groups.adaptive=true", "algorithm.filter_groups.min_gen_batch_size=100"]
    trainer = DAPOTrainer(load_config(overrides=overrides))
    sizes = []
    next_batch = trainer.generation.cursor.next_batch
    trainer.generation.cursor.next_batch = lambda: sizes.append(trainer.generation.cursor.batch_size) or next_batch()
    trainer.fit()
    assert sizes[0] == 3 and max(sizes) <= 24, sizes


@pytest.mark.timeout(240)
def test_unlimited_gen_batches_with_nothing_ever_kept_stops_after_a_pass_over_the_rows(tmp_path):
    """max_num_gen_batches=0 (unlimited) and a reward that is always 0: the step raises
    DynamicSamplingExhausted once the 24 training rows were all generated without a kept group
    (8 rounds of 3), instead of sampling forever."""
    overrides = micro_setup(str(tmp_path), ZERO_REWARD) + [
        "trainer.total_training_steps=1", "trainer.val_before_train=false", "data.val_files=[]",
        "algorithm.filter_groups.max_num_gen_batches=0"]
    with pytest.raises(dk.DynamicSamplingExhausted, match=r"8 generation batches .*whole pass over the 24 "
                                                          "training rows keeps no group"):
        DAPOTrainer(load_config(overrides=overrides)).fit()


def test_unlimited_warning_does_not_promise_a_stop_at_max_num_gen_batches():
    """With max_num_gen_batches unlimited the warning says when the step stops, not "the run then stops"."""
    msg = exhaustion_warning(step=1, rounds=3, max_rounds=0, need=2, size=3, keep_rate=0.01, seen=9,
                             all_correct=0, all_wrong=9, on_exhausted="error")
    assert "the run then stops" not in msg and "once a whole pass over the training rows keeps no group" in msg


# --------------------------------------------------------------------------- the default path
def test_adaptive_is_off_by_default_and_the_size_stays_fixed():
    fg = Config().algorithm.filter_groups
    assert not fg.adaptive and fg.on_exhausted == "error" and fg.reward_threshold_schedule == "constant"
    cfg = Config()
    cfg.data.gen_batch_size = 24
    ctl = SamplingController(cfg, dp=8, ceiling=10)
    for kept in (0, 24, 3):
        ctl.observe_round({"": (kept, 24)})
        assert ctl.gen_size(0, 0) == 24 and ctl.gen_size(5, 3) == 24


# --------------------------------------------------------------------------- warnings
def test_exhaustion_warning_names_the_all_correct_share():
    msg = exhaustion_warning(step=7, rounds=2, max_rounds=4, need=16, size=32, keep_rate=0.1, seen=64,
                             all_correct=48, all_wrong=8, on_exhausted="error")
    assert msg is not None
    assert "75% were all-correct and 12% all-wrong" in msg and "the policy solves most prompts" in msg
    assert "max_num_gen_batches=4" in msg and "on_exhausted=short_batch" in msg
    # Enough expected from the rounds left, and a keep rate above the low mark: no warning.
    assert exhaustion_warning(step=7, rounds=1, max_rounds=10, need=16, size=32, keep_rate=0.5, seen=32,
                              all_correct=8, all_wrong=8, on_exhausted="error") is None
    # Unlimited rounds still warn below LOW_KEEP_RATE.
    low = exhaustion_warning(step=1, rounds=3, max_rounds=0, need=16, size=32, keep_rate=LOW_KEEP_RATE / 2,
                             seen=96, all_correct=0, all_wrong=94, on_exhausted="error")
    assert low is not None and "unlimited" in low and "fails most prompts" in low


def test_trainer_warns_before_exhausting(tmp_path, caplog):
    """All-wrong rewards: the first round warns with the all-wrong share, then the second raises."""
    overrides = micro_setup(str(tmp_path), ZERO_REWARD) + ONE_STEP + [
        "algorithm.filter_groups.max_num_gen_batches=2", "data.gen_batch_size=2"]
    with caplog.at_level(logging.WARNING, logger="dapo_trainer.adaptive_sampling"):
        with pytest.raises(dk.DynamicSamplingExhausted):
            DAPOTrainer(load_config(overrides=overrides)).fit()
    warned = [r.getMessage() for r in caplog.records if r.name == "dapo_trainer.adaptive_sampling"]
    assert len(warned) == 1 and "0% were all-correct and 100% all-wrong" in warned[0]


def test_threshold_above_every_reward_is_blamed_not_the_policy(tmp_path, caplog):
    """A reward_threshold above every reward makes every group all-wrong: the warning and the
    exhaustion error name the threshold and the highest metric, not "the policy fails most prompts"."""
    overrides = micro_setup(str(tmp_path), ALTERNATING_REWARD) + ONE_STEP + [
        "algorithm.filter_groups.max_num_gen_batches=2", "data.gen_batch_size=2",
        "algorithm.filter_groups.reward_threshold=5.0"]
    with caplog.at_level(logging.WARNING, logger="dapo_trainer.adaptive_sampling"):
        with pytest.raises(dk.DynamicSamplingExhausted, match=r"reward_threshold=5 \(the highest filter metric"):
            DAPOTrainer(load_config(overrides=overrides)).fit()
    warned = [r.getMessage() for r in caplog.records if r.name == "dapo_trainer.adaptive_sampling"]
    assert len(warned) == 1 and "reward_threshold=5" in warned[0] and "the policy fails" not in warned[0]


# --------------------------------------------------------------------------- short batch
def test_short_batch_trains_on_the_kept_groups(tmp_path):
    """on_exhausted=short_batch: one round of 1 prompt for a train batch of 2 trains on 1 group."""
    overrides = micro_setup(str(tmp_path), ALTERNATING_REWARD) + ONE_STEP + [
        "algorithm.filter_groups.max_num_gen_batches=1", "data.gen_batch_size=1",
        "algorithm.filter_groups.on_exhausted=short_batch"]
    m = DAPOTrainer(load_config(overrides=overrides)).fit()
    assert m["sampling/short_batch"] == 1.0 and m["train/kept_groups"] == 1 and m["train/num_gen_batches"] == 1
    assert m["actor/num_updates"] == 1 and m["train/effective_batch"] == 4  # one group of n=4


def test_short_batch_without_any_kept_group_still_raises(tmp_path):
    """The error reports the configured max_num_gen_batches (2), not the accumulator's own 0."""
    overrides = micro_setup(str(tmp_path), ZERO_REWARD) + ONE_STEP + [
        "algorithm.filter_groups.max_num_gen_batches=2", "data.gen_batch_size=2",
        "algorithm.filter_groups.on_exhausted=short_batch"]
    with pytest.raises(dk.DynamicSamplingExhausted, match=r"\(max_num_gen_batches=2\).*no group to train on"):
        DAPOTrainer(load_config(overrides=overrides)).fit()


def test_short_batch_rounds_down_to_mini_batches():
    assert short_batch_groups(3, 4) == 3 and short_batch_groups(7, 4) == 4 and short_batch_groups(8, 4) == 8


def test_accumulator_takes_a_short_batch():
    acc = dk.DynamicBatchAccumulator(4, 2)
    acc.add({"x": torch.arange(6.0)}, torch.tensor([0, 0, 1, 1, 2, 2]), torch.tensor([1, 1, 0, 0, 1, 1]).bool())
    with pytest.raises(ValueError, match=r"num_groups must be in \[1, 2\]"):
        acc.take(num_groups=3)
    out = acc.take(num_groups=2)
    assert out["x"].tolist() == [0.0, 1.0, 4.0, 5.0] and out["group_index"].tolist() == [0, 0, 1, 1]
    assert acc.num_buffered_groups == 0


# --------------------------------------------------------------------------- threshold schedules
def test_threshold_schedules():
    assert ThresholdSchedule("constant", 0.5).value(9) == 0.5
    assert ThresholdSchedule().value(1) is None
    lin = ThresholdSchedule("linear", 0.2, 0.8, total_steps=4)
    assert [round(lin.value(s), 6) for s in (1, 2, 3, 4, 9)] == [0.2, 0.4, 0.6, 0.8, 0.8]
    with pytest.raises(ValueError, match="needs start and end"):
        ThresholdSchedule("linear", 0.5)


def test_target_keep_rate_threshold_moves_toward_the_target():
    """Groups all above 0.5: at 0.5 none is kept; the schedule raises the bar until about half are."""
    t = ThresholdSchedule("target_keep_rate", 0.5, 1.0, target=0.5)
    # 4 groups of 2: scores (0.6, 0.9), (0.7, 0.95), (0.55, 0.6), (0.8, 1.0).
    metric = torch.tensor([0.6, 0.9, 0.7, 0.95, 0.55, 0.6, 0.8, 1.0])
    t.observe(metric, 2)
    thr = t.value(2)
    g = metric.view(4, 2)
    kept = ((g.min(1).values < thr) & (g.max(1).values >= thr)).double().mean()
    assert 0.5 < thr <= 1.0 and float(kept) == pytest.approx(0.5, abs=0.25)
    assert float(kept) >= 0.5  # 0.5 of the groups is reachable here exactly
    constant = ThresholdSchedule("constant", 0.5)
    constant.observe(metric, 2)
    assert constant.value(2) == 0.5


def test_threshold_schedule_config_rule_names_the_key():
    with pytest.raises(ValueError, match="reward_threshold_end"):
        load_config(overrides=["algorithm.filter_groups.reward_threshold_schedule=linear",
                               "algorithm.filter_groups.reward_threshold=0.5"])
    with pytest.raises(ValueError, match="on_exhausted"):
        load_config(overrides=["algorithm.filter_groups.on_exhausted=skip"])
    with pytest.raises(ValueError, match="min_gen_batch_size"):
        load_config(overrides=["algorithm.filter_groups.min_gen_batch_size=64",
                               "algorithm.filter_groups.max_gen_batch_size=32"])


def test_round_counts_per_source():
    keep = torch.tensor([1, 1, 0, 0, 1, 1]).bool()
    assert round_counts(["a", "b", "a"], keep) == {"a": (2, 2), "b": (0, 1)}


# --------------------------------------------------------------------------- the trainer with adaptive on
def test_adaptive_run_logs_estimate_and_size_and_resumes_it(tmp_path):
    overrides = micro_setup(str(tmp_path)) + [
        "trainer.total_training_steps=3", "trainer.val_before_train=false", "data.val_files=[]",
        "algorithm.filter_groups.adaptive=true", "trainer.save_freq=1",
        "algorithm.filter_groups.reward_threshold=0.5", "algorithm.filter_groups.reward_threshold_end=0.9",
        "algorithm.filter_groups.reward_threshold_schedule=linear"]
    trainer = DAPOTrainer(load_config(overrides=overrides))
    trainer.fit()
    lines = read_metrics(os.path.join(str(tmp_path), "run"))
    for m in lines:
        assert 0 < m["sampling/keep_rate_estimate"] < 1
        assert 0 <= m["sampling/next_gen_batch_size"] <= 24  # the ceiling: the 24 training rows here
        # 0 exactly when the carried-over groups fill the next train batch (2 groups) alone.
        assert (m["sampling/next_gen_batch_size"] == 0) == (m["train/carried_over_groups"] >= 2)
        assert m["sampling/samples_per_kept_group"] >= 4 or m["train/kept_groups"] == 0
        assert 0 <= m["perf/gen_time_share"] <= 1 and "sampling/dead_loop_rate" in m
    assert [m["sampling/reward_threshold"] for m in lines] == pytest.approx([0.5, 0.7, 0.9])
    est = trainer.generation.sampling.estimator
    resumed = DAPOTrainer(load_config(overrides=overrides))
    assert resumed.generation.sampling.estimator.keep_rate() == est.keep_rate()
    assert resumed.generation.sampling.steps == 3 and not math.isnan(est.keep_rate())
