"""Harness of test_async_rollout's SIGKILL test: ``python -m tests.trainer.async_kill ROOT``.

Trains a micro run with ``async_training.enable=true`` and two rollout workers for many steps under
``ROOT`` (``micro_setup``'s files, written by the test) until the test SIGKILLs this process.
"""
from __future__ import annotations

import sys

import torch

from dapo_trainer.config import load_config
from dapo_trainer.trainer import DAPOTrainer
from tests.trainer.tiny import micro_setup

OVERRIDES = ["trainer.total_training_steps=1000", "trainer.val_before_train=false", "data.val_files=[]",
             "trainer.save_freq=0", "async_training.enable=true", "rollout.n_gpus_per_node=2",
             "async_training.staleness_threshold=1", "async_training.trigger_parameter_sync_step=1"]

if __name__ == "__main__":
    torch.set_num_threads(1)
    DAPOTrainer(load_config(overrides=micro_setup(sys.argv[1]) + OVERRIDES)).fit()
