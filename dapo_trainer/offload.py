"""Activation offload: checkpointed layers' inputs wait in host memory between forward and backward.

With activation checkpointing a layer keeps only its input for the backward (everything inside
is recomputed), so a forward over ``L`` layers leaves ``L`` hidden states ``[T, hidden]`` on the
device until the backward reaches them. :class:`ActivationOffload` moves them to host memory as
they are saved and brings each back when the backward needs it, through
``torch.autograd.graph.saved_tensors_hooks`` around the checkpointed layers: non-reentrant
``torch.utils.checkpoint`` saves a layer's inputs under the caller's hooks and the layer's own
tensors under its own, so these hooks see exactly the layer inputs.

On CUDA the copies run on a side stream: the copy to pinned host memory starts as the input is
saved and overlaps the next layers' forward; in the backward, bringing layer ``i``'s input back
also starts the copy of layer ``i - 1``'s, which overlaps layer ``i``'s recompute and backward.
Device memory then holds at most two layers' inputs instead of ``L``. On the CPU, host memory is
the device's: the move is a no-op (the mechanism still runs: ``stats`` counts it). Other devices
copy synchronously.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch


class OffloadedTensor:
    """One offloaded tensor: its host copy (any object a custom ``to_host`` keeps), the device it
    came from, the copy's completion event (None: nothing to wait for), the input saved before
    it (the next one the backward needs) and a prefetched device copy."""

    __slots__ = ("host", "device", "ready", "prev", "fetched")

    def __init__(self, host, device, ready=None):
        self.host, self.device, self.ready = host, device, ready
        self.prev = self.fetched = None


class ActivationOffload:
    """Saved-tensor hooks that keep the checkpointed layers' inputs in host memory.

    Set as ``Transformer.activation_offload`` (it acts with ``activation_checkpointing`` on).
    Offloads floating-point tensors that require grad (the hidden states); the rotary tables
    and ``cu_seqlens``, shared by every layer, stay where they are. ``stats`` counts the
    tensors and bytes moved each way, and the most bytes held on the host at once.
    Subclasses may override :meth:`to_host` / :meth:`to_device` (another store).
    """

    def __init__(self):
        self._streams = {}
        self.stats = {"offloaded": 0, "reloaded": 0, "bytes": 0, "held_bytes": 0, "peak_held_bytes": 0}

    def wanted(self, t: torch.Tensor) -> bool:
        return t.is_floating_point() and t.requires_grad

    def _stream(self, device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def to_host(self, t: torch.Tensor) -> OffloadedTensor:
        if t.device.type == "cpu":
            return OffloadedTensor(t, t.device)
        if t.device.type != "cuda":
            return OffloadedTensor(t.to("cpu"), t.device)
        stream = self._stream(t.device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))  # t is written on the compute stream
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # the allocator reuses t's memory only after the copy
        return OffloadedTensor(host, t.device, stream.record_event())

    def prefetch(self, saved: OffloadedTensor) -> None:
        """Start bringing ``saved`` back to its device (CUDA: on the side stream)."""
        if saved.ready is None or saved.fetched is not None:
            return
        stream = self._stream(saved.device)
        stream.wait_event(saved.ready)
        with torch.cuda.stream(stream):
            dev = saved.host.to(saved.device, non_blocking=True)
        saved.fetched = (dev, stream.record_event())

    def to_device(self, saved: OffloadedTensor) -> torch.Tensor:
        if saved.ready is None:
            return saved.host.to(saved.device)
        self.prefetch(saved)
        (dev, ready), saved.fetched = saved.fetched, None
        current = torch.cuda.current_stream(saved.device)
        current.wait_event(ready)
        dev.record_stream(current)
        return dev

    def _count(self, key: str, t: torch.Tensor, sign: int) -> None:
        s, nbytes = self.stats, t.numel() * t.element_size()
        s[key] += 1
        s["bytes"] += nbytes if sign > 0 else 0
        s["held_bytes"] += sign * nbytes
        s["peak_held_bytes"] = max(s["peak_held_bytes"], s["held_bytes"])

    def hooks(self):
        """A ``saved_tensors_hooks`` context for one forward (its inputs chain for prefetching)."""
        last = [None]

        def pack(t):
            if not self.wanted(t):
                return t
            saved = self.to_host(t)
            saved.prev, last[0] = last[0], saved
            self._count("offloaded", t, +1)
            return saved

        def unpack(saved):
            if not isinstance(saved, OffloadedTensor):
                return saved
            t = self.to_device(saved)
            if saved.prev is not None:
                self.prefetch(saved.prev)
            self._count("reloaded", t, -1)
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def offload_scope(offload: Optional[ActivationOffload]):
    """``offload.hooks()``, or a no-op context for None."""
    return nullcontext() if offload is None else offload.hooks()
