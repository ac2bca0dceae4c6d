"""The GPU check scripts run end to end on the CPU at toy sizes (``benchmarks/gpu/smoke_cpu.py``).

Device time comes in minutes per task and a machine start costs one or two of them: a
check that crashes on a renamed argument or a stale shape would waste the run. Each check
runs in its own process because the smoke runner answers ``torch.cuda``'s timing calls on
the host for the whole interpreter. The checks' own correctness rows must read ok too
(toy sizes, interpreted Triton): a FAIL row fails the test.
"""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMOKE = ROOT / "benchmarks" / "gpu" / "smoke_cpu.py"
CHECKS = sorted(p.stem[len("check_"):] for p in (ROOT / "benchmarks" / "gpu").glob("check_*.py"))


def test_every_check_is_covered():
    assert CHECKS, "no benchmarks/gpu/check_*.py found"


@pytest.mark.parametrize("name", CHECKS)
def test_gpu_check_runs_on_cpu(name):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(SMOKE), name], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=540)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"smoke run of check_{name}.py failed (rc {proc.returncode}):\n{out[-4000:]}"
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| ") and not ln.startswith("| op ")]
    assert rows, f"check_{name}.py reported nothing:\n{out[-2000:]}"
    assert not any("| FAIL |" in r for r in rows), "\n".join(rows)
