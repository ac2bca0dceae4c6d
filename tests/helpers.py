"""Shared test helpers: readable ids, backends, poisoning checks, exact comparisons, and the
rendezvous of multi-process (gloo) tests. The tolerance rule and error measures: tests/tolerance.py."""
from __future__ import annotations

import os
import socket
import sys
from typing import Callable, Iterable, Optional

import torch

import dapo_kernels as dk

BACKENDS = ("torch", "triton")
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


def case_id(**kw) -> str:
    """case_id(B=2, T=63, D=96, dtype=torch.bfloat16) -> 'B2-T63-D96-bf16'."""
    parts = []
    for k, v in kw.items():
        if isinstance(v, torch.dtype):
            parts.append(DTYPE_NAMES.get(v, str(v).replace("torch.", "")))
        elif isinstance(v, bool):
            parts.append(k if v else f"no{k}")
        else:
            parts.append(f"{k}{v}")
    return "-".join(parts)


def backend(name: str):
    """Context manager forcing ``name`` ('torch' | 'triton')."""
    return dk.use_backend(name)


def assert_no_nan(t: torch.Tensor, name: str = "output") -> None:
    if t.is_floating_point() and t.numel():
        n = torch.isnan(t).sum().item()
        assert n == 0, f"{name}: {n} NaN element(s) - unwritten (poisoned) output or bad numerics"


def assert_equal(out: torch.Tensor, ref: torch.Tensor, name: str = "output") -> None:
    """Exact equality (copies, integer metadata), NaN-aware so poisoned elements fail."""
    assert out.dtype == ref.dtype, f"{name}: dtype {out.dtype} != {ref.dtype}"
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert_no_nan(out, name)
    assert torch.equal(out, ref), f"{name}: differs from the reference at {int((out != ref).sum())} element(s)"


def random_lengths(n: int, max_len: int, *, allow_zero: bool = True, gen: Optional[torch.Generator] = None) -> list:
    lo = 0 if allow_zero else 1
    return torch.randint(lo, max_len + 1, (n,), generator=gen).tolist()


def cu_seqlens_from(lengths: Iterable[int], device="cpu") -> torch.Tensor:
    lengths = list(lengths)
    cu = [0]
    for L in lengths:
        cu.append(cu[-1] + int(L))
    return torch.tensor(cu, dtype=torch.int32, device=device)


def snapshot(*tensors: torch.Tensor):
    """Copies to check later that a failing call left its inputs unchanged."""
    return [t.clone() for t in tensors]


def assert_unchanged(before, *tensors) -> None:
    for i, (a, b) in enumerate(zip(before, tensors)):
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                     and torch.equal(a.nan_to_num(), b.nan_to_num())), f"input {i} was modified"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process_group_entry(rank: int, worker: Callable, world: int, port: int, backend: str, init_kw: dict, args):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world, **init_kw)
    try:
        worker(rank, *args)
        # Every rank done with its collectives before any tears down: gloo aborted a rank whose peer's
        # group was destroyed while it was still finishing ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # A passing rank leaves without interpreter teardown: groups still held by a DeviceMesh or FSDP state
    # were destroyed there, after their peer had gone, and gloo aborted the process (SIGABRT, 1 in ~100s).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_process_group(worker: Callable, world: int, *args, backend: str = "gloo", **init_kw) -> None:
    """Run ``worker(rank, *args)`` in ``world`` spawned processes joined in one process group
    (``backend``, rendezvous on a free local port, ``init_kw`` passed to ``init_process_group``),
    destroyed when the worker returns or raises; waits for all of them. ``worker`` must be a
    module-level function (spawn pickles it)."""
    import torch.multiprocessing as mp

    mp.start_processes(_process_group_entry, args=(worker, world, free_port(), backend, init_kw, args),
                       nprocs=world, start_method="spawn", join=True)


__all__ = [n for n in dir() if not n.startswith("_")
           and n not in ("annotations", "math", "os", "socket", "sys", "torch", "dk", "Callable", "Iterable",
                         "Optional")]
