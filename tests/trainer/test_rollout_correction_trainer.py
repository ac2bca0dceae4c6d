"""``algorithm.rollout_correction`` in the trainer (issue 42), as verl 0.9.1 runs it.

verl's keys and defaults load (everything off) and bad values are errors naming the dotted key at load;
the embedded sampler's log-probs are the trainer's old log-probs on the same weights; after the
old-log-prob pass ``dk.rollout_correction`` hands its IS weights and rejection-masked response mask to
the loss and verl's ``rollout_corr/*`` metrics to the step's metrics; ``bypass_mode`` has no
old-log-prob forward (the rollout's log-probs are the old ones) and trains; with the correction off a
run is the run it was before.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import fields

import pytest
import torch

import dapo_kernels as dk
from dapo_trainer.actor import Actor, from_grid, to_grid
from dapo_trainer.config import RolloutCorrectionConfig, all_keys, load_config
from dapo_trainer.metrics import read_metrics
from dapo_trainer.trainer import DAPOTrainer
from tests.trainer.tiny import micro_setup

RC = "algorithm.rollout_correction"
ON = ["actor_rollout_ref.rollout.calculate_log_probs=true"]
QUIET = ["trainer.val_before_train=false", "data.val_files=[]"]
# Two mini-batches per step: without bypass_mode the old log-probs are recomputed every step.
TWO_MINI = ["actor_rollout_ref.actor.ppo_mini_batch_size=1"]

# verl 0.9.1's metric keys for rollout_is=token (rollout_corr_helper.compute_is_metrics and
# compute_offpolicy_metrics; tests/test_verl_rollout_correction.py checks dk's against verl itself).
VERL_OFFPOLICY = ["training_ppl", "training_log_ppl", "kl", "k3_kl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
                  "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq"]
VERL_TOKEN_IS = ["rollout_is_mean", "rollout_is_max", "rollout_is_min", "rollout_is_ratio_fraction_high",
                 "rollout_is_ratio_fraction_low", "rollout_is_std", "rollout_is_eff_sample_size", "rollout_is_seq_mean",
                 "rollout_is_seq_std", "rollout_is_seq_max", "rollout_is_seq_min", "rollout_is_seq_max_deviation",
                 "rollout_is_seq_fraction_high", "rollout_is_seq_fraction_low"]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls on a shared machine: a second thread only waits
    yield
    torch.set_num_threads(threads)


def _trainer(root, *extra) -> DAPOTrainer:
    return DAPOTrainer(load_config(overrides=micro_setup(str(root)) + QUIET + list(extra)))


def _corr(m: dict) -> dict:
    return {k: v for k, v in m.items() if k.startswith("rollout_corr/")}


class _LossSpy:
    """Every ``dk.fused_linear_policy_loss`` call of the update, with the micro-batch record it was made for."""

    def __init__(self, monkeypatch):
        self.calls = []
        real_loss, real_micro = dk.fused_linear_policy_loss, Actor._micro_loss
        pending = []

        def micro(actor, hidden, mb, *args):
            pending.append(mb)
            return real_micro(actor, hidden, mb, *args)

        def loss(hidden, weight, labels, old_log_prob, advantages, response_mask, **kw):
            self.calls.append(dict(mb=pending.pop(), old_log_prob=old_log_prob, response_mask=response_mask, **kw))
            return real_loss(hidden, weight, labels, old_log_prob, advantages, response_mask, **kw)

        monkeypatch.setattr(Actor, "_micro_loss", micro)
        monkeypatch.setattr(dk, "fused_linear_policy_loss", loss)


def _perturb_rollout(monkeypatch, trainer, shift):
    """The rollout's log-probs lowered by ``shift(grid shape)`` at every sampled token: the trainer's old
    log-probs are then ``exp(shift)`` times the rollout's probabilities there (the sampler matches the
    trainer to ~1e-7). Returns the list the step's train batches (after the shift) are appended to."""
    real, batches = trainer.generation.collect, []

    def collect(step):
        batch, metrics = real(step)
        batch.log_probs = batch.log_probs - shift(batch.log_probs.shape) * batch.sampled
        batches.append(batch)
        return batch, metrics

    monkeypatch.setattr(trainer.generation, "collect", collect)
    return batches


def _pattern(shape):
    """0, 0.3, 1.0, 0, 0.3, ... over the [N, R] cells: ratios 1, 1.35 and e."""
    return torch.tensor([0.0, 0.3, 1.0]).repeat(shape[0] * shape[1] // 3 + 1)[:shape[0] * shape[1]].view(shape)


# --------------------------------------------------------------------------- config
def test_verl_keys_load_with_verl_defaults():
    """Every key of verl 0.9.1's algorithm.rollout_correction (its rollout_correction.yaml: everything off) and
    actor_rollout_ref.rollout.calculate_log_probs exists with verl's default; set, each keeps its value: a
    "lower_upper" spec stays a string, a number is a float."""
    keys = set(all_keys())
    verl = {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False, "rollout_rs": None,
            "rollout_rs_threshold": None, "bypass_mode": False, "loss_type": "ppo_clip"}
    assert {f"{RC}.{k}" for k in verl} | {"actor_rollout_ref.rollout.calculate_log_probs"} <= keys
    cfg = load_config()
    assert {f.name: getattr(cfg.algorithm.rollout_correction, f.name) for f in fields(RolloutCorrectionConfig)} == verl
    assert cfg.actor_rollout_ref.rollout.calculate_log_probs is False
    cfg = load_config(overrides=ON + [f"{RC}.rollout_is=sequence", f"{RC}.rollout_is_threshold=0.5_5.0",
                                      f"{RC}.rollout_is_batch_normalize=true", f"{RC}.rollout_rs=token_k1,seq_max_k3",
                                      f"{RC}.rollout_rs_threshold='0.9_1.1,0.01'", f"{RC}.bypass_mode=true"])
    rc = cfg.algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_batch_normalize, rc.rollout_rs,
            rc.rollout_rs_threshold, rc.bypass_mode) == ("sequence", "0.5_5.0", True, "token_k1,seq_max_k3",
                                                         "0.9_1.1,0.01", True)
    assert load_config(overrides=[f"{RC}.rollout_is_threshold=3"]).algorithm.rollout_correction.rollout_is_threshold \
        == 3.0


@pytest.mark.parametrize("overrides,key,match", [
    ([f"{RC}.rollout_is=tokens"], f"{RC}.rollout_is", "'token' or 'sequence'"),
    ([f"{RC}.rollout_is_threshold=abc"], f"{RC}.rollout_is_threshold", "not a number"),
    ([f"{RC}.rollout_is_threshold=-1"], f"{RC}.rollout_is_threshold", "> 0"),
    ([f"{RC}.rollout_is_threshold=nan"], f"{RC}.rollout_is_threshold", "finite"),
    ([f"{RC}.rollout_is_threshold=2.0_0.5"], f"{RC}.rollout_is_threshold", "lower bound"),
    (ON + [f"{RC}.rollout_rs=token_k4", f"{RC}.rollout_rs_threshold=2"], f"{RC}.rollout_rs", "unknown option"),
    (ON + [f"{RC}.rollout_rs=token_k2"], f"{RC}.rollout_rs_threshold", "must be given"),
    (ON + [f"{RC}.rollout_rs=token_k2", f"{RC}.rollout_rs_threshold=0.5_2.0"], f"{RC}.rollout_rs_threshold",
     "only \\*_k1"),
    (ON + [f"{RC}.rollout_rs=token_k1,token_k2", f"{RC}.rollout_rs_threshold='2,3,4'"], f"{RC}.rollout_rs_threshold",
     "3 thresholds for 2"),
    ([f"{RC}.rollout_rs_threshold=-0.5"], f"{RC}.rollout_rs_threshold", "> 0"),
    ([f"{RC}.loss_type=reinforce"], f"{RC}.loss_type", "not implemented"),
    ([f"{RC}.loss_type=pg"], f"{RC}.loss_type", "'ppo_clip' or 'reinforce'"),
    ([f"{RC}.rollout_is=token"], "actor_rollout_ref.rollout.calculate_log_probs", "rollout_is=token needs"),
    ([f"{RC}.bypass_mode=true"], "actor_rollout_ref.rollout.calculate_log_probs", "bypass_mode=true needs"),
    (ON + [f"{RC}.bypass_mode=true", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
     f"{RC}.bypass_mode", "sequence parallelism"),
], ids=["is-level", "is-text", "is-negative", "is-nan", "is-icepop-order", "rs-option", "rs-no-threshold",
        "rs-k2-pair", "rs-count", "rs-negative", "reinforce", "loss-type", "is-without-log-probs",
        "bypass-without-log-probs", "bypass-sp"])
def test_bad_values_name_the_key_at_load(overrides, key, match):
    """A bad value is a ValueError naming the dotted key when the config loads (no model is built yet). Correction
    asked for without calculate_log_probs is refused too: verl would skip the decoupled correction silently
    (and raise at the first step in bypass_mode)."""
    with pytest.raises(ValueError, match=re.escape(f"'{key}'") + ".*" + match):
        load_config(overrides=overrides)


# --------------------------------------------------------------------------- rollout log-probs
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)], ids=["T1", "T0.7-p0.8"])
def test_sampler_log_probs_are_the_trainers_old_log_probs(tmp_path, temperature, top_p):
    """The train batch's rollout log-probs (TrainBatch.log_probs, the embedded sampler's, under the temperature it
    sampled at, no top-p renormalisation) match the actor's old-log-prob pass on the same weights, cell by cell of
    the [N, R] grid the correction reads: test_rollout_embedded.py's sampler-vs-recomputation tolerance."""
    trainer = _trainer(tmp_path, *ON, *TWO_MINI, f"actor_rollout_ref.rollout.temperature={temperature}",
                       f"actor_rollout_ref.rollout.top_p={top_p}")
    actor = trainer.actor
    batch, _ = trainer.generation.collect(1)
    plan = actor.plan(batch)
    packed = [[actor.pack(batch, rows) for rows in p.micro] for p in plan]
    old = to_grid(packed, actor.log_probs(actor.model, plan, packed), tuple(batch.log_probs.shape), actor.device)
    assert batch.log_probs.dtype == torch.float32 and batch.log_probs.shape == batch.response_ids.shape
    sampled = batch.sampled
    assert int(sampled.sum()) == int(batch.response_len.sum()) > 0
    assert torch.equal(batch.log_probs[~sampled], torch.zeros(int((~sampled).sum())))
    diff = (old - batch.log_probs)[sampled].abs()
    assert diff.mean() < 1e-4 and diff.max() < 1e-3, f"mean {diff.mean():.2e} max {diff.max():.2e}"


# --------------------------------------------------------------------------- decoupled correction
def test_token_is_run_logs_verl_metrics(tmp_path):
    """A two-step run with rollout_is=token writes verl's rollout_corr/* names (IS and off-policy metrics, nothing
    else) with finite values to metrics.jsonl every step, and dapo-report plots them."""
    from dapo_trainer.tools import report

    _trainer(tmp_path, *ON, f"{RC}.rollout_is=token", "trainer.total_training_steps=2").fit()
    run = os.path.join(str(tmp_path), "run")
    lines = read_metrics(run)
    assert [m["step"] for m in lines] == [1, 2]
    want = {f"rollout_corr/{k}" for k in VERL_TOKEN_IS + VERL_OFFPOLICY}
    for m in lines:
        assert set(_corr(m)) == want
        assert all(math.isfinite(v) for v in _corr(m).values()), _corr(m)
        assert 0 < m["rollout_corr/rollout_is_min"] <= m["rollout_corr/rollout_is_mean"] <= \
            m["rollout_corr/rollout_is_max"] <= 2.0
    # Step 1 samples with the weights it trains: only the sampler's rounding separates the two policies.
    assert abs(lines[0]["rollout_corr/kl"]) < 1e-5 and abs(lines[0]["rollout_corr/rollout_is_mean"] - 1) < 1e-4
    html = open(report.write_report(run)).read()
    assert 'src="rollout_corr.png"' in html and 'src="rollout_corr_is.png"' in html


def test_is_weights_and_rejection_reach_the_loss(tmp_path, monkeypatch):
    """After the old-log-prob pass (forced on-policy: one mini-batch here), dk.rollout_correction's token IS
    weights (TIS at 2) and its token_k1 rejection ([0.5, 1.5]) go into every loss call: rollout log-probs
    lowered by 0, 0.3 and 1 give weights exp(0.3) and the cut 2, the tokens at ratio e leave the loss's mask and
    its token count; verl's masked fractions say so."""
    trainer = _trainer(tmp_path, *ON, f"{RC}.rollout_is=token", f"{RC}.rollout_rs=token_k1",
                       f"{RC}.rollout_rs_threshold=0.5_1.5")
    batches = _perturb_rollout(monkeypatch, trainer, _pattern)
    spy = _LossSpy(monkeypatch)
    calls = []
    real_log_probs = Actor.log_probs
    monkeypatch.setattr(Actor, "log_probs", lambda self, *a: calls.append(1) or real_log_probs(self, *a))
    m = trainer.train_step()
    assert calls == [1], "on-policy, the correction still needs the old-log-prob pass"
    (batch,) = batches
    shift, sampled = _pattern(batch.log_probs.shape), batch.sampled
    rejected = sampled & (shift == 1.0)
    kept = sampled & ~rejected
    assert rejected.any() and kept.any()
    weights = torch.where(sampled, torch.exp(shift).clamp(max=2.0), 0.0)  # (a rejected token keeps its weight)
    assert len(spy.calls) == sum(len(p.micro) for p in trainer.actor.plan(batch))
    for c in spy.calls:
        mb = c["mb"]
        assert c["old_log_prob"] is None  # one mini-batch, one epoch: the op's own forward stays the ratio's base
        assert torch.equal(c["response_mask"], from_grid(mb, kept)) and torch.equal(mb.mask, c["response_mask"])
        torch.testing.assert_close(c["rollout_is_weights"], from_grid(mb, weights), rtol=1e-5, atol=0)
        assert int(c["num_tokens"]) == int(kept.sum())  # verl's token count is the rejection-masked one
    n = float(sampled.sum())
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(float(rejected.sum()) / n, rel=1e-6)
    assert m["rollout_corr/rollout_rs_token_k1_masked_fraction"] == pytest.approx(float(rejected.sum()) / n, rel=1e-6)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(float(rejected.sum()) / n, rel=1e-6)
    assert m["rollout_corr/rollout_is_max"] == 2.0 and m["actor/num_updates"] == 1
    assert "timing_s/old_log_prob" in m


# --------------------------------------------------------------------------- bypass_mode
def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("rs", [False, True], ids=["ppo-clip", "ppo-clip-token-k1-rs"])
def test_bypass_mode_skips_the_old_log_prob_forward_and_trains(tmp_path, monkeypatch, rs):
    """bypass_mode (verl's two-policy mode) with two mini-batches, which otherwise recompute the old log-probs:
    no log-prob forward before the update and no old_log_prob phase in the timings; every loss call takes the
    rollout's log-probs as its old log-probs and no IS weights (PPO-clip's ratio is the correction); the
    per-micro-batch rollout_corr/* metrics of the current vs the rollout policy are logged, and the weights move.
    With rollout_rs, the tokens the current policy puts at ratio e to the (lowered) rollout leave the loss."""
    extra = [f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=0.5_1.5"] if rs else []
    trainer = _trainer(tmp_path, *ON, *TWO_MINI, f"{RC}.bypass_mode=true", *extra)
    batches = _perturb_rollout(monkeypatch, trainer, _pattern if rs else (lambda shape: torch.zeros(shape)))
    spy = _LossSpy(monkeypatch)
    calls = []
    real_log_probs = Actor.log_probs
    monkeypatch.setattr(Actor, "log_probs", lambda self, *a: calls.append(1) or real_log_probs(self, *a))
    before = _weights(trainer)
    m = trainer.train_step()
    assert calls == [] and "timing_s/old_log_prob" not in m
    assert m["actor/num_updates"] == 2 and any(not torch.equal(before[k], v) for k, v in _weights(trainer).items())
    (batch,) = batches
    assert spy.calls
    minis = {int(batch.sampled[:4].sum()), int(batch.sampled[4:].sum())}  # rows of mini-batch 1 and 2
    in_loss = 0
    for c in spy.calls:
        mb = c["mb"]
        assert torch.equal(c["old_log_prob"], from_grid(mb, batch.log_probs)) and c["rollout_is_weights"] is None
        assert int(c["num_tokens"]) in minis  # the mini-batch's tokens before rejection, as verl's bypass counts
        in_loss += int(c["response_mask"].sum())
        if rs:
            rejected = from_grid(mb, batch.sampled & (_pattern(batch.log_probs.shape) == 1.0))
            assert not (c["response_mask"] & rejected).any()
        else:
            assert torch.equal(c["response_mask"], mb.mask)
    assert (in_loss < int(batch.sampled.sum())) if rs else (in_loss == int(batch.sampled.sum()))
    want = set(VERL_OFFPOLICY) | ({"rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction"} if rs else set())
    assert want <= {k.removeprefix("rollout_corr/") for k in _corr(m)}
    assert all(math.isfinite(v) for v in _corr(m).values())
    if rs:
        assert m["rollout_corr/rollout_rs_masked_fraction"] > 0.2


def test_decoupled_mode_recomputes_where_bypass_does_not(tmp_path, monkeypatch):
    """The same two-mini-batch step without bypass_mode runs the old-log-prob forward once and times it, so the
    phase bypass_mode drops is there to drop."""
    trainer = _trainer(tmp_path, *ON, *TWO_MINI)
    calls = []
    real_log_probs = Actor.log_probs
    monkeypatch.setattr(Actor, "log_probs", lambda self, *a: calls.append(1) or real_log_probs(self, *a))
    m = trainer.train_step()
    assert calls == [1] and m["timing_s/old_log_prob"] > 0
    assert set(_corr(m)) == {f"rollout_corr/{k}" for k in VERL_OFFPOLICY}  # verl's metrics-only mode


# --------------------------------------------------------------------------- correction off
@pytest.mark.parametrize("mini", ["1", "2"], ids=["off-policy", "on-policy"])
def test_correction_off_leaves_the_run_unchanged(tmp_path, monkeypatch, mini):
    """With calculate_log_probs false (the default) the keys change nothing: a run with every correction key
    given (thresholds changed, correction not asked for) logs the same metrics, bit for bit, and ends at the
    same weights as the run without the keys (main's config); no rollout_corr/* metric, no IS weights, the
    sampled mask in the loss, and on-policy no old-log-prob forward."""
    steps = ["trainer.total_training_steps=2", f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}"]
    keys = ["actor_rollout_ref.rollout.calculate_log_probs=false", f"{RC}.rollout_is=null",
            f"{RC}.rollout_is_threshold=0.5_5.0", f"{RC}.rollout_is_batch_normalize=true", f"{RC}.rollout_rs=null",
            f"{RC}.rollout_rs_threshold=0.9_1.1", f"{RC}.bypass_mode=false", f"{RC}.loss_type=ppo_clip"]
    runs = []
    for name, extra in (("main", []), ("keys", keys)):
        trainer = _trainer(tmp_path / name, *steps, *extra)
        spy = _LossSpy(monkeypatch)
        calls = []
        real_log_probs = Actor.log_probs
        monkeypatch.setattr(Actor, "log_probs", lambda self, *a: calls.append(1) or real_log_probs(self, *a))
        trainer.fit()
        monkeypatch.undo()
        assert all(c["rollout_is_weights"] is None and torch.equal(c["response_mask"], c["mb"].mask)
                   for c in spy.calls)
        assert len(calls) == (2 if mini == "1" else 0)
        lines = [{k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/"))}
                 for m in read_metrics(str(tmp_path / name / "run"))]
        runs.append((lines, _weights(trainer)))
    (main_lines, main_w), (lines, w) = runs
    assert lines == main_lines and not any(_corr(m) for m in lines)
    assert all(torch.equal(main_w[k], w[k]) for k in main_w)


# --------------------------------------------------------------------------- parallel layouts
@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_dp2_and_sp2_correct_the_whole_batch_as_one_process(tmp_path):
    """Under DP=2 and SP=2 (torchrun, two gloo processes) each rank computes the old log-probs of its rows /
    token shard only; summed into the whole [N, R] grid, the correction (token IS + token_k1 and seq_mean_k3
    rejection) gives one process's rollout_corr/* metrics and losses, as verl's driver corrects the whole batch."""
    from tests.trainer.test_multiproc_train import COMPARED, RUN, _torchrun

    base = micro_setup(str(tmp_path)) + RUN + ON + [
        f"{RC}.rollout_is=token", f"{RC}.rollout_rs=token_k1,seq_mean_k3",
        f"{RC}.rollout_rs_threshold='0.999_1.001,0.0001'"]
    DAPOTrainer(load_config(overrides=base)).fit()
    single = read_metrics(str(tmp_path / "run"))
    assert any(m["rollout_corr/rollout_rs_masked_fraction"] > 0 for m in single)  # step 2: carried-over staleness
    for name, extra in (("dp2", []), ("sp2", ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"])):
        run_dir = tmp_path / name
        _torchrun(base + [f"trainer.default_local_dir={run_dir}"] + extra)
        lines = read_metrics(str(run_dir))
        assert [m["step"] for m in lines] == [1, 2], name
        for ref, got in zip(single, lines):
            assert set(_corr(got)) == set(_corr(ref)), name
            for key in COMPARED + sorted(_corr(ref)):
                assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (name, ref["step"], key)
