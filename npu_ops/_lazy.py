"""Lazy, failure-tolerant access to ``torch_npu``.

``torch_npu`` is optional: on a machine without the CANN libraries its import raises
(ImportError, or OSError / RuntimeError from a missing ``libascendcl.so``). Nothing here
imports it at module load; the first NPU kernel that runs does, and a failure becomes
one ``RuntimeError`` line naming the cause instead of a traceback from inside CANN.
"""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Optional

import torch

# Set on the first failed import so every later call reports the same cause cheaply.
_error: Optional[str] = None


def torch_npu() -> ModuleType:
    """The ``torch_npu`` module, imported on first use.

    Raises:
        RuntimeError: one line saying why Ascend NPU ops are unavailable.
    """
    global _error
    mod = sys.modules.get("torch_npu")
    if mod is not None:
        return mod
    if _error is None:
        try:
            import torch_npu as mod  # noqa: F401  (registers the "npu" device with torch)

            return mod
        except Exception as exc:  # a broken CANN install raises OSError/RuntimeError, not only ImportError
            _error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    raise RuntimeError(
        f"dapo_kernels NPU ops need torch_npu (Ascend CANN), which could not be imported ({_error}); "
        "CPU and CUDA ops are unaffected"
    )


def reset() -> None:
    """Forget a failed import (tests, or after fixing the environment in-process)."""
    global _error
    _error = None


def is_npu(t: torch.Tensor) -> bool:
    """True for a tensor on an Ascend NPU (torch_npu names the privateuseone device 'npu';
    no tensor can be there before torch_npu is imported)."""
    return t.device.type == "npu"
