"""Parallelism applied to a built model by functions: tensor (Megatron), sequence (Ulysses) and
data (FSDP2 / DDP).

Typical multi-node setup (launched by ``torchrun``)::

    device = init_distributed("cuda")
    mesh = make_mesh(device, tp=2)
    model = load_hf_model(path, device=device)
    parallelize(model, mesh["tp"].get_group())
    apply_fsdp(model, mesh["dp"], param_dtype=torch.bfloat16)
"""
# Names resolve on first use (PEP 562): importing the leaf parallel.collectives, as the model
# does, must not import parallel.tensor, which imports the model.
_EXPORTS = {
    "apply_ddp": "data", "apply_fsdp": "data", "balanced_dp_split": "data", "global_mean_scale": "data",
    "sp_micro_batches": "data",
    "collective_device": "collectives", "backend_for_device": "dist", "init_distributed": "dist", "make_mesh": "dist",
    "ColumnParallelLinear": "tensor", "RowParallelLinear": "tensor", "VocabParallelEmbedding": "tensor",
    "full_state_dict": "tensor", "parallelize": "tensor", "tp_shard_dims": "tensor", "unshard": "tensor",
    "apply_sequence_parallel": "sequence", "shard_sequence": "sequence",
    "ParallelDims": "dims", "parallelize_model": "dims",
    "apply_pipeline": "pipeline", "build_pipeline": "pipeline", "pipeline_state_dict": "pipeline",
    "tied_grad_sync": "pipeline", "stage_keep": "pipeline", "tied_parameter": "pipeline",
    "clip_grad_norm": "grads",
}

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
    "apply_sequence_parallel",
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
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))
