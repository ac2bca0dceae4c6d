"""dapo-tune: presets in sync with the tuner, a tuned config trains, keep rate from a profile,
the fill probability, bad input; the memory model against the CPU peak (two small sizes)."""
import importlib.util
import json
import os
import random
import shlex

import pytest

import dapo_trainer
from dapo_trainer.tools import tune
from dapo_trainer.config import load_config
from dapo_trainer.trainer import DAPOTrainer
from tests.trainer.tiny import micro_setup, write_tiny_model

PRESETS = os.path.join(os.path.dirname(dapo_trainer.__file__), "configs", "presets")


def _preset_files():
    return sorted(f for f in os.listdir(PRESETS) if f.endswith(".yaml"))


@pytest.mark.parametrize("name", _preset_files())
def test_preset_is_what_dapo_tune_writes(name):
    text = open(os.path.join(PRESETS, name)).read()
    args = shlex.split(text.splitlines()[0].lstrip("# "))[1:]  # the command in the first line
    i = args.index("--model")
    args[i + 1] = os.path.join(PRESETS, "models", args[i + 1])
    assert tune.cli(args) == text, f"{name} is stale: rerun the command in its first line with --output"
    cfg = load_config(os.path.join(PRESETS, name))
    assert cfg.algorithm.filter_groups.enable


def test_presets_cover_the_hardware():
    names = _preset_files()
    assert {n.split("_")[0] for n in names} == {"1x24GB", "8x80GB", "8xAscend910B", "cpu"}
    cpu = load_config(os.path.join(PRESETS, [n for n in names if n.startswith("cpu")][0]))
    assert cpu.data.gen_batch_size == 8 and cpu.algorithm.filter_groups.max_num_gen_batches == 3
    assert cpu.trainer.device == "cpu" and cpu.actor_rollout_ref.model.dtype == "float32"
    big = load_config(os.path.join(PRESETS, "8x80GB_qwen2.5-7b.yaml"))
    assert big.actor_rollout_ref.actor.strategy == "fsdp2" and big.actor_rollout_ref.model.dtype == "bfloat16"


def test_tuned_config_trains(tmp_path):
    overrides = micro_setup(str(tmp_path))
    out = tmp_path / "tuned.yaml"
    tune.cli(["--task-type", "math", "--hardware", "cpu", "--model", str(tmp_path / "model"),
               "--dataset", str(tmp_path / "train.jsonl"), "--output", str(out)])
    text = out.read_text()
    assert "24 dataset prompts in tokens" in text  # the tiny model has a tokenizer
    paths = [o for o in overrides if o.split("=")[0] in (
        "actor_rollout_ref.model.path", "data.train_files", "data.val_files", "custom_reward_function.path",
        "trainer.default_local_dir")]
    # The tiny model's context is 256 positions: responses shorter than the tuner's CPU cap.
    cfg = load_config(str(out), paths + ["trainer.total_training_steps=1", "data.max_response_length=8",
                                         "trainer.progress_bar=false"])
    assert cfg.data.gen_batch_size == 8 and cfg.data.max_prompt_length == 64  # p99 of 4-6 tokens, + 5%, to 64
    final = DAPOTrainer(cfg).fit()
    assert final["train/num_gen_batches"] >= 1 and "actor/pg_loss" in final


def test_profile_keep_rate_sets_gen_batch(tmp_path):
    model = os.path.join(PRESETS, "models", "qwen2.5-7b")
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"keep_rate": 0.25, "steps": 5, "truncated_share": 0.2,
                                "config": {"max_response_length": 2048}}))
    v = {k: (x, why) for k, x, why in tune.tune("math", "8xH100", model, profile=str(prof))}
    assert v["data.gen_batch_size"][0] == 568  # 128 / 0.25 x 1.1 = 563.2, up to a multiple of DP 8
    assert "measured keep rate 25%" in v["data.gen_batch_size"][1]
    assert v["data.max_response_length"][0] == 4096  # 20% truncated at 2048: doubled
    n = v["algorithm.filter_groups.max_num_gen_batches"][0] // 2
    fill = [tune.fill_probability(568, 0.25, 128, k) for k in (n - 1, n)]
    assert fill[1] >= tune.FILL_PROBABILITY > fill[0]


def test_fill_probability_matches_sampling():
    random.seed(0)
    sims = sum(sum(random.random() < 0.3 for _ in range(2 * 20)) >= 10 for _ in range(4000)) / 4000
    assert abs(tune.fill_probability(20, 0.3, 10, 2) - sims) < 0.03
    assert tune.fill_probability(10, 0.5, 0, 1) == 1.0 and tune.fill_probability(10, 0.0, 1, 5) == 0.0


def test_bad_input(tmp_path):
    model = os.path.join(PRESETS, "models", "qwen2.5-7b")
    with pytest.raises(ValueError, match="hardware must be one of"):
        tune.tune("math", "2xTPU", model)
    with pytest.raises(ValueError, match="task_type must be one of"):
        tune.tune("chess", "8xH100", model)
    with pytest.raises(ValueError, match="has no config.json"):
        tune.tune("math", "8xH100", str(tmp_path))
    with pytest.raises(SystemExit, match="dapo-tune: 7.62B parameters need .* over 80% of 1x24GB"):
        tune.main(["--task-type", "math", "--hardware", "1x24GB", "--model", model])


@pytest.mark.slow
def test_memory_model_matches_cpu_peak():
    """The two smallest sizes of benchmarks/bench_memory_model.py (the 4-size table is in RESULTS.md)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "benchmarks", "bench_memory_model.py")
    spec = importlib.util.spec_from_file_location("bench_memory_model", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from dapo_trainer.memory_model import train_memory

    for size in bench.SIZES[:2]:
        for tokens in bench.TOKENS:
            pred = train_memory(bench._model_config(*size), tokens, foreach=False)["peak"]
            measured = bench.run_case(size, tokens)
            assert abs(pred - measured) <= bench.TOLERANCE * measured, (size[0], tokens, pred, measured)


def test_heads_that_do_not_split_the_hidden_size_are_refused(tmp_path):
    """A config.json of hidden_size 64 over 3 heads (no head_dim) is no model: dapo-tune refuses it
    naming the file and both keys instead of writing a config for it."""
    with open(os.path.join(PRESETS, "models", "qwen2.5-0.5b", "config.json")) as f:
        cfg = json.load(f)
    cfg.update(hidden_size=64, num_attention_heads=3, num_key_value_heads=1, intermediate_size=128)
    cfg.pop("head_dim", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json: hidden_size 64 is not a multiple of num_attention_heads 3"):
        tune.tune("math", "cpu", str(tmp_path))


def test_tuned_lengths_fit_the_models_context(tmp_path):
    """Suggested prompt + response lengths never exceed the model's max_position_embeddings (which
    the config refuses at load); the reason says they were cut."""
    write_tiny_model(str(tmp_path / "model"))  # 256 positions; the CPU preset asks 256 + 256
    v = {k: (x, why) for k, x, why in tune.tune("math", "cpu", str(tmp_path / "model"))}
    assert v["data.max_prompt_length"][0] + v["data.max_response_length"][0] == 256
    assert "max_position_embeddings 256" in v["data.max_response_length"][1]


def test_pipeline_suggested_where_tp_x_fsdp_cannot_fit(tmp_path):
    """A model whose 5 KV heads allow neither TP nor Ulysses SP (50 heads: 2 does not divide 5, nor 5 2)
    on 8 x A100-40GB: FSDP over the 8 devices holds the states but not one 5120-token sequence (the
    gathered root and layers, the loss workspace and the sampler replica on every device); two
    pipeline stages x FSDP 4 fit, and the reason gives both layouts' per-device memory."""
    from dapo_trainer.hf_io import write_hf_config
    from dapo_trainer.model import ModelConfig
    from dapo_trainer.memory_model import Parallel, train_memory

    cfg = ModelConfig(vocab_size=128256, hidden_size=6400, intermediate_size=19200, num_layers=16, num_heads=50,
                      num_kv_heads=5, head_dim=128, max_position_embeddings=8192)
    write_hf_config(cfg, None, str(tmp_path))
    v = {k: (x, why) for k, x, why in tune.tune("math", "8xA100-40GB", str(tmp_path))}
    pp, why = v["actor_rollout_ref.actor.pipeline_model_parallel_size"]
    assert pp == 2 and v["actor_rollout_ref.actor.tensor_model_parallel_size"][0] == 1
    assert v["actor_rollout_ref.actor.strategy"][0] == "fsdp2"
    assert v["actor_rollout_ref.actor.ulysses_sequence_parallel_size"][0] == 1
    # The figures in the reason are the memory model's at one sequence with checkpointing and offload.
    budget, replica = tune.HEADROOM * 40 * tune.GIB, 2 * cfg.num_params()

    def need(fsdp, pp):
        return train_memory(cfg, 5120, dtype="bfloat16", checkpointing=True, offload=True,
                            par=Parallel(fsdp=fsdp, pp=pp), micro_batches=2)["peak"] + replica

    assert need(8, 1) > budget >= need(4, 2)
    assert (f"the layers do not fit after TP=1 x FSDP=8 (TP sizes dividing the 50 heads and 5 KV heads: none "
            f"below 8; SP: none): one 5120-token sequence needs {need(8, 1) / tune.GIB:.1f} GiB") in why
    assert (f"PP=2 (x TP=1 x FSDP=4, checkpointing and offload) gives {need(4, 2) / tune.GIB:.1f} GiB per GPU on "
            "its largest stage") in why
    # With 10 KV heads TP=2 divides the heads: the same shapes take TP=2 x FSDP=4 and no pipeline.
    write_hf_config(ModelConfig(**{**cfg.__dict__, "num_kv_heads": 10, "hf_config": None}), None, str(tmp_path))
    v = {k: x for k, x, _ in tune.tune("math", "8xA100-40GB", str(tmp_path))}
    assert "actor_rollout_ref.actor.pipeline_model_parallel_size" not in v
    assert v["actor_rollout_ref.actor.tensor_model_parallel_size"] == 2
