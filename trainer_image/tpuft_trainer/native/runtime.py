"""This worker's runtime: the process group, the device and the DeviceMesh.

On a TPU host TorchTPU (`torch_tpu`) registers the ``tpu`` device and the ``tpu_dist`` process group
backend, but only when it finds chips (there is no CPU fallback): there the group is ``tpu_dist`` and
tensors live on ``tpu:<local rank>``. Anywhere else (the CPU tests, the local demo) the group is gloo
and tensors stay on the CPU. The TPU branch is written from TorchTPU's documentation and tests
(``init_process_group("tpu_dist")``, ``init_device_mesh("tpu", ...)``) and runs only on a slice:
docs/trainer.md lists it among what only a slice can verify.

The mesh has the xla backend's axes in its order (mesh.py): ``dcn`` (slices) x ``data`` x ``fsdp`` x
``tensor``, one process per chip, ranks slice-major (node rank = slice x hosts_per_slice + host, as
the launcher sets it) and row-major over the axes, as the xla backend numbers its devices: ``tensor``
is innermost, so a tensor group is consecutive ranks (one host's chips) and rank r sits at batch
part ``r // tensor`` of the xla backend's split over dcn x data x fsdp. FSDP2 shards parameters over
``fsdp`` and replicates them over ``dcn`` x ``data`` (HSDP when that is more than 1); the decoder
projections are also split over ``tensor`` (model.py). The ranks of one tensor group hold the same
rows of the global batch (they compute one replica's forward together); each tensor group a
different part.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from tpuft_trainer.config import MeshConfig
from tpuft_trainer.mesh import MeshShape, plan_mesh

log = logging.getLogger(__name__)

REPLICATE, SHARD, TENSOR = "replicate", "fsdp", "tensor"


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: Any  # torch.device
    backend: str  # the process group's: "gloo" or "tpu_dist"
    shape: MeshShape
    mesh: Any  # DeviceMesh: (replicate?, fsdp, tensor?), the axes of size 1 left out

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def shard_mesh(self) -> Any:
        """What FSDP2 shards over: (replicate, fsdp) or (fsdp,)."""
        if self.shape.tensor == 1:
            return self.mesh
        names = tuple(name for name in self.mesh.mesh_dim_names if name != TENSOR)
        return self.mesh[names]

    @property
    def tensor_mesh(self) -> Any:
        """The ``tensor`` axis (tensor parallelism), or None when it has size 1."""
        return self.mesh[TENSOR] if self.shape.tensor > 1 else None

    @property
    def data_rank(self) -> int:
        """Which part of the global batch this process reads: its tensor group's (``tensor`` innermost)."""
        return self.rank // self.shape.tensor

    @property
    def data_ways(self) -> int:
        """How many parts the global batch is split into (processes / tensor)."""
        return self.shape.batch_ways

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
    shape = plan_mesh(mesh_config, world_size)
    replicate = shape.dcn * shape.data
    # Row-major like the xla backend's device order (mesh.py); axes of size 1 are left out so an
    # fsdp-only run's parameters keep their 1-D placements (and its checkpoints their layout).
    dims = [(REPLICATE, replicate), (SHARD, shape.fsdp), (TENSOR, shape.tensor)]
    kept = [(name, size) for name, size in dims if size > 1 or name == SHARD]
    mesh = init_device_mesh(
        device_type,
        tuple(size for _, size in kept),
        mesh_dim_names=tuple(name for name, _ in kept),
    )
    log.info(
        "native backend: rank %d of %d on %s (%s), mesh dcn=%d x data=%d x fsdp=%d x tensor=%d",
        rank,
        world_size,
        device,
        backend,
        shape.dcn,
        shape.data,
        shape.fsdp,
        shape.tensor,
    )
    return Runtime(rank, world_size, local_rank, device, backend, shape, mesh)


def all_reduce_sum(value: Any) -> Any:
    """The sum over every process of a tensor (in place, returned)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def batch_sum(value: Any, rt: Runtime) -> Any:
    """The sum over the global batch of a per-process figure of its rows (loss sums, loss-token
    counts): every process of a tensor group holds the same rows and the same figure, so the sum over
    every process counts each part ``tensor`` times. In place, returned."""
    all_reduce_sum(value)
    if rt.shape.tensor > 1:
        value /= rt.shape.tensor
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
