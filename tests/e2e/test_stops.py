"""What a stop costs a real run, through the operator (issue 17): the pod's `tpuft train` runs on this
host (4 PJRT CPU devices for a v5e 2x2 host), the executor plays the kubelet (SIGTERM on deletion,
SIGKILL after the grace period, the exit code reported), and nothing else is simulated.

- spec.suspend on a running run: the pods get SIGTERM, the trainer saves the step it reached; on
  resume training continues from that step, not from 0; status.goodput accounts for the pause.
- GKE's maintenance label on the run's node: condition MaintenanceScheduled and an Event, a
  checkpoint before the announced time; the drain that follows stops the run with a checkpoint,
  and the restart, with maxRestarts 0, is not counted against it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import unique
from tests.e2e.conftest import OperatorProcess, copy_assets
from tests.e2e.test_progress import tiny_run
from tests.support import get_json, tpu_pods_of, wait_for
from tpuft_dev.cluster.executor import LocalExecutor
from tpuft_dev.cluster.local import LocalCluster
from tpuft_operator.maintenance import SCHEDULED_LABEL
from tpuft_trainer.storage import COMPLETE

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.trainer]
LOST = ("waitingSeconds", "startupSeconds", "checkpointSeconds", "redoneSeconds", "restartGapSeconds")


def status_of(cluster: LocalCluster, name: str, namespace: str) -> dict[str, Any]:
    return dict(get_json(cluster, "tpuft", name, "-n", namespace).get("status") or {})


def step_of(cluster: LocalCluster, name: str, namespace: str) -> int:
    return int((status_of(cluster, name, namespace).get("progress") or {}).get("step") or 0)


def complete_checkpoints(output: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in output.glob("checkpoint-*") if (p / COMPLETE).exists())


def finished(cluster: LocalCluster, name: str, namespace: str) -> dict[str, Any] | None:
    status = status_of(cluster, name, namespace)
    return status if status.get("phase") in ("Succeeded", "Failed") else None


def pod_logs(directory: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(directory.glob("*.log")))


def assert_goodput_adds_up(goodput: dict[str, Any]) -> None:
    assert 0 < goodput["ratio"] <= 1, goodput
    total = goodput["productiveSeconds"] + sum(goodput["lost"][k] for k in LOST)
    assert abs(total - goodput["wallSeconds"]) < 0.5, goodput


@dataclass
class Host:
    """This machine as a TPU host: the tiny model's files, the run's output, the executor."""

    root: Path
    output: Path
    pods: Path  # the trainer processes' logs, one file per pod
    executor: LocalExecutor


@contextmanager
def host_on_this_machine(
    cluster: LocalCluster, namespace: str, tmp_path: Path, tiny_assets: Path
) -> Iterator[Host]:
    """This machine as a v5e 2x2 host of ``cluster`` that trains for real: a kwok node pool of its
    own, a copy of the demo's model and data, and the local executor running the pods' `tpuft train`."""
    root = copy_assets(tiny_assets, tmp_path / "work")
    cluster.add_nodepool("v5e", "2x2", prefix=unique("cpu"))
    executor = LocalExecutor(cluster, namespace, tmp_path / "pods")
    executor.start()
    try:
        yield Host(root, root / "output", tmp_path / "pods", executor)
    finally:
        executor.stop()


@pytest.fixture
def host(local_cluster: LocalCluster, namespace: str, tmp_path: Path, tiny_assets: Path) -> Iterator[Host]:
    with host_on_this_machine(local_cluster, namespace, tmp_path, tiny_assets) as made:
        yield made


def test_suspend_then_resume_continues_from_the_suspend_step(
    local_cluster: LocalCluster, operator: OperatorProcess, namespace: str, host: Host
) -> None:
    root, output, executor = host.root, host.output, host.executor
    local_cluster.apply([tiny_run("pausable", namespace, root, steps=150, prepare_job=False)])  # no saveSteps
    wait_for(
        lambda: step_of(local_cluster, "pausable", namespace) >= 15,
        timeout=300,
        what="training to pass step 15",
        interval=0.5,
    )
    patch = '{"spec":{"suspend":true}}'
    local_cluster.kubectl("patch", "tpuft", "pausable", "-n", namespace, "--type=merge", "-p", patch)
    suspended_at = step_of(local_cluster, "pausable", namespace)

    def saved_and_suspended() -> bool:
        status = status_of(local_cluster, "pausable", namespace)
        return (
            status.get("phase") == "Suspended" and bool(complete_checkpoints(output)) and not executor.logs()
        )

    wait_for(saved_and_suspended, timeout=120, what="the stop's checkpoint and phase Suspended", interval=0.5)
    (saved,) = complete_checkpoints(output)
    logs = pod_logs(host.pods)
    assert f"stopped at step {saved} after saving checkpoint-{saved} (SIGTERM)" in logs, logs[-3000:]
    assert saved >= suspended_at  # the step it reached, not an older one
    time.sleep(3)  # suspended for a while: the gap shows in status.goodput
    patch = '{"spec":{"suspend":false}}'
    local_cluster.kubectl("patch", "tpuft", "pausable", "-n", namespace, "--type=merge", "-p", patch)
    done = wait_for(
        lambda: finished(local_cluster, "pausable", namespace),
        timeout=420,
        what="the resumed run to finish",
        interval=1,
    )
    logs = pod_logs(host.pods)
    assert done["phase"] == "Succeeded", logs[-3000:]

    record = json.loads((output / "tpuft-metrics.json").read_text())
    assert record["resumed_from"] == f"checkpoint-{saved}"
    assert min(int(step) for step in record["losses"]) == saved + 1  # nothing redone, nothing skipped
    assert done["progress"]["step"] == 150
    assert done.get("restarts", 0) == 0  # a suspension is not a restart
    goodput = done["goodput"]
    assert_goodput_adds_up(goodput)
    assert len(goodput["attempts"]) == 2
    assert goodput["attempts"][1]["resumedFromStep"] == saved
    assert goodput["lost"]["restartGapSeconds"] >= 3  # the time it spent suspended
    assert goodput["lost"]["redoneSeconds"] == 0
    assert goodput["lost"]["startupSeconds"] > 0 and goodput["lost"]["checkpointSeconds"] > 0
    wide = local_cluster.kubectl("get", "tpuft", "pausable", "-n", namespace, "-o", "wide").stdout
    assert "GOODPUT" in wide and str(goodput["ratio"]) in wide


def test_maintenance_checkpoints_before_the_announced_time_and_the_restart_is_free(
    local_cluster: LocalCluster, operator: OperatorProcess, namespace: str, host: Host
) -> None:
    root, output = host.root, host.output
    body = tiny_run("maintained", namespace, root, steps=150, prepare_job=False)
    assert body["spec"]["maxRestarts"] == 0  # so a restart that counted would fail the run
    node = ""
    try:
        local_cluster.apply([body])
        wait_for(
            lambda: step_of(local_cluster, "maintained", namespace) >= 10,
            timeout=300,
            what="training to pass step 10",
            interval=0.5,
        )
        (pod,) = get_json(local_cluster, "pods", "-n", namespace, "-l", tpu_pods_of("maintained"))["items"]
        node = pod["spec"]["nodeName"]
        announced = int(time.time()) + 300
        local_cluster.kubectl("label", "node", node, f"{SCHEDULED_LABEL}={announced}", "--overwrite")

        def asked_and_saved() -> dict[str, Any] | None:
            status = status_of(local_cluster, "maintained", namespace)
            conditions = {c["type"]: c for c in status.get("conditions") or []}
            save = (status.get("progress") or {}).get("lastCheckpoint") or {}
            if conditions.get("MaintenanceScheduled", {}).get("status") != "True" or not complete_checkpoints(
                output
            ):
                return None
            return status if save.get("reason") == f"checkpoint request {announced}" else None

        try:
            status = wait_for(asked_and_saved, timeout=120, what="the maintenance checkpoint", interval=0.5)
        except AssertionError as error:
            seen = status_of(local_cluster, "maintained", namespace)
            raise AssertionError(f"{error}\nstatus: {seen}\noperator: {operator.log_tail(30)}") from None
        assert time.time() < announced  # before the announced time
        condition = next(c for c in status["conditions"] if c["type"] == "MaintenanceScheduled")
        assert f"node {node}: maintenance scheduled for" in condition["message"], condition
        assert condition["reason"] == "MaintenanceScheduled"
        events = get_json(
            local_cluster,
            "events",
            "-n",
            namespace,
            "--field-selector=involvedObject.name=maintained,reason=MaintenanceScheduled",
        )["items"]
        assert len(events) == 1 and events[0]["type"] == "Warning", events
        before_drain = complete_checkpoints(output)

        # The maintenance itself: GKE drains the node; the pods get SIGTERM and save again.
        local_cluster.kubectl(
            "drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--force", "--timeout=120s"
        )

        def stopped_with_a_checkpoint() -> bool:
            return len(complete_checkpoints(output)) > len(
                before_drain
            ) and "after saving checkpoint-" in pod_logs(host.pods)

        wait_for(stopped_with_a_checkpoint, timeout=120, what="the drain's checkpoint", interval=0.5)
        drain_saved = complete_checkpoints(output)[-1]
        assert drain_saved > before_drain[-1]
        # The VMs come back.
        local_cluster.kubectl("uncordon", node)
        local_cluster.kubectl("label", "node", node, f"{SCHEDULED_LABEL}-")
        done = wait_for(
            lambda: finished(local_cluster, "maintained", namespace),
            timeout=420,
            what="the restarted run to finish",
            interval=1,
        )
        logs = pod_logs(host.pods)
        assert done["phase"] == "Succeeded", (done.get("message"), logs[-3000:])
    finally:
        if node:
            local_cluster.kubectl("uncordon", node, check=False)

    record = json.loads((output / "tpuft-metrics.json").read_text())
    assert record["resumed_from"] == f"checkpoint-{drain_saved}"
    assert min(int(step) for step in record["losses"]) == drain_saved + 1  # no step lost to the drain
    assert done["restarts"] == 1  # restarted once, with maxRestarts 0: the restart was not counted
    (jobset,) = get_json(local_cluster, "jobsets", "-n", namespace)["items"]
    assert jobset["status"]["restarts"] == 1
    assert jobset["status"].get("restartsCountTowardsMax", 0) == 0
    conditions = {c["type"]: c for c in done["conditions"]}
    assert conditions["MaintenanceScheduled"]["status"] == "False"  # it was over before the run ended
    assert_goodput_adds_up(done["goodput"])
