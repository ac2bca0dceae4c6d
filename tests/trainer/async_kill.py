"""Harness of test_async_rollout's SIGKILL tests: ``python -m tests.trainer.async_kill ROOT [KEY=VALUE ...]``.

Trains a micro run with ``async_training.enable=true`` under ``ROOT`` (``micro_setup``'s files) until the test
SIGKILLs this process. Without overrides: two rollout workers and many steps (OVERRIDES); with them, those
overrides instead. ``HANG_IN_STEP=K`` in the environment: the actor's update of step K never returns (the
process then waits, mid-step, for its SIGKILL; the workers keep generating ahead).
"""
from __future__ import annotations

import os
import sys
import time

import torch

from dapo_trainer.actor import Actor
from dapo_trainer.config import load_config
from dapo_trainer.trainer import DAPOTrainer
from tests.trainer.tiny import micro_setup

OVERRIDES = ["trainer.total_training_steps=1000", "trainer.val_before_train=false", "data.val_files=[]",
             "trainer.save_freq=0", "async_training.enable=true", "rollout.n_gpus_per_node=2",
             "async_training.staleness_threshold=1", "async_training.trigger_parameter_sync_step=1"]


def hang_in_step(k: int) -> None:
    real, calls = Actor.update, []

    def update(self, batch):
        calls.append(1)
        if len(calls) == k:
            print(f"hanging in step {k}", flush=True)
            time.sleep(3600)
        return real(self, batch)

    Actor.update = update


if __name__ == "__main__":
    torch.set_num_threads(1)
    if os.environ.get("HANG_IN_STEP"):
        hang_in_step(int(os.environ["HANG_IN_STEP"]))
    DAPOTrainer(load_config(overrides=micro_setup(sys.argv[1]) + (sys.argv[2:] or OVERRIDES))).fit()
