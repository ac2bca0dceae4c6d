"""Parallelism applied to a built model by functions: tensor (Megatron), sequence (Ulysses),
pipeline, expert (MoE experts over the data-parallel ranks) and data (FSDP2 / DDP).

Typical multi-node setup (launched by ``torchrun``)::

    device = init_distributed("cuda")
    mesh = make_mesh(device, tp=2)
    model = load_hf_model(path, device=device)
    parallelize(model, mesh["tp"].get_group())
    apply_fsdp(model, mesh["dp"], param_dtype=torch.bfloat16)
    loss.backward()      # each micro-batch of an update, then once per update:
    tp_grad_sync(model)  # the per-head q/k norms' partial gradients (Qwen3, Gemma 3) summed over TP
    optimizer.step()
"""
from .collectives import collective_device
from .data_parallel import apply_ddp, apply_fsdp, balanced_dp_split, global_mean_scale, sp_micro_batches
from .dims import ParallelDims, parallelize_model
from .expert import apply_expert_parallel, expert_parallel_group, expert_shard_names
from .dist import backend_for_device, init_distributed, make_mesh
from .grads import clip_grad_norm
from .pipeline import (apply_pipeline, build_pipeline, pipeline_state_dict, stage_keep, tied_grad_sync,
                       tied_parameter)
from .sequence import apply_sequence_parallel, sequence_parallel_group, shard_sequence
from .tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelLMHead,
                     full_state_dict, parallelize, tensor_parallel_group, tp_grad_sync, tp_shard_dims, unshard)

__all__ = [
    "ParallelDims",
    "parallelize_model",
    "apply_pipeline",
    "build_pipeline",
    "pipeline_state_dict",
    "tied_parameter",
    "clip_grad_norm",
    "tied_grad_sync",
    "stage_keep",
    "parallelize",
    "apply_expert_parallel",
    "expert_parallel_group",
    "expert_shard_names",
    "tensor_parallel_group",
    "tp_grad_sync",
    "apply_sequence_parallel",
    "sequence_parallel_group",
    "shard_sequence",
    "apply_fsdp",
    "apply_ddp",
    "balanced_dp_split",
    "sp_micro_batches",
    "global_mean_scale",
    "backend_for_device",
    "collective_device",
    "init_distributed",
    "make_mesh",
    "full_state_dict",
    "tp_shard_dims",
    "unshard",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
]
