"""Ascend NPU kernels for every ``dapo_kernels`` op, on the custom ops' ``privateuseone`` key.

A tensor on ``npu`` (torch_npu's name for the ``privateuseone`` device) dispatches to
these kernels with no change in user code: ``dk.varlen_attention(q.npu(), ...)`` runs
``npu_fusion_attention``.

=============================================  ==============================================
custom op                                      NPU kernel
=============================================  ==============================================
``varlen_attention_fwd`` / ``_bwd``            ``npu_fusion_attention`` / ``_grad``, TND
                                               (:mod:`npu_ops.attention`)
``linear_log_probs`` / ``_bwd``,               chunked fp32 logits + online statistics
``fused_linear_policy_loss``                   (:mod:`npu_ops.loss`)
``index_rows``, ``scatter_rows``,              the ops' device-agnostic torch paths
``packed_position_ids``, ``group_filter``,     (:mod:`npu_ops.generic`)
``overlong_penalty``, ``policy_loss_*``
=============================================  ==============================================

The model pieces of ``dapo_trainer`` (RMSNorm, RoPE, SwiGLU) are in
:mod:`npu_ops.model_ops`, called by the model itself.

Loading: importing this package registers the kernels, and ``import dapo_kernels``
imports it (see ``dapo_kernels/__init__.py``), so users do nothing. Registering touches
only the dispatcher's ``PrivateUse1`` entries and imports no torch_npu, so it is done
unconditionally; that makes the import order of ``dapo_kernels`` and ``torch_npu``
irrelevant. ``torch_npu`` is imported by the first NPU kernel that needs it
(:mod:`npu_ops._lazy`); without it an NPU op raises one ``RuntimeError`` line, and CPU /
CUDA are never affected.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch

from . import attention, generic, loss

__all__ = ["register", "kernels", "registered"]

# The backend name torch_npu gives privateuseone; we register under the generic key and
# never rename it ourselves (torch_npu does, at its import).
DEVICE_TYPE = "privateuseone"
_DISPATCH_KEY = "PrivateUse1"


def kernels() -> Dict[str, Callable]:
    """{custom op name: NPU kernel}, one per ``dapo::`` custom op."""
    table = {
        "dapo::varlen_attention_fwd": attention.varlen_attention_fwd,
        "dapo::varlen_attention_bwd": attention.varlen_attention_bwd,
        "dapo::linear_log_probs": loss.linear_log_probs,
        "dapo::linear_log_probs_bwd": loss.linear_log_probs_bwd,
        "dapo::fused_linear_policy_loss": loss.fused_linear_policy_loss,
    }
    table.update(generic.kernels())
    return table


def register(device_type: str = DEVICE_TYPE) -> None:
    """Register every NPU kernel on ``device_type``'s key of its ``dapo`` custom op (idempotent).

    ``device_type`` other than ``privateuseone`` is for tests only: the CPU-only test
    suite routes CPU tensors through these kernels (with a fake torch_npu) in a
    subprocess to check the wiring end to end.
    """
    for name, fn in kernels().items():
        torch.library.register_kernel(name, device_type, fn)


def registered() -> Dict[str, bool]:
    """{custom op name: whether a PrivateUse1 kernel is registered}, from the dispatcher."""
    return {name: torch._C._dispatch_has_kernel_for_dispatch_key(name, _DISPATCH_KEY) for name in kernels()}


# At the end of the package's own import, whichever of dapo_kernels / npu_ops came first:
# by now the dapo custom ops exist (the submodules above imported dapo_kernels).
register()
