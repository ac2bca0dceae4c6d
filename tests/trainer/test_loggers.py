"""``trainer.logger`` (issue 40 item 17): verl's names ``console``, ``tensorboard``, ``wandb``, ``mlflow``.

wandb runs offline (``WANDB_MODE=offline``) and mlflow on a file store, both under ``tmp_path``: no
network. What the trackers recorded is read back from their files (wandb's ``.wandb`` log, mlflow's
store through ``MlflowClient``) and compared with ``metrics.jsonl``.
"""
from __future__ import annotations

import glob
import json
import math
import os
import sys

import pytest

from dapo_trainer import loggers
from dapo_trainer.config import load_config
from dapo_trainer.config.choices import LOGGERS
from dapo_trainer.metrics import read_metrics
from dapo_trainer.trainer import DAPOTrainer
from tests.trainer.tiny import micro_setup

PROJECT, EXPERIMENT = "dapo-tests", "micro-run"


def _wandb():
    return pytest.importorskip("wandb", reason="wandb is not installed (requirements-dev.txt)")


def _mlflow():
    return pytest.importorskip("mlflow", reason="mlflow-skinny is not installed (requirements-dev.txt)")


def _offline_env(mp: pytest.MonkeyPatch, root) -> None:
    """wandb offline, silent and without error reports, its home folders under ``root``; mlflow's store
    at ``root/mlstore``."""
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    mp.setenv("WANDB_ERROR_REPORTING", "false")  # no crash reports sent
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        mp.setenv(var, os.path.join(str(root), "wandb-home", var.lower()))
    mp.setenv("MLFLOW_TRACKING_URI", f"file://{root}/mlstore")
    mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def _wandb_records(run_dir: str) -> list:
    """``(run id, kind, record)`` of every record of every offline run under ``run_dir/wandb``, in run order."""
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal import datastore

    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        ds = datastore.DataStore()
        ds.open_for_scan(path)
        while (data := ds.scan_data()) is not None:
            rec = pb.Record()
            rec.ParseFromString(data)
            out.append((os.path.basename(path)[4:-6], rec.WhichOneof("record_type"), rec))
    return out


def _wandb_history(records) -> dict:
    """``{step: {key: value}}`` of the logged history (wandb's own ``_``-keys left out)."""
    hist = {}
    for _, kind, rec in records:
        if kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            hist.setdefault(row["_step"], {}).update({k: v for k, v in row.items() if not k.startswith("_")})
    return hist


def _numeric_lines(run_dir: str) -> dict:
    """``{step: {key: value}}`` of metrics.jsonl, string values left out (they stay in the file only)."""
    return {m["step"]: {k: v for k, v in m.items() if k != "step" and not isinstance(v, str)}
            for m in read_metrics(run_dir)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """A micro run with ``trainer.logger=[console,wandb,mlflow]``: 2 steps (validation at step 0), then
    resumed from its step-2 checkpoint to step 3. Returns its root directory."""
    _wandb(), _mlflow()
    root = tmp_path_factory.mktemp("tracked")
    with pytest.MonkeyPatch.context() as mp:
        _offline_env(mp, root)
        overrides = micro_setup(str(root)) + ["trainer.logger=[console,wandb,mlflow]",
                                              f"trainer.project_name={PROJECT}",
                                              f"trainer.experiment_name={EXPERIMENT}"]
        DAPOTrainer(load_config(overrides=overrides + ["trainer.total_training_steps=2"])).fit()
        ids = {name: open(os.path.join(root, "run", f"{name}_run_id")).read().strip()
               for name in ("wandb", "mlflow")}
        DAPOTrainer(load_config(overrides=overrides + ["trainer.total_training_steps=3"])).fit()
        yield root, ids


def test_wandb_logs_every_step_as_metrics_jsonl(tracked_run):
    """wandb (offline, under the run directory) holds every step's metrics under metrics.jsonl's keys
    and values, step 0's validation included; the run is trainer.project_name / experiment_name, its
    config is the resolved config, and it ended with exit code 0."""
    root, _ = tracked_run
    run_dir = os.path.join(root, "run")
    records = _wandb_records(run_dir)
    assert records, f"no offline wandb run under {run_dir}/wandb"
    lines = _numeric_lines(run_dir)
    assert sorted(lines) == [0, 1, 2, 3]
    hist = _wandb_history(records)
    assert sorted(hist) == sorted(lines)
    for step in lines:
        assert _same(hist[step], lines[step]), step
    runs = [rec.run for _, kind, rec in records if kind == "run"]
    assert {(r.project, r.display_name) for r in runs} == {(PROJECT, EXPERIMENT)}
    config = {u.key: json.loads(u.value_json) for u in runs[0].config.update}
    assert config["trainer"]["experiment_name"] == EXPERIMENT and config["trainer"]["logger"] == ["console", "wandb",
                                                                                                   "mlflow"]
    assert config["data"]["train_batch_size"] == 2
    assert [rec.exit.exit_code for _, kind, rec in records if kind == "exit"] == [0, 0]


def test_wandb_resume_continues_the_same_run(tracked_run):
    """The resumed run (from the step-2 checkpoint) logs to the wandb run whose id the run directory
    holds: both offline runs carry that one id, the second one only step 3."""
    root, ids = tracked_run
    run_dir = os.path.join(root, "run")
    records = _wandb_records(run_dir)
    assert {rid for rid, _, _ in records} == {ids["wandb"]}
    assert len(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*"))) == 2
    assert open(os.path.join(run_dir, "wandb_run_id")).read().strip() == ids["wandb"]


def test_mlflow_logs_every_step_as_metrics_jsonl(tracked_run):
    """mlflow (MLFLOW_TRACKING_URI honoured) holds every step's metrics under metrics.jsonl's keys and
    values; experiment trainer.project_name, run trainer.experiment_name, params the resolved config's
    dotted keys, status FINISHED; the resumed run continued the same mlflow run."""
    from mlflow.tracking import MlflowClient

    root, ids = tracked_run
    run_dir = os.path.join(root, "run")
    assert not os.path.exists(os.path.join(run_dir, "mlruns")), "MLFLOW_TRACKING_URI was not used"
    client = MlflowClient(f"file://{root}/mlstore")
    exp = client.get_experiment_by_name(PROJECT)
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [ids["mlflow"]]
    run = runs[0]
    assert run.info.run_name == EXPERIMENT and run.info.status == "FINISHED"
    assert run.data.params["trainer.experiment_name"] == EXPERIMENT
    assert run.data.params["data.train_batch_size"] == "2"
    assert json.loads(run.data.params["trainer.logger"]) == ["console", "wandb", "mlflow"]
    lines = _numeric_lines(run_dir)
    keys = set().union(*lines.values())
    assert set(run.data.metrics) == keys
    logged = {}
    for key in keys:
        for m in client.get_metric_history(run.info.run_id, key):
            assert key not in logged.get(m.step, {}), f"{key} logged twice at step {m.step}"
            logged.setdefault(m.step, {})[key] = m.value
    assert sorted(logged) == [0, 1, 2, 3]
    for step in lines:
        assert _same(logged[step], lines[step]), step


def test_failed_training_closes_the_trackers_as_failed(tmp_path, monkeypatch):
    """Training that raises closes the trackers, marked failed: the mlflow run (in the default file
    store, run_dir/mlruns, when MLFLOW_TRACKING_URI is unset) is FAILED, the wandb run exits with 1."""
    _wandb(), _mlflow()
    from mlflow.tracking import MlflowClient

    _offline_env(monkeypatch, tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    overrides = micro_setup(str(tmp_path)) + ["trainer.logger=[wandb,mlflow]", "trainer.val_before_train=false",
                                              "data.val_files=[]", "trainer.total_training_steps=1"]
    trainer = DAPOTrainer(load_config(overrides=overrides))

    def boom():
        raise RuntimeError("boom")

    monkeypatch.setattr(trainer, "train_step", boom)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit()
    run_dir = os.path.join(tmp_path, "run")
    run_id = open(os.path.join(run_dir, "mlflow_run_id")).read().strip()
    assert MlflowClient(f"file://{run_dir}/mlruns").get_run(run_id).info.status == "FAILED"
    exits = [rec.exit.exit_code for _, kind, rec in _wandb_records(run_dir) if kind == "exit"]
    assert exits == [1]


def test_unknown_logger_refused_at_load():
    """A name that is not a logger is a ValueError naming trainer.logger and the value, at config load;
    verl's loggers not implemented here (swanlab) are still dropped with a note, wandb and mlflow kept."""
    with pytest.raises(ValueError, match=r"'trainer\.logger\[1\]': must be one of 'console', 'tensorboard', "
                                         r"'wandb' or 'mlflow', got 'wandbb'"):
        load_config(overrides=["trainer.logger=[console,wandbb]"])
    with pytest.warns(UserWarning, match="'swanlab' not implemented here"):
        cfg = load_config(overrides=["trainer.logger=[console,wandb,mlflow,swanlab]"])
    assert cfg.trainer.logger == ["console", "wandb", "mlflow"]


@pytest.mark.parametrize("name, package", [("wandb", "wandb"), ("mlflow", "mlflow-skinny")])
def test_missing_package_refused_at_start_up(tmp_path, monkeypatch, name, package):
    """A requested tracker whose package cannot be imported is an ImportError naming trainer.logger and
    the pip package, raised when the trainer is built: before any model is built or file written."""
    import dapo_trainer.trainer as trainer_mod

    monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError

    def no_model(*a, **k):
        raise AssertionError("a model was built")

    monkeypatch.setattr(trainer_mod, "build_model", no_model)
    overrides = micro_setup(str(tmp_path)) + [f"trainer.logger=[console,{name}]"]
    cfg = load_config(overrides=overrides)
    with pytest.raises(ImportError, match=rf"trainer\.logger: '{name}' needs the {package} package.*"
                                          rf"pip install {package}"):
        DAPOTrainer(cfg)
    assert not os.path.exists(os.path.join(tmp_path, "run"))


def test_missing_tensorboard_is_skipped_with_a_warning(monkeypatch, caplog):
    """tensorboard is in the default list: without its package the run goes on without it, warned once,
    while a missing wandb next to it is still an error."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    assert loggers.check_installed(["console", "tensorboard"]) == ["tensorboard"]
    assert "trainer.logger: 'tensorboard' needs the tensorboard package" in caplog.text
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="'wandb' needs the wandb package"):
        loggers.check_installed(["tensorboard", "wandb"])


def test_every_logger_name_has_a_tracker():
    """Each name trainer.logger accepts but console opens a tracker: the config's list and the trackers
    are one set."""
    assert set(loggers.BACKENDS) | {"console"} == set(LOGGERS)


def test_mlflow_metric_names():
    """Every metric name of CONTRACT.md reaches mlflow unchanged; a character mlflow refuses is renamed
    as verl does."""
    for name in ("critic/rewards/mean", "timing_s/update_weights", "sampling/keep_rate_estimate/openai/gsm8k"):
        assert loggers.mlflow_key(name) == name
    assert loggers.mlflow_key("val/pass@4") == "val/pass_at_4"
    assert loggers.mlflow_key("val/acc(greedy)") == "val/acc_greedy_"
