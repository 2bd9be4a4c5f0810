"""This worker's runtime: the process group, the device and the DeviceMesh.

On a TPU host TorchTPU (`torch_tpu`) registers the ``tpu`` device and the ``tpu_dist`` process group
backend, but only when it finds chips (there is no CPU fallback): there the group is ``tpu_dist`` and
tensors live on ``tpu:<local rank>``. Anywhere else (the CPU tests, the local demo) the group is gloo
and tensors stay on the CPU. The TPU branch is written from TorchTPU's documentation and tests
(``init_process_group("tpu_dist")``, ``init_device_mesh("tpu", ...)``) and runs only on a slice:
docs/trainer.md lists it among what only a slice can verify.

The mesh has the xla backend's batch axes (mesh.py): ``dcn`` (slices) x ``data`` x ``fsdp``, one
process per chip, ranks slice-major (node rank = slice x hosts_per_slice + host, as the launcher
sets it). FSDP2 shards parameters over ``fsdp`` and replicates them over ``dcn`` x ``data`` (HSDP
when that is more than 1); every rank holds a different part of the global batch.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from tpuft_trainer.config import MeshConfig
from tpuft_trainer.errors import ConfigError
from tpuft_trainer.mesh import MeshShape, plan_mesh

log = logging.getLogger(__name__)

REPLICATE, SHARD = "replicate", "fsdp"


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: Any  # torch.device
    backend: str  # the process group's: "gloo" or "tpu_dist"
    shape: MeshShape
    mesh: Any  # DeviceMesh, (replicate, fsdp) or (fsdp,)

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def on_tpu(self) -> bool:
        return self.backend == "tpu_dist"


def tpu_available() -> bool:
    """TorchTPU is installed and found chips (it registers the ``tpu`` device only then)."""
    try:
        import torch
        import torch_tpu  # noqa: F401  (registers the device)
    except ImportError:
        return False
    return bool(hasattr(torch, "tpu") and torch.tpu.is_available())


def start(mesh_config: MeshConfig) -> Runtime:
    """Joins the process group the launcher's agent set up (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the
    environment) and builds the mesh over every process."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if tpu_available():
        backend, device_type = "tpu_dist", "tpu"
        device = torch.device("tpu", local_rank)
    else:
        backend, device_type = "gloo", "cpu"
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if mesh_config.tensor > 1:  # the contract refuses it (config.py); a hand-written config too
        raise ConfigError(
            "fsdp.mesh.tensor > 1 runs on backend xla only: the native backend has no tensor parallelism"
        )
    shape = plan_mesh(mesh_config, world_size)
    replicate = shape.dcn * shape.data
    if replicate > 1:
        mesh = init_device_mesh(device_type, (replicate, shape.fsdp), mesh_dim_names=(REPLICATE, SHARD))
    else:
        mesh = init_device_mesh(device_type, (shape.fsdp,), mesh_dim_names=(SHARD,))
    log.info(
        "native backend: rank %d of %d on %s (%s), mesh dcn=%d x data=%d x fsdp=%d",
        rank,
        world_size,
        device,
        backend,
        shape.dcn,
        shape.data,
        shape.fsdp,
    )
    return Runtime(rank, world_size, local_rank, device, backend, shape, mesh)


def all_reduce_sum(value: Any) -> Any:
    """The sum over every process of a tensor (in place, returned)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def stop_group() -> Any:
    """A gloo group of every process for the stop agreement (stop.py): CPU integers, apart from the
    training collectives (on TPU those go over tpu_dist)."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def checkpoint_group() -> Any:
    """A gloo group of every process for torch.distributed.checkpoint: a periodic save writes in a
    background thread while the loop runs its own collectives on the default group, and two threads
    must never issue collectives on one group. Gloo: the staged copies are in host memory."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def finish() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
