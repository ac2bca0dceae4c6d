"""Without the compiled extension ``dapo_kernels._C``, ``import dapo_kernels`` and the tensor ops work and
only the balancing functions fail, with an ``ImportError`` that says how to build the extension.

Run in a subprocess on a copy of the package without its ``.so`` files, as a fresh clone (or a GPU
machine whose Python the shipped extension was not built for) has it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import sys
# An editable install (pip install -e .) maps dapo_kernels.* to its checkout, _C included: use the copy only.
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
import torch
import dapo_kernels as dk

assert dk.__file__.startswith(sys.argv[1]), dk.__file__  # the copy, not the checkout
assert callable(dk.varlen_attention)
assert "dapo_kernels._C" not in sys.modules

# A tensor op end to end, forward and backward, on the CPU.
lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
loss, metrics = dk.policy_loss(lp, torch.tensor([-1.1, -1.9, -0.5]), torch.tensor([1.0, -1.0, 0.5]),
                               torch.tensor([True, True, False]))
loss.backward()
assert torch.isfinite(loss) and lp.grad is not None and lp.grad[2] == 0
pos = dk.packed_position_ids(torch.tensor([0, 2, 5], dtype=torch.int32))
assert pos.tolist() == [0, 1, 0, 1, 2], pos

for call in (lambda: dk.micro_batches([3, 4, 5], 8), lambda: dk.balanced_partitions([1, 2], 2),
             lambda: dk.attention_workload([3], 8), lambda: dk.pipeline_order([[0], [1]], [1, 2])):
    try:
        call()
    except ImportError as e:
        msg = str(e)
        assert "dapo_kernels._C" in msg and "pip install -e ." in msg and "pybind11" in msg, msg
    else:
        raise AssertionError("a balancing function ran without the extension")
print("ok")
"""


def test_package_works_without_compiled_extension(tmp_path):
    """The package imports and a tensor op runs without ``_C``; each balancing function raises the
    ImportError naming ``pip install -e .``."""
    copy = tmp_path / "dapo_kernels"
    shutil.copytree(ROOT / "dapo_kernels", copy, ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    assert not list(copy.rglob("_C*")), "the copy still holds the extension"
    env = dict(os.environ, PYTHONPATH=str(tmp_path), DAPO_KERNELS_BACKEND="torch")
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr
