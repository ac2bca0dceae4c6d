"""``python -m dapo_trainer.demo.ablation`` (``make ablation``): the DAPO paper's ladder on
the demo task, at an equal sample budget.

Rungs (each adds one technique to the one before, as in the paper's Table 1):

1. naive GRPO: symmetric clip 0.2, sequence-mean loss, no overlong shaping, no filtering;
2. + clip-higher (``clip_ratio_high=0.28``);
3. + token-level loss (``loss_agg_mode=token-mean``);
4. + overlong shaping (soft overlong punishment);
5. + dynamic sampling (``algorithm.filter_groups``) = DAPO.

Equal budget: dynamic sampling generates more than one batch per step, so it runs first
and every other rung then trains for as many steps as that many sampled responses pay
for. All rungs start from the same cached warm start and seed.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from typing import List, Optional

from . import DEFAULT_CONFIG, read_metrics, run_demo

# (name, overrides relative to the trainer config) — cumulative.
LADDER = [
    ("naive GRPO", ["actor_rollout_ref.actor.clip_ratio_high=0.2", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
                    "reward_model.overlong_buffer.enable=false", "algorithm.filter_groups.enable=false"]),
    ("+ clip-higher", ["actor_rollout_ref.actor.clip_ratio_high=0.28"]),
    ("+ token-level loss", ["actor_rollout_ref.actor.loss_agg_mode=token-mean"]),
    ("+ overlong shaping", ["reward_model.overlong_buffer.enable=true"]),
    ("+ dynamic sampling (DAPO)", ["algorithm.filter_groups.enable=true"]),
]


def rung_overrides(i: int) -> List[str]:
    """The cumulative overrides of rung ``i`` (later settings win)."""
    return [o for _, ovr in LADDER[:i + 1] for o in ovr]


def samples_used(run_dir: str, gen_batch_size: int, n: int) -> int:
    """Responses sampled by a run (generation batches x prompts x n)."""
    return int(sum(r.get("train/num_gen_batches", 0) for r in read_metrics(run_dir)) * gen_batch_size * n)


def main(argv: Optional[List[str]] = None) -> List[dict]:
    p = argparse.ArgumentParser(prog="python -m dapo_trainer.demo.ablation", description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="DAPO steps (default: the config's)")
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--cache-dir", default=".cache/dapo_demo")
    p.add_argument("--run-dir", default="runs/ablation")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides applied to every rung")
    args = p.parse_args(argv)
    import torch

    from ..config import load_config

    torch.set_num_threads(args.threads)
    base = load_config(args.config, args.overrides)
    n, gbs, tbs = base.actor_rollout_ref.rollout.n, base.data.gen_batch_size, base.data.train_batch_size
    common = list(args.overrides) + ["trainer.save_freq=0", "trainer.test_freq=0"]
    if args.steps:
        common.append(f"trainer.total_training_steps={args.steps}")

    results = {}
    order = [len(LADDER) - 1] + list(range(len(LADDER) - 1))  # DAPO first: it sets the budget
    budget = None
    for i in order:
        name = LADDER[i][0]
        run_dir = os.path.join(args.run_dir, f"rung{i}")
        ovr = common + rung_overrides(i)
        if budget is not None:
            # Without filtering every step samples exactly train_batch_size prompts.
            ovr += [f"data.gen_batch_size={tbs}", f"trainer.total_training_steps={max(1, round(budget / (tbs * n)))}"]
        if os.path.isdir(run_dir):  # a fresh run per rung: the trainer would resume a finished one
            shutil.rmtree(run_dir)
        t0 = time.time()
        res = run_demo(seed=args.seed, config=args.config, cache_dir=args.cache_dir, run_dir=run_dir,
                       overrides=ovr, progress=False)
        used = samples_used(run_dir, gbs if budget is None else tbs, n)
        budget = used if budget is None else budget
        results[i] = {"rung": name, "before": res["before"], "after": res["after"], "samples": used,
                      "steps": max(r["step"] for r in read_metrics(run_dir)), "seconds": time.time() - t0}
    rows = [results[i] for i in range(len(LADDER))]
    print(f"\nDAPO ablation on the demo task (seed {args.seed}, held-out greedy accuracy, equal sample budget)")
    print(f"{'rung':<28}{'steps':>6}{'samples':>9}{'before':>9}{'after':>9}{'gain':>8}{'time':>8}")
    for r in rows:
        print(f"{r['rung']:<28}{r['steps']:>6}{r['samples']:>9}{100 * r['before']:>8.1f}%{100 * r['after']:>8.1f}%"
              f"{100 * (r['after'] - r['before']):>+7.1f}{r['seconds']:>7.0f}s")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
