"""Where this process stands in the job: a pure function of the environment and the configuration.

On GKE, every TPU pod of a multi-host slice gets ``TPU_WORKER_ID`` and ``TPU_WORKER_HOSTNAMES`` from
the TPU webhook; multislice pods also get ``MEGASCALE_*``. PJRT reads the same variables to join the
hosts of a slice (and the slices over DCN) into ONE SPMD program, so rank and world below are what the
runtime will use; we read them first only to refuse, before any XLA work, to start a multi-host job
whose environment would make every host train an independent copy (the classic optimum-tpu failure).
Locally (no such variables) the defaults are one process, rank 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tpuft_trainer.config import WorldConfig
from tpuft_trainer.errors import WorldError
from tpuft_trainer.pod_contract import (
    JOB_COMPLETION_INDEX_ENV,
    MEGASCALE_NUM_SLICES_ENV,
    MEGASCALE_SLICE_ID_ENV,
    RESTART_ATTEMPT_ENV,
    SLICE_INDEX_ENV,
    TPU_WORKER_HOSTNAMES_ENV,
    TPU_WORKER_ID_ENV,
)

# Every variable this module reads, with who sets it (pod_contract.py names them); docs/trainer.md
# lists the same.
ENV_VARS: dict[str, str] = {
    TPU_WORKER_ID_ENV: "GKE TPU webhook: this host's index within its slice",
    TPU_WORKER_HOSTNAMES_ENV: "GKE TPU webhook: comma-separated hostnames of the slice's hosts",
    MEGASCALE_SLICE_ID_ENV: "GKE (multislice): this slice's index",
    MEGASCALE_NUM_SLICES_ENV: "GKE (multislice): number of slices",
    JOB_COMPLETION_INDEX_ENV: "Kubernetes Indexed Job: the pod's index (fallback for TPU_WORKER_ID)",
    SLICE_INDEX_ENV: "tpuft JobSet (downward API, jobset.sigs.k8s.io/job-index): fallback slice index",
    RESTART_ATTEMPT_ENV: "tpuft JobSet (downward API, jobset.sigs.k8s.io/restart-attempt)",
}


@dataclass(frozen=True)
class World:
    slice_index: int
    host_index: int  # within the slice
    slices: int
    hosts_per_slice: int
    chips_per_host: int
    restart_attempt: int

    @property
    def process_index(self) -> int:
        return self.slice_index * self.hosts_per_slice + self.host_index

    @property
    def process_count(self) -> int:
        return self.slices * self.hosts_per_slice

    @property
    def is_rank_zero(self) -> bool:
        return self.process_index == 0

    @property
    def expected_devices(self) -> int:
        return self.process_count * self.chips_per_host


def env_int(env: Mapping[str, str], name: str) -> int | None:
    """The integer in ``env[name]``; None when unset or blank; WorldError naming it otherwise."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError as error:
        raise WorldError(f"{name}={raw!r} is not an integer") from error


def detect_world(config: WorldConfig, env: Mapping[str, str]) -> World:
    """Rank and world from the environment, checked against the job's shape in ``config``."""
    host_index = env_int(env, TPU_WORKER_ID_ENV)
    if host_index is None:
        host_index = env_int(env, JOB_COMPLETION_INDEX_ENV) or 0
    slice_index = env_int(env, MEGASCALE_SLICE_ID_ENV)
    if slice_index is None:
        slice_index = env_int(env, SLICE_INDEX_ENV) or 0
    restart_attempt = env_int(env, RESTART_ATTEMPT_ENV) or 0

    if config.hosts_per_slice > 1:
        hostnames = [h for h in env.get(TPU_WORKER_HOSTNAMES_ENV, "").split(",") if h.strip()]
        if len(hostnames) != config.hosts_per_slice:
            raise WorldError(
                f"this job has {config.hosts_per_slice} hosts per slice but TPU_WORKER_HOSTNAMES lists "
                f"{len(hostnames)} ({env.get(TPU_WORKER_HOSTNAMES_ENV, 'unset')!r}); without every host "
                "the runtime would start each host as an independent copy of the training. Run it in the "
                "JobSet the operator renders (GKE sets these variables on TPU pods)."
            )
    if config.slices > 1:
        num_slices = env_int(env, MEGASCALE_NUM_SLICES_ENV)
        if num_slices != config.slices:
            raise WorldError(
                f"this job has {config.slices} slices but MEGASCALE_NUM_SLICES={num_slices}; the slices "
                "would not join over DCN."
            )
    if not 0 <= host_index < config.hosts_per_slice:
        raise WorldError(f"host index {host_index} is outside 0..{config.hosts_per_slice - 1}")
    if not 0 <= slice_index < config.slices:
        raise WorldError(f"slice index {slice_index} is outside 0..{config.slices - 1}")
    return World(
        slice_index=slice_index,
        host_index=host_index,
        slices=config.slices,
        hosts_per_slice=config.hosts_per_slice,
        chips_per_host=config.chips_per_host,
        restart_attempt=restart_attempt,
    )


def check_runtime(world: World, *, process_count: int, device_count: int, on_tpu: bool) -> list[str]:
    """Compare what PJRT sees with the job's shape. On TPU a mismatch is fatal (hosts did not join);
    on CPU (tests, the local demo) the device count is whatever CPU_NUM_DEVICES says, so the
    differences come back as warnings."""
    problems = []
    if process_count != world.process_count:
        problems.append(f"the runtime sees {process_count} processes, the job has {world.process_count}")
    if device_count != world.expected_devices:
        problems.append(f"the runtime sees {device_count} devices, the job has {world.expected_devices}")
    if problems and on_tpu:
        raise WorldError("; ".join(problems) + ": refusing to train as independent copies")
    return problems


def check_one_feeder(*, world_size: int, process_index: int) -> None:
    """Under SPMD each host feeds the same global batch (and transfers only its own devices' shards),
    so the HF Trainer must see one process and not split the data by host. It takes its world from
    accelerate, which under torch_xla asks the XLA runtime (one virtual device under SPMD), never
    torch.distributed's default group (checkpoint/xla.py starts one for DCP on several hosts):
    docs/trainer.md, "torch.distributed's default group and the Trainer". If a library version
    changed that, every host would train on a different part of each batch: refuse."""
    if (world_size, process_index) != (1, 0):
        raise WorldError(
            f"the Trainer sees a world of {world_size} process(es) (this one {process_index}); under SPMD it "
            "must see 1, or each host would feed a different part of every batch: refusing to train"
        )
