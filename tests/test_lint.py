"""``ruff check`` over the repository is clean (config: [tool.ruff] in pyproject.toml; ruff is pinned
in requirements-dev.txt, so ``make test`` has it)."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff():
    try:
        import ruff  # noqa: F401  (the PyPI package ships the binary and its finder)
        from ruff.__main__ import find_ruff_bin

        return [find_ruff_bin()]
    except ImportError:
        exe = shutil.which("ruff")
        return [exe] if exe else None


def test_ruff_check_clean():
    cmd = _ruff()
    if cmd is None:
        pytest.skip(f"ruff is not installed in {sys.prefix} (pip install -r requirements-dev.txt)")
    res = subprocess.run(cmd + ["check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
