"""``benchmarks/gpu/sweep.py``, the optional autotune sweep for the time left in a GPU session, runs end to
end on the CPU (``--toy``: interpreter, toy sizes) and writes its JSON, markdown table and tile proposal; a
config whose output is wrong is a FAIL row and never a winner; a budget stop keeps what was measured."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu" / "sweep.py"


def _sweep(out, budget, **env_vars):
    env = dict(os.environ, **env_vars)
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), "--toy", "--commit", "abc1234", "--budget-s",
                           str(budget)], env=env, capture_output=True, text=True, timeout=budget + 120)
    return proc, json.loads((out / "sweep.json").read_text())


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    """A whole toy sweep with the forward's BLOCK_N=32 config forced to give twice the right output."""
    out = tmp_path_factory.mktemp("sweep")
    return out, *_sweep(out, 400, SWEEP_FAULT="fwd:BLOCK_N=32 w1 s1")


def test_sweep_runs_end_to_end_and_writes_its_files(faulty_run):
    """Every kernel of every toy case has a winner per bucket, the fused loss one per tunable sweep, and the
    JSON, table, tile proposal and log are written."""
    out, proc, result = faulty_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["status"] == "complete" and result["commit"] == "abc1234" and result["toy"] is True
    won = {(w["kernel"], w["dtype"], w["bucket"]) for w in result["winners"]}
    for kernel in ("fwd", "dkdv_dq", "dkdv", "dq"):
        for dtype in ("bfloat16", "float16"):
            assert {(kernel, dtype, "L32-T64"), (kernel, dtype, "L64-T128")} <= won, (kernel, dtype, won)
    assert ("fused_loss", "bfloat16", "N64") in won
    table = (out / "sweep.md").read_text()
    assert "| kernel | dtype | D | mask | bucket | config | ms |" in table
    assert "| dq | float16 | 16 | full softcap30" in table
    assert (out / "sweep_tiles.diff").read_text().startswith("no table config timed")
    assert (out / "sweep.log").stat().st_size > 0


def test_a_wrong_config_is_a_fail_row_and_never_a_winner(faulty_run):
    """The forced-wrong forward config fails its check against the float64 reference, is never timed, and every
    forward winner is the other config; the configs of the other kernels still pass their checks."""
    _, _, result = faulty_run
    fails = [r for r in result["rows"] if r["status"] == "FAIL"]
    assert {(r["kernel"], r["config"], r["bucket"]) for r in fails} == {("fwd", "BLOCK_N=32 w1 s1", "check")}, fails
    assert all(r["err_over_bound"] > 1 for r in fails)
    assert not any(r.get("ms") is not None for r in result["rows"] if r["config"] == "BLOCK_N=32 w1 s1"
                   and r["kernel"] == "fwd")
    fwd = [w["config"] for w in result["winners"] if w["kernel"] == "fwd"]
    assert fwd and set(fwd) == {"BLOCK_N=16 w1 s1"}, fwd
    checks = [r for r in result["rows"] if r["bucket"] == "check" and r["kernel"] != "fwd"]
    assert checks and all(r["status"] == "ok" and r["err_over_bound"] <= 1 for r in checks)


def test_the_budget_stop_keeps_what_was_measured(tmp_path):
    """A budget too short for the whole sweep stops it cleanly (a 'stopped' row, no row after it, exit 0) and
    the files still carry the configs timed before the stop and their winners. (The toy budget counts timed
    calls, sweep.TOY_CALL_S each: 10 s lets 4 run whatever the CPU's speed.)"""
    proc, result = _sweep(tmp_path, 10)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["status"] == "stopped by the budget", result["status"]
    statuses = [r["status"] for r in result["rows"]]
    assert statuses.count("stopped") == 1 and statuses[-1] == "stopped", statuses
    timed = [r for r in result["rows"] if r.get("ms") is not None]
    assert timed and result["winners"], result["rows"]
    assert result["seconds"] < 10 + 30
    assert len(timed) < 2 * 4 * 2 * 2 + 4  # (the whole toy sweep: 2 cases x 4 kernels x 2 configs x 2 buckets + loss)
    assert "| fwd | bfloat16 | 16 | causal |" in (tmp_path / "sweep.md").read_text()


def test_the_tile_proposal_keeps_the_winners_and_drops_configs_that_never_won():
    """Per table row and head dim, the proposal lists the configs that won a bucket (most wins first) and drops
    offered configs timed without a win; a config with a FAIL row anywhere is no winner even where it was fastest;
    a winning candidate beyond the tables is named, not written into a row."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu import sweep
    from dapo_kernels.ops.varlen_attention import tiles

    outer, offered = tiles._GPU_TILES["fwd", 90, 2][128]
    assert len(offered) >= 2, offered
    slow, fast = offered[0], offered[1]

    def row(tile, bucket, ms, status="ok", table=("fwd", 90, 2)):
        return dict(kernel="fwd", dtype="bfloat16", D=128, mask="causal", config=f"cfg {tile}", table=table,
                    tile=list(tile), candidate=table is None, bucket=bucket, ms=ms, status=status)
    rows = [row(slow, "L1024-T16384", 2.0), row(fast, "L1024-T16384", 1.0),
            row(slow, "L32768-T131072", 2.0), row(fast, "L32768-T131072", 1.0),
            row((16, 4, 1), "L1024-T16384", 0.1, table=None), row((16, 4, 1), "L32768-T131072", None, "FAIL", None),
            row((32, 4, 2), "L32768-T131072", 0.5, table=None)]
    best = sweep.winners(rows)
    assert best["fwd", "bfloat16", 128, "causal", "L1024-T16384"]["config"] == f"cfg {fast}"
    assert best["fwd", "bfloat16", 128, "causal", "L32768-T131072"]["config"] == "cfg (32, 4, 2)"
    diff = sweep.tiles_diff(rows, best)
    assert f"-('fwd', 90, 2)[128]: ({outer}, {tuple(offered)})" in diff
    assert f"+('fwd', 90, 2)[128]: ({outer}, {(fast, *offered[2:])})" in diff, diff
    assert "candidate beyond the tables won fwd bfloat16 D=128 causal L32768-T131072: cfg (32, 4, 2)" in diff
    assert "(16, 4, 1)" not in diff
