"""The device mesh: from the configuration to the global SPMD mesh that is in force while training.

Axes, outermost first: ``dcn`` (slices, over the data-centre network), then within a slice (ICI)
``data`` x ``fsdp`` x ``tensor``. Parameters are sharded along ``fsdp`` (torch_xla's FSDPv2 requires an
axis of that name); the batch is split over ``dcn``, ``data`` and ``fsdp``. Axes of size 1 are kept so
every sharding spec names the same four axes whatever the shape.

transformers' Trainer installs its own 1-D mesh in ``__init__``; ``install`` must run again after the
Trainer is built (``fsdp_v2.use_mesh`` has compat's ``mesh_wins`` do it after every Trainer's
``__init__``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tpuft_trainer.config import MeshConfig
from tpuft_trainer.errors import ConfigError

AXIS_NAMES: tuple[str, str, str, str] = ("dcn", "data", "fsdp", "tensor")
# The axes a batch is split over (outermost first): each holds a different part of the global batch.
BATCH_AXES: tuple[str, str, str] = ("dcn", "data", "fsdp")


@dataclass(frozen=True)
class MeshShape:
    dcn: int
    data: int
    fsdp: int
    tensor: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.dcn, self.data, self.fsdp, self.tensor)

    @property
    def ici_shape(self) -> tuple[int, int, int, int]:
        return (1, self.data, self.fsdp, self.tensor)

    @property
    def dcn_shape(self) -> tuple[int, int, int, int]:
        return (self.dcn, 1, 1, 1)

    @property
    def devices(self) -> int:
        return self.dcn * self.data * self.fsdp * self.tensor

    @property
    def batch_ways(self) -> int:
        """How many parts the global batch is split into."""
        return self.dcn * self.data * self.fsdp


def plan_mesh(config: MeshConfig, num_devices: int) -> MeshShape:
    """Axis sizes for ``num_devices`` devices. ``fsdp`` defaults to whatever the other axes leave."""
    if config.dcn_data < 1 or num_devices % config.dcn_data:
        raise ConfigError(f"{num_devices} devices cannot be split into {config.dcn_data} slices (dcn_data)")
    per_slice = num_devices // config.dcn_data
    fsdp = config.fsdp
    if fsdp is None:
        other = config.data * config.tensor
        if per_slice % other:
            raise ConfigError(
                f"mesh data={config.data} x tensor={config.tensor} does not divide the {per_slice} "
                f"devices of a slice ({num_devices} devices over {config.dcn_data} slice(s))"
            )
        fsdp = per_slice // other
    shape = MeshShape(dcn=config.dcn_data, data=config.data, fsdp=fsdp, tensor=config.tensor)
    if shape.devices != num_devices:
        raise ConfigError(
            f"mesh dcn_data={shape.dcn} x data={shape.data} x fsdp={shape.fsdp} x tensor={shape.tensor} "
            f"= {shape.devices} devices, but the runtime has {num_devices}; the product must equal the "
            "device count"
        )
    return shape


def build_mesh(shape: MeshShape) -> Any:
    """The torch_xla mesh for ``shape``. On TPU a HybridMesh orders devices by their physical ICI
    topology and slice (it needs TPU device attributes); elsewhere (CPU) a logical mesh in device-id
    order, which is all a host-memory "interconnect" can have."""
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    if xr.device_type() == "TPU":
        return xs.HybridMesh(
            ici_mesh_shape=shape.ici_shape, dcn_mesh_shape=shape.dcn_shape, axis_names=AXIS_NAMES
        )
    if shape.dcn > 1:
        raise ConfigError("a mesh across slices (dcn_data > 1) needs TPU devices; this runtime has none")
    return xs.Mesh(np.arange(shape.devices), shape.shape, AXIS_NAMES)


def install(mesh: Any) -> None:
    import torch_xla.distributed.spmd as xs

    xs.set_global_mesh(mesh)


def current_mesh_shape() -> dict[str, int]:
    """The global mesh in force, as ``{axis: size}``; what tests assert during training."""
    import torch_xla.distributed.spmd as xs

    mesh = xs.get_global_mesh()
    if mesh is None:
        return {}
    return dict(zip(mesh.axis_names or (), mesh.mesh_shape, strict=True))


# Megatron-style tensor parallelism as SPMD annotations: the projections that fan out (column-parallel)
# split their output features over `tensor`, the ones that fan back in (row-parallel) their input
# features; the other dimension stays sharded over `fsdp`. XLA's partitioner inserts the collectives.
COLUMN_PARALLEL = frozenset(
    {"q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj"}
)
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})


def tensor_parallel_spec(name: str, param: Any) -> tuple[str, str] | None:
    """The Megatron-style layout of a decoder projection's weight over ``tensor`` (and ``fsdp``), or
    None for any other parameter. ``name`` may carry wrapper parts (``_orig_module``, peft's
    ``base_layer``)."""
    parts = [part for part in name.split(".") if part not in {"_orig_module", "base_layer"}]
    if param.dim() != 2 or len(parts) < 2 or parts[-1] != "weight":
        return None
    if parts[-2] in COLUMN_PARALLEL:
        return ("tensor", "fsdp")
    if parts[-2] in ROW_PARALLEL:
        return ("fsdp", "tensor")
    return None


def shard_tensor_parallel(model: Any, mesh: Any) -> int:
    """Re-annotate the decoder projections of an FSDPv2-wrapped ``model`` for the ``tensor`` axis.
    Returns how many weights were annotated (0 when the axis has size 1). Run after wrapping and before
    the first step (train.py does it when training begins), so optimizer state follows the new layout.
    (The sharded loader, loading.py, lays them out so from the start.)"""
    import torch_xla.distributed.spmd as xs

    sizes = dict(zip(mesh.axis_names or (), mesh.mesh_shape, strict=True))
    if sizes.get("tensor", 1) == 1:
        return 0
    annotated = 0
    for name, param in model.named_parameters():
        spec = tensor_parallel_spec(name, param)
        if spec is None:
            continue
        xs.clear_sharding(param)
        xs.mark_sharding(param, mesh, spec)
        annotated += 1
    return annotated
