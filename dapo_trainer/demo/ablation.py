"""``python -m dapo_trainer.demo.ablation`` (``make ablation``): what each DAPO component is
for, on a task built so that the failure mode it fixes is present and measured.

One warm-started model (:data:`FAMILY`: sorting 1-12 digits, 60% of its demonstrations in
the descending convention the checker rejects, 40% showing their work as ``"52817:12578"``,
a response twice as long) and four tasks drawn from it, one per component. Each task runs
two rungs, DAPO without the component and DAPO, from the same warm start and seed:

- ``entropy`` (clip-higher, ``clip_ratio_high`` 0.2 -> 0.28): sorting 6-8 digits where the
  descending answer also counts, for half the reward; the better, ascending answer is the
  rare one (5% of the first step's samples). Symmetric clipping caps how fast a rare token's
  probability can rise within a step, so the policy sharpens on the common valid answer.
  Measured: policy entropy per step, final held-out accuracy (ascending only).
- ``length`` (token-level loss, ``seq-mean-token-mean`` -> ``token-mean``): half 2-3-digit,
  half 9-11-digit sorts. Averaging per sequence weights each token of a long response by
  1/length, so the long ones are learned slower. Measured: held-out accuracy per length.
- ``truncation`` (soft overlong punishment): 4-7 digits under a 12-token response budget;
  the verbose convention of 6-7 digits does not fit, so a fair share of early samples is cut
  (23% at the first step; reward 0 whatever they held). Measured: the share of generated
  responses truncated per step, held-out accuracy.
- ``vanishing`` (dynamic sampling, ``algorithm.filter_groups``): 40% one-digit sorts (always
  right: too easy), 30% 14-16 digits (never right: too hard), 30% 3-5 digits. Groups that
  are all right or all wrong have zero advantage. Measured: the effective batch (train-batch
  responses with a non-zero advantage) per step, held-out accuracy on the 3-5-digit prompts
  per generated sample.

The other components stay on in both rungs, except dynamic sampling, which is off in the
first three tasks: without it every step samples exactly ``train_batch_size x n`` responses,
so both rungs see the same number of samples. In ``vanishing`` DAPO runs first and the rung
without filtering trains for as many steps as DAPO's generated responses pay for.

Seeds vary the training prompts and the RL sampling; the warm start is built once (seed 0).
Writes ``RUN_DIR/ablation.json`` and one run directory per task / rung / seed;
``dapo-report RUN_DIR`` draws the rungs side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from . import DEFAULT_CONFIG, ablation_reward, read_metrics
from .arithmetic import TaskConfig
from .assets import DemoConfig, build_demo

__all__ = ["FAMILY", "TASKS", "AblationTask", "make_rows", "run_ablation", "main"]

FAMILY = DemoConfig(seed=0, task=TaskConfig(sort_len=(1, 12)), num_val=10, warm_start_descending=0.6,
                    warm_start_verbose=0.4)
# The DAPO rung's settings (configs/demo.yaml has them already; repeated so the ablation does
# not depend on that file's choices).
DAPO = ["actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=4",
        "algorithm.filter_groups.enable=true"]
NO_FILTER = ["algorithm.filter_groups.enable=false"]


@dataclass(frozen=True)
class AblationTask:
    """One component's task. ``buckets``: (name, (shortest, longest) digits, share of the
    training prompts, held-out prompts); ``without``: the overrides that remove the component
    from DAPO (``common`` applies to both rungs); ``metric``: the metrics.jsonl key it targets."""

    name: str
    component: str
    buckets: Tuple[Tuple[str, Tuple[int, int], float, int], ...]
    max_response_length: int
    without: Tuple[str, ...]
    metric: str
    metric_label: str
    common: Tuple[str, ...] = tuple(NO_FILTER)
    data_source: str = "sort"


TASKS = (
    AblationTask("entropy", "clip-higher", (("6-8", (6, 8), 1.0, 96),), 18,
                 ("actor_rollout_ref.actor.clip_ratio_high=0.2",), "actor/entropy", "policy entropy (nats/token)",
                 data_source="sort_rare"),
    AblationTask("length", "token-level loss", (("2-3", (2, 3), 0.5, 48), ("9-11", (9, 11), 0.5, 48)), 24,
                 ("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",), "acc/mean",
                 "train accuracy (both lengths)"),
    AblationTask("truncation", "overlong shaping", (("4-7", (4, 7), 1.0, 96),), 12,
                 ("reward_model.overlong_buffer.enable=false",), "train/gen_truncated_frac",
                 "share of sampled responses truncated"),
    AblationTask("vanishing", "dynamic sampling",
                 (("1 (easy)", (1, 1), 0.4, 0), ("14-16 (hard)", (14, 16), 0.3, 0), ("3-5", (3, 5), 0.3, 96)), 20,
                 tuple(NO_FILTER), "train/effective_batch", "effective batch (non-zero-advantage responses)",
                 common=()),
)


def _problem(rng: random.Random, lengths: Tuple[int, int]) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(*lengths)))


def make_rows(task: AblationTask, seed: int, num_train: int) -> Tuple[List[dict], Dict[str, List[dict]]]:
    """``(train, {bucket: held-out rows})``: the held-out rows come from a fixed seed (the
    same for every training seed) and no training prompt is one of them."""
    def row(digits: str) -> dict:
        return {"prompt": f"sort:{digits}=", "answer": "".join(sorted(digits)), "data_source": task.data_source}

    vrng, val, seen = random.Random(f"{task.name}/val"), {}, set()
    for name, lengths, _, count in task.buckets:
        rows = []
        while len(rows) < count:
            r = row(_problem(vrng, lengths))
            if r["prompt"] not in seen:
                seen.add(r["prompt"])
                rows.append(r)
        val[name] = rows
    rng, train = random.Random(f"{task.name}/train/{seed}"), []
    weights = [b[2] for b in task.buckets]
    while len(train) < num_train:
        r = row(_problem(rng, rng.choices(task.buckets, weights)[0][1]))
        if r["prompt"] not in seen:
            train.append(r)
    return train, val


def _write(rows: List[dict], path: str) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _accuracy(trainer, rows: List[dict]) -> float:
    """Greedy held-out accuracy of ``trainer``'s current policy on ``rows`` (trainer rows)."""
    saved, trainer.val_rows = trainer.val_rows, rows
    try:
        return trainer.validate()["val/acc"]
    finally:
        trainer.val_rows = saved


def run_rung(task: AblationTask, with_component: bool, seed: int, steps: int, model_dir: str, run_dir: str,
             config: str, overrides: Sequence[str], progress: bool = False) -> dict:
    """Train one rung; returns its per-bucket held-out accuracy before / after and sample count."""
    from ..config import load_config
    from ..data import load_rows
    from ..trainer import DAPOTrainer

    if os.path.isdir(run_dir):  # a fresh run: the trainer would resume a finished one
        shutil.rmtree(run_dir)
    os.makedirs(run_dir)
    train, val = make_rows(task, seed, 4000)
    _write(train, os.path.join(run_dir, "train.jsonl"))
    val_files = {}
    for name, rows in val.items():
        if rows:
            val_files[name] = os.path.join(run_dir, f"val_{len(val_files)}.jsonl")
            _write(rows, val_files[name])
    cfg = load_config(config, [
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{os.path.join(run_dir, 'train.jsonl')}]",
        f"data.val_files=[{','.join(val_files.values())}]", f"trainer.default_local_dir={run_dir}",
        f"trainer.seed={seed}", f"trainer.total_training_steps={steps}", "trainer.save_freq=0",
        "trainer.resume_mode=disable", f"trainer.progress_bar={str(progress).lower()}", "trainer.logger=[console]",
        f"data.max_response_length={task.max_response_length}", f"data.max_prompt_length={6 + 16}",
        f"custom_reward_function.path={ablation_reward.__file__}", "custom_reward_function.name=compute_score",
        *DAPO, *task.common, *(() if with_component else task.without), *overrides])
    if not cfg.algorithm.filter_groups.enable:
        cfg.data.gen_batch_size = cfg.data.train_batch_size  # without filtering a step samples one batch
    t0 = time.time()
    trainer = DAPOTrainer(cfg)
    buckets = {name: load_rows(path) for name, path in val_files.items()}
    before = {name: _accuracy(trainer, rows) for name, rows in buckets.items()}
    trainer.fit()
    after = {name: _accuracy(trainer, rows) for name, rows in buckets.items()}
    trainer.engine.close()
    rows = read_metrics(run_dir)
    return {"task": task.name, "component": task.component, "with": with_component, "seed": seed,
            "run_dir": run_dir, "steps": steps, "samples": int(sum(r.get("train/gen_responses", 0) for r in rows)),
            "before": before, "after": after, "seconds": round(time.time() - t0, 1)}


def run_ablation(run_dir: str, seeds: Sequence[int], steps: int, *, tasks: Sequence[str] = (),
                 config: str = DEFAULT_CONFIG, cache_dir: str = ".cache/dapo_demo", overrides: Sequence[str] = (),
                 family: DemoConfig = FAMILY, progress: bool = True) -> dict:
    """Every task's two rungs for every seed; writes and returns ``RUN_DIR/ablation.json``."""
    chosen = [t for t in TASKS if not tasks or t.name in tasks]
    unknown = set(tasks) - {t.name for t in TASKS}
    if unknown:
        raise ValueError(f"tasks: unknown {sorted(unknown)}; known: {[t.name for t in TASKS]}")
    t0 = time.time()
    assets = build_demo(family, cache_dir=cache_dir, progress=progress)
    build_s = time.time() - t0
    runs = []
    for task in chosen:
        for seed in seeds:
            # With the component first: in "vanishing" its generated responses set the budget.
            first = run_rung(task, True, seed, steps, assets.model_dir,
                             os.path.join(run_dir, task.name, "with", f"seed{seed}"), config, overrides)
            other = steps
            if task.name == "vanishing":
                tbs, n = _batch(config, overrides)
                other = max(1, round(first["samples"] / (tbs * n)))
            second = run_rung(task, False, seed, other, assets.model_dir,
                              os.path.join(run_dir, task.name, "without", f"seed{seed}"), config, overrides)
            runs += [second, first]
            if progress:
                for r in (second, first):
                    print(f"{task.name:<11}{'with' if r['with'] else 'without':<8} seed {seed}: "
                          f"{r['steps']} steps, {r['samples']} samples, after "
                          f"{', '.join(f'{k} {100 * v:.0f}%' for k, v in r['after'].items())} ({r['seconds']:.0f} s)",
                          flush=True)
    out = {"seeds": list(seeds), "steps": steps, "warm_start": assets.root, "warm_start_built": assets.built,
           "warm_start_seconds": round(build_s, 1), "seconds": round(time.time() - t0, 1),
           "tasks": [{"name": t.name, "component": t.component, "metric": t.metric, "metric_label": t.metric_label,
                      "buckets": [b[0] for b in t.buckets if b[3]]} for t in chosen], "runs": runs}
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "ablation.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def _batch(config: str, overrides: Sequence[str]) -> Tuple[int, int]:
    from ..config import load_config

    cfg = load_config(config, list(overrides))
    return cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n


def main(argv: Optional[List[str]] = None) -> List[dict]:
    p = argparse.ArgumentParser(prog="python -m dapo_trainer.demo.ablation", description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds (default 0,1,2,3,4)")
    p.add_argument("--steps", type=int, default=12,
                   help="training steps per rung (the DAPO rung's, in 'vanishing'; default 12)")
    p.add_argument("--tasks", default="", help="comma-separated subset of " + ",".join(t.name for t in TASKS))
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--cache-dir", default=".cache/dapo_demo")
    p.add_argument("--run-dir", default="runs/ablation")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-report", action="store_true", help="skip dapo-report of the run directory")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides applied to every rung")
    args = p.parse_intermixed_args(argv)  # overrides may follow a flag
    import torch

    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
    if not seeds:
        raise ValueError("--seeds must name at least one seed")
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    torch.set_num_threads(args.threads)
    result = run_ablation(args.run_dir, seeds, args.steps, tasks=[t for t in args.tasks.split(",") if t],
                          config=args.config, cache_dir=args.cache_dir, overrides=args.overrides)
    from ..tools.report import ablation_summary, ablation_table, write_report

    rows = ablation_summary(result)
    print(f"\nDAPO ablation, seeds {seeds}: mean ± 95% t interval of the final greedy held-out accuracy\n")
    print(ablation_table(rows))
    if not args.no_report:
        print(f"report: {write_report(args.run_dir)}")
    print(f"wall time: {result['seconds']:.0f} s (warm start {'built' if result['warm_start_built'] else 'cached'}"
          f", {result['warm_start_seconds']:.0f} s)")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
