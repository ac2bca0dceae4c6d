"""``dapo-profile --config CONFIG [key=value ...] (--steps N | --duration SECONDS)``: where a step's time goes.

Runs the ordinary trainer (no resume, validation and checkpoints as the config says) and writes
``OUT/profile.json`` and ``OUT/profile.html`` (default OUT: ``trainer.default_local_dir/profile``):

* time per phase per step (the trainer's ``timing_s/*``: gen, reward, filter, old_log_prob, ref,
  update_actor, update_weights, validate; plus checkpoint, timed here around ``save``);
* generation batches per step and the seconds each took;
* tokens/s of the rollout (prompt + response tokens generated / generation time) and of the update
  (packed tokens of every micro-batch, all epochs / update time);
* padding of the rollout's fixed-width response buffers (1 - response tokens / (responses x
  ``data.max_response_length``)) and micro-batch utilisation (tokens per micro-batch / the cap
  ``ppo_max_token_len_per_gpu`` x SP size; the update itself packs, so it pads nothing);
* peak memory (CUDA: ``max_memory_allocated``; CPU: the process's peak resident set);
* on CUDA, the share of one step's wall time in which no kernel ran (a ``torch.profiler`` trace
  of that step, also written as a chrome trace).

It ends with findings (:func:`findings`): each a sentence computed from the numbers, naming
the measurement and the threshold that triggered it.
"""
from __future__ import annotations

import argparse
import html
import json
import math
import os
import resource
import sys
import time
from collections import defaultdict
from typing import List, Optional

from . import _cli

__all__ = ["run_profile", "findings", "write_html", "cli", "main"]

# Thresholds of the findings (quoted in their text).
MANY_GEN_BATCHES = 1.5  # mean generation batches per step
OVERGEN_KEEP = 0.5  # keep rate above which one generation batch larger than needed is waste
DOMINANT_PHASE = 0.5  # share of the step time
LOW_UTILISATION = 0.6  # tokens per micro-batch / cap
HIGH_PADDING = 0.5  # share of response slots that are padding
TRUNCATION = 0.05  # share of responses cut at max_response_length
CUDA_IDLE = 0.3  # share of a step with no kernel running
PHASE_ADVICE = {
    "gen": "the rollout dominates: a faster engine (actor_rollout_ref.rollout.name=vllm), a lower "
           "data.max_response_length or fewer generation batches (see the keep rate) pay most",
    "update_actor": "the policy update dominates: a larger ppo_max_token_len_per_gpu (fewer, fuller micro-batches), "
                    "bfloat16 or fewer ppo_epochs pay most",
    "reward": "the reward function dominates: make it cheaper or run it in a process pool",
    "old_log_prob": "recomputing old log-probs dominates: one mini-batch per step and one epoch skip it (on-policy, "
                    "unless rollout.calculate_log_probs), as does algorithm.rollout_correction.bypass_mode",
    "ref": "the reference model dominates: lower kl_loss_coef to 0 and use_kl_loss=false if KL is not needed",
    "update_weights": "pushing weights to the rollout engine dominates",
    "validate": "validation dominates: raise trainer.test_freq or lower data.val_max_samples",
    "checkpoint": "checkpointing dominates: raise trainer.save_freq",
}


def _peak_memory(device) -> float:
    import torch

    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux


def _cuda_idle_share(prof, wall_s: float) -> float:
    """1 - (union of the kernels' intervals) / wall time of the profiled step."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if getattr(e, "device_type", None) is not None and e.device_type.name == "CUDA")
    busy, end = 0.0, -math.inf
    for s, e in spans:
        if e > end:
            busy += e - max(s, end)
            end = e
    return max(0.0, 1.0 - busy * 1e-6 / max(wall_s, 1e-9))  # time_range is in microseconds


def run_profile(cfg, *, steps: Optional[int] = None, duration: Optional[float] = None,
                out_dir: Optional[str] = None, trace: bool = True) -> dict:
    """Train under ``cfg`` for ``steps`` steps or until ``duration`` seconds have passed (at least one
    step); returns the profile (also written to ``out_dir/profile.json``)."""
    import torch

    from ..trainer import DAPOTrainer

    if steps is None and duration is None:
        raise ValueError("give steps or duration")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if duration is not None and not duration > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    t = cfg.trainer
    t.resume_mode, t.progress_bar = "disable", False
    out_dir = out_dir or os.path.join(t.default_local_dir, "profile")
    os.makedirs(out_dir, exist_ok=True)
    trainer = DAPOTrainer(cfg)
    a = cfg.actor_rollout_ref.actor
    cap = a.ppo_max_token_len_per_gpu * a.ulysses_sequence_parallel_size if a.use_dynamic_bsz else None

    rec = defaultdict(list)  # what the wrappers see during the current step
    gen_batch, plan, save = trainer.generation.generation_batch, trainer.actor.plan, trainer.save

    def timed_generation_batch(step, k):
        t0 = time.perf_counter()
        gb = gen_batch(step, k)
        rec["gen_batch_s"].append(time.perf_counter() - t0)
        rec["response_len"] += gb.batch.response_len.tolist()
        return gb

    def recorded_plan(batch):
        p = plan(batch)
        seqlens = (batch.prompt_len + batch.response_len).tolist()
        rec["micro_tokens"] += [sum(seqlens[i] for i in mb) for mini in p for mb in mini.micro]
        return p

    trainer.generation.generation_batch, trainer.actor.plan = timed_generation_batch, recorded_plan
    cuda = trainer.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(trainer.device)
    per_step, idle = [], None
    t_start = time.perf_counter()
    while (steps is None or len(per_step) < steps) and (duration is None or not per_step
                                                        or time.perf_counter() - t_start < duration):
        rec.clear()
        profile_this = cuda and trace and len(per_step) == min(1, (steps or 2) - 1)  # the 2nd step (warm)
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA]) if profile_this else None
        t0 = time.perf_counter()
        if prof is not None:
            with prof:
                m = trainer.train_step()
                torch.cuda.synchronize()
            idle = _cuda_idle_share(prof, time.perf_counter() - t0)
            prof.export_chrome_trace(os.path.join(out_dir, "trace_step.json"))
        else:
            m = trainer.train_step()
        step = trainer.global_step
        if t.test_freq > 0 and step % t.test_freq == 0:
            t1 = time.perf_counter()
            trainer.validate()
            m["timing_s/validate"] = time.perf_counter() - t1
        if t.save_freq > 0 and step % t.save_freq == 0:
            t1 = time.perf_counter()
            save()
            m["timing_s/checkpoint"] = time.perf_counter() - t1
        m["timing_s/step"] = time.perf_counter() - t0
        micro = rec["micro_tokens"] * a.ppo_epochs
        lens = rec["response_len"]
        per_step.append({
            "step": step, **{k: v for k, v in m.items() if k.startswith("timing_s/")},
            "gen_batches": len(rec["gen_batch_s"]), "gen_batch_s": list(rec["gen_batch_s"]),
            "keep_rate": m["train/keep_rate"], "seen_groups": m["train/seen_groups"],
            "all_correct_groups": m["train/all_correct_groups"], "all_wrong_groups": m["train/all_wrong_groups"],
            "gen_tokens": m["train/gen_tokens"], "update_tokens": sum(micro), "micro_batches": len(micro),
            "micro_batch_utilisation": sum(micro) / (len(micro) * cap) if cap and micro else None,
            "responses": len(lens), "response_tokens": sum(lens),
            "truncated_share": m["response_length/clip_ratio"]})
    prof = summarise(per_step, cfg, _peak_memory(trainer.device), idle, trainer.device.type)
    prof["findings"] = findings(prof)
    with open(os.path.join(out_dir, "profile.json"), "w") as f:
        json.dump(prof, f, indent=1)
    write_html(prof, out_dir)
    return prof


def summarise(per_step: List[dict], cfg, peak_memory: float, cuda_idle: Optional[float], device: str) -> dict:
    """Totals and means over the profiled steps."""
    d, a = cfg.data, cfg.actor_rollout_ref.actor
    tot = lambda key: sum(s.get(key) or 0.0 for s in per_step)  # noqa: E731
    phases = sorted({k.split("/", 1)[1] for s in per_step for k in s if k.startswith("timing_s/")} - {"step"})
    step_s = tot("timing_s/step")
    gen_steps = [s for s in per_step if s["seen_groups"]]
    seen = tot("seen_groups")
    util = [s["micro_batch_utilisation"] for s in per_step if s["micro_batch_utilisation"] is not None]
    responses = tot("responses")
    return {
        "device": device, "steps": len(per_step), "per_step": per_step,
        "config": {"train_batch_size": d.train_batch_size, "gen_batch_size": cfg.gen_batch_size,
                   "rollout_n": cfg.actor_rollout_ref.rollout.n, "max_response_length": d.max_response_length,
                   "ppo_max_token_len_per_gpu": a.ppo_max_token_len_per_gpu, "use_dynamic_bsz": a.use_dynamic_bsz,
                   "ppo_mini_batch_size": a.ppo_mini_batch_size},
        "step_s_mean": step_s / len(per_step),
        "phase_share": {p: tot(f"timing_s/{p}") / step_s for p in phases} if step_s else {},
        "gen_batches_per_step": tot("gen_batches") / len(per_step),
        "gen_batch_s_mean": tot("timing_s/gen") / max(tot("gen_batches"), 1),
        # Over the steps that generated (a step filled by carried-over groups has no keep rate).
        "keep_rate": sum(s["keep_rate"] * s["seen_groups"] for s in gen_steps) / seen if seen else None,
        "all_correct_share": tot("all_correct_groups") / seen if seen else None,
        "all_wrong_share": tot("all_wrong_groups") / seen if seen else None,
        "rollout_tokens_per_s": tot("gen_tokens") / max(tot("timing_s/gen"), 1e-9),
        "update_tokens_per_s": tot("update_tokens") / max(tot("timing_s/update_actor"), 1e-9),
        "rollout_padding": 1.0 - tot("response_tokens") / (responses * d.max_response_length) if responses else None,
        "micro_batch_utilisation": sum(util) / len(util) if util else None,
        "truncated_share": sum(s["truncated_share"] for s in per_step) / len(per_step),
        "peak_memory_bytes": peak_memory, "cuda_idle_share": cuda_idle,
    }


def findings(p: dict) -> List[dict]:
    """Plain-language findings, each ``{"text", "measurement", "value", "threshold"}``."""
    out = []

    def add(text, key, threshold):
        out.append({"text": text, "measurement": key, "value": p[key], "threshold": threshold})

    c = p["config"]
    gb, keep = p["gen_batches_per_step"], p["keep_rate"]
    if keep is not None and gb > MANY_GEN_BATCHES:
        easy = (p["all_correct_share"] or 0) >= (p["all_wrong_share"] or 0)
        need = math.ceil(c["train_batch_size"] / max(keep, 1e-9))
        add(f"dynamic sampling needed {gb:.1f} generation batches per step (> {MANY_GEN_BATCHES}); only "
            f"{keep:.0%} of groups were kept, {p['all_correct_share']:.0%} all-correct and "
            f"{p['all_wrong_share']:.0%} all-wrong: the prompts are mostly too {'easy' if easy else 'hard'} "
            + ("(raise the difficulty or drop solved prompts), " if easy else
               "(lower the difficulty or warm-start longer), ") +
            f"or raise data.gen_batch_size from {c['gen_batch_size']} to about {need} so that one batch usually fills "
            f"the step", "gen_batches_per_step", MANY_GEN_BATCHES)
    elif (keep is not None and keep > OVERGEN_KEEP and gb <= 1.0
          and c["gen_batch_size"] * keep > 1.25 * c["train_batch_size"]):
        need = math.ceil(1.1 * c["train_batch_size"] / keep)
        add(f"one generation batch of {c['gen_batch_size']} prompts filled each step and {keep:.0%} of its groups "
            f"were kept (> {OVERGEN_KEEP:.0%}): {c['gen_batch_size'] * keep:.0f} kept groups for a train batch of "
            f"{c['train_batch_size']}; data.gen_batch_size={need} would generate less (the surplus is carried over "
            "or dropped)", "keep_rate", OVERGEN_KEEP)
    if p["phase_share"]:
        phase, share = max(p["phase_share"].items(), key=lambda kv: kv[1])
        advice = PHASE_ADVICE.get(phase, "look at this phase first")
        u = p["micro_batch_utilisation"]
        if phase == "update_actor" and u is not None and u < LOW_UTILISATION:
            # The cap is not what splits the update: the mini-batches are smaller than one micro-batch.
            advice = (f"the policy update dominates, and its micro-batches are only {u:.0%} full: fewer, larger "
                      "mini-batches (ppo_mini_batch_size) or bfloat16 pay most")
        if share > DOMINANT_PHASE:
            out.append({"text": f"{phase} takes {share:.0%} of the step time (> {DOMINANT_PHASE:.0%}): {advice}",
                        "measurement": f"phase_share.{phase}", "value": share, "threshold": DOMINANT_PHASE})
    u = p["micro_batch_utilisation"]
    if u is not None and u < LOW_UTILISATION:
        add(f"micro-batches hold {u:.0%} of the token cap ppo_max_token_len_per_gpu={c['ppo_max_token_len_per_gpu']} "
            f"on average (< {LOW_UTILISATION:.0%}): the memory planned for the cap is unused; raise "
            "ppo_mini_batch_size (more tokens per mini-batch) or lower the cap and give the memory to the rollout",
            "micro_batch_utilisation", LOW_UTILISATION)
    pad = p["rollout_padding"]
    if pad is not None and pad > HIGH_PADDING:
        add(f"responses fill {1 - pad:.0%} of data.max_response_length={c['max_response_length']} on average: "
            f"{pad:.0%} of a fixed-width rollout buffer is padding (> {HIGH_PADDING:.0%}); a lower "
            "max_response_length (with the overlong buffer) saves KV cache and decode steps", "rollout_padding",
            HIGH_PADDING)
    if p["truncated_share"] > TRUNCATION:
        add(f"{p['truncated_share']:.0%} of the trained responses were cut at max_response_length "
            f"(> {TRUNCATION:.0%}): "
            "raise data.max_response_length or enable reward_model.overlong_buffer", "truncated_share", TRUNCATION)
    if p["cuda_idle_share"] is not None and p["cuda_idle_share"] > CUDA_IDLE:
        add(f"the GPU ran no kernel for {p['cuda_idle_share']:.0%} of the traced step (> {CUDA_IDLE:.0%}): host work "
            "(reward, filtering, Python) stalls it; see trace_step.json", "cuda_idle_share", CUDA_IDLE)
    return out


def write_html(p: dict, out_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report import _plot_timing

    esc = html.escape
    img = ""
    if _plot_timing(plt, p["per_step"], os.path.join(out_dir, "profile_timing.png")):
        img = ('<figure><img src="profile_timing.png" alt="time per phase">'
               "<figcaption>Time per phase</figcaption></figure>")
    fmt = lambda v: "n/a" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    keys = ("steps", "step_s_mean", "gen_batches_per_step", "gen_batch_s_mean", "keep_rate", "all_correct_share",
            "all_wrong_share", "rollout_tokens_per_s", "update_tokens_per_s", "rollout_padding",
            "micro_batch_utilisation", "truncated_share", "peak_memory_bytes", "cuda_idle_share")
    summary = "".join(f"<tr><th>{k}</th><td>{esc(fmt(p[k]))}</td></tr>" for k in keys)
    shares = "".join(f"<tr><th>{esc(k)}</th><td>{v:.1%}</td></tr>" for k, v in sorted(p["phase_share"].items()))
    found = "".join(f"<li>{esc(f['text'])} <small>[{esc(f['measurement'])} = {fmt(f['value'])}]</small></li>"
                    for f in p["findings"]) or "<li>nothing stood out</li>"
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>DAPO profile</title>"
            "<style>body{font-family:sans-serif;margin:2em}th{text-align:left;padding-right:1em}</style></head>"
            f"<body><h1>DAPO profile ({esc(p['device'])})</h1><h2>Findings</h2><ul>{found}</ul>"
            f"<h2>Measurements</h2><table>{summary}</table><h2>Share of step time</h2><table>{shares}</table>"
            f"{img}</body></html>")
    path = os.path.join(out_dir, "profile.html")
    with open(path, "w") as f:
        f.write(page)
    return path


def cli(argv: Optional[List[str]] = None) -> dict:
    """``dapo-profile`` with ``argv``: profiles, prints the summary and findings; returns the profile."""
    from ..config import load_config

    ap = argparse.ArgumentParser(prog="dapo-profile", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="trainer YAML")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--steps", type=int, help="profile this many steps")
    g.add_argument("--duration", type=float, help="profile steps until this many seconds have passed")
    ap.add_argument("--out", default=None, help="output directory (default trainer.default_local_dir/profile)")
    ap.add_argument("--no-trace", action="store_true", help="no torch.profiler trace of a step on CUDA")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (the demo uses 1)")
    _cli.add_debug_flag(ap)
    args = ap.parse_intermixed_args(argv)  # overrides may follow a flag
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    cfg = _cli.run("dapo-profile", args.debug, load_config, args.config, args.overrides)
    p = _cli.run("dapo-profile", args.debug, run_profile, cfg, steps=args.steps, duration=args.duration,
                 out_dir=args.out, trace=not args.no_trace)
    out = args.out or os.path.join(cfg.trainer.default_local_dir, "profile")  # (run_profile keeps it)
    print(f"profile: {os.path.join(out, 'profile.json')} and profile.html ({p['steps']} steps, "
          f"{p['step_s_mean']:.2f} s per step)")
    for f in p["findings"]:
        print(f"- {f['text']} [{f['measurement']} = {f['value']:.3g}]")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """The console script: exit status 0 (the wrapper passes a returned value to ``sys.exit``)."""
    cli(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
