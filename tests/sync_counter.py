"""Count the host reads of tensor values (each a device->host sync on a GPU), on the CPU.

Two doors lead from a tensor's values to Python:

* the dispatcher: ``_local_scalar_dense`` (``.item()``, ``int(t)``, ``bool(t)``, ...), and the ops
  whose output size depends on the values (``nonzero``, ``masked_select``, ``unique``, boolean
  indexing, ...), which on CUDA wait for the device to learn that size. A ``TorchDispatchMode``
  sees them, including inside ``dapo`` custom ops: their bodies are run with the mode active.
* ``Tensor.tolist()`` / ``.numpy()`` / ``.item()`` and the number protocols, which on a CPU tensor
  read memory without the dispatcher: they are wrapped for the duration of the count.

Each read is counted once (a wrapped method that also dispatches ``_local_scalar_dense`` counts
as one), with the Python stack that made it, so a failing budget names the line to fix.
"""
from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass, field
from typing import Iterator, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that read values to the host (or size their output from them).
SYNC_OPS = frozenset({
    "_local_scalar_dense", "nonzero", "nonzero_static_out", "argwhere", "masked_select", "unique", "_unique",
    "_unique2", "unique_consecutive", "unique_dim", "repeat_interleave", "masked_scatter", "equal", "is_nonzero",
    "_assert_scalar",
})
# Ops that read when one of their indices (args[1]) is a boolean mask.
_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
# Tensor methods that read values without (or before) the dispatcher on a CPU tensor.
_METHODS = ("tolist", "numpy", "item", "__bool__", "__int__", "__float__", "__index__", "__complex__")


@dataclass
class SyncCount:
    """Reads seen: ``count`` and, per read, ``(what, stack summary)``."""

    reads: List[tuple] = field(default_factory=list)
    state: dict = field(default_factory=lambda: {"in_method": False, "paused": False})

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Reads inside this block are not counted (host-side preparation around the code measured)."""
        before = self.state["paused"]
        self.state["paused"] = True
        try:
            yield
        finally:
            self.state["paused"] = before

    @property
    def count(self) -> int:
        return len(self.reads)

    def report(self) -> str:
        return "\n".join(f"{i}: {what}\n{where}" for i, (what, where) in enumerate(self.reads)) or "no reads"


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-3] if "sync_counter" not in f.filename]
    return "".join(traceback.format_list(frames[-6:]))


class _Mode(TorchDispatchMode):
    def __init__(self, counter: SyncCount, state: dict):
        super().__init__()
        self.counter, self.state = counter, state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        # repeat_interleave by an int, or told its output size, reads nothing; indexing with a boolean mask
        # is a nonzero() inside aten.
        sized = name == "repeat_interleave" and (kwargs.get("output_size") is not None
                                                 or func._overloadname == "self_int")
        masked = name in _INDEX_OPS and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ()))
        if (name in SYNC_OPS and not sized or masked) and not (self.state["in_method"] or self.state["paused"]):
            self.counter.reads.append((f"aten::{name}", _where()))
        if func.namespace == "dapo":
            # Run the custom op's body with this mode still active, so the reads inside count.
            from torch._library.custom_ops import OPDEFS

            opdef = OPDEFS.get(f"dapo::{func._opname}")
            if opdef is not None:
                with self:
                    return opdef._init_fn(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_syncs() -> Iterator[SyncCount]:
    """``with count_host_syncs() as c: ...`` then ``c.count`` / ``c.report()``."""
    counter = SyncCount()
    state = counter.state
    saved = {name: getattr(torch.Tensor, name) for name in _METHODS}

    def wrap(name, orig):
        def method(self, *args, **kwargs):
            outer = not state["in_method"]
            if outer:
                if not state["paused"]:
                    counter.reads.append((f"Tensor.{name}", _where()))
                state["in_method"] = True
            try:
                return orig(self, *args, **kwargs)
            finally:
                if outer:
                    state["in_method"] = False

        return method

    for name, orig in saved.items():
        setattr(torch.Tensor, name, wrap(name, orig))
    try:
        with _Mode(counter, state):
            yield counter
    finally:
        for name, orig in saved.items():
            setattr(torch.Tensor, name, orig)
