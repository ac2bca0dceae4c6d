"""The keep-rate estimate behind adaptive dynamic sampling, and the generation sizes drawn from it.

:class:`KeepRateEstimator` (a running Beta posterior of the keep rate per data source) and
:func:`adaptive_gen_batch_size` size each generation batch so that the train batch fills in a target
number of rounds with a chosen probability; :class:`dapo_trainer.adaptive_sampling.SamplingController`
is their one user.
"""
from __future__ import annotations

import math
from statistics import NormalDist
from typing import Dict, Mapping, Tuple

from dapo_kernels.validation import check_float, check_int


class KeepRateEstimator:
    """Running estimate of dynamic sampling's keep rate: a Beta posterior per data source.

    Source ``s`` has ``Beta(a0 + A_s, b0 + B_s)``: ``A_s`` / ``B_s`` are its kept / dropped groups,
    each round's counts weighted ``forgetting ** age`` (a round ``k`` rounds old counts
    ``forgetting ** k``), so the estimate follows a keep rate that drifts as the policy trains;
    ``a0 = prior_keep * prior_strength``, ``b0 = (1 - prior_keep) * prior_strength`` keep it a
    proper distribution when a source keeps nothing. Sources mix in proportion to their groups
    seen (forgotten alike): the share a generation batch of random prompts draws from each.

    Args:
        forgetting: weight of the previous round's evidence, in (0, 1] (1: never forget).
        prior_keep: prior mean keep rate, in (0, 1).
        prior_strength: prior pseudo-groups, > 0.
    """

    def __init__(self, forgetting: float = 0.5, prior_keep: float = 0.5, prior_strength: float = 1.0):
        self.forgetting = _check_prob("forgetting", forgetting, open_hi=False)
        self.prior_keep = _check_prob("prior_keep", prior_keep)
        self.prior_strength = check_float("prior_strength", prior_strength, valid=lambda v: 0 < v < math.inf,
                                          expected="> 0 and finite")
        self._kept: Dict[str, float] = {}
        self._dropped: Dict[str, float] = {}
        self.rounds = 0

    @property
    def ready(self) -> bool:
        """True once a round with at least one group seen was observed."""
        return bool(self._kept)

    def update(self, counts: Mapping[str, Tuple[int, int]]) -> None:
        """Observe one generation round: ``{source: (kept groups, seen groups)}``.

        Every source's earlier evidence is first multiplied by ``forgetting``.
        """
        if not isinstance(counts, Mapping):
            raise TypeError(f"counts must be a mapping of source -> (kept, seen), got {type(counts).__name__}")
        checked = {}
        for src, pair in counts.items():
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise TypeError(f"counts[{src!r}] must be a (kept, seen) pair, got {pair!r}")
            kept = check_int(f"counts[{src!r}] kept", pair[0], minimum=0)
            seen = check_int(f"counts[{src!r}] seen", pair[1], minimum=0)
            if kept > seen:
                raise ValueError(f"counts[{src!r}]: kept ({kept}) must be <= seen ({seen})")
            checked[str(src)] = (kept, seen)
        f = self.forgetting
        for src in self._kept:
            self._kept[src] *= f
            self._dropped[src] *= f
        for src, (kept, seen) in checked.items():
            if seen:
                self._kept[src] = self._kept.get(src, 0.0) + kept
                self._dropped[src] = self._dropped.get(src, 0.0) + seen - kept
        self.rounds += 1

    def _posterior(self, src: str) -> Tuple[float, float]:
        s = self.prior_strength
        return self.prior_keep * s + self._kept[src], (1 - self.prior_keep) * s + self._dropped[src]

    def _weights(self) -> Dict[str, float]:
        seen = {src: self._kept[src] + self._dropped[src] for src in self._kept}
        total = sum(seen.values())
        if total <= 0:  # every count forgotten to nothing (forgetting ** rounds underflowed): equal shares
            return {src: 1 / len(seen) for src in seen}
        return {src: v / total for src, v in seen.items()}

    def source_rates(self) -> Dict[str, float]:
        """Posterior mean keep rate of each observed source."""
        return {src: a / (a + b) for src, (a, b) in ((s, self._posterior(s)) for s in self._kept)}

    def keep_rate(self) -> float:
        """Posterior mean keep rate of a random prompt (sources mixed by their share); the prior's before any round."""
        if not self.ready:
            return self.prior_keep
        rates = self.source_rates()
        return sum(w * rates[src] for src, w in self._weights().items())

    def kept_moments(self, prompts: float) -> Tuple[float, float]:
        """Mean and variance of the groups kept out of ``prompts`` random prompts (posterior predictive:
        per source a beta-binomial over its share of the prompts)."""
        if not self.ready:
            p = self.prior_keep
            return prompts * p, prompts * p * (1 - p) * (self.prior_strength + prompts) / (self.prior_strength + 1)
        mean = var = 0.0
        for src, w in self._weights().items():
            a, b = self._posterior(src)
            m, p = prompts * w, a / (a + b)
            mean += m * p
            var += m * p * (1 - p) * (a + b + m) / (a + b + 1)
        return mean, var

    def prompts_needed(self, need: int, quantile: float = 0.9, limit: int = 1 << 40) -> int:
        """The fewest prompts whose kept groups reach ``need`` with probability about ``quantile``
        (normal approximation of the predictive distribution); ``limit`` when even that many fall short."""
        need = check_int("need", need)
        z = NormalDist().inv_cdf(_check_prob("quantile", quantile))
        limit = check_int("limit", limit, minimum=1)
        if need <= 0:
            return 0

        def enough(m: int) -> bool:
            mean, var = self.kept_moments(m)
            return mean - z * math.sqrt(var) >= need

        hi = need
        while not enough(hi):
            if hi >= limit:
                return limit
            hi = min(2 * hi, limit)
        lo = hi // 2 if hi > need else need - 1  # enough(lo) is False, enough(hi) True
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if enough(mid) else (mid, hi)
        return hi

    def state_dict(self) -> Dict[str, object]:
        return {"kept": dict(self._kept), "dropped": dict(self._dropped), "rounds": self.rounds}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        missing = {"kept", "dropped", "rounds"} - set(state)
        if missing:
            raise ValueError(f"keep-rate estimator state is missing {sorted(missing)}")
        self._kept = {str(k): float(v) for k, v in dict(state["kept"]).items()}
        self._dropped = {str(k): float(v) for k, v in dict(state["dropped"]).items()}
        if set(self._kept) != set(self._dropped):
            raise ValueError("keep-rate estimator state: 'kept' and 'dropped' name different sources")
        self.rounds = int(state["rounds"])


def _check_prob(name: str, value, *, open_hi: bool = True) -> float:
    return check_float(name, value, valid=(lambda v: 0 < v < 1) if open_hi else (lambda v: 0 < v <= 1),
                       expected="in (0, 1)" if open_hi else "in (0, 1]")


def round_to_multiple(value: int, multiple: int, *, floor: int, ceiling: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``, then clamped to the multiples within
    ``[floor, ceiling]`` (the floor rounded up, the ceiling down). ValueError when none lies there."""
    multiple = check_int("multiple", multiple, minimum=1)
    lo = -(-check_int("floor", floor, minimum=1) // multiple) * multiple
    hi = check_int("ceiling", ceiling, minimum=1) // multiple * multiple
    if hi < lo:
        raise ValueError(f"no multiple of {multiple} lies in [floor={floor}, ceiling={ceiling}]")
    up = -(-check_int("value", value) // multiple) * multiple
    return min(max(up, lo), hi)


def adaptive_gen_batch_size(estimator: KeepRateEstimator, need: int, *, rounds: int = 1, quantile: float = 0.9,
                            multiple: int = 1, floor: int = 1, ceiling: int) -> int:
    """Prompts for the next generation batch so that ``rounds`` such batches keep ``need`` more groups
    with probability about ``quantile`` (:meth:`KeepRateEstimator.prompts_needed`, split evenly over
    the rounds); rounded up to a multiple of ``multiple`` (e.g. the data-parallel size) and kept
    within ``[floor, ceiling]`` (:func:`round_to_multiple`)."""
    if not isinstance(estimator, KeepRateEstimator):
        raise TypeError(f"estimator must be a KeepRateEstimator, got {type(estimator).__name__}")
    rounds = check_int("rounds", rounds, minimum=1)
    ceiling = check_int("ceiling", ceiling, minimum=1)
    total = estimator.prompts_needed(max(need, 0), quantile, limit=ceiling * rounds)
    return round_to_multiple(-(-total // rounds), multiple, floor=floor, ceiling=ceiling)
