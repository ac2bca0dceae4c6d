"""Asynchronous generation (``async_training.*``, issue 42) on the CPU.

Rollout worker processes generate the next train batches while the trainer trains; the weights reach
them every ``trigger_parameter_sync_step`` steps; the weight version each batch was sampled by lags the
trainer's by at most ``max_staleness`` (checked on the logged versions); with staleness 0 and one
worker a run equals the synchronous trainer's; dynamic sampling and the adaptive controller train every
kept group once across the overlap; a checkpoint taken while a worker generates resumes as the
uninterrupted run (staleness 0: exact); bad values are errors naming the dotted key before any worker
starts; a failed, hung or orphaned worker is named and never outlives the trainer.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import dapo_kernels as dk
from dapo_trainer.actor import Actor
from dapo_trainer.async_rollout import RolloutWorkerError, WorkerSpec, _build_stage, max_staleness
from dapo_trainer.config import load_config
from dapo_trainer.hf_io import load_hf_model
from dapo_trainer.metrics import read_metrics
from dapo_trainer.state_file import load_state_file
from dapo_trainer.trainer import DAPOTrainer
from tests.trainer.tiny import ZERO_REWARD, micro_setup

QUIET = ["trainer.val_before_train=false", "data.val_files=[]", "trainer.save_freq=0"]
ASYNC = ["async_training.enable=true", "async_training.worker_timeout_s=120"]
# Rows whose answer is even: rewards 1, 0, 1, 0, ... (mixed: kept); odd: 0 (uniform: dropped). Which groups
# dynamic sampling keeps depends on the data cursor only, not on the weights that sampled them.
KEYED_REWARD = """
_calls = [0]
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if int(ground_truth) % 2:
        return 0.0
    _calls[0] += 1
    return float(_calls[0] % 2)
"""
HANGING_REWARD = """
import time
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(600)
    return 0.0
"""
# Per step, what timing decides (waits, what was queued, the workers' own timings).
_TIMED = ("timing_s/", "perf/", "fully_async/total_wait_time", "fully_async/gen_time_hidden",
          "fully_async/queued_batches", "fully_async/rollouter/")


pytestmark = pytest.mark.usefixtures("one_thread")


def _children(pid: int) -> set:
    """The live child processes of ``pid`` (Linux /proc; zombies count as gone)."""
    out = set()
    task_dir = f"/proc/{pid}/task"
    for tid in os.listdir(task_dir) if os.path.isdir(task_dir) else []:
        try:
            with open(f"{task_dir}/{tid}/children") as f:
                out |= {int(c) for c in f.read().split()}
        except OSError:
            continue
    return {c for c in out if _alive(c)}


def _workers_left(before: set) -> set:
    """This process's live children not there ``before``, but multiprocessing's resource tracker (one per
    process, started by the first spawn, kept for the next ones)."""
    from multiprocessing import resource_tracker

    return _children(os.getpid()) - before - {getattr(resource_tracker._resource_tracker, "_pid", None)}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def no_children_left():
    """After the test: this process has no child left (every rollout worker stopped)."""
    before = _children(os.getpid())
    yield
    deadline = time.monotonic() + 10
    while _workers_left(before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _workers_left(before), "rollout worker processes outlived the trainer"


def _untimed(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(_TIMED)}


def _run(root, *extra) -> list:
    DAPOTrainer(load_config(overrides=micro_setup(str(root)) + QUIET + list(extra))).fit()
    return read_metrics(os.path.join(str(root), "run"))


# --------------------------------------------------------------------------- config
@pytest.mark.parametrize("override,key", [
    ("async_training.staleness_threshold=-0.5", "async_training.staleness_threshold"),
    ("async_training.trigger_parameter_sync_step=0", "async_training.trigger_parameter_sync_step"),
    ("async_training.require_batches=0", "async_training.require_batches"),
    ("async_training.worker_timeout_s=0", "async_training.worker_timeout_s"),
    ("rollout.nnodes=2", "rollout.nnodes"),
    ("rollout.n_gpus_per_node=0", "rollout.n_gpus_per_node"),
    ("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.name"),
    ("trainer.device=cuda", "trainer.device"),
])
def test_bad_values_name_the_key_at_load(override, key):
    """A bad async value is a ValueError naming its dotted key when the config loads (no process yet)."""
    with pytest.raises(ValueError, match=re.escape(f"'{key}'")):
        load_config(overrides=ASYNC + [override])


def test_use_rollout_log_probs_with_decoupled_correction_is_refused():
    """verl's actor.use_rollout_log_probs under decoupled rollout correction would weigh the rollout's
    log-probs against themselves: refused, naming the key (bypass_mode is that mode)."""
    with pytest.raises(ValueError, match=r"'actor_rollout_ref\.actor\.use_rollout_log_probs'.*bypass_mode=true"):
        load_config(overrides=["actor_rollout_ref.actor.use_rollout_log_probs=true",
                               "actor_rollout_ref.rollout.calculate_log_probs=true",
                               "algorithm.rollout_correction.rollout_is=token"])


def test_use_rollout_log_probs_trains_without_the_old_log_prob_forward(tmp_path, monkeypatch):
    """Two mini-batches (off-policy): the old log-probs are the sampler's, so no old-log-prob pass runs."""
    passes, real = [], Actor._with_log_probs

    def spy(self, model, plan, packed, name):
        passes.append(name)
        return real(self, model, plan, packed, name)

    monkeypatch.setattr(Actor, "_with_log_probs", spy)
    lines = _run(tmp_path, "trainer.total_training_steps=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                 "actor_rollout_ref.actor.use_rollout_log_probs=true")
    assert "old_log_prob" not in passes and "timing_s/old_log_prob" not in lines[0]
    assert lines[0]["actor/pg_clipfrac"] == lines[0]["actor/pg_clipfrac"]  # trained, finite


def test_more_workers_than_rows_is_refused_before_any_worker_starts(tmp_path, no_children_left):
    before = _children(os.getpid())  # (other tests in this process may have left helpers: wandb, compile workers)
    overrides = micro_setup(str(tmp_path), n_train=3) + QUIET + ASYNC + ["rollout.n_gpus_per_node=4"]
    with pytest.raises(ValueError, match=r"rollout\.n_gpus_per_node=4 rollout workers, but data\.train_files has 3"):
        DAPOTrainer(load_config(overrides=overrides))
    assert not _workers_left(before)


# --------------------------------------------------------------------------- messages
def test_batch_message_round_trips_without_pickle_and_refuses_other_bytes():
    """A worker's batch crosses processes as safetensors + JSON bytes; anything else (a pickle) is refused
    naming the sender, never unpickled."""
    import pickle

    from dapo_trainer.async_rollout import BatchMessage, QueuedBatch
    from tests.trainer.tiny import train_batch

    batch = train_batch(prompt_ids=torch.arange(6).view(2, 3), response_ids=torch.arange(8).view(2, 4),
                        group_index=torch.tensor([0, 0]))
    msg = BatchMessage(QueuedBatch(5, 2, batch, {"timing_s/gen": 0.5}), {"cursor": {"epoch": 1, "pos": 3}})
    back = BatchMessage.from_bytes(msg.to_bytes(), "worker 1")
    assert back.item.index == 5 and back.item.version == 2 and back.item.metrics == {"timing_s/gen": 0.5}
    assert all(torch.equal(getattr(back.item.batch, k), getattr(batch, k)) for k in ("prompt_ids", "group_index"))
    assert back.generation == {"cursor": {"epoch": 1, "pos": 3}}
    with pytest.raises(ValueError, match="worker 1 is not a dapo_trainer state"):
        BatchMessage.from_bytes(pickle.dumps({"index": 5}), "worker 1")


# --------------------------------------------------------------------------- the stream
def test_staleness_zero_one_worker_equals_the_synchronous_trainer(tmp_path, no_children_left):
    """One worker, staleness 0, a sync every step: every batch is sampled by the weights the synchronous
    trainer samples it with, from the same data cursor and seeds: every logged value but the timings equals."""
    steps = ["trainer.total_training_steps=2"]
    sync = _run(tmp_path / "sync", *steps)
    asy = _run(tmp_path / "async", *steps, *ASYNC, "async_training.staleness_threshold=0",
               "async_training.trigger_parameter_sync_step=1")
    assert [m["step"] for m in asy] == [1, 2]
    assert all(m["fully_async/staleness/max"] == 0 for m in asy)
    for s, a in zip(sync, asy):
        a = {k: v for k, v in _untimed(a).items() if not k.startswith("fully_async/")}
        assert a == _untimed(s)


def test_workers_generate_ahead_sync_every_t_steps_within_the_staleness_bound(tmp_path, no_children_left):
    """Two workers, staleness 1, a sync every 2 steps: the trainer's version at step s is (s - 1) // 2,
    every batch's sampling version lags it by 0..max_staleness (1), the bound is reached (the workers
    sampled batches 2 and 3 with version 0 while steps 1 and 2 trained) and generation ran hidden."""
    lines = _run(tmp_path, "trainer.total_training_steps=6", *ASYNC, "rollout.n_gpus_per_node=2",
                 "async_training.staleness_threshold=1", "async_training.trigger_parameter_sync_step=2")
    cfg = load_config(overrides=ASYNC + ["async_training.staleness_threshold=1",
                                         "async_training.trigger_parameter_sync_step=2"])
    bound = max_staleness(cfg)
    assert bound == 1
    assert [m["step"] for m in lines] == list(range(1, 7))
    for m in lines:
        version, sampled = m["fully_async/count/current_param_version"], m["fully_async/staleness/min_version"]
        assert version == (m["step"] - 1) // 2
        assert 0 <= version - sampled <= bound, m
        assert m["fully_async/staleness/max"] == version - sampled
    assert max(m["fully_async/staleness/max"] for m in lines) == 1
    assert lines[-1]["fully_async/count/stale_trajectory_processed"] > 0
    assert sum(m["fully_async/gen_time_hidden"] for m in lines) > 0
    assert all(m["train/kept_groups"] <= m["train/seen_groups"] for m in lines)


def test_workers_run_below_the_trainers_priority(tmp_path, monkeypatch, no_children_left):
    """The trainer's step is the critical path: every rollout worker runs 10 nice levels below it (on two
    cores with two workers the trainer keeps a core while it trains)."""
    import dapo_trainer.async_rollout as ar

    seen = []
    connect = ar.AsyncRollout._connect

    def spy(self):  # once connected every worker has started, and set its priority first
        engine = connect(self)
        seen.extend(os.getpriority(os.PRIO_PROCESS, p.pid) for p in self.procs)
        return engine

    monkeypatch.setattr(ar.AsyncRollout, "_connect", spy)
    _run(tmp_path, "trainer.total_training_steps=1", *ASYNC, "rollout.n_gpus_per_node=2")
    assert seen == [min(os.getpriority(os.PRIO_PROCESS, 0) + 10, 19)] * 2


def test_rollout_correction_metrics_show_the_staleness(tmp_path, no_children_left):
    """One-step off-policy (staleness 1, a sync every step) with rollout correction's metrics on: step 1
    trains the batch its weights sampled (rollout vs old log-probs differ by float noise only), every
    later step a batch sampled one version back, which the off-policy diagnostics show."""
    lines = _run(tmp_path, "trainer.total_training_steps=4", *ASYNC, "async_training.staleness_threshold=1",
                 "async_training.trigger_parameter_sync_step=1", "actor_rollout_ref.rollout.calculate_log_probs=true",
                 "algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.actor.optim.lr=1e-2",
                 "async_training.partial_rollout=false")
    lag = [m["fully_async/staleness/max"] for m in lines]
    diff = [m["rollout_corr/log_ppl_abs_diff"] for m in lines]
    assert lag[0] == 0 and lag[1:] == [1, 1, 1], lag
    assert diff[0] < 1e-4 and min(diff[1:]) > 10 * max(diff[0], 1e-5), diff


def _groups(batch) -> list:
    """A train batch's groups in order, each as its prompt (every group full: rollout.n rows of one prompt)."""
    out = []
    for g in torch.unique_consecutive(batch.group_index):
        rows = (batch.group_index == g).nonzero().squeeze(1)
        assert len(rows) == 4 and all(torch.equal(batch.prompt_ids[r], batch.prompt_ids[rows[0]]) for r in rows)
        out.append(tuple(batch.prompt_ids[rows[0]].tolist()))
    return out


def test_dynamic_sampling_and_adaptive_size_train_every_kept_group_once(tmp_path, monkeypatch, no_children_left):
    """Two workers, 2 batches per step, staleness 1, adaptive generation size, carry-over: the groups
    trained, step by step, are exactly those the workers' GenerationStages keep in stream order (batch i
    from worker i % 2, collect(i + 1)), each a full group: none lost, none trained twice. The keep rule
    depends on the prompt only (KEYED_REWARD), so the expected stream is the stages' own, re-run here."""
    trained, real = [], Actor.update

    def record(self, batch):
        trained.append(_groups(batch))
        return real(self, batch)

    monkeypatch.setattr(Actor, "update", record)
    extra = [*ASYNC, "rollout.n_gpus_per_node=2", "async_training.require_batches=2",
             "async_training.staleness_threshold=1", "async_training.trigger_parameter_sync_step=1",
             "algorithm.filter_groups.adaptive=true", "data.gen_batch_size=2"]
    overrides = micro_setup(str(tmp_path), KEYED_REWARD) + QUIET + ["trainer.total_training_steps=3"] + extra
    lines = (DAPOTrainer(load_config(overrides=overrides)).fit(), read_metrics(os.path.join(str(tmp_path), "run")))[1]
    assert len(trained) == 3 and all(len(t) == 4 for t in trained)  # 2 batches x train_batch_size 2
    assert sum(m["train/num_gen_batches"] for m in lines) > 0
    cfg = load_config(overrides=overrides)
    stages = [_build_stage(WorkerSpec(rank=w, world=2, cfg=cfg, model_dir=f"{tmp_path}/model", store_port=0,
                                      specs=[], start_index=w, generation_state=None, threads=1))[2]
              for w in range(2)]
    expected = [[g for i in (2 * s, 2 * s + 1) for g in _groups(stages[i % 2].collect(i + 1)[0])] for s in range(3)]
    assert trained == expected
    dropped = sum(m["train/seen_groups"] - m["train/kept_groups"] for m in lines)
    assert dropped > 0  # dynamic sampling did drop groups (odd answers)


# Rows with an even answer: mixed rewards (kept), odd: 0 (dropped); the first response of each group waits
# 0.2 s, so one collect takes several dynamic-sampling rounds that outlast a training step.
SLOW_KEYED_REWARD = """
import time
_calls = [0]
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    _calls[0] += 1
    if _calls[0] % 4 == 1:
        time.sleep(0.2)
    return 0.0 if int(ground_truth) % 2 else float(_calls[0] % 2)
"""


@pytest.mark.parametrize("partial", [True, False], ids=["partial", "between-batches"])
def test_partial_rollout_loads_new_weights_inside_a_batch(tmp_path, partial, no_children_left):
    """One worker always behind the trainer (each collect takes several slow rounds): with partial_rollout
    the versions pushed meanwhile are loaded inside the batches (between decode steps; the engine test
    checks what the responses then hold), the batch still tagged with the version it started with, within
    the bound; without it a worker never swaps weights mid-batch."""
    overrides = micro_setup(str(tmp_path), SLOW_KEYED_REWARD) + QUIET + ASYNC + [
        "trainer.total_training_steps=4", "data.gen_batch_size=1", "async_training.staleness_threshold=2",
        "async_training.trigger_parameter_sync_step=1", f"async_training.partial_rollout={str(partial).lower()}"]
    DAPOTrainer(load_config(overrides=overrides)).fit()
    lines = read_metrics(os.path.join(str(tmp_path), "run"))
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    swaps = [m["fully_async/partial/weight_swaps"] for m in lines]
    for m in lines:
        version, sampled = m["fully_async/count/current_param_version"], m["fully_async/staleness/min_version"]
        assert 0 <= version - sampled <= 2
        assert sampled <= m["fully_async/partial/newest_version"] <= version
    if partial:
        assert sum(swaps) > 0 and any(m["fully_async/partial/newest_version"] > m["fully_async/staleness/min_version"]
                                      for m in lines)
    else:
        assert sum(swaps) == 0


# --------------------------------------------------------------------------- checkpoints
def test_checkpoint_mid_overlap_resumes_as_the_uninterrupted_run(tmp_path, monkeypatch, no_children_left):
    """Staleness 0, a sync every 2 steps, 2 workers: batch 1 is generated (version 0) while step 1 trains,
    so the step-1 checkpoint is taken mid-overlap (batch 1 queued or in flight). Killed in step 2 and
    resumed, the run logs exactly the uninterrupted run's values (timings aside) and ends on the same
    weights: with staleness 0 the version sampling each batch is fixed, a queued batch is restored and an
    in-flight one regenerated from its worker's saved GenerationStage state."""
    extra = ["trainer.total_training_steps=3", *ASYNC, "rollout.n_gpus_per_node=2",
             "async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=2"]
    full = _run(tmp_path / "full", *extra)
    root = tmp_path / "cut"
    overrides = micro_setup(str(root)) + QUIET + extra + ["trainer.save_freq=1"]
    real, calls = Actor.update, []

    def crash_in_step_2(self, batch):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real(self, batch)

    monkeypatch.setattr(Actor, "update", crash_in_step_2)
    with pytest.raises(KeyboardInterrupt):
        DAPOTrainer(load_config(overrides=overrides)).fit()
    monkeypatch.setattr(Actor, "update", real)
    run = os.path.join(str(root), "run")
    saved = load_state_file(os.path.join(run, "checkpoints", "global_step_1", "state_rank0.safetensors"))["async"]
    assert saved["version"] == 0 and saved["next_index"] == 1
    assert [w["next_index"] for w in saved["workers"]] in ([2, 1], [2, 3])  # batch 1: in flight, or queued
    assert [p["index"] for p in saved["pending"]] == ([] if saved["workers"][1]["next_index"] == 1 else [1])
    with pytest.raises(ValueError, match=r"rollout\.n_gpus_per_node=1, but the checkpoint being resumed was saved "
                                         r"by 2 rollout workers"):
        DAPOTrainer(load_config(overrides=overrides + ["rollout.n_gpus_per_node=1"]))
    resumed = DAPOTrainer(load_config(overrides=overrides))
    assert resumed.global_step == 1
    resumed.fit()
    lines = read_metrics(run)
    assert [m["step"] for m in lines] == [1, 2, 3]
    by_step = {m["step"]: _untimed(m) for m in lines}
    assert by_step == {m["step"]: _untimed(m) for m in full}
    a = load_hf_model(os.path.join(run, "checkpoints", "global_step_3", "model")).state_dict()
    b = load_hf_model(os.path.join(str(tmp_path / "full"), "run", "checkpoints", "global_step_3", "model")).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sigkill_mid_overlap_then_resume_equals_the_uninterrupted_run(tmp_path, no_children_left):
    """The trainer process is SIGKILLed (no cleanup runs) in step 2, after its step-1 checkpoint, while its
    two workers generate ahead; a fresh process resumes from that checkpoint and logs exactly the
    uninterrupted run's values (timings aside) and ends on the same weights (staleness 0: the version
    sampling each batch is fixed)."""
    extra = ["trainer.total_training_steps=3", *ASYNC, "rollout.n_gpus_per_node=2",
             "async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=2"]
    full = _run(tmp_path / "full", *extra)
    root = str(tmp_path / "cut")
    overrides = QUIET + extra + ["trainer.save_freq=1"]
    env = {**os.environ, "HANG_IN_STEP": "2",
           "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    err = open(tmp_path / "stderr.txt", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "tests.trainer.async_kill", root, *overrides], env=env,
                            stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        hung = any(line.strip() == "hanging in step 2" for line in proc.stdout)  # (ends early if it exits)
        assert hung, (tmp_path / "stderr.txt").read_text()[-3000:]
        workers = _children(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        err.close()
    run = os.path.join(root, "run")
    assert [m["step"] for m in read_metrics(run)] == [1]
    resumed = DAPOTrainer(load_config(overrides=micro_setup(root) + overrides))
    assert resumed.global_step == 1
    resumed.fit()
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3]
    assert {m["step"]: _untimed(m) for m in read_metrics(run)} == {m["step"]: _untimed(m) for m in full}
    a = load_hf_model(os.path.join(run, "checkpoints", "global_step_3", "model")).state_dict()
    b = load_hf_model(os.path.join(str(tmp_path / "full"), "run", "checkpoints", "global_step_3", "model")).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_in_the_other_mode_is_refused(tmp_path, no_children_left):
    extra = ["trainer.total_training_steps=1", "trainer.save_freq=1", "trainer.resume_mode=auto"]
    _run(tmp_path, *extra)
    with pytest.raises(ValueError, match=r"async_training\.enable=True, but the checkpoint .* was saved with "
                                         r"async_training\.enable=False"):
        DAPOTrainer(load_config(overrides=micro_setup(str(tmp_path)) + QUIET + extra + ASYNC))


# --------------------------------------------------------------------------- failures
def test_worker_error_is_raised_in_the_trainer_naming_the_worker(tmp_path, no_children_left):
    """The synchronous trainer's exhaustion error, raised where it happens (the worker), reaches fit()."""
    overrides = micro_setup(str(tmp_path), ZERO_REWARD) + QUIET + ASYNC + [
        "trainer.total_training_steps=1", "algorithm.filter_groups.max_num_gen_batches=2", "data.gen_batch_size=2"]
    with pytest.raises(dk.DynamicSamplingExhausted, match=r"rollout worker 0: .*keep rate 0\.0% of 4 groups"):
        DAPOTrainer(load_config(overrides=overrides)).fit()


def test_a_hung_worker_is_named_within_worker_timeout_s(tmp_path, no_children_left):
    """A worker that sends nothing (its reward function hangs) is a RolloutWorkerError after
    async_training.worker_timeout_s, and is killed (no_children_left)."""
    overrides = micro_setup(str(tmp_path), HANGING_REWARD) + QUIET + [
        "trainer.total_training_steps=1", "async_training.enable=true", "async_training.worker_timeout_s=2"]
    t0 = time.monotonic()
    with pytest.raises(RolloutWorkerError, match=r"rollout worker 0 \(pid \d+\) sent no train batch 0 within "
                                                 r"async_training\.worker_timeout_s=2 s"):
        DAPOTrainer(load_config(overrides=overrides)).fit()
    assert time.monotonic() - t0 < 60


def test_sigkilled_trainer_leaves_no_worker(tmp_path):
    """SIGKILL of the trainer (no cleanup runs in it): its rollout workers exit on their own."""
    root = str(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "tests.trainer.async_kill", root], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not read_metrics(os.path.join(root, "run")):  # a step trained: the workers are generating
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the trainer logged no step within 120 s"
            time.sleep(0.2)
        workers = _children(proc.pid)
        assert len(workers) >= 2  # the two rollout workers (and multiprocessing's resource tracker)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in workers if _alive(p)], "rollout workers outlived the SIGKILLed trainer"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
