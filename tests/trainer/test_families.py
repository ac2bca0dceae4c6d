"""Qwen3, Qwen3-MoE, Qwen2-MoE, Mistral and Gemma 3 (text) through load_hf_model / save_hf_model: parity with
transformers.

The same checks as the Llama / Qwen2 parity tests of test_model.py (logits within 1e-5 relative in float32,
parameter gradients against float64, save -> from_pretrained), on tiny random models built with transformers
(nothing downloaded) whose family features all act: per-head q/k norms, head_dim != hidden / heads, tied
embeddings, a sliding window shorter than the packed sequences, Gemma's (1 + w) norms, embedding scale,
query_pre_attn_scalar, GELU-tanh, sandwich norms, interleaved sliding / full layers with their own ropes,
Qwen3-MoE's sparse layers (decoder_sparse_step / mlp_only_layers leaving dense ones between them,
norm_topk_prob both ways, experts saved per expert as transformers saves them).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from dapo_trainer import config_from_hf, config_to_hf, read_hf_config
from dapo_trainer.config import load_config
from dapo_trainer.model import FULL, SLIDING
from dapo_trainer.trainer import DAPOTrainer
from tests.trainer.test_model import check_gradients, check_logits_and_save, make_hf_model
from tests.trainer.tiny import micro_setup, write_tiny_model

WINDOW = 5  # shorter than the 12- and 19-token sequences of the parity batches
# Gradient batches: sequences longer than the window, each within WINDOW - 1 of the longest (transformers pads
# them; a padding query whose window holds padding only gives NaN in its float64 eager reference).
GRAD_LENGTHS = (11, 14, 10)

FAMILIES = {
    # name: (transformers config class prefix, config kwargs)
    "qwen3-tied-hd24": ("Qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                      tie_word_embeddings=True)),
    "qwen3-bias": ("Qwen3", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16, attention_bias=True)),
    "mistral-window": ("Mistral", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW)),
    "mistral-no-window": ("Mistral", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                          sliding_window=None)),
    "gemma3": ("Gemma3Text", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})),
    # Sparse layers 0, 2, 3 (layer 1 in mlp_only_layers), the chosen probabilities renormalised.
    "qwen3-moe-norm": ("Qwen3Moe", dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                        norm_topk_prob=True, mlp_only_layers=[1])),
    # Qwen2-MoE: q/k/v bias, no q/k norm, a gated shared expert beside the routed ones; layer 0 dense.
    "qwen2-moe-shared": ("Qwen2Moe", dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                          num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=48, mlp_only_layers=[0])),
    # Sparse layers 1, 3 (decoder_sparse_step 2), raw probabilities as weights, tied embeddings.
    "qwen3-moe-step2-tied": ("Qwen3Moe", dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
                                              head_dim=16, num_experts=8, num_experts_per_tok=2,
                                              moe_intermediate_size=24, norm_topk_prob=False, decoder_sparse_step=2,
                                              tie_word_embeddings=True)),
}

# The same families as ModelConfig switches, for trainer runs on write_tiny_model's checkpoints.
TRAINER_FAMILIES = {
    "qwen3": dict(model_type="qwen3", qk_norm=True, tie_word_embeddings=True),
    "gemma3": dict(model_type="gemma3_text", qk_norm=True, norm_unit_offset=True, hidden_act="gelu_pytorch_tanh",
                   embed_scale=True, sandwich_norms=True, query_pre_attn_scalar=24, sliding_window=4,
                   layer_types=(SLIDING, FULL), rope_local_theta=1e4, tie_word_embeddings=True),
    "qwen3-moe": dict(model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, norm_topk_prob=True),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def hf_checkpoint(request, tmp_path_factory):
    """(family, transformers model, checkpoint dir written by save_pretrained)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(*FAMILIES[request.param])
    hf.save_pretrained(str(path))
    return request.param, hf, str(path)


def test_logits_match_transformers_and_survive_save(hf_checkpoint, tmp_path):
    torch.manual_seed(1)
    check_logits_and_save(*hf_checkpoint, tmp_path)


def test_gradients_match_transformers(hf_checkpoint):
    torch.manual_seed(2)
    check_gradients(*hf_checkpoint, lengths=GRAD_LENGTHS)


def test_config_round_trips(hf_checkpoint):
    """config.json -> ModelConfig -> config.json (classic dialect) -> the same ModelConfig, family fields kept."""
    _, hf, path = hf_checkpoint
    cfg = read_hf_config(path)
    assert config_from_hf(config_to_hf(cfg)) == cfg
    head_dim = getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads
    assert cfg.model_type == hf.config.model_type and cfg.head_dim == head_dim  # Qwen2-MoE: no head_dim key


def test_gemma3_release_dialect_reads_alike(tmp_path):
    """Released Gemma 3 configs spell the ropes rope_theta / rope_scaling / rope_local_base_freq and the
    layer pattern sliding_window_pattern (every n-th layer full); both dialects give one ModelConfig."""
    path = str(tmp_path)
    make_hf_model(*FAMILIES["gemma3"]).config.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        v5 = json.load(f)
    ropes = v5["rope_parameters"]
    full = {k: v for k, v in ropes["full_attention"].items() if k != "rope_theta"}
    classic = {k: v for k, v in v5.items() if k not in ("rope_parameters", "layer_types")}
    classic.update(rope_theta=ropes["full_attention"]["rope_theta"], rope_scaling=full, sliding_window_pattern=2,
                   rope_local_base_freq=ropes["sliding_attention"]["rope_theta"])
    assert config_from_hf(classic) == read_hf_config(path)


@pytest.mark.parametrize("model_type, changes, message", [
    ("qwen3", dict(use_sliding_window=True), "use_sliding_window"),
    ("mistral", dict(sliding_window=0), "sliding_window must be an int >= 1"),
    ("gemma3_text", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    ("gemma3_text", dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
    ("gemma3_text", dict(hidden_activation="silu"), "hidden_act 'silu'"),
    ("gemma3_text", dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                                          "full_attention": {"rope_type": "default"}}), "sliding layers' rope"),
], ids=["qwen3-window", "mistral-window-0", "gemma-attn-softcap", "gemma-final-softcap", "gemma-act",
        "gemma-local-rope-scaled"])
def test_unsupported_family_config_is_named(model_type, changes, message):
    """What a family's model cannot compute is refused at load, naming the field."""
    base = dict(model_type=model_type, vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, head_dim=8)
    with pytest.raises(ValueError, match=message):
        config_from_hf({**base, **changes})


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "qwen3-moe"])
def test_on_policy_trainer_step(tmp_path, family):
    """A DAPO step on a tiny Qwen3 / Gemma 3 / Qwen3-MoE checkpoint: the sampler's log-probs are the trainer's
    (one mini-batch, one epoch: nothing clips, ppo_kl ~ 0) and the checkpoint it saves reloads; an MoE
    model logs its routers' load."""
    overrides = micro_setup(str(tmp_path)) + ["trainer.total_training_steps=1", "trainer.val_before_train=false",
                                              "data.val_files=[]", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                              "trainer.save_freq=1"]
    write_tiny_model(os.path.join(tmp_path, "model"), layers=2, **TRAINER_FAMILIES[family])
    m = DAPOTrainer(load_config(overrides=overrides)).fit()
    assert m["actor/pg_clipfrac"] == 0.0 and abs(m["actor/ppo_kl"]) < 1e-5
    if family == "qwen3-moe":  # 2 sparse layers x 4 experts, top-2: the aux loss is 2 (k) when balanced, <= E
        assert 0.0 < m["actor/moe_aux_loss"] <= 4.0 and m["actor/moe_load_max"] >= 1.0 >= m["actor/moe_load_min"]
        assert 0.0 <= m["actor/moe_idle_experts"] < 1.0
    else:
        assert not [k for k in m if k.startswith("actor/moe_")]
    saved = read_hf_config(os.path.join(tmp_path, "run", "checkpoints", "global_step_1", "model"))
    assert saved == read_hf_config(os.path.join(tmp_path, "model"))


def test_supported_list_names_the_families():
    """The error for an unknown model_type lists every family."""
    with pytest.raises(ValueError, match=r"supported: \['gemma3_text', 'llama', 'mistral', 'qwen2', 'qwen2_moe', "
                                         r"'qwen3', 'qwen3_moe'\]"):
        config_from_hf(dict(model_type="mixtral", vocab_size=32, hidden_size=16, intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=2))
