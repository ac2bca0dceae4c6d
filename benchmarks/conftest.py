"""pytest-benchmark suite (CPU): `pytest benchmarks --benchmark-only` (or `make bench`).

Peers (verl, liger-kernel) are benchmark-only dependencies from requirements-bench*.txt.
verl imports `ray` at module level in places we never call; when ray is not installed a
stub package from benchmarks/_stubs is put on the path so those imports succeed.
"""
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if importlib.util.find_spec("ray") is None:
    sys.path.append(os.path.join(HERE, "_stubs"))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
