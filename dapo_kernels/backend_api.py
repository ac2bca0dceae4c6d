"""What an out-of-tree backend (a device this package has no kernels for) may use.

A backend package such as ``npu_ops`` (Ascend) imports this module and nothing else of
``dapo_kernels``; everything here keeps its name and meaning across releases, unlike the
private modules behind it.

Registering
    A backend calls :func:`register_device_kernels` with ``{"dapo::op": kernel}`` for the
    device type it serves (``"privateuseone"`` for torch's out-of-tree devices) and declares
    an entry point so that users need not import it::

        # setup.py / pyproject.toml of the backend
        [project.entry-points."dapo_kernels.backends"]
        npu = "npu_ops:register"

    ``import dapo_kernels`` imports no backend. The first time a custom op sees a
    ``privateuseone`` tensor, :func:`load_backends` calls every entry point of the group,
    and the op runs again on the kernel just registered. Each kernel takes the custom op's
    arguments (see ``torch.ops.dapo.<op>.default._schema``) and returns what the op returns.

Reusing the ops' own pieces
    * :func:`torch_implementation` - an op's device-generic torch code (index gathers,
      segment sums, elementwise math run natively on most devices);
    * :class:`LossHead` - the fused loss's per-token head, built from ``LossTokens._make(tokens)``
      and ``LossParams._make(params)`` (the custom op's lists): ``head(log_prob, entropy, slice)``
      gives ``(d loss / d log_prob, d loss / d entropy, torch.stack(LossSums) fp64)``;
    * :func:`combine_stats`, :func:`dlogits_`, :func:`all_reduce` - the row statistics of
      ``linear_log_probs``: partial ``[S, N, 4]`` (max, sum-exp, sum-exp * z, target logit)
      to ``(lse, log_prob, entropy)``, the logits gradient, and the all-reduce over the
      op's process-group key;
    * :func:`check_tensor`, :func:`check_int` - argument checks with the ops' error messages;
    * :func:`per_tensor_cache` - memoise per-batch metadata (host lists of ``cu_seqlens``, index
      maps) on a tensor's identity and version, so every layer reuses it.
"""
from __future__ import annotations

from typing import Callable

import torch

from ._cache import per_tensor_cache
from ._registry import (BACKEND_ENTRY_POINTS, OUT_OF_TREE_DEVICE, custom_op_names, device_kernels, dispatch,
                        load_backends, register_device_kernels, use_backend)
from .ops._row_stats import all_reduce, combine_stats, dlogits_
from .ops.fused_linear_policy_loss import LossHead, LossParams, LossSums, LossTokens
from .validation import check_int, check_tensor

__all__ = [
    "BACKEND_ENTRY_POINTS", "OUT_OF_TREE_DEVICE", "register_device_kernels", "device_kernels", "load_backends",
    "custom_op_names", "torch_implementation", "LossHead", "LossParams", "LossSums", "LossTokens", "combine_stats",
    "dlogits_", "all_reduce",
    "check_tensor", "check_int", "per_tensor_cache",
]


def torch_implementation(name: str) -> Callable:
    """The registry's ``torch`` implementation of ``name`` (a custom op or a kernel-level name such as
    ``"varlen_attention_fwd"``), run as such whatever backend is forced: a kernel built on it never
    hands a tensor of another device to a CUDA Triton kernel."""

    def kernel(*args):
        with use_backend("torch"):
            # The device only steers the backend choice, which use_backend fixes.
            return dispatch(name, torch.device("cpu"))(*args)

    kernel.__name__ = kernel.__qualname__ = f"{name}_torch"
    kernel.__doc__ = f"dapo::{name}: the device-generic torch implementation."
    return kernel

