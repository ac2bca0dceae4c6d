"""``dapo-report RUN_DIR``: an HTML page of PNG plots from a run's ``metrics.jsonl``.

Plots (each only when the run logged its metrics): reward and accuracy (train and
held-out), keep rate and generation batches per step, response length (per-step range
and the distribution of per-step means), clip fractions, entropy, time per phase and, for
multi-turn runs (the ``dialog/*`` metrics), turns per dialogue, tokens per assistant /
environment turn and assistant vs environment tokens per step, with their run means in the
summary table.
Writes ``RUN_DIR/report/index.html`` and its PNGs; returns / prints the HTML path.

``--analysis batch_quality`` adds the section of :mod:`dapo_trainer.tools.batch_quality`, read from
the rollouts the trainer dumped (``trainer.rollout_data_dir``; default ``RUN_DIR/rollout_data``).
The page refers to its PNGs by relative path, so it opens from disk without a server; a
script marks every image that fails to load (``data-state="broken"`` and a red outline).
A directory of ``python -m dapo_trainer.demo.ablation`` (it holds ``ablation.json``) gets
the ablation's table and, per task, its rungs side by side: the targeted metric and the
held-out accuracy against the generated responses, means over the seeds.
"""
from __future__ import annotations

import argparse
import html
import math
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from ..readers import read_json, read_jsonl, read_text
from . import _cli

__all__ = ["load_metrics", "val_decoding", "write_report", "ablation_summary", "ablation_table", "main"]


def load_metrics(run_dir: str) -> List[dict]:
    """The run's metric rows, ordered by step; a step logged twice (a resumed run) keeps
    its last row."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"RUN_DIR {run_dir!r} has no metrics.jsonl")
    by_step: Dict[int, dict] = {}
    # A run killed mid-write leaves a partial last line; any other line that is not JSON is corrupt.
    for n, row in read_jsonl(path, skip_partial_last=True):
        if not isinstance(row, dict) or "step" not in row:
            raise ValueError(f"{path}:{n} has no 'step'")
        step = row["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"{path}:{n}: 'step' must be an int >= 0, got {type(step).__name__} {step!r}")
        by_step.setdefault(step, {}).update(row)
    if not by_step:
        raise ValueError(f"{path} holds no metrics")
    return [by_step[s] for s in sorted(by_step)]


def val_decoding(run_dir: str, rows: Sequence[dict]) -> Optional[str]:
    """How the held-out responses were decoded: "greedy" (``val_kwargs.temperature`` 0), "sampled at
    temperature T", or None when the run says nothing about it. Read from the last ``val/temperature``
    the run logged, else from ``RUN_DIR/config.yaml`` (the trainer's config dump)."""
    temps = [r["val/temperature"] for r in rows if isinstance(r.get("val/temperature"), (int, float))]
    t = temps[-1] if temps else None
    path = os.path.join(run_dir, "config.yaml")
    if t is None and os.path.isfile(path):
        import yaml

        try:
            cfg = yaml.safe_load(read_text(path))
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML ({e})") from None
        for key in ("actor_rollout_ref", "rollout", "val_kwargs", "temperature"):
            cfg = cfg.get(key) if isinstance(cfg, dict) else None
        t = cfg if isinstance(cfg, (int, float)) and not isinstance(cfg, bool) else None
    if t is None:
        return None
    return "greedy" if t == 0 else f"sampled at temperature {t:g}"


def _series(rows: Sequence[dict], key: str):
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


# Each panel: title, y label, [(metric key, legend label)].
PANELS = [
    ("reward", "Reward and accuracy", "value", [
        ("critic/score/mean", "train score"), ("critic/rewards/mean", "train reward (after overlong penalty)"),
        ("acc/mean", "train acc"), ("val/acc", "held-out acc"), ("val/score", "held-out score")]),
    # Fractions of the step's freshly generated groups, all on one 0-1 axis (the counts are
    # divided by train/seen_groups in _with_fractions).
    ("sampling", "Dynamic sampling: groups kept / all-correct / all-wrong", "fraction of generated groups", [
        ("train/keep_rate", "kept (reward varies in the group)"),
        ("train/all_correct_frac", "all-correct"), ("train/all_wrong_frac", "all-wrong")]),
    ("gen_batches", "Generation batches per step", "generation batches", [("train/num_gen_batches", "gen batches")]),
    ("length", "Response length", "tokens", [
        ("response_length/mean", "mean"), ("response_length/max", "max"), ("response_length/min", "min")]),
    ("clip", "Clip fractions", "fraction of tokens", [
        ("actor/pg_clipfrac", "pg_clipfrac (upper)"), ("actor/pg_clipfrac_lower", "pg_clipfrac_lower (dual clip)"),
        ("response_length/clip_ratio", "responses cut at max length")]),
    ("entropy", "Policy entropy and KL", "nats per token", [("actor/entropy", "entropy"), ("actor/ppo_kl", "ppo_kl"),
                                                  ("actor/kl_loss", "kl_loss")]),
    # algorithm.rollout_correction (verl's rollout_corr/* names): the rollout vs the training policy, and what the
    # correction did about it (IS weights, rejected tokens).
    ("rollout_corr", "Rollout vs training policy", "nats per token", [
        ("rollout_corr/kl", "kl (training vs rollout)"), ("rollout_corr/k3_kl", "k3 kl"),
        ("rollout_corr/log_ppl_abs_diff", "|log ppl difference|")]),
    ("rollout_corr_is", "Rollout correction: IS weights and rejection", "weight or fraction", [
        ("rollout_corr/rollout_is_mean", "IS weight mean"), ("rollout_corr/rollout_is_max", "IS weight max"),
        ("rollout_corr/rollout_is_eff_sample_size", "effective sample size"),
        ("rollout_corr/rollout_rs_masked_fraction", "rejected tokens")]),
    # Multi-turn runs (rollout/multiturn.py's turn_stats, per step over its generation batches).
    ("turns", "Dialogue turns", "assistant turns", [
        ("dialog/turns_per_dialog", "mean turns per dialogue"), ("dialog/max_turns_per_dialog", "max turns")]),
    ("turn_tokens", "Tokens per turn", "tokens", [
        ("dialog/tokens_per_assistant_turn", "assistant turn"), ("dialog/tokens_per_env_turn", "environment turn")]),
    ("turn_split", "Assistant vs environment tokens", "tokens per step", [
        ("dialog/assistant_tokens", "assistant (trained on)"), ("dialog/env_tokens", "environment (context only)")]),
]


def _with_fractions(rows: List[dict]) -> List[dict]:
    """Rows with all-correct / all-wrong group counts also as fractions of the step's seen groups.
    A step that generated nothing (carried-over groups filled it) has no keep rate to draw."""
    out = []
    for r in rows:
        seen = r.get("train/seen_groups")
        if seen == 0:
            r = {k: v for k, v in r.items() if k != "train/keep_rate"}
        elif isinstance(seen, (int, float)) and seen > 0:
            r = dict(r, **{f"train/all_{w}_frac": r[f"train/all_{w}_groups"] / seen
                           for w in ("correct", "wrong") if isinstance(r.get(f"train/all_{w}_groups"), (int, float))})
        out.append(r)
    return out


def _plot_lines(plt, rows, title, ylabel, keys, path) -> bool:
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    drawn = False
    for key, label in keys:
        xs, ys = _series(rows, key)
        if xs:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, ms=3, label=label)
            drawn = True
    if drawn:
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        _save(fig, [ax], path)
    plt.close(fig)
    return drawn


def _save(fig, axes, path: str) -> None:
    """Grid and legend on each of ``axes``, then write ``fig`` to ``path``."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _plot_length_hist(plt, rows, path) -> bool:
    _, means = _series(rows, "response_length/mean")
    if not means:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.hist(means, bins=min(30, max(5, len(means) // 2)), color="tab:purple", alpha=0.8)
    ax.set(title="Distribution of the per-step mean response length", xlabel="tokens", ylabel="steps")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def _plot_timing(plt, rows, path) -> bool:
    phases = sorted({k for r in rows for k in r if k.startswith("timing_s/") and k != "timing_s/step"})
    train_rows = [r for r in rows if r["step"] > 0]
    if not phases or not train_rows:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    steps = [r["step"] for r in train_rows]
    bottom = [0.0] * len(train_rows)
    for ph in phases:
        vals = [float(r.get(ph, 0.0) or 0.0) for r in train_rows]
        ax.bar(steps, vals, bottom=bottom, label=ph.split("/", 1)[1], width=0.9)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(title="Time per phase", xlabel="step", ylabel="seconds")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def _summary(rows: List[dict], decoding: Optional[str] = None) -> List[tuple]:
    val = [r for r in rows if "val/acc" in r]
    out = [("steps", str(max(r["step"] for r in rows)))]
    if val:
        out.append((f"held-out accuracy ({decoding})" if decoding else "held-out accuracy",
                    f"{100 * val[0]['val/acc']:.1f}% (step {val[0]['step']}) -> "
                    f"{100 * val[-1]['val/acc']:.1f}% (step {val[-1]['step']})"))
    total = sum(float(r.get("timing_s/step", 0.0) or 0.0) for r in rows)
    if total:
        out.append(("training time", f"{total:.0f} s"))
    gen = sum(float(r.get("train/num_gen_batches", 0) or 0) for r in rows)
    if gen:
        out.append(("generation batches", f"{gen:.0f}"))
    _, turns = _series(rows, "dialog/turns_per_dialog")
    if turns:
        out.append(("turns per dialogue", f"{turns[0]:.2f} (first step) -> {turns[-1]:.2f} (last step), "
                                          f"mean {sum(turns) / len(turns):.2f}"))
        per_turn = [f"{who} {sum(v) / len(v):.1f}" for who, v in (
            ("assistant", _series(rows, "dialog/tokens_per_assistant_turn")[1]),
            ("environment", _series(rows, "dialog/tokens_per_env_turn")[1])) if v]
        if per_turn:
            out.append(("tokens per turn (mean)", ", ".join(per_turn)))
        a = sum(_series(rows, "dialog/assistant_tokens")[1])
        e = sum(_series(rows, "dialog/env_tokens")[1])
        if a + e:
            out.append(("assistant vs environment tokens",
                        f"{a:.0f} vs {e:.0f} ({100 * a / (a + e):.1f}% assistant)"))
    return out


# --------------------------------------------------------------------------- ablation
# Two-sided 95% Student t quantiles by degrees of freedom (1..10); beyond that, the normal's.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def mean_ci(values: Sequence[float]) -> Tuple[float, float]:
    """Mean and the half-width of its 95% t interval (nan for a single value)."""
    n = len(values)
    m = sum(values) / n
    if n < 2:
        return m, float("nan")
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    return m, (_T95[n - 2] if n - 1 <= len(_T95) else 1.96) * sd / math.sqrt(n)


def _metric_summary(task: dict, run: dict) -> Tuple[float, float, float]:
    """The targeted metric of one run: (first step, last step, mean over the steps)."""
    vals = [r[task["metric"]] for r in load_metrics(run["run_dir"]) if task["metric"] in r]
    if not vals:
        return float("nan"), float("nan"), float("nan")
    return vals[0], vals[-1], sum(vals) / len(vals)


def ablation_summary(result: dict) -> List[dict]:
    """One row per task and rung: mean and 95% interval of the final held-out accuracy per
    bucket (and overall) and of the targeted metric, over the seeds."""
    rows = []
    for task in result["tasks"]:
        for with_ in (False, True):
            runs = [r for r in result["runs"] if r["task"] == task["name"] and r["with"] == with_]
            if not runs:
                continue
            acc = {b: mean_ci([r["after"][b] for r in runs]) for b in task["buckets"]}
            before = {b: sum(r["before"][b] for r in runs) / len(runs) for b in task["buckets"]}
            overall = mean_ci([sum(r["after"].values()) / len(r["after"]) for r in runs])
            rows.append({"task": task["name"], "component": task["component"], "with": with_,
                         "rung": ("DAPO" if with_ else f"DAPO - {task['component']}"),
                         "steps": round(sum(r["steps"] for r in runs) / len(runs)),
                         "samples": round(sum(r["samples"] for r in runs) / len(runs)),
                         "before": sum(sum(r["before"].values()) / len(r["before"]) for r in runs) / len(runs),
                         "acc": overall, "acc_by_bucket": acc, "before_by_bucket": before, "metric": task["metric"],
                         "metric_label": task["metric_label"],
                         # first step, last step, mean over steps: each a mean and 95% interval over seeds
                         "metric_value": [mean_ci(list(v)) for v in zip(*(_metric_summary(task, r) for r in runs))],
                         "seeds": len(runs)})
    return rows


def _pm(m: float, h: float, scale: float = 100.0, fmt: str = ".1f") -> str:
    return f"{scale * m:{fmt}}" + ("" if math.isnan(h) else f" ± {scale * h:{fmt}}")


def _ablation_cells(rows: List[dict]) -> List[List[str]]:
    """The header and one list of cells per row of :func:`ablation_summary`."""
    out = [["task (component)", "rung", "steps", "samples", "held-out acc % (95% CI)", "by bucket %: before -> after",
            "targeted metric"]]
    for r in rows:
        buckets = ", ".join(f"{b}: {100 * r['before_by_bucket'][b]:.0f} -> {_pm(*v, fmt='.0f')}"
                            for b, v in r["acc_by_bucket"].items()) if len(r["acc_by_bucket"]) > 1 else ""
        out.append([f"{r['task']} ({r['component']})", r["rung"], str(r["steps"]), str(r["samples"]),
                    f"{_pm(*r['acc'])} (before {100 * r['before']:.1f})", buckets,
                    f"{r['metric_label']}: step 1 {_pm(*r['metric_value'][0], scale=1.0, fmt='.3g')}, last "
                    f"{_pm(*r['metric_value'][1], scale=1.0, fmt='.3g')}, mean "
                    f"{_pm(*r['metric_value'][2], scale=1.0, fmt='.3g')}"])
    return out


def ablation_table(rows: List[dict]) -> str:
    """A Markdown table of :func:`ablation_summary`'s rows."""
    cells = _ablation_cells(rows)
    lines = ["| " + " | ".join(c) + " |" for c in cells]
    return "\n".join(lines[:1] + ["|" + "---|" * len(cells[0])] + lines[1:])


def _curve(runs: List[dict], key: str):
    """Mean over ``runs`` of ``key`` against the cumulative generated responses (the sample
    budget), at the steps every run logged it."""
    per_run = []
    for run in runs:
        total, pts = 0.0, {}
        for r in load_metrics(run["run_dir"]):
            total += float(r.get("train/gen_responses", 0) or 0)
            if isinstance(r.get(key), (int, float)):
                pts[r["step"]] = (total, r[key])
        per_run.append(pts)
    steps = sorted(set.intersection(*(set(p) for p in per_run))) if per_run else []
    return ([sum(p[s][0] for p in per_run) / len(per_run) for s in steps],
            [sum(p[s][1] for p in per_run) / len(per_run) for s in steps])


def _plot_ablation(plt, result: dict, task: dict, path: str) -> bool:
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    drawn, decoding = False, None
    for with_, style in ((False, "--"), (True, "-")):
        runs = [r for r in result["runs"] if r["task"] == task["name"] and r["with"] == with_]
        if not runs:
            continue
        label = "DAPO" if with_ else f"DAPO - {task['component']}"
        decoding = decoding or val_decoding(runs[0]["run_dir"], load_metrics(runs[0]["run_dir"]))
        for ax, key in zip(axes, (task["metric"], "val/acc")):
            xs, ys = _curve(runs, key)
            if xs:
                ax.plot(xs, ys, style, marker="o" if len(xs) < 30 else None, ms=3, label=label)
                drawn = True
    if drawn:
        axes[0].set(title=f"{task['name']}: {task['metric_label']}", ylabel=task["metric"])
        axes[1].set(title=f"{task['name']}: held-out accuracy" + (f" ({decoding})" if decoding else ""),
                    ylabel="val/acc")
        for ax in axes:
            ax.set_xlabel(f"generated responses (mean of {len(result['seeds'])} seeds)")
        _save(fig, axes, path)
    plt.close(fig)
    return drawn


def _write_ablation_report(run_dir: str, out_dir: str, plt) -> str:
    result = read_json(os.path.join(run_dir, "ablation.json"))
    figures = []
    for task in result["tasks"]:
        if _plot_ablation(plt, result, task, os.path.join(out_dir, f"ablation_{task['name']}.png")):
            figures.append((f"ablation_{task['name']}", f"{task['name']} ({task['component']})"))
    esc = html.escape
    cells = _ablation_cells(ablation_summary(result))
    table = "".join("<tr>" + "".join(f"<{tag}>{esc(c)}</{tag}>" for c in row) + "</tr>"
                    for row, tag in zip(cells, ["th"] + ["td"] * len(cells)))
    body = "".join(f'<figure><img src="{n}.png" alt="{esc(t)}"><figcaption>{esc(t)}</figcaption></figure><br>'
                   for n, t in figures)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>DAPO ablation {esc(run_dir)}</title>"
            "<style>body{font-family:sans-serif;margin:2em}td,th{padding:.2em .6em;border-bottom:1px solid #ddd}"
            "</style></head>"
            f"<body><h1>DAPO ablation: {esc(os.path.abspath(run_dir))}</h1>"
            f"<p>seeds {esc(str(result['seeds']))}; mean &plusmn; 95% t interval over seeds; "
            f"{result['seconds']:.0f} s</p><table>{table}</table>{body}</body></html>")


ANALYSES = ("batch_quality",)
# Marks each image as loaded or broken once the page has loaded (a browser test reads the marks).
_IMG_CHECK = ("<script>window.addEventListener('load',function(){document.querySelectorAll('img').forEach("
              "function(i){var ok=i.complete&&i.naturalWidth>0;i.dataset.state=ok?'ok':'broken';"
              "if(!ok){i.style.outline='3px solid red';}});document.body.dataset.images='checked';});</script>")


def write_report(run_dir: str, out_dir: Optional[str] = None, analyses: Sequence[str] = (),
                 rollout_dir: Optional[str] = None) -> str:
    """Render the report of ``run_dir``; returns the path of ``index.html``.

    ``analyses``: extra sections (:data:`ANALYSES`); ``rollout_dir``: the rollout dump the
    ``batch_quality`` analysis reads (default ``run_dir/rollout_data``)."""
    bad = [a for a in analyses if a not in ANALYSES]
    if bad:
        raise ValueError(f"analysis must be one of {ANALYSES}, got {bad}")
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(f"dapo-report draws its plots with matplotlib, which is not installed ({e}): "
                          "pip install matplotlib (or pip install 'dapo-kernels[trainer]')") from e
    matplotlib.use("Agg")  # no display on a training box
    import matplotlib.pyplot as plt

    out_dir = out_dir or os.path.join(run_dir, "report")
    if os.path.isfile(os.path.join(run_dir, "ablation.json")):  # python -m dapo_trainer.demo.ablation's directory
        os.makedirs(out_dir, exist_ok=True)
        return _write_page(out_dir, _write_ablation_report(run_dir, out_dir, plt))
    rows = _with_fractions(load_metrics(run_dir))
    decoding = val_decoding(run_dir, rows)
    os.makedirs(out_dir, exist_ok=True)
    figures = []
    for name, title, ylabel, keys in PANELS:
        if decoding:
            keys = [(k, f"{label} ({decoding})" if k == "val/acc" else label) for k, label in keys]
        if _plot_lines(plt, rows, title, ylabel, keys, os.path.join(out_dir, f"{name}.png")):
            figures.append((name, title))
    if _plot_length_hist(plt, rows, os.path.join(out_dir, "length_hist.png")):
        figures.append(("length_hist", "Response length distribution"))
    if _plot_timing(plt, rows, os.path.join(out_dir, "timing.png")):
        figures.append(("timing", "Time per phase"))

    sections = ""
    if "batch_quality" in analyses:
        from . import batch_quality

        figs, sections = batch_quality.write_analysis(plt, rollout_dir or os.path.join(run_dir, "rollout_data"),
                                                      rows, out_dir)
        figures += figs
    esc = html.escape
    summary = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in _summary(rows, decoding))
    body = "".join(f'<figure><img src="{n}.png" alt="{esc(t)}"><figcaption>{esc(t)}</figcaption></figure>'
                   for n, t in figures)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>DAPO run {esc(run_dir)}</title>"
            "<style>body{font-family:sans-serif;margin:2em}figure{display:inline-block;margin:.5em}"
            "th{text-align:left;padding-right:1em}table.flags{border-collapse:collapse;font-size:85%}"
            "table.flags td,table.flags th{border:1px solid #ccc;padding:2px 4px;vertical-align:top}</style></head>"
            f"<body><h1>DAPO run: {esc(os.path.abspath(run_dir))}</h1><table>{summary}</table>{body}{sections}"
            f"{_IMG_CHECK}</body></html>")
    return _write_page(out_dir, page)


def _write_page(out_dir: str, page: str) -> str:
    path = os.path.join(out_dir, "index.html")
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(page)
    os.replace(tmp, path)
    return path


def main(argv: Optional[List[str]] = None) -> int:
    """The console script: prints the page's path; exit status 0."""
    p = argparse.ArgumentParser(prog="dapo-report", description="HTML report with plots of a DAPO run")
    p.add_argument("run_dir", help="the trainer's run directory (trainer.default_local_dir), or the directory "
                                   "of python -m dapo_trainer.demo.ablation (its rungs side by side)")
    p.add_argument("-o", "--out", default=None, help="output directory (default RUN_DIR/report)")
    p.add_argument("--analysis", action="append", default=[], choices=ANALYSES,
                   help="extra section: batch_quality (flagged samples and reward / length panels from the "
                        "rollouts dumped by trainer.rollout_data_dir)")
    p.add_argument("--rollout-dir", default=None, help="the rollout dump (default RUN_DIR/rollout_data)")
    _cli.add_debug_flag(p)
    args = p.parse_args(argv)
    print(_cli.run("dapo-report", args.debug, write_report, args.run_dir, args.out, args.analysis, args.rollout_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
