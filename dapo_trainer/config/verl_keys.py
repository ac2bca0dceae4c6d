"""verl keys without a field here: accepted at the values that change nothing in this trainer, with a note.

``VERL_KEYS[dotted key] = VerlKey(accepts, expected, note)``: ``accepts(value, cfg)`` (``cfg``: the config
after every override) tells whether the value means here what it means in verl; ``note`` says what the
key does here, printed once at load. Any other value asks for behaviour this trainer does not have: an
error naming the key, ``expected`` and why. Keys come from verl's DAPO recipe scripts and its
``ppo_trainer.yaml`` defaults (verl 0.9.1).

``trainer.logger`` is a field (the loggers implemented here, :data:`~.choices.Logger`); verl's other
loggers are dropped from it with a note (:func:`split_loggers`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from .choices import LOGGERS


class VerlKey(NamedTuple):
    accepts: Callable[[Any, Any], bool]  # (value, final config) -> the value changes nothing here
    expected: str  # the accepted values, in words
    note: str  # what the key means in this trainer


def _bool(v, cfg) -> bool:
    return isinstance(v, bool)


def _int(lo: int) -> Callable[[Any, Any], bool]:
    return lambda v, cfg: isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _int_or_null(lo: int) -> Callable[[Any, Any], bool]:
    return lambda v, cfg: v is None or _int(lo)(v, cfg)


def _number(v, cfg) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is(*values) -> Callable[[Any, Any], bool]:
    # ``True == 1`` in Python: a bool matches a bool only.
    return lambda v, cfg: any(type(v) is type(x) and v == x for x in values)


def _any(v, cfg) -> bool:
    return True


def _no_top_k(v, cfg) -> bool:
    return _is(-1, 0)(v, cfg)


def _do_sample(v, cfg) -> bool:
    # verl's do_sample=False is greedy validation: here that is val_kwargs.temperature=0.
    return v is True or (v is False and cfg.actor_rollout_ref.rollout.val_kwargs.temperature == 0)


_ACTOR_MB = ("old and reference log-probs use the actor's micro-batches "
             "(actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu)")
_NO_OFFLOAD = "parameters and optimizer state stay on the device (no FSDP CPU offload here)"
_FSDP_DEFAULTS = "FSDP2's defaults are used"
_FUSED = "entropy comes from dapo_kernels' fused log-prob op, which never holds the full logits"
_VLLM_DEFAULT = "vLLM's own scheduler defaults are used"
_KL_IN_REWARD = "used only with algorithm.use_kl_in_reward=true, which is not implemented"
_TOP_K = ("-1 or 0 (top-k sampling is not implemented)", "no top-k cut: sampling uses temperature and top_p only")

A, R, REF = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref"
# Mixture-of-experts keys (verl's Qwen3-MoE recipes): the actor's expert_model_parallel_size is a setting
# (schema.MegatronConfig); the reference model takes the actor's layout, the embedded sampler a replica.
_NO_EP = (f"the reference model is laid out as the actor ({A}.megatron.expert_model_parallel_size) and the "
          "embedded sampler holds every expert")

VERL_KEYS: Dict[str, VerlKey] = {
    # data
    "data.filter_overlong_prompts": VerlKey(_bool, "true or false", "a prompt over data.max_prompt_length is "
                                            "handled by data.truncation (error, left or right), never dropped"),
    "data.filter_overlong_prompts_workers": VerlKey(_int(1), "an int >= 1", "no filtering pass here"),
    "data.return_raw_chat": VerlKey(_bool, "true or false", "message-list prompts are rendered by "
                                    "data.apply_chat_template"),
    "data.dataloader_num_workers": VerlKey(_int(0), "an int >= 0", "rows are read in the trainer's process"),
    "data.train_max_samples": VerlKey(_is(-1), "-1 (every row)", "every training row is used"),
    "data.validation_shuffle": VerlKey(_is(False), "false", "validation rows are read in file order"),
    "data.reward_fn_key": VerlKey(_is("data_source"), "'data_source'", "the reward function gets the row's "
                                  "data_source"),
    "data.trust_remote_code": VerlKey(_is(False), "false", "no code from the model directory is ever run"),
    "data.seed": VerlKey(_is(None), "null", "shuffling uses trainer.seed"),
    # model
    "actor_rollout_ref.model.use_remove_padding": VerlKey(_bool, "true or false", "sequences are always packed "
                                                          "without padding (flash-attn's varlen layout)"),
    "actor_rollout_ref.model.trust_remote_code": VerlKey(_is(False), "false", "no code from the model directory "
                                                         "is ever run"),
    **{f"actor_rollout_ref.model.override_config.{k}": VerlKey(_is(0, 0.0), "0", "the model has no dropout")
       for k in ("attention_dropout", "embd_pdrop", "resid_pdrop")},
    # actor
    **{f"{A}.fsdp_config.{k}": VerlKey(_bool, "true or false", _NO_OFFLOAD)
       for k in ("param_offload", "optimizer_offload")},
    f"{A}.fsdp_config.fsdp_size": VerlKey(_int(-1), "an int >= -1", "strategy=fsdp2 shards over every "
                                          "data-parallel rank"),
    **{f"{s}.fsdp_config.{k}": VerlKey(_bool, "true or false", _FSDP_DEFAULTS)
       for s in (A, REF) for k in ("forward_prefetch", "reshard_after_forward")},
    **{f"{s}.{k}": VerlKey(_bool, "true or false", _FUSED)
       for s in (A, REF) for k in ("entropy_checkpointing", "entropy_from_logits_with_chunking")},
    **{f"{s}.use_torch_compile": VerlKey(_bool, "true or false", "the fused ops are Triton kernels; "
                                         "nothing is compiled by torch.compile") for s in (A, REF)},
    f"{A}.ppo_micro_batch_size": VerlKey(_is(None), "null", "verl's deprecated global size; "
                                         f"{A}.ppo_micro_batch_size_per_gpu is the one used"),
    f"{A}.use_token_level_loss": VerlKey(_is(True), "true", f"token-level loss is {A}.loss_agg_mode=token-mean "
                                         "(the default)"),
    # reference model and old log-probs
    **{f"{s}.log_prob_use_dynamic_bsz": VerlKey(_bool, "true or false", _ACTOR_MB) for s in (REF, R)},
    **{f"{s}.log_prob_max_token_len_per_gpu": VerlKey(_int(1), "an int >= 1", _ACTOR_MB) for s in (REF, R)},
    **{f"{s}.{k}": VerlKey(_int_or_null(1), "an int >= 1 or null", _ACTOR_MB)
       for s in (REF, R) for k in ("log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu")},
    f"{REF}.fsdp_config.param_offload": VerlKey(_bool, "true or false", "the reference model (built only with "
                                                f"{A}.use_kl_loss) stays on the device"),
    f"{REF}.ulysses_sequence_parallel_size": VerlKey(_int(1), "an int >= 1", "the reference model runs with "
                                                     f"{A}.ulysses_sequence_parallel_size"),
    # rollout
    f"{R}.top_k": VerlKey(_no_top_k, *_TOP_K),
    f"{R}.val_kwargs.top_k": VerlKey(_no_top_k, *_TOP_K),
    f"{R}.val_kwargs.do_sample": VerlKey(_do_sample, f"true, or false with {R}.val_kwargs.temperature=0",
                                         f"validation samples at {R}.val_kwargs.temperature (0: greedy)"),
    f"{R}.enable_chunked_prefill": VerlKey(_bool, "true or false", _VLLM_DEFAULT),
    f"{R}.max_num_batched_tokens": VerlKey(_int(1), "an int >= 1", _VLLM_DEFAULT),
    f"{R}.max_num_seqs": VerlKey(_int(1), "an int >= 1", _VLLM_DEFAULT),
    # mixture of experts
    **{k: VerlKey(_is(1), "1", _NO_EP) for k in (f"{REF}.megatron.expert_model_parallel_size",
                                                 f"{R}.expert_parallel_size")},
    # algorithm
    "algorithm.use_kl_in_reward": VerlKey(_is(False), f"false (KL in the reward is not implemented; use "
                                          f"{A}.use_kl_loss=true for a KL term)", "no KL penalty in the reward"),
    "algorithm.kl_penalty": VerlKey(_any, "any", _KL_IN_REWARD),
    **{f"algorithm.kl_ctrl.{k}": VerlKey(_any, "any", _KL_IN_REWARD)
       for k in ("type", "kl_coef", "horizon", "target_kl")},
    **{f"algorithm.{k}": VerlKey(_number, "a number", "used by GAE only; GRPO advantages do not use it")
       for k in ("gamma", "lam")},
    "algorithm.use_pf_ppo": VerlKey(_is(False), "false (PF-PPO is not implemented)", "no PF-PPO reweighting"),
    # reward
    "reward_model.enable": VerlKey(_is(False), "false (no reward model is implemented)", "rewards come from "
                                   "custom_reward_function or the built-in verifiers"),
    "reward_model.overlong_buffer.log": VerlKey(_bool, "true or false", "no per-sample overlong log; the penalty "
                                                "is part of the reward metrics"),
    # trainer
    **{f"trainer.{k}": VerlKey(_int(1), "an int >= 1", "the world size comes from the launcher "
                               "(torchrun --nnodes / --nproc_per_node)") for k in ("nnodes", "n_gpus_per_node")},
    "trainer.total_epochs": VerlKey(_int(1), "an int >= 1", "training runs trainer.total_training_steps steps "
                                    "(set it: default 10), cycling through the data"),
    "trainer.critic_warmup": VerlKey(_is(0), "0 (no critic here)", "GRPO has no critic"),
    "trainer.log_val_generations": VerlKey(_int(0), "an int >= 0", "validation generations are not logged; "
                                           "trainer.rollout_data_dir dumps training rollouts"),
    "trainer.val_only": VerlKey(_is(False), "false (validation-only runs are not implemented)", "the run trains"),
    "trainer.default_hdfs_dir": VerlKey(_is(None), "null", "checkpoints stay in trainer.default_local_dir"),
    "trainer.del_local_ckpt_after_load": VerlKey(_is(False), "false", "checkpoints are kept after a resume"),
    **{f"trainer.max_{k}_ckpt_to_keep": VerlKey(_is(None), "null (checkpoint retention is not implemented)",
                                                "every checkpoint is kept") for k in ("actor", "critic")},
    "trainer.validation_data_dir": VerlKey(_is(None), "null", "validation generations are not dumped"),
    "trainer.ray_wait_register_center_timeout": VerlKey(_number, "a number", "no Ray here"),
}

# verl's loggers not implemented here (verl.utils.tracking.Tracking.supported_backend).
VERL_ONLY_LOGGERS = ("swanlab", "vemlp_wandb", "clearml", "trackio", "file", "rl_insight")
_LOGGER_NOTE = ("not implemented here: every step's metrics go to metrics.jsonl in trainer.default_local_dir, "
                f"the loggers are {', '.join(LOGGERS[:-1])} and {LOGGERS[-1]}")


def is_verl_section(key: str) -> bool:
    """``key`` is a section of some verl key here (a YAML mapping under it holds verl keys)."""
    return any(k.startswith(key + ".") for k in VERL_KEYS)


def split_loggers(value) -> Tuple[Any, Optional[str]]:
    """``trainer.logger`` without verl's loggers that are not implemented here, and the note about them."""
    items = value if isinstance(value, (list, tuple)) else [value]
    dropped = [x for x in items if x in VERL_ONLY_LOGGERS]
    if not dropped:
        return value, None
    return [x for x in items if x not in VERL_ONLY_LOGGERS], f"{', '.join(map(repr, dropped))} {_LOGGER_NOTE}"


def check_verl_keys(given: List[Tuple[str, Any]], cfg) -> Tuple[List[str], List[str]]:
    """``(notes, problems)`` of the verl keys ``given`` as ``(key, value)``, judged against the final ``cfg``."""
    notes, problems = [], []
    for key, value in given:
        vk = VERL_KEYS[key]
        if vk.accepts(value, cfg):
            notes.append(f"{key}={value!r}: {vk.note}")
        else:
            problems.append(f"config key {key!r}: verl's {key}={value!r} would change behaviour that is not "
                            f"implemented here; expected {vk.expected}")
    return notes, problems
