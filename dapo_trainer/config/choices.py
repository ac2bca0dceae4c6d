"""The config's closed sets of values, each defined once as a ``Literal`` (the schema's field types).

``choices(T)`` is the tuple of a Literal's values, for code that lists or compares them. The loader
checks every ``Literal``-typed key against its values at load; nothing else needs to repeat them.
"""
from __future__ import annotations

import typing
from typing import Literal

from dapo_kernels import KL_TYPES, LOSS_AGG_MODES

from ..rollout.base import ENGINES, RolloutName

# The library's tuples are the single list of its loss modes: the config's type is built from them.
LossAggMode = Literal[LOSS_AGG_MODES]  # type: ignore[valid-type]
KlType = Literal[KL_TYPES]  # type: ignore[valid-type]

Strategy = Literal["ddp", "fsdp2"]  # gradient all-reduce | fully sharded
# float16 is named here so that its refusal explains itself (rules.parameters_not_float16).
ParamDtype = Literal["float32", "bfloat16", "float16"]
Truncation = Literal["error", "left", "right"]
FilterMetric = Literal["acc", "score", "seq_reward", "seq_final_reward"]
KeepPreference = Literal["first", "longest", "random"]
OnExhausted = Literal["error", "short_batch"]  # max_num_gen_batches hit: verl's error | train on fewer groups
ThresholdSchedule = Literal["constant", "linear", "target_keep_rate"]  # filter_groups.reward_threshold per step
AdvEstimator = Literal["grpo"]
# algorithm.rollout_correction (verl 0.9.1): the IS weights' level, and the loss of bypass_mode.
RolloutIsLevel = Literal["token", "sequence"]
RolloutLossType = Literal["ppo_clip", "reinforce"]  # reinforce: verl's, refused here (rules)
# actor.router_replay.mode (verl's): none | replay the old-log-prob forward's routing | the rollout's
RouterReplayMode = Literal["disabled", "R2", "R3"]
Scorer = Literal["relevance", "coherence"]
Embedder = Literal["minilm", "ngram"]
OnError = Literal["raise", "drop"]
ResumeMode = Literal["auto", "disable", "resume_path"]
Device = Literal["auto", "cpu", "cuda", "npu"]
# trainer.logger, verl's names: each but "console" mirrors metrics.jsonl (always written) to a tracker
# (dapo_trainer.loggers: TensorBoard, wandb, mlflow); "console" adds nothing (the bar is trainer.progress_bar).
Logger = Literal["console", "tensorboard", "wandb", "mlflow"]
# Each SP rank aggregates the loss of its token shard: only token-additive modes stay exact.
SP_LOSS_AGG_MODES = ("token-mean", "token-sum")


def choices(literal) -> tuple:
    """The values of a ``Literal`` type, in declaration order."""
    return typing.get_args(literal)


FILTER_METRICS = choices(FilterMetric)
RESUME_MODES = choices(ResumeMode)
STRATEGIES = choices(Strategy)
PARAM_DTYPES = choices(ParamDtype)
DEVICES = choices(Device)
LOGGERS = choices(Logger)

__all__ = ["LossAggMode", "KlType", "Strategy", "ParamDtype", "Truncation", "FilterMetric", "KeepPreference",
           "AdvEstimator", "RolloutIsLevel", "RolloutLossType", "Scorer", "Embedder", "OnError", "ResumeMode", "Device",
           "Logger", "RolloutName", "ENGINES",
           "choices", "SP_LOSS_AGG_MODES", "FILTER_METRICS", "RESUME_MODES", "STRATEGIES", "PARAM_DTYPES", "DEVICES",
           "LOGGERS"]
