"""The PyTorch/XLA SPMD backend of the checkpoint manager: torch_xla's DCP planners, a staging copy
of each process's own chunks, and optimizer priming.

Waiting for the device (``torch_xla.sync()`` + ``wait_device_ops``, ``wait_for_device``): the steps
the training loop dispatched ahead run to their end. Staging, after it: every sharded
tensor's *local* shards are copied to host memory, one chunk per distinct offset: a chunk that several
of this host's devices hold (the ``data`` or ``tensor`` axes replicate some tensors) is copied once.
That also keeps the checkpoint whole: torch_xla 2.9's ``dedup_tensors`` drops *every* copy of a
chunk that appears twice in one process's plan, so a plan with replicas wrote an empty checkpoint
without an error (trap C in shared/facts/distributed-checkpoint.md; tests/trainer cover a mesh with
data=2). Across hosts DCP keeps the first copy of each chunk: each host writes only chunks no lower
rank holds. Tensors that are not sharded (replicated, or on the CPU like AdamW's step counters) are
copied whole and written by the coordinator.

Priming: ``torch_xla``'s ``prime_optimizer`` (a step with zero gradients), which creates the state
in the parameters' shardings and changes the parameters: the manager loads the weights after it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tpuft_trainer import compat
from tpuft_trainer.checkpoint.backend import broadcast_over_default_group


def _offsets(indices: Any) -> tuple[int, ...]:
    if indices is Ellipsis:
        return ()
    return tuple(int(index.start or 0) for index in indices)


class XlaBackend:
    """torch_xla SPMD: one process per host, every local device's shards staged by that process."""

    name = "xla"

    def __init__(self) -> None:
        import torch.distributed as dist
        import torch_xla.runtime as xr

        self._process_index = xr.process_index()
        self._process_count = xr.process_count()
        if self._process_count > 1 and not dist.is_initialized():
            # DCP's collectives (plan exchange, the coordinator's metadata) run over a gloo group of
            # the SPMD program's processes; torch_xla's xla:// rendezvous finds them on a TPU slice.
            import torch_xla.distributed.xla_backend  # noqa: F401  (registers xla://)

            dist.init_process_group("gloo", init_method="xla://")

    @property
    def process_index(self) -> int:
        return self._process_index

    @property
    def process_count(self) -> int:
        return self._process_count

    def wait_for_device(self) -> None:
        # The loop runs ahead of the device: at a step boundary the step's graph (and maybe the one
        # before) is dispatched but not finished. The device computes it meanwhile.
        import torch_xla
        import torch_xla.core.xla_model as xm

        torch_xla.sync()
        xm.wait_device_ops()

    def stage(self, state: Mapping[str, Any]) -> dict[str, Any]:
        import torch

        return {key: self._stage_value(value, torch) for key, value in state.items()}

    def _stage_value(self, value: Any, torch: Any) -> Any:
        if isinstance(value, Mapping):
            return {key: self._stage_value(item, torch) for key, item in value.items()}
        if not isinstance(value, torch.Tensor):
            return value
        if value.device.type != "xla":
            return value.detach().clone()  # e.g. AdamW's step: updated in place by the next step
        if not compat.is_sharded(value):
            return torch_xla_cpu([value])[0]
        return _local_unique_shards(value)

    def save_planner(self) -> Any:
        from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

        return SPMDSavePlanner()

    def load_planner(self) -> Any:
        from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

        return SPMDLoadPlanner()

    def prime_optimizer(self, optimizer: Any) -> None:
        from torch_xla.experimental.distributed_checkpoint import prime_optimizer

        prime_optimizer(optimizer)
        optimizer.zero_grad(set_to_none=True)

    def full_tensors(self, tensors: list[Any]) -> list[Any]:
        return compat.cpu_copies(tensors)

    def barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def broadcast_object(self, value: Any) -> Any:
        # The gloo group __init__ started (several processes) carries it, as it does DCP's plans.
        return broadcast_over_default_group(value)


def torch_xla_cpu(tensors: list[Any]) -> list[Any]:
    import torch_xla

    return list(torch_xla._XLAC._xla_get_cpu_tensors(tensors))


def _local_unique_shards(tensor: Any) -> Any:
    """torch_xla's ``_CpuShards`` of ``tensor``: this process's shards, each distinct chunk once."""
    import torch_xla
    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.distributed_checkpoint._helpers import _CpuShards

    shards = torch_xla._XLAC._get_local_shards([tensor])[0]
    placements = torch_xla._XLAC._get_local_shard_replica_and_indices([tensor])[0]
    kept, seen = [], set()
    for (data, device), (replica, indices) in zip(shards, placements, strict=True):
        offsets = _offsets(indices)
        if offsets in seen:
            continue
        seen.add(offsets)
        kept.append(xs.XLAShard(data, indices, device, replica))
    return _CpuShards(shards=kept, global_shape=tensor.shape)
