"""Peak memory per rank of the trainer at TP=2 (2 gloo processes, CPU): construction + one step.

    python -m benchmarks.tp_rollout_memory [--hidden 512 --layers 8]

Prints, per rank, the resident set size after construction and its peak over the step
(``ru_maxrss``), and the parameter bytes the rank holds. With the sampler on the TP-sharded
model no rank holds a full replica for the rollout.
"""
from __future__ import annotations

import argparse
import datetime
import os
import resource
import tempfile

import torch


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _worker(rank: int, root: str, overrides: list):
    from dapo_trainer.config import load_config
    from dapo_trainer.trainer import DAPOTrainer

    torch.set_num_threads(1)
    trainer = DAPOTrainer(load_config(overrides=overrides))
    built = _rss_mb()
    held = {id(p): p.numel() * p.element_size() for m in vars(trainer).values() if isinstance(m, torch.nn.Module)
            for p in m.parameters()}
    trainer.train_step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"rank {rank}: rss after construction {built:.0f} MiB, peak rss over the step {peak:.0f} MiB, "
          f"parameters held {sum(held.values()) / 2**20:.0f} MiB", flush=True)


def main():
    from tests.helpers import spawn_process_group
    from tests.trainer.tiny import micro_setup, write_tiny_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        overrides = micro_setup(root) + ["actor_rollout_ref.actor.tensor_model_parallel_size=2",
                                         "trainer.total_training_steps=1", "data.val_files=[]"]
        write_tiny_model(os.path.join(root, "model"), hidden=args.hidden, layers=args.layers, heads=8, kv_heads=8)
        spawn_process_group(_worker, 2, root, overrides, timeout=datetime.timedelta(seconds=600))


if __name__ == "__main__":
    main()
