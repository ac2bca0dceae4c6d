"""DAPO dynamic sampling loop: accumulate kept prompt groups until a train batch is full.

Typical use in a trainer (``res`` from :func:`dapo_kernels.group_filter`)::

    acc = dk.DynamicBatchAccumulator(train_batch_size, n_per_prompt, max_num_gen_batches)
    while not acc.ready:
        batch, scores, group_index = generate_and_score()
        res = dk.group_filter(scores, group_index, num_groups)
        acc.add(batch, group_index, res.keep, scores=scores)
    train_batch = acc.take()          # exactly train_batch_size whole groups
    log(acc.last_metrics)
"""
from __future__ import annotations

import numbers
from typing import Dict, List, Mapping, Optional

import torch

from ._validation import FLOAT_DTYPES, INT_DTYPES, check_flag, check_int, check_mask, check_tensor

GROUP_INDEX_KEY = "group_index"
_PREFIX = "dynamic_sampling/"
# Which buffered groups fill a train batch first (DynamicBatchAccumulator.take).
PREFER_MODES = ("first", "longest", "random")


class DynamicSamplingExhausted(RuntimeError):
    """More generation batches than ``max_num_gen_batches`` were needed to fill a train batch."""


def _boundaries(sorted_ids: torch.Tensor) -> torch.Tensor:
    """True where a run of equal ids starts in a sorted 1-D tensor."""
    start = torch.ones_like(sorted_ids, dtype=torch.bool)
    start[1:] = sorted_ids[1:] != sorted_ids[:-1]
    return start


def _uniform_group_counts(group_index, keep, scores):
    """(all-correct, all-wrong) counts among dropped multi-member groups with one common score.

    "Correct" means the common score is > 0 (accuracy 1 or reward +1), "wrong" <= 0.
    """
    order = torch.argsort(group_index, stable=True)
    gid = group_index[order]
    seg = torch.cumsum(_boundaries(gid), 0) - 1
    n = gid.numel()
    s = scores[order].double()
    lo = torch.full((n,), float("inf"), dtype=torch.float64, device=s.device).scatter_reduce_(0, seg, s, "amin")
    hi = torch.full((n,), -float("inf"), dtype=torch.float64, device=s.device).scatter_reduce_(0, seg, s, "amax")
    size = torch.bincount(seg, minlength=n)
    kept = torch.zeros(n, dtype=torch.bool, device=s.device).scatter_reduce_(0, seg, keep[order], "amax")
    uniform = (size > 1) & (lo == hi) & ~kept
    return (uniform & (hi > 0)).sum(), (uniform & (hi <= 0)).sum()


def _check_accumulator_state(state) -> None:
    """A :meth:`DynamicBatchAccumulator.state_dict` in shape: a ``TypeError`` / ``ValueError`` naming the
    entry otherwise (not Python's own message from deep inside ``dict()`` or ``int()``)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"accumulator state must be a mapping (a state_dict()), got {type(state).__name__}")
    missing = {"chunks", "keys", "num_buffered_groups", "carried_in"} - set(state)
    if missing:
        raise ValueError(f"accumulator state is missing {sorted(missing)}")
    chunks, keys = state["chunks"], state["keys"]
    if not isinstance(chunks, (list, tuple)) or not all(
            isinstance(c, Mapping) and all(isinstance(v, torch.Tensor) for v in c.values()) for c in chunks):
        raise TypeError(f"accumulator state['chunks'] must be a list of dicts of tensors, got {chunks!r:.80}")
    if keys is not None and (not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys)):
        raise TypeError(f"accumulator state['keys'] must be None or a list of str, got {keys!r:.80}")
    for name in ("num_buffered_groups", "carried_in"):
        value = state[name]
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"accumulator state[{name!r}] must be an int >= 0, got {value!r:.80}")


class DynamicBatchAccumulator:
    """Collects whole kept prompt groups over generation batches, on the device.

    Args:
        train_batch_size: prompt groups per train batch.
        n_per_prompt: responses per group (``rollout.n``); every kept group must have
            exactly this many rows.
        max_num_gen_batches: generation batches allowed per train batch; ``<= 0`` means
            unlimited. Needing more raises :class:`DynamicSamplingExhausted`.
        carry_over: surplus kept groups beyond the train batch are carried over to the
            next step (default True). ``False`` throws them away, as verl does.

    ``add`` makes one host sync (the number of kept rows sizes the gather); ``take``
    makes none. Rows of a group are made contiguous, groups in ascending
    ``group_index`` order per generation batch, batches in arrival order.
    """

    def __init__(self, train_batch_size: int, n_per_prompt: int, max_num_gen_batches: int = 0, *,
                 carry_over: bool = True):
        self.train_batch_size = check_int("train_batch_size", train_batch_size, minimum=1)
        self.n_per_prompt = check_int("n_per_prompt", n_per_prompt, minimum=1)
        self.max_num_gen_batches = check_int("max_num_gen_batches", max_num_gen_batches)
        self.carry_over = check_flag("carry_over", carry_over)
        self._chunks: List[Dict[str, torch.Tensor]] = []
        self._keys: Optional[tuple] = None
        self.num_buffered_groups = 0
        self.last_metrics: Dict[str, float] = {}
        self._reset_step(carried_in=0)

    def _reset_step(self, carried_in: int) -> None:
        self._kept_per_batch: List[int] = []
        self._seen = 0
        self._all_correct = 0
        self._all_wrong = 0
        self._carried_in = carried_in

    def state_dict(self) -> Dict[str, object]:
        """Buffered (carried-over) groups and counters, for checkpoints (tensors stay on device)."""
        return {"chunks": [dict(c) for c in self._chunks], "keys": self._keys,
                "num_buffered_groups": self.num_buffered_groups, "carried_in": self._carried_in,
                "n_per_prompt": self.n_per_prompt}

    @staticmethod
    def state_n_per_prompt(state: Dict[str, object]) -> Optional[int]:
        """Rows per buffered group in a :meth:`state_dict` (None when it buffers none); states saved
        without ``n_per_prompt`` give their rows over their groups."""
        try:
            groups = int(state.get("num_buffered_groups") or 0)
        except (TypeError, ValueError):  # load_state_dict names what is wrong with the state
            return None
        if groups <= 0:
            return None
        if state.get("n_per_prompt") is not None:
            return int(state["n_per_prompt"])
        rows = sum(next(iter(c.values())).shape[0] for c in state["chunks"] if c)
        return rows // groups if rows % groups == 0 else rows / groups

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Restore what :meth:`state_dict` saved; the step being accumulated starts afresh.

        Buffered groups of another ``n_per_prompt`` are a ValueError naming both values: a group
        cannot change its number of responses."""
        _check_accumulator_state(state)
        saved_n = self.state_n_per_prompt(state)
        if saved_n not in (None, self.n_per_prompt):
            raise ValueError(f"accumulator state buffers {int(state['num_buffered_groups'])} groups of "
                             f"n_per_prompt={saved_n} rows; this accumulator has n_per_prompt={self.n_per_prompt}: "
                             "load it with the same n_per_prompt (rollout.n), or drop its buffered groups")
        self._chunks = [dict(c) for c in state["chunks"]]
        self._keys = tuple(state["keys"]) if state["keys"] is not None else None
        self.num_buffered_groups = int(state["num_buffered_groups"])
        self._reset_step(carried_in=int(state["carried_in"]))

    @property
    def ready(self) -> bool:
        """True once at least ``train_batch_size`` kept groups are buffered."""
        return self.num_buffered_groups >= self.train_batch_size

    def metrics(self) -> Dict[str, float]:
        """Metrics of the step being accumulated (``last_metrics`` holds the last taken step's)."""
        kept = sum(self._kept_per_batch)
        return {
            _PREFIX + "gen_batches": len(self._kept_per_batch),
            _PREFIX + "groups_seen": self._seen,
            _PREFIX + "groups_kept": kept,
            _PREFIX + "keep_rate": kept / self._seen if self._seen else 0.0,
            _PREFIX + "groups_all_correct": self._all_correct,
            _PREFIX + "groups_all_wrong": self._all_wrong,
            _PREFIX + "groups_carried_in": self._carried_in,
        }

    def _check_batch(self, batch, group_index, keep, scores) -> int:
        if not isinstance(batch, dict) or not batch:
            raise TypeError(f"batch_tensors must be a non-empty dict of tensors, got {type(batch).__name__}")
        if GROUP_INDEX_KEY in batch:
            raise ValueError(f"batch_tensors must not contain {GROUP_INDEX_KEY!r}: take() adds it")
        keep = check_mask("keep", keep, ndim=1)
        N, dev = keep.shape[0], keep.device
        check_tensor("group_index", group_index, dtypes=(torch.int64, torch.int32), device=dev, shape=[N])
        if scores is not None:
            check_tensor("scores", scores, dtypes=FLOAT_DTYPES + INT_DTYPES, device=dev, shape=[N])
        for k, v in batch.items():
            check_tensor(f"batch_tensors[{k!r}]", v, device=dev)
            if v.dim() == 0 or v.shape[0] != N:
                raise ValueError(f"batch_tensors[{k!r}] must have {N} rows (len(keep)), got shape {tuple(v.shape)}")
        if self._keys is not None and tuple(sorted(batch)) != self._keys:
            raise ValueError(f"batch_tensors keys {sorted(batch)} differ from earlier batches' {list(self._keys)}")
        return N, keep

    def add(self, batch_tensors: Dict[str, torch.Tensor], group_index: torch.Tensor, keep: torch.Tensor, *,
            scores: Optional[torch.Tensor] = None) -> None:
        """Append the kept groups of one generation batch.

        Args:
            batch_tensors: ``{name: [N, ...] tensor}``, one row per response.
            group_index: ``[N]`` int64/int32 prompt group of each row, any order.
            keep: ``[N]`` bool (or integer / float 0 / 1), e.g. ``group_filter(...).keep``; whole groups only.
            scores: optional ``[N]`` filter metric, for the all-correct / all-wrong counts.

        Raises ValueError (nothing appended) if a kept group does not have exactly
        ``n_per_prompt`` rows, and :class:`DynamicSamplingExhausted` (after appending) when
        the batch is still not full after ``max_num_gen_batches`` generation batches.
        """
        N, keep = self._check_batch(batch_tensors, group_index, keep, scores)
        gi = group_index.long()
        n = self.n_per_prompt
        # Kept rows first, by group index: a second stable sort on ~keep, not a sentinel index for
        # the dropped rows, which any valid int64 index could equal.
        by_group = torch.argsort(gi, stable=True)
        order = by_group[torch.argsort(~keep[by_group], stable=True)]
        pos = torch.arange(N, device=gi.device)
        start = _boundaries(gi[order]) & keep[order]
        zero = gi.new_zeros(())
        n_rows = keep.sum()
        n_groups = start.sum()
        misplaced = (start & (pos % n != 0)).sum() + (n_rows != n_groups * n).long()
        seen = _boundaries(torch.sort(gi).values).sum() if N else zero
        correct, wrong = _uniform_group_counts(gi, keep, scores) if scores is not None and N else (zero, zero)
        n_rows, n_groups, misplaced, seen, correct, wrong = torch.stack(
            [n_rows, n_groups, misplaced, seen, correct, wrong]).tolist()
        if misplaced:
            raise ValueError(f"every kept group must have exactly n_per_prompt={n} rows; keep selects {n_rows} "
                             f"rows in {n_groups} groups (keep must hold whole groups of {n})")
        rows = order[:n_rows]
        self._chunks.append({k: v.index_select(0, rows) for k, v in batch_tensors.items()})
        self._keys = tuple(sorted(batch_tensors))
        self.num_buffered_groups += n_groups
        self._kept_per_batch.append(n_groups)
        self._seen += seen
        self._all_correct += correct
        self._all_wrong += wrong
        used = len(self._kept_per_batch)
        if not self.ready and 0 < self.max_num_gen_batches <= used:
            raise DynamicSamplingExhausted(self.exhausted_message())

    def exhausted_message(self, max_num_gen_batches: Optional[int] = None) -> str:
        """Why the step's generation batches did not fill a train batch (the exhaustion error's text).

        ``max_num_gen_batches``: the limit to report where the caller stops the batches itself (this
        accumulator then has 0, no limit of its own); default: this accumulator's."""
        have = self.num_buffered_groups
        rate = sum(self._kept_per_batch) / self._seen if self._seen else 0.0
        limit = self.max_num_gen_batches if max_num_gen_batches is None else max_num_gen_batches
        return (
            f"dynamic sampling exhausted: {len(self._kept_per_batch)} generation batches "
            f"(max_num_gen_batches={limit}) kept {self._kept_per_batch} groups per batch, "
            f"keep rate {rate:.1%} of {self._seen} groups seen ({self._carried_in} carried in); "
            f"{have} of the {self.train_batch_size} groups needed. Dropped groups with identical rewards: "
            f"{self._all_correct} all-correct, {self._all_wrong} all-wrong. Raise max_num_gen_batches "
            f"(0 = unlimited), generate more prompts per batch (data.gen_batch_size) or more responses per "
            f"prompt (rollout.n), or train on data closer to the model's level."
        )

    def take(self, prefer: str = "first", key: Optional[str] = None, seed: int = 0, *,
             num_groups: Optional[int] = None) -> Dict[str, torch.Tensor]:
        """Exactly ``train_batch_size`` whole groups: every key of ``batch_tensors`` with
        ``train_batch_size * n_per_prompt`` rows, plus ``'group_index'`` (int64, groups
        numbered ``0..train_batch_size-1``, rows of a group contiguous).

        ``num_groups`` (a short batch): take that many groups instead, ``1 <= num_groups <=``
        the buffered groups, even when not :attr:`ready`.

        ``prefer`` picks the groups when more are buffered than the batch needs: "first"
        (arrival order), "longest" (largest mean of ``batch_tensors[key]`` over the group's
        rows first, ties in arrival order) or "random" (a permutation drawn from ``seed``).
        Surplus groups stay buffered, in arrival order, for the next step (``carry_over=True``)
        or are dropped. Raises RuntimeError when not :attr:`ready`.
        """
        if prefer not in PREFER_MODES:
            raise ValueError(f"prefer must be one of {PREFER_MODES}, got {prefer!r}")
        if prefer == "longest" and key not in (self._keys or ()):
            raise ValueError(f"prefer='longest' needs key naming one of the batch tensors {list(self._keys or ())}, "
                             f"got {key!r}")
        check_int("seed", seed)
        if num_groups is None:
            if not self.ready:
                raise RuntimeError(f"take() needs {self.train_batch_size} kept groups, only "
                                   f"{self.num_buffered_groups} are buffered; add more batches while not acc.ready")
            num_groups = self.train_batch_size
        elif not 1 <= check_int("num_groups", num_groups) <= self.num_buffered_groups:
            raise ValueError(f"num_groups must be in [1, {self.num_buffered_groups}] (the buffered groups), "
                             f"got {num_groups}")
        rows = num_groups * self.n_per_prompt
        merged = {k: torch.cat([c[k] for c in self._chunks]) for k in self._keys}
        if prefer != "first" and self.num_buffered_groups > num_groups:
            merged = self._preferred_first(merged, prefer, key, seed, num_groups)
        out = {k: v[:rows] for k, v in merged.items()}
        dev = next(iter(out.values())).device
        out[GROUP_INDEX_KEY] = torch.arange(num_groups, device=dev).repeat_interleave(self.n_per_prompt)
        surplus = self.num_buffered_groups - num_groups
        carried = surplus if self.carry_over else 0
        self._chunks = [{k: v[rows:] for k, v in merged.items()}] if carried else []
        self.num_buffered_groups = carried
        self.last_metrics = {**self.metrics(), _PREFIX + "groups_carried_over": carried,
                             _PREFIX + "groups_discarded": surplus - carried}
        self._reset_step(carried_in=carried)
        return out

    def _preferred_first(self, merged, prefer: str, key: Optional[str], seed: int, take: int):
        """``merged`` with the preferred ``take`` groups first, then the rest in arrival order."""
        G, n = self.num_buffered_groups, self.n_per_prompt
        dev = next(iter(merged.values())).device
        if prefer == "longest":
            per_group = merged[key].reshape(G, n, -1).double().mean(dim=(1, 2))
            order = torch.argsort(-per_group, stable=True)
        else:
            order = torch.randperm(G, generator=torch.Generator().manual_seed(seed)).to(dev)
        chosen = torch.zeros(G, dtype=torch.bool, device=dev)
        chosen[order[:take]] = True
        # Chosen groups in preference order, then the others by a stable sort on "not chosen".
        rest = torch.argsort(chosen.logical_not().to(torch.int8), stable=True)[take:]
        groups = torch.cat([order[:take], rest])
        idx = (groups[:, None] * n + torch.arange(n, device=dev)).reshape(-1)
        return {k: v.index_select(0, idx) for k, v in merged.items()}
