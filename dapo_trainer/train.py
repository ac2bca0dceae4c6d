"""Command line: ``python -m dapo_trainer.train --config X.yaml key=value ...``.

Under ``torchrun --nproc_per_node K`` every process joins the group ``torchrun`` describes
(gloo on the CPU, nccl on CUDA, hccl on Ascend NPUs) and ranks split as
``DP = K / actor_rollout_ref.actor.tensor_model_parallel_size``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

import torch.distributed as dist

from .config import load_config
from .parallel import init_distributed
from .trainer import DAPOTrainer, resolve_device


def parse_args(argv: Optional[List[str]] = None):
    p = argparse.ArgumentParser(prog="python -m dapo_trainer.train", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="YAML config (e.g. dapo_trainer/configs/demo.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, verl's key names")
    p.add_argument("--debug", action="store_true", help="show the traceback of a config error")
    return p.parse_intermixed_args(argv)  # overrides may follow a flag: --debug trainer.seed=1


def main(argv: Optional[List[str]] = None) -> dict:
    """Load the config, join the process group when launched by torchrun, train; returns final metrics."""
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        device = resolve_device(cfg.trainer.device)
    except (ValueError, TypeError, OSError) as e:
        if args.debug:
            raise
        sys.exit(f"config error: {e}")
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        init_distributed(device)
    try:
        metrics = DAPOTrainer(cfg).fit()
    finally:
        if distributed and dist.is_initialized():
            dist.destroy_process_group()
    if not distributed or int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: v for k, v in metrics.items() if not k.startswith("timing_s/")}, sort_keys=True))
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
