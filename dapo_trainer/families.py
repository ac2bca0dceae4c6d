"""The model families' ``config.json`` dialects: which :class:`~dapo_trainer.model.ModelConfig`
switches each ``model_type`` sets, and the family fields written back on save.

Read by :mod:`dapo_trainer.hf_io`; everything shared by all families (sizes, rope, eps, tying)
is read there.
"""
from __future__ import annotations

from typing import Optional

from .model import SLIDING, ModelConfig

# model_type -> the transformers causal-LM class its checkpoints name.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "mistral": "MistralForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
# The MLP activation each family accepts ("hidden_activation" is Gemma's key).
_ACTIVATION = {"gemma3_text": "gelu_pytorch_tanh"}


def hidden_act(model_type: str, cfg: dict) -> str:
    """The MLP gate's activation named by ``cfg`` (Gemma: ``hidden_activation``)."""
    if model_type == "gemma3_text":
        return cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    return cfg.get("hidden_act", "silu")


def supported_act(model_type: str) -> str:
    return _ACTIVATION.get(model_type, "silu")


def _positive(cfg: dict, key: str, source: str) -> Optional[float]:
    v = cfg.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
        raise ValueError(f"{source}: {key} must be a positive number or null, got {v!r}")
    return v


def family_fields(model_type: str, cfg: dict, source: str) -> dict:
    """The family switches of :class:`ModelConfig` for a parsed ``config.json`` of ``model_type``."""
    if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe") and cfg.get("use_sliding_window"):
        raise ValueError(f"{source}: use_sliding_window=true is not supported (full attention only)")
    if model_type == "qwen2":
        return dict(qkv_bias=True)
    if model_type == "qwen2_moe":  # Qwen2's attention (its own qkv_bias key), experts plus a gated shared expert
        shared = cfg.get("shared_expert_intermediate_size")
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 1:
            raise ValueError(f"{source}: shared_expert_intermediate_size must be an int >= 1, got {shared!r}")
        return dict(qkv_bias=bool(cfg.get("qkv_bias", True)), shared_expert_intermediate_size=shared,
                    **moe_fields(cfg, source))
    bias = bool(cfg.get("attention_bias", False))
    if model_type == "llama":
        return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))
    if model_type == "qwen3":
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=True)
    if model_type == "qwen3_moe":
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, **moe_fields(cfg, source))
    window = cfg.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{source}: sliding_window must be an int >= 1 or null, got {window!r}")
    if model_type == "mistral":
        return dict(sliding_window=window)
    # gemma3_text
    if cfg.get("final_logit_softcapping") is not None:
        raise ValueError(f"{source}: final_logit_softcapping is not supported (the fused log-probs take raw logits)")
    if cfg.get("attn_logit_softcapping") is not None:
        # transformers' Gemma 3 keeps the field but never applies it (Gemma 3 replaced it by q/k norm).
        raise ValueError(f"{source}: attn_logit_softcapping is not supported for gemma3_text (transformers ignores it)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention=true is not supported (causal decoder only)")
    types = cfg.get("layer_types")
    if types is None:  # older releases: every sliding_window_pattern-th layer is global
        pattern = cfg.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(cfg["num_hidden_layers"])]
    return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, norm_unit_offset=True, embed_scale=True,
                sandwich_norms=True, query_pre_attn_scalar=_positive(cfg, "query_pre_attn_scalar", source) or 256,
                sliding_window=window, layer_types=tuple(types))


def moe_fields(cfg: dict, source: str) -> dict:
    """The mixture-of-experts switches of a Qwen3-MoE ``config.json`` (ValueError naming a bad one)."""
    out = {}
    # Released checkpoints say num_experts; transformers >= 5 writes it as num_local_experts.
    cfg = {"num_experts": cfg.get("num_local_experts"), **{k: v for k, v in cfg.items() if v is not None}}
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
        v = cfg.get(key, 1 if key == "decoder_sparse_step" else None)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{source}: {key} must be an int >= 1, got {v!r}")
        out[key] = v
    if out["num_experts_per_tok"] > out["num_experts"]:
        raise ValueError(f"{source}: num_experts_per_tok ({out['num_experts_per_tok']}) must be <= num_experts "
                         f"({out['num_experts']})")
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ValueError(f"{source}: mlp_only_layers must be a list of layer indices, got {only!r}")
    return dict(out, norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), mlp_only_layers=tuple(only))


def family_to_hf(cfg: ModelConfig) -> dict:
    """The family fields of ``config.json`` for ``cfg`` (written over the checkpoint's own)."""
    if cfg.model_type == "llama":
        if cfg.qkv_bias != cfg.o_bias:
            raise ValueError("a llama config has one attention_bias for q/k/v and o; got different flags")
        return dict(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    if cfg.model_type == "qwen3":
        return dict(attention_bias=cfg.qkv_bias, use_sliding_window=False)
    moe = dict(use_sliding_window=False, num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
               moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
               decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers))
    if cfg.model_type == "qwen3_moe":
        return dict(attention_bias=cfg.qkv_bias, **moe)
    if cfg.model_type == "qwen2_moe":
        return dict(qkv_bias=cfg.qkv_bias, shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, **moe)
    if cfg.model_type == "mistral":
        return dict(sliding_window=cfg.sliding_window)
    if cfg.model_type == "gemma3_text":
        return dict(attention_bias=cfg.qkv_bias, hidden_activation=cfg.hidden_act,
                    query_pre_attn_scalar=cfg.query_pre_attn_scalar,
                    attn_logit_softcapping=None, final_logit_softcapping=None,
                    sliding_window=cfg.sliding_window, layer_types=list(cfg.layer_types or [SLIDING] * cfg.num_layers),
                    rope_local_base_freq=cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta)
    return {}
