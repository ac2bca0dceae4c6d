"""Qwen3, Mistral and Gemma 3 (text) through load_hf_model / save_hf_model: parity with transformers.

The same checks as the Llama / Qwen2 parity tests of test_model.py (logits within 1e-5 relative in float32,
parameter gradients against float64, save -> from_pretrained), on tiny random models built with transformers
(nothing downloaded) whose family features all act: per-head q/k norms, head_dim != hidden / heads, tied
embeddings, a sliding window shorter than the packed sequences, Gemma's (1 + w) norms, embedding scale,
query_pre_attn_scalar, GELU-tanh, sandwich norms, interleaved sliding / full layers with their own ropes.
"""
from __future__ import annotations

import pytest
import torch

from dapo_trainer import config_from_hf, config_to_hf, read_hf_config
from tests.trainer.test_model import check_gradients, check_logits_and_save, make_hf_model

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
    assert cfg.model_type == hf.config.model_type and cfg.head_dim == hf.config.head_dim
