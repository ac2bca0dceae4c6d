"""``benchmarks/bench_trl_step.py`` (make bench-trl) without TRL installed: its arguments, its
tables from made-up runs, and a --smoke run of our trainer. The TRL half of the smoke run needs
trl (.venv-trl); where trl does not import it is skipped with the reason printed."""
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_trl_step.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_trl_step", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _module()


def test_defaults_are_issue_42s_settings():
    args = bench.parse_args(["--trainers", "ours,ours_bypass"])
    assert (args.steps, args.seed_list, args.eval_every, args.val_rows) == (30, [0, 1, 2], 5, 200)
    assert args.trainer_list == ["ours", "ours_bypass"]
    assert (bench.PROMPTS_PER_STEP, bench.N_SAMPLES, bench.UPDATES_PER_STEP, bench.MAX_RESPONSE) == (16, 8, 4, 12)


@pytest.mark.parametrize("argv, message", [
    (["--trainers", "ours,verl"], "--trainers: unknown ['verl']"),
    (["--seeds", "0,x"], "--seeds: comma-separated integers"),
    (["--seeds", ","], "--seeds: at least one seed"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--eval-every", "0"], "--eval-every must be >= 1"),
])
def test_bad_arguments_are_errors_naming_the_argument(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_without_trl_a_full_run_refuses_and_smoke_skips_it(monkeypatch, capsys):
    monkeypatch.setattr(bench, "trl_importable", lambda: False)
    with pytest.raises(SystemExit):
        bench.parse_args([])
    assert "trl is not importable" in capsys.readouterr().err
    args = bench.parse_args(["--smoke"])
    assert "TRL runs skipped: trl is not importable" in capsys.readouterr().out
    assert args.trainer_list == ["ours", "ours_bypass", "ours_async_bypass"]
    assert (args.steps, args.seed_list, args.warm_start_steps) == (2, [0], 5)
    monkeypatch.setattr(bench, "trl_importable", lambda: True)
    assert bench.parse_args(["--smoke"]).trainer_list == list(bench.DEFAULT_TRAINERS)
    assert bench.parse_args(["--smoke", "--steps", "3"]).steps == 3  # an explicit value wins over --smoke's


def _run(trainer, seed, step, samples, tokens, curve):
    return {"trainer": trainer, "seed": seed, "step_s": [2 * step] + [step] * 3,
            "parts": {"step": step, "gen": step / 4, "old_log_prob": step / 8, "update_actor": step / 2},
            "samples": [samples] * 4, "tokens": [tokens] * 4, "gen_batches": [1.0] * 4, "curve": curve,
            "heldout_own": curve[-1][2], "wall_s": 10.0}


def test_ratio_table_from_made_up_runs():
    # Ours: 0.6 s a step (training 3.0 s), TRL 0.5 s (2.5 s). Ours samples twice as many, trains 300 tokens.
    results = [
        _run("ours", 0, 0.6, 256, 300, [[2, 1.8, 0.5], [4, 3.0, 0.9]]),
        _run("trl", 0, 0.5, 128, 600, [[2, 1.5, 0.3], [4, 2.5, 0.6]]),
        _run("trl", 1, 0.5, 128, 600, [[2, 1.5, 0.4], [4, 2.5, 0.7]]),
        _run("ours", 1, 0.4, 256, 300, [[2, 1.2, 0.6], [4, 2.0, 0.8]]),
    ]
    lines, by, seeds = bench.ratio_table(results, before=0.1)
    assert seeds == [0, 1]
    table = {ln.split(" | ")[0].lstrip("| "): ln.split(" | ")[1:] for ln in lines[2:]}
    step = table["time per step, s (median after the first)"]
    assert step[0].startswith("0.500 / 0.500") and step[1].startswith("0.600 / 0.400")
    assert step[2].startswith("1.20 / 0.80 (mean 1.00 [0.80-1.20])")
    assert table["time per generated sample, ms"][2].startswith("0.60 / 0.40")
    assert table["time per trained token, ms"][2].startswith("2.40 / 1.60")
    assert table["held-out at the last step (equal steps), %"][2].startswith("+30.0 / +10.0 pts")
    # Seed 0: equal time 2.5 s: ours at its step 2 (1.8 s, 50%), TRL at its last (60%).
    # Seed 1: equal time 2.0 s: ours at its last (80%), TRL at its step 2 (1.5 s, 40%).
    eq = table["held-out at equal training time, %"]
    assert eq[0].startswith("vs ours: 60.0 / 40.0 (step 4 / 2)")
    assert eq[1].startswith("50.0 / 80.0 (step 2 / 4; at ")
    assert eq[2].startswith("-10.0 / +40.0 pts")
    meta = {"versions": dict.fromkeys(("torch", "transformers", "trl", "accelerate", "datasets"), "x"), "steps": 4,
            "seeds": [0, 1], "val_rows": 8, "eval_every": 2, "order": ["ours/0", "trl/0", "trl/1", "ours/1"],
            "load_start": "1", "load_end": "1", "total_s": 1.0, "before": 0.1}
    text = bench.tables(results, meta)
    assert "| ours | 0.500 [0.400-0.600] |" in text
    assert "- trl seed 1: 0: 0s 10.0, 2: 2s 40.0, 4: 2s 70.0" in text


def test_cpu_time_row_only_where_every_run_recorded_it():
    runs = [_run("ours", 0, 0.6, 256, 300, [[4, 3.0, 0.9]]), _run("trl", 0, 0.5, 128, 600, [[4, 2.5, 0.6]])]
    assert not any("CPU time per step" in ln for ln in bench.ratio_table(runs, before=0.1)[0])
    runs[0]["cpu_s"], runs[1]["cpu_s"] = [1.0, 0.3, 0.3, 0.3], [1.0, 0.4, 0.4, 0.4]
    row = next(ln for ln in bench.ratio_table(runs, before=0.1)[0] if "CPU time per step" in ln)
    assert row.split(" | ")[1:4] == ["0.400", "0.300", "0.75 |"]


def test_at_time_takes_the_last_evaluation_within_the_time():
    curve = [[0, 0.0, 0.1], [5, 3.0, 0.5], [10, 6.0, 0.9]]
    assert bench.at_time(curve, 2.9) == [0, 0.0, 0.1]
    assert bench.at_time(curve, 6.0) == [10, 6.0, 0.9]


def _smoke(trainers, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--trainers", trainers,
                           "--cache-dir", str(tmp_path / "cache"), "--run-root", str(tmp_path / "runs")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"--smoke failed (rc {proc.returncode}):\n{out[-4000:]}"
    return proc.stdout


@pytest.mark.slow  # ~30 s on a quiet 2-core machine
def test_smoke_run_of_ours(tmp_path):
    """Every variant of ours runs to its tables; the async one (a rollout worker process) counts the worker's
    CPU time in its step's."""
    out = _smoke("ours,ours_bypass,ours_async_bypass", tmp_path)
    assert "| time per step, s (median after the first) |" in out and "- ours_bypass seed 0: 0: 0s" in out
    assert "- ours_async_bypass seed 0: 0: 0s" in out and "| CPU time per step" in out


@pytest.mark.slow
def test_smoke_run_with_trl(tmp_path):
    if importlib.util.find_spec("trl") is None:
        pytest.skip("trl is not importable here (it lives in .venv-trl: make trl-install; "
                    ".venv-trl/bin/python -m pytest tests/benchmarks/test_bench_trl_step.py runs this)")
    out = _smoke("ours,trl", tmp_path)
    assert "ours / trl" in out and "| held-out at equal training time, % |" in out
