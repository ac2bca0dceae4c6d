"""Trainer configuration: dataclasses with verl's key names, YAML files and dotted overrides.

``load_config("dapo_7b.yaml", ["data.train_batch_size=64", "trainer.seed=3"])`` reads the
file, applies the overrides (each value parsed as YAML, so ``true``, ``1e-6`` and
``[a, b]`` mean what they say) and checks every key and type:

* unknown keys are one ``ValueError`` (:class:`ConfigError`) naming each, with the closest valid key
  when one is close;
* a verl key without a field here (:mod:`.verl_keys`) is accepted where its value changes nothing
  here (one warning lists what each means here) and rejected, naming it and why, where it would;
* a value of the wrong type is a ``TypeError`` naming the key;
* inconsistent values (a batch size that does not divide, an unknown mode) are a
  ``ValueError`` naming the key;
* every float must be finite and in its field's declared range, also where the setting that
  uses it is off;
* a key given twice in one file (or one override's mapping) is a ``ValueError`` naming the key
  and its line, not "the last one wins".

Keys follow verl (``actor_rollout_ref.actor.clip_ratio_high``, ...), so a verl DAPO
command line ports by copying its ``key=value`` arguments. Lengths are checked against the model's
context (``max_position_embeddings`` of ``actor_rollout_ref.model.path/config.json``) at load.

Layout: :mod:`.schema` (sections, defaults, ranges), :mod:`.choices` (the ``Literal`` value sets),
:mod:`.fields` (field declarations and their generic check), :mod:`.loader` (YAML, overrides,
coercion), :mod:`.rules` (rules between fields, :func:`validate`), :mod:`.verl_keys` (verl keys with no
field here).
"""
from ..rollout.base import RolloutConfig
from .choices import FILTER_METRICS, RESUME_MODES
from .fields import float_values
from .loader import ALIASES, ConfigError, VerlKeysNoted, all_keys, apply_dict, apply_override, dump_config, load_config
from .rules import model_context_length, validate
from .verl_keys import VERL_KEYS
from .schema import (ActorConfig, ActorRolloutRefConfig, AlgorithmConfig, Config, CustomRewardFunctionConfig,
                     DataConfig, DialogueRewardConfig, DynamicTokenLenConfig, EnvironmentConfig, FilterGroupsConfig,
                     ModelSection, OptimConfig, OverlongBufferConfig, RewardModelConfig, RolloutCorrectionConfig,
                     RolloutSection, TrainerConfig, ValKwargs)

__all__ = ["Config", "DataConfig", "ModelSection", "ValKwargs", "RolloutSection", "OptimConfig",
           "DynamicTokenLenConfig", "ActorConfig", "ActorRolloutRefConfig", "FilterGroupsConfig", "AlgorithmConfig",
           "RolloutCorrectionConfig",
           "OverlongBufferConfig", "DialogueRewardConfig", "RewardModelConfig", "EnvironmentConfig",
           "CustomRewardFunctionConfig", "TrainerConfig", "RolloutConfig", "FILTER_METRICS", "RESUME_MODES", "ALIASES",
           "all_keys", "apply_dict", "apply_override", "load_config", "dump_config", "validate", "float_values",
           "ConfigError", "VerlKeysNoted", "VERL_KEYS", "model_context_length"]
