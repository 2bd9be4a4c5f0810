"""One process per chip: `tpuft train` re-runs itself under torch.distributed's elastic agent.

TorchTPU (like every torch-native accelerator stack) runs one process per chip. The pods' command stays
`tpuft train --config FILE` for both backends: with backend native, the process the pod starts is
the *launcher*; it runs torch.distributed's elastic agent in-process (what `torchrun` runs) with
``nproc_per_node = world.chips_per_host`` and ``nnodes = slices x hosts_per_slice``, and a static
rendezvous over the c10d store at ``MASTER_ADDR:MASTER_PORT`` (the first pod of the first slice's
stable hostname, set by the operator). This host's node rank is slice-major: slice index x
hosts_per_slice + host index, the slice index from ``TPUFT_SLICE_INDEX`` (the JobSet's job index;
``MEGASCALE_SLICE_ID`` must agree), the host index from ``TPUFT_HOST_INDEX`` (the operator pins it to
the pod's completion index; without it ``TPU_WORKER_ID``, then ``JOB_COMPLETION_INDEX``). The
operator renders both numbers, the downward API cannot multiply them; a ``NODE_RANK`` already in the
environment must agree. So global ranks run slice by slice, and the runtime's mesh (replicate = dcn x
data outermost, fsdp innermost; native/runtime.py) keeps every fsdp group inside one slice: FSDP2
shards within a slice and replicates across slices (HSDP), with ``fsdp.mesh.dcn_data`` = slices.
Each worker runs the same command again; it sees the agent's ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``
and trains.

On a TPU host (torch-tpu importable) the launcher first calls torch-tpu's ``set_tpu_launch_env``
(torch_tpu/_internal/distributed/distributed.py:328 in the 0.2.0 wheel), once, before the workers
start, with ``NNODES`` and ``NODE_RANK`` set: it fills in the launch variables the operator did not
pin (TORCH_TPU_SLICEBUILDER_ADDRESSES from GKE's TPU_WORKER_HOSTNAMES, this slice's hosts) and never
overwrites one. It is given this slice's host count, which it checks against those hostnames
(distributed.py:367-376); with several slices libtpu's MegaScale client joins them
(render/native_env.py says what the wheel reads). Not exercised here (no TPU): docs/trainer.md lists
it among what only a slice verifies.

Exit codes carry the operator's failure split (exit_codes.py), so the launcher must not turn them all
into the agent's 1: each worker writes its code to a file in a directory the launcher names
(``TPUFT_NATIVE_EXIT_DIR``), and the launcher exits with the workers' code: 0 when all succeeded, 75
when all stopped after a checkpoint, else the first failure's (a worker killed by a signal: 128 + it).
SIGTERM reaches the launcher (the pod's PID 1): the agent forwards it to every worker and waits up to
``stop.grace_seconds`` (its shutdown timeout) for their stop save before killing them.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpuft_trainer.config import TrainerConfig
from tpuft_trainer.errors import WorldError
from tpuft_trainer.exit_codes import ExitCode
from tpuft_trainer.pod_contract import (
    HOST_INDEX_ENV,
    MASTER_ADDR_ENV,
    MASTER_PORT_ENV,
    MEGASCALE_SLICE_ID_ENV,
    NATIVE_EXIT_DIR_ENV,
    NATIVE_MASTER_PORT,
    NNODES_ENV,
    NODE_RANK_ENV,
    SLICE_INDEX_ENV,
)
from tpuft_trainer.world import detect_world, env_int

log = logging.getLogger(__name__)

EXIT_DIR_ENV = NATIVE_EXIT_DIR_ENV
# Set by torch.distributed's agent in every worker it starts (and by torchrun): this process is a worker.
WORKER_MARKERS = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")
DEFAULT_MASTER_PORT = NATIVE_MASTER_PORT  # not stop.coordination_port's 29500: both listen on the first host


def is_worker(env: Mapping[str, str]) -> bool:
    """True in a process started by torch.distributed's agent (or by torchrun, or by hand with RANK
    and WORLD_SIZE set): it trains rather than launches."""
    return any(name in env for name in WORKER_MARKERS) or ("RANK" in env and "WORLD_SIZE" in env)


@dataclass(frozen=True)
class Launch:
    """The agent's configuration for this host: torchrun's options, so the log can show the command."""

    nnodes: int
    nproc_per_node: int
    node_rank: int
    hosts_per_slice: int  # what torch-tpu's set_tpu_launch_env counts (one slice's hostnames)
    master_addr: str
    master_port: int
    shutdown_timeout: int

    def torchrun_args(self, program: Sequence[str]) -> list[str]:
        return [
            f"--nnodes={self.nnodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--node-rank={self.node_rank}",
            f"--master-addr={self.master_addr}",
            f"--master-port={self.master_port}",
            "--rdzv-backend=static",
            "--max-restarts=0",  # the JobSet restarts the whole job; a lone worker restart cannot rejoin
            *program,
        ]


def plan_launch(config: TrainerConfig, env: Mapping[str, str]) -> Launch:
    """This host's launch: a pure function of the configuration and the environment."""
    world = detect_world(config.world, env)
    nnodes = world.process_count
    pinned_nodes = env.get(NNODES_ENV, "")
    if pinned_nodes and pinned_nodes != str(nnodes):
        raise WorldError(
            f"{NNODES_ENV}={pinned_nodes} but the trainer config's world has {nnodes} hosts "
            f"({world.slices} slice(s) of {world.hosts_per_slice}): the pod's environment and its config "
            "were rendered for different shapes"
        )
    if config.fsdp.mesh.dcn_data != world.slices:
        raise WorldError(
            f"fsdp.mesh.dcn_data={config.fsdp.mesh.dcn_data} but the world has {world.slices} slice(s): "
            "the mesh's dcn axis is the slices (FSDP2 shards within a slice, replicates across them)"
        )
    host_index = world.host_index
    pinned_host = env_int(env, HOST_INDEX_ENV)
    if pinned_host is not None:
        if not 0 <= pinned_host < world.hosts_per_slice:
            raise WorldError(
                f"{HOST_INDEX_ENV}={pinned_host} is not one of a slice's {world.hosts_per_slice} hosts"
            )
        host_index = pinned_host
    # The slice index: world took MEGASCALE_SLICE_ID first (what libtpu's MegaScale client reads), then
    # the JobSet's job index; the node ranks must order the slices as MegaScale does.
    job_index = env_int(env, SLICE_INDEX_ENV)
    megascale = env_int(env, MEGASCALE_SLICE_ID_ENV)
    if job_index is not None and megascale is not None and job_index != megascale:
        raise WorldError(
            f"{MEGASCALE_SLICE_ID_ENV}={megascale} but {SLICE_INDEX_ENV}={job_index} (the JobSet's job "
            "index): the slices' ranks would not match the slices libtpu joins"
        )
    node_rank = world.slice_index * world.hosts_per_slice + host_index
    pinned_rank = env_int(env, NODE_RANK_ENV)
    if pinned_rank is not None and pinned_rank != node_rank:
        raise WorldError(
            f"{NODE_RANK_ENV}={pinned_rank} but this host is host {host_index} of slice "
            f"{world.slice_index} ({world.hosts_per_slice} hosts a slice): node rank {node_rank}"
        )
    address = env.get(MASTER_ADDR_ENV, "")
    if nnodes > 1 and not address:
        raise WorldError(
            f"this job has {nnodes} hosts but {MASTER_ADDR_ENV} is unset: the hosts' processes could not "
            "meet (the operator sets it to the first pod's hostname)"
        )
    raw_port = env.get(MASTER_PORT_ENV, "") or str(DEFAULT_MASTER_PORT)
    try:
        port = int(raw_port)
    except ValueError as error:
        raise WorldError(f"{MASTER_PORT_ENV}={raw_port!r} is not a port number") from error
    if nnodes > 1 and port == config.stop.coordination_port:
        raise WorldError(
            f"{MASTER_PORT_ENV}={port} is also stop.coordination_port: the rendezvous and the stop "
            "channel would both listen there on the first host"
        )
    return Launch(
        nnodes=nnodes,
        nproc_per_node=config.world.chips_per_host,
        node_rank=node_rank,
        hosts_per_slice=world.hosts_per_slice,
        master_addr=address or "127.0.0.1",
        master_port=port,
        shutdown_timeout=max(1, int(config.stop.grace_seconds)),
    )


def worker_program(config_path: Path) -> list[str]:
    """What every worker runs: the same `tpuft train` (as a module, whatever the venv's layout)."""
    return ["-m", "tpuft_operator", "train", "--config", str(config_path)]


def launch(config: TrainerConfig, config_path: Path, env: Mapping[str, str] | None = None) -> int:
    """Runs this host's workers under the elastic agent; returns the exit code for the pod."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import config_from_args, get_args_parser

    env = os.environ if env is None else env
    plan = plan_launch(config, env)
    # Before set_tpu_launch_env, which keeps what is set: every slice's hosts, and the slice-major rank
    # (it would derive one within this slice). The workers inherit both.
    os.environ[NNODES_ENV] = str(plan.nnodes)
    os.environ[NODE_RANK_ENV] = str(plan.node_rank)
    _tpu_launch_env(plan)
    args = plan.torchrun_args(worker_program(config_path))
    log.info(
        "native backend: %d process(es) on this host (one per chip), %d host(s): %s -m torch.distributed.run %s",
        plan.nproc_per_node,
        plan.nnodes,
        sys.executable,
        shlex.join(args),
    )
    exits = Path(tempfile.mkdtemp(prefix="tpuft-exits-"))
    os.environ[EXIT_DIR_ENV] = str(exits)  # the agent passes its environment on to the workers
    launch_config, entrypoint, entry_args = config_from_args(get_args_parser().parse_args(args))
    settings: Any = launch_config  # (torch 2.15's LaunchConfig; the main venv's torch 2.9 has no such field)
    settings.shutdown_timeout = plan.shutdown_timeout
    from torch.distributed.launcher.api import elastic_launch

    try:
        elastic_launch(launch_config, entrypoint)(*entry_args)
    except ChildFailedError as failed:
        return _exit_code(exits, plan.nproc_per_node, failed)
    except SignalException as signalled:
        name = signal.Signals(signalled.sigval).name  # (an int here: "got 15" says little in a pod's log)
        log.warning("the launcher got %s: the workers were asked to checkpoint and stop", name)
        return _exit_code(exits, plan.nproc_per_node, None)
    return _exit_code(exits, plan.nproc_per_node, None)


def _tpu_launch_env(plan: Launch) -> None:
    """On a TPU host, torch-tpu's own launch variables (see the module doc); nothing on CPU."""
    try:
        import torch_tpu  # noqa: F401  (registers torch.tpu)
    except ImportError:
        return  # CPU (the tests, the local cluster): gloo needs only the rendezvous
    import torch

    tpu: Any = getattr(torch, "tpu")  # noqa: B009  (registered by torch_tpu at import: no stubs)
    # This slice's hosts: the wheel checks nnodes against TPU_WORKER_HOSTNAMES (one slice's on GKE) and
    # builds this slice's endpoints from them; NNODES (every slice's) is set already and kept.
    tpu.distributed.set_tpu_launch_env(nnodes=plan.hosts_per_slice, nproc_per_node=plan.nproc_per_node)


def note_exit(code: int, env: Mapping[str, str] | None = None) -> None:
    """In a worker, before it exits: its code for the launcher (best effort)."""
    env = os.environ if env is None else env
    directory = env.get(EXIT_DIR_ENV)
    if not directory:
        return
    try:
        (Path(directory) / f"{env.get('LOCAL_RANK', '0')}.code").write_text(str(code))
    except OSError as error:
        log.warning("could not note the exit code for the launcher: %s", error)


def _exit_code(exits: Path, workers: int, failed: object | None) -> int:
    """The pod's exit code from the workers': their own notes first (exact codes), then the agent's
    record of a failure (a worker killed before it wrote one)."""
    noted: dict[int, int] = {}
    for path in exits.glob("*.code"):
        try:
            noted[int(path.stem)] = int(path.read_text())
        except (OSError, ValueError):
            continue
    codes = list(noted.values())
    if failed is not None:
        failures = getattr(failed, "failures", {}) or {}
        for failure in sorted(failures.values(), key=lambda f: getattr(f, "timestamp", 0)):
            code = int(getattr(failure, "exitcode", 1))
            codes.append(128 - code if code < 0 else code)
    if len(noted) == workers and all(code == ExitCode.OK for code in noted.values()) and failed is None:
        return int(ExitCode.OK)
    if codes and all(code == ExitCode.STOPPED_AFTER_CHECKPOINT for code in codes):
        return int(ExitCode.STOPPED_AFTER_CHECKPOINT)
    failures_only = [c for c in codes if c not in (ExitCode.OK, ExitCode.STOPPED_AFTER_CHECKPOINT)]
    if failures_only:
        return failures_only[0]
    return 1 if failed is not None or len(noted) < workers else int(ExitCode.OK)
