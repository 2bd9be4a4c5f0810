"""The environment a `backend: native` pod gets: torch.distributed's rendezvous and TorchTPU's launch
variables, read from the torch-tpu 0.2.0 wheel (trainer_stack.TORCH_TPU_VERSION). Pure.

The pods' command stays `tpuft train --config ...`; the trainer's native launcher starts one process
per chip with torch.distributed's elastic agent, after calling torch-tpu's `set_tpu_launch_env`
(public as `torch.tpu.distributed.set_tpu_launch_env`), which fills in every launch variable that is
not already set and never overwrites one (torch_tpu/_internal/distributed/distributed.py:333-337).
The operator pins what it knows for certain from the JobSet, so every host agrees without asking
the TPU hardware; the wheel derives the rest. Paths below are inside the wheel
(torch_tpu-0.2.0-cp311-cp311-manylinux_2_31_x86_64.whl):

- ``NNODES`` (distributed.py:425-432): the hosts of the run. The wheel would count GKE's
  TPU_WORKER_HOSTNAMES.
- ``NODE_RANK`` (distributed.py:434-443): the pod's completion index (the Job controller's annotation,
  through the downward API). Pinned because the wheel, given a TORCH_TPU_TOPOLOGY from outside, ranks
  hosts by their chips' physical coordinates (distributed.py:58-70, 191-262), while it lists the
  per-rank endpoints in the order of TPU_WORKER_HOSTNAMES (distributed.py:404-419), which GKE writes
  in completion-index order: the completion index keeps the two in the same order.
- ``MASTER_ADDR`` (distributed.py:445-447; handshake.py:1321 dials it too): the first pod's stable
  hostname, as the wheel would take the first of TPU_WORKER_HOSTNAMES.
- ``MASTER_PORT`` (distributed.py:448): not the wheel's default 29500, where the trainer's stop
  channel listens on the first host (tpuft_trainer/stop.py): pod_contract.NATIVE_MASTER_PORT.
- ``TORCH_TPU_TOPOLOGY`` (distributed.py:22, 400-403, parsed at 111-140, 'x' or ',' separated): the
  slice's topology. Only one supplied from outside describes the whole slice (distributed.py:63-65);
  the wheel would otherwise write the host's own.
- ``TORCH_TPU_DEVICES_PER_HOST`` (distributed.py:411-414): chips per host; the wheel would count the
  host's PCI devices, or assume 8.
- ``TORCH_TPU_BASE_PORT`` (distributed.py:407-410): the wheel's own default, 8070, written out.

Not set here: ``TORCH_TPU_SLICEBUILDER_ADDRESSES`` (distributed.py:21, 404-423), one ``host:port``
per chip of the slice, which the wheel builds from TPU_WORKER_HOSTNAMES and the three variables
above. Rendered, it would be one string of ~60 bytes a chip: ~550 KB for the largest tpu7x slice,
over Linux's 128 KiB limit on one environment string (MAX_ARG_STRLEN), so the pod could not start.
``TPU_WORKER_HOSTNAMES`` and ``TPU_WORKER_ID`` are GKE's (its TPU webhook sets them on Indexed Job
pods with a subdomain, as for the xla backend); the wheel reads the first (distributed.py:361), libtpu
the second. ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` are per process: the elastic agent sets them
for each worker it starts (torchcomm_tpu.py:141-151 reads them). ``TORCH_TPU_XPROF_SESSION_ID``
(profiling only) is left to the wheel. Multislice is refused for native (api/cel.py,
NATIVE_MULTISLICE_MESSAGE): the wheel's launch environment is one slice's, and its only multislice
path is libtpu's MegaScale client (MEGASCALE_* variables, device_mesh.py:330-342), which tpuft has
neither wired nor verified.
"""

from __future__ import annotations

from typing import Any

from tpuft_operator.render import naming
from tpuft_operator.topology import SliceShape
from tpuft_trainer.pod_contract import (
    MASTER_ADDR_ENV,
    MASTER_PORT_ENV,
    NATIVE_MASTER_PORT,
    NNODES_ENV,
    NODE_RANK_ENV,
    TORCH_TPU_BASE_PORT,
    TORCH_TPU_BASE_PORT_ENV,
    TORCH_TPU_DEVICES_PER_HOST_ENV,
    TORCH_TPU_TOPOLOGY_ENV,
)

# The Indexed Job controller's annotation on each pod: its completion index (the same number as the
# JOB_COMPLETION_INDEX variable the controller sets, which the downward API cannot copy).
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"


def native_env(shape: SliceShape, jobset: str) -> list[dict[str, Any]]:
    """The variables of pod_contract.NATIVE_RENDERED_ENV, in that order, for a run of ``shape``."""
    return [
        {"name": NNODES_ENV, "value": str(shape.hosts)},
        {
            "name": NODE_RANK_ENV,
            "valueFrom": {
                "fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}
            },
        },
        {"name": MASTER_ADDR_ENV, "value": naming.coordinator_address(jobset)},
        {"name": MASTER_PORT_ENV, "value": str(NATIVE_MASTER_PORT)},
        {"name": TORCH_TPU_TOPOLOGY_ENV, "value": shape.topology},
        {"name": TORCH_TPU_DEVICES_PER_HOST_ENV, "value": str(shape.chips_per_host)},
        {"name": TORCH_TPU_BASE_PORT_ENV, "value": str(TORCH_TPU_BASE_PORT)},
    ]
