"""Process groups: the backend follows the device, the launch is ``torchrun``'s."""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from .collectives import BACKENDS as _BACKENDS

# The variable that restricts which accelerators a process sees (set per process by launchers).
VISIBLE_DEVICES_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


def visible_devices_env(device) -> str:
    """'CUDA_VISIBLE_DEVICES' for cuda, 'ASCEND_RT_VISIBLE_DEVICES' for npu (Ascend)."""
    dev_type = str(device).split(":")[0]
    if dev_type not in VISIBLE_DEVICES_ENV:
        raise ValueError(f"device: no visible-devices variable for {dev_type!r} (known: {sorted(VISIBLE_DEVICES_ENV)})")
    return VISIBLE_DEVICES_ENV[dev_type]


def backend_for_device(device) -> str:
    """'gloo' for cpu, 'nccl' for cuda, 'hccl' for npu (Ascend, via torch_npu)."""
    dev_type = torch.device(device).type
    if dev_type == "privateuseone":  # torch_npu registers "npu" under this key
        dev_type = "npu"
    if dev_type not in _BACKENDS:
        raise ValueError(f"device: no collective backend for device type {dev_type!r} "
                         f"(known: {sorted(_BACKENDS)})")
    return _BACKENDS[dev_type]


def init_distributed(device, *, timeout_s: Optional[float] = None) -> torch.device:
    """Join the process group ``torchrun`` describes (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    Picks the backend from ``device`` and, for accelerators, binds this process to
    ``LOCAL_RANK``'s device. Returns the device this rank computes on. A no-op when
    the group already exists.
    """
    if str(device).startswith("npu"):  # "npu" is a device name only once torch_npu is imported
        from npu_ops import torch_npu
        torch_npu()
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, int(os.environ.get("LOCAL_RANK", 0)))
    if device.type != "cpu":
        getattr(torch, device.type).set_device(device)
    if not dist.is_initialized():
        kw = {}
        if timeout_s is not None:
            import datetime

            kw["timeout"] = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend=backend_for_device(device), **kw)
    return device


def make_mesh(device, *, tp: int = 1, sp: int = 1, pp: int = 1):
    """2-D ``DeviceMesh`` ("dp", "tp") over all ranks, tensor-parallel ranks adjacent; with
    ``sp > 1`` 3-D ("dp", "sp", "tp"), sequence-parallel ranks next (Ulysses all-to-alls, four per
    layer each way, also want the fast links).

    Adjacent ranks share a node, so the TP all-reduces (two per layer) stay on the
    fastest links; ``mesh["tp"].get_group()`` goes to ``parallelize``, ``mesh["sp"].get_group()``
    to ``apply_sequence_parallel`` and ``mesh["dp"]`` to ``apply_fsdp``. With ``pp > 1`` 3-D
    ("pp", "dp", "tp"), pipeline ranks outermost: a stage boundary sends one activation per
    micro-batch each way, the least traffic of all dimensions, so it may cross nodes.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if pp > 1:
        if sp > 1 or tp < 1 or world % (tp * pp):
            raise ValueError(f"pp x tp must divide the world size {world} (sp 1), got pp={pp}, tp={tp}, sp={sp}")
        return init_device_mesh(torch.device(device).type, (pp, world // (tp * pp), tp),
                                mesh_dim_names=("pp", "dp", "tp"))
    if tp < 1 or sp < 1 or world % (tp * sp):
        raise ValueError(f"tp x sp must divide the world size {world}, got tp={tp}, sp={sp}")
    if sp == 1:
        return init_device_mesh(torch.device(device).type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return init_device_mesh(torch.device(device).type, (world // (tp * sp), sp, tp), mesh_dim_names=("dp", "sp", "tp"))
