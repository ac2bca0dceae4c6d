"""A run directory belongs to one run at a time: a second process is refused naming the holder, a
killed holder blocks nothing, and ``resume_mode=disable`` never overwrites an earlier run."""
import os
import socket
import subprocess
import sys

import pytest

import dapo_trainer.trainer as trainer_mod
from dapo_trainer.config import load_config
from dapo_trainer.run_dir import LOCK_FILE, RunDirectoryInUse
from dapo_trainer.trainer import DAPOTrainer
from tests.trainer.tiny import micro_setup

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ONE_STEP = ["trainer.total_training_steps=1", "trainer.val_before_train=false", "data.val_files=[]"]
HOLD = ("import sys, time; from dapo_trainer.run_dir import claim; claim(sys.argv[1], fresh=False); "
        "print('held', flush=True); time.sleep(120)")


def _no_model(*a, **k):
    raise AssertionError("a model was built")


def test_second_run_in_the_same_directory_is_refused_naming_the_holder(tmp_path, monkeypatch):
    """While another process holds ``trainer.default_local_dir``, a trainer there fails at start-up,
    before building a model or writing anything, naming the holder's pid and host; once the holder
    is killed (no clean exit), the directory is free again."""
    overrides = micro_setup(str(tmp_path)) + ONE_STEP
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with monkeypatch.context() as m:
            m.setattr(trainer_mod, "build_model", _no_model)
            with pytest.raises(RunDirectoryInUse, match=rf"in use by another run \(pid {holder.pid} on "
                                                        rf"{socket.gethostname()}, started 20"):
                DAPOTrainer(load_config(overrides=overrides))
        assert sorted(os.listdir(run)) == [LOCK_FILE]
    finally:
        holder.kill()
        holder.wait()
    DAPOTrainer(load_config(overrides=overrides)).fit()  # the killed holder's lock went with it
    assert (run / "metrics.jsonl").read_text()


def test_resume_mode_disable_into_an_earlier_run_is_refused(tmp_path, monkeypatch):
    """``trainer.resume_mode=disable`` where a run left metrics and a checkpoint: a ValueError naming the
    directory and the key before any model is built; metrics.jsonl and global_step_1 stay as they were."""
    overrides = micro_setup(str(tmp_path)) + ONE_STEP
    DAPOTrainer(load_config(overrides=overrides)).fit()
    run = tmp_path / "run"
    metrics = (run / "metrics.jsonl").read_bytes()
    weights = run / "checkpoints" / "global_step_1" / "model" / "model.safetensors"
    before = (weights.read_bytes(), weights.stat().st_mtime_ns)
    monkeypatch.setattr(trainer_mod, "build_model", _no_model)
    with pytest.raises(ValueError, match=rf"trainer.resume_mode=disable: trainer.default_local_dir '{run}' already "
                                         r"holds a run \(metrics.jsonl, checkpoints/global_step_1"):
        DAPOTrainer(load_config(overrides=overrides + ["trainer.resume_mode=disable"]))
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert (weights.read_bytes(), weights.stat().st_mtime_ns) == before
