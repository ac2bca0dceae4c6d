"""DeepSpeed-Ulysses sequence parallelism applied to a built :class:`~dapo_trainer.model.Transformer`.

``apply_sequence_parallel(model, sp_group)``: the ``n`` ranks of ``sp_group`` each take the
same packed micro-batch and compute a contiguous ``1/n`` of its tokens (sequences may cross
shard boundaries; no padding). Everything but attention is per token, so it runs on the shard
as it is. Around attention one all-to-all turns "my tokens, every head" into "every token, my
``H/n`` heads" for q, k and v, ``dk.varlen_attention`` runs on whole sequences with the
micro-batch's ``cu_seqlens``, and one all-to-all turns the output back (backward: the opposite
exchanges). With fewer KV heads than ranks (GQA) each rank gets a copy of the KV head its
query heads read. Each layer's own attention runs on whole sequences, so its sliding window (Mistral,
Gemma 3's sliding layers) and softmax scale hold as on one process.

Applied as module replacement and a hook: each layer's ``self_attn.inner_attention`` becomes a
:class:`UlyssesAttention` around it (rotary tables of the whole micro-batch in, this rank's rows
used), and a forward pre-hook on ``embed_tokens`` keeps this rank's tokens. The model then
returns this rank's shard of the hidden states; labels, masks and advantages
are sharded alike with :func:`shard_sequence` and the loss of each rank covers its tokens. A
token mean stays exact when every rank divides by the micro-batch's (or mini-batch's) global
token count, and the parameters' gradients are summed over ``sp_group`` (a data-parallel
reduction over the SP ranks too: DDP / FSDP over all their ranks, ``world`` times the
per-rank loss) to give the full gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..model import Transformer
from .collectives import heads_to_seq, seq_to_heads, sequence_shards
from .tensor import check_not_yet, map_first_input, module_group, tensor_parallel_group


class UlyssesAttention(nn.Module):
    """The wrapped attention (``inner``, a :class:`~dapo_trainer.model.VarlenAttention`) on this
    rank's tokens: q, k, v ``[T_r, heads, D]`` rotated with this rank's rows of the micro-batch's
    ``cos`` / ``sin`` ``[T, D]``, exchanged for every token of ``heads / n`` heads, attended over the
    whole sequences of ``cu_seqlens``, and exchanged back to ``[T_r, heads, D]``."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, q, k, v, cos, sin, cu_seqlens, max_seqlen: int, sharing=None):
        if sharing is not None:  # the config rule refuses it first; a direct caller learns here
            raise ValueError("sharing: prompt sharing with sequence parallelism is not supported")
        shards, start = sequence_shards(cos.shape[0], self.group)
        cos, sin = cos.narrow(0, start, q.shape[0]), sin.narrow(0, start, q.shape[0])
        q, k = self.inner.rotate(q, k, cos, sin)
        q, k, v = (seq_to_heads(t, self.group, shards) for t in (q, k, v))
        return heads_to_seq(self.inner.attend(q, k, v, cu_seqlens, max_seqlen), self.group, shards)


def sequence_parallel_group(model: nn.Module):
    """The group :func:`apply_sequence_parallel` made ``model`` sequence parallel over; None if not."""
    return module_group(model, UlyssesAttention)


def apply_sequence_parallel(model: Transformer, sp_group) -> Transformer:
    """Make ``model`` sequence parallel over ``sp_group`` in place; returns it.

    ``num_heads`` must divide by the group size ``n``, and ``num_kv_heads`` divide by it or
    divide it (ValueError otherwise). Not combined with tensor parallelism here (ValueError).
    """
    check_not_yet(model, "sp_group", "sequence", sequence_parallel_group(model))
    if tensor_parallel_group(model) is not None:
        raise ValueError("model: sequence parallelism on a tensor-parallel model is not supported")
    n, cfg = dist.get_world_size(sp_group), model.config
    if cfg.num_heads % n:
        raise ValueError(f"num_heads ({cfg.num_heads}) must be divisible by the sequence-parallel size {n}")
    if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
        raise ValueError(f"num_kv_heads ({cfg.num_kv_heads}) must divide or be divisible by the "
                         f"sequence-parallel size {n}")
    if n == 1:
        return model
    for layer in model.layers.values():
        attn = layer.self_attn
        attn.inner_attention = UlyssesAttention(attn.inner_attention, sp_group)
    model.embed_tokens.register_forward_pre_hook(map_first_input(lambda ids: shard_sequence(ids, sp_group)))
    return model


def shard_sequence(t: torch.Tensor, sp_group) -> torch.Tensor:
    """This rank's shard (along dim 0) of a per-token tensor of the whole packed micro-batch:
    the tokens the sequence-parallel model computes here."""
    shards, start = sequence_shards(t.shape[0], sp_group)
    return t.narrow(0, start, shards[dist.get_rank(sp_group)])
