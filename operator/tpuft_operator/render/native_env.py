"""The environment a `backend: native` pod gets: torch.distributed's rendezvous and TorchTPU's launch
variables, read from the torch-tpu 0.2.0 wheel (trainer_stack.TORCH_TPU_VERSION). Pure.

The pods' command stays `tpuft train --config ...`; the trainer's native launcher starts one process
per chip with torch.distributed's elastic agent, after calling torch-tpu's `set_tpu_launch_env`
(public as `torch.tpu.distributed.set_tpu_launch_env`), which fills in every launch variable that is
not already set and never overwrites one (torch_tpu/_internal/distributed/distributed.py:333-337).
The operator pins what it knows for certain from the JobSet, so every host agrees without asking
the TPU hardware; the wheel derives the rest. Paths below are inside the wheel
(torch_tpu-0.2.0-cp311-cp311-manylinux_2_31_x86_64.whl):

- ``NNODES`` (distributed.py:425-432): the hosts of the run, every slice's (slices x hosts per
  slice). The wheel would count GKE's TPU_WORKER_HOSTNAMES, which lists one slice's hosts.
- ``TPUFT_HOST_INDEX`` (pod_contract.HOST_INDEX_ENV): the pod's completion index (the Job controller's
  annotation, through the downward API), its host index within its slice. The launcher computes
  ``NODE_RANK`` = slice index (TPUFT_SLICE_INDEX, the JobSet's job index) x hosts per slice + this,
  and sets it before calling set_tpu_launch_env: the downward API cannot multiply. Pinned because the
  wheel, left to itself, ranks a slice's hosts by their chips' physical coordinates when given a
  TORCH_TPU_TOPOLOGY from outside (distributed.py:58-70, 191-262, 434-443), within one slice, while
  it lists the per-chip endpoints in the order of TPU_WORKER_HOSTNAMES (distributed.py:404-419), which
  GKE writes in completion-index order: the completion index keeps the two in the same order.
- ``MASTER_ADDR`` (distributed.py:445-447; handshake.py:1321 dials it too): the first pod of the first
  slice's stable hostname, as the wheel would take the first of TPU_WORKER_HOSTNAMES on one slice.
- ``MASTER_PORT`` (distributed.py:448): not the wheel's default 29500, where the trainer's stop
  channel listens on the first host (tpuft_trainer/stop.py): pod_contract.NATIVE_MASTER_PORT.
- ``TORCH_TPU_TOPOLOGY`` (distributed.py:22, 400-403, parsed at 111-140, 'x' or ',' separated): the
  slice's topology. Only one supplied from outside describes the whole slice (distributed.py:63-65);
  the wheel would otherwise write the host's own.
- ``TORCH_TPU_DEVICES_PER_HOST`` (distributed.py:411-414): chips per host; the wheel would count the
  host's PCI devices, or assume 8.
- ``TORCH_TPU_BASE_PORT`` (distributed.py:407-410): the wheel's own default, 8070, written out.

Several slices (``slices > 1``). The wheel forms one world of every slice's chips, slices joined by
libtpu's MegaScale client over DCN; what it reads (0.2.0; the C++ glue is
csrc/common/glue_2_15_0/libpywrap_2_15_0_common.so, read by disassembly, no line numbers):

- One slice's endpoints. set_tpu_launch_env builds TORCH_TPU_SLICEBUILDER_ADDRESSES from
  TPU_WORKER_HOSTNAMES (distributed.py:405-423), one slice's hosts on GKE, and refuses an ``nnodes``
  argument that differs from their count (distributed.py:367-376): the launcher passes it the hosts per
  slice, with NNODES (every slice's) pinned here, which it never overwrites (distributed.py:432). The
  glue's ``InitializeDistributedEnvironment`` sets each worker's CLOUD_TPU_TASK_ID to RANK modulo the
  number of those addresses, its task within its slice (given ranks slice-major, as the launcher's
  node ranks make them), and treats WORLD_SIZE > that number as a multislice job.
- MegaScale. On a multislice job the glue's ``AssignMegascalePorts`` (log line "Multi-slice job
  detected, setting MEGASCALE_PORT=...", csrc/common/environment.cc) gives each worker
  MEGASCALE_PORT = 8080 + 2 x LOCAL_RANK and MEGASCALE_DEBUG_PORT = 8081 + 2 x LOCAL_RANK (above the
  8070 + chip TorchTPU endpoints: 8 chips a host at most), and sets SKIP_MEGASCALE_PJRT_CLIENT itself
  once its own client is made ("TorchTPU owns the MegaScale PJRT client"). libtpu installs that
  client once MEGASCALE_COORDINATOR_ADDRESS, MEGASCALE_SLICE_ID and MEGASCALE_NUM_SLICES are set;
  the coordinator address needs its port, e.g. <MASTER_ADDR>:8080, since libtpu would otherwise
  append each process's own MEGASCALE_PORT (device_mesh.py:330-341). So the renderer sets the three
  (pod_contract.NATIVE_MULTISLICE_ENV): the coordinator is the first pod of the first slice at 8080
  (where its local rank 0, global rank 0, listens), the slice ID the JobSet's job index (downward
  API), the count ``slices``. Not SKIP_MEGASCALE_PJRT_CLIENT, nor MEGASCALE_PORT (the glue's).
- The mesh. topology_aware_mesh reads each device's ``slice_index`` (published only by the MegaScale
  client, device_mesh.py:303-317) and splits a mesh across slices on its outermost non-trivial axis
  (device_mesh.py:91-148): the trainer's (replicate = dcn x data, fsdp) puts the slices on
  ``replicate``, every fsdp group inside one slice (HSDP), as its slice-major ranks do.

The xla backend renders none of the MEGASCALE_* variables: GKE sets them on multislice pods (world.py);
a native pod needs the coordinator's port, which GKE's bare address lacks. What only a multislice TPU
run verifies (docs/trainer.md): that GKE's webhook leaves the rendered MEGASCALE_* as they are, that
libtpu's coordinator is the global rank 0 worker at 8080, that ``tpu_dist`` collectives cross DCN,
and the throughput of HSDP across slices.

Not set here: ``TORCH_TPU_SLICEBUILDER_ADDRESSES`` (distributed.py:21, 404-423), one ``host:port``
per chip of the slice, which the wheel builds from TPU_WORKER_HOSTNAMES and the three variables
above. Rendered, it would be one string of ~60 bytes a chip: ~550 KB for the largest tpu7x slice,
over Linux's 128 KiB limit on one environment string (MAX_ARG_STRLEN), so the pod could not start.
``TPU_WORKER_HOSTNAMES`` and ``TPU_WORKER_ID`` are GKE's (its TPU webhook sets them on Indexed Job
pods with a subdomain, as for the xla backend); the wheel reads the first (distributed.py:361), libtpu
the second. ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` are per process: the elastic agent sets them
for each worker it starts (torchcomm_tpu.py:141-151 reads them). ``TORCH_TPU_XPROF_SESSION_ID``
(profiling only) is left to the wheel.
"""

from __future__ import annotations

from typing import Any

from tpuft_operator.render import naming
from tpuft_operator.topology import SliceShape
from tpuft_trainer.pod_contract import (
    HOST_INDEX_ENV,
    MASTER_ADDR_ENV,
    MASTER_PORT_ENV,
    MEGASCALE_COORDINATOR_ADDRESS_ENV,
    MEGASCALE_NUM_SLICES_ENV,
    MEGASCALE_SLICE_ID_ENV,
    NATIVE_MASTER_PORT,
    NATIVE_MEGASCALE_PORT,
    NNODES_ENV,
    TORCH_TPU_BASE_PORT,
    TORCH_TPU_BASE_PORT_ENV,
    TORCH_TPU_DEVICES_PER_HOST_ENV,
    TORCH_TPU_TOPOLOGY_ENV,
)

# The Indexed Job controller's annotation on each pod: its completion index (the same number as the
# JOB_COMPLETION_INDEX variable the controller sets, which the downward API cannot copy).
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
# JobSet's label on each pod: the index of its Job, i.e. its slice (render/jobset.py renders it as
# TPUFT_SLICE_INDEX for every backend).
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"


def native_env(shape: SliceShape, jobset: str) -> list[dict[str, Any]]:
    """The variables of pod_contract.NATIVE_RENDERED_ENV, in that order, for a run of ``shape``; then,
    with several slices, those of pod_contract.NATIVE_MULTISLICE_ENV."""
    coordinator = naming.coordinator_address(jobset)  # the first pod of the first slice
    out: list[dict[str, Any]] = [
        {"name": NNODES_ENV, "value": str(shape.hosts)},
        {
            "name": HOST_INDEX_ENV,
            "valueFrom": {
                "fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}
            },
        },
        {"name": MASTER_ADDR_ENV, "value": coordinator},
        {"name": MASTER_PORT_ENV, "value": str(NATIVE_MASTER_PORT)},
        {"name": TORCH_TPU_TOPOLOGY_ENV, "value": shape.topology},
        {"name": TORCH_TPU_DEVICES_PER_HOST_ENV, "value": str(shape.chips_per_host)},
        {"name": TORCH_TPU_BASE_PORT_ENV, "value": str(TORCH_TPU_BASE_PORT)},
    ]
    if shape.slices > 1:
        out += [
            {"name": MEGASCALE_COORDINATOR_ADDRESS_ENV, "value": f"{coordinator}:{NATIVE_MEGASCALE_PORT}"},
            {
                "name": MEGASCALE_SLICE_ID_ENV,
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{JOB_INDEX_LABEL}']"}},
            },
            {"name": MEGASCALE_NUM_SLICES_ENV, "value": str(shape.slices)},
        ]
    return out
