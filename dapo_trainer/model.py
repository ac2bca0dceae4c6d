"""Decoder-only transformer of the Llama / Qwen2 families on packed sequences.

One plain model file in the spirit of gpt-fast: parameter names follow Hugging Face
(``embed_tokens``, ``layers.{i}.self_attn.q_proj``, ...) so checkpoints map one to one
(:mod:`dapo_trainer.hf_io`), and tensor / sequence / data parallelism are applied afterwards by
functions in :mod:`dapo_trainer.parallel` that swap modules in place or set their groups.

Every activation is packed: ``T`` tokens of ``B`` sequences laid end to end, described
by ``cu_seqlens [B+1]`` int32 (flash-attn's varlen convention). Nothing is padded, so
no FLOP is spent on padding tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import dapo_kernels as dk
from dapo_kernels.validation import INT_DTYPES, check_cu_seqlens, check_int, check_tensor

from .offload import offload_scope
from .parallel.collectives import copy_to_tp, gather_from_tp, heads_to_seq, seq_to_heads, sequence_shards

ROPE_TYPES = ("default", "linear", "llama3")


def _npu():  # Ascend fused kernels (None outside their limits); imported only for NPU tensors
    from . import npu_model_ops
    return npu_model_ops


@dataclass
class ModelConfig:
    """Shape and numerics of a Llama / Qwen2 decoder (what ``config.json`` says).

    ``rope_scaling`` is None or a dict with ``rope_type`` in :data:`ROPE_TYPES`
    ("linear": ``factor``; "llama3": ``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``).
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

    def num_params(self, *, embeddings: bool = True) -> int:
        """Parameter count (tied embeddings counted once)."""
        H, D = self.hidden_size, self.head_dim
        q, kv = self.num_heads * D, self.num_kv_heads * D
        attn = H * (q + 2 * kv) + q * H + (q + 2 * kv) * self.qkv_bias + H * self.o_bias
        mlp = 3 * H * self.intermediate_size + (2 * self.intermediate_size + H) * self.mlp_bias
        n = self.num_layers * (attn + mlp + 2 * H) + H
        if embeddings:
            n += self.vocab_size * H * (1 if self.tie_word_embeddings else 2)
        return n


# --------------------------------------------------------------------------- rotary
def rope_inv_freq(cfg: ModelConfig, device=None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32, with Llama 3 / linear scaling."""
    D = cfg.head_dim
    # Same expression as the reference implementations, so fp32 results agree bitwise.
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64, device=device).float() / D))
    s = cfg.rope_scaling or {}
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


def rope_cos_sin(cfg: ModelConfig, position_ids: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[T, head_dim]`` in ``dtype``, computed in float32 from ``position_ids [T]``."""
    inv = rope_inv_freq(cfg, position_ids.device)
    freqs = position_ids.float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, D]`` by position (the "rotate half" layout HF checkpoints use)."""
    if x.device.type == "npu" and (y := _npu().rotary(x, cos, sin)) is not None:
        return y
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


# --------------------------------------------------------------------------- blocks
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "npu" and (y := _npu().rms_norm(x, self.weight, self.eps)) is not None:
            return y
        # Normalise in fp32 even for bf16 activations; scale after casting back, as the
        # checkpoints were trained.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.head_dim = D
        self.q_proj = nn.Linear(H, cfg.num_heads * D, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * D, H, bias=cfg.o_bias)
        self.sp_group = None  # set by dapo_trainer.parallel.apply_sequence_parallel

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen: int, seq_shards=None):
        T, D = x.shape[0], self.head_dim
        # Head counts come from the weight shapes: under tensor parallelism each rank
        # holds a contiguous slice of q heads and the kv heads they read.
        q = apply_rope(self.q_proj(x).view(T, -1, D), cos, sin)
        k = apply_rope(self.k_proj(x).view(T, -1, D), cos, sin)
        v = self.v_proj(x).view(T, -1, D)
        if seq_shards is not None:
            # Ulysses: this rank's tokens of every head -> every token of this rank's heads, so
            # attention sees whole sequences (cu_seqlens is the whole micro-batch's).
            q, k, v = (seq_to_heads(t, self.sp_group, seq_shards) for t in (q, k, v))
        o = dk.varlen_attention(q, k, v, cu_seqlens, max_seqlen, causal=True, softmax_scale=D ** -0.5)
        if seq_shards is not None:
            o = heads_to_seq(o, self.sp_group, seq_shards)
        return self.o_proj(o.reshape(T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(H, I, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(I, H, bias=cfg.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        if x.device.type == "npu" and (y := _npu().swiglu(gate, up)) is not None:
            return self.down_proj(y)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen: int, seq_shards=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cu_seqlens, max_seqlen, seq_shards)
        return x + self.mlp(self.post_attention_layernorm(x))


# --------------------------------------------------------------------------- model
class Transformer(nn.Module):
    """Llama / Qwen2 decoder on packed tokens.

    ``model(input_ids, cu_seqlens, max_seqlen)`` returns the hidden states after the
    final norm; the vocabulary projection ``lm_head.weight [V, H]`` is applied by
    :meth:`log_probs` (fused, never materialising ``[T, V]``) or :meth:`logits`.

    Attributes set by :mod:`dapo_trainer.parallel`: ``tp_group`` (None when not tensor
    parallel), ``sp_group`` (None when not sequence parallel; else :meth:`forward` returns
    this rank's contiguous shard of the tokens, ``parallel.shard_sequence``).
    ``activation_checkpointing`` recomputes each layer in backward; ``activation_offload``
    (an :class:`~dapo_trainer.offload.ActivationOffload`, or None) keeps the checkpointed
    layers' inputs in host memory between forward and backward.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.activation_checkpointing = False
        self.activation_offload = None
        self.tp_group = None
        self.sp_group = None

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> "Transformer":
        """Random init as the HF reference models do (normal(0, std), zero biases, unit norms)."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0.0, std)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        position_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Hidden states of packed sequences.

        Args:
            input_ids: ``[T]`` integer token ids of all sequences laid end to end.
            cu_seqlens: ``[B+1]`` int32/int64, ``cu_seqlens[-1] == T``.
            max_seqlen: longest sequence length (int).
            position_ids: ``[T]`` integer; default: 0, 1, ... restarting at each sequence.
        Returns:
            ``[T, hidden_size]`` in the parameters' dtype, after the final RMSNorm; under
            sequence parallelism ``[T_r, hidden_size]``, this rank's shard of the tokens
            (every rank of ``sp_group`` passes the same whole micro-batch).
        """
        check_tensor("input_ids", input_ids, ndim=1, dtypes=INT_DTYPES)
        T = input_ids.shape[0]
        check_cu_seqlens(cu_seqlens, T, device=input_ids.device)
        max_seqlen = check_int("max_seqlen", max_seqlen, minimum=0)
        if position_ids is None:
            position_ids = dk.packed_position_ids(cu_seqlens, T)
        else:
            check_tensor("position_ids", position_ids, dtypes=INT_DTYPES, device=input_ids.device, shape=(T,))
        shards = None
        if self.sp_group is not None:  # this rank's tokens; attention exchanges them for heads
            shards, start = sequence_shards(T, self.sp_group)
            rank_tokens = shards[dist.get_rank(self.sp_group)]
            input_ids = input_ids.narrow(0, start, rank_tokens)
            position_ids = position_ids.narrow(0, start, rank_tokens)

        h = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.config, position_ids, h.dtype)
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        # Offload acts on what the checkpoints save: each layer's input (the layer's own
        # activations are recomputed, not saved).
        with offload_scope(self.activation_offload if recompute else None):
            for layer in self.layers:
                if recompute:
                    h = checkpoint(layer, h, cos, sin, cu_seqlens, max_seqlen, shards, use_reentrant=False)
                else:
                    h = layer(h, cos, sin, cu_seqlens, max_seqlen, shards)
        return self.norm(h)

    def forward_padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Padded batch in, padded hidden states out: ``[B, S]`` -> ``[B, S, H]``.

        The padding is removed with ``dk.unpad_input`` before the layers run and put back
        (as zeros) with ``dk.pad_input``, so only real tokens are computed.
        """
        check_tensor("input_ids", input_ids, ndim=2, dtypes=INT_DTYPES)
        if self.sp_group is not None:
            raise ValueError("forward_padded: a sequence-parallel model returns a shard of the packed tokens, "
                             "which cannot be padded back; call forward on packed tokens")
        B, S = input_ids.shape
        ids, indices, cu_seqlens, max_seqlen, _ = dk.unpad_input(input_ids.unsqueeze(-1), attention_mask)
        hidden = self(ids.squeeze(-1), cu_seqlens, max_seqlen)
        return dk.pad_input(hidden, indices, B, S)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits ``[T, V]`` (in ``hidden``'s dtype), for generation and tests.

        Training should use :meth:`log_probs`, which never materialises them.
        """
        if self.tp_group is None:
            return F.linear(hidden, self.lm_head.weight)

        local = F.linear(copy_to_tp(hidden, self.tp_group), self.lm_head.weight)
        return gather_from_tp(local, self.tp_group)

    def log_probs(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        *,
        temperature: float = 1.0,
        return_entropy: bool = False,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``log softmax(hidden @ lm_head.weight.T / temperature)[labels]``: ``[T]`` float32.

        Through the fused ``dk.linear_log_probs`` (vocab-parallel over ``tp_group`` when
        the model is tensor parallel). Returns ``(log_prob, entropy or None)``.
        """
        return dk.linear_log_probs(
            hidden, self.lm_head.weight, labels,
            temperature=temperature, return_entropy=return_entropy, process_group=self.tp_group,
        )
