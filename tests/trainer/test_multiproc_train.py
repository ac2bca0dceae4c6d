"""torchrun with DP=2 and with TP=2 on two CPU processes (gloo) gives the losses of one process."""
import os
import subprocess
import sys

import pytest

from dapo_trainer.config import load_config
from dapo_trainer.metrics import read_metrics
from dapo_trainer.trainer import DAPOTrainer
from tests.helpers import free_port
from tests.trainer.tiny import micro_setup

# Two steps of two mini-batches: step 2 starts from weights the parallel update produced,
# and the second mini-batch of each step is off-policy (recomputed old log-probs).
RUN = ["trainer.total_training_steps=2", "trainer.val_before_train=false", "data.val_files=[]",
       "actor_rollout_ref.actor.ppo_mini_batch_size=1", "data.train_batch_size=2"]
COMPARED = ["actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac", "actor/entropy",
            "critic/rewards/mean", "train/kept_groups"]


def _torchrun(overrides, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "dapo_trainer.train", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.multiproc
def test_dp2_and_tp2_match_single_process(tmp_path):
    base = micro_setup(str(tmp_path)) + RUN
    DAPOTrainer(load_config(overrides=base)).fit()
    single = read_metrics(str(tmp_path / "run"))
    assert [m["step"] for m in single] == [1, 2]
    for name, extra in (("dp2", []), ("tp2", ["actor_rollout_ref.actor.tensor_model_parallel_size=2"])):
        run_dir = tmp_path / name
        _torchrun(base + [f"trainer.default_local_dir={run_dir}"] + extra)
        lines = read_metrics(str(run_dir))
        assert [m["step"] for m in lines] == [1, 2], name
        for ref, got in zip(single, lines):
            for key in COMPARED:
                assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (name, ref["step"], key)
        assert os.path.isdir(run_dir / "checkpoints" / "global_step_2" / "model")
