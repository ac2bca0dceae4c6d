"""State files: nested dicts / lists / tuples of tensors, arrays, numbers and strings, written and
read without pickle.

A state file is a safetensors file: its tensors as safetensors tensors, everything else as JSON in
the safetensors header (:func:`save_state_file`). Loading one never runs code, unlike the
``torch.load`` of a pickle, which runs whatever the file says.
"""
from __future__ import annotations

import json

import numpy as np
import torch

FORMAT = "dapo_trainer.checkpoint/2"


def _encode(obj, tensors: dict, where: str):
    """JSON-able form of ``obj``; tensors go to ``tensors`` and are referenced by name.

    JSON has no tuples, int keys or arrays, and the state needs them (``random.setstate``
    wants tuples, the optimiser's state is keyed by int): each gets a one-key tag.
    """
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        t = obj.to_local() if hasattr(obj, "to_local") else obj  # FSDP2: this rank's shard
        t = t.detach().cpu()
        # safetensors refuses views into a larger or shared storage: store those as copies.
        storage = t.untyped_storage()
        if not t.is_contiguous() or storage.nbytes() != t.numel() * t.element_size() or \
                (t.numel() and storage.data_ptr() in tensors["ptrs"]):
            t = t.contiguous().clone()
        tensors["ptrs"].add(t.untyped_storage().data_ptr())
        name = str(len(tensors["by_name"]))
        tensors["by_name"][name] = t
        return {"__tensor__": name}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": [str(obj.dtype), obj.tolist()]}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors, f"{where}[{k!r}]") for k, v in obj.items()}
        return {"__items__": [[_encode(k, tensors, where), _encode(v, tensors, f"{where}[{k!r}]")]
                              for k, v in obj.items()]}
    raise TypeError(f"checkpoint state {where} is a {type(obj).__name__}; state files hold tensors, arrays, "
                    "numbers, strings, None and lists / tuples / dicts of them")


def _decoder(tensors: dict, path: str):
    def hook(d: dict):
        tags = [k for k in d if k.startswith("__")]
        if not tags:
            return d
        if len(d) != 1:
            raise ValueError(f"{path}: malformed state entry {sorted(d)}")
        tag, v = tags[0], d[tags[0]]
        if tag == "__tensor__":
            return tensors[v]
        if tag == "__tuple__":
            return tuple(v)
        if tag == "__items__":
            return {k: val for k, val in v}
        if tag == "__ndarray__":
            return np.asarray(v[1], dtype=np.dtype(v[0]))
        raise ValueError(f"{path}: unknown state entry {tag!r}")
    return hook


def save_state_file(obj, path: str) -> None:
    """Write ``obj`` (nested dicts / lists / tuples of tensors, arrays, numbers, strings)
    as a safetensors file whose header carries the non-tensor part as JSON."""
    from safetensors.torch import save_file

    tensors = {"by_name": {}, "ptrs": set()}
    meta = json.dumps(_encode(obj, tensors, "state"))
    save_file(tensors["by_name"], path, metadata={"format": FORMAT, "state": meta})


def load_state_file(path: str):
    """Read what :func:`save_state_file` wrote. Anything else (a pickle, a truncated or
    foreign file) is a ValueError naming the file; nothing in the file is executed."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors' own error type is not public
        raise ValueError(f"{path} is not a dapo_trainer state file ({e}); pickled states are never loaded") from None
    if meta.get("format") != FORMAT or "state" not in meta:
        raise ValueError(f"{path} is not a dapo_trainer state file (header format {meta.get('format')!r})")
    try:
        return json.loads(meta["state"], object_hook=_decoder(tensors, path))
    except (json.JSONDecodeError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"{path}: malformed state ({e})") from None


def dump_state_bytes(obj) -> bytes:
    """:func:`save_state_file`'s format in memory: what a rollout worker sends the trainer
    (:mod:`dapo_trainer.async_rollout`), so that no pickle of a tensor crosses processes."""
    from safetensors.torch import save

    tensors = {"by_name": {}, "ptrs": set()}
    meta = json.dumps(_encode(obj, tensors, "state"))
    return save(tensors["by_name"], metadata={"format": FORMAT, "state": meta})


def load_state_bytes(data: bytes, where: str = "message"):
    """Read what :func:`dump_state_bytes` wrote (``where`` names the sender in errors)."""
    import struct

    from safetensors.torch import load

    try:
        n = struct.unpack("<Q", data[:8])[0]
        meta = json.loads(data[8:8 + n]).get("__metadata__") or {}
        tensors = load(data)
    except Exception as e:  # safetensors' own error type is not public
        raise ValueError(f"{where} is not a dapo_trainer state ({e})") from None
    if meta.get("format") != FORMAT or "state" not in meta:
        raise ValueError(f"{where} is not a dapo_trainer state (header format {meta.get('format')!r})")
    return json.loads(meta["state"], object_hook=_decoder(tensors, where))
