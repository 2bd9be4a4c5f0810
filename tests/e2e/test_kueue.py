"""Queued runs against the real Kueue (issue 14): Kueue's manager with its webhooks and JobSet
integration, the real JobSet controller, the scheduler and kwok TPU node pools; the operator as the
chart's ServiceAccount, reading Kueue's Workloads.

The preemption test trains for real on this host (the local executor, as in test_stops.py), so the
evicted run's resume from its SIGTERM checkpoint is checked step by step.

Each test makes its own ResourceFlavor (by GKE's TPU labels), ClusterQueue with a google.com/tpu
quota, and LocalQueue, as docs/install-gke.md shows them. The quota, not the nodes, is what is
short: every test's node pool could run the pods, and Kueue alone keeps them waiting.

Kueue is started in the session's cluster by the `kueue` fixture (the first test here that needs it),
so the operator, started before, also shows it picks up Kueue's CRDs when they appear.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import unique
from tests.e2e.conftest import OperatorProcess
from tests.e2e.test_operator_lifecycle import events
from tests.e2e.test_progress import tiny_run
from tests.e2e.test_stops import Host, complete_checkpoints, host_on_this_machine, pod_logs, step_of
from tests.support import condition, finetune, get_json, tpu_pods_of, wait_for
from tpuft_dev.cluster import kwok
from tpuft_dev.cluster.local import LocalCluster
from tpuft_operator import topology
from tpuft_operator.render.jobset import KUEUE_PRIORITY_CLASS_LABEL as PRIORITY_LABEL

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.trainer]

V5P = topology.resolve("v5p", "2x2x2", slices=1)  # 2 hosts of 4 chips: 8 google.com/tpu a slice
KUEUE = "kueue.x-k8s.io/v1beta2"


@pytest.fixture(scope="session")
def kueue(local_cluster: LocalCluster) -> LocalCluster:
    """The session's cluster with Kueue (idempotent: a cluster that runs it already is kept as is)."""
    local_cluster.up(kueue=True)
    return local_cluster


@pytest.fixture
def v5p_pools(kueue: LocalCluster) -> list[str]:
    return kueue.add_nodepool("v5p", "2x2x2", slices=2, prefix=unique("kv5p"))


class Queues:
    """A ResourceFlavor + ClusterQueue (cluster-scoped, unique names) and a LocalQueue per test."""

    def __init__(self, cluster: LocalCluster, namespace: str) -> None:
        self.cluster, self.namespace = cluster, namespace
        self.made: list[tuple[str, str]] = []

    def make(
        self, chips: int, *, preemption: bool = False, name: str = "tpu", shape: topology.SliceShape = V5P
    ) -> str:
        flavor, cluster_queue = unique(f"{shape.family.name}-flavor"), unique("cq")
        spec: dict[str, Any] = {
            "namespaceSelector": {},
            "resourceGroups": [
                {
                    "coveredResources": [topology.TPU_RESOURCE],
                    "flavors": [
                        {
                            "name": flavor,
                            "resources": [{"name": topology.TPU_RESOURCE, "nominalQuota": chips}],
                        }
                    ],
                }
            ],
        }
        if preemption:
            spec["preemption"] = {"withinClusterQueue": "LowerPriority"}
        self.cluster.apply(
            [
                {
                    "apiVersion": KUEUE,
                    "kind": "ResourceFlavor",
                    "metadata": {"name": flavor},
                    "spec": {
                        "nodeLabels": {
                            topology.ACCELERATOR_LABEL: shape.family.accelerator,
                            topology.TOPOLOGY_LABEL: shape.topology,
                        }
                    },
                },
                {
                    "apiVersion": KUEUE,
                    "kind": "ClusterQueue",
                    "metadata": {"name": cluster_queue},
                    "spec": spec,
                },
                {
                    "apiVersion": KUEUE,
                    "kind": "LocalQueue",
                    "metadata": {"name": name, "namespace": self.namespace},
                    "spec": {"clusterQueue": cluster_queue},
                },
            ]
        )
        self.made += [("clusterqueue", cluster_queue), ("resourceflavor", flavor)]
        wait_for(
            lambda: (
                (condition(get_json(self.cluster, "clusterqueue", cluster_queue), "Active") or {}).get(
                    "status"
                )
                == "True"
            ),
            timeout=30,
            what=f"ClusterQueue {cluster_queue} to be active",
        )
        return cluster_queue

    def priority_class(self, value: int) -> str:
        name = unique(f"p{value}")
        self.cluster.apply(
            [
                {
                    "apiVersion": KUEUE,
                    "kind": "WorkloadPriorityClass",
                    "metadata": {"name": name},
                    "value": value,
                }
            ]
        )
        self.made.append(("workloadpriorityclass", name))
        return name

    def cleanup(self) -> None:
        for kind, name in self.made:
            self.cluster.kubectl("delete", kind, name, "--wait=false", "--ignore-not-found", check=False)


@pytest.fixture
def queues(kueue: LocalCluster, namespace: str) -> Iterator[Queues]:
    made = Queues(kueue, namespace)
    yield made
    made.cleanup()


def status(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    return dict(get_json(cluster, "tpufinetune", name, "-n", namespace).get("status") or {})


def wait_phase(
    cluster: LocalCluster, namespace: str, name: str, phase: str, timeout: float = 120
) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        current = status(cluster, namespace, name)
        return current if current.get("phase") == phase else None

    try:
        return wait_for(check, timeout=timeout, what=f"TPUFineTune {name} to be {phase}")
    except AssertionError as error:
        raise AssertionError(f"{error}; status: {json.dumps(status(cluster, namespace, name))}") from None


def wait_queued(
    cluster: LocalCluster, namespace: str, name: str, reason: str, timeout: float = 60
) -> dict[str, Any]:
    """The run is Queued and its Queued condition has ``reason``."""

    def check() -> dict[str, Any] | None:
        current = status(cluster, namespace, name)
        queued = condition({"status": current}, "Queued") or {}
        return current if current.get("phase") == "Queued" and queued.get("reason") == reason else None

    try:
        return wait_for(check, timeout=timeout, what=f"TPUFineTune {name} to be Queued ({reason})")
    except AssertionError as error:
        raise AssertionError(f"{error}; status: {json.dumps(status(cluster, namespace, name))}") from None


def reasons(cluster: LocalCluster, namespace: str, name: str) -> list[str]:
    return [reason for reason, _ in events(cluster, namespace, name)]


def workload_of(cluster: LocalCluster, namespace: str, jobset: str) -> dict[str, Any] | None:
    for wl in get_json(cluster, "workloads.kueue.x-k8s.io", "-n", namespace)["items"]:
        if any(ref.get("name") == jobset for ref in wl["metadata"].get("ownerReferences") or []):
            return dict(wl)
    return None


def run_pods(cluster: LocalCluster, namespace: str, name: str) -> list[dict[str, Any]]:
    return list(get_json(cluster, "pods", "-n", namespace, "-l", tpu_pods_of(name))["items"])


def test_two_runs_that_each_need_the_whole_quota_run_one_after_the_other(
    kueue: LocalCluster, operator: OperatorProcess, namespace: str, queues: Queues, v5p_pools: list[str]
) -> None:
    cluster_queue = queues.make(V5P.chips)
    hold = {"podAnnotations": kwok.hold_running("12s")}
    # The first prepares its data for 3 s first: no JobSet, so nothing for Kueue to admit (no
    # Workload), and its prepare Job carries no queue label (it holds no TPU).
    preparing = {"podAnnotations": {**kwok.hold_running("12s"), **kwok.hold_prepare("3s")}}
    kueue.apply([finetune("first", namespace, queueName="tpu", **preparing)])
    wait_phase(kueue, namespace, "first", "Preparing", timeout=30)
    assert not get_json(kueue, "workloads.kueue.x-k8s.io", "-n", namespace)["items"]
    assert not get_json(kueue, "jobsets", "-n", namespace)["items"]
    job = get_json(kueue, "job", "first-prepare", "-n", namespace)
    assert "kueue.x-k8s.io/queue-name" not in job["metadata"]["labels"]
    assert not job["spec"].get("suspend")  # Kueue left it alone (it would suspend a job it manages)
    wait_phase(kueue, namespace, "first", "Running")
    kueue.apply([finetune("second", namespace, queueName="tpu", **hold)])
    second = wait_queued(kueue, namespace, "second", "InsufficientQuota")
    # Kueue's own words, through the run's status.
    assert f"insufficient unused quota for {topology.TPU_RESOURCE}" in second["message"], second
    assert "LocalQueue tpu" in second["message"]
    assert not run_pods(kueue, namespace, "second")
    assert get_json(kueue, "jobset", "second", "-n", namespace)["spec"]["suspend"] is True

    first = wait_phase(kueue, namespace, "first", "Succeeded")
    queued = condition({"status": first}, "Queued")
    assert queued is not None and (queued["status"], queued["reason"]) == ("False", "Admitted"), first
    assert cluster_queue in queued["message"]
    wait_phase(kueue, namespace, "second", "Succeeded", timeout=120)
    for name in ("first", "second"):
        assert "Admitted" in reasons(kueue, namespace, name)
    assert reasons(kueue, namespace, "second").index("Queued") < reasons(kueue, namespace, "second").index(
        "Admitted"
    )


def test_a_run_naming_a_missing_localqueue_says_so(
    kueue: LocalCluster, operator: OperatorProcess, namespace: str, v5p_pools: list[str]
) -> None:
    kueue.apply([finetune("lost", namespace, queueName="no-such-queue")])
    lost = wait_queued(kueue, namespace, "lost", "LocalQueueMissing")
    assert "LocalQueue no-such-queue doesn't exist" in lost["message"], lost
    queued = condition({"status": lost}, "Queued")
    assert queued is not None and queued["status"] == "True"
    assert not run_pods(kueue, namespace, "lost")


@pytest.fixture
def cpu_host(kueue: LocalCluster, namespace: str, tmp_path: Path, tiny_assets: Path) -> Iterator[Host]:
    """This machine as a v5e 2x2 host that trains for real, in the cluster that runs Kueue."""
    with host_on_this_machine(kueue, namespace, tmp_path, tiny_assets) as made:
        yield made


def test_a_preempted_training_run_queues_again_and_resumes_from_its_checkpoint(
    kueue: LocalCluster, operator: OperatorProcess, namespace: str, queues: Queues, cpu_host: Host
) -> None:
    """A high-priority run preempts a low-priority one that trains for real on this host: Kueue
    evicts it, its trainer saves on SIGTERM, it is Queued again saying why, and once the other is
    done Kueue admits it again and it continues from the saved step to the end."""
    v5e = topology.resolve("v5e", "2x2", slices=1)
    queues.make(v5e.chips, preemption=True, shape=v5e)
    low, high = queues.priority_class(100), queues.priority_class(1000)
    output = cpu_host.output
    training = tiny_run("low", namespace, cpu_host.root, steps=60, prepare_job=False)  # no saveSteps
    training["spec"]["queueName"] = "tpu"
    training["metadata"]["labels"] = {PRIORITY_LABEL: low}
    kueue.apply([training])
    wait_for(
        lambda: step_of(kueue, "low", namespace) >= 15,
        timeout=300,
        what="training to pass step 15",
        interval=0.5,
    )
    job = get_json(kueue, "jobset", "low", "-n", namespace)
    assert job["metadata"]["labels"][PRIORITY_LABEL] == low

    urgent = finetune(
        "urgent",
        namespace,
        queueName="tpu",
        tpu={"type": "v5e", "topology": "2x2"},
        pod_annotations=kwok.hold_running("3s"),
        # Its JobSet at once, as Kueue's preemption is what is tested: the other run would finish
        # its last 45 steps (~7 s) while this one prepared.
        prepare={"enabled": False},
    )
    urgent["metadata"]["labels"] = {PRIORITY_LABEL: high}
    kueue.apply([urgent])
    evicted = wait_for(
        lambda: (
            (s := status(kueue, namespace, "low")).get("phase") == "Queued"
            and s["message"].startswith("evicted by Kueue")
            and s
        ),
        timeout=120,
        what="the low-priority run to be evicted back to the queue",
    )
    assert "Preempted" in evicted["message"], evicted
    assert (condition({"status": evicted}, "Queued") or {}).get("status") == "True"
    assert "Evicted" in reasons(kueue, namespace, "low")
    wait_for(
        lambda: bool(complete_checkpoints(output)) and not cpu_host.executor.logs(),
        timeout=120,
        what="the evicted trainer's checkpoint",
        interval=0.5,
    )
    (saved,) = complete_checkpoints(output)
    assert f"stopped at step {saved} after saving checkpoint-{saved} (SIGTERM)" in pod_logs(cpu_host.pods)

    wait_phase(kueue, namespace, "urgent", "Succeeded")
    done = wait_phase(kueue, namespace, "low", "Succeeded", timeout=420)
    record = json.loads((output / "tpuft-metrics.json").read_text())
    assert record["resumed_from"] == f"checkpoint-{saved}"
    assert min(int(step) for step in record["losses"]) == saved + 1  # nothing redone, nothing skipped
    assert done["progress"]["step"] == 60
    assert reasons(kueue, namespace, "low").count("Admitted") >= 2, reasons(kueue, namespace, "low")
    assert condition({"status": done}, "Queued")["reason"] == "Admitted"  # type: ignore[index]


def test_suspending_a_queued_run_holds_it_in_kueue_until_resumed(
    kueue: LocalCluster, operator: OperatorProcess, namespace: str, queues: Queues, v5p_pools: list[str]
) -> None:
    queues.make(V5P.chips)
    # Busy long enough for the other to prepare its data (~1-2 s on kwok), queue, and be suspended.
    kueue.apply([finetune("busy", namespace, queueName="tpu", pod_annotations=kwok.hold_running("14s"))])
    wait_phase(kueue, namespace, "busy", "Running")
    kueue.apply([finetune("paused", namespace, queueName="tpu")])
    wait_queued(kueue, namespace, "paused", "InsufficientQuota")
    kueue.kubectl(
        "patch", "tpuft", "paused", "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}'
    )
    wait_phase(kueue, namespace, "paused", "Suspended")
    wait_for(
        lambda: (
            (wl := workload_of(kueue, namespace, "paused")) is not None and wl["spec"].get("active") is False
        ),
        timeout=30,
        what="the operator to hold the suspended run's Workload (spec.active=false)",
    )
    wait_phase(kueue, namespace, "busy", "Succeeded")
    time.sleep(5)  # the quota is free now: a held run must stay held
    assert status(kueue, namespace, "paused")["phase"] == "Suspended"
    assert get_json(kueue, "jobset", "paused", "-n", namespace)["spec"]["suspend"] is True
    assert not run_pods(kueue, namespace, "paused")

    kueue.kubectl(
        "patch", "tpuft", "paused", "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":false}}'
    )
    wait_phase(kueue, namespace, "paused", "Succeeded", timeout=120)
    assert workload_of(kueue, namespace, "paused")["spec"]["active"] is True  # type: ignore[index]


def test_a_two_slice_run_is_admitted_whole_or_not_at_all(
    kueue: LocalCluster, operator: OperatorProcess, namespace: str, queues: Queues, v5p_pools: list[str]
) -> None:
    # Quota for one and a half slices: neither slice may start alone.
    cluster_queue = queues.make(V5P.chips + V5P.chips // 2)
    kueue.apply(
        [
            finetune(
                "multi",
                namespace,
                queueName="tpu",
                tpu={"type": "v5p", "topology": "2x2x2", "slices": 2},
                pod_annotations=kwok.hold_running("3s"),
            )
        ]
    )
    waiting = wait_for(
        lambda: (
            (s := status(kueue, namespace, "multi")).get("phase") == "Queued"
            and (condition({"status": s}, "Queued") or {}).get("reason")
            in ("InsufficientQuota", "ExceedsMaxQuota")
            and s
        ),
        timeout=60,
        what="the 2-slice run to be Queued for quota",
    )
    assert topology.TPU_RESOURCE in waiting["message"], waiting
    workload = workload_of(kueue, namespace, "multi")
    assert workload is not None
    # One Workload for both slices: one pod set of 2 slices x 2 hosts.
    assert [(p["count"]) for p in workload["spec"]["podSets"]] == [2 * V5P.hosts_per_slice], workload["spec"]
    time.sleep(3)
    assert not run_pods(kueue, namespace, "multi")

    kueue.kubectl(
        "patch",
        "clusterqueue",
        cluster_queue,
        "--type=json",
        "-p",
        json.dumps(
            [
                {
                    "op": "replace",
                    "path": "/spec/resourceGroups/0/flavors/0/resources/0/nominalQuota",
                    "value": 2 * V5P.chips,
                }
            ]
        ),
    )
    wait_phase(kueue, namespace, "multi", "Running")
    assert len(run_pods(kueue, namespace, "multi")) == 2 * V5P.hosts_per_slice
    wait_phase(kueue, namespace, "multi", "Succeeded")
