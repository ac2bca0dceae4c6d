"""``dapo-report RUN_DIR``: an HTML page of PNG plots from a run's ``metrics.jsonl``.

Plots (each only when the run logged its metrics): reward and accuracy (train and
held-out), keep rate and generation batches per step, response length (per-step range
and the distribution of per-step means), clip fractions, entropy, time per phase and, for
multi-turn runs (the ``dialog/*`` metrics), turns per dialogue, tokens per assistant /
environment turn and assistant vs environment tokens per step, with their run means in the
summary table.
Writes ``RUN_DIR/report/index.html`` and its PNGs; returns / prints the HTML path.
"""
from __future__ import annotations

import argparse
import html
import json
import os
import sys
from typing import Dict, List, Optional, Sequence

__all__ = ["load_metrics", "write_report", "main"]


def load_metrics(run_dir: str) -> List[dict]:
    """The run's metric rows, ordered by step; a step logged twice (a resumed run) keeps
    its last row."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"RUN_DIR {run_dir!r} has no metrics.jsonl")
    by_step: Dict[int, dict] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                # A run killed mid-write leaves a partial last line; anything else is corrupt.
                if n == sum(1 for _ in open(path)):
                    continue
                raise ValueError(f"{path}:{n} is not JSON: {e}") from None
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError(f"{path}:{n} has no 'step'")
            by_step.setdefault(int(row["step"]), {}).update(row)
    if not by_step:
        raise ValueError(f"{path} holds no metrics")
    return [by_step[s] for s in sorted(by_step)]


def _series(rows: Sequence[dict], key: str):
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


# Each panel: title, y label, [(metric key, legend label)].
PANELS = [
    ("reward", "Reward and accuracy", "value", [
        ("critic/score/mean", "train score"), ("critic/rewards/mean", "train reward (after overlong penalty)"),
        ("acc/mean", "train acc"), ("val/acc", "held-out acc (greedy)"), ("val/score", "held-out score")]),
    ("sampling", "Dynamic sampling: keep rate", "fraction of groups", [
        ("train/keep_rate", "keep rate"),
        ("train/all_correct_groups", "all-correct groups (count)"), ("train/all_wrong_groups", "all-wrong groups (count)")]),
    ("gen_batches", "Generation batches per step", "batches", [("train/num_gen_batches", "gen batches")]),
    ("length", "Response length", "tokens", [
        ("response_length/mean", "mean"), ("response_length/max", "max"), ("response_length/min", "min")]),
    ("clip", "Clip fractions", "fraction of tokens", [
        ("actor/pg_clipfrac", "pg_clipfrac (upper)"), ("actor/pg_clipfrac_lower", "pg_clipfrac_lower (dual clip)"),
        ("response_length/clip_ratio", "responses cut at max length")]),
    ("entropy", "Policy entropy and KL", "nats", [("actor/entropy", "entropy"), ("actor/ppo_kl", "ppo_kl"),
                                                  ("actor/kl_loss", "kl_loss")]),
    # Multi-turn runs (rollout/multiturn.py's turn_stats, per step over its generation batches).
    ("turns", "Dialogue turns", "assistant turns", [
        ("dialog/turns_per_dialog", "mean turns per dialogue"), ("dialog/max_turns_per_dialog", "max turns")]),
    ("turn_tokens", "Tokens per turn", "tokens", [
        ("dialog/tokens_per_assistant_turn", "assistant turn"), ("dialog/tokens_per_env_turn", "environment turn")]),
    ("turn_split", "Assistant vs environment tokens", "tokens per step", [
        ("dialog/assistant_tokens", "assistant (trained on)"), ("dialog/env_tokens", "environment (context only)")]),
]


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
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=90)
    plt.close(fig)
    return drawn


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


def _summary(rows: List[dict]) -> List[tuple]:
    val = [r for r in rows if "val/acc" in r]
    out = [("steps", str(max(r["step"] for r in rows)))]
    if val:
        out.append(("held-out accuracy", f"{100 * val[0]['val/acc']:.1f}% (step {val[0]['step']}) -> "
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


def write_report(run_dir: str, out_dir: Optional[str] = None) -> str:
    """Render the report of ``run_dir``; returns the path of ``index.html``."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a training box
    import matplotlib.pyplot as plt

    rows = load_metrics(run_dir)
    out_dir = out_dir or os.path.join(run_dir, "report")
    os.makedirs(out_dir, exist_ok=True)
    figures = []
    for name, title, ylabel, keys in PANELS:
        if _plot_lines(plt, rows, title, ylabel, keys, os.path.join(out_dir, f"{name}.png")):
            figures.append((name, title))
    if _plot_length_hist(plt, rows, os.path.join(out_dir, "length_hist.png")):
        figures.append(("length_hist", "Response length distribution"))
    if _plot_timing(plt, rows, os.path.join(out_dir, "timing.png")):
        figures.append(("timing", "Time per phase"))

    esc = html.escape
    summary = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in _summary(rows))
    body = "".join(f'<figure><img src="{n}.png" alt="{esc(t)}"><figcaption>{esc(t)}</figcaption></figure>'
                   for n, t in figures)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>DAPO run {esc(run_dir)}</title>"
            "<style>body{font-family:sans-serif;margin:2em}figure{display:inline-block;margin:.5em}"
            "th{text-align:left;padding-right:1em}</style></head>"
            f"<body><h1>DAPO run: {esc(os.path.abspath(run_dir))}</h1><table>{summary}</table>{body}</body></html>")
    path = os.path.join(out_dir, "index.html")
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(page)
    os.replace(tmp, path)
    return path


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="dapo-report", description="HTML report with plots of a DAPO run")
    p.add_argument("run_dir", help="the trainer's run directory (trainer.default_local_dir)")
    p.add_argument("-o", "--out", default=None, help="output directory (default RUN_DIR/report)")
    args = p.parse_args(argv)
    try:
        print(write_report(args.run_dir, args.out))
    except ValueError as e:
        sys.exit(f"dapo-report: {e}")


if __name__ == "__main__":
    main()
