"""What the checkpoint manager needs of a tensor backend, and the plain-torch one.

The manager (manager.py) is written against ``Backend``: waiting for the device to finish the steps
dispatched to it, staging a state dict to host memory (the only part training waits for), the DCP planners that read and write it, creating an optimizer's
state before loading into it, and fetching whole tensors for the export. ``xla.py`` is the
PyTorch/XLA SPMD backend the trainer runs on; ``TorchBackend`` here is plain torch on CPU
(single process, or DTensors over a gloo group), which the tests use to check the manager's
behaviour without XLA, and the shape a torch-native TPU backend (DTensor/FSDP2) would take.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class Backend(Protocol):
    """The tensor runtime under a checkpoint."""

    # The trainer backend whose tensor code this is ("xla", "native"): recorded in every checkpoint's
    # writer file (layout.WRITER) and compared with it when an index cannot be read.
    name: str

    @property
    def process_index(self) -> int: ...

    @property
    def process_count(self) -> int: ...

    def wait_for_device(self) -> None:
        """Returns once the device has finished every step dispatched to it, so ``stage`` copies the
        state as of this step boundary. The device keeps computing those steps meanwhile: the time
        is not lost to training (a runtime that computes when it is called has nothing to wait for)."""
        ...

    def stage(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """A host-memory copy of this process's part of ``state`` (nested dicts of tensors), taken
        now (after ``wait_for_device``): training may change the tensors as soon as this returns.
        Every process calls it."""
        ...

    def save_planner(self) -> Any: ...

    def load_planner(self) -> Any: ...

    def prime_optimizer(self, optimizer: Any) -> None:
        """Create the optimizer's state (in the parameters' layout) so a checkpoint loads into it.
        May change the parameters: load them afterwards."""
        ...

    def full_tensors(self, tensors: list[Any]) -> list[Any]:
        """Whole CPU copies of (possibly sharded) tensors. A collective: every process calls it."""
        ...

    def barrier(self) -> None: ...

    def broadcast_object(self, value: Any) -> Any:
        """Process 0's ``value`` (any picklable object), on every process. A collective: every
        process calls it; what the others pass is ignored."""
        ...


def broadcast_over_default_group(value: Any) -> Any:
    """``Backend.broadcast_object`` over torch.distributed's default group, if one is initialised
    (with one process there is nothing to send)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class TorchBackend:
    """Plain torch tensors (or DTensors) on CPU, with torch.distributed's default group if initialised.

    ``process_group``: the group DCP's collectives use (manager.py), when training runs collectives
    of its own on the default group (the native backend: a gloo group of every process, apart)."""

    name = "native"

    def __init__(self, process_group: Any = None) -> None:
        self.process_group = process_group

    @property
    def process_index(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    @property
    def process_count(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def wait_for_device(self) -> None:
        return None  # eager CPU tensors: every operation is done when it returns

    def stage(self, state: Mapping[str, Any]) -> dict[str, Any]:
        # DCP's own blocking stager: new host tensors (a DTensor keeps its mesh and placements with a
        # host copy of its shard), so on a TPU the device memory is not doubled by the staged copy
        # and the write reads host memory; on CPU it is one copy, as a clone.
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        return dict(BlockingAsyncStager().stage(dict(state)))

    def save_planner(self) -> Any:
        from torch.distributed.checkpoint import DefaultSavePlanner

        return DefaultSavePlanner()

    def load_planner(self) -> Any:
        from torch.distributed.checkpoint import DefaultLoadPlanner

        return DefaultLoadPlanner()

    def prime_optimizer(self, optimizer: Any) -> None:
        import torch

        saved = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = 0.0
            for param in group["params"]:
                if param.requires_grad:
                    param.grad = torch.zeros_like(param)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr

    def full_tensors(self, tensors: list[Any]) -> list[Any]:
        out = []
        for tensor in tensors:
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            out.append(full.detach().cpu())
        return out

    def barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def broadcast_object(self, value: Any) -> Any:
        return broadcast_over_default_group(value)
