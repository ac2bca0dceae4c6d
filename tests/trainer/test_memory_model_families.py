"""The memory model and dapo-tune on the Qwen3 families: the parameter counts equal transformers' models
(dense Qwen3 and Qwen3-MoE, built offline at tiny sizes), an MoE layer's activations follow the active
experts only, and the Qwen3-8B / Qwen3-30B-A3B entries of the presets."""
import json
import os

import pytest
import torch

import dapo_trainer
from dapo_trainer.hf_io import config_from_hf, config_to_hf, read_hf_config
from dapo_trainer.memory_model import (DTYPE_BYTES, Parallel, activation_bytes_per_token, layer_activation_bytes,
                                       stage_memory, stage_params, train_memory)
from dapo_trainer.model import ModelConfig, Transformer
from dapo_trainer.tools import tune

transformers = pytest.importorskip("transformers")

PRESETS = os.path.join(os.path.dirname(dapo_trainer.__file__), "configs", "presets")
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)


def _hf(cls: str, **kw):
    """A random transformers model of class ``cls`` and its config.json dict (nothing downloaded)."""
    cfg = getattr(transformers, f"{cls}Config")(**{**TINY, **kw})
    torch.manual_seed(0)
    model = getattr(transformers, f"{cls}ForCausalLM")(cfg)
    return model, json.loads(cfg.to_json_string())


def _numel(model, prefix: str = "") -> int:
    """Parameters of ``model`` under ``prefix`` (tied ones once)."""
    return sum(p.numel() for n, p in {id(p): (n, p) for n, p in model.named_parameters()}.values()
               if n.startswith(prefix))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_qwen3_count_equals_transformers(tied, bias):
    hf, d = _hf("Qwen3", tie_word_embeddings=tied, attention_bias=bias)
    cfg = config_from_hf(d)
    assert cfg.num_params() == _numel(hf) == _numel(Transformer(cfg))
    for i in range(cfg.num_layers):
        assert cfg.layer_params(i) == _numel(hf, f"model.layers.{i}.")


@pytest.mark.parametrize("layout", [dict(), dict(mlp_only_layers=[1]), dict(decoder_sparse_step=2),
                                    dict(tie_word_embeddings=True)], ids=["all-moe", "mlp-only-1", "step-2", "tied"])
def test_moe_count_equals_transformers(layout):
    """Router (E x H) and every expert (E x 3 H moe_I) of each sparse layer, the dense MLP (3 H I) of the
    others: ModelConfig.num_params == sum(p.numel()) of transformers' Qwen3MoeForCausalLM, layer by layer."""
    hf, d = _hf("Qwen3Moe", **MOE, **layout)
    cfg = config_from_hf(d)
    assert cfg.num_experts == 6 and cfg.num_experts_per_tok == 2 and cfg.norm_topk_prob
    assert cfg.num_params() == _numel(hf) == _numel(Transformer(cfg))
    for i in range(cfg.num_layers):
        assert cfg.layer_params(i) == _numel(hf, f"model.layers.{i}."), i
        assert cfg.is_moe(i) == (type(hf.model.layers[i].mlp).__name__ == "Qwen3MoeSparseMoeBlock"), i
    # Pipeline stages hold their layers' experts: stage_params is each contiguous split's count.
    for rank in range(2):
        layers = sum(_numel(hf, f"model.layers.{i}.") for i in range(2 * rank, 2 * rank + 2))
        outer = (cfg.vocab_size * cfg.hidden_size if rank == 0 else 0) + \
            (cfg.vocab_size * cfg.hidden_size + cfg.hidden_size if rank == 1 else 0)
        assert stage_params(cfg, 2, rank) == layers + outer
    assert config_from_hf(config_to_hf(cfg)) == cfg


def test_qwen2_moe_count_equals_transformers():
    """Qwen2-MoE's sparse layers add a shared expert (3 H shared_I) and its [1, H] gate to the router and experts."""
    hf, d = _hf("Qwen2Moe", **MOE, shared_expert_intermediate_size=24, mlp_only_layers=[2])
    cfg = config_from_hf(d)
    assert cfg.num_params() == _numel(hf) == _numel(Transformer(cfg))
    for i in range(cfg.num_layers):
        assert cfg.layer_params(i) == _numel(hf, f"model.layers.{i}."), i
        assert cfg.moe_params(i) == (_numel(hf, f"model.layers.{i}.mlp.") if cfg.is_moe(i) else 0), i


def test_tp_keeps_sparse_layers_whole():
    """Under TP the sparse MLPs are replicated (parallel/tensor.py): a TP=2 rank holds half of everything
    else and all of them."""
    _, d = _hf("Qwen3Moe", **MOE, mlp_only_layers=[1])
    cfg = config_from_hf(d)
    whole = sum(cfg.moe_params(i) for i in range(cfg.num_layers))
    assert whole and stage_memory(cfg, 64, dtype="bfloat16", par=Parallel(tp=2))["params"] == \
        ((cfg.num_params() - whole) / 2 + whole) * DTYPE_BYTES["bfloat16"]


def test_moe_states_count_every_expert_activations_the_active_ones():
    """Weights, gradients and Adam states grow with the experts; activations with the active experts
    only (per token: k copies of 2 H + 4 moe_I, and the router's fp32 softmax 4 E bytes)."""
    _, d = _hf("Qwen3Moe", **MOE)
    cfg = config_from_hf(d)
    more = ModelConfig(**{**cfg.__dict__, "num_experts": 60, "hf_config": None})
    busier = ModelConfig(**{**cfg.__dict__, "num_experts_per_tok": 4, "hf_config": None})
    b = DTYPE_BYTES["bfloat16"]
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    m, m_more = (train_memory(c, 4096, dtype="bfloat16") for c in (cfg, more))
    assert m["params"] == cfg.num_params() * b and m["optimizer"] == 2 * cfg.num_params() * b
    assert m_more["params"] - m["params"] == cfg.num_layers * 54 * (H + 3 * H * I) * b
    assert layer_activation_bytes(more, 0, b) - layer_activation_bytes(cfg, 0, b) == 4 * 54
    assert layer_activation_bytes(busier, 0, b) - layer_activation_bytes(cfg, 0, b) == 2 * (2 * H + 4 * I) * b
    dense = ModelConfig(**{**cfg.__dict__, "num_experts": 0, "hf_config": None})
    assert layer_activation_bytes(dense, 0, b) - layer_activation_bytes(cfg, 0, b) == \
        4 * cfg.intermediate_size * b - 2 * (2 * H + 4 * I) * b - 4 * 6
    # Interleaved pipeline chunks hold the dense layer 1 on rank 1: its activations are the smaller ones.
    mixed = config_from_hf({**d, "mlp_only_layers": [1, 3]})
    acts = activation_bytes_per_token(mixed, b, False)["layers"]
    assert acts[0] == acts[2] != acts[1] == acts[3]
    s0, s1 = (stage_memory(mixed, 512, r, par=Parallel(pp=2, vpp=2), micro_batches=4) for r in range(2))
    assert s0["activations"] > 0 and s1["activations"] > 0


def test_preset_model_entries():
    """Qwen3-8B (dense, q/k norms, untied) and Qwen3-30B-A3B (128 experts, 8 active) as the releases' config.json
    give them: 8.19B and 30.53B parameters."""
    dense = read_hf_config(os.path.join(PRESETS, "models", "qwen3-8b"))
    assert (dense.model_type, dense.qk_norm, dense.tie_word_embeddings, dense.head_dim) == ("qwen3", True, False, 128)
    assert dense.num_params() == 8_190_735_360
    moe = read_hf_config(os.path.join(PRESETS, "models", "qwen3-30b-a3b"))
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.norm_topk_prob) == \
        (128, 8, 768, True)
    assert moe.num_params() == 30_532_122_624
    # Active per token: attention, norms, the router and 8 experts per layer, the embeddings: Qwen3's "3.3B".
    active = moe.num_params() - moe.num_layers * (128 - 8) * 3 * 2048 * 768
    assert 3.3e9 <= active < 3.4e9, active  # 3.35B: the model card rounds it down


def test_tune_plans_qwen3_moe_and_refuses_what_does_not_fit(tmp_path):
    """dapo-tune reads the Qwen3-MoE config (experts said in the reason); 30.53B parameters
    with the sampler replica do not fit 8 x 80 GB; a 4-layer tiny MoE plans on the CPU."""
    with pytest.raises(ValueError, match=r"30\.53B parameters need 85\.3 GiB per device"):
        tune.tune("math", "8xH100", os.path.join(PRESETS, "models", "qwen3-30b-a3b"))
    _, d = _hf("Qwen3Moe", **MOE)
    (tmp_path / "config.json").write_text(json.dumps(d))
    v = {k: (x, why) for k, x, why in tune.tune("math", "cpu", str(tmp_path))}
    assert "6 experts, 2 active per token" in v["trainer.device"][1]
    v = {k: x for k, x, _ in tune.tune("math", "8xH100", os.path.join(PRESETS, "models", "qwen3-8b"))}
    assert v["actor_rollout_ref.actor.strategy"] == "fsdp2"

