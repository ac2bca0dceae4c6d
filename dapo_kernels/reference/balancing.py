"""Reference for dapo_kernels.balancing: Karmarkar-Karp in plain Python.

Written from the textbook largest differencing method with explicit k-group states,
sharing the C++ tie rules so tests can compare partitions item for item:

* items start sorted by (value, index); a state's groups are ordered by
  (sum desc, non-empty first, first item asc);
* the heap pops the largest spread first, then the largest top group, then the oldest
  state (initial states are numbered in creation order, each merge gets the next number);
* merging ``a`` (popped first) with ``b``: group i = a's group i + b's group k-1-i.
"""
from __future__ import annotations

import heapq
from typing import List, Optional, Sequence


def _group_key(group):
    total, items = group
    return (-total, 0 if items else 1, items[0] if items else 0)


def karmarkar_karp_ref(values: Sequence[int], k: int, equal_size: bool = False) -> List[List[int]]:
    """Partitions of ``range(len(values))`` (each ascending, ordered by first index)."""
    values = [int(v) for v in values]
    n = len(values)
    assert 1 <= k <= n and (not equal_size or n % k == 0)
    order = sorted(range(n), key=lambda i: (values[i], i))
    per_state = k if equal_size else 1
    heap, counter = [], 0

    def push(groups):
        nonlocal counter
        groups.sort(key=_group_key)
        spread = groups[0][0] - groups[-1][0]
        heapq.heappush(heap, (-spread, -groups[0][0], counter, groups))
        counter += 1

    for s in range(0, n, per_state):
        chunk = order[s : s + per_state]
        push([(values[i], [i]) for i in chunk] + [(0, []) for _ in range(k - len(chunk))])
    while len(heap) > 1:
        a = heapq.heappop(heap)[3]
        b = heapq.heappop(heap)[3]
        push([(a[i][0] + b[k - 1 - i][0], a[i][1] + b[k - 1 - i][1]) for i in range(k)])
    return sorted(sorted(items) for _, items in heap[0][3])


def micro_batch_count_ref(
    seqlens: Sequence[int],
    max_token_len: int,
    workloads: Optional[Sequence[int]] = None,
    min_num_micro_batches: int = 1,
    multiple_of: int = 1,
) -> int:
    """Micro-batch count of the plain search: from ceil(total / cap) upward in steps of
    ``multiple_of`` until the KK partition of the workloads keeps every token sum under
    the cap (the search verl's ``rearrange_micro_batches`` documents)."""
    seqlens = [int(s) for s in seqlens]
    workloads = seqlens if workloads is None else [int(w) for w in workloads]
    m = max(min_num_micro_batches, -(-sum(seqlens) // max_token_len))
    m = -(-m // multiple_of) * multiple_of
    while True:
        parts = karmarkar_karp_ref(workloads, m)
        if all(sum(seqlens[i] for i in p) <= max_token_len for p in parts):
            return m
        m += multiple_of


def spread_of(values: Sequence[int], parts: Sequence[Sequence[int]]) -> int:
    """max - min of the partition sums."""
    sums = [sum(int(values[i]) for i in p) for p in parts]
    return max(sums) - min(sums)
