"""Adaptive dynamic sampling: generation sizes from the measured keep rate, threshold schedules, warnings.

:class:`SamplingController` is what :class:`~dapo_trainer.generation.GenerationStage` asks, round by
round, how many prompts to generate (``algorithm.filter_groups.adaptive``; otherwise always
``data.gen_batch_size``), and tells what each round kept. It keeps:

* a :class:`dapo_trainer.keep_rate.KeepRateEstimator` (per ``data_source``, forgetting
  ``adaptive_forgetting`` per round), updated in both modes, so the estimate is logged either way;
* the size for the still-needed groups (train batch minus the groups buffered, carried-over ones
  included) over ``target_rounds - k`` rounds at the ``adaptive_quantile`` of the predictive
  distribution, rounded up to a multiple of the data-parallel size and held in
  ``[min_gen_batch_size, ceiling]``; the ceiling is :func:`gen_size_ceiling`, ``max_gen_batch_size`` and
  the training rows, whichever is least (``min_gen_batch_size`` above it is lowered to it); the first
  round, before any measurement, is ``data.gen_batch_size`` within the ceiling;
* the ``reward_threshold`` schedule (:class:`ThresholdSchedule`);
* the run's counters behind ``sampling/dead_loop_rate`` (checkpointed).
"""
from __future__ import annotations

import logging
import math
import os
from collections import Counter
from typing import Dict, Optional, Sequence

import torch

from .keep_rate import KeepRateEstimator, adaptive_gen_batch_size, round_to_multiple

from .config.choices import ThresholdSchedule as ScheduleKind
from .config.choices import choices
from .hf_io import read_hf_config
from .memory_model import DTYPE_BYTES, kv_bytes_per_token, rollout_memory

logger = logging.getLogger(__name__)
# Below this estimated keep rate a step warns even when max_num_gen_batches is unlimited.
LOW_KEEP_RATE = 0.05


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of ``device`` (an accelerator's own; the host's physical memory for the CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "npu":
        return int(torch.npu.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def gen_size_ceiling(model_cfg, *, memory_bytes: float, fraction: float, n: int, seq_len: int, dtype_bytes: int,
                     tp: int = 1, dp: int = 1) -> int:
    """The most prompts a generation batch may hold: each replica samples its ``1 / dp`` share at once,
    holding the KV cache of ``n`` sequences of ``seq_len`` tokens per prompt
    (:func:`dapo_trainer.memory_model.rollout_memory`) next to the rollout weights, within
    ``fraction`` (``rollout.gpu_memory_utilization``) of the device's memory. At least ``dp``."""
    weights = rollout_memory(model_cfg, 0, seq_len, dtype_bytes=dtype_bytes, tp=tp)["weights"]
    per_prompt = n * seq_len * kv_bytes_per_token(model_cfg, dtype_bytes, tp)
    per_replica = int(max(memory_bytes * fraction - weights, 0) // per_prompt)
    return max(per_replica, 1) * dp


def memory_ceiling(cfg, dims) -> int:
    """:func:`gen_size_ceiling` of the run: its model's ``config.json``, the device of ``dims``, the
    rollout's TP (vLLM's own, else the actor's) and ``rollout.gpu_memory_utilization``."""
    arr, d = cfg.actor_rollout_ref, cfg.data
    tp = arr.rollout.tensor_model_parallel_size if arr.rollout.name == "vllm" else dims.tp
    return gen_size_ceiling(read_hf_config(arr.model.path), memory_bytes=device_memory_bytes(dims.comm_device),
                            fraction=arr.rollout.gpu_memory_utilization, n=arr.rollout.n,
                            seq_len=d.max_prompt_length + d.max_response_length,
                            dtype_bytes=DTYPE_BYTES[arr.model.dtype], tp=tp, dp=dims.dp)


def round_counts(sources: Sequence[str], keep: torch.Tensor) -> Dict[str, tuple]:
    """``{source: (kept groups, seen groups)}`` of a generation batch: ``sources[g]`` of group ``g``,
    ``keep`` per response, whole groups in order."""
    kept_groups = keep.view(len(sources), -1)[:, 0].tolist() if len(sources) else []
    seen, kept = Counter(sources), Counter()
    for src, k in zip(sources, kept_groups):
        kept[src] += bool(k)
    return {src: (kept[src], seen[src]) for src in seen}


def short_batch_groups(have: int, mini_batch: int) -> int:
    """Groups of a short batch: the ``have`` buffered ones, down to whole mini-batches when there is one."""
    return have if have < mini_batch else have - have % mini_batch


class ThresholdSchedule:
    """``algorithm.filter_groups.reward_threshold`` per step (``reward_threshold_schedule``).

    * ``constant``: ``start`` (None: the metric is not binarised);
    * ``linear``: ``start`` at step 1 to ``end`` at step ``total_steps``;
    * ``target_keep_rate``: ``start``, then after every step the threshold within ``[start, end]``
      (either order) whose keep rate on that step's generated groups is closest to ``target``
      (ties: the one nearest the current threshold). A group is kept at threshold ``t`` when
      ``min(metric) < t <= max(metric)``: some of its responses pass and some do not.
    """

    KINDS = choices(ScheduleKind)

    def __init__(self, kind: str = "constant", start: Optional[float] = None, end: Optional[float] = None, *,
                 total_steps: int = 1, target: float = 0.5):
        if kind not in self.KINDS:
            raise ValueError(f"kind must be one of {self.KINDS}, got {kind!r}")
        if kind != "constant" and (start is None or end is None):
            raise ValueError(f"a {kind!r} threshold schedule needs start and end, got {start!r}, {end!r}")
        self.kind, self.start, self.end, self.target = kind, start, end, float(target)
        self.total_steps = max(int(total_steps), 1)
        self.current = start

    def value(self, step: int) -> Optional[float]:
        """The threshold of ``step`` (1-based)."""
        if self.kind == "linear":
            frac = min(max((step - 1) / max(self.total_steps - 1, 1), 0.0), 1.0)
            return self.start + (self.end - self.start) * frac
        return self.current

    def observe(self, metric: torch.Tensor, n: int) -> None:
        """Take a step's raw (not binarised) filter metric of every generated response, ``n`` per group, in groups."""
        if self.kind != "target_keep_rate" or metric.numel() == 0:
            return
        g = metric.double().reshape(-1, n)
        lo, hi = g.min(1).values, g.max(1).values
        a, b = sorted((self.start, self.end))
        cands = torch.cat([torch.unique(g[(g >= a) & (g <= b)]), torch.tensor([a, b], dtype=torch.float64)])
        keep = ((lo[None, :] < cands[:, None]) & (hi[None, :] >= cands[:, None])).double().mean(1)
        score = (keep - self.target).abs() * 1e6 + (cands - self.current).abs()  # keep rate first, then nearness
        self.current = float(cands[int(torch.argmin(score))])

    def state_dict(self) -> dict:
        return {"current": self.current}

    def load_state_dict(self, state: dict) -> None:
        self.current = state.get("current", self.current)


def exhaustion_warning(*, step: int, rounds: int, max_rounds: int, need: int, size: int, keep_rate: float,
                       seen: int, all_correct: int, all_wrong: int, on_exhausted: str,
                       cause: Optional[str] = None) -> Optional[str]:
    """A warning when the keep rate points at ``max_num_gen_batches`` being hit (or falls below
    :data:`LOW_KEEP_RATE`), naming the share of all-correct / all-wrong groups; None otherwise.
    ``rounds``: generation batches so far this step; ``need``: groups still missing; ``cause``: why
    the groups are dropped where it is known (default: the policy, from the larger share)."""
    left = max_rounds - rounds if max_rounds > 0 else math.inf
    expected = keep_rate * size * left
    if need <= 0 or (expected >= need and keep_rate >= LOW_KEEP_RATE):
        return None
    def frac(count: int) -> float:
        return count / seen if seen else 0.0

    if cause is None:
        cause = "the policy solves most prompts" if all_correct > all_wrong else "the policy fails most prompts"
    limit = (f"at this rate the {left} generation batches left before max_num_gen_batches={max_rounds} keep "
             f"~{expected:.1f} of the {need} groups still needed" if max_rounds > 0 else
             f"max_num_gen_batches is unlimited: the step may take ~{need / max(keep_rate * size, 1e-9):.0f} more "
             "generation batches")
    if max_rounds <= 0:
        then = ("the step goes on until the batch fills, and stops (DynamicSamplingExhausted) once a whole pass "
                "over the training rows keeps no group")
    elif on_exhausted == "short_batch":
        then = "the step then trains on a short batch (on_exhausted=short_batch)"
    else:
        then = ("the run then stops (on_exhausted=error; set algorithm.filter_groups.on_exhausted=short_batch to "
                "train on a short batch instead)")
    return (f"step {step}: dynamic sampling keep rate {keep_rate:.1%} ({rounds} generation batches so far); {limit}. "
            f"Of the {seen} groups seen this step {frac(all_correct):.0%} were all-correct and {frac(all_wrong):.0%} "
            f"all-wrong ({cause}); {then}. Consider data closer to the model's level, a reward_threshold schedule, "
            f"or algorithm.filter_groups.adaptive")


class SamplingController:
    """Round sizes, keep-rate estimate, threshold schedule and run counters of dynamic sampling."""

    def __init__(self, cfg, *, dp: int, ceiling: int):
        fg, d = cfg.algorithm.filter_groups, cfg.data
        self.fg, self.train_batch_size, self.dp = fg, d.train_batch_size, dp
        self.gen_batch_size = cfg.gen_batch_size
        self.estimator = KeepRateEstimator(forgetting=fg.adaptive_forgetting)
        # ceiling: memory / max_gen_batch_size / the rows (the caller's), on the DP grid and >= dp; the floor
        # (min_gen_batch_size) never lifts a size above it.
        self.ceiling = max(min(ceiling, fg.max_gen_batch_size or ceiling) // dp * dp, dp)
        self.floor = min(fg.min_gen_batch_size or dp, self.ceiling)
        self.threshold = ThresholdSchedule(fg.reward_threshold_schedule, fg.reward_threshold, fg.reward_threshold_end,
                                           total_steps=cfg.trainer.total_training_steps, target=fg.target_keep_rate)
        self.steps = self.dead_steps = 0

    def gen_size(self, buffered: int, k: int) -> int:
        """Prompts of round ``k`` (0-based) of a step with ``buffered`` kept groups so far."""
        if not self.fg.adaptive:
            return self.gen_batch_size
        if not self.estimator.ready:  # no measurement yet: the configured size, on the DP grid, within the ceiling
            return round_to_multiple(self.gen_batch_size, self.dp, floor=self.dp, ceiling=self.ceiling)
        return adaptive_gen_batch_size(self.estimator, self.train_batch_size - buffered,
                                       rounds=max(self.fg.target_rounds - k, 1), quantile=self.fg.adaptive_quantile,
                                       multiple=self.dp, floor=self.floor, ceiling=self.ceiling)

    def observe_round(self, counts: Dict[str, tuple]) -> None:
        self.estimator.update(counts)

    def threshold_note(self, step: int, raw_metrics: Sequence[torch.Tensor]) -> Optional[str]:
        """Why every group is all-wrong when the step's reward_threshold lies above every filter metric
        of ``raw_metrics`` (this step's rounds, before binarising): the threshold, not the policy.
        None without a threshold or when some metric reaches it."""
        threshold = self.threshold.value(step)
        if threshold is None or not raw_metrics or not sum(m.numel() for m in raw_metrics):
            return None
        best = float(torch.cat([m.reshape(-1) for m in raw_metrics]).max())
        if best >= threshold:
            return None
        return (f"no response reached algorithm.filter_groups.reward_threshold={threshold:g} (the highest filter "
                f"metric this step is {best:g}), so every group binarises to all-wrong: the threshold drops them, "
                f"not the policy; lower reward_threshold")

    def warn_if_exhausting(self, acc, step: int, k: int, size: int, max_rounds: int, *, log: bool,
                           cause: Optional[str] = None) -> bool:
        """Log :func:`exhaustion_warning` for the accumulator ``acc`` after ``k`` rounds (the last of
        ``size`` prompts) when ``log``; True when the keep rate called for it. ``cause``: as there."""
        m = acc.metrics()
        msg = exhaustion_warning(step=step, rounds=k, max_rounds=max_rounds,
                                 need=acc.train_batch_size - acc.num_buffered_groups,
                                 size=self.gen_size(acc.num_buffered_groups, k) if self.fg.adaptive else size,
                                 keep_rate=self.estimator.keep_rate(), seen=m["dynamic_sampling/groups_seen"],
                                 all_correct=m["dynamic_sampling/groups_all_correct"],
                                 all_wrong=m["dynamic_sampling/groups_all_wrong"], on_exhausted=self.fg.on_exhausted,
                                 cause=cause)
        if msg and log:
            logger.warning(msg)
        return msg is not None

    def step_metrics(self, *, rounds: int, prompts: int, responses: int, kept: int, discarded: int, n: int,
                     buffered: int, threshold: Optional[float]) -> Dict[str, float]:
        """The step's sampling metrics; counts the step for the dead-loop rate."""
        self.steps += 1
        self.dead_steps += rounds > self.fg.dead_loop_rounds
        out = {"sampling/keep_rate_estimate": self.estimator.keep_rate(),
               "sampling/gen_prompts": float(prompts),
               # The size the next step's first round will have, after this step's carry-over (0: none needed).
               "sampling/next_gen_batch_size": float(self.gen_size(buffered, 0) if buffered < self.train_batch_size
                                                     else 0),
               "sampling/samples_per_kept_group": responses / kept if kept else 0.0,
               # Kept groups neither trained on nor carried over (carry_over=false's surplus).
               "sampling/wasted_samples": float(discarded * n),
               "sampling/dead_loop_rate": self.dead_steps / self.steps}
        rates = self.estimator.source_rates()
        if len(rates) > 1:
            out.update({f"sampling/keep_rate_estimate/{src}": r for src, r in rates.items()})
        if threshold is not None:
            out["sampling/reward_threshold"] = float(threshold)
        return out

    def state_dict(self) -> dict:
        return {"estimator": self.estimator.state_dict(), "threshold": self.threshold.state_dict(),
                "steps": self.steps, "dead_steps": self.dead_steps}

    def load_state_dict(self, state: dict) -> None:
        self.estimator.load_state_dict(state["estimator"])
        self.threshold.load_state_dict(state["threshold"])
        self.steps, self.dead_steps = int(state["steps"]), int(state["dead_steps"])


def gen_time_share(metrics: Dict[str, float]) -> float:
    """Share of the step's time in generation, rewards and filtering (the rest: update, weight sync)."""
    gen = sum(metrics.get(k, 0.0) for k in ("timing_s/gen", "timing_s/reward", "timing_s/filter"))
    return gen / max(metrics.get("timing_s/step", 0.0), 1e-9)
