"""Start-up checks of the config: verl command lines port, every bad
value is caught at load naming its dotted key, lengths are checked against the model's context."""
from __future__ import annotations

import json
import warnings

import pytest

from dapo_trainer.config import (VERL_KEYS, ConfigError, VerlKeysNoted, all_keys, load_config,
                                 model_context_length)

# The key=value arguments of verl's recipe/dapo/run_dapo_qwen2.5_32b.sh (the DAPO paper's run), with
# the script's shell variables resolved; "{model}" and "{run}" stand for local directories.
RECIPE_32B = [
    "data.train_files={run}/dapo-math-17k.parquet", "data.val_files={run}/aime-2024.parquet",
    "data.prompt_key=prompt", "data.truncation='left'", "data.max_prompt_length=2048",
    "data.max_response_length=20480", "data.gen_batch_size=1536", "data.train_batch_size=512",
    "actor_rollout_ref.rollout.n=16", "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
    "algorithm.kl_ctrl.kl_coef=0.0", "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.actor.kl_loss_coef=0.0", "actor_rollout_ref.actor.clip_ratio_low=0.2",
    "actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.actor.clip_ratio_c=10.0",
    "algorithm.filter_groups.enable=True", "algorithm.filter_groups.max_num_gen_batches=10",
    "algorithm.filter_groups.metric=acc", "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=22528",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=22528",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=22528", "actor_rollout_ref.model.path={model}",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True", "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.optim.lr_warmup_steps=10", "actor_rollout_ref.actor.optim.weight_decay=0.1",
    "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.fsdp_config.param_offload=True",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True", "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.grad_clip=1.0", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=8",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.80",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=4", "actor_rollout_ref.rollout.enable_chunked_prefill=True",
    "actor_rollout_ref.rollout.max_num_batched_tokens=22528", "actor_rollout_ref.rollout.temperature=1.0",
    "actor_rollout_ref.rollout.top_p=1.0", "actor_rollout_ref.rollout.top_k=-1",
    "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", "actor_rollout_ref.rollout.val_kwargs.top_p=0.7",
    "actor_rollout_ref.rollout.val_kwargs.top_k=-1", "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
    "actor_rollout_ref.rollout.val_kwargs.n=1", "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True", "actor_rollout_ref.ref.ulysses_sequence_parallel_size=8",
    "actor_rollout_ref.actor.fsdp_config.fsdp_size=-1", "reward_model.reward_manager=dapo",
    "reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=4096",
    "reward_model.overlong_buffer.penalty_factor=1.0", 'trainer.logger=["console","wandb"]',
    "trainer.project_name=DAPO", "trainer.experiment_name=DAPO-Qwen2.5-32B", "trainer.n_gpus_per_node=8",
    "trainer.nnodes=16", "trainer.val_before_train=True", "trainer.test_freq=5", "trainer.save_freq=5",
    "trainer.total_epochs=1", "trainer.default_local_dir={run}/ckpts", "trainer.resume_mode=auto",
]
# Keys of verl's other DAPO recipe scripts (test_dapo_7b.sh, test_dapo_7b_math.sh, run_dapo_qwen2.5_7b_npu.sh,
# run_dapo_qwen3_moe_30b_vllm_fp8_rollout.sh) not in RECIPE_32B.
RECIPE_OTHERS = [
    "data.filter_overlong_prompts=True", "data.return_raw_chat=True", "reward_model.overlong_buffer.log=False",
    "actor_rollout_ref.actor.ppo_micro_batch_size=null", "actor_rollout_ref.ref.log_prob_micro_batch_size=null",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size=null",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "+actor_rollout_ref.model.override_config.attention_dropout=0.",
    "+actor_rollout_ref.model.override_config.embd_pdrop=0.", "+actor_rollout_ref.model.override_config.resid_pdrop=0.",
    "actor_rollout_ref.actor.use_token_level_loss=True", "actor_rollout_ref.actor.use_torch_compile=False",
    "actor_rollout_ref.ref.use_torch_compile=False", "actor_rollout_ref.actor.entropy_checkpointing=True",
    "actor_rollout_ref.ref.entropy_checkpointing=True", "actor_rollout_ref.actor.fsdp_config.forward_prefetch=True",
    "actor_rollout_ref.ref.fsdp_config.forward_prefetch=True",
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking=True",
    "actor_rollout_ref.ref.entropy_from_logits_with_chunking=True", "actor_rollout_ref.rollout.max_num_seqs=256",
    "trainer.total_training_steps=200", "trainer.log_val_generations=10", "+trainer.val_before_train=True",
    "trainer.critic_warmup=0",
]


def _model_dir(tmp_path, context=131072):
    """A model directory holding only config.json (Qwen2.5-32B's context by default)."""
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": context}))
    return str(d)


def _load(overrides):
    """``(config, notes)``: the config and the lines of the one VerlKeysNoted warning (none: [])."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(overrides=overrides)
    noted = [w.message for w in caught if isinstance(w.message, VerlKeysNoted)]
    assert len(noted) <= 1, "the notes are printed once per load"
    return cfg, (noted[0].notes if noted else [])


def _classify(overrides, tmp_path):
    """``(accepted, noted, rejected)`` keys of ``overrides`` loaded together."""
    lines = [o.format(model=_model_dir(tmp_path), run=tmp_path) for o in overrides]
    keys = [o.split("=", 1)[0].lstrip("+") for o in lines]
    try:
        _, notes = _load(lines)
        rejected = []
    except ConfigError as e:
        notes, rejected = [], [k for k in keys if any(repr(k) in p for p in e.problems)]
    noted = [k for k in keys if k not in rejected and any(n.startswith((f"{k}=", f"{k}:")) for n in notes)]
    accepted = [k for k in keys if k not in rejected and k not in noted]
    return accepted, noted, rejected


# --------------------------------------------------------------------------- item 14: verl command lines
def test_dapo_recipe_command_line_loads(tmp_path):
    """All 70 keys of verl's DAPO 32B recipe load in one go: 50 as settings of this trainer (its
    trainer.logger=['console','wandb'] included), 20 with a note of what they mean here; was 43 of 70,
    the rest rejected one per launch."""
    accepted, noted, rejected = _classify(RECIPE_32B, tmp_path)
    print(f"\nrun_dapo_qwen2.5_32b.sh: {len(accepted)} accepted, {len(noted)} noted, {len(rejected)} rejected "
          f"of {len(RECIPE_32B)}")
    assert len(RECIPE_32B) == 70 and rejected == []
    assert (len(accepted), len(noted)) == (50, 20), (accepted, noted)
    assert "trainer.logger" in accepted and "actor_rollout_ref.model.use_remove_padding" in noted
    cfg, _ = _load([o.format(model=_model_dir(tmp_path), run=tmp_path) for o in RECIPE_32B])
    assert cfg.trainer.logger == ["console", "wandb"]
    assert cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 8


def test_other_dapo_recipe_keys_load(tmp_path):
    """The keys of verl's other DAPO recipe scripts load on top of the 32B recipe, each with a note
    unless it is a setting here."""
    accepted, noted, rejected = _classify(RECIPE_32B + RECIPE_OTHERS, tmp_path)
    others = [o.split("=", 1)[0].lstrip("+") for o in RECIPE_OTHERS]
    print(f"\nother recipe keys: {len([k for k in others if k in accepted])} accepted, "
          f"{len([k for k in others if k in noted])} noted, {len(rejected)} rejected of {len(others)}")
    assert rejected == []
    assert {k for k in others if k in accepted} == {"trainer.total_training_steps", "trainer.val_before_train"}


def test_noted_keys_are_not_fields():
    """A verl key with a note is no setting of this trainer (a field would shadow it)."""
    assert not set(VERL_KEYS) & set(all_keys())
    assert all(vk.note and vk.expected for vk in VERL_KEYS.values())


@pytest.mark.parametrize("override,why", [
    ("algorithm.use_kl_in_reward=True", "KL in the reward is not implemented"),
    ("actor_rollout_ref.rollout.top_k=50", "top-k sampling is not implemented"),
    ("actor_rollout_ref.rollout.val_kwargs.top_k=20", "top-k sampling is not implemented"),
    ("actor_rollout_ref.rollout.val_kwargs.do_sample=False", "val_kwargs.temperature=0"),  # sampling at 1.0
    ("trainer.max_actor_ckpt_to_keep=5", "checkpoint retention is not implemented"),
    ("+actor_rollout_ref.model.override_config.attention_dropout=0.1", "expected 0"),
    ("data.train_max_samples=100", "expected -1"),
])
def test_verl_value_that_changes_behaviour_rejected(override, why):
    """A verl key whose value asks for behaviour this trainer lacks is an error naming the key and why."""
    key = override.split("=", 1)[0].lstrip("+")
    with pytest.raises(ConfigError, match=rf"{key!r}.*would change behaviour.*{why}"):
        load_config(overrides=[override, "actor_rollout_ref.rollout.val_kwargs.temperature=1.0"])


def test_greedy_validation_spelled_as_verl_does():
    """val_kwargs.do_sample=False is accepted with val_kwargs.temperature=0 (greedy here too)."""
    _, notes = _load(["actor_rollout_ref.rollout.val_kwargs.do_sample=False",
                      "actor_rollout_ref.rollout.val_kwargs.temperature=0"])
    assert [n.split(":")[0] for n in notes] == ["actor_rollout_ref.rollout.val_kwargs.do_sample=False"]


def test_every_unknown_key_in_one_error():
    """Every unknown or rejected key of a launch is named in one error, not one per launch."""
    bad = ["data.bogus_key=1", "trainer.nonsense=2", "algorithm.use_kl_in_reward=True",
           "actor_rollout_ref.actor.fsdp_config.wrap_policy=3"]
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["data.train_batch_size=8", *bad])
    assert len(e.value.problems) == 4 and str(e.value).startswith("4 config problems:")
    for o in bad:
        assert repr(o.split("=")[0]) in str(e.value)


@pytest.mark.parametrize("key,suggested", [
    ("actor_rollout_ref.actor.fsdp_config.wrap_policy", None),  # was: did you mean '...grad_clip'
    ("trainer.n_gpus", None),  # was: did you mean 'trainer.seed'
    ("data.max_promt_length", "data.max_prompt_length"),
    ("trainer.n_gpu_per_node", "trainer.n_gpus_per_node"),
    ("actor_rollout_ref.actr.clip_ratio_low", "actor_rollout_ref.actor.clip_ratio_low"),
])
def test_suggestion_only_when_close(key, suggested):
    """An unknown key names a valid key only when it is a near spelling of it."""
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[f"{key}=1"])
    if suggested is None:
        assert "did you mean" not in str(e.value)
    else:
        assert f"did you mean {suggested!r}" in str(e.value)


def test_verl_keys_in_yaml(tmp_path):
    """verl keys nested in a YAML file are judged like overrides."""
    p = tmp_path / "c.yaml"
    p.write_text("actor_rollout_ref:\n  actor:\n    fsdp_config:\n      param_offload: true\n"
                 "trainer:\n  nnodes: 2\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(str(p))
    (w,) = [w.message for w in caught if isinstance(w.message, VerlKeysNoted)]
    assert [n.split("=")[0] for n in w.notes] == ["actor_rollout_ref.actor.fsdp_config.param_offload",
                                                  "trainer.nnodes"]
    p.write_text("actor_rollout_ref:\n  actor:\n    fsdp_config:\n      bogus: 1\n")
    with pytest.raises(ConfigError, match="fsdp_config.bogus"):
        load_config(str(p))


# --------------------------------------------------------------------------- item 8: the model's context
def test_lengths_checked_against_model_context(tmp_path):
    """max_prompt_length + max_response_length beyond the model's max_position_embeddings (read from
    its config.json alone, no weights) is an error at load naming the keys and both numbers."""
    model = _model_dir(tmp_path, context=256)
    assert model_context_length(model) == (256, f"{model}/config.json")
    lengths = [f"actor_rollout_ref.model.path={model}", "data.max_prompt_length=200"]
    assert load_config(overrides=lengths + ["data.max_response_length=56"]).data.max_response_length == 56
    with pytest.raises(ValueError, match=r"data\.max_response_length.*200 \+ 100 = 300 exceeds the model's "
                                         r"context, max_position_embeddings = 256"):
        load_config(overrides=lengths + ["data.max_response_length=100"])


@pytest.mark.parametrize("mml,match", [
    (128, r"max_model_len': must hold the longest sequence, .* = 256, got 128"),
    (512, r"max_model_len': 512 exceeds the model's context, max_position_embeddings = 256"),
])
def test_max_model_len_checked(tmp_path, mml, match):
    """rollout.max_model_len must hold the longest sequence and fit the model's context."""
    overrides = [f"actor_rollout_ref.model.path={_model_dir(tmp_path, 256)}", "data.max_prompt_length=128",
                 "data.max_response_length=128", f"actor_rollout_ref.rollout.max_model_len={mml}"]
    with pytest.raises(ValueError, match=match):
        load_config(overrides=overrides)


def test_model_config_json_problems_name_the_file(tmp_path):
    """A missing model directory is left to the model loader; a bad config.json names the file."""
    assert model_context_length(str(tmp_path / "absent")) is None and model_context_length("") is None
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"model\.path.*config\.json is not a JSON file"):
        load_config(overrides=[f"actor_rollout_ref.model.path={d}"])
    (d / "config.json").write_text('{"max_position_embeddings": "4096"}')
    with pytest.raises(ValueError, match=r"config\.json: max_position_embeddings must be an int >= 1, got '4096'"):
        load_config(overrides=[f"actor_rollout_ref.model.path={d}"])


# --------------------------------------------------------------------------- item 9: ranges at load
@pytest.mark.parametrize("override,error,key", [
    ("actor_rollout_ref.rollout.n=100000000", ValueError, "actor_rollout_ref.rollout.n"),
    ("actor_rollout_ref.rollout.n=0", ValueError, "actor_rollout_ref.rollout.n"),
    ("data.max_response_length=1e12", TypeError, "data.max_response_length"),
    ("data.max_response_length=1000000000000", ValueError, "data.max_response_length"),
    ("data.max_response_length=0", ValueError, "data.max_response_length"),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1e30", TypeError,
     "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu=" + "1" + "0" * 30, ValueError,
     "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4294967296", ValueError,
     "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
    ("actor_rollout_ref.rollout.val_kwargs.n=0", ValueError, "actor_rollout_ref.rollout.val_kwargs.n"),
    ("actor_rollout_ref.rollout.val_kwargs.n=10000000", ValueError, "actor_rollout_ref.rollout.val_kwargs.n"),
    ("actor_rollout_ref.rollout.max_model_len=-5", ValueError, "actor_rollout_ref.rollout.max_model_len"),
    ("actor_rollout_ref.rollout.max_model_len=0", ValueError, "actor_rollout_ref.rollout.max_model_len"),
    ("trainer.seed=" + "9" * 20, ValueError, "trainer.seed"),
    ("trainer.seed=-1", ValueError, "trainer.seed"),  # numpy's generators take seeds >= 0
])
def test_out_of_range_counts_and_lengths_rejected_at_load(override, error, key):
    """Counts >= 1, lengths and token caps that fit what the packed batches address, every int in
    int64: an error at load naming the dotted key (was: accepted, failing after the model loads)."""
    with pytest.raises(error, match=rf"config key '{key}'"):
        load_config(overrides=[override])


def test_rollout_n_bound_is_the_packed_group():
    """rollout.n is bounded by the int32 offsets of one prompt's packed group: the largest n that
    fits loads."""
    longest = 512 + 512
    n = (2**31 - 1) // longest
    assert load_config(overrides=[f"actor_rollout_ref.rollout.n={n}"]).actor_rollout_ref.rollout.n == n
    with pytest.raises(ValueError, match="rollout.n"):
        load_config(overrides=[f"actor_rollout_ref.rollout.n={n + 1}"])


# --------------------------------------------------------------------------- item 4: val_max_samples
@pytest.mark.parametrize("value,limit", [(-1, None), ("null", None), (1, 1), (3, 3)])
def test_val_max_samples_minus_one_means_every_row(value, limit):
    """data.val_max_samples=-1 (verl's default) means every validation row, as null does."""
    d = load_config(overrides=[f"data.val_max_samples={value}"]).data
    rows = list(range(5))
    assert d.val_rows_limit == limit and rows[:d.val_rows_limit] == rows[:limit or 5]


@pytest.mark.parametrize("value", [0, -2])
def test_val_max_samples_zero_rejected(value):
    """0 validation rows (or a negative count other than -1) is an error naming the key."""
    with pytest.raises(ValueError, match=r"data\.val_max_samples': must be -1 \(every row\) or >= 1"):
        load_config(overrides=[f"data.val_max_samples={value}"])


# --------------------------------------------------------------------------- item 5: trainer.logger
def test_logger_names_checked():
    """Unknown logger names are an error naming the key; verl's loggers not implemented here (swanlab)
    are dropped with a note saying where the metrics go; wandb and mlflow are loggers here."""
    with pytest.raises(ValueError, match=r"trainer\.logger\[0\]': must be one of 'console', 'tensorboard', 'wandb' "
                                         r"or 'mlflow', got 'nonsense'"):
        load_config(overrides=["trainer.logger=[nonsense]"])
    cfg, notes = _load(["trainer.logger=[console,wandb,swanlab,mlflow]"])
    assert cfg.trainer.logger == ["console", "wandb", "mlflow"]
    assert notes == [n for n in notes if n.startswith("trainer.logger: 'swanlab' not implemented here")] and notes
    assert "metrics.jsonl" in notes[0]
    cfg, notes = _load(["trainer.logger=[tensorboard]"])
    assert cfg.trainer.logger == ["tensorboard"] and notes == []


def test_rollout_tp_with_the_embedded_rollout_is_noted():
    """rollout.tensor_model_parallel_size=4 with the embedded rollout loads with a note that it is
    vLLM's and ignored here (not silently); with rollout.name=vllm it is a setting, not noted."""
    tp = "actor_rollout_ref.rollout.tensor_model_parallel_size=4"
    _, notes = _load([tp])
    assert any(n.startswith(tp) and "ignores it" in n for n in notes), notes
    _, notes = _load([tp, "actor_rollout_ref.rollout.name=vllm", "trainer.device=cuda"])
    assert not any(n.startswith(tp) for n in notes), notes
