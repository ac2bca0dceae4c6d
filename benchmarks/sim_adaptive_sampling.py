"""Simulated long run of dynamic sampling, fixed vs adaptive generation size (issue 33); no model.

A synthetic keep rate falls linearly from 0.9 to 0.05 over 500 steps (the policy learning the
task: ever more groups all-correct). Each generated prompt group is kept with that probability;
kept groups fill a train batch (``train_batch_size``), the surplus is carried over
(``carry_over=true``, this trainer's default) or dropped (verl). The adaptive size comes from the
trainer's own :class:`dapo_trainer.adaptive_sampling.SamplingController` (a
``dapo_trainer.keep_rate.KeepRateEstimator`` behind it), the fixed one is
``data.gen_batch_size``. Rounds are not capped (``max_num_gen_batches=0``) so that their count is
measured; the table counts the steps that a cap of 10 would have stopped.

    python benchmarks/sim_adaptive_sampling.py [--steps 500] [--seeds 0,1,2] [--json out.json]

Columns: rounds per step (mean / max), dead-loop rate (steps with more than 2 rounds), steps over
10 rounds, generated samples per trained group, wasted samples (kept groups neither trained on
nor carried over, x n) and the mean carried-over groups per step (how stale the buffer runs).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Dict, List

from dapo_trainer.adaptive_sampling import SamplingController
from dapo_trainer.config import Config

SETUPS = {
    # verl's DAPO recipe sizes: 512 prompts per train batch, 3x as many per generation batch, 16 responses.
    "recipe": {"train": 512, "gen": 1536, "n": 16, "dp": 8, "ceiling": 8192},
    # The demo's sizes (dapo_trainer/configs/demo.yaml).
    "demo": {"train": 16, "gen": 32, "n": 8, "dp": 1, "ceiling": 1024},
}


def keep_rate(step: int, steps: int, hi: float = 0.9, lo: float = 0.05) -> float:
    return hi + (lo - hi) * (step - 1) / max(steps - 1, 1)


def simulate(setup: dict, *, adaptive: bool, carry_over: bool, steps: int, seed: int,
             quantile: float = 0.9) -> Dict[str, float]:
    cfg = Config()
    cfg.data.train_batch_size, cfg.data.gen_batch_size = setup["train"], setup["gen"]
    fg = cfg.algorithm.filter_groups
    fg.adaptive, fg.carry_over, fg.adaptive_quantile = adaptive, carry_over, quantile
    ctl = SamplingController(cfg, dp=setup["dp"], ceiling=setup["ceiling"])
    rng = random.Random(seed)
    train, n = setup["train"], setup["n"]
    buffered = 0
    rounds_per_step: List[int] = []
    generated = wasted = carried_total = 0
    for step in range(1, steps + 1):
        p, k = keep_rate(step, steps), 0
        while buffered < train:
            size = ctl.gen_size(buffered, k)
            kept = sum(rng.random() < p for _ in range(size))
            ctl.observe_round({"": (kept, size)})
            buffered += kept
            generated += size * n
            k += 1
        surplus = buffered - train
        buffered = surplus if carry_over else 0
        wasted += 0 if carry_over else surplus * n
        carried_total += buffered
        rounds_per_step.append(k)
    return {"rounds_mean": sum(rounds_per_step) / steps, "rounds_max": max(rounds_per_step),
            "dead_loop_rate": sum(r > 2 for r in rounds_per_step) / steps,
            "over_10_rounds": sum(r > 10 for r in rounds_per_step),
            "samples_per_group": generated / (steps * train), "wasted_samples": wasted,
            "carried_mean": carried_total / steps}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    results = {}
    print(f"keep rate 0.9 -> 0.05 linearly over {args.steps} steps; means over seeds {seeds}")
    print("| setup | mode | carry_over | rounds/step | max rounds | dead-loop rate (>2) | steps > 10 rounds "
          "| samples / trained group | wasted samples | carried groups / step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, setup in SETUPS.items():
        for carry in (True, False):
            # Without carry-over the surplus of a round is wasted: a lower quantile trades rounds for waste.
            for adaptive, q in ((False, 0.9), (True, 0.9), (True, 0.75)):
                if q != 0.9 and carry:
                    continue
                runs = [simulate(setup, adaptive=adaptive, carry_over=carry, steps=args.steps, seed=s, quantile=q)
                        for s in seeds]
                mean = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
                mode = f"adaptive q={q}" if adaptive else f"fixed gen={setup['gen']}"
                results[f"{name}/{'carry' if carry else 'drop'}/{mode}"] = mean
                print(f"| {name} (train {setup['train']}, n {setup['n']}) | {mode} | {carry} | "
                      f"{mean['rounds_mean']:.2f} | {mean['rounds_max']:.0f} | {mean['dead_loop_rate']:.1%} | "
                      f"{mean['over_10_rounds']:.1f} | {mean['samples_per_group']:.1f} | "
                      f"{mean['wasted_samples']:,.0f} | {mean['carried_mean']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
