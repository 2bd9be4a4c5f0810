"""A `backend: native` run through the local cluster, for real: its prepare pod's `tpuft prepare` and its
TPU pods' `tpuft train` run on this host in the native venv (`scripts/venv.sh native`: torch 2.15, no
torch_xla), as the native image would run them. Two v5e 2x4 slices: 2 Jobs (one per slice) of 2 hosts
(pods) of 4 chips. Each pod's `tpuft train` is the native launcher; it starts 4 worker processes (gloo
on CPU), and the 16 meet across the four pods and the two Jobs at the rendezvous the executor points
at this host (one port for the JobSet), ranked slice by slice, train the tiny model with FSDP2 sharded
within a slice and replicated across the two (HSDP), report progress from rank 0 with the pod's own
token, and export the model. The run goes Preparing -> Pending -> Running -> Succeeded with the native
backend's caveat in its conditions. (Two slices of two hosts: the smallest native multislice the API
admits, since GKE joins only multi-host slices; it covers a slice's hosts meeting too.)"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import unique
from tests.e2e.conftest import OperatorProcess, copy_assets
from tests.support import condition, get_json, tpu_pods_of, wait_for
from tpuft_dev.cluster.executor import LocalExecutor, native_python
from tpuft_dev.cluster.local import LocalCluster
from tpuft_dev.demo import host_run
from tpuft_operator import trainer_stack
from tpuft_operator.render.settings import DEFAULT_TRAINER_IMAGE_NATIVE
from tpuft_trainer.pod_contract import NATIVE_MASTER_PORT

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.trainer]

STEPS = 4
TOPOLOGY = "2x4"  # v5e: 2 hosts of 4 chips a slice
SLICES, HOSTS_PER_SLICE, CHIPS_PER_HOST = 2, 2, 4
HOSTS = SLICES * HOSTS_PER_SLICE
WORKERS = HOSTS * CHIPS_PER_HOST


class PhaseWatch:
    """`kubectl get --watch` on the run: every phase its status went through, in order (Pending lasts
    a moment between the prepare Job's end and the pod's start: too short to poll for), and when."""

    def __init__(self, cluster: LocalCluster, namespace: str, name: str) -> None:
        self.started = time.monotonic()
        self.seen: list[tuple[str, float]] = []
        self.process = subprocess.Popen(
            [
                str(cluster.bins.kubectl), f"--kubeconfig={cluster.kubeconfig}", "get", "tpuft", name,
                "-n", namespace, "--watch", "-o", "jsonpath={.status.phase}{'\\n'}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )  # fmt: skip
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            phase = line.strip()
            if phase and (not self.seen or self.seen[-1][0] != phase):
                self.seen.append((phase, round(time.monotonic() - self.started, 1)))

    def phases(self) -> list[str]:
        self.process.terminate()
        self.process.wait(timeout=30)
        self.reader.join(timeout=10)
        print("phases (seconds after apply):", self.seen)  # for the record (-s), never asserted on
        return [phase for phase, _ in self.seen]


def test_a_native_run_trains_one_process_per_chip_and_succeeds(
    local_cluster: LocalCluster,
    operator: OperatorProcess,
    namespace: str,
    tmp_path: Path,
    tiny_assets: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    venv_python = native_python()  # a missing venv fails here, saying `scripts/venv.sh native`
    root = copy_assets(tiny_assets, tmp_path / "work")
    local_cluster.add_nodepool("v5e", TOPOLOGY, slices=SLICES, prefix=unique("cpu"))
    executor = LocalExecutor(local_cluster, namespace, tmp_path / "pods")
    caplog.set_level(logging.INFO, logger="tpuft.executor")
    executor.start()
    try:
        run = host_run(
            "nat",
            namespace,
            root,
            STEPS,
            backend="native",
            tpu={"type": "v5e", "topology": TOPOLOGY, "slices": SLICES},
        )
        local_cluster.apply([run])
        watch = PhaseWatch(local_cluster, namespace, "nat")

        def finished() -> dict[str, Any] | None:
            ft = get_json(local_cluster, "tpuft", "nat", "-n", namespace)
            return ft if ft.get("status", {}).get("phase") in ("Succeeded", "Failed") else None

        done = wait_for(finished, timeout=300, what="the native run to finish", interval=1)
        phases = watch.phases()
        logs = {p.name: p.read_text() for p in (tmp_path / "pods").glob("*.log")}
        assert done["status"]["phase"] == "Succeeded", "\n".join(logs.values())[-4000:]
    finally:
        executor.stop()

    assert phases == ["Preparing", "Pending", "Running", "Succeeded"], phases
    # Every pod ran in the native venv: the prepare pod's `tpuft prepare` too (the run's own image).
    started = [r.getMessage() for r in caplog.records if r.getMessage().startswith("running pod ")]
    prepare = [m for m in started if " prepare " in m]
    train = [m for m in started if " train " in m]
    assert len(prepare) == 1 and len(train) == HOSTS, started
    assert f"{venv_python} -m tpuft_operator prepare" in prepare[0]
    assert all(f"{venv_python} -m tpuft_operator train" in m for m in train), train

    pods = get_json(local_cluster, "pods", "-n", namespace, "-l", tpu_pods_of("nat"))["items"]
    assert len(pods) == HOSTS
    ports = set()
    nodes = set()
    for pod in pods:
        # The native image's pod, with the launch environment the operator renders...
        (container,) = pod["spec"]["containers"]
        assert container["image"] == DEFAULT_TRAINER_IMAGE_NATIVE
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert (env["TORCH_TPU_DEVICES_PER_HOST"], env["NNODES"]) == (str(CHIPS_PER_HOST), str(HOSTS))
        assert env["MEGASCALE_NUM_SLICES"] == str(SLICES)
        assert env["MASTER_ADDR"].endswith(f".{done['status']['jobSetName']}")  # a cluster DNS name...
        # ...which the executor pointed at this host, on a port of the JobSet's (not the rendered one).
        # Slice-major: the slice's Job index, then the host's completion index within its slice.
        slice_index = int(pod["metadata"]["labels"]["jobset.sigs.k8s.io/job-index"])
        host = int(pod["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"])
        node = slice_index * HOSTS_PER_SLICE + host
        nodes.add(node)
        (pod_log,) = [text for name, text in logs.items() if name.startswith(pod["metadata"]["name"])]
        launch = re.search(
            r"native backend: (\d+) process\(es\) on this host \(one per chip\), (\d+) host.*", pod_log
        )
        assert launch is not None, pod_log[-3000:]
        assert (int(launch[1]), int(launch[2])) == (CHIPS_PER_HOST, HOSTS), launch[0]
        assert f"--node-rank={node}" in launch[0] and "--master-addr=127.0.0.1" in launch[0], launch[0]
        port = re.search(r"--master-port=(\d+)", launch[0])
        assert port is not None and int(port[1]) != NATIVE_MASTER_PORT, launch[0]
        ports.add(port[1])
        # One worker per chip really ran on this host: each one's own line, the host's block of ranks,
        # in a mesh whose dcn axis is the slices (fsdp groups of one slice's chips).
        ranks = re.findall(
            rf"native backend: rank (\d+) of {WORKERS} on cpu \(gloo\), mesh dcn={SLICES} x data=1 "
            rf"x fsdp={HOSTS_PER_SLICE * CHIPS_PER_HOST}",
            pod_log,
        )
        first = node * CHIPS_PER_HOST
        assert sorted(int(r) for r in ranks) == list(range(first, first + CHIPS_PER_HOST)), (node, ranks)
        # Rank 0 (on host 0 of slice 0) reports the progress; the others train without a word of it.
        assert ("progress: step 4/4" in pod_log) is (node == 0), node
        # The data was prepared once, by the prepare pod, and every worker read it.
        assert pod_log.count("prepared before, read memory-mapped") == CHIPS_PER_HOST, node
    assert nodes == set(range(HOSTS)), nodes  # every node rank once, both slices' hosts
    assert len(ports) == 1, ports  # every host of both slices met at one rendezvous

    progress = done["status"]["progress"]
    assert progress["step"] == progress["totalSteps"] == STEPS, progress
    assert isinstance(progress["loss"], float) and progress["loss"] > 0
    data = done["status"]["data"]
    assert data["rows"] > 0 and (root / "output" / "prepared" / data["fingerprint"]).is_dir(), data
    # The native caveat: a condition, not a refusal.
    caveat = condition(done, trainer_stack.CONDITION)
    assert caveat is not None and (caveat["status"], caveat["reason"]) == (
        "False",
        trainer_stack.REASON_NATIVE,
    )
    # The final model, exported in the standard format, by one HSDP run of 16 processes.
    output = root / "output"
    assert (output / "model.safetensors").is_file()
    assert json.loads((output / "config.json").read_text())["hidden_size"] == 64
    record = json.loads((output / "tpuft-metrics.json").read_text())
    assert (record["final_step"], record["process_count"]) == (STEPS, WORKERS), record
    mesh = record["mesh"]
    assert (mesh["dcn"], mesh["fsdp"]) == (SLICES, HOSTS_PER_SLICE * CHIPS_PER_HOST), mesh
