"""Backend registry: which implementation of an op runs for a given device.

Every public op is a ``torch.library`` custom op in the ``dapo`` namespace. Its
device-generic body calls :func:`dispatch`, which picks an implementation here:

================  =========================  ======================================
device type       default backend            where it lives
================  =========================  ======================================
``cuda``          ``triton``                 ``dapo_kernels/ops/*`` Triton kernels
``cpu``           ``torch``                  vectorised torch in the same op file
``privateuseone`` ``npu`` (registered by     ``npu_ops`` (registers its kernels on
                  ``npu_ops``)               the custom ops' ``privateuseone`` key)
================  =========================  ======================================

``DAPO_KERNELS_BACKEND=triton|torch`` or ``with dk.use_backend("triton"):`` forces a
backend for every device; CPU tests use it to run the Triton kernels through
``TRITON_INTERPRET=1`` and compare them with the torch path and the reference.
An op without a Triton kernel falls back to its torch implementation.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable, Dict, Iterator, Optional

import torch

BACKENDS = ("triton", "torch")
_ENV = "DAPO_KERNELS_BACKEND"

_impls: Dict[str, Dict[str, Callable]] = {}
_local = threading.local()


def triton_interpreted() -> bool:
    """True when Triton kernels run in the interpreter (CPU tensors welcome).

    Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when
    ``dapo_kernels`` is imported; setting it later has no effect on our kernels.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def register(op: str, backend: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as the ``backend`` implementation of ``op``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    def deco(fn: Callable) -> Callable:
        _impls.setdefault(op, {})[backend] = fn
        return fn

    return deco


def _forced_backend() -> Optional[str]:
    stack = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    env = os.environ.get(_ENV, "").strip().lower()
    if env in ("", "auto"):
        return None
    if env not in BACKENDS:
        raise ValueError(f"{_ENV} must be one of {BACKENDS} or 'auto', got {env!r}")
    return env


@contextlib.contextmanager
def use_backend(backend: Optional[str]) -> Iterator[None]:
    """Force ``backend`` ('triton', 'torch' or None for the default) inside the block.

    Same meaning as the ``DAPO_KERNELS_BACKEND`` environment variable, and it wins
    over it. Thread-local.
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(backend)
    try:
        yield
    finally:
        stack.pop()


def current_backend(device: torch.device | str) -> str:
    """The backend an op on ``device`` runs with right now."""
    forced = _forced_backend()
    if forced is not None:
        return forced
    dev_type = torch.device(device).type
    return "triton" if dev_type == "cuda" else "torch"


def dispatch(op: str, device: torch.device) -> Callable:
    """The implementation of ``op`` for a tensor on ``device``."""
    impls = _impls.get(op)
    if not impls:
        raise NotImplementedError(f"dapo::{op} has no registered implementation")
    backend = current_backend(device)
    fn = impls.get(backend) or impls["torch"]
    if fn is impls.get("triton") and torch.device(device).type == "cpu" and not triton_interpreted():
        raise RuntimeError(
            f"dapo::{op}: the triton backend was forced for CPU tensors, but Triton kernels only run "
            "on the CPU in interpreter mode; set TRITON_INTERPRET=1 before importing dapo_kernels"
        )
    return fn


def registered_ops() -> Dict[str, tuple]:
    """{op name: backends it has}, for docs and tests."""
    return {k: tuple(sorted(v)) for k, v in sorted(_impls.items())}
