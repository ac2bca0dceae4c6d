"""group_filter (torch path, CPU) side by side with verl 0.9.1's DAPO filtering and GRPO advantages.

    pytest benchmarks/bench_group_filter.py --benchmark-only -p no:xdist

N responses in N/16 prompt groups (n = 16, verl's interleaved layout), binary accuracy
scores with a per-prompt difficulty, so some groups are all-correct / all-wrong.

Peers:
* ``verl dapo filter loop``: the dynamic-sampling filter of verl's recipe/dapo trainer,
  re-implemented here from its documented behaviour (the recipe is not in the 0.9.1
  wheel): uuid-string uids, a dict of per-uid metric lists, ``np.std`` per group, and a
  list membership test per response.
* ``verl grpo_outcome_advantage`` / ``verl grpo_vectorized``: verl 0.9.1's
  ``compute_grpo_outcome_advantage`` (Python loop) and its vectorised variant, called
  with ``token_level_rewards`` of shape [N, 1] and uuid-string ``index`` as the trainer does.

``dk.group_filter`` computes both the keep mask and the advantages in one call.
"""
from __future__ import annotations

import uuid
from collections import defaultdict

import numpy as np
import pytest
import torch

import dapo_kernels as dk

N_PER_PROMPT = 16
SIZES = (8192, 131072)
# Rounds per implementation: the Python loops take seconds at N = 131072.
SLOW_ROUNDS = {8192: 5, 131072: 1}

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl==0.9.1 (requirements-bench-nodeps.txt)")


def make_inputs(N: int):
    g = torch.Generator().manual_seed(N)
    G = N // N_PER_PROMPT
    gi = torch.arange(G).repeat_interleave(N_PER_PROMPT)
    p = torch.rand(G, generator=g)[gi] * 1.4 - 0.2  # a few groups certain to be all wrong / all right
    scores = (torch.rand(N, generator=g) < p).float()
    uids = np.array([str(uuid.UUID(int=int(i) + 1)) for i in range(G)], dtype=object)[gi.numpy()]
    return scores, gi, G, uids


def verl_dapo_filter_loop(metric: np.ndarray, uids: np.ndarray) -> list:
    """Indices of the responses kept by DAPO's dynamic sampling, written as the recipe does."""
    vals_by_uid = defaultdict(list)
    for uid, v in zip(uids, metric):
        vals_by_uid[uid].append(v)
    std_by_uid = {uid: np.std(v) for uid, v in vals_by_uid.items()}
    kept_uids = [uid for uid, s in std_by_uid.items() if s > 0 or len(vals_by_uid[uid]) == 1]
    return [i for i, uid in enumerate(uids) if uid in kept_uids]


IMPLS = ["dk.group_filter index", "dk.group_filter group_size", "dk.group_filter from uid strings",
         "verl dapo filter loop", "verl grpo_outcome_advantage", "verl grpo_vectorized"]


def _runner(impl: str, scores, gi, G, uids):
    rewards = scores[:, None]
    mask = torch.ones_like(rewards)
    if impl == "dk.group_filter index":
        return lambda: dk.group_filter(scores, gi, G)
    if impl == "dk.group_filter group_size":
        return lambda: dk.group_filter(scores, group_size=N_PER_PROMPT)

    if impl == "dk.group_filter from uid strings":
        def from_uids():
            _, inv = np.unique(uids, return_inverse=True)
            return dk.group_filter(scores, torch.from_numpy(inv.astype(np.int64)), G)
        return from_uids
    if impl == "verl dapo filter loop":
        return lambda: verl_dapo_filter_loop(scores.numpy(), uids)
    if impl == "verl grpo_outcome_advantage":
        return lambda: core_algos.compute_grpo_outcome_advantage(rewards, mask, uids)
    return lambda: core_algos.compute_grpo_vectorized_outcome_advantage(rewards, mask, uids)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # The 2 CPU cores are shared: with 2 intra-op threads small ops spend their time
    # waiting for a busy core, for every implementation alike. One thread measures the work.
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("N", SIZES, ids=[f"N{n}" for n in SIZES])
def test_group_filter_cpu(benchmark, N, impl):
    scores, gi, G, uids = make_inputs(N)
    fn = _runner(impl, scores, gi, G, uids)
    benchmark.group = f"group_filter N={N} n={N_PER_PROMPT}"
    with dk.use_backend("torch"):
        if impl.startswith("dk."):
            res = benchmark(fn)
            # same decisions as the peers, so the race is fair
            kept = verl_dapo_filter_loop(scores.numpy(), uids) if N <= 8192 else None
            if kept is not None:
                assert torch.nonzero(res.keep).flatten().tolist() == kept
        else:
            benchmark.pedantic(fn, rounds=SLOW_ROUNDS[N], iterations=1, warmup_rounds=0)
