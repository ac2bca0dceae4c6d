"""Sequence-length balancing vs verl 0.9.1 (CPU, host-side).

`pytest benchmarks/bench_balancing.py --benchmark-only -p no:xdist`

* balanced partitions: n = 8,192 log-normal lengths (64..20,480), k = 8 and 64, with
  equal_size False / True; ours from an ndarray, a list and a tensor; verl's
  `get_seqlen_balanced_partitions` from a list and from a tensor.
* micro-batches: 1,024 sequences, cap 24,576 tokens; ours balancing tokens and balancing
  verl's attention workload (h = 4096); verl's `rearrange_micro_batches` on a TensorDict
  with a bool attention mask and a 1-wide input_ids (so its time is its index logic plus
  one small index_select, not a copy of padded activations).

* micro-batch scaling: ours alone at n = 1e4, 1e5, 1e6, uniform lengths
  1..20,000 under a 20,000-token cap (about two sequences a micro-batch, the adversarial
  case for the count search) and log-normal lengths under caps 24,576 and
  65,536. Near-linear growth is the point; the 1e6 rows run once.

Quality goes into each row's extra_info (spread = max - min partition sum; count, max
tokens, lower bound ceil(sum / cap)); `--benchmark-json out.json` keeps it. verl runs fewer
rounds (VERL_ROUNDS): one call takes up to a minute. Without verl (requirements-bench*.txt)
its rows are skipped, the others still run.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import dapo_kernels as dk

try:
    import tensordict
    import verl.utils.seqlen_balancing as verl_sb
except ImportError:
    tensordict = verl_sb = None
needs_verl = pytest.mark.skipif(verl_sb is None, reason="verl==0.9.1 + tensordict (requirements-bench*.txt)")

N_PART, N_MB, CAP, HIDDEN = 8192, 1024, 24_576, 4096
# verl takes 0.1 s to a minute per call here: a few rounds from a list, one from a
# tensor (every element is a 0-d tensor in its Python loops) and for micro-batches.
VERL_ROUNDS = {"list": 3, "tensor": 1, "batch": 1}


def rl_lengths(n: int, seed: int) -> np.ndarray:
    """Response lengths of an RL batch: log-normal around 1.5k tokens, clipped to 64..20,480."""
    rng = np.random.default_rng(seed)
    return np.clip(np.exp(rng.normal(np.log(1500), 1.0, n)), 64, 20_480).astype(np.int64)


def as_input(lengths: np.ndarray, kind: str):
    return {"ndarray": lengths, "list": lengths.tolist(), "tensor": torch.from_numpy(lengths)}[kind]


def group_sums(values: np.ndarray, groups) -> np.ndarray:
    """Sum of values per (non-empty) group, vectorised: 1e6 sequences in 5e5 groups."""
    return np.add.reduceat(np.asarray(values)[np.concatenate(groups)], np.cumsum([0] + [len(g) for g in groups[:-1]]))


def run(benchmark, fn, rounds=None):
    if rounds:
        return benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=0)
    return benchmark(fn)


# --------------------------------------------------------------------------- partitions
PEERS = [("dapo", "ndarray"), ("dapo", "list"), ("dapo", "tensor"), ("verl", "list"), ("verl", "tensor")]
PEER_PARAMS = [pytest.param(a, b, id=f"{a}-{b}", marks=[needs_verl] if a == "verl" else []) for a, b in PEERS]


@pytest.mark.parametrize("equal_size", [False, True], ids=["free", "equal"])
@pytest.mark.parametrize("k", [8, 64], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("impl,kind", PEER_PARAMS)
def test_balanced_partitions(benchmark, impl, kind, k, equal_size):
    lengths = rl_lengths(N_PART, seed=0)
    data = as_input(lengths, kind)
    benchmark.group = f"partitions n={N_PART} k={k} {'equal' if equal_size else 'free'}"
    if impl == "dapo":
        fn = lambda: dk.balanced_partitions(data, k, equal_size)  # noqa: E731
    else:
        fn = lambda: verl_sb.get_seqlen_balanced_partitions(data, k, equal_size)  # noqa: E731
    parts = run(benchmark, fn, VERL_ROUNDS[kind] if impl == "verl" else None)
    sums = group_sums(lengths, parts)
    assert sorted(i for p in parts for i in p) == list(range(N_PART))
    benchmark.extra_info.update(spread=int(sums.max() - sums.min()), max_sum=int(sums.max()))


# --------------------------------------------------------------------------- micro-batches
def verl_batch(lengths: np.ndarray):
    mask = torch.arange(int(lengths.max()))[None, :] < torch.from_numpy(lengths)[:, None]
    ids = torch.zeros(len(lengths), 1, dtype=torch.long)
    return tensordict.TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[len(lengths)])


MB_IMPLS = ["dapo-tokens", "dapo-attention", pytest.param("verl", marks=needs_verl)]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("impl", MB_IMPLS)
def test_micro_batches(benchmark, impl, seed):
    lengths = rl_lengths(N_MB, seed=seed)
    attention = dk.attention_workload(lengths, HIDDEN)  # == verl's calculate_workload
    benchmark.group = f"micro_batches n={N_MB} cap={CAP} seed={seed}"
    if impl == "verl":
        batch = verl_batch(lengths)
        fn = lambda: verl_sb.rearrange_micro_batches(batch, CAP)[1]  # noqa: E731
    elif impl == "dapo-attention":
        fn = lambda: dk.micro_batches(lengths, CAP, workloads=attention)  # noqa: E731
    else:
        fn = lambda: dk.micro_batches(lengths, CAP)  # noqa: E731
    mbs = run(benchmark, fn, VERL_ROUNDS["batch"] if impl == "verl" else None)
    work = group_sums(attention, mbs)
    record_micro_batches(benchmark, lengths, mbs, CAP, attention_spread=int(work.max() - work.min()))


def record_micro_batches(benchmark, lengths: np.ndarray, mbs, cap: int, **extra):
    """Check the cap, put count / lower bound / max tokens / token spread into extra_info."""
    tokens = group_sums(lengths, mbs)
    assert tokens.max() <= cap
    benchmark.extra_info.update(
        count=len(mbs),
        lower_bound=-(-int(lengths.sum()) // cap),
        max_tokens=int(tokens.max()),
        token_spread=int(tokens.max() - tokens.min()),
        **extra,
    )


# --------------------------------------------------------------------------- micro-batch scaling
SCALING = [(n, dist, cap) for dist, cap in [("uniform", 20_000), ("lognormal", CAP), ("lognormal", 65_536)]
           for n in (10_000, 100_000, 1_000_000)]


@pytest.mark.parametrize("n,dist,cap", SCALING, ids=[f"{d}-cap{c}-n{n}" for n, d, c in SCALING])
def test_micro_batches_scaling(benchmark, n, dist, cap):
    lengths = np.random.default_rng(0).integers(1, 20_001, n) if dist == "uniform" else rl_lengths(n, seed=0)
    benchmark.group = f"micro_batches scaling {dist} cap={cap}"
    mbs = run(benchmark, lambda: dk.micro_batches(lengths, cap), rounds=1 if n >= 1_000_000 else 3)
    assert np.array_equal(np.sort(np.concatenate(mbs)), np.arange(n))
    record_micro_batches(benchmark, lengths, mbs, cap)
