"""Backend registry: which implementation of an op runs for a given device.

The tensor ops are ``torch.library`` custom ops in the ``dapo`` namespace (``kl_penalty``,
the balancing functions and the accumulator are not). A custom op's device-generic body
calls :func:`dispatch`, which picks an implementation here:

================  =========================  ======================================
device type       default backend            where it lives
================  =========================  ======================================
``cuda``          ``triton``                 ``dapo_kernels/ops/*`` Triton kernels
``cpu``           ``torch``                  vectorised torch in the same op file
``privateuseone`` an out-of-tree backend      e.g. ``npu_ops`` (Ascend), found through the
                  (``npu_ops``)              ``dapo_kernels.backends`` entry point group
================  =========================  ======================================

``DAPO_KERNELS_BACKEND=triton|torch`` or ``with dk.use_backend("triton"):`` forces a
backend for every device; CPU tests use it to run the Triton kernels through
``TRITON_INTERPRET=1`` and compare them with the torch path and the reference.
An op without a Triton kernel falls back to its torch implementation.

Out-of-tree backends (devices this package has no kernels for) are packages that register
kernels on the custom ops' device key through :mod:`dapo_kernels.backend_api`. They are
found the way torch finds out-of-tree devices: an entry point in the group
``dapo_kernels.backends`` names a callable that registers them. ``import dapo_kernels``
imports none of them; every custom op gets a small loader kernel on ``privateuseone``
instead, which loads the backends the first time an op sees such a tensor and calls the op
again (now reaching the backend's kernel). Importing a backend package registers it too.
"""
from __future__ import annotations

import contextlib
import os
import threading
from importlib import metadata
from typing import Callable, Dict, Iterator, List, Optional

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


# --------------------------------------------------------------------------- out-of-tree backends
BACKEND_ENTRY_POINTS = "dapo_kernels.backends"
# Device types with kernels in this package; any other device type of a tensor is served by a
# backend registered through dapo_kernels.backend_api.
OUT_OF_TREE_DEVICE = "privateuseone"
# {device type: {"dapo::op": kernel}} as registered by backends (the dispatcher itself cannot tell
# a backend's kernel from the loader below).
_device_kernels: Dict[str, Dict[str, Callable]] = {}
_loaded_backends: Optional[List[str]] = None


def register_device_kernels(device_type: str, kernels: Dict[str, Callable]) -> None:
    """Register ``{"dapo::op": fn}`` on ``device_type``'s key of each custom op (replaces any earlier one)."""
    for name, fn in kernels.items():
        torch.library.register_kernel(name, device_type, fn)
        _device_kernels.setdefault(device_type, {})[name] = fn


def backend_kernel_serves(name: str, device: torch.device | str) -> bool:
    """True if a kernel registered through :func:`register_device_kernels` runs ``name``
    (``"dapo::op"``) for tensors on ``device``, so that no implementation of this registry does
    (whatever :func:`current_backend` says). torch_npu names the privateuseone device "npu"."""
    dev_type = torch.device(device).type
    if dev_type == torch._C._get_privateuse1_backend_name():
        dev_type = OUT_OF_TREE_DEVICE
    return name in _device_kernels.get(dev_type, {})


def device_kernels(device_type: str) -> Dict[str, Callable]:
    """``{"dapo::op": fn}`` that backends have registered on ``device_type``."""
    return dict(_device_kernels.get(device_type, {}))


def load_backends() -> List[str]:
    """Load every backend named in the ``dapo_kernels.backends`` entry point group, once.

    Each entry point is a callable (``module:function``) that registers its kernels. Returns the
    names of the entry points loaded (in the order found). A backend that fails to load raises.
    """
    global _loaded_backends
    if _loaded_backends is None:
        names = []
        for ep in sorted(metadata.entry_points(group=BACKEND_ENTRY_POINTS), key=lambda e: e.name):
            ep.load()()
            names.append(ep.name)
        _loaded_backends = names
    return list(_loaded_backends)


def _backend_loader(name: str) -> Callable:
    """The ``privateuseone`` kernel of ``dapo::name`` until a backend registers its own."""
    namespace, op_name = name.split("::")

    def kernel(*args, **kwargs):
        loaded = load_backends()
        if name not in _device_kernels.get(OUT_OF_TREE_DEVICE, {}):
            raise NotImplementedError(
                f"{name} got a {OUT_OF_TREE_DEVICE} tensor, and no dapo_kernels backend registers a kernel "
                f"for it (entry points in {BACKEND_ENTRY_POINTS!r}: {loaded or 'none'}); for Ascend NPUs install "
                "dapo-kernels with its npu_ops package")
        # The backend replaced this kernel on the dispatcher: call the op again to reach it.
        return getattr(getattr(torch.ops, namespace), op_name).default(*args, **kwargs)

    kernel.__name__ = kernel.__qualname__ = f"{op_name}_backend_loader"
    return kernel


def install_backend_loaders(namespace: str = "dapo") -> None:
    """Give every ``namespace::`` custom op without an out-of-tree kernel the loader above."""
    have = _device_kernels.get(OUT_OF_TREE_DEVICE, {})
    for name in custom_op_names(namespace):
        if name not in have:
            torch.library.register_kernel(name, OUT_OF_TREE_DEVICE, _backend_loader(name))


def custom_op_names(namespace: str = "dapo") -> List[str]:
    """Every custom op defined in ``namespace``, e.g. ``["dapo::index_rows", ...]``."""
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith(namespace + "::"))
