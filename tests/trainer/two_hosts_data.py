"""One "host" of a two-process check of what the HF Trainer feeds under SPMD once torch.distributed's
default group exists (``python two_hosts_data.py RANK PORT OUT_DIR``).

On a slice, checkpoint/xla.py starts a gloo default group of the run's processes for DCP. Under
SPMD every host must feed the *same* global batch (each transfers only its own devices' shards), so
that group must not make the Trainer split the data by process. Each process here: PJRT CPU with two
devices and SPMD on (as ``tpuft train``), a gloo default group of both processes started *before*
the Trainer exists (stricter than train.py, which starts it after), then the Trainer that tpuft
builds (train._build_trainer), and every batch of its training dataloader for two epochs. The test
(test_checkpoint_units.py) compares the two processes' batches.

What it cannot show: two processes joined into one SPMD program (torch_xla 2.9's CPU client cannot),
so ``xr.world_size()`` here is each process's own; on a slice it is 1 as well under SPMD (torch_xla's
``_xla_get_all_devices`` returns the one virtual device), which only a slice can confirm.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import tiny

ROWS, SEQ_LEN, BATCH = 24, 8, 4


def observe(rank: int, port: int) -> dict[str, Any]:
    import torch.distributed as dist
    from datasets import Dataset

    from tpuft_trainer import fsdp_v2, mesh
    from tpuft_trainer.config import MeshConfig, TrainerConfig
    from tpuft_trainer.train import _build_trainer
    from tpuft_trainer.world import check_one_feeder

    fsdp_v2.use_fsdp_v2()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    shape = mesh.plan_mesh(MeshConfig(), 2)
    fsdp_v2.use_mesh(mesh.build_mesh(shape))
    out = Path(tempfile.mkdtemp(prefix=f"two-hosts-{rank}-"))
    config = TrainerConfig.model_validate(
        {
            "model": {"name": "tiny", "dtype": "float32"},
            "dataset": {"name": "rows"},
            "training": {"epochs": 2, "per_device_batch_size": BATCH // shape.batch_ways, "seed": 7},
            "output": {"uri": str(out)},
        }
    )
    # Row i is all i: a batch's rows are read back from its first column.
    rows = Dataset.from_dict(
        {"input_ids": [[i] * SEQ_LEN for i in range(ROWS)], "labels": [[i] * SEQ_LEN for i in range(ROWS)]}
    )
    model = tiny.model()
    fsdp_args = fsdp_v2.get_fsdp_training_args(model)
    trainer = _build_trainer(
        config, model, None, tiny.tokenizer(), rows, None, out, BATCH, fsdp_args, rank == 0
    )
    check_one_feeder(
        world_size=trainer.args.world_size, process_index=trainer.args.process_index
    )  # as train.py
    loader = trainer.get_train_dataloader()
    epochs = []
    for epoch in range(2):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        epochs.append([batch["input_ids"][:, 0].cpu().tolist() for batch in loader])
    observed = {
        "default_group_world_size": dist.get_world_size(),
        "args_world_size": trainer.args.world_size,
        "args_process_index": trainer.args.process_index,
        "parallel_mode": str(trainer.args.parallel_mode),
        "accelerator_num_processes": trainer.accelerator.num_processes,
        "sampler": type(getattr(loader, "_loader", loader).get_sampler()).__name__
        if hasattr(getattr(loader, "_loader", loader), "get_sampler")
        else None,
        "epochs": epochs,
    }
    dist.destroy_process_group()
    return observed


if __name__ == "__main__":
    rank, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    (out_dir / f"rank{rank}.json").write_text(json.dumps(observe(rank, port)))
