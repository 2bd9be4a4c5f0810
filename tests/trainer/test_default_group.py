"""What the HF Trainer feeds when torch.distributed's default group is up: on a slice,
checkpoint/xla.py starts a gloo group of the run's processes for DCP, and under SPMD every host must
still feed the same global batch. Two real processes (two_hosts_data.py), each with SPMD over two
PJRT CPU devices and a gloo default group of both, build the Trainer as ``tpuft train`` does and
read their training dataloaders. What this cannot show (one SPMD program across the two processes)
is in docs/trainer.md, "torch.distributed's default group and the Trainer"."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest
from spmd import PYTHON, spmd_env
from two_hosts_data import BATCH, ROWS

pytestmark = pytest.mark.trainer

SCRIPT = Path(__file__).with_name("two_hosts_data.py")


def test_a_default_group_of_two_processes_leaves_every_host_the_same_global_batches(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = spmd_env(2)
    hosts = [
        subprocess.Popen(
            [PYTHON, str(SCRIPT), str(rank), str(port), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [host.communicate(timeout=300)[0] for host in hosts]
    assert [host.returncode for host in hosts] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    first, second = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert first["default_group_world_size"] == second["default_group_world_size"] == 2
    # accelerate takes the world from the XLA runtime (one virtual device under SPMD), not from the
    # default group: no process splits the data.
    for seen in (first, second):
        assert (seen["args_world_size"], seen["args_process_index"], seen["accelerator_num_processes"]) == (
            1,
            0,
            1,
        )
        assert seen["parallel_mode"] == "ParallelMode.TPU"
        assert seen["sampler"] == "SeedableRandomSampler"
    for epoch in first["epochs"]:
        # Whole global batches, every row once per epoch: nothing was split off to another process.
        assert all(len(b) == BATCH for b in epoch)
        assert sorted(r for b in epoch for r in b) == list(range(ROWS))
    assert first["epochs"][0] != first["epochs"][1]  # shuffled anew each epoch (set_epoch)
    assert first["epochs"] == second["epochs"]  # and the same order on both hosts
