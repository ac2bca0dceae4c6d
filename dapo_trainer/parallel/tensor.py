"""Megatron-style tensor parallelism applied to a built :class:`~dapo_trainer.model.Transformer`.

``parallelize(model, tp_group)`` swaps modules in place (no second model class):

=========================  ==============================  =====================================
module                     becomes                         weight kept on rank r
=========================  ==============================  =====================================
q/k/v_proj, gate/up_proj   :class:`ColumnParallelLinear`   output rows (heads / ffn units) r
o_proj, down_proj          :class:`RowParallelLinear`      input columns r, bias replicated
embed_tokens               :class:`VocabParallelEmbedding` vocabulary rows r (``padding_idx``
                                                           kept: the pad row gets no gradient)
lm_head                    :class:`VocabParallelLMHead`    vocabulary rows r (same rows as the
                                                           embedding, so tying survives)
q_norm, k_norm (per head)  unchanged                       replicated; gradient summed over the
                                                           group by :func:`tp_grad_sync`
SparseMoeBlock (Qwen3-MoE) unchanged                       replicated: router and every expert
=========================  ==============================  =====================================

A sparse MoE layer runs whole on every rank of the group (its input, the residual stream, is
replicated; so are its output and its gradients, as a norm's): experts are not split over TP ranks
(expert parallelism, :mod:`.expert`, splits them over the DP ranks instead). FSDP2 shards them as any weight.

Each attention / MLP block then costs one all-reduce in forward and one in backward, as
Megatron's conjugate operators f / g: the block's input passes through ``copy_to_tp``
(identity forward, all-reduce backward) once, shared by q/k/v (gate/up), and the row-parallel
output through ``reduce_from_tp`` (all-reduce forward, identity backward). Norms and residuals
stay replicated; their gradients come out identical on every rank, except the per-head q/k norms of
Qwen3 / Gemma 3: their ``[head_dim]`` weight is shared by all heads, and each rank sees only its own
heads, so each holds a partial gradient. As Megatron's ``finalize_model_grads`` does for its
layer norms under sequence parallelism (and as DDP / FSDP sum the layer norms' partial gradients over
the Ulysses ranks here), :func:`tp_grad_sync` sums them over the group once per optimizer update (one
all-reduce of them all, after the last backward, before clipping): whoever steps a tensor-parallel
model calls it (the trainer's actor does).
The vocabulary-parallel lm_head gives the logits gathered over the group and the log-probs
through ``dk.linear_log_probs(..., process_group=tp_group)`` (:meth:`Transformer.log_probs`).
The parallel modules hold the group: :func:`tensor_parallel_group` reads it back from a model.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dapo_kernels as dk

from ..model import SparseMoeBlock, Transformer
from .collectives import copy_to_tp, gather_from_tp, reduce_from_tp
from .expert import expert_parallel_group, expert_shard_names, unshard_experts

TP_KEY = "actor_rollout_ref.actor.tensor_model_parallel_size"
# Name endings of the replicated parameters whose gradient a tensor-parallel rank computes in part.
HEAD_SHARED = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


# --------------------------------------------------------------------------- parallel modules
def _shard(t: Optional[torch.Tensor], dim: int, group) -> Optional[nn.Parameter]:
    if t is None:
        return None
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return nn.Parameter(t.detach().chunk(n, dim=dim)[r].clone(), requires_grad=t.requires_grad)


class _Sharded(nn.Module):
    """A module whose ``weight`` is this rank's slice along ``shard_dim`` over ``group``."""

    shard_dim: int

    def __init__(self, module: nn.Module, group):
        super().__init__()
        self.group = group
        self.weight = _shard(module.weight, self.shard_dim, group)


class ColumnParallelLinear(_Sharded):
    """``y_r = x W_r^T + b_r``: this rank's slice of the output features.

    ``copy_input``: pass ``x`` through ``copy_to_tp`` here (all-reduce of its gradient in
    backward); False when the enclosing block already did, once for all its column-parallel
    linears (what :func:`parallelize` sets up).
    """

    shard_dim = 0

    def __init__(self, linear: nn.Linear, group, copy_input: bool = True):
        super().__init__(linear, group)
        self.bias = _shard(linear.bias, 0, group)
        self.copy_input = copy_input

    def forward(self, x):
        return F.linear(copy_to_tp(x, self.group) if self.copy_input else x, self.weight, self.bias)


class RowParallelLinear(_Sharded):
    """``y = sum_r x_r W_r^T + b``: input features sharded, output replicated."""

    shard_dim = 1

    def __init__(self, linear: nn.Linear, group):
        super().__init__(linear, group)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(_Sharded):
    """Embedding whose rows ``[start, start + V/tp)`` live on this rank; ids elsewhere give 0.

    The embedding's ``padding_idx`` (transformers': ``pad_token_id``) is kept: the rank holding that
    row leaves it out of the gradient, as ``nn.Embedding`` does (ids of other ranks' rows, mapped to
    local row 0 here, are masked to 0 after the lookup and so give row 0 no gradient either)."""

    shard_dim = 0

    def __init__(self, embedding: nn.Embedding, group):
        super().__init__(embedding, group)
        rows = self.weight.shape[0]
        self.vocab_start = dist.get_rank(group) * rows
        pad = getattr(embedding, "padding_idx", None)
        self.padding_idx = pad - self.vocab_start if pad is not None and 0 <= pad - self.vocab_start < rows else None

    def forward(self, ids):
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=self.padding_idx)
        return reduce_from_tp(h.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


class VocabParallelLMHead(_Sharded):
    """The vocabulary projection with rows ``[start, start + V/tp)`` on this rank: logits gathered
    over the group, log-probs vocabulary-parallel (one fused op, never the ``[T, V]`` logits)."""

    shard_dim = 0

    def forward(self, hidden):
        return gather_from_tp(F.linear(copy_to_tp(hidden, self.group), self.weight), self.group)

    def log_probs(self, hidden, labels, *, temperature: float = 1.0, return_entropy: bool = False):
        return dk.linear_log_probs(hidden, self.weight, labels, temperature=temperature,
                                   return_entropy=return_entropy, process_group=self.group)


# --------------------------------------------------------------------------- parallelize
def module_group(model: nn.Module, kind: type):
    """The ``group`` of ``model``'s first submodule of type ``kind`` (a parallel module); None without one."""
    return next((m.group for m in model.modules() if isinstance(m, kind)), None)


def tensor_parallel_group(model: nn.Module):
    """The group ``model``'s weights are sharded over by :func:`parallelize`; None if not tensor parallel."""
    return module_group(model, _Sharded)


def map_first_input(fn):
    """A forward pre-hook passing the module's first argument through ``fn``."""

    def hook(module, args):
        return (fn(args[0]), *args[1:])

    return hook


def check_not_yet(model: Transformer, group_arg: str, kind: str, group) -> None:
    """TypeError unless ``model`` is a Transformer; ValueError without torch.distributed or when its
    ``kind`` parallel ``group`` is already set."""
    if not isinstance(model, Transformer):
        raise TypeError(f"model must be a dapo_trainer Transformer, got {type(model).__name__}")
    if not dist.is_initialized():
        raise ValueError(f"{group_arg}: torch.distributed is not initialised")
    if group is not None:
        raise ValueError(f"model is already {kind} parallel")


def parallelize(model: Transformer, tp_group) -> Transformer:
    """Shard ``model`` in place for tensor parallelism over ``tp_group``; returns it.

    Every rank of the group must hold the same full weights when this is called (load
    the checkpoint on each rank, or broadcast). Head counts, the intermediate size and
    the vocabulary must divide by the group size (ValueError otherwise). A model with per-head
    q/k norms (Qwen3, Gemma 3) needs :func:`tp_grad_sync` after its backward.
    """
    check_not_yet(model, "tp_group", "tensor", tensor_parallel_group(model))
    tp = dist.get_world_size(tp_group)
    cfg = model.config
    for name in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
        if getattr(cfg, name) % tp:
            raise ValueError(f"{name} ({getattr(cfg, name)}) must be divisible by the tensor-parallel size {tp} "
                             f"({TP_KEY}={tp}; model_type {cfg.model_type!r})")
    if tp == 1:
        return model
    for layer in model.layers.values():
        attn, mlp = layer.self_attn, layer.mlp
        blocks = [(attn, ("q_proj", "k_proj", "v_proj"), "o_proj")]
        if not isinstance(mlp, SparseMoeBlock):  # a sparse one stays replicated (module doc)
            blocks.append((mlp, ("gate_proj", "up_proj"), "down_proj"))
        for block, cols, row in blocks:
            for lin in cols:
                setattr(block, lin, ColumnParallelLinear(getattr(block, lin), tp_group, copy_input=False))
            setattr(block, row, RowParallelLinear(getattr(block, row), tp_group))
            # One backward all-reduce per block (Megatron's f), not one per column-parallel linear.
            block.register_forward_pre_hook(map_first_input(lambda x: copy_to_tp(x, tp_group)))
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, tp_group)
    model.lm_head = VocabParallelLMHead(model.lm_head, tp_group)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def head_shared_grads(model: nn.Module) -> list:
    """Gradients (local tensors; FSDP2: this rank's shard) of ``model``'s parameters replicated over the
    tensor-parallel group whose gradient each rank computes for its own heads only: the per-head q/k
    norm weights (their names end in :data:`HEAD_SHARED`)."""
    out = []
    for name, p in model.named_parameters():
        if name.endswith(HEAD_SHARED) and p.grad is not None:
            out.append(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
    return out


@torch.no_grad()
def tp_grad_sync(model: nn.Module) -> None:
    """Sum over the tensor-parallel group the partial gradients of the replicated per-head q/k norm
    weights (:func:`head_shared_grads`), in one all-reduce of them all (collective over the group);
    a no-op without tensor parallelism or without such parameters (Llama, Qwen2, Mistral).

    Call it once per optimizer update, after the last backward of the accumulated micro-batches and
    before the gradients are clipped or read (DDP / FSDP2 have reduced them over the data-parallel
    ranks by then; both reductions are linear, so their order does not matter). Every rank of the group
    holds the same layers (and, under FSDP2, the same shard of each), so the buffers match.
    """
    group = tensor_parallel_group(model)
    grads = head_shared_grads(model) if group is not None else []
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # on the gradients' device, as NCCL wants
    dist.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def tp_shard_dims(model: Transformer) -> dict:
    """{parameter name: dim it is sharded along over :func:`tensor_parallel_group`}; absent = replicated."""
    dims = {}
    for mod_name, mod in model.named_modules():
        if not isinstance(mod, _Sharded):
            continue
        dims[f"{mod_name}.weight"] = mod.shard_dim
        if isinstance(mod, ColumnParallelLinear) and mod.bias is not None:
            dims[f"{mod_name}.bias"] = 0
    return dims


def unshard(t: torch.Tensor, dim: Optional[int], tp_group) -> torch.Tensor:
    """Full tensor of a parameter (or its gradient) of a parallel model (collective).

    Gathers FSDP2 shards (``DTensor.full_tensor``), then tensor-parallel shards along
    ``dim`` (from :func:`tp_shard_dims`; None = replicated) over ``tp_group``.
    """
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    if dim is None or tp_group is None:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, t.contiguous(), group=tp_group)
    return torch.cat(parts, dim=dim)


def full_state_dict(model: Transformer) -> dict:
    """Unsharded ``state_dict`` of a tensor-, expert- and/or FSDP-parallel model (collective).

    What :func:`dapo_trainer.hf_io.save_hf_model` needs; call it on every rank, save on one.
    """
    dims, group = tp_shard_dims(model), tensor_parallel_group(model)
    experts, ep_group = expert_shard_names(model), expert_parallel_group(model)
    return {name: (unshard_experts(t, ep_group) if name in experts else unshard(t, dims.get(name), group)).detach()
            for name, t in model.state_dict().items()}
