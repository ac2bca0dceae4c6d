"""dapo-report: plots and HTML from a metrics.jsonl, resumed runs, bad run dirs."""
import json
import os
import random

import pytest

from dapo_trainer.tools import report


def _fake_run(path, steps=6, resumed_at=None, partial_tail=False):
    rows = [{"step": 0, "val/acc": random.random(), "val/score": 0.3}]
    for s in range(1, steps + 1):
        rows.append({
            "step": s, "critic/score/mean": random.random(), "critic/rewards/mean": random.random(),
            "acc/mean": random.random(), "train/keep_rate": random.random(),
            "train/num_gen_batches": random.randint(1, 4), "train/all_correct_groups": random.randint(0, 5),
            "train/all_wrong_groups": random.randint(0, 5), "response_length/mean": random.uniform(3, 8),
            "response_length/max": 12, "response_length/min": 2, "response_length/clip_ratio": 0.01,
            "actor/pg_clipfrac": random.random() / 10, "actor/pg_clipfrac_lower": 0.0,
            "actor/entropy": random.random(), "actor/ppo_kl": 1e-3,
            "timing_s/gen": random.random(), "timing_s/update_actor": random.random(),
            "timing_s/step": 2.0, **({"val/acc": 0.5} if s == steps else {})})
    if resumed_at is not None:  # a killed run re-logs the steps after its last checkpoint
        rows += [dict(r, **{"acc/mean": -1.0}) for r in rows if r["step"] >= resumed_at]
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
        if partial_tail:
            f.write('{"step": 7, "acc/me')
    return rows


def test_report_writes_all_plots(tmp_path):
    _fake_run(tmp_path / "run")
    page = report.write_report(str(tmp_path / "run"))
    out = tmp_path / "run" / "report"
    assert page == str(out / "index.html")
    html = open(page).read()
    for name in ("reward", "sampling", "gen_batches", "length", "length_hist", "clip", "entropy", "timing"):
        png = out / f"{name}.png"
        assert png.stat().st_size > 1000, name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f'src="{name}.png"' in html
    assert "held-out accuracy" in html


def test_resumed_run_keeps_last_row_per_step_and_skips_cut_line(tmp_path):
    _fake_run(tmp_path, steps=5, resumed_at=3, partial_tail=True)
    rows = report.load_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == list(range(6))
    assert [r.get("acc/mean") for r in rows[3:]] == [-1.0, -1.0, -1.0]


def test_missing_metrics_skip_their_plot(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 1, "acc/mean": 0.5}) + "\n")
    html = open(report.write_report(str(tmp_path))).read()
    assert 'src="reward.png"' in html and "timing.png" not in html and "clip.png" not in html


def test_bad_run_dir(tmp_path, capsys):
    with pytest.raises(ValueError, match="has no metrics.jsonl"):
        report.load_metrics(str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not valid JSON"):
        report.load_metrics(str(tmp_path))
    with pytest.raises(SystemExit, match="dapo-report: .*has no metrics.jsonl"):
        report.main([str(tmp_path / "nope")])


def test_one_garbage_line_is_named_not_no_metrics(tmp_path):
    """A metrics.jsonl whose only line is not JSON is that line's error (file, line 1), not "holds no
    metrics": a cut last line is skipped only after a valid one."""
    (tmp_path / "metrics.jsonl").write_text("garbage\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: not valid JSON"):
        report.load_metrics(str(tmp_path))


def test_dialogue_runs_show_per_turn_statistics(tmp_path):
    _fake_run(tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as f:  # a multi-turn run's dialog/* metrics on steps 1-3
        for s, (turns, a_tok, e_tok) in enumerate(((1.25, 40, 10), (1.5, 60, 30), (2.0, 80, 60)), 1):
            f.write(json.dumps({"step": s, "dialog/turns_per_dialog": turns, "dialog/max_turns_per_dialog": 2,
                                "dialog/tokens_per_assistant_turn": 4.0 + s, "dialog/tokens_per_env_turn": 4.0,
                                "dialog/assistant_tokens": a_tok, "dialog/env_tokens": e_tok}) + "\n")
    html = open(report.write_report(str(tmp_path))).read()
    for name in ("turns", "turn_tokens", "turn_split"):
        assert (tmp_path / "report" / f"{name}.png").stat().st_size > 1000, name
        assert f'src="{name}.png"' in html
    assert "turns per dialogue</th><td>1.25 (first step) -&gt; 2.00 (last step), mean 1.58" in html
    assert "tokens per turn (mean)</th><td>assistant 6.0, environment 4.0" in html
    assert "assistant vs environment tokens</th><td>180 vs 100 (64.3% assistant)" in html
    # A single-turn run has none of them.
    _fake_run(tmp_path / "single")
    html = open(report.write_report(str(tmp_path / "single"))).read()
    assert "turns.png" not in html and "turns per dialogue" not in html and "turn_split" not in html
