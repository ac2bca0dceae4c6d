"""torchrun with DP=2 and with TP=2 on two CPU processes (gloo) gives the losses of one process;
so does a two-node launch (two torchrun launchers on this machine, one process each)."""
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


def _torchrun(overrides, timeout=240, nodes=1):
    """2 processes: one launcher with 2, or ``nodes=2`` launchers with 1 each, meeting at a
    rendezvous endpoint as real nodes do (node ranks given, static rendezvous)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nodes == 1:
        launchers = [["--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port())]]
    else:
        endpoint = f"localhost:{free_port()}"
        launchers = [["--nnodes", str(nodes), "--node_rank", str(r), "--nproc_per_node", "1",
                      "--rdzv_endpoint", endpoint] for r in range(nodes)]
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args, "-m", "dapo_trainer.train",
                               *overrides], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for args in launchers]
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    # Rank 0 alone prints the final metrics: one world of 2, not two worlds of 1.
    assert sum('"actor/pg_loss"' in out for out, _ in outs) == 1, [out[-500:] for out, _ in outs]


@pytest.mark.multiproc
def test_dp2_and_tp2_match_single_process(tmp_path):
    base = micro_setup(str(tmp_path)) + RUN
    DAPOTrainer(load_config(overrides=base)).fit()
    single = read_metrics(str(tmp_path / "run"))
    assert [m["step"] for m in single] == [1, 2]
    for name, extra, nodes in (("dp2", [], 1), ("tp2", ["actor_rollout_ref.actor.tensor_model_parallel_size=2"], 1),
                               ("2nodes", [], 2)):
        run_dir = tmp_path / name
        _torchrun(base + [f"trainer.default_local_dir={run_dir}"] + extra, nodes=nodes)
        lines = read_metrics(str(run_dir))
        assert [m["step"] for m in lines] == [1, 2], name
        for ref, got in zip(single, lines):
            for key in COMPARED:
                assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (name, ref["step"], key)
        assert os.path.isdir(run_dir / "checkpoints" / "global_step_2" / "model")
