"""Batch-quality report: the trainer's rollout dump (trainer.rollout_data_dir), the flag rules on a
crafted rollout file, the report's panels (titles, axis labels, one unit per axis) and the page in a
real headless browser (Debian's chromium) when one is installed."""
import html as html_mod
import json
import os
import re
import shutil
import subprocess

import pytest

from dapo_trainer import rollout_dump
from dapo_trainer.tools import batch_quality, report
from dapo_trainer.config import load_config
from dapo_trainer.trainer import DAPOTrainer
from tests.trainer.tiny import micro_setup


def _row(step, group, sample, ids, reward, finish="stop", gen_batch=0):
    return {"step": step, "gen_batch": gen_batch, "group": group, "sample": sample, "prompt": "p",
            "response": "".join(chr(97 + i % 26) for i in ids), "response_ids": ids, "response_length": len(ids),
            "finish_reason": finish, "score": reward, "acc": reward, "reward": reward, "filter_metric": reward,
            "components": {}, "kept": True}


def test_flag_rules_on_crafted_rollout(tmp_path):
    rows = [
        # group 0 (6 responses): one success among failures, z = 0.833 / 0.373 = 2.24 > 2 -> outlier;
        # the failures sit at z = 0.45. Row 1 is truncated, row 2 empty, row 3 repeats a 4-gram 3 times,
        # row 4 only twice (not flagged).
        _row(1, 0, 0, [1, 2, 3], 1.0), _row(1, 0, 1, [5, 6, 7, 8, 9], 0.0, finish="length"),
        _row(1, 0, 2, [], 0.0), _row(1, 0, 3, [1, 2, 3, 4] * 3, 0.0), _row(1, 0, 4, [1, 2, 3, 4] * 2, 0.0),
        _row(1, 0, 5, [9, 8], 0.0),
        # group 1 (6 responses): two successes, z = 1.41 -> no outlier.
        *[_row(1, 1, j, [j, j + 1], float(j < 2)) for j in range(6)],
        # group 2 of step 2 (3 responses, identical): identical_group on all; too small for outliers.
        *[_row(2, 2, j, [4, 4, 5], float(j == 0)) for j in range(3)],
        # same group id in another generation batch is another group: not identical to the above.
        _row(2, 2, 0, [7], 0.0, gen_batch=1), _row(2, 2, 1, [8], 0.0, gen_batch=1),
    ]
    d = tmp_path / "rollouts"
    rollout_dump.write_step(str(d), 2, [r for r in rows if r["step"] == 2])
    rollout_dump.write_step(str(d), 1, [r for r in rows if r["step"] == 1])
    loaded = batch_quality.load_rollouts(str(d))
    assert loaded == rows  # ordered by step, all fields round-trip
    got = {(r["row"]["step"], r["row"]["gen_batch"], r["row"]["group"], r["row"]["sample"]): set(r["flags"])
           for r in batch_quality.flag_rows(loaded)}
    assert got == {(1, 0, 0, 0): {"reward_outlier"}, (1, 0, 0, 1): {"truncated"}, (1, 0, 0, 2): {"empty"},
                   (1, 0, 0, 3): {"repeated_ngram"},
                   **{(2, 0, 2, j): {"identical_group"} for j in range(3)}}
    assert set(batch_quality.RULES) == {"truncated", "empty", "repeated_ngram", "reward_outlier", "identical_group"}


def test_spread_groups_samples_every_generation_batch():
    assert rollout_dump.spread_groups([4, 4, 4], n=8, max_rows=24) == [(0, 0), (1, 0), (2, 0)]
    assert rollout_dump.spread_groups([2], n=8, max_rows=64) == [(0, 0), (0, 1)]
    assert rollout_dump.spread_groups([3], n=8, max_rows=4) == [(0, 0)]  # at least one whole group


@pytest.fixture(scope="module")
def dumped_run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("bq"))
    overrides = micro_setup(root) + ["trainer.total_training_steps=2", f"trainer.rollout_data_dir={root}/run/rollouts",
                                     "trainer.rollout_data_max_rows=8", "algorithm.filter_groups.carry_over=false"]
    DAPOTrainer(load_config(overrides=overrides)).fit()
    return root


def test_trainer_dumps_capped_whole_groups(dumped_run):
    d = os.path.join(dumped_run, "run", "rollouts")
    assert sorted(os.listdir(d)) == ["1.jsonl", "2.jsonl"]
    metrics = [json.loads(x) for x in open(os.path.join(dumped_run, "run", "metrics.jsonl"))]
    for step in (1, 2):
        rows = [json.loads(x) for x in open(os.path.join(d, f"{step}.jsonl"))]
        assert len(rows) == 8  # rollout_data_max_rows = 2 groups of rollout.n = 4
        gb = int(metrics[step]["train/num_gen_batches"])
        assert {r["gen_batch"] for r in rows} <= set(range(gb))
        groups = {}
        for r in rows:
            assert r["step"] == step and r["response_length"] == len(r["response_ids"]) <= 5
            assert r["finish_reason"] == ("stop" if r["response_ids"] and r["response_ids"][-1] == 1 else "length")
            assert abs(r["score"] - r["components"]["score"]) == 0.0
            groups.setdefault((r["gen_batch"], r["group"]), []).append(r)
        for members in groups.values():
            assert sorted(r["sample"] for r in members) == [0, 1, 2, 3]
            # dynamic sampling keeps a group exactly when its filter metric (acc) varies
            varies = len({r["filter_metric"] for r in members}) > 1
            assert {r["kept"] for r in members} == {varies}


def _images(page):
    html = open(page).read()
    return html, re.findall(r'<img src="([^"]+)"', html)


def test_report_batch_quality_images_resolve(dumped_run):
    """No browser needed: every <img src> of the page is a PNG file beside it."""
    run = os.path.join(dumped_run, "run")
    page = report.write_report(run, analyses=["batch_quality"], rollout_dir=os.path.join(run, "rollouts"))
    html, srcs = _images(page)
    assert {"bq_reward_length.png", "bq_gen_batches.png", "sampling.png"} <= set(srcs)
    for src in srcs:
        path = os.path.join(os.path.dirname(page), src)
        assert not os.path.isabs(src) and open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n", src
    for rule in batch_quality.RULES.values():
        assert html_mod.escape(rule) in html
    with pytest.raises(ValueError, match="analysis must be one of"):
        report.write_report(run, analyses=["nope"])
    with pytest.raises(SystemExit, match="rollout directory .* does not exist"):
        report.main([run, "--analysis", "batch_quality", "--rollout-dir", os.path.join(run, "none")])


def test_every_panel_has_title_labels_and_one_unit(tmp_path, monkeypatch):
    """Each saved figure: a title and both axis labels on every axis; the sampling panel draws
    fractions only (group counts on its 0-1 axis would mix two units)."""
    import matplotlib.figure

    from tests.trainer.test_report import _fake_run

    rows = _fake_run(tmp_path / "run", steps=8)
    for r in rows:
        if r["step"] > 0:
            r["train/seen_groups"] = 5
    with open(tmp_path / "run" / "metrics.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    saved = {}
    real = matplotlib.figure.Figure.savefig

    def spy(fig, path, *a, **k):
        saved[os.path.basename(str(path))] = [(ax.get_title(), ax.get_xlabel(), ax.get_ylabel(),
                                               [list(line.get_ydata()) for line in ax.get_lines()])
                                              for ax in fig.axes if ax.get_label() != "<colorbar>"]
        return real(fig, path, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    report.write_report(str(tmp_path / "run"))
    assert "sampling.png" in saved and len(saved) >= 8
    for name, axes in saved.items():
        for title, xlabel, ylabel, _ in axes:
            assert title and xlabel and ylabel, name
    (_, _, ylabel, lines), = saved["sampling.png"]
    assert len(lines) == 3 and "fraction" in ylabel
    assert all(0.0 <= y <= 1.0 for line in lines for y in line)


def _chromium():
    for name in ("chromium", "chromium-browser", "chromium-headless-shell", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _browser_states(browser, page):
    """The page's DOM after its load event, as a headless chromium sees it from disk."""
    out = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", f"file://{page}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert 'data-images="checked"' in out.stdout  # the load handler ran
    return re.findall(r'<img [^>]*data-state="(\w+)"', out.stdout)


def test_report_in_headless_browser(dumped_run, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("no headless browser: install Debian's chromium (apt-get install chromium) to run this test")
    run = os.path.join(dumped_run, "run")
    page = os.path.abspath(report.write_report(run, analyses=["batch_quality"],
                                               rollout_dir=os.path.join(run, "rollouts")))
    _, srcs = _images(page)
    states = _browser_states(browser, page)
    assert states == ["ok"] * len(srcs) and len(srcs) >= 10
    # A page with a missing picture is caught (the check can fail).
    broken = tmp_path / "broken"
    shutil.copytree(os.path.dirname(page), broken)
    os.remove(broken / srcs[0])
    assert sorted(_browser_states(browser, str(broken / "index.html"))) == ["broken"] + ["ok"] * (len(srcs) - 1)
    shot = os.path.join(run, "report", "screenshot.png")
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1280,3000", f"file://{page}"], capture_output=True, timeout=120, check=True)
    assert open(shot, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(shot) > 20000
    print(f"screenshot: {shot}")
