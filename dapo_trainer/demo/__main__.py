"""The main job: ``python -m dapo_trainer.demo`` (``make demo``).

Builds (or finds cached) the demo's task, tokenizer, tiny model and supervised warm
start (:mod:`.assets`), runs DAPO with dynamic sampling on it through the ordinary
trainer (``dapo_trainer/configs/demo.yaml`` + the paths as dotted overrides, exactly as
a user would on their own model dir and jsonl files), writes the report, and ends by
printing ``held-out accuracy: before X% -> after Y%`` (greedy decoding on the held-out
problems at step 0 and after the last step).

Extra ``key=value`` arguments are passed to the trainer, e.g.
``python -m dapo_trainer.demo actor_rollout_ref.rollout.name=vllm``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from typing import List, Optional

import torch

from . import DEFAULT_CONFIG, DIALOG_CONFIG, check_config, run_demo


def parse_args(argv: Optional[List[str]] = None):
    p = argparse.ArgumentParser(prog="python -m dapo_trainer.demo", description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0, help="task, warm start and RL seed (default 0)")
    p.add_argument("--task", choices=("sort", "dialog"), default="sort",
                   help="sort: the single-turn digit task; dialog: the multi-turn order-status desk")
    p.add_argument("--family", choices=("llama", "qwen3", "qwen3_moe"), default="llama",
                   help="the sort task's tiny model: Llama (default), Qwen3 or Qwen3-MoE (8 experts, 2 active)")
    p.add_argument("--config", default=None,
                   help="trainer YAML (default: configs/demo.yaml, or configs/dialog_demo.yaml for --task dialog)")
    p.add_argument("--cache-dir", default=None, help="where the warm-started model is cached")
    p.add_argument("--run-dir", default=None, help="run directory root (one sub-directory per seed)")
    p.add_argument("--resume", action="store_true", help="continue the seed's last run instead of starting afresh")
    p.add_argument("--no-report", action="store_true", help="skip the HTML report")
    p.add_argument("--warm-start-steps", type=int, default=None,
                   help="supervised warm-start steps (default: the task's, 300 for sort, 500 for dialog); "
                        "fewer for a quick smoke run, which then learns less")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: the model's matmuls are so small that a second "
                        "thread costs more in synchronisation than it saves, 2.5x slower when cores are shared)")
    p.add_argument("overrides", nargs="*", help="dotted key=value trainer overrides")
    return p.parse_intermixed_args(argv)  # overrides may follow a flag: --debug trainer.seed=1


def main(argv: Optional[List[str]] = None) -> dict:
    args = parse_args(argv)
    if args.warm_start_steps is not None and args.warm_start_steps < 1:
        raise ValueError(f"--warm-start-steps must be >= 1, got {args.warm_start_steps}")
    if args.family != "llama" and args.task != "sort":
        raise ValueError(f"--family {args.family} is for --task sort (the dialog demo's model is a Llama)")
    torch.set_num_threads(args.threads)
    t0 = time.time()
    dialog = args.task == "dialog"
    run_dir = os.path.join(args.run_dir or ("runs/demo_dialog" if dialog else "runs/demo"), f"seed{args.seed}")
    config = args.config or (DIALOG_CONFIG if dialog else DEFAULT_CONFIG)
    check_config(config, run_dir, args.seed, args.overrides)  # before the old run is removed
    if not args.resume and os.path.isdir(run_dir):
        shutil.rmtree(run_dir)
    demo_config = None
    # (Both part of the cache key: a short warm start, or another family, is cached apart.)
    if args.warm_start_steps is not None or args.family != "llama":
        given = {} if args.warm_start_steps is None else {"warm_start_steps": args.warm_start_steps}
        if dialog:
            from .dialog import DialogDemoConfig as demo_cls
        else:
            from .assets import DemoConfig as demo_cls
            given["family"] = args.family
        demo_config = demo_cls(seed=args.seed, **given)
    result = run_demo(seed=args.seed, config=config,
                      cache_dir=args.cache_dir or (".cache/dapo_demo_dialog" if dialog else ".cache/dapo_demo"),
                      run_dir=run_dir, overrides=args.overrides, task=args.task, demo_config=demo_config)
    if not args.no_report:
        from ..tools.report import write_report

        print(f"report: {write_report(run_dir)}")
    print(f"wall time: {time.time() - t0:.0f} s (warm start {'built' if result['built'] else 'cached'})")
    what = "held-out dialogue success" if dialog else "held-out accuracy"
    print(f"{what}: before {100 * result['before']:.1f}% -> after {100 * result['after']:.1f}%")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
