"""Checks of a loaded config beyond one field's type, range and choices: one function per rule.

:func:`validate` runs :func:`~.fields.check_fields` (every field's range and choices), then each
rule of ``RULES`` in order. A rule takes the :class:`~.schema.Config` and raises ``ValueError``
naming the dotted key (:func:`~.fields.require`); add one with the ``@rule`` decorator.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Callable, List, Optional, Tuple

from dapo_kernels.validation import check_rollout_correction

from .choices import SP_LOSS_AGG_MODES
from .fields import INT32_MAX, check_fields, require
from .schema import Config

RULES: List[Callable[[Config], None]] = []
ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"
DTL = f"{ACTOR}.dynamic_token_len"
MODEL_PATH = "actor_rollout_ref.model.path"
RC = "algorithm.rollout_correction"
# dk.rollout_correction's arguments, each a prefix of its error messages (the longer names first).
_RC_ARGS = ("rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs_threshold", "rollout_is", "rollout_rs")


def rule(fn: Callable[[Config], None]) -> Callable[[Config], None]:
    RULES.append(fn)
    return fn


def _longest_sequence(cfg: Config) -> int:
    return cfg.data.max_prompt_length + cfg.data.max_response_length


def _model_json(model_path: str) -> Optional[Tuple[object, str]]:
    """``(model_path/config.json's contents, its path)``, None when there is no such file."""
    path = os.path.join(model_path, "config.json") if model_path else ""
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f), path
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"config key {MODEL_PATH!r}: {path} is not a JSON file: {e}") from None


def model_context_length(model_path: str) -> Optional[Tuple[int, str]]:
    """``(max_position_embeddings, file)`` from ``model_path/config.json`` alone (no model is built);
    None when there is no such file (the model loader reports a missing model). A missing field reads
    as the model loader's default."""
    found = _model_json(model_path)
    if found is None:
        return None
    hf, path = found
    from ..model import ModelConfig  # its default is what the loader builds without the field

    default = {f.name: f.default for f in dataclasses.fields(ModelConfig)}["max_position_embeddings"]
    ctx = hf.get("max_position_embeddings", default) if isinstance(hf, dict) else None
    require(isinstance(ctx, int) and not isinstance(ctx, bool) and ctx >= 1, MODEL_PATH,
            f"{path}: max_position_embeddings must be an int >= 1, got {ctx!r}")
    return ctx, path


@rule
def lengths_fit_model_context(cfg: Config) -> None:
    d, longest, mml = cfg.data, _longest_sequence(cfg), cfg.actor_rollout_ref.rollout.max_model_len
    lengths = f"data.max_prompt_length + data.max_response_length = {d.max_prompt_length} + {d.max_response_length}"
    require(mml is None or longest <= mml, f"{ROLLOUT}.max_model_len",
            f"must hold the longest sequence, {lengths} = {longest}, got {mml}")
    found = model_context_length(cfg.actor_rollout_ref.model.path)
    if found is not None:
        ctx, path = found
        require(longest <= ctx, "data.max_response_length",
                f"{lengths} = {longest} exceeds the model's context, max_position_embeddings = {ctx} in {path}")
        require(mml is None or mml <= ctx, f"{ROLLOUT}.max_model_len",
                f"{mml} exceeds the model's context, max_position_embeddings = {ctx} in {path}")


@rule
def sample_groups_fit_int32_offsets(cfg: Config) -> None:
    # A prompt's n responses stay together on one rank, packed with int32 offsets (flash-attn's cu_seqlens).
    longest, r = _longest_sequence(cfg), cfg.actor_rollout_ref.rollout
    require(longest <= INT32_MAX, "data.max_response_length",
            f"data.max_prompt_length + data.max_response_length = {longest} exceeds the {INT32_MAX} tokens one "
            "packed batch can address")
    for key, n in ((f"{ROLLOUT}.n", r.n), (f"{ROLLOUT}.val_kwargs.n", r.val_kwargs.n)):
        require(n * longest <= INT32_MAX, key,
                f"{n} samples of up to {longest} tokens (data.max_prompt_length + data.max_response_length) "
                f"exceed the {INT32_MAX} tokens one packed batch can address, got {n}")


@rule
def mini_batch_divides_train_batch(cfg: Config) -> None:
    d, a = cfg.data, cfg.actor_rollout_ref.actor
    require(d.train_batch_size % a.ppo_mini_batch_size == 0, f"{ACTOR}.ppo_mini_batch_size",
            f"must divide data.train_batch_size ({d.train_batch_size}), got {a.ppo_mini_batch_size}")


@rule
def token_cap_holds_longest_sequence(cfg: Config) -> None:
    # An SP group shares a micro-batch: it holds SP x the per-rank cap.
    a, longest = cfg.actor_rollout_ref.actor, _longest_sequence(cfg)
    sp = a.ulysses_sequence_parallel_size
    require(not a.use_dynamic_bsz or a.ppo_max_token_len_per_gpu * sp >= longest, f"{ACTOR}.ppo_max_token_len_per_gpu",
            f"times ulysses_sequence_parallel_size ({sp}) must hold the longest sequence, data.max_prompt_length + "
            f"data.max_response_length = {longest}, got {a.ppo_max_token_len_per_gpu}")


@rule
def dynamic_token_len_consistent(cfg: Config) -> None:
    dtl, longest = cfg.actor_rollout_ref.actor.dynamic_token_len, _longest_sequence(cfg)
    require(dtl.short_turns <= dtl.long_turns, f"{DTL}.short_turns",
            f"must be <= long_turns ({dtl.long_turns}), got {dtl.short_turns}")
    require(dtl.max_token_len is not None or dtl.long_factor <= 1, f"{DTL}.max_token_len",
            f"must be set (the most tokens one micro-batch may hold in memory) when long_factor "
            f"({dtl.long_factor}) is above 1")
    require(dtl.max_token_len is None or dtl.max_token_len >= longest, f"{DTL}.max_token_len",
            f"must hold the longest sequence, data.max_prompt_length + data.max_response_length = {longest}, "
            f"got {dtl.max_token_len}")


@rule
def prompt_template_has_placeholder(cfg: Config) -> None:
    require("{prompt}" in cfg.data.prompt_template, "data.prompt_template", "must contain '{prompt}'")


@rule
def sequence_parallel_compatible(cfg: Config) -> None:
    a, key = cfg.actor_rollout_ref.actor, f"{ACTOR}.ulysses_sequence_parallel_size"
    sp = a.ulysses_sequence_parallel_size
    require(sp == 1 or a.tensor_model_parallel_size == 1, key,
            f"sequence parallelism ({sp}) with tensor parallelism "
            f"({ACTOR}.tensor_model_parallel_size={a.tensor_model_parallel_size}) is not supported; use one of them")
    require(sp == 1 or a.loss_agg_mode in SP_LOSS_AGG_MODES, key,
            f"sequence parallelism supports loss_agg_mode token-mean or token-sum, got {a.loss_agg_mode!r}")


@rule
def pipeline_parallel_compatible(cfg: Config) -> None:
    a, key = cfg.actor_rollout_ref.actor, f"{ACTOR}.pipeline_model_parallel_size"
    pp, v = a.pipeline_model_parallel_size, a.virtual_pipeline_model_parallel_size or 1
    require(pp == 1 or a.ulysses_sequence_parallel_size == 1, key,
            f"pipeline parallelism ({pp}) with sequence parallelism ({ACTOR}.ulysses_sequence_parallel_size="
            f"{a.ulysses_sequence_parallel_size}) is not supported; use one of them")
    require(v == 1 or pp > 1, f"{ACTOR}.virtual_pipeline_model_parallel_size",
            f"interleaving ({v} model chunks per rank) needs {key} > 1, got {pp}")
    # Every stage must have a micro-batch of its own in flight: at least PP x virtual micro-batches.
    rows = a.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n
    require(rows >= pp * v, f"{ACTOR}.ppo_mini_batch_size",
            f"x actor_rollout_ref.rollout.n = {rows} rows per mini-batch, fewer than the {pp * v} pipeline stages "
            f"({key}={pp} x {ACTOR}.virtual_pipeline_model_parallel_size={v}): every stage needs a micro-batch")


@rule
def expert_parallel_compatible(cfg: Config) -> None:
    a = cfg.actor_rollout_ref.actor
    ep, key = a.megatron.expert_model_parallel_size, f"{ACTOR}.megatron.expert_model_parallel_size"
    # Tokens are exchanged among the DP ranks only; TP / SP / PP ranks would each need their own EP groups.
    for other in ("tensor_model_parallel_size", "ulysses_sequence_parallel_size", "pipeline_model_parallel_size"):
        require(ep == 1 or getattr(a, other) == 1, key,
                f"expert parallelism ({ep}) with {ACTOR}.{other}={getattr(a, other)} is not supported; "
                "EP runs over the data-parallel ranks only")
    # Every forward is collective over the EP ranks: they must run as many micro-batches.
    require(ep == 1 or a.use_dynamic_bsz, key,
            f"expert parallelism ({ep}) needs {ACTOR}.use_dynamic_bsz=true (the ranks run equal numbers of "
            "micro-batches, every forward exchanges tokens)")


@rule
def activation_offload_needs_checkpointing(cfg: Config) -> None:
    m = cfg.actor_rollout_ref.model
    require(not m.enable_activation_offload or m.enable_gradient_checkpointing,
            "actor_rollout_ref.model.enable_activation_offload",
            "offloads the checkpointed layers' inputs: set actor_rollout_ref.model.enable_gradient_checkpointing=true")


@rule
def parameters_not_float16(cfg: Config) -> None:
    # AdamW steps in the parameters' dtype: float16 has no fp32 master copy or loss scaling here.
    require(cfg.actor_rollout_ref.model.dtype != "float16", "actor_rollout_ref.model.dtype",
            "float16 parameters are refused: AdamW's update in float16 (eps 1e-8 rounds to 0, small squared "
            "gradients underflow) turns the weights inf / NaN at the first step; use bfloat16 (float32's range, "
            "half the memory) or float32")


@rule
def two_betas(cfg: Config) -> None:
    betas = cfg.actor_rollout_ref.actor.optim.betas
    require(len(betas) == 2, f"{ACTOR}.optim.betas", f"must hold 2 floats, got {betas}")


@rule
def vllm_tensor_parallel_fits_device(cfg: Config) -> None:
    r = cfg.actor_rollout_ref.rollout
    if r.name == "vllm":
        from ..rollout.vllm_engine import check_vllm_tp  # vLLM itself is imported by the engine only

        check_vllm_tp(r.tensor_model_parallel_size, on_cpu=cfg.trainer.device == "cpu")


@rule
def filter_metric_mapping_not_empty(cfg: Config) -> None:
    m = cfg.algorithm.filter_groups.metric
    require(isinstance(m, str) or len(m) > 0, "algorithm.filter_groups.metric", "an empty mapping weights nothing")


@rule
def filter_groups_adaptive_consistent(cfg: Config) -> None:
    fg, key = cfg.algorithm.filter_groups, "algorithm.filter_groups"
    require(fg.reward_threshold_schedule == "constant" or None not in (fg.reward_threshold, fg.reward_threshold_end),
            f"{key}.reward_threshold_end", f"reward_threshold_schedule={fg.reward_threshold_schedule} needs "
            f"reward_threshold (the start) and reward_threshold_end, got {fg.reward_threshold}, "
            f"{fg.reward_threshold_end}")
    lo, hi = fg.min_gen_batch_size, fg.max_gen_batch_size
    require(lo is None or hi is None or lo <= hi, f"{key}.min_gen_batch_size",
            f"must be <= max_gen_batch_size ({hi}), got {lo}")


@rule
def overlong_buffer_within_response(cfg: Config) -> None:
    ob, max_len = cfg.reward_model.overlong_buffer, cfg.data.max_response_length
    require(not ob.enable or 0 < ob.len <= max_len, "reward_model.overlong_buffer.len",
            f"must be in [1, data.max_response_length={max_len}], got {ob.len}")


@rule
def rollout_correction_options(cfg: Config) -> None:
    """``algorithm.rollout_correction`` as ``dk.rollout_correction`` parses it (the threshold of the IS
    weights also while ``rollout_is`` is null: a later rollout_is=token must not meet a bad value)."""
    rc = cfg.algorithm.rollout_correction
    for name in ("rollout_is_threshold", "rollout_rs_threshold"):
        spec = getattr(rc, name)
        for part in re.split("[_,]", spec) if isinstance(spec, str) else ():
            try:
                value = float(part)
            except ValueError:
                continue  # not a number: the op's own message below names it
            if not math.isfinite(value):
                raise ValueError(f"config key '{RC}.{name}' must be finite, got {spec!r}")
    try:
        check_rollout_correction(rc.rollout_is or "token", rc.rollout_is_threshold, rc.rollout_is_batch_normalize,
                                 rc.rollout_rs, rc.rollout_rs_threshold)
    except (ValueError, TypeError) as e:
        arg = next((a for a in _RC_ARGS if str(e).startswith(a)), "rollout_rs")
        raise ValueError(f"config key '{RC}.{arg}': {e}") from None
    require(rc.loss_type == "ppo_clip", f"{RC}.loss_type",
            "'reinforce' (verl's bypass_mode REINFORCE loss, -w * log_prob * advantage, unclipped) is not "
            "implemented: dapo_kernels' policy losses are PPO-clip; use 'ppo_clip' (verl's default)")


@rule
def rollout_correction_has_rollout_log_probs(cfg: Config) -> None:
    # verl: decoupled mode skips the correction without rollout log-probs (silently), bypass_mode raises at the
    # first step; here both are refused at load.
    rc, r = cfg.algorithm.rollout_correction, cfg.actor_rollout_ref.rollout
    asked = [f"{RC}.{k}={'true' if v is True else v}" for k, v in (
        ("rollout_is", rc.rollout_is), ("rollout_rs", rc.rollout_rs), ("bypass_mode", rc.bypass_mode))
        if v not in (None, False)]
    require(not asked or r.calculate_log_probs, f"{ROLLOUT}.calculate_log_probs",
            f"{', '.join(asked)} needs the rollout's log-probs: set {ROLLOUT}.calculate_log_probs=true, got false")
    sp = cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size
    require(not rc.bypass_mode or sp == 1, f"{RC}.bypass_mode",
            f"bypass_mode corrects each micro-batch against the current policy, whose sequences sequence parallelism "
            f"splits over ranks ({ACTOR}.ulysses_sequence_parallel_size={sp}); use sp 1, or bypass_mode=false")
    # decoupled mode compares the old log-probs with the rollout's: taking the rollout's as the old ones
    # would make every weight 1 (bypass_mode is the mode that trains on the rollout's log-probs).
    require(not (cfg.actor_rollout_ref.actor.use_rollout_log_probs and r.calculate_log_probs and not rc.bypass_mode),
            f"{ACTOR}.use_rollout_log_probs",
            f"true with {ROLLOUT}.calculate_log_probs=true and {RC}.bypass_mode=false would correct the rollout's "
            f"log-probs against themselves (every weight 1); set {RC}.bypass_mode=true instead")


@rule
def router_replay_supported(cfg: Config) -> None:
    a, r, key = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, f"{ACTOR}.router_replay.mode"
    mode, record = a.router_replay.mode, r.enable_rollout_routing_replay
    require(mode == "disabled" or a.pipeline_model_parallel_size == 1, key,
            f"{mode!r} with pipeline parallelism ({ACTOR}.pipeline_model_parallel_size="
            f"{a.pipeline_model_parallel_size}) is not supported: its stages record no routing")
    require((mode == "R3") == record, f"{ROLLOUT}.enable_rollout_routing_replay",
            f"records the rollout's routing for {key}=R3 and only for it: got {str(record).lower()} with {mode!r}")
    if mode == "R3":
        require(r.name == "embedded", key, f"'R3' needs the embedded sampler's routing ({ROLLOUT}.name=embedded): "
                f"vLLM's is not read here, got {ROLLOUT}.name={r.name!r}")
        require(a.ulysses_sequence_parallel_size == 1, key, "'R3' with sequence parallelism "
                f"({ACTOR}.ulysses_sequence_parallel_size={a.ulysses_sequence_parallel_size}) is not supported")
        require(not cfg.environment.path, key, "'R3' with a multi-turn environment (environment.path) is not "
                "supported: the environment's turns are not routed by the sampler")


@rule
def share_prompts_supported(cfg: Config) -> None:
    a, key = cfg.actor_rollout_ref.actor, f"{ACTOR}.share_prompts"
    if not a.share_prompts:
        return
    for other in ("ulysses_sequence_parallel_size", "pipeline_model_parallel_size"):
        require(getattr(a, other) == 1, key, f"prompt sharing with {ACTOR}.{other}={getattr(a, other)} is not "
                "supported: those split a micro-batch's tokens, not its sequences")
    require(a.router_replay.mode == "disabled", key, f"prompt sharing with router replay ({ACTOR}.router_replay.mode="
            f"{a.router_replay.mode!r}) is not supported")
    found = _model_json(cfg.actor_rollout_ref.model.path)
    if found is not None and isinstance(found[0], dict):
        experts = found[0].get("num_experts") or found[0].get("num_local_experts")
        require(not experts, key, f"prompt sharing with a mixture-of-experts model ({experts} experts in {found[1]}) "
                "is not supported: its router's load and aux loss count every copy of a prompt")


@rule
def resume_path_given(cfg: Config) -> None:
    t = cfg.trainer
    require(t.resume_mode != "resume_path" or bool(t.resume_from_path), "trainer.resume_from_path",
            "must be set when trainer.resume_mode=resume_path")


def validate(cfg: Config) -> Config:
    """Every field's range and choices, then every rule; ``ValueError`` naming the key. Returns ``cfg``."""
    check_fields(cfg)
    for check in RULES:
        check(cfg)
    return cfg


def notes(cfg: Config) -> List[str]:
    """Settings that load but change nothing here, one line each (listed with the verl keys' notes)."""
    out = []
    r, a = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    if r.name != "vllm" and r.tensor_model_parallel_size != 1:
        out.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size={r.tensor_model_parallel_size}: vLLM's "
                   f"tensor parallel size; the embedded rollout (rollout.name={r.name!r}) samples on the actor's "
                   f"layout ({ACTOR}.tensor_model_parallel_size={a.tensor_model_parallel_size}) and ignores it")
    return out


@rule
def async_training_supported(cfg: Config) -> None:
    at = cfg.async_training
    if not at.enable:
        return
    r = cfg.actor_rollout_ref.rollout
    require(r.name == "embedded", f"{ROLLOUT}.name",
            f"async_training.enable=true runs the embedded sampler in the rollout workers; {r.name!r} is not "
            "implemented there")
    require(cfg.trainer.device in ("cpu", "auto"), "trainer.device",
            f"async_training.enable=true runs on the CPU only (gloo weight sync); got {cfg.trainer.device!r}")
