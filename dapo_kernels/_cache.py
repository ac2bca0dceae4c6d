"""Per-batch metadata computed once and reused by every layer (flash-attn's scheduler metadata).

A packed batch's ``cu_seqlens`` is one tensor that every attention layer, forward and backward,
receives. What is derived from it alone - the validation that reads it to the host, the
attention work lists, the CPU path's length buckets - is the same for all of them, so it is
computed for the first layer and looked up by the others (FLA's ``tensor_cache`` does the
same). An entry is tied to the tensor object itself (a weak reference: a new batch is a new
tensor, even at a recycled address) and to its version counter (an in-place write is a miss).
"""
from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from typing import Callable

import torch

# Entries kept per function: a step holds one batch's cu_seqlens per micro-batch in flight,
# and a function is called with a few (block, causal) variants per batch.
_SLOTS = 16


def per_tensor_cache(fn: Callable) -> Callable:
    """Memoise ``fn(t, *args)`` (``args`` hashable) on the identity and version of the tensor ``t``."""
    entries: "OrderedDict[tuple, tuple]" = OrderedDict()

    def key_of(t: torch.Tensor, args: tuple):
        try:
            return (id(t), t._version, args)
        except RuntimeError:  # an inference-mode tensor has no version counter: nothing to key on
            return None

    def store(key, t, value):
        entries[key] = (weakref.ref(t), value)
        while len(entries) > _SLOTS:
            entries.popitem(last=False)

    @functools.wraps(fn)
    def cached(t: torch.Tensor, *args):
        key = key_of(t, args)
        if key is None:
            return fn(t, *args)
        hit = entries.get(key)
        if hit is not None and hit[0]() is t:
            entries.move_to_end(key)
            return hit[1]
        value = fn(t, *args)
        store(key, t, value)
        return value

    def prime(t: torch.Tensor, *args, value) -> None:
        """Record ``value`` as ``fn(t, *args)`` without computing it: for the producer of ``t``, which
        knows it by construction (``unpad_input`` knows its ``cu_seqlens`` are valid)."""
        key = key_of(t, args)
        if key is not None:
            store(key, t, value)

    cached.prime = prime
    cached.cache_clear = entries.clear
    return cached
