"""The native launcher's plan for a host (native/launcher.py): a pure function of the trainer config
and the pod's environment, which the operator renders (render/native_env.py)."""

from __future__ import annotations

import pytest

from tpuft_trainer.config import TrainerConfig
from tpuft_trainer.errors import WorldError
from tpuft_trainer.native.launcher import DEFAULT_MASTER_PORT, plan_launch


def config(hosts: int = 2, chips: int = 4) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "backend": "native",
            "model": {"name": "m"},
            "dataset": {"name": "d"},
            "training": {"max_steps": 2},
            "output": {"uri": "/tmp/out"},
            "world": {"hosts_per_slice": hosts, "chips_per_host": chips},
        }
    )


HOSTS = {"TPU_WORKER_HOSTNAMES": "h0,h1", "MASTER_ADDR": "h0"}


def test_one_process_per_chip_and_the_pinned_node_rank() -> None:
    # The operator pins NODE_RANK to the completion index; it wins over TPU_WORKER_ID.
    plan = plan_launch(config(), {**HOSTS, "TPU_WORKER_ID": "0", "NODE_RANK": "1", "NNODES": "2"})
    assert (plan.nnodes, plan.nproc_per_node, plan.node_rank) == (2, 4, 1)
    assert (plan.master_addr, plan.master_port) == ("h0", DEFAULT_MASTER_PORT)
    assert "--nproc-per-node=4" in plan.torchrun_args(["-m", "x"])
    # Without NODE_RANK, the GKE webhook's TPU_WORKER_ID.
    assert plan_launch(config(), {**HOSTS, "TPU_WORKER_ID": "1"}).node_rank == 1


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"NNODES": "3"}, "NNODES=3"),
        ({"NODE_RANK": "2"}, "NODE_RANK=2"),
        ({"NODE_RANK": "x"}, "NODE_RANK='x'"),
        ({"MASTER_PORT": "29500"}, "stop.coordination_port"),
        ({"MASTER_ADDR": ""}, "MASTER_ADDR is unset"),
    ],
)
def test_a_pod_environment_that_disagrees_is_refused_naming_it(env: dict[str, str], names: str) -> None:
    with pytest.raises(WorldError, match=names.replace("(", r"\(")):
        plan_launch(config(), {**HOSTS, **env})
