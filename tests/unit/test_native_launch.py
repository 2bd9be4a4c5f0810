"""The native launcher's plan for a host (native/launcher.py): a pure function of the trainer config
and the pod's environment, which the operator renders (render/native_env.py)."""

from __future__ import annotations

import pytest

from tpuft_trainer.config import MeshConfig, TrainerConfig
from tpuft_trainer.errors import WorldError
from tpuft_trainer.mesh import plan_mesh
from tpuft_trainer.native.launcher import DEFAULT_MASTER_PORT, plan_launch


def config(hosts: int = 2, chips: int = 4, slices: int = 1, dcn: int | None = None) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "backend": "native",
            "model": {"name": "m"},
            "dataset": {"name": "d"},
            "training": {"max_steps": 2},
            "output": {"uri": "/tmp/out"},
            "fsdp": {"mesh": {"dcn_data": slices if dcn is None else dcn}},
            "world": {"hosts_per_slice": hosts, "chips_per_host": chips, "slices": slices},
        }
    )


HOSTS = {"TPU_WORKER_HOSTNAMES": "h0,h1", "MASTER_ADDR": "h0"}


def test_one_process_per_chip_and_the_pinned_host_index() -> None:
    # The operator pins TPUFT_HOST_INDEX to the completion index; it wins over TPU_WORKER_ID.
    plan = plan_launch(config(), {**HOSTS, "TPU_WORKER_ID": "0", "TPUFT_HOST_INDEX": "1", "NNODES": "2"})
    assert (plan.nnodes, plan.nproc_per_node, plan.node_rank, plan.hosts_per_slice) == (2, 4, 1, 2)
    assert (plan.master_addr, plan.master_port) == ("h0", DEFAULT_MASTER_PORT)
    assert "--nproc-per-node=4" in plan.torchrun_args(["-m", "x"])
    # Without it, the GKE webhook's TPU_WORKER_ID; a NODE_RANK set by hand that agrees is accepted.
    assert plan_launch(config(), {**HOSTS, "TPU_WORKER_ID": "1", "NODE_RANK": "1"}).node_rank == 1


def slice_env(slice_index: int, host: int, slices: int = 2) -> dict[str, str]:
    """What a native multislice pod sees: the rendered variables (render/native_env.py) and GKE's
    TPU_WORKER_* for its own Job (one slice's hosts)."""
    return {
        "TPU_WORKER_HOSTNAMES": f"s{slice_index}h0,s{slice_index}h1",
        "TPU_WORKER_ID": str(host),
        "JOB_COMPLETION_INDEX": str(host),
        "MASTER_ADDR": "s0h0",
        "NNODES": str(2 * slices),
        "TPUFT_HOST_INDEX": str(host),
        "TPUFT_SLICE_INDEX": str(slice_index),
        "MEGASCALE_SLICE_ID": str(slice_index),
        "MEGASCALE_NUM_SLICES": str(slices),
    }


def test_several_slices_rank_hosts_slice_major_and_keep_every_fsdp_group_inside_a_slice() -> None:
    cfg = config(hosts=2, chips=4, slices=2)
    plans = {(s, h): plan_launch(cfg, slice_env(s, h)) for s in range(2) for h in range(2)}
    # Every host of slice 0 before any of slice 1; set_tpu_launch_env is given one slice's hosts.
    assert {key: p.node_rank for key, p in plans.items()} == {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3}
    assert {(p.nnodes, p.hosts_per_slice, p.master_addr) for p in plans.values()} == {(4, 2, "s0h0")}
    # The agent numbers a host's workers node_rank x nproc_per_node + local rank; the runtime's mesh is
    # (replicate = dcn x data, fsdp), laid out row-major over the ranks as init_device_mesh does.
    slice_of = {
        plan.node_rank * plan.nproc_per_node + local: s
        for (s, _), plan in plans.items()
        for local in range(plan.nproc_per_node)
    }
    shape = plan_mesh(MeshConfig(dcn_data=2), len(slice_of))
    assert (shape.dcn, shape.data, shape.fsdp) == (2, 1, 8)
    groups = [range(row * shape.fsdp, (row + 1) * shape.fsdp) for row in range(shape.dcn * shape.data)]
    assert [{slice_of[rank] for rank in group} for group in groups] == [{0}, {1}]


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"NNODES": "3"}, "NNODES=3"),
        ({"NODE_RANK": "1"}, "NODE_RANK=1 but this host is host 0 of slice 0"),
        ({"NODE_RANK": "x"}, "NODE_RANK='x'"),
        ({"TPUFT_HOST_INDEX": "2"}, "TPUFT_HOST_INDEX=2 is not one of a slice's 2 hosts"),
        ({"MASTER_PORT": "29500"}, "stop.coordination_port"),
        ({"MASTER_ADDR": ""}, "MASTER_ADDR is unset"),
    ],
)
def test_a_pod_environment_that_disagrees_is_refused_naming_it(env: dict[str, str], names: str) -> None:
    with pytest.raises(WorldError, match=names.replace("(", r"\(")):
        plan_launch(config(), {**HOSTS, **env})


@pytest.mark.parametrize(
    ("cfg", "env", "names"),
    [
        # NNODES counting one slice's hosts: the pod was rendered for one slice.
        (config(slices=2), {"NNODES": "2"}, r"NNODES=2 but .* 4 hosts \(2 slice\(s\) of 2\)"),
        (config(slices=2), {"MEGASCALE_SLICE_ID": "0"}, "MEGASCALE_SLICE_ID=0 but TPUFT_SLICE_INDEX=1"),
        (config(slices=2), {"NODE_RANK": "1"}, "NODE_RANK=1 but this host is host 1 of slice 1"),
        (config(slices=2), {"MEGASCALE_NUM_SLICES": "1"}, "MEGASCALE_NUM_SLICES=1"),
        (config(slices=2, dcn=1), {}, "fsdp.mesh.dcn_data=1 but the world has 2 slice"),
    ],
)
def test_a_multislice_environment_that_disagrees_is_refused_naming_it(
    cfg: TrainerConfig, env: dict[str, str], names: str
) -> None:
    with pytest.raises(WorldError, match=names):
        plan_launch(cfg, {**slice_env(1, 1), **env})
