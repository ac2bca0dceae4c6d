"""Packing, group filtering, policy loss, rollout correction, MoE experts on Ascend: the ops' own torch paths.

These ops are index gathers / scatters, segment reductions and elementwise math, which
torch_npu runs natively, so the NPU kernel of each is its torch implementation from the
backend registry. Registering it on ``privateuseone`` (instead of leaving the op's
generic body to pick) pins it: ``DAPO_KERNELS_BACKEND=triton`` or ``dk.use_backend("triton")``
then still never hands an NPU tensor to a CUDA Triton kernel.

Not verified on hardware: the policy-loss, group-filter and rollout-correction torch paths do their per-token
math and sums in fp64, which torch_npu may run on the AI CPU (slow, ``[N]``-sized) or reject; the MoE experts'
padded ``bmm`` is plain matmul work (torch_npu's ``npu_grouped_matmul`` would skip the padding: not used yet).
"""
from __future__ import annotations

from typing import Callable, Dict

from dapo_kernels.backend_api import torch_implementation

# dapo custom op -> backend-registry name of its implementation (the same name for all;
# listed so a renamed or new op shows up in tests instead of silently missing an NPU path).
TORCH_PATH_OPS = (
    "index_rows",            # dk.unpad_input (and pad_input's backward)
    "scatter_rows",          # dk.pad_input (and unpad_input's backward)
    "packed_position_ids",
    "group_filter",
    "overlong_penalty",
    "policy_loss_sums",
    "policy_loss_grad",
    "rollout_correction",    # dk.rollout_correction: index_add_ / scatter_reduce over fp64 token tables
    "moe_experts_fwd",       # dk.moe_experts / fused_moe: bmm over the experts padded to the largest count
    "moe_experts_bwd",
)


def torch_path(name: str) -> Callable:
    """Kernel running the registry's ``torch`` implementation of ``name`` on the inputs' device."""
    kernel = torch_implementation(name)
    kernel.__name__ = kernel.__qualname__ = f"{name}_npu"
    return kernel


def kernels() -> Dict[str, Callable]:
    """{custom op name: NPU kernel} for the torch-path ops."""
    return {f"dapo::{name}": torch_path(name) for name in TORCH_PATH_OPS}
