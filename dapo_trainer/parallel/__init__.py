"""Parallelism applied to a built model by functions: tensor (Megatron) and data (FSDP2 / DDP).

Typical multi-node setup (launched by ``torchrun``)::

    device = init_distributed("cuda")
    mesh = make_mesh(device, tp=2)
    model = load_hf_model(path, device=device)
    parallelize(model, mesh["tp"].get_group())
    apply_fsdp(model, mesh["dp"], param_dtype=torch.bfloat16)
"""
from .data import apply_ddp, apply_fsdp, balanced_dp_split, global_mean_scale
from .dist import backend_for_device, init_distributed, make_mesh
from .tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    full_state_dict,
    parallelize,
    tp_shard_dims,
    unshard,
)

__all__ = [
    "parallelize",
    "apply_fsdp",
    "apply_ddp",
    "balanced_dp_split",
    "global_mean_scale",
    "backend_for_device",
    "init_distributed",
    "make_mesh",
    "full_state_dict",
    "tp_shard_dims",
    "unshard",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
]
