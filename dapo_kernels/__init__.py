"""dapo_kernels: kernels for DAPO / GRPO reinforcement-learning training of LLMs.

``import dapo_kernels as dk`` and call the ops as drop-in replacements for what verl,
TRL and flash-attn provide. The tensor ops (packing, attention, log-probs, losses, group
filter, rollout correction, MoE experts) are ``torch.library`` custom ops (namespace ``dapo``) dispatched per device by
:mod:`dapo_kernels._registry`; ``kl_penalty`` is plain differentiable torch, the balancing
functions run in C++ on host integers, and ``DynamicBatchAccumulator`` is a Python class.
"""
from ._registry import current_backend, install_backend_loaders, load_backends, registered_ops, use_backend
from .balancing import attention_workload, balanced_partitions, micro_batches, pipeline_order
from .ops.group_filter import GroupFilterResult, group_filter
from .ops.fused_linear_policy_loss import fused_linear_policy_loss
from .ops.kl_penalty import KL_TYPES, kl_penalty
from .ops.linear_log_probs import linear_log_probs
from .ops.moe import (MoEPermutation, fused_moe, moe_experts, moe_load_balancing_loss, moe_permute, moe_route,
                      moe_tokens_per_expert, moe_unpermute)
from .ops.overlong_penalty import overlong_penalty
from .ops.packing import pad_input, packed_position_ids, unpad_input
from .ops.policy_loss import LOSS_AGG_MODES, policy_loss
from .ops.rollout_correction import RolloutCorrectionResult, rollout_correction
from .ops.varlen_attention import varlen_attention
from .dynamic_sampling import DynamicBatchAccumulator, DynamicSamplingExhausted

# Out-of-tree backends (Ascend: npu_ops) are not imported here: each custom op gets a loader on
# its privateuseone key that finds them through their entry points on first use (_registry).
install_backend_loaders()
del install_backend_loaders

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
    "KL_TYPES",
    "LOSS_AGG_MODES",
    "group_filter",
    "overlong_penalty",
    "GroupFilterResult",
    "rollout_correction",
    "RolloutCorrectionResult",
    "DynamicBatchAccumulator",
    "DynamicSamplingExhausted",
    "use_backend",
    "current_backend",
    "registered_ops",
    "load_backends",
    "unpad_input",
    "pad_input",
    "packed_position_ids",
    "varlen_attention",
    "moe_route",
    "moe_experts",
    "fused_moe",
    "moe_permute",
    "moe_unpermute",
    "moe_load_balancing_loss",
    "moe_tokens_per_expert",
    "MoEPermutation",
]
