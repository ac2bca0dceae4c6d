"""Watch ``torch.distributed``'s collectives in one process: count them, and check the device
of every tensor they get against a simulated accelerator.

NCCL (HCCL) takes CUDA (NPU) tensors only; gloo takes anything on the CPU, so a CPU-only run
never sees the error a host tensor would raise on GPUs. :class:`CollectiveAudit` with
``simulate="cuda"`` makes the CPU play both parts, host and accelerator: a
:class:`torch.overrides.TorchFunctionMode` marks as *host* every tensor built by a factory
without a ``device`` (or with the string ``"cpu"``), moved by ``.cpu()``, or computed from host
tensors only; a ``device=torch.device(...)`` argument, ``.to(device)`` or a non-host input
makes a tensor a *device* one (so do tensors torch builds in C++: gradients, loaded weights).
A host tensor handed to a collective is what NCCL would reject: the audit raises there.

Usage (inside each rank's process)::

    with CollectiveAudit(simulate="cuda") as audit:
        audit.phase = "forward"
        ...
    audit.counts()  # {(phase, name): calls}
"""
from __future__ import annotations

import weakref
from collections import Counter

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from dapo_trainer.parallel import collective_device

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single")
# Factories place their result on the default (host) device unless told otherwise.
_FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
              torch.linspace, torch.rand, torch.randn, torch.randint, torch.randperm, torch.from_numpy}


def _tensors(tree):
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class _HostTracker(TorchFunctionMode):
    """Marks host tensors (module docstring); ``is_host(t)`` reads the mark."""

    def __init__(self):
        super().__init__()
        self._host = {}  # id -> weakref (tensors compare elementwise, so no WeakSet)

    def _mark(self, t, host: bool):
        key = id(t)
        if host:
            self._host[key] = weakref.ref(t, lambda _, k=key: self._host.pop(k, None))
        else:
            self._host.pop(key, None)

    def is_host(self, t) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = _tensors((args, kwargs))
        device = kwargs.get("device")
        if func is torch.Tensor.to:
            device = next((a for a in args[1:] if isinstance(a, (str, torch.device))), device)
        if func is torch.Tensor.cpu or (isinstance(device, str) and device.startswith("cpu")):
            host = True
        elif device is not None:
            host = False
        elif func in _FACTORIES:
            host = not inputs  # torch.as_tensor(t) hands back t itself
        else:
            host = bool(inputs) and all(self.is_host(t) for t in inputs)
        for t in _tensors(out):
            self._mark(t, host)
        return out


class CollectiveAudit:
    """Patches the collectives of ``torch.distributed`` while active (see the module docstring).

    Each call is recorded as ``(phase, name)``; ``phase`` is whatever the caller set last.
    ``simulate``: the accelerator type the run stands for (e.g. "cuda"); None checks only
    the real device against the group's backend.
    """

    def __init__(self, simulate=None):
        self.simulate = simulate
        self.phase = ""
        self.calls = []
        self._saved = {}
        self._inside = False
        self._tracker = _HostTracker() if simulate else None

    def counts(self) -> Counter:
        return Counter(self.calls)

    def _check(self, name, tensors, group):
        want = collective_device(group)
        for t in tensors:
            if t.device != want:
                raise AssertionError(f"{name}: a tensor on {t.device}, but the group's backend "
                                     f"{dist.get_backend(group)} serves {want}")
            if self._tracker is not None and self._tracker.is_host(t):
                raise AssertionError(f"{name}: a host tensor {tuple(t.shape)} {t.dtype}; on {self.simulate} "
                                     f"the backend would reject it (it must live on the model's device)")

    def _wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            # Under a TorchFunctionMode the collective re-enters itself (through the module
            # global, i.e. this wrapper) via handle_torch_function: count the outer call only.
            if self._inside:
                return fn(*args, **kwargs)
            self.calls.append((self.phase, name))
            self._check(name, _tensors((args, {k: v for k, v in kwargs.items() if k != "group"})),
                        kwargs.get("group"))
            self._inside = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside = False
        return wrapper

    def __enter__(self):
        mods = (dist, dist.distributed_c10d)
        for name in COLLECTIVES:
            fn = getattr(dist.distributed_c10d, name)
            wrapped = self._wrap(name, fn)
            for mod in mods:
                self._saved[(mod, name)] = getattr(mod, name)
                setattr(mod, name, wrapped)
        if self._tracker is not None:
            self._tracker.__enter__()
        return self

    def __exit__(self, *exc):
        if self._tracker is not None:
            self._tracker.__exit__(*exc)
        for (mod, name), fn in self._saved.items():
            setattr(mod, name, fn)
        self._saved.clear()
        return False
