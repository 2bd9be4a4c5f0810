"""One rank of a two-process run on plain torch (``python two_ranks.py RANK PORT DIR``): DTensors sharded
over a gloo group, saved by the CheckpointManager and exported by export.py as the hosts of a slice
would, each process writing only what it holds. test_checkpoint_units.py starts two and reads what
they left."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tpuft_trainer import export
from tpuft_trainer.checkpoint import layout
from tpuft_trainer.checkpoint.backend import TorchBackend
from tpuft_trainer.checkpoint.manager import CheckpointManager

FULL_SHAPES = {"model.embed.weight": (8, 4), "model.norm.weight": (6,), "lm_head.weight": (10, 4)}


def full_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator) for name, shape in FULL_SHAPES.items()}


def main(rank: int, port: int, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    sharded = {name: distribute_tensor(t, mesh, [Shard(0)]) for name, t in full_tensors().items()}
    backend = TorchBackend()
    manager = CheckpointManager(layout.Store(str(out / "run")), backend)
    small = {name: b"{}" for name in layout.SMALL_FILES}
    manager.save(3, {"model": sharded, "optim": {}}, lambda: small, reason="periodic", blocking=False)
    records = manager.wait()
    exported = export.export_weights(
        sharded, layout.Store(str(out / "run" / "model")), backend, group_bytes=150
    )
    result = {
        "records": [(r.step, r.reason) for r in records],
        "exported": exported.files,
        "written_here": exported.written_here,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
