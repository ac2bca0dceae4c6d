"""Checkpoints that a killed run resumes from exactly.

Layout under ``<trainer.default_local_dir>/checkpoints``::

    global_step_N/model/              HF safetensors + config.json + tokenizer files (loadable anywhere)
    global_step_N/optim_rank{r}.pt    optimiser + LR schedule of rank r (its own TP shard)
    global_step_N/state_rank{r}.pt    step, data cursor, the accumulator's carried-over groups, RNG states
    latest_checkpointed_iteration.txt N (verl's name)

A checkpoint is written into ``.global_step_N.tmp`` and renamed when every rank has
finished, and the ``latest`` file is replaced the same way, so a crash at any moment
leaves the previous checkpoint intact and never a half-written one marked as latest.
"""
from __future__ import annotations

import os
import random
import shutil
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

LATEST_FILE = "latest_checkpointed_iteration.txt"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def accumulator_state(acc) -> dict:
    return acc.state_dict()


def load_accumulator_state(acc, state: dict) -> None:
    acc.load_state_dict(state)


def _atomic_torch_save(obj, path: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def latest_checkpoint(ckpt_root: str) -> Optional[str]:
    """Directory of the newest complete checkpoint under ``ckpt_root``, or None."""
    path = os.path.join(ckpt_root, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        step = int(f.read().strip())
    d = os.path.join(ckpt_root, f"global_step_{step}")
    return d if os.path.isdir(d) else None


def save_checkpoint(ckpt_root: str, step: int, *, model, full_state: dict, optimizer, scheduler, trainer_state: dict,
                    model_src_dir: Optional[str] = None) -> str:
    """Write ``global_step_{step}`` (collective: every rank calls it). Returns its path.

    ``full_state``: the unsharded model ``state_dict`` (every rank gathers it; rank 0 writes).
    ``trainer_state``: this rank's picklable state (cursor, accumulator, step, ...).
    """
    from .hf_io import save_hf_model

    rank = _rank()
    final = os.path.join(ckpt_root, f"global_step_{step}")
    tmp = os.path.join(ckpt_root, f".global_step_{step}.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    if rank == 0:
        save_hf_model(model, os.path.join(tmp, "model"), state_dict=full_state)
        for name in _TOKENIZER_FILES:  # so the checkpoint is a usable model directory
            if model_src_dir and os.path.isfile(os.path.join(model_src_dir, name)):
                shutil.copy(os.path.join(model_src_dir, name), os.path.join(tmp, "model", name))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
               os.path.join(tmp, f"optim_rank{rank}.pt"))
    torch.save({**trainer_state, "rng": rng_state()}, os.path.join(tmp, f"state_rank{rank}.pt"))
    _barrier()
    if rank == 0:
        if os.path.isdir(final):  # re-saving a step (e.g. after a resume) replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest = os.path.join(ckpt_root, LATEST_FILE)
        with open(latest + ".tmp", "w") as f:
            f.write(str(step))
        os.replace(latest + ".tmp", latest)
    _barrier()
    return final


def load_checkpoint(ckpt_dir: str, *, optimizer, scheduler) -> dict:
    """Restore optimiser, schedule and RNG of this rank from ``ckpt_dir``; return its trainer state.

    The model weights are read by the trainer from ``ckpt_dir/model`` when it builds the model.
    """
    rank = _rank()
    path = os.path.join(ckpt_dir, f"state_rank{rank}.pt")
    if not os.path.isfile(path):
        raise ValueError(f"trainer.resume_mode: checkpoint {ckpt_dir!r} has no state for rank {rank}; "
                         "resume with the same number of processes it was written with")
    optim = torch.load(os.path.join(ckpt_dir, f"optim_rank{rank}.pt"), weights_only=False)
    optimizer.load_state_dict(optim["optimizer"])
    scheduler.load_state_dict(optim["scheduler"])
    state = torch.load(path, weights_only=False)
    set_rng_state(state.pop("rng"))
    return state
