"""Test harness: interpreter mode for Triton on CPU, output poisoning, per-test seeds.

Environment must be set before dapo_kernels (and so Triton kernels) are imported:
Triton reads TRITON_INTERPRET when a kernel is decorated.
"""
import os
import random
import zlib

os.environ.setdefault("DAPO_KERNELS_POISON", "1")
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover - torch is a hard dependency
    pass

import pytest

# One session seed, printed in the header: every run draws fresh inputs, and a failing
# run is reproduced with DAPO_TEST_SEED=<printed value>.
SESSION_SEED = int(os.environ.get("DAPO_TEST_SEED", random.SystemRandom().randrange(2**31)))
os.environ["DAPO_TEST_SEED"] = str(SESSION_SEED)  # xdist workers inherit it


def pytest_report_header(config):
    return [
        f"dapo-kernels test seed: DAPO_TEST_SEED={SESSION_SEED}",
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}, "
        f"DAPO_KERNELS_POISON={os.environ.get('DAPO_KERNELS_POISON')}",
    ]


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    seed = (SESSION_SEED + zlib.crc32(request.node.nodeid.encode())) % (2**31)
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass
    yield seed
