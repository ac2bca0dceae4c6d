"""Per-batch metadata computed once and reused by every layer (flash-attn's scheduler metadata).

A packed batch's ``cu_seqlens`` is one tensor that every attention layer, forward and backward,
receives. What is derived from it alone - the validation that reads it to the host, the
attention work lists, the CPU path's length buckets - is the same for all of them, so it is
computed for the first layer and looked up by the others (FLA's ``tensor_cache`` does the
same). An entry lives exactly as long as its tensor (a weak reference whose death drops it: a
new batch is a new tensor, even at a recycled address, and a step's many micro-batches never
evict each other) and holds only for the tensor's current version (an in-place write is a miss).
"""
from __future__ import annotations

import functools
import weakref
from typing import Callable, Dict

import torch


def per_tensor_cache(fn: Callable) -> Callable:
    """Memoise ``fn(t, *args)`` (``args`` hashable) on the identity and version of the tensor ``t``."""
    # id(t) -> (weak reference to t, t's version, {args: value})
    entries: Dict[int, tuple] = {}

    def slot(t: torch.Tensor):
        # Under torch.compile the tensor is a fake one of this trace: nothing to remember it by.
        if torch.compiler.is_compiling():
            return None
        try:
            version = t._version
        except RuntimeError:  # an inference-mode tensor has no version counter: nothing to key on
            return None
        key = id(t)
        entry = entries.get(key)
        if entry is None or entry[0]() is not t or entry[1] != version:
            def drop(ref, key=key):
                if entries.get(key, (None,))[0] is ref:
                    del entries[key]

            entry = (weakref.ref(t, drop), version, {})
            entries[key] = entry
        return entry[2]

    @functools.wraps(fn)
    def cached(t: torch.Tensor, *args):
        values = slot(t)
        if values is None:
            return fn(t, *args)
        if args not in values:
            values[args] = fn(t, *args)
        return values[args]

    def prime(t: torch.Tensor, *args, value) -> None:
        """Record ``value`` as ``fn(t, *args)`` without computing it: for the producer of ``t``, which
        knows it by construction (``unpad_input`` knows its ``cu_seqlens`` are valid)."""
        values = slot(t)
        if values is not None:
            values[args] = value

    cached.prime = prime
    cached.cache_clear = entries.clear
    return cached
