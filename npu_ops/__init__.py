"""Ascend NPU kernels for every ``dapo_kernels`` op, on the custom ops' ``privateuseone`` key.

A tensor on ``npu`` (torch_npu's name for the ``privateuseone`` device) dispatches to
these kernels with no change in user code: ``dk.varlen_attention(q.npu(), ...)`` runs
``npu_fusion_attention``.

=============================================  ==============================================
custom op                                      NPU kernel
=============================================  ==============================================
``varlen_attention_fwd`` / ``_bwd``            ``npu_fusion_attention`` / ``_grad``, TND
                                               (:mod:`npu_ops.varlen_attention`)
``linear_log_probs`` / ``_bwd``,               chunked fp32 logits + online statistics
``fused_linear_policy_loss``                   (:mod:`npu_ops.linear_log_probs`)
``index_rows``, ``scatter_rows``,              the ops' device-agnostic torch paths
``packed_position_ids``, ``group_filter``,     (:mod:`npu_ops.generic`)
``overlong_penalty``, ``policy_loss_*``,
``rollout_correction``
=============================================  ==============================================

The model's fused NPU kernels (RMSNorm, RoPE, SwiGLU) live with the model, in
:mod:`dapo_trainer.npu_model_ops`.

Loading: this package registers its kernels itself, through :mod:`dapo_kernels.backend_api`
(the only module of ``dapo_kernels`` it imports), when it is imported or when its entry point
``dapo_kernels.backends: npu = npu_ops:register`` is called. ``import dapo_kernels`` imports
nothing of it: the first ``dapo`` op that sees a ``privateuseone`` tensor loads the entry
points, so users do nothing either way. Registering touches only the dispatcher's
``PrivateUse1`` entries and imports no torch_npu, so the import order of ``dapo_kernels``
and ``torch_npu`` is irrelevant. ``torch_npu`` is imported by the first NPU kernel that
needs it (:func:`torch_npu`); without it an NPU op raises one ``RuntimeError`` line, and
CPU / CUDA are never affected.
"""
from __future__ import annotations

from typing import Callable, Dict

from dapo_kernels.backend_api import OUT_OF_TREE_DEVICE, device_kernels, register_device_kernels

from . import generic, linear_log_probs, varlen_attention
from ._lazy import is_npu, torch_npu

__all__ = ["register", "kernels", "registered", "torch_npu", "is_npu"]

# torch_npu renames privateuseone to "npu" at its import; we register under the generic name,
# which the dispatcher resolves either way, and never rename it ourselves.
DEVICE_TYPE = OUT_OF_TREE_DEVICE


def kernels() -> Dict[str, Callable]:
    """{custom op name: NPU kernel}, one per ``dapo::`` custom op."""
    table = {
        "dapo::varlen_attention_fwd": varlen_attention.varlen_attention_fwd,
        "dapo::varlen_attention_bwd": varlen_attention.varlen_attention_bwd,
        "dapo::linear_log_probs": linear_log_probs.linear_log_probs,
        "dapo::linear_log_probs_bwd": linear_log_probs.linear_log_probs_bwd,
        "dapo::fused_linear_policy_loss": linear_log_probs.fused_linear_policy_loss,
    }
    table.update(generic.kernels())
    return table


def register(device_type: str = DEVICE_TYPE) -> None:
    """Register every NPU kernel on ``device_type``'s key of its ``dapo`` custom op (idempotent).

    ``device_type`` other than ``privateuseone`` is for tests only: the CPU-only test
    suite routes CPU tensors through these kernels (with a fake torch_npu) in a
    subprocess to check the wiring end to end.
    """
    register_device_kernels(device_type, kernels())


def registered() -> Dict[str, bool]:
    """{custom op name: whether this package's kernel is registered on privateuseone} (a ``dapo`` op
    that has none still carries dapo_kernels' backend loader on that key)."""
    have = device_kernels(DEVICE_TYPE)
    return {name: name in have for name in kernels()}


# At the end of the package's own import: by now the dapo custom ops exist (backend_api
# imported dapo_kernels).
register()
