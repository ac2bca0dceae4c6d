"""Our trainer's DAPO step against TRL's ``GRPOTrainer``, side by side (issue 42).

    make bench-trl                                   # builds .venv-trl, then the full run below
    .venv-trl/bin/python benchmarks/bench_trl_step.py [--steps 30] [--seeds 0,1,2] [--out FILE]
    python benchmarks/bench_trl_step.py --smoke      # toy sizes, seconds; TRL's rows only where trl imports

What is compared, on the CPU, one torch thread in every run:

- the same model: ``make demo``'s warm-started tiny Llama (``dapo_trainer/demo/assets.py``, cached
  under ``--cache-dir``; one warm start, of ``--assets-seed``, for every RL seed), copied per run;
- the same prompts (the demo's train rows) and the same held-out rows (the demo's val rows);
- the same reward: the demo's verifier (``dapo_trainer.rewards.default_compute_score``, which our
  trainer calls), wrapped for TRL as a reward function of the completions, plus DAPO's soft overlong
  penalty on both sides (ours: ``reward_model.overlong_buffer`` len 4; TRL:
  ``trl.rewards.get_soft_overlong_punishment(12, 4)``);
- the same sampling (temperature 1.0, top-p 1, no top-k, at most 12 response tokens, n = 8) and the
  same batch: 16 prompts x 8 samples, four policy updates of 4 prompts x 8 per generation batch
  (ours: ``ppo_mini_batch_size`` 4 of ``train_batch_size`` 16; TRL: ``per_device_train_batch_size``
  32, ``steps_per_generation`` 4, ``num_iterations`` 1, so four optimizer steps per generation);
- the same loss: DAPO's token-mean clipped loss, epsilon 0.2 / 0.28, no KL (TRL ``loss_type="dapo"``,
  ``beta=0``), group-normalised advantages (TRL ``scale_rewards="group"``), grad clip 1.0;
- the same optimizer: AdamW lr 1e-4, betas (0.9, 0.999), no weight decay, lr warmed up over the first
  2 generation batches as ``demo.yaml`` does (handed to TRL as ``optimizers=``: TRL's own
  ``warmup_steps`` would start at lr 0).

The one difference in the algorithm: TRL has no dynamic sampling. Ours generates
``data.gen_batch_size`` = 32 prompts per generation batch, keeps the groups whose accuracy varies and
generates again until 16 are kept; TRL trains on all 16 groups it generated (a group with equal
rewards has zero advantage and contributes only to the token count). So ours samples at least 256
responses per step to TRL's 128: hence the per-sample and per-token rows. ``--trainers ours_nofilter``
adds a row of ours with the filter off and gen_batch_size 16 (the same sample count as TRL).
``ours_bypass`` is ours with ``algorithm.rollout_correction.bypass_mode=true`` (the rollout's log-probs
are the old ones: no old-log-prob pass). ``ours_async_bypass`` is ``ours_bypass`` with
``async_training`` on: one rollout worker process (its own torch thread, so two cores busy where every
other run uses one) generates the next batches while the trainer trains, weights pushed every step,
batches at most 2 versions old; its CPU time is the trainer's and the worker's together.

Measured per run (each trainer and seed in its own process, the trainers interleaved per seed, the
order alternating between seeds):

- per-step wall time (ours: the trainer's ``timing_s/step``; TRL: from the first optimizer step's
  start to the fourth one's end, one generation batch); the median over the steps after the first;
- where the time goes (ours: the trainer's ``timing_s/*``; TRL: its own ``profiling_context``
  timers, recorded by a hook on ``ProfilingContext``);
- samples generated and response tokens trained on per step (ours: ``train/gen_responses``,
  ``train/num_tokens``; TRL: the generation batch's rows and the sum of its completion mask);
- held-out accuracy every ``--eval-every`` steps, greedy, by one evaluator for both (transformers
  ``generate`` and the demo's verifier; ours' checkpoints are evaluated after the run), against the
  cumulative training time (the sum of the step times: evaluation, checkpointing and start-up are
  not counted). "Equal wall time": per seed, the shorter of the two runs' training times; each
  trainer's accuracy at its last evaluation within it. Ours' own validation of the last step is
  printed beside it as a cross-check of the evaluator.

The tables are printed and written to ``--out``; the workers' JSON to ``--run-root``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

T_START = time.perf_counter()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

TRAINERS = ("ours", "ours_bypass", "ours_async_bypass", "ours_nofilter", "trl")
DEFAULT_TRAINERS = ("ours", "ours_bypass", "ours_async_bypass", "trl")
MAX_RESPONSE = 12
N_SAMPLES = 8
PROMPTS_PER_STEP = 16
UPDATES_PER_STEP = 4
LR, WARMUP_STEPS = 1.0e-4, 2  # demo.yaml: actor.optim.lr, lr_warmup_steps (trainer steps)
OVERLONG_LEN = 4  # demo.yaml: reward_model.overlong_buffer.len (penalty_factor 1.0)
OUR_OVERRIDES = {
    "ours": [],
    "ours_bypass": ["algorithm.rollout_correction.bypass_mode=true",
                    "actor_rollout_ref.rollout.calculate_log_probs=true"],
    "ours_nofilter": ["algorithm.filter_groups.enable=false", f"data.gen_batch_size={PROMPTS_PER_STEP}"],
    # One rollout worker process generating ahead (weights pushed every step, batches at most 2 versions
    # old, partial rollout as verl's default), trained as ours_bypass: PPO's clip is then taken against the
    # weights that sampled each batch.
    "ours_async_bypass": ["algorithm.rollout_correction.bypass_mode=true",
                          "actor_rollout_ref.rollout.calculate_log_probs=true",
                          "async_training.enable=true", "async_training.trigger_parameter_sync_step=1",
                          "async_training.staleness_threshold=2"],
}
# --smoke: a 5-step warm start answers nothing right, so dynamic sampling would find no group to keep.
SMOKE_OVERRIDES = ["algorithm.filter_groups.enable=false", f"data.gen_batch_size={PROMPTS_PER_STEP}"]
SMOKE = {"steps": 2, "seeds": "0", "val_rows": 16, "warm_start_steps": 5, "eval_every": 1}
TRL_MISSING = "trl is not importable: run this with .venv-trl/bin/python (make trl-install builds it)"


# --------------------------------------------------------------------------- shared pieces
def trl_importable() -> bool:
    return importlib.util.find_spec("trl") is not None


def demo_assets(args):
    """The demo's warm-started model and rows (built once, then cached, as ``make demo`` does)."""
    from dapo_trainer.demo.assets import DemoConfig, build_demo

    kw = {} if args.warm_start_steps is None else {"warm_start_steps": args.warm_start_steps}
    return build_demo(DemoConfig(seed=args.assets_seed, **kw), cache_dir=args.cache_dir, progress=False)


def rows_of(path, limit=None):
    """The demo's rows as the trainer reads them (``prompt``, ``ground_truth``, ``data_source``)."""
    from dapo_trainer.data import load_rows

    rows = load_rows(path)
    return rows[:limit] if limit else rows


def copy_model(src, dst):
    """A private copy of the warm-started model directory for one run."""
    if os.path.exists(dst):
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def hf_heldout_accuracy(model, tokenizer, rows):
    """Greedy accuracy of a transformers causal LM on ``rows`` (at most 12 new tokens, the demo's
    verifier on the text before the first end-of-text). Prompts are batched by length, so no padding.
    Leaves the model in the mode it found it in."""
    import torch

    from dapo_trainer.rewards import default_compute_score

    eos, pad = tokenizer.convert_tokens_to_ids("<eos>"), tokenizer.convert_tokens_to_ids("<pad>")
    by_len = {}
    for i, r in enumerate(rows):
        by_len.setdefault(len(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]), []).append(i)
    correct, was_training = 0.0, model.training
    model.eval()
    try:
        with torch.no_grad():
            for idx in by_len.values():
                ids = torch.tensor([tokenizer(rows[i]["prompt"], add_special_tokens=False)["input_ids"] for i in idx])
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=MAX_RESPONSE, eos_token_id=eos, pad_token_id=pad,
                                     top_k=None, top_p=None, temperature=None)
                for i, seq in zip(idx, out[:, ids.shape[1]:].tolist()):
                    body = seq[:seq.index(eos)] if eos in seq else seq
                    text = tokenizer.decode(body, skip_special_tokens=True)
                    r = rows[i]
                    correct += float(default_compute_score(r["data_source"], text, r["ground_truth"])["acc"])
    finally:
        model.train(was_training)
    return correct / max(len(rows), 1)


def load_hf(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            AutoTokenizer.from_pretrained(model_dir))


def after_first(xs):
    """The median of the per-step values after the first (the first holds one-off warm-up)."""
    xs = list(xs)
    xs = xs[1:] or xs
    return statistics.median(xs) if xs else float("nan")


def quantile(xs, q):
    """The ``q`` quantile of ``xs`` (linear between the order statistics)."""
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def cumulative(xs):
    out, t = [], 0.0
    for x in xs:
        t += x
        out.append(t)
    return out


# --------------------------------------------------------------------------- workers
def run_ours(args, assets, variant, run_dir):
    """One run of our trainer (synchronous: generate, then update), demo.yaml + the paths."""
    from dapo_trainer.config import load_config
    from dapo_trainer.demo import DEFAULT_CONFIG
    from dapo_trainer.metrics import read_metrics
    from dapo_trainer.trainer import DAPOTrainer

    model_dir = copy_model(assets.model_dir, os.path.join(run_dir, "model_init"))
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files=[{assets.train_file}]",
        f"data.val_files=[{assets.val_file}]",
        f"data.val_max_samples={args.val_rows}",
        f"trainer.default_local_dir={os.path.join(run_dir, 'run')}",
        f"trainer.seed={args.seed}",
        f"trainer.total_training_steps={args.steps}",
        "trainer.test_freq=0",  # its own validation at the last step only (the cross-check)
        f"trainer.save_freq={args.eval_every}",  # the held-out curve: checkpoints evaluated after the run
        "trainer.val_before_train=false",
        "trainer.resume_mode=disable",
        "trainer.progress_bar=false",
        *OUR_OVERRIDES[variant],
        *(SMOKE_OVERRIDES if args.smoke else []),
    ]
    cfg = load_config(DEFAULT_CONFIG, overrides)
    t0 = time.perf_counter()
    trainer, cpu_s = DAPOTrainer(cfg), []
    step_fn = trainer.train_step

    def train_step():  # the step's CPU time too (one thread: what the step costs without other load)
        c = time.process_time() + workers_cpu_s(trainer)
        metrics = step_fn()
        cpu_s.append(time.process_time() + workers_cpu_s(trainer) - c)
        return metrics

    trainer.train_step = train_step
    trainer.fit()
    wall = time.perf_counter() - t0
    rows = [m for m in read_metrics(os.path.join(run_dir, "run")) if "timing_s/step" in m]
    final = next(m for m in reversed(rows) if "val/acc" in m)
    keys = ("timing_s/step", "timing_s/gen", "timing_s/reward", "timing_s/filter", "timing_s/old_log_prob",
            "timing_s/update_actor", "timing_s/update_weights")
    parts = {k.split("/")[1]: after_first(m.get(k, 0.0) for m in rows) for k in keys}
    if rows and "timing_s/wait_batch" in rows[0]:  # async: generation, reward and filter ran in the worker;
        parts.update(gen=after_first(m["timing_s/wait_batch"] for m in rows), reward=0.0, filter=0.0)  # the wait
    parts["other"] = parts["step"] - sum(v for k, v in parts.items() if k != "step")
    step_s = [m["timing_s/step"] for m in rows]
    cum = cumulative(step_s)
    # The held-out curve: every checkpoint through the same transformers evaluator as TRL's model.
    val_rows = rows_of(assets.val_file, args.val_rows)
    root = os.path.join(run_dir, "run", "checkpoints")
    curve = []
    for d in sorted((d for d in os.listdir(root) if d.startswith("global_step_")), key=lambda d: int(d.split("_")[-1])):
        k = int(d.split("_")[-1])
        model, tok = load_hf(os.path.join(root, d, "model"))
        curve.append([k, cum[k - 1], hf_heldout_accuracy(model, tok, val_rows)])
    return {"step_s": step_s, "cpu_s": cpu_s, "parts": parts, "curve": curve, "heldout_own": final["val/acc"],
            "wall_s": wall,
            "samples": [m.get("train/gen_responses", float("nan")) for m in rows],
            "tokens": [m.get("train/num_tokens", float("nan")) for m in rows],
            "gen_batches": [m.get("train/num_gen_batches", 1.0) for m in rows]}


def workers_cpu_s(trainer) -> float:
    """CPU seconds used so far by the trainer's rollout worker processes (async_training; 0 without)."""
    workers = getattr(trainer, "async_rollout", None)
    total = 0.0
    for p in workers.procs if workers is not None else ():
        try:
            with open(f"/proc/{p.pid}/stat") as f:  # utime, stime: fields 14 and 15, after the ")" of comm
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):  # exited: its last seconds are not counted
            pass
    return total


class _Profile:
    """TRL's ``profiling_context`` timers (it logs them only to wandb / mlflow / trackio), recorded
    with the enclosing timers' names: ``[(name, seconds, parents, global_step)]``."""

    def __init__(self):
        from trl.extras import profiling

        self.records, self.stack = [], []
        cls = profiling.ProfilingContext
        enter, exit_ = cls.__enter__, cls.__exit__
        prof = self

        def __enter__(ctx):
            prof.stack.append(ctx.name)
            return enter(ctx)

        def __exit__(ctx, *exc):
            t = time.perf_counter() - ctx._start_time
            prof.stack.pop()
            prof.records.append((ctx.name.split(".", 1)[-1], t, tuple(prof.stack), ctx.step))
            return exit_(ctx, *exc)

        cls.__enter__, cls.__exit__ = __enter__, __exit__


def run_trl(args, assets, run_dir):
    """One run of TRL's GRPOTrainer with the demo's settings (module docstring)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.rewards import get_soft_overlong_punishment

    from dapo_trainer.rewards import default_compute_score

    U = UPDATES_PER_STEP
    model_dir = copy_model(assets.model_dir, os.path.join(run_dir, "model_init"))
    model, tok = load_hf(model_dir)
    data = Dataset.from_list([{k: r[k] for k in ("prompt", "ground_truth", "data_source")}
                              for r in rows_of(assets.train_file)])
    val_rows = rows_of(assets.val_file, args.val_rows)

    def demo_verifier(prompts, completions, ground_truth, data_source, **_):
        return [float(default_compute_score(ds, c, gt)["score"])
                for c, gt, ds in zip(completions, ground_truth, data_source)]

    class Timer(TrainerCallback):
        def __init__(self):
            self.begin, self.end, self.cpu_begin, self.cpu_end = [], [], [], []

        def on_step_begin(self, a, state, control, **kw):
            self.begin.append(time.perf_counter())
            self.cpu_begin.append(time.process_time())

        def on_step_end(self, a, state, control, **kw):
            self.cpu_end.append(time.process_time())
            self.end.append(time.perf_counter())

    class HeldOut(TrainerCallback):
        """Every eval_every generation batches (after Timer's on_step_end: not timed)."""

        def __init__(self):
            self.acc = {}

        def on_step_end(self, a, state, control, model=None, **kw):
            k, r = divmod(state.global_step, U)
            if r == 0 and (k % args.eval_every == 0 or k == args.steps):
                self.acc[k] = hf_heldout_accuracy(model, tok, val_rows)

    class Counted(GRPOTrainer):
        """GRPOTrainer recording each generation batch's rows and completion tokens."""

        counts = []

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            self.counts.append((int(out["completion_mask"].shape[0]), float(out["completion_mask"].sum())))
            return out

    config = GRPOConfig(
        output_dir=os.path.join(run_dir, "run"), use_cpu=True, seed=args.seed, report_to=[],
        save_strategy="no", logging_steps=U, disable_tqdm=True,
        max_steps=args.steps * U,
        per_device_train_batch_size=PROMPTS_PER_STEP * N_SAMPLES // U,
        steps_per_generation=U, gradient_accumulation_steps=1, num_iterations=1,
        num_generations=N_SAMPLES, max_completion_length=MAX_RESPONSE, temperature=1.0, top_p=1.0, top_k=0,
        loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.0, scale_rewards="group",
        max_grad_norm=1.0, learning_rate=LR, weight_decay=0.0)
    # demo.yaml's schedule: lr x (s + 1) / 2 for trainer step s < 2, then lr; one trainer step is
    # UPDATES_PER_STEP optimizer steps. (TRL's warmup_steps starts from lr 0.)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t // U + 1) / WARMUP_STEPS))
    timer, held, prof = Timer(), HeldOut(), _Profile()
    t0 = time.perf_counter()
    trainer = Counted(model=model, processing_class=tok, args=config, train_dataset=data,
                      reward_funcs=[demo_verifier, get_soft_overlong_punishment(MAX_RESPONSE, OVERLONG_LEN)],
                      optimizers=(opt, sched), callbacks=[timer, held])
    trainer.train()
    wall = time.perf_counter() - t0

    step_s = [timer.end[U * k + U - 1] - timer.begin[U * k] for k in range(len(timer.end) // U)]
    cpu_s = [timer.cpu_end[U * k + U - 1] - timer.cpu_begin[U * k] for k in range(len(timer.end) // U)]
    cum = cumulative(step_s)

    def per_step(name, parent=None):
        """Seconds of timer ``name`` (inside ``parent``) per generation batch."""
        out = [0.0] * len(step_s)
        for n, t, parents, step in prof.records:
            if n == name and (parent is None or any(p.endswith(parent) for p in parents)) and step // U < len(out):
                out[step // U] += t
        return out

    prep = per_step("_prepare_inputs")
    gen = per_step("transformers.generate")
    reward = per_step("_calculate_rewards")
    old_lp = per_step("_get_per_token_logps_and_entropies", parent="_prepare_inputs")
    fwd = per_step("compute_loss")
    parts = {"step": after_first(step_s), "gen": after_first(gen), "reward": after_first(reward),
             "old_log_prob": after_first(old_lp),
             "prepare_other": after_first(p - g - r - o for p, g, r, o in zip(prep, gen, reward, old_lp)),
             "update_actor": after_first(s - p for s, p in zip(step_s, prep)),
             "update_forward_loss": after_first(fwd)}
    curve = [[k, cum[k - 1], a] for k, a in sorted(held.acc.items())]
    return {"step_s": step_s, "cpu_s": cpu_s, "parts": parts, "curve": curve, "heldout_own": curve[-1][2],
            "wall_s": wall,
            "samples": [float(c[0]) for c in Counted.counts], "tokens": [c[1] for c in Counted.counts],
            "gen_batches": [1.0] * len(step_s)}


def worker(args):
    import torch

    torch.set_num_threads(1)
    assets = demo_assets(args)
    run_dir = os.path.join(args.run_root, f"{args.worker}_seed{args.seed}")
    if os.path.exists(run_dir):
        shutil.rmtree(run_dir)
    os.makedirs(run_dir)
    out = run_trl(args, assets, run_dir) if args.worker == "trl" else run_ours(args, assets, args.worker, run_dir)
    out.update(trainer=args.worker, seed=args.seed, threads=torch.get_num_threads(),
               process_s=time.perf_counter() - T_START)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


# --------------------------------------------------------------------------- tables
def versions():
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "trl", "accelerate", "datasets"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "absent"
    return out


def has_rollout_correction():
    from dapo_trainer.config import schema

    return "bypass_mode" in open(schema.__file__).read()


def at_time(curve, t):
    """Held-out accuracy of the last evaluation at or before training time ``t`` (``curve``:
    ``[[step, seconds, acc], ...]``, starting with ``[0, 0.0, acc before]``)."""
    best = curve[0]
    for point in curve:
        if point[1] <= t + 1e-9:
            best = point
    return best


def summary(r, before):
    """One run's figures (``r``: a worker's JSON; ``before``: the held-out accuracy at step 0)."""
    step = r["parts"]["step"]
    # Per sample and per token: the steps' time over their samples / tokens (after the first step).
    # Means, not medians: with carry-over a step of ours may generate nothing (its groups kept before).
    k = 1 if len(r["step_s"]) > 1 else 0
    t, samples, tokens = sum(r["step_s"][k:]), sum(r["samples"][k:]), sum(r["tokens"][k:])
    n = len(r["step_s"]) - k
    curve = [[0, 0.0, before]] + [list(c) for c in r["curve"]]
    cpu = r.get("cpu_s")  # (runs before the CPU time was recorded have none)
    return {"step": step, "cpu": after_first(cpu) if cpu else float("nan"), "samples": samples / n,
            "tokens": tokens / n, "per_sample_ms": 1e3 * t / samples,
            "per_token_ms": 1e3 * t / tokens, "final": curve[-1][2], "final_step": curve[-1][0],
            "train_s": sum(r["step_s"]), "curve": curve, "p90_p10": quantile(r["step_s"][k:], 0.9) /
            quantile(r["step_s"][k:], 0.1), "heldout_own": r["heldout_own"],
            "gen_batches": after_first(r["gen_batches"]), "wall_s": r["wall_s"]}


def fmt(xs, spec="{:.2f}"):
    return " / ".join(spec.format(x) for x in xs)


def spread(xs, spec="{:.2f}"):
    """``mean [min-max]`` of the seeds' values."""
    if not xs:
        return "-"
    return (spec + " [" + spec + "-" + spec + "]").format(statistics.mean(xs), min(xs), max(xs))


def per_seed(xs, spec):
    """The seeds' values, and with several seeds their mean [min-max]."""
    return fmt(xs, spec) + (f" (mean {spread(xs, spec)})" if len(xs) > 1 else "")


def ratio_table(results, before, peer="trl"):
    """Per seed: ours' figures, TRL's, and their ratio; rows ``(measure, {trainer: [per seed]})``."""
    by = {}
    for r in results:
        by.setdefault(r["trainer"], {})[r["seed"]] = summary(r, before)
    names = [n for n in by if n != peer]
    seeds = sorted(set.intersection(*(set(v) for v in by.values()))) if by else []
    lines = []
    if peer not in by:
        lines.append(f"(no {peer} runs: no ratios)")
        peers = {}
    else:
        peers = by[peer]
    cols = [peer] + names if peers else names
    head = "| measure (seed " + " / ".join(map(str, seeds)) + ") | " + " | ".join(
        f"{n}" + (f" | {n} / {peer}" if peers and n != peer else "") for n in cols) + " |"
    lines += [head, "|---" * (1 + len(cols) + (len(names) if peers else 0)) + "|"]

    def row(label, key, spec, ratio="ratio"):
        cells = []
        for n in cols:
            vals = [by[n][s][key] for s in seeds]
            cells.append(per_seed(vals, spec))
            if peers and n != peer:
                if ratio is None:
                    cells.append("-")
                elif ratio == "ratio":
                    cells.append(per_seed([by[n][s][key] / peers[s][key] for s in seeds], "{:.2f}"))
                else:  # difference, in points
                    ds = [by[n][s][key] - peers[s][key] for s in seeds]
                    cells.append(f"{fmt(ds, '{:+.1f}')} pts")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("time per step, s (median after the first)", "step", "{:.3f}")
    if all(by[n][s]["cpu"] == by[n][s]["cpu"] for n in cols for s in seeds):
        row("CPU time per step, s (process time, median after the first)", "cpu", "{:.3f}")
    row("samples generated per step (mean)", "samples", "{:.0f}")
    row("time per generated sample, ms", "per_sample_ms", "{:.2f}")
    row("response tokens trained per step (mean)", "tokens", "{:.0f}")
    row("time per trained token, ms", "per_token_ms", "{:.3f}")
    row("step time within the run, p90 / p10", "p90_p10", "{:.2f}", ratio=None)
    row("training time of the run, s (sum of steps)", "train_s", "{:.1f}")
    # Held-out accuracy in percent; at equal steps (the last) and at equal training time.
    for n in cols:
        for s in seeds:
            by[n][s]["final_pct"] = 100 * by[n][s]["final"]
    row("held-out at the last step (equal steps), %", "final_pct", "{:.1f}", ratio="diff")
    if peers:
        for n in names:
            for s in seeds:
                a, b = by[n][s], peers[s]
                t = min(a["train_s"], b["train_s"])
                pa, pb = at_time(a["curve"], t), at_time(b["curve"], t)
                a.setdefault("eqt", {})[peer] = (t, 100 * pa[2], pa[0])
                b.setdefault("eqt", {})[n] = (t, 100 * pb[2], pb[0])
        cells = []
        for n in cols:
            if n == peer:
                cells.append("; ".join(f"vs {m}: " + fmt([peers[s]['eqt'][m][1] for s in seeds], "{:.1f}") +
                                       " (step " + fmt([peers[s]['eqt'][m][2] for s in seeds], "{:d}") + ")"
                                       for m in names))
            else:
                e = [by[n][s]["eqt"][peer] for s in seeds]
                cells.append(fmt([x[1] for x in e], "{:.1f}") + " (step " + fmt([x[2] for x in e], "{:d}") +
                             "; at " + fmt([x[0] for x in e], "{:.0f}") + " s)")
                cells.append(fmt([x[1] - peers[s]["eqt"][n][1] for x, s in zip(e, seeds)], "{:+.1f}") + " pts")
        lines.append("| held-out at equal training time, % | " + " | ".join(cells) + " |")
    return lines, by, seeds


def tables(results, meta):
    """The markdown tables of a run (``results``: the workers' JSON, in run order)."""
    v = meta["versions"]
    lines = [f"torch {v['torch']}, transformers {v['transformers']}, trl {v['trl']} (accelerate {v['accelerate']}, "
             f"datasets {v['datasets']}); {meta['steps']} steps (generation batches of 16 prompts x 8) per run, "
             f"seeds {meta['seeds']}, 1 thread, {meta['val_rows']} held-out rows evaluated every "
             f"{meta['eval_every']} steps; run order {' '.join(meta.get('order', []))}; load average "
             f"{meta['load_start']} at the start, {meta['load_end']} at the end; total {meta['total_s']:.0f} s.",
             f"Held-out accuracy before RL (greedy, transformers evaluator): {100 * meta['before']:.1f}%.", "",
             "Per seed, then mean [min-max] over the seeds:", ""]
    ratio_lines, by, seeds = ratio_table(results, meta["before"])
    lines += ratio_lines
    cols = ("gen", "reward", "filter", "prepare_other", "old_log_prob", "update_actor", "update_forward_loss",
            "update_weights", "other")
    lines += ["", "Where a step's time goes, s (median over the steps after the first; mean [min-max] over "
              "seeds). Ours: timing_s/* (async: gen = the wait for the worker's batches); TRL: its profiling "
              "timers (update_actor = the four optimizer steps, update_forward_loss = their compute_loss calls).",
              "",
              "| trainer | step | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    runs = {}
    for r in results:
        runs.setdefault(r["trainer"], []).append(r)
    for name, rs in runs.items():
        cells = []
        for k in ("step", *cols):
            xs = [r["parts"][k] for r in rs if k in r["parts"]]
            cells.append(spread(xs, "{:.3f}") if xs else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Held-out curves, step: training seconds -> accuracy % (transformers evaluator); ours' own "
              "validation at the last step in brackets:", ""]
    for name, per_seed in by.items():
        for s in seeds:
            x = per_seed[s]
            pts = ", ".join(f"{k}: {t:.0f}s {100 * a:.1f}" for k, t, a in x["curve"])
            own = f" [own {100 * x['heldout_own']:.1f}]" if name != "trl" else ""
            lines.append(f"- {name} seed {s}: {pts}{own}")
    return "\n".join(lines)


def load_avg():
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


# --------------------------------------------------------------------------- driver
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="generation batches (trainer steps) per run (default 30)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated RL seeds (default 0,1,2)")
    p.add_argument("--trainers", default=None,
                   help=f"comma-separated, of {', '.join(TRAINERS)} (default {','.join(DEFAULT_TRAINERS)}; "
                        "ours_bypass is dropped where the trainer has no rollout correction)")
    p.add_argument("--eval-every", type=int, default=5, help="held-out evaluation every N steps (default 5)")
    p.add_argument("--assets-seed", type=int, default=0, help="seed of the demo's warm start (default 0)")
    p.add_argument("--warm-start-steps", type=int, default=None,
                   help="supervised warm-start steps (default: the demo's); fewer for a toy run")
    p.add_argument("--val-rows", type=int, default=200, help="held-out rows evaluated (default: all 200)")
    p.add_argument("--cache-dir", default=None, help="the demo's asset cache (default .cache/dapo_demo)")
    p.add_argument("--run-root", default=None, help="the runs' directories (default runs/bench_trl)")
    p.add_argument("--out", default=None, help="also write the tables here (markdown)")
    p.add_argument("--report", metavar="RESULTS_JSON", default=None,
                   help="print (and --out) the tables of an earlier run's results.json, running nothing")
    p.add_argument("--smoke", action="store_true",
                   help="toy sizes (2 steps, 1 seed, 16 held-out rows, a 5-step warm start, dynamic sampling "
                        "off, a temporary cache and run directory): checks that everything runs; TRL's runs "
                        "are skipped, with the reason printed, where trl does not import")
    p.add_argument("--worker", choices=TRAINERS, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        for k, val in SMOKE.items():
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, val)
        if args.cache_dir is None and not args.worker:
            tmp = tempfile.mkdtemp(prefix="bench_trl_smoke_")
            args.cache_dir, args.run_root = os.path.join(tmp, "cache"), args.run_root or os.path.join(tmp, "runs")
    args.cache_dir = args.cache_dir or os.path.join(ROOT, ".cache", "dapo_demo")
    args.run_root = args.run_root or os.path.join(ROOT, "runs", "bench_trl")
    for k in ("steps", "eval_every", "val_rows"):
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1, got {getattr(args, k)}")
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds: comma-separated integers, got {args.seeds!r}")
    if not args.seed_list:
        p.error("--seeds: at least one seed")
    trainers = [t.strip() for t in (args.trainers or ",".join(DEFAULT_TRAINERS)).split(",") if t.strip()]
    bad = [t for t in trainers if t not in TRAINERS]
    if bad:
        p.error(f"--trainers: unknown {bad}; choose from {', '.join(TRAINERS)}")
    if "trl" in trainers and not trl_importable() and not args.report:
        if not args.smoke:
            p.error(TRL_MISSING)
        print(f"TRL runs skipped: {TRL_MISSING}", flush=True)
        trainers.remove("trl")
    args.trainer_list = trainers
    return args


def report(path, out=None):
    """The tables of a saved ``results.json`` (written by an earlier run)."""
    with open(path) as f:
        saved = json.load(f)
    text = tables(saved["results"], saved["meta"])
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    return text


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if args.report:
        return report(args.report, args.out)
    trainers = args.trainer_list
    for name in ("ours_bypass", "ours_async_bypass"):
        if name in trainers and not has_rollout_correction():
            print(f"{name} dropped: this trainer has no algorithm.rollout_correction", flush=True)
            trainers.remove(name)
    seeds = args.seed_list
    meta = {"steps": args.steps, "seeds": seeds, "val_rows": args.val_rows, "eval_every": args.eval_every,
            "load_start": load_avg(), "versions": versions(), "order": []}
    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(1)
    assets = demo_assets(args)
    model, tok = load_hf(assets.model_dir)
    meta["before"] = hf_heldout_accuracy(model, tok, rows_of(assets.val_file, args.val_rows))
    os.makedirs(args.run_root, exist_ok=True)
    results = []
    for i, seed in enumerate(seeds):
        order = trainers if i % 2 == 0 else trainers[::-1]  # interleaved, the order alternating
        for name in order:
            js = os.path.join(args.run_root, f"{name}_seed{seed}.json")
            log = os.path.join(args.run_root, f"{name}_seed{seed}.log")
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--seed", str(seed),
                   "--json", js, "--steps", str(args.steps), "--assets-seed", str(args.assets_seed),
                   "--val-rows", str(args.val_rows), "--eval-every", str(args.eval_every),
                   "--cache-dir", args.cache_dir, "--run-root", args.run_root]
            if args.warm_start_steps is not None:
                cmd += ["--warm-start-steps", str(args.warm_start_steps)]
            if args.smoke:
                cmd.append("--smoke")
            env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
            t = time.perf_counter()
            with open(log, "w") as f:
                proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
            if proc.returncode:
                with open(log) as f:
                    sys.stderr.write(f.read()[-6000:])
                raise SystemExit(f"{name} seed {seed} failed (exit {proc.returncode}); its log: {log}")
            with open(js) as f:
                r = json.load(f)
            results.append(r)
            meta["order"].append(f"{name}/{seed}")
            print(f"{name} seed {seed}: step {r['parts']['step']:.3f} s, held-out {100 * r['curve'][-1][2]:.1f}%, "
                  f"{time.perf_counter() - t:.0f} s (load {load_avg()})", flush=True)
    meta.update(load_end=load_avg(), total_s=time.perf_counter() - t0)
    text = tables(results, meta)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    with open(os.path.join(args.run_root, "results.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
