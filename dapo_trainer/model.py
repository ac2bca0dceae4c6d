"""Decoder-only transformer of the Llama / Qwen2 / Qwen3 / Qwen3-MoE / Qwen2-MoE / Mistral / Gemma 3 families on
packed sequences.

One plain model file in the spirit of gpt-fast: parameter names follow Hugging Face
(``embed_tokens``, ``layers.{i}.self_attn.q_proj``, ...) so checkpoints map one to one
(:mod:`dapo_trainer.hf_io`). The model knows no parallelism: :mod:`dapo_trainer.parallel` applies
tensor / sequence / data / pipeline parallelism to a built model by replacing modules
(``q_proj``, ``lm_head``, ``self_attn.inner_attention``, ...), registering hooks, or pruning it to
a pipeline stage (``layers`` is a ModuleDict keyed by the global layer index, and a model without
``embed_tokens`` / ``norm`` takes / returns hidden states).

Every activation is packed: ``T`` tokens of ``B`` sequences laid end to end, described
by ``cu_seqlens [B+1]`` int32 (flash-attn's varlen convention). Nothing is padded, so
no FLOP is spent on padding tokens.

A group's responses share their prompt: with a :class:`PromptSharing` the model computes each shared
prompt once (every projection, norm and MLP on the distinct tokens only) and attends each sequence over
its own copy of the prompt's keys and values, the same math as the sequences packed apart.

Qwen3-MoE's sparse layers (:class:`SparseMoeBlock`) run ``dapo_kernels``' MoE op (``dk.moe_route``,
``dk.moe_experts``: routing, expert-contiguous permutation and grouped GEMMs on the device); their
routing is observable (:meth:`Transformer.trace_routing`: :class:`RouterTrace` records, for the aux
loss and the load metrics) and replayable (:meth:`Transformer.replay_routing`: router replay).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from contextlib import contextmanager
from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import dapo_kernels as dk
from dapo_kernels.validation import FLOAT_DTYPES, INT_DTYPES, check_cu_seqlens, check_int, check_tensor

from .offload import offload_scope

ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
SLIDING, FULL = "sliding_attention", "full_attention"


def _npu():  # Ascend fused kernels (None outside their limits); imported only for NPU tensors
    from . import npu_model_ops
    return npu_model_ops


@dataclass
class ModelConfig:
    """Shape and numerics of a Llama / Qwen2 / Qwen3 / Mistral / Gemma 3 decoder (what ``config.json`` says).

    ``rope_scaling`` is None or a dict with ``rope_type`` in :data:`ROPE_TYPES`
    ("linear": ``factor``; "llama3": ``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``).
    Family switches: ``qk_norm`` (Qwen3, Gemma 3: RMSNorm over ``head_dim`` of q and k before RoPE),
    ``norm_unit_offset`` (Gemma: RMSNorm scales by ``1 + weight``), ``hidden_act`` (the MLP gate's
    activation, :data:`ACTIVATIONS`), ``embed_scale`` (Gemma: embeddings times ``sqrt(hidden_size)``),
    ``sandwich_norms`` (Gemma: attention and MLP outputs normalised too, MLP input by its own norm),
    ``query_pre_attn_scalar`` (softmax scale ``scalar ** -0.5``; None: ``head_dim``),
    ``attn_logit_softcapping`` (scores ``c * tanh(s / c)``), ``sliding_window`` (a query sees the last
    ``sliding_window`` positions, itself included; None: all) on the layers ``layer_types`` marks
    ``"sliding_attention"`` (None: all layers), whose RoPE base is ``rope_local_theta`` (unscaled;
    None: the global rope). The embedding row ``pad_token_id`` gets no gradient (transformers' ``padding_idx``).
    Mixture of experts (Qwen3-MoE; ``num_experts > 0``, :class:`SparseMoeBlock`): layer ``i`` is sparse
    (:meth:`is_moe`) unless listed in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``: a router
    ``[num_experts, H]`` picks ``num_experts_per_tok`` experts per token, each a gated MLP of
    ``moe_intermediate_size`` units (``norm_topk_prob``: the picked weights renormalised to sum 1);
    Qwen2-MoE adds to every sparse layer a shared expert of ``shared_expert_intermediate_size`` units
    (0: none) whose output is scaled by ``sigmoid(shared_expert_gate(x))``.
    ``hf_config`` keeps the checkpoint's own ``config.json`` so that saving writes back
    every field we do not model (token ids, generation settings, ...).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    qk_norm: bool = False
    norm_unit_offset: bool = False
    hidden_act: str = "silu"
    embed_scale: bool = False
    sandwich_norms: bool = False
    query_pre_attn_scalar: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
    sliding_window: Optional[int] = None
    layer_types: Optional[Tuple[str, ...]] = None
    rope_local_theta: Optional[float] = None
    pad_token_id: Optional[int] = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: Tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    model_type: str = "llama"
    hf_config: Optional[dict] = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            check_int(name, getattr(self, name), minimum=1)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type must be one of {ROPE_TYPES}, got {rope_type!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {sorted(ACTIVATIONS)}, got {self.hidden_act!r}")
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window, minimum=1)
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {SLIDING, FULL}:
                raise ValueError(f"layer_types must name {SLIDING!r} or {FULL!r} for each of the "
                                 f"{self.num_layers} layers, got {list(self.layer_types)}")
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        if self.num_experts:
            check_int("num_experts", self.num_experts, minimum=1)
            check_int("num_experts_per_tok", self.num_experts_per_tok, minimum=1)
            check_int("moe_intermediate_size", self.moe_intermediate_size, minimum=1)
            check_int("decoder_sparse_step", self.decoder_sparse_step, minimum=1)
            check_int("shared_expert_intermediate_size", self.shared_expert_intermediate_size, minimum=0)
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= num_experts "
                                 f"({self.num_experts})")

    def is_sliding(self, layer: int) -> bool:
        """Whether layer ``layer`` attends within ``sliding_window``."""
        return self.sliding_window is not None and (self.layer_types is None or self.layer_types[layer] == SLIDING)

    def local_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` (of type sliding, window or not) rotates with ``rope_local_theta``."""
        return self.rope_local_theta is not None and (self.layer_types is None or self.layer_types[layer] == SLIDING)

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts (transformers' Qwen3-MoE rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def moe_params(self, layer: int) -> int:
        """Parameters of layer ``layer``'s sparse MLP (0 if dense): the router (E H), all ``num_experts``
        experts (E x 3 H moe_I) and Qwen2-MoE's shared expert with its [1, H] gate. Tensor parallelism keeps
        them whole on every rank (:mod:`dapo_trainer.parallel.tensor`)."""
        if not self.is_moe(layer):
            return 0
        H, shared = self.hidden_size, self.shared_expert_intermediate_size
        return self.num_experts * (H + 3 * H * self.moe_intermediate_size) + (3 * H * shared + H if shared else 0)

    def layer_params(self, layer: int) -> int:
        """Parameters of decoder layer ``layer``: attention, norms and its MLP -- dense (3 H I) or sparse
        (:meth:`moe_params`)."""
        H, D = self.hidden_size, self.head_dim
        q, kv = self.num_heads * D, self.num_kv_heads * D
        attn = H * (q + 2 * kv) + q * H + (q + 2 * kv) * self.qkv_bias + H * self.o_bias
        if self.is_moe(layer):
            mlp = self.moe_params(layer)
        else:
            mlp = 3 * H * self.intermediate_size + (2 * self.intermediate_size + H) * self.mlp_bias
        norms = (4 if self.sandwich_norms else 2) * H + 2 * D * self.qk_norm
        return attn + mlp + norms

    def num_params(self, *, embeddings: bool = True) -> int:
        """Parameter count (tied embeddings counted once; every expert of an MoE layer counted)."""
        H = self.hidden_size
        n = sum(self.layer_params(i) for i in range(self.num_layers)) + H
        if embeddings:
            n += self.vocab_size * H * (1 if self.tie_word_embeddings else 2)
        return n


# --------------------------------------------------------------------------- rotary
def rope_inv_freq(cfg: ModelConfig, device=None, local: bool = False) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32, with Llama 3 / linear scaling (``local``:
    the sliding layers' unscaled ``rope_local_theta``)."""
    D, theta = cfg.head_dim, cfg.rope_local_theta if local else cfg.rope_theta
    # Same expression as the reference implementations, so fp32 results agree bitwise.
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64, device=device).float() / D))
    s = {} if local else cfg.rope_scaling or {}
    kind = s.get("rope_type", "default")
    if kind == "linear":
        return inv / s["factor"]
    if kind == "llama3":
        # Llama 3.1: long wavelengths (beyond low_freq_wavelen) are slowed down by
        # `factor`, short ones (below high_freq_wavelen) kept, and the band in between
        # interpolated linearly in 1/wavelength.
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_ctx = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        return torch.where(medium, blended, scaled)
    return inv


def rope_cos_sin(cfg: ModelConfig, position_ids: torch.Tensor, dtype: torch.dtype,
                 local: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[T, head_dim]`` in ``dtype``, computed in float32 from ``position_ids [T]``."""
    inv = rope_inv_freq(cfg, position_ids.device, local)
    freqs = position_ids.float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def layer_ropes(cfg: ModelConfig, position_ids: torch.Tensor, dtype: torch.dtype, layers) -> list:
    """(cos, sin) of each layer index in ``layers``; each distinct table is computed once."""
    tables = {local: rope_cos_sin(cfg, position_ids, dtype, local) for local in {cfg.local_rope(i) for i in layers}}
    return [tables[cfg.local_rope(i)] for i in layers]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, D]`` by position (the "rotate half" layout HF checkpoints use)."""
    if x.device.type == "npu" and (y := _npu().rotary(x, cos, sin)) is not None:
        return y
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


# --------------------------------------------------------------------------- blocks
class RMSNorm(nn.Module):
    """RMSNorm over the last dim; scales by ``weight`` or, with ``unit_offset`` (Gemma), ``1 + weight``."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type == "npu" and not self.unit_offset
                and (y := _npu().rms_norm(x, self.weight, self.eps)) is not None):
            return y
        # Normalise in fp32 even for bf16 activations (float64 stays float64); scale after casting back
        # (Gemma: before), as the checkpoints were trained.
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.to(h.dtype))).to(x.dtype)
        return self.weight * h.to(x.dtype)


class PromptSharing(NamedTuple):
    """Packed sequences that repeat a prompt, computed once: ``T`` packed positions (``cu_seqlens``'
    layout) and ``C <= T`` computed rows (host-built index tensors on the model's device).

    ``computed [C]`` int64: the packed position each computed row stands for (a shared prompt's first
    copy, and every token no other sequence repeats); ``source [T]`` int64: for every packed position,
    its computed row (a repeated prompt token: the first copy's). Built by
    :func:`dapo_trainer.actor.pack_micro_batch` from a micro-batch's rows.
    """

    computed: torch.Tensor
    source: torch.Tensor


class VarlenAttention(nn.Module):
    """Rotary embedding and causal attention over packed sequences: ``(q, k, v [T, heads, D], cos, sin
    [T, D], cu_seqlens, max_seqlen) -> [T, q heads, D]``; no parameters (what sequence parallelism
    replaces)."""

    def __init__(self, head_dim: int, softmax_scale: Optional[float] = None, window: Optional[int] = None,
                 softcap: Optional[float] = None):
        super().__init__()
        self.head_dim = head_dim
        self.softmax_scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
        # A query sees itself and the window - 1 keys before it (transformers' kv > q - window).
        self.window_size = (-1, -1) if window is None else (window - 1, 0)
        self.softcap = softcap or 0.0

    def forward(self, q, k, v, cos, sin, cu_seqlens, max_seqlen: int, sharing: Optional[PromptSharing] = None):
        q, k = self.rotate(q, k, cos, sin)
        if sharing is None:
            return self.attend(q, k, v, cu_seqlens, max_seqlen)
        # Each sequence attends over its own copy of the prompt: rows gathered to the packed layout, the
        # attention of the computed positions gathered back (repeated prompt rows' outputs are never read).
        q, k, v = (t.index_select(0, sharing.source) for t in (q, k, v))
        return self.attend(q, k, v, cu_seqlens, max_seqlen).index_select(0, sharing.computed)

    def rotate(self, q, k, cos, sin):
        """q and k rotated by position (``cos`` / ``sin``: one row per token of q and k)."""
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def attend(self, q, k, v, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        """Attention of rotated q, k: every query sees the keys of its sequence up to itself (within the window)."""
        return dk.varlen_attention(q, k, v, cu_seqlens, max_seqlen, causal=True, softmax_scale=self.softmax_scale,
                                   window_size=self.window_size, softcap=self.softcap)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.head_dim = D
        self.q_proj = nn.Linear(H, cfg.num_heads * D, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * D, H, bias=cfg.o_bias)
        if cfg.qk_norm:  # one [head_dim] weight shared by all heads
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps, cfg.norm_unit_offset)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps, cfg.norm_unit_offset)
        scalar = cfg.query_pre_attn_scalar
        self.inner_attention = VarlenAttention(D, None if scalar is None else scalar ** -0.5,
                                               cfg.sliding_window if cfg.is_sliding(layer) else None,
                                               cfg.attn_logit_softcapping)

    def project(self, x):
        """q, k, v ``[T, heads, D]`` of ``x [T, H]`` (q and k normalised per head where the family does)."""
        T, D = x.shape[0], self.head_dim
        # Head counts come from the weight shapes (a tensor-parallel rank holds a slice of the heads).
        q, k, v = (proj(x).view(T, -1, D) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen: int, sharing: Optional[PromptSharing] = None):
        q, k, v = self.project(x)
        o = self.inner_attention(q, k, v, cos, sin, cu_seqlens, max_seqlen, sharing)
        return self.o_proj(o.reshape(x.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: Optional[int] = None):
        super().__init__()
        H, I = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(H, I, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(I, H, bias=cfg.mlp_bias)
        self.act = cfg.hidden_act

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.act == "silu" and x.device.type == "npu" and (y := _npu().swiglu(gate, up)) is not None:
            return self.down_proj(y)
        return self.down_proj(ACTIVATIONS[self.act](gate) * up)


class MoEExperts(nn.Module):
    """``num_experts`` SwiGLU MLPs stacked as transformers' ``Qwen3MoeExperts`` holds them in memory:
    ``gate_up_proj [E, 2 moe_I, H]`` (gate rows first) and ``down_proj [E, H, moe_I]`` (checkpoints
    store them per expert; :mod:`dapo_trainer.hf_io` converts)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward(self, x, topk_weights, topk_ids):
        return dk.moe_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)


@dataclass
class RouterTrace:
    """One sparse layer's routing in one forward (:meth:`Transformer.trace_routing`)."""
    layer: int  # the decoder layer's global index
    logits: torch.Tensor  # [T, E] the router's logits, in the autograd graph (for the aux loss)
    topk_ids: torch.Tensor  # [T, k] int64, the experts each token ran through (replayed ones included)


def replayed_weights(logits: torch.Tensor, topk_ids: torch.Tensor, norm_topk_prob: bool) -> torch.Tensor:
    """``dk.moe_route``'s weights for given experts ``topk_ids [T, k]``: their float32 softmax
    probabilities (renormalised to sum 1 if ``norm_topk_prob``), in ``logits``' dtype."""
    top = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, topk_ids)
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype)


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE's sparse MLP (transformers' ``Qwen3MoeSparseMoeBlock``): the router ``gate`` ``[E, H]``
    picks ``num_experts_per_tok`` experts per token (``dk.moe_route``), whose outputs are summed with
    the routing weights (``dk.moe_experts``). ``replay`` (``[T, k]`` expert ids, or None) replaces the
    top-k choice (router replay: the weights stay the router's probabilities of those experts); a row
    holding a negative id keeps the router's own choice (a token whose routing was not recorded)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.layer, self.top_k, self.norm_topk_prob = layer, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = MoEExperts(cfg)
        if cfg.shared_expert_intermediate_size:  # Qwen2-MoE
            self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.replay: Optional[torch.Tensor] = None
        self.sink: Optional[List[RouterTrace]] = None  # set by Transformer.trace_routing

    def forward(self, x):
        logits = self.gate(x)
        weights, ids = dk.moe_route(logits, self.top_k, self.norm_topk_prob)
        if self.replay is not None:
            check_tensor(f"layer {self.layer}'s replayed expert ids", self.replay, dtypes=INT_DTYPES,
                         device=x.device, shape=(x.shape[0], self.top_k))
            ids = torch.where((self.replay < 0).any(1, keepdim=True), ids, self.replay.long())
            weights = replayed_weights(logits, ids, self.norm_topk_prob)
        if self.sink is not None:
            self.sink.append(RouterTrace(self.layer, logits, ids))
        out = self.experts(x, weights, ids)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class DecoderLayer(nn.Module):
    """Pre-norm block; with ``sandwich_norms`` (Gemma) ``post_attention_layernorm`` normalises the
    attention output and ``pre_`` / ``post_feedforward_layernorm`` wrap the MLP."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        H, eps, offset = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset
        self.input_layernorm = RMSNorm(H, eps, offset)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(H, eps, offset)
        self.mlp = SparseMoeBlock(cfg, layer) if cfg.is_moe(layer) else MLP(cfg)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(H, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(H, eps, offset)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen: int, sharing: Optional[PromptSharing] = None):
        return self.feed_forward(self.add_attention(x, self.self_attn(self.input_layernorm(x), cos, sin,
                                                                      cu_seqlens, max_seqlen, sharing)))

    def add_attention(self, x, attn_out):
        """The residual stream ``x`` plus the attention block's output (o_proj's)."""
        return x + (self.post_attention_layernorm(attn_out) if hasattr(self, "pre_feedforward_layernorm") else attn_out)

    def feed_forward(self, x):
        """``x`` plus the MLP block's output."""
        if hasattr(self, "pre_feedforward_layernorm"):
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x + self.mlp(self.post_attention_layernorm(x))


class LMHead(nn.Linear):
    """The vocabulary projection ``[V, H]``: ``forward`` gives full logits, :meth:`log_probs` the
    fused log-probs of labels (never materialising ``[T, V]``)."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(hidden_size, vocab_size, bias=False)

    def log_probs(self, hidden, labels, *, temperature: float = 1.0, return_entropy: bool = False):
        return dk.linear_log_probs(hidden, self.weight, labels, temperature=temperature,
                                   return_entropy=return_entropy)


# --------------------------------------------------------------------------- model
class Transformer(nn.Module):
    """Decoder of any :class:`ModelConfig` family on packed tokens.

    ``model(input_ids, cu_seqlens, max_seqlen)`` returns the hidden states after the
    final norm; the vocabulary projection ``lm_head.weight [V, H]`` is applied by
    :meth:`log_probs` (fused, never materialising ``[T, V]``) or :meth:`logits`.

    ``activation_checkpointing`` recomputes each layer in backward; ``activation_offload``
    (an :class:`~dapo_trainer.offload.ActivationOffload`, or None) keeps the checkpointed
    layers' inputs in host memory between forward and backward.
    A pruned model (a pipeline stage) may lack ``embed_tokens`` (it then takes hidden states),
    ``norm`` and ``lm_head`` (it returns the last layer's output), and hold some layers only.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in range(cfg.num_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.activation_checkpointing = False
        self.activation_offload = None

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> "Transformer":
        """Random init as the HF reference models do (normal(0, std), zero biases, norms scaling by 1)."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0.0, std)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
            elif isinstance(m, RMSNorm):
                m.weight.fill_(0.0 if m.unit_offset else 1.0)
            elif isinstance(m, MoEExperts):
                m.gate_up_proj.normal_(0.0, std)
                m.down_proj.normal_(0.0, std)
        return self

    def sparse_blocks(self) -> List[SparseMoeBlock]:
        """The mixture-of-experts MLPs of the layers held, in layer order (none for a dense family)."""
        return [layer.mlp for layer in self.layers.values() if isinstance(layer.mlp, SparseMoeBlock)]

    @contextmanager
    def trace_routing(self) -> Iterator[List[RouterTrace]]:
        """Within the block, each sparse layer's forward appends its :class:`RouterTrace` to the list
        yielded (layer order per forward). Forwards outside it -- activation checkpointing's recompute
        in the backward among them -- record nothing."""
        traces: List[RouterTrace] = []
        blocks = self.sparse_blocks()
        for b in blocks:
            b.sink = traces
        try:
            yield traces
        finally:
            for b in blocks:
                b.sink = None

    def replay_routing(self, topk_ids: Optional[Sequence[torch.Tensor]]) -> None:
        """Route every following forward by ``topk_ids`` (one ``[T, k]`` per sparse layer held, in
        layer order: the tokens' recorded experts) until called with None. Kept through the backward,
        so that activation checkpointing recomputes the same routing."""
        blocks = self.sparse_blocks()
        if topk_ids is not None and len(topk_ids) != len(blocks):
            raise ValueError(f"replay_routing: got expert ids for {len(topk_ids)} layers, the model holds "
                             f"{len(blocks)} sparse layers")
        for i, b in enumerate(blocks):
            b.replay = None if topk_ids is None else topk_ids[i]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, H]`` (Gemma: times ``sqrt(hidden_size)`` rounded to their dtype)."""
        h = self.embed_tokens(input_ids)
        if not self.config.embed_scale:
            return h
        return h * torch.tensor(self.config.hidden_size ** 0.5).to(h.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        position_ids: Optional[torch.Tensor] = None,
        sharing: Optional[PromptSharing] = None,
    ) -> torch.Tensor:
        """Hidden states of packed sequences.

        Args:
            input_ids: ``[T]`` integer token ids of all sequences laid end to end; without
                ``embed_tokens``, the hidden states ``[T, hidden_size]`` entering the first layer held.
            cu_seqlens: ``[B+1]`` int32/int64, ``cu_seqlens[-1] == T``.
            max_seqlen: longest sequence length (int).
            position_ids: ``[T]`` integer; default: 0, 1, ... restarting at each sequence.
            sharing: a :class:`PromptSharing` of these ``T`` positions: the repeated prompt tokens are
                computed once (the result is the same math as without it, rounding aside).
        Returns:
            ``[T, hidden_size]`` in the parameters' dtype, after the final RMSNorm (without
            ``norm``: after the last layer held).
        """
        if self.embed_tokens is None:
            check_tensor("input_ids", input_ids, ndim=2, dtypes=FLOAT_DTYPES)
        else:
            check_tensor("input_ids", input_ids, ndim=1, dtypes=INT_DTYPES)
        T = input_ids.shape[0]
        check_cu_seqlens(cu_seqlens, T, device=input_ids.device)
        max_seqlen = check_int("max_seqlen", max_seqlen, minimum=0)
        if position_ids is None:
            position_ids = dk.packed_position_ids(cu_seqlens, T)
        else:
            check_tensor("position_ids", position_ids, dtypes=INT_DTYPES, device=input_ids.device, shape=(T,))

        if sharing is not None:
            check_tensor("sharing.source", sharing.source, dtypes=INT_DTYPES, device=input_ids.device, shape=(T,))
            check_tensor("sharing.computed", sharing.computed, ndim=1, dtypes=INT_DTYPES, device=input_ids.device)
            input_ids, position_ids = input_ids[sharing.computed], position_ids[sharing.computed]
        h = input_ids if self.embed_tokens is None else self.embed(input_ids)
        ropes = layer_ropes(self.config, position_ids, h.dtype, [int(i) for i in self.layers])
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        # Offload acts on what the checkpoints save: each layer's input (the layer's own
        # activations are recomputed, not saved).
        with offload_scope(self.activation_offload if recompute else None):
            for layer, (cos, sin) in zip(self.layers.values(), ropes):
                if recompute:
                    h = checkpoint(layer, h, cos, sin, cu_seqlens, max_seqlen, sharing, use_reentrant=False)
                else:
                    h = layer(h, cos, sin, cu_seqlens, max_seqlen, sharing)
        h = h if self.norm is None else self.norm(h)
        return h if sharing is None else h.index_select(0, sharing.source)

    def forward_padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Padded batch in, padded hidden states out: ``[B, S]`` -> ``[B, S, H]``.

        The padding is removed with ``dk.unpad_input`` before the layers run and put back
        (as zeros) with ``dk.pad_input``, so only real tokens are computed.
        """
        check_tensor("input_ids", input_ids, ndim=2, dtypes=INT_DTYPES)
        B, S = input_ids.shape
        ids, indices, cu_seqlens, max_seqlen, _ = dk.unpad_input(input_ids.unsqueeze(-1), attention_mask)
        hidden = self(ids.squeeze(-1), cu_seqlens, max_seqlen)
        if hidden.shape[0] != ids.shape[0]:
            raise ValueError(f"forward_padded: the model returned {hidden.shape[0]} of the {ids.shape[0]} tokens "
                             "(a sequence-parallel model returns its shard), which cannot be padded back; "
                             "call forward on packed tokens")
        return dk.pad_input(hidden, indices, B, S)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits ``[T, V]`` (in ``hidden``'s dtype), for generation and tests.

        Training should use :meth:`log_probs`, which never materialises them.
        """
        return self.lm_head(hidden)

    def log_probs(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        *,
        temperature: float = 1.0,
        return_entropy: bool = False,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``log softmax(hidden @ lm_head.weight.T / temperature)[labels]``: ``[T]`` float32.

        Through the fused ``dk.linear_log_probs`` (``lm_head.log_probs``). Returns
        ``(log_prob, entropy or None)``.
        """
        return self.lm_head.log_probs(hidden, labels, temperature=temperature, return_entropy=return_entropy)
