"""Pipeline parallelism: the decoder layers split into stages, run by torch's pipelining engine.

``split_model`` cuts a built (and tensor-parallel) :class:`~dapo_trainer.model.Transformer` into
``pp x v`` stages of equal layer counts, stage ``s`` on pipeline rank ``s % pp`` (torch's looped
placement, which ``ScheduleInterleaved1F1B`` expects); the first stage holds the embedding, the last
the final norm and ``lm_head`` (with tied embeddings a copy of the embedding, its gradient summed
with the first stage's over ``tied_group``). The model is pruned in place to this rank's modules,
their names unchanged (``layers.{i}.*`` keeps the layer's global index), so its ``state_dict`` is a
subset of the HF checkpoint's. Each stage is a Transformer pruned further to the stage's modules
(shared with the model), run by the model's own forward.

:class:`Pipeline` runs packed varlen micro-batches through ``PipelineStage`` + ``Schedule1F1B`` /
``ScheduleInterleaved1F1B``: every micro-batch padded to the same token count (the cap: stage
shapes are static), the padding one extra sequence (it attends to itself only) and ``cu_seqlens``
padded with empty sequences to a fixed length; they travel to every stage as keyword arguments.
The last stage's hook (the schedule's ``loss_fn``) sees the hidden states with the padding cut
off, so no loss or metric reads a padding position.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..model import ModelConfig, Transformer
from .data_parallel import apply_ddp
from .tensor import full_state_dict

PP_KEY = "actor_rollout_ref.actor.pipeline_model_parallel_size"
VPP_KEY = "actor_rollout_ref.actor.virtual_pipeline_model_parallel_size"


def stage_layers(num_layers: int, pp: int, v: int = 1) -> List[range]:
    """The decoder layers of each of the ``pp * v`` stages: equal contiguous ranges (ValueError
    naming the keys unless ``pp * v`` divides ``num_layers``)."""
    n = pp * v
    if num_layers % n:
        raise ValueError(f"{PP_KEY}={pp} x {VPP_KEY}={v} = {n} pipeline stages must divide the model's "
                         f"{num_layers} decoder layers")
    per = num_layers // n
    return [range(s * per, (s + 1) * per) for s in range(n)]


def _stage_inputs(module, args, kwargs):
    """Forward pre-hook of a stage: the schedule's rows of one micro-batch (``cu_seqlens [1, L]``,
    ``max_seqlen [1]``) as the model's arguments (``[L]``, an int)."""
    bound = {**dict(zip(("input_ids", "cu_seqlens", "max_seqlen"), args)), **kwargs}
    return (bound["input_ids"], bound["cu_seqlens"].reshape(-1), int(bound["max_seqlen"].reshape(-1)[0])), {}


def stage_model(model: Transformer, layers: range, *, first: bool, last: bool) -> Transformer:
    """One pipeline stage: a Transformer of ``model``'s own modules (``layers`` under their global
    indices, the embedding on the first stage, the final norm and ``lm_head`` on the last) with its
    checkpointing / offload settings. It takes token ids (first stage) or hidden states ``[T, H]``
    and the schedule's rows of ``cu_seqlens`` / ``max_seqlen``; returns hidden states."""
    with torch.device("meta"):  # a shell whose modules are replaced by the model's below
        stage = type(model)(model.config)
    stage.embed_tokens = model.embed_tokens if first else None
    stage.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
    stage.norm, stage.lm_head = (model.norm, model.lm_head) if last else (None, None)
    stage.activation_checkpointing, stage.activation_offload = model.activation_checkpointing, model.activation_offload
    stage.register_forward_pre_hook(_stage_inputs, with_kwargs=True)
    return stage


def stage_keep(pp_rank: int, pp: int, v: int = 1) -> Optional[Callable[[ModelConfig, str], bool]]:
    """``keep(config, name)`` for :func:`~dapo_trainer.hf_io.load_hf_model`: True for the parameters
    of pipeline rank ``pp_rank``'s stages (on the last, a tied embedding's weight: its ``lm_head``),
    so a rank reads and materialises only its own layers before :func:`split_model` cuts; None
    (all) at ``pp=1``."""
    if pp == 1:
        return None

    def keep(cfg: ModelConfig, name: str) -> bool:
        n = pp * v
        mine = [s for s in range(n) if s % pp == pp_rank]
        if name.startswith("layers."):
            layer = int(name.split(".")[1])
            return any(layer in r for s, r in enumerate(stage_layers(cfg.num_layers, pp, v)) if s in mine)
        if name == "embed_tokens.weight":
            return 0 in mine or (n - 1 in mine and cfg.tie_word_embeddings)
        return n - 1 in mine  # norm, lm_head

    return keep


def split_model(model: Transformer, pp_rank: int, pp: int, v: int = 1) -> List[Transformer]:
    """This rank's stages of ``model`` (stage indices ``pp_rank + k * pp``), the model pruned in
    place to their modules (those of other stages may be on the meta device: :func:`stage_keep`).
    Tied embeddings: the last stage's ``lm_head.weight`` becomes its own parameter."""
    n = pp * v
    ranges = stage_layers(model.config.num_layers, pp, v)
    mine = [s for s in range(n) if s % pp == pp_rank]
    tied = model.config.tie_word_embeddings and pp > 1
    if tied and pp_rank == pp - 1:  # its gradient is summed with the embedding's (tied_grad_sync)
        # pp > 1: this rank does not hold stage 0, so the embedding is dropped below and the
        # storage need not be copied.
        model.lm_head.weight = nn.Parameter(model.embed_tokens.weight.detach())
    owned = nn.ModuleDict({str(i): model.layers[str(i)] for s in mine for i in ranges[s]})
    model.layers = owned
    if 0 not in mine:
        model.embed_tokens = None
    if n - 1 not in mine:
        model.norm = model.lm_head = None
    return [stage_model(model, ranges[s], first=s == 0, last=s == n - 1) for s in mine]


def apply_pipeline(model: Transformer, dims, *, fsdp: bool) -> Transformer:
    """Split ``model`` (already tensor parallel) into this rank's stages, ``model.pipeline_chunks``;
    under ``fsdp`` with several DP ranks each decoder layer and each stage is an FSDP2 unit."""
    model.pipeline_chunks = split_model(model, dims.pp_rank, dims.pp, dims.vpp)
    if fsdp and dims.grad_ranks > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        for chunk in model.pipeline_chunks:
            for layer in chunk.layers.values():
                fully_shard(layer, mesh=dims.grad_mesh, mp_policy=mp)
            # The root stays gathered from forward to backward: the loss reads lm_head.weight after it.
            fully_shard(chunk, mesh=dims.grad_mesh, mp_policy=mp, reshard_after_forward=False)
    return model


def build_pipeline(model: Transformer, dims, *, ddp: bool, max_seqs: int) -> "Pipeline":
    """The :class:`Pipeline` of a model split by :func:`apply_pipeline`; ``ddp``: each stage wrapped
    in torch's DDP over the gradient ranks (the stage runs it: no_sync but in the last backward)."""
    chunks = model.pipeline_chunks
    modules = list(chunks)
    if ddp:
        modules = [apply_ddp(c, dims.grad_group) for c in chunks]
    p = next(model.parameters())
    return Pipeline(chunks, modules, pp_rank=dims.pp_rank, pp=dims.pp, v=dims.vpp, group=dims.pp_group,
                    device=p.device, max_seqs=max_seqs, hidden_size=model.config.hidden_size, dtype=p.dtype)


def tied_parameter(model: Transformer) -> Optional[nn.Parameter]:
    """The parameter of a tied embedding this rank holds under PP (the embedding or its copy)."""
    if not model.config.tie_word_embeddings:
        return None
    return model.embed_tokens.weight if model.embed_tokens is not None else (
        model.lm_head.weight if model.lm_head is not None else None)


class Pipeline:
    """The stages of one model on this rank and their schedules (one per micro-batch count and mode).

    ``run(mbs, cap, on_output, train)``: ``mbs`` packed micro-batches
    (:class:`~dapo_trainer.records.MicroBatch`), in the order to run them; ``on_output(i, hidden)``
    is called on the last stage with micro-batch ``i``'s unpadded hidden states and returns its
    loss (``train``) or anything.
    """

    def __init__(self, chunks: List[Transformer], modules: List[nn.Module], *, pp_rank: int, pp: int, v: int,
                 group, device: torch.device, max_seqs: int, hidden_size: int, dtype: torch.dtype):
        self.chunks, self.modules = chunks, modules  # modules: the chunks as the stages run them (DDP / FSDP)
        self.pp_rank, self.pp, self.v, self.group, self.device = pp_rank, pp, v, group, device
        self.max_seqs, self.hidden_size, self.dtype = max_seqs, hidden_size, dtype
        self.is_last = pp_rank == pp - 1
        self._schedules: Dict[Tuple[int, int, bool], object] = {}
        self._hook: Optional[Callable] = None

    def _schedule(self, m: int, cap: int, train: bool):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

        key = (m, cap, train)
        if key not in self._schedules:
            n = self.pp * self.v
            stages = []
            for k, mod in enumerate(self.modules):
                s = self.pp_rank + k * self.pp
                # Example tensors of the static shapes (activations that carry a gradient in training).
                x = (torch.zeros(cap, dtype=torch.long, device=self.device) if s == 0 else
                     torch.zeros(cap, self.hidden_size, dtype=self.dtype, device=self.device, requires_grad=train))
                out = torch.zeros(cap, self.hidden_size, dtype=self.dtype, device=self.device, requires_grad=train)
                stages.append(PipelineStage(mod, s, n, self.device, input_args=(x,), output_args=(out,),
                                            group=self.group))
            loss = self._loss
            if self.v == 1:
                self._schedules[key] = Schedule1F1B(stages[0], m, loss_fn=loss, scale_grads=False)
            else:
                self._schedules[key] = ScheduleInterleaved1F1B(stages, m, loss_fn=loss, scale_grads=False)
        return self._schedules[key]

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        i = int(target.reshape(-1)[0])
        return self._hook(i, output[:self._tokens[i]])

    def run(self, mbs: Sequence, cap: int, on_output: Callable[[int, torch.Tensor], torch.Tensor],
            train: bool) -> None:
        """One pass of the micro-batches through the pipe (forward and backward when ``train``)."""
        m, L = len(mbs), self.max_seqs + 2
        ids = torch.zeros(m * cap, dtype=torch.long, device=self.device)
        cus = torch.full((m, L), cap, dtype=torch.int32, device=self.device)
        msl = torch.zeros(m, dtype=torch.long)
        self._tokens = []
        for i, mb in enumerate(mbs):
            t, cu = mb.input_ids.shape[0], mb.cu_seqlens
            if t > cap or cu.shape[0] > L - 1:
                raise ValueError(f"micro-batch {i}: {t} tokens in {cu.shape[0] - 1} sequences exceed the pipeline's "
                                 f"static shape ({cap} tokens, {L - 2} sequences)")
            ids[i * cap:i * cap + t] = mb.input_ids
            cus[i, :cu.shape[0]] = cu  # then the padding: one sequence up to cap, then empty ones
            msl[i] = max(mb.max_seqlen, cap - t)
            self._tokens.append(t)
        self._hook = on_output
        sched = self._schedule(m, cap, train)
        target = torch.arange(m)
        args = (ids,) if self.pp_rank == 0 else ()
        try:
            if train:
                sched.step(*args, cu_seqlens=cus, max_seqlen=msl, target=target, return_outputs=False)
            else:
                sched.eval(*args, cu_seqlens=cus, max_seqlen=msl, target=target)
        finally:
            self._hook = None


def tied_grad_sync(model: Transformer, group) -> None:
    """Sum the tied embedding's gradient of the first stage and its copy's on the last (``group``:
    the two ranks); no-op when this rank holds neither."""
    p = tied_parameter(model)
    if p is None or group is None or p.grad is None:
        return
    g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
    dist.all_reduce(g, group=group)


def pipeline_state_dict(model: Transformer, dims) -> dict:
    """The whole model's unsharded ``state_dict`` on every rank (collective): each stage's
    (:func:`~.tensor.full_state_dict`: TP and FSDP2 shards gathered) all-gathered over the
    pipeline group; HF names, as without PP."""
    local = {k: v.cpu() for k, v in full_state_dict(model).items()}
    parts = [None] * dims.pp
    dist.all_gather_object(parts, local, group=dims.pp_group)
    full = {}
    for part in parts:
        full.update(part)
    device = next(model.parameters()).device
    return {k: v.to(device) for k, v in full.items()}
