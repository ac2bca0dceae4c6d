"""Rollout dumps (``trainer.rollout_data_dir``) and the batch-quality analysis of ``dapo-report``.

The trainer writes, per step, ``ROLLOUT_DIR/{step}.jsonl`` (verl's file name): at most
``trainer.rollout_data_max_rows`` rows, whole prompt groups spread evenly over the step's
generation batches, one JSON object per response:

``step, gen_batch, group`` (index of the prompt in its generation batch), ``sample`` (index in
the group), ``prompt``, ``response`` (decoded text), ``response_ids``, ``response_length``,
``finish_reason`` ("stop" | "length"), ``score`` (the reward function's), ``acc``, ``reward``
(score + overlong penalty: what the advantages are computed from), ``filter_metric``,
``components`` (the reward function's dict; ``{}`` for responses another data-parallel replica
sampled), ``kept`` (the group passed the dynamic-sampling filter).

:func:`flag_rows` applies the rules of :data:`RULES`; :func:`write_analysis` draws the PNG
panels and returns the HTML section.
"""
from __future__ import annotations

import glob
import html
import json
import math
import os
from collections import Counter, defaultdict
from typing import Dict, List, Sequence

from ..readers import read_jsonl

# Flag thresholds (the rule texts below quote them).
NGRAM_N = 4  # tokens per n-gram
NGRAM_REPEATS = 3  # occurrences of one n-gram that flag a response
OUTLIER_Z = 2.0  # |reward - group mean| / group std
OUTLIER_MIN_GROUP = 4  # fewer responses give no meaningful spread
RULES = {
    "truncated": "finish_reason is 'length': the response reached data.max_response_length without an "
                 "end-of-sequence token",
    "empty": "the response has no token, or its text is only whitespace",
    "repeated_ngram": f"one {NGRAM_N}-token n-gram occurs at least {NGRAM_REPEATS} times in the response",
    "reward_outlier": f"in a group of at least {OUTLIER_MIN_GROUP} dumped responses, |reward - group mean| > "
                      f"{OUTLIER_Z:g} x the group's standard deviation (population, > 0)",
    "identical_group": "every response of the group (at least 2 dumped) is token for token the same",
}


# --------------------------------------------------------------------------- dump (trainer side)
def spread_groups(groups_per_batch: Sequence[int], n: int, max_rows: int) -> List[tuple]:
    """``(gen batch, group)`` pairs to dump: at most ``max_rows // n`` groups (at least one), evenly
    strided over all groups of the step in arrival order, so every generation batch is sampled."""
    total = sum(groups_per_batch)
    want = min(total, max(1, max_rows // n))
    flat = [(k, g) for k, b in enumerate(groups_per_batch) for g in range(b)]
    return [flat[i * total // want] for i in range(want)]


def check_rollout_dir(rollout_dir: str, key: str = "trainer.rollout_data_dir") -> None:
    """Start-up check that :func:`write_step` can write under ``rollout_dir`` (named ``key`` in the
    ValueError): every existing part of the path is a directory, the deepest one writable."""
    target = os.path.abspath(rollout_dir)
    existing = target
    while not os.path.isdir(existing):
        if os.path.lexists(existing):  # a file, or a link to nothing, where a directory must be
            raise ValueError(f"{key}: {existing!r} is not a directory, so rollouts cannot be written to "
                             f"{target!r}; pick another path")
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{key}: the directory {existing!r} is not writable, so rollouts cannot be written to "
                         f"{target!r}; pick another path")


def write_step(rollout_dir: str, step: int, rows: List[dict]) -> str:
    """``rollout_dir/{step}.jsonl``, replaced atomically (a resumed step overwrites its file)."""
    os.makedirs(rollout_dir, exist_ok=True)
    path = os.path.join(rollout_dir, f"{step}.jsonl")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)
    return path


# What the analysis reads of every row: name -> (types, what it is).
_ROW_FIELDS = {"step": ((int,), "an int"), "group": ((int,), "an int"), "response_length": ((int,), "an int"),
               "reward": ((int, float), "a number")}


def _check_row(row, where: str) -> None:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a rollout row must be a JSON object, got {type(row).__name__}")
    for key, (types, what) in _ROW_FIELDS.items():
        if key not in row:
            raise ValueError(f"{where}: the rollout row has no {key!r} (rows need {sorted(_ROW_FIELDS)})")
        v = row[key]
        if isinstance(v, bool) or not isinstance(v, types):
            raise ValueError(f"{where}: {key!r} must be {what}, got {type(v).__name__} {v!r}")


def load_rollouts(rollout_dir: str) -> List[dict]:
    """Every dumped row of ``rollout_dir``, ordered by step (files named ``{step}.jsonl``)."""
    if not os.path.isdir(rollout_dir):
        raise ValueError(f"rollout directory {rollout_dir!r} does not exist; set trainer.rollout_data_dir")
    files = [p for p in glob.glob(os.path.join(rollout_dir, "*.jsonl"))
             if os.path.basename(p)[:-len(".jsonl")].isdigit()]
    rows = []
    for p in sorted(files, key=lambda p: int(os.path.basename(p)[:-len(".jsonl")])):
        for n, row in read_jsonl(p):
            _check_row(row, f"{p}:{n}")
            rows.append(row)
    if not rows:
        raise ValueError(f"rollout directory {rollout_dir!r} holds no {{step}}.jsonl rows")
    return rows


# --------------------------------------------------------------------------- flags
def _max_ngram_repeats(tokens: Sequence, n: int = NGRAM_N) -> int:
    grams = Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))
    return max(grams.values(), default=0)


def flag_rows(rows: Sequence[dict]) -> List[dict]:
    """``[{"row": row, "flags": {rule: detail}}]`` for every row that breaks a rule of :data:`RULES`
    (groups are rows of one ``(step, gen_batch, group)``)."""
    flags: Dict[int, Dict[str, str]] = defaultdict(dict)
    groups: Dict[tuple, List[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        groups[(r["step"], r.get("gen_batch", 0), r["group"])].append(i)
        ids = r.get("response_ids")
        tokens = ids if ids is not None else list(r.get("response", ""))
        if r.get("finish_reason") == "length":
            flags[i]["truncated"] = f"{r.get('response_length', len(tokens))} tokens, no end-of-sequence"
        if not tokens or not str(r.get("response", "x")).strip():
            flags[i]["empty"] = "no text"
        reps = _max_ngram_repeats(tokens)
        if reps >= NGRAM_REPEATS:
            flags[i]["repeated_ngram"] = f"a {NGRAM_N}-gram occurs {reps} times"
    for members in groups.values():
        rewards = [float(rows[i]["reward"]) for i in members]
        if len(members) >= OUTLIER_MIN_GROUP:
            mean = sum(rewards) / len(rewards)
            std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
            for i, x in zip(members, rewards):
                if std > 0 and abs(x - mean) > OUTLIER_Z * std:
                    flags[i]["reward_outlier"] = f"reward {x:g}, group mean {mean:.3g} +- {std:.3g}"
        if len(members) >= 2:
            seqs = {tuple(rows[i].get("response_ids") or rows[i].get("response", "")) for i in members}
            if len(seqs) == 1:
                for i in members:
                    flags[i]["identical_group"] = f"all {len(members)} responses identical"
    return [{"row": rows[i], "flags": flags[i]} for i in sorted(flags)]


# --------------------------------------------------------------------------- report section
def _save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _heatmap(plt, rows, path) -> bool:
    """Mean reward per (step, response-length bin)."""
    import numpy as np

    first, last = min(r["step"] for r in rows), max(r["step"] for r in rows)
    steps = list(range(first, last + 1))  # a step without a dump (it generated nothing) stays blank
    lmax = max(r["response_length"] for r in rows)
    nbins = max(1, min(20, lmax + 1))
    edges = np.linspace(0, lmax + 1, nbins + 1)
    total = np.zeros((nbins, len(steps)))
    count = np.zeros((nbins, len(steps)))
    col = {s: j for j, s in enumerate(steps)}
    for r in rows:
        b = min(nbins - 1, int(np.searchsorted(edges, r["response_length"], side="right")) - 1)
        total[b, col[r["step"]]] += float(r["reward"])
        count[b, col[r["step"]]] += 1
    mean = np.where(count > 0, total / np.maximum(count, 1), np.nan)
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    im = ax.imshow(mean, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest",
                   extent=(steps[0] - 0.5, steps[-1] + 0.5, edges[0], edges[-1]))
    fig.colorbar(im, ax=ax, label="mean reward of the responses")
    ax.set(title="Reward by response length and step (dumped samples)", xlabel="step",
           ylabel="response length (tokens)")
    _save(fig, path)
    plt.close(fig)
    return True


def _gen_batch_hist(plt, metrics, path) -> bool:
    counts = Counter(int(m["train/num_gen_batches"]) for m in metrics
                     if isinstance(m.get("train/num_gen_batches"), (int, float)))
    if not counts:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    xs = sorted(counts)
    ax.bar(xs, [counts[x] for x in xs], color="tab:orange")
    ax.set_xticks(xs)
    ax.set(title="Generation batches needed per step", xlabel="generation batches in the step",
           ylabel="number of steps")
    _save(fig, path)
    plt.close(fig)
    return True


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def write_analysis(plt, rollout_dir: str, metrics: Sequence[dict], out_dir: str,
                   max_table_rows: int = 200) -> tuple:
    """Draw the batch-quality PNGs into ``out_dir``; returns ``(figures [(name, title)], html)``."""
    rows = load_rollouts(rollout_dir)
    figures = []
    if _heatmap(plt, rows, os.path.join(out_dir, "bq_reward_length.png")):
        figures.append(("bq_reward_length", "Reward by response length and step"))
    if _gen_batch_hist(plt, metrics, os.path.join(out_dir, "bq_gen_batches.png")):
        figures.append(("bq_gen_batches", "Generation batches needed per step"))
    flagged = flag_rows(rows)
    esc = html.escape
    per_rule = Counter(f for x in flagged for f in x["flags"])
    rules = "".join(f"<li><b>{esc(k)}</b> ({per_rule.get(k, 0)} of {len(rows)} samples): {esc(v)}</li>"
                    for k, v in RULES.items())
    cols = ("step", "gen_batch", "group", "sample", "kept", "reward", "response_length", "finish_reason")
    head = "".join(f"<th>{c}</th>" for c in cols) + "<th>flags</th><th>prompt</th><th>response</th>"
    body = "".join(
        "<tr>" + "".join(f"<td>{esc(_fmt(x['row'].get(c, '')))}</td>" for c in cols)
        + f"<td>{esc('; '.join(f'{k}: {v}' for k, v in x['flags'].items()))}</td>"
        + f"<td><code>{esc(str(x['row'].get('prompt', ''))[-80:])}</code></td>"
        + f"<td><code>{esc(str(x['row'].get('response', ''))[:160])}</code></td></tr>"
        for x in flagged[:max_table_rows])
    more = (f"<p>{len(flagged) - max_table_rows} more flagged samples not shown.</p>"
            if len(flagged) > max_table_rows else "")
    # A step the carried-over groups filled generated nothing, so it has no dump: say so, not leave a gap.
    carried = [m["step"] for m in metrics if m.get("train/num_gen_batches") == 0 and "step" in m]
    why = (f" Steps {', '.join(map(str, carried))} trained only on groups carried over from earlier steps: they "
           f"generated nothing, so they have no dump." if carried else "")
    section = (f"<h2>Batch quality</h2><p>{len(rows)} dumped samples from {esc(os.path.abspath(rollout_dir))}; "
               f"{len(flagged)} flagged.{esc(why)} Rules:</p><ul>{rules}</ul>"
               f"<table class='flags'><tr>{head}</tr>{body}</table>{more}")
    return figures, section
