"""Hugging Face checkpoints: ``config.json`` + ``*.safetensors`` in, the same format out.

Reads the two ``config.json`` dialects found in the wild: the classic ``rope_theta`` +
``rope_scaling`` (Qwen2.5, Llama 3.x releases) and transformers 5's ``rope_parameters``.
Writes a single ``model.safetensors`` or, above ``max_shard_size``, numbered shards plus
``model.safetensors.index.json`` - the layout transformers and vLLM load.

Qwen3-MoE's experts: the model holds them stacked (``mlp.experts.gate_up_proj [E, 2I, H]``,
``mlp.experts.down_proj [E, H, I]``: transformers 5's in-memory names), checkpoints per expert
(``mlp.experts.{e}.gate_proj / up_proj / down_proj.weight``: the releases', transformers' save and
vLLM's load). Loading reads either; saving and :func:`hf_tensors` write per expert.
"""
from __future__ import annotations

import copy
import json
import os
import re
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from .families import ARCHITECTURES, family_fields, family_to_hf, hidden_act, supported_act
from .model import FULL, ROPE_TYPES, SLIDING, ModelConfig, Transformer
from .readers import read_json

SUPPORTED_MODEL_TYPES = ARCHITECTURES
CONFIG_NAME = "config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"
# Buffers some older checkpoints saved alongside the weights; recomputed, never loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# Sizes that may be absent from config.json (defaults below) but, when given, are ints >= 1.
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")


# --------------------------------------------------------------------------- config
def _rope_from_hf(cfg: dict, source: str = "config.json", local: bool = False) -> tuple:
    """(rope_theta, rope_scaling or None, local rope_theta or None) from either config dialect;
    ``local``: the family gives its sliding layers an unscaled rope of their own (Gemma 3)."""
    params = cfg.get("rope_parameters")
    local_theta = cfg.get("rope_local_base_freq", 10000.0) if local else None
    if isinstance(params, dict) and params:
        if "rope_theta" not in params and all(isinstance(v, dict) for v in params.values()):
            if local and {SLIDING, FULL} <= set(params):
                sliding = params[SLIDING]
                if sliding.get("rope_type", sliding.get("type", "default")) != "default":
                    raise ValueError(f"{source}: the sliding layers' rope must be 'default', got {sliding}")
                local_theta = sliding.get("rope_theta", local_theta)
                params = {FULL: params[FULL]}
            # Per-layer-type rope (transformers 5); the families here use one for all (global) layers.
            distinct = {json.dumps(v, sort_keys=True) for v in params.values()}
            if len(distinct) != 1:
                raise ValueError(f"{source}: rope_parameters differ between layer types {sorted(params)}; "
                                 "only one rope for all layers is supported")
            params = next(iter(params.values()))
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
        scaling.setdefault("rope_type", params.get("type", "default"))
    else:
        theta = cfg.get("rope_theta", 10000.0)
        raw = cfg.get("rope_scaling") or {}
        scaling = dict(raw)
        if raw:
            # Older releases spell the key "type".
            scaling["rope_type"] = scaling.pop("type", None) or scaling.get("rope_type", "default")
        else:
            scaling = {"rope_type": "default"}
    kind = scaling["rope_type"]
    if kind not in ROPE_TYPES:
        raise ValueError(f"{source}: rope type {kind!r} is not supported (supported: {ROPE_TYPES})")
    need = {"linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    missing = [k for k in need.get(kind, ()) if k not in scaling]
    if missing:
        raise ValueError(f"{source}: rope type {kind!r} needs {missing} in its rope parameters")
    return float(theta), (None if kind == "default" else scaling), None if local_theta is None else float(local_theta)


def config_from_hf(cfg: dict, source: str = "config.json") -> ModelConfig:
    """:class:`ModelConfig` from a parsed ``config.json`` dict (a family of :data:`SUPPORTED_MODEL_TYPES`).

    Raises ValueError naming ``source`` (the file) and the architecture or field that is unsupported,
    missing or of the wrong type (sizes must be ints >= 1).
    """
    if not isinstance(cfg, dict):
        raise TypeError(f"cfg must be a dict (parsed config.json), got {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{source}: model_type {model_type!r} (architectures {archs}) is not supported; "
                         f"supported: {sorted(SUPPORTED_MODEL_TYPES)}")
    unsupported = [a for a in archs if a != SUPPORTED_MODEL_TYPES[model_type]]
    if unsupported:
        raise ValueError(f"{source}: architectures {unsupported} are not supported; "
                         f"expected {SUPPORTED_MODEL_TYPES[model_type]!r} for model_type {model_type!r}")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if cfg.get(k) is None]
    if missing:
        raise ValueError(f"{source}: missing required field(s) {missing}")
    for k in required + _OPTIONAL_SIZES:
        v = cfg.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{source}: {k} must be an int >= 1, got {type(v).__name__} {v!r}")
    act = hidden_act(model_type, cfg)
    if act != supported_act(model_type):
        raise ValueError(f"{source}: hidden_act {act!r} is not supported ({model_type} needs "
                         f"{supported_act(model_type)!r})")
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    # Without head_dim, HF's models split hidden_size evenly over the heads: a remainder is no model.
    if (not cfg.get("head_dim") and isinstance(hidden, int) and isinstance(heads, int) and heads > 0
            and hidden % heads):
        raise ValueError(f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                         f"(and no head_dim is given), so the heads cannot split it")
    fields = family_fields(model_type, cfg, source)
    theta, scaling, local_theta = _rope_from_hf(cfg, source, local=model_type == "gemma3_text")
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=local_theta,
        hidden_act=act,
        pad_token_id=pad if isinstance(pad := cfg.get("pad_token_id"), int) and 0 <= pad < cfg["vocab_size"] else None,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        model_type=model_type,
        hf_config=copy.deepcopy(cfg),
        **fields,
    )


def config_to_hf(cfg: ModelConfig, dtype: Optional[torch.dtype] = None) -> dict:
    """``config.json`` dict in the classic dialect (what vLLM and every transformers read).

    Starts from the checkpoint's own config when the model was loaded from one.
    """
    out = copy.deepcopy(cfg.hf_config) if cfg.hf_config else {}
    out.pop("rope_parameters", None)
    out.update(
        architectures=[SUPPORTED_MODEL_TYPES[cfg.model_type]],
        model_type=cfg.model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act=cfg.hidden_act,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        rope_scaling=copy.deepcopy(cfg.rope_scaling),
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings,
    )
    if cfg.pad_token_id is not None:
        out["pad_token_id"] = cfg.pad_token_id
    out.update(family_to_hf(cfg))
    if dtype is not None:
        # transformers < 5 reads "torch_dtype", 5.x "dtype"; keep both in step.
        out["torch_dtype"] = str(dtype).replace("torch.", "")
        if "dtype" in out:
            out["dtype"] = out["torch_dtype"]
    return out


def read_hf_config(path: str) -> ModelConfig:
    """:class:`ModelConfig` of the checkpoint directory ``path``."""
    file = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(file):
        raise ValueError(f"{path!r} has no {CONFIG_NAME}")
    cfg = read_json(file)
    if not isinstance(cfg, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(cfg).__name__}")
    return config_from_hf(cfg, file)


# --------------------------------------------------------------------------- weights
def hf_name(name: str) -> str:
    """Our parameter name -> the checkpoint's (everything but lm_head sits under ``model.``)."""
    return name if name.startswith("lm_head.") else "model." + name


def _our_name(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


# A checkpoint's per-expert weight (our name): layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight.
_EXPERT_PIECE = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}


def hf_tensors(name: str, t: torch.Tensor) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(checkpoint name, tensor)`` of our parameter ``name``: itself under its HF name, or a stacked
    experts' weight split per expert (``gate_up_proj [E, 2I, H]``: gate rows first)."""
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith(".mlp.experts") or leaf not in ("gate_up_proj", "down_proj"):
        yield hf_name(name), t
        return
    half = t.shape[1] // 2
    for e in range(t.shape[0]):
        if leaf == "down_proj":
            yield hf_name(f"{prefix}.{e}.down_proj.weight"), t[e]
        else:
            yield hf_name(f"{prefix}.{e}.gate_proj.weight"), t[e, :half]
            yield hf_name(f"{prefix}.{e}.up_proj.weight"), t[e, half:]


def _stack_experts(pieces: Dict[str, Dict[Tuple[int, str], object]], expected: dict, wanted: set,
                   state: Dict[str, torch.Tensor], seen: Dict[str, tuple], unexpected: List[str]) -> List[str]:
    """Per-expert checkpoint weights (``pieces[stacked name][(expert, part)]``: a tensor if wanted,
    else its shape) into the stacked parameters, in ``state`` / ``seen``; returns the missing pieces'
    names and adds pieces of experts beyond ``num_experts`` to ``unexpected``."""
    missing = []
    for name, got in pieces.items():
        if name not in expected:
            unexpected.extend(hf_name(f"{name.rpartition('.')[0]}.{e}.{part}.weight") for e, part in got)
            continue
        E = expected[name].shape[0]
        parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
        unexpected.extend(hf_name(f"{name.rpartition('.')[0]}.{e}.{part}.weight") for e, part in got if e >= E)
        absent = [(e, part) for e in range(E) for part in parts if (e, part) not in got]
        missing.extend(hf_name(f"{name.rpartition('.')[0]}.{e}.{part}.weight") for e, part in absent)
        if absent:
            continue
        rows = [got[(e, part)] for e in range(E) for part in parts]
        shapes = {tuple(r.shape) if isinstance(r, torch.Tensor) else r for r in rows}
        if len(shapes) != 1:
            raise ValueError(f"checkpoint experts of {hf_name(name)} differ in shape: {sorted(shapes)}")
        (shape,) = shapes
        seen[name] = (E, len(parts) * shape[0], *shape[1:])
        if name in wanted:
            state[name] = torch.stack([torch.cat([got[(e, p)] for p in parts]) for e in range(E)])
    return missing


def _weight_files(path: str) -> list:
    index = os.path.join(path, SAFE_INDEX_NAME)
    if os.path.isfile(index):
        weight_map = read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: expected a 'weight_map' object of weight name -> file name")
        return sorted(set(weight_map.values()))
    if os.path.isfile(os.path.join(path, SAFE_WEIGHTS_NAME)):
        return [SAFE_WEIGHTS_NAME]
    raise ValueError(f"{path!r} has neither {SAFE_WEIGHTS_NAME} nor {SAFE_INDEX_NAME}")


def _safetensor_error() -> type:
    """safetensors' error type (exported by recent versions; ``Exception`` otherwise)."""
    import safetensors

    return getattr(safetensors, "SafetensorError", Exception)


def load_hf_model(path: str, dtype: torch.dtype = torch.float32, device="cpu",
                  keep: Optional[Callable[[ModelConfig, str], bool]] = None) -> Transformer:
    """Build the model described by ``path/config.json`` and load its safetensors weights.

    Args:
        path: local checkpoint directory (single file or sharded with an index).
        dtype: parameter dtype (the checkpoint's tensors are cast).
        device: where the parameters are created.
        keep: ``keep(config, name)`` is True for the parameters (our names, a tied weight as
            ``embed_tokens.weight``) to read; the others are never read and stay on the meta
            device, for a caller that drops them (None: all).
    Raises:
        ValueError naming unsupported config fields, missing weight names, unexpected
        weight names, or shape mismatches.
    """
    from safetensors import safe_open

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    cfg = read_hf_config(path)
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {name: p for name, p in model.named_parameters()}  # tied weights appear once
    wanted = {name for name in expected if keep is None or keep(cfg, name)}
    state: Dict[str, torch.Tensor] = {}
    seen: Dict[str, tuple] = {}  # name -> shape (from the header for the weights not read)
    unexpected = []
    pieces: Dict[str, Dict[Tuple[int, str], object]] = {}  # stacked experts' name -> per-expert weights
    for file in _weight_files(path):
        full = os.path.join(path, file)
        try:
            with safe_open(full, framework="pt", device="cpu") as f:
                for key in f.keys():
                    name = _our_name(key)
                    if key.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                        continue
                    piece = _EXPERT_PIECE.match(name)
                    if piece:
                        stacked = f"{piece[1]}.{_STACKED[piece[3]]}"
                        pieces.setdefault(stacked, {})[(int(piece[2]), piece[3])] = (
                            f.get_tensor(key).to(device=device, dtype=dtype) if stacked in wanted
                            else tuple(f.get_slice(key).get_shape()))
                        continue
                    if name not in expected:
                        unexpected.append(key)
                        continue
                    if name in wanted:
                        state[name] = f.get_tensor(key).to(device=device, dtype=dtype)
                        seen[name] = tuple(state[name].shape)
                    else:  # no bytes read: the parameter stays on meta
                        seen[name] = tuple(f.get_slice(key).get_shape())
        except (OSError, _safetensor_error()) as e:
            raise ValueError(f"{full}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    missing = _stack_experts(pieces, expected, wanted, state, seen, unexpected)
    missing += [hf_name(n) for n in expected if n not in seen and n not in pieces]
    if missing:
        raise ValueError(f"checkpoint {path!r} is missing {len(missing)} weight(s): {missing[:8]}"
                         + (" ..." if len(missing) > 8 else ""))
    if unexpected:
        raise ValueError(f"checkpoint {path!r} has {len(unexpected)} weight(s) this model does not use: "
                         f"{unexpected[:8]}" + (" ..." if len(unexpected) > 8 else ""))
    for name, shape in seen.items():
        if shape != tuple(expected[name].shape):
            raise ValueError(f"checkpoint weight {hf_name(name)} has shape {list(shape)}, "
                             f"config.json implies {list(expected[name].shape)}")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # assign=True replaced the shared Parameter
    return model


def _chunks(items: Iterable, max_bytes: Optional[int]):
    shard, size = [], 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if shard and max_bytes is not None and size + nbytes > max_bytes:
            yield shard
            shard, size = [], 0
        shard.append((name, t))
        size += nbytes
    if shard:
        yield shard


def write_hf_config(cfg, dtype: Optional[torch.dtype], path: str) -> None:
    """``path/config.json`` (created) of a model config: what transformers / vLLM read."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(config_to_hf(cfg, dtype), f, indent=2, sort_keys=True)


def save_hf_model(model: Transformer, path: str, *, max_shard_size: Optional[int] = 5 * 2**30,
                  state_dict: Optional[Dict[str, torch.Tensor]] = None) -> None:
    """Write ``config.json`` + safetensors weights that transformers / vLLM load.

    Args:
        model: an unsharded :class:`Transformer` (for a parallel one, pass the full
            ``state_dict`` from :func:`dapo_trainer.parallel.full_state_dict`).
        path: output directory (created).
        max_shard_size: bytes per file; larger models get numbered shards and an index.
        state_dict: full (unsharded) parameters by our names; default ``model.state_dict()``.
    """
    from safetensors.torch import save_file

    if not isinstance(model, Transformer):
        raise TypeError(f"model must be a dapo_trainer Transformer, got {type(model).__name__}")
    cfg = model.config
    sd = model.state_dict() if state_dict is None else state_dict
    tensors = []
    for name, t in sd.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        # safetensors refuses views that share storage; the checkpoint wants plain copies.
        tensors.extend((key, piece.detach().to("cpu").contiguous().clone()) for key, piece in hf_tensors(name, t))
    write_hf_config(cfg, tensors[0][1].dtype if tensors else None, path)
    shards = list(_chunks(tensors, max_shard_size))
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(dict(shards[0]), os.path.join(path, SAFE_WEIGHTS_NAME), metadata=meta)
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(dict(shard), os.path.join(path, file), metadata=meta)
        for name, t in shard:
            weight_map[name] = file
            total += t.numel() * t.element_size()
    with open(os.path.join(path, SAFE_INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
