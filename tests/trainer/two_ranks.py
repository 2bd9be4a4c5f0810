"""One rank of a two-process run on plain torch over a gloo group (``python two_ranks.py MODE RANK PORT
DIR``), as the hosts of a slice; test_checkpoint_units.py starts two and reads what they left.

- ``save``: DTensors sharded over the group, saved by the CheckpointManager and exported by export.py,
  each process writing only what it holds;
- ``resume``: where to resume from, for the checkpoints under DIR/<case>, while this process's reads
  of checkpoint-4's index fail (an injected EIO): in case ``rank0-once`` rank 0's first read, in case
  ``rank1-always`` every read of rank 1's.
"""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tpuft_trainer import export
from tpuft_trainer.checkpoint import layout
from tpuft_trainer.checkpoint.backend import TorchBackend
from tpuft_trainer.checkpoint.manager import CheckpointManager
from tpuft_trainer.checkpoint.resume import agree_on_resume_point

FULL_SHAPES = {"model.embed.weight": (8, 4), "model.norm.weight": (6,), "lm_head.weight": (10, 4)}


def full_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator) for name, shape in FULL_SHAPES.items()}


def save(rank: int, out: Path) -> None:
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


RESUME_CASES = {"rank0-once": (0, 1), "rank1-always": (1, -1)}  # case -> (failing rank, failures)


class FlakyFileSystem(LocalFileSystem):
    """Local files behind ``flaky://``; opening a file whose path ends with ``failing`` for reading
    raises EIO, ``failures`` times (-1: always)."""

    protocol = "flaky"
    failing = ""
    failures = 0

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        path = str(path)
        return super()._strip_protocol(path[len("flaky://") :] if path.startswith("flaky://") else path)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        flaky = type(self)
        if "r" in mode and flaky.failing and path.endswith(flaky.failing) and flaky.failures != 0:
            flaky.failures -= 1
            raise OSError(errno.EIO, "Input/output error (injected)", path)
        return super()._open(path, mode, **kwargs)


def resume(rank: int, out: Path) -> None:
    fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
    result = {}
    for case, (failing_rank, failures) in RESUME_CASES.items():
        FlakyFileSystem.failing = f"checkpoint-4/{layout.DCP_METADATA}"
        FlakyFileSystem.failures = failures if rank == failing_rank else 0
        agreed = agree_on_resume_point(
            layout.Store(f"flaky://{out / case}"), TorchBackend(), backoff_seconds=0.05
        )
        found = agreed.point.checkpoint
        result[case] = {
            "step": found.step if found else None,
            "skipped": [f.name for f in agreed.point.skipped],
        }
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    mode, rank, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    {"save": save, "resume": resume}[mode](rank, out)
    dist.destroy_process_group()
