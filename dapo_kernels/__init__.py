"""dapo_kernels: kernels for DAPO / GRPO reinforcement-learning training of LLMs.

``import dapo_kernels as dk`` and call the ops as drop-in replacements for what verl,
TRL and flash-attn provide. Each op is a ``torch.library`` custom op (namespace
``dapo``) dispatched per device by :mod:`dapo_kernels._registry`.
"""
from ._registry import current_backend, registered_ops, use_backend
from .balancing import attention_workload, balanced_partitions, micro_batches, pipeline_order
from .ops.group_filter import GroupFilterResult, group_filter, overlong_penalty
from .ops.linear_log_probs import fused_linear_policy_loss, kl_penalty, linear_log_probs
from .ops.packing import pad_input, packed_position_ids, unpad_input
from .ops.policy_loss import policy_loss
from .ops.varlen_attention import varlen_attention
from .sampling import DynamicBatchAccumulator, DynamicSamplingExhausted

# Importing npu_ops registers the Ascend NPU kernels on the ops' privateuseone key. It
# imports no torch_npu, so it is safe everywhere and independent of import order.
try:
    import npu_ops  # noqa: F401
except ModuleNotFoundError as _e:  # an install without the npu_ops package
    if _e.name != "npu_ops":
        raise

__version__ = "0.1.0"

__all__ = [
    "balanced_partitions",
    "micro_batches",
    "attention_workload",
    "pipeline_order",
    "policy_loss",
    "linear_log_probs",
    "fused_linear_policy_loss",
    "kl_penalty",
    "group_filter",
    "overlong_penalty",
    "GroupFilterResult",
    "DynamicBatchAccumulator",
    "DynamicSamplingExhausted",
    "use_backend",
    "current_backend",
    "registered_ops",
    "unpad_input",
    "pad_input",
    "packed_position_ids",
    "varlen_attention",
]
