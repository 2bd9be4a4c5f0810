"""The local control plane is real: JobSet webhooks default, the scheduler places TPU pods only where
the chips are, the garbage collector cascades, RBAC denies, kwok plays exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import unique
from tests.support import condition, get_json, wait_for
from tpuft_dev.cluster import kwok
from tpuft_dev.cluster.local import LocalCluster
from tpuft_operator import topology

pytestmark = pytest.mark.cluster


def tpu_jobset(
    name: str, *, chips: int, hosts: int, tpu_type: str = "v5p", topo: str = "2x2x2"
) -> dict[str, Any]:
    """A JobSet written by hand the way a user would, leaving defaults to the JobSet webhook."""
    family = topology.FAMILIES[tpu_type]
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name},
        "spec": {
            "replicatedJobs": [
                {
                    "name": "slice",
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "parallelism": hosts,
                            "completions": hosts,
                            "backoffLimit": 0,
                            "template": {
                                "spec": {
                                    "nodeSelector": {
                                        topology.ACCELERATOR_LABEL: family.accelerator,
                                        topology.TOPOLOGY_LABEL: topo,
                                    },
                                    "containers": [
                                        {
                                            "name": "train",
                                            "image": "example.invalid/trainer:1",
                                            "resources": {
                                                "requests": {topology.TPU_RESOURCE: str(chips)},
                                                "limits": {topology.TPU_RESOURCE: str(chips)},
                                            },
                                        }
                                    ],
                                }
                            },
                        }
                    },
                }
            ]
        },
    }


def pods_of(cluster: LocalCluster, namespace: str, jobset: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = get_json(
        cluster, "pods", "-n", namespace, "-l", f"jobset.sigs.k8s.io/jobset-name={jobset}"
    )["items"]
    return items


def test_components_are_healthy(local_cluster: LocalCluster) -> None:
    statuses = local_cluster.status()
    # Kueue only once a test asked for it (tests/e2e/test_kueue.py), or in a cluster kept with it.
    kueue = ["kueue-controller"] if local_cluster.kueue else []
    assert [s.name for s in statuses] == [
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "jobset-controller",
        *kueue,
        "kwok",
    ]
    assert all(s.healthy for s in statuses), statuses
    raw = local_cluster.kubectl("get", "--raw=/version").stdout
    assert '"gitVersion": "v1.36.3"' in raw  # ldflags set: tools that read the version see a real one


def test_nodepool_looks_like_gke(local_cluster: LocalCluster) -> None:
    prefix = unique("np")
    names = local_cluster.add_nodepool("v5p", "2x2x2", prefix=prefix)
    assert len(names) == 2
    for name in names:
        node = get_json(local_cluster, "node", name)
        labels = node["metadata"]["labels"]
        assert labels[topology.ACCELERATOR_LABEL] == "tpu-v5p-slice"
        assert labels[topology.TOPOLOGY_LABEL] == "2x2x2"
        assert labels[topology.NODEPOOL_LABEL] == f"{prefix}-0"
        assert node["status"]["allocatable"][topology.TPU_RESOURCE] == "4"
        assert {"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"} in node["spec"]["taints"]
        assert condition(node, "Ready")["status"] == "True"  # type: ignore[index]


def test_multislice_nodepool_has_one_pool_per_slice(local_cluster: LocalCluster) -> None:
    prefix = unique("ms")
    names = local_cluster.add_nodepool("v6e", "4x4", slices=2, prefix=prefix)
    assert len(names) == 8  # 16 chips per slice / 4 chips per host x 2 slices
    pools = {get_json(local_cluster, "node", n)["metadata"]["labels"][topology.NODEPOOL_LABEL] for n in names}
    assert pools == {f"{prefix}-0", f"{prefix}-1"}


def test_tpu_jobset_is_defaulted_scheduled_run_and_garbage_collected(
    local_cluster: LocalCluster, namespace: str
) -> None:
    nodes = set(local_cluster.add_nodepool("v5p", "2x2x2", prefix=unique("smoke")))
    local_cluster.apply(
        [{**tpu_jobset("fits", chips=4, hosts=2), "metadata": {"name": "fits", "namespace": namespace}}]
    )

    created = get_json(local_cluster, "jobset", "fits", "-n", namespace)
    # The JobSet defaulting webhook really ran.
    assert created["spec"]["successPolicy"]["operator"] == "All"
    assert created["spec"]["startupPolicy"]["startupPolicyOrder"] == "AnyOrder"
    assert created["spec"]["replicatedJobs"][0]["template"]["spec"]["completionMode"] == "Indexed"

    jobset = wait_for(
        lambda: (
            (js := get_json(local_cluster, "jobset", "fits", "-n", namespace))
            and (c := condition(js, "Completed"))
            and c["status"] == "True"
            and js
        ),
        timeout=120,
        what="the JobSet to complete",
    )
    assert jobset["status"]["replicatedJobsStatus"][0]["succeeded"] == 1
    pods = pods_of(local_cluster, namespace, "fits")
    assert len(pods) == 2
    # Pods landed on TPU nodes with enough chips (other tests' v5p pools are valid places too).
    for pod in pods:
        node = get_json(local_cluster, "node", pod["spec"]["nodeName"])
        assert node["metadata"]["labels"][topology.TOPOLOGY_LABEL] == "2x2x2"
        # ExtendedResourceToleration added the TPU toleration, as GKE does.
        assert any(t.get("key") == "google.com/tpu" for t in pod["spec"]["tolerations"])
    assert nodes  # the pool we made exists (scheduling may have used any matching pool)

    local_cluster.kubectl("delete", "jobset", "fits", "-n", namespace)
    wait_for(
        lambda: (
            not pods_of(local_cluster, namespace, "fits")
            and not get_json(local_cluster, "jobs", "-n", namespace)["items"]
        ),
        timeout=120,
        what="the garbage collector to delete the JobSet's Jobs and pods",
    )


def test_tpu_pod_asking_for_more_chips_than_a_host_has_stays_pending(
    local_cluster: LocalCluster, namespace: str
) -> None:
    local_cluster.add_nodepool("v5p", "2x2x2", prefix=unique("big"))
    spec = tpu_jobset("too-big", chips=8, hosts=2)
    spec["metadata"]["namespace"] = namespace
    local_cluster.apply([spec])

    def unschedulable() -> list[str]:
        pods = pods_of(local_cluster, namespace, "too-big")
        messages = [
            c.get("message", "")
            for p in pods
            if (c := condition(p, "PodScheduled"))
            and c["status"] == "False"
            and c.get("reason") == "Unschedulable"
        ]
        return messages if len(messages) >= 1 else []

    messages = wait_for(unschedulable, timeout=60, what="the scheduler to refuse the 8-chip pods")
    assert any("google.com/tpu" in m for m in messages), messages
    for pod in pods_of(local_cluster, namespace, "too-big"):
        assert pod["status"]["phase"] == "Pending"
        assert not pod["spec"].get("nodeName")


def test_simulated_exit_code_fails_the_pod(local_cluster: LocalCluster, namespace: str) -> None:
    local_cluster.add_nodepool("v5e", "2x2", prefix=unique("exit"))
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "user-error", "namespace": namespace},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"annotations": kwok.simulated_exit(64)},
                "spec": {
                    "restartPolicy": "Never",
                    "nodeSelector": {topology.ACCELERATOR_LABEL: "tpu-v5-lite-podslice"},
                    "containers": [
                        {
                            "name": "train",
                            "image": "example.invalid/trainer:1",
                            "resources": {"limits": {topology.TPU_RESOURCE: "4"}},
                        }
                    ],
                },
            },
        },
    }
    local_cluster.apply([job])

    def failed_pod() -> dict[str, Any] | None:
        for pod in get_json(local_cluster, "pods", "-n", namespace, "-l", "job-name=user-error")["items"]:
            if pod["status"].get("phase") == "Failed":
                return dict(pod)
        return None

    pod = wait_for(failed_pod, timeout=90, what="the pod to fail with exit code 64")
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 64
    wait_for(
        lambda: (
            (c := condition(get_json(local_cluster, "job", "user-error", "-n", namespace), "Failed"))
            and c["status"] == "True"
        ),
        timeout=60,
        what="the Job to fail",
    )


def test_service_account_kubeconfig_is_subject_to_rbac(
    local_cluster: LocalCluster, namespace: str, tmp_path: Path
) -> None:
    local_cluster.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    local_cluster.kubectl(
        "create", "role", "read-cm", "--verb=get,list", "--resource=configmaps", "-n", namespace
    )
    local_cluster.kubectl(
        "create",
        "rolebinding",
        "reader",
        "--role=read-cm",
        f"--serviceaccount={namespace}:reader",
        "-n",
        namespace,
    )
    config = tmp_path / "sa.kubeconfig"
    config.write_text(local_cluster.service_account_kubeconfig(namespace, "reader"))
    allowed = local_cluster.kubectl("get", "configmaps", "-n", namespace, kubeconfig=config, check=False)
    assert allowed.returncode == 0, allowed.stderr
    denied = local_cluster.kubectl("get", "secrets", "-n", namespace, kubeconfig=config, check=False)
    assert denied.returncode != 0
    assert "forbidden" in denied.stderr.lower()
    assert f"system:serviceaccount:{namespace}:reader" in denied.stderr


def test_cli_status_and_env(local_cluster: LocalCluster) -> None:
    tpuft = [sys.executable, "-m", "tpuft_operator", "cluster"]
    status = subprocess.run([*tpuft, "status", "--name", local_cluster.name], capture_output=True, text=True)
    assert status.returncode == 0, status.stderr
    assert "kube-apiserver" in status.stdout and "healthy" in status.stdout
    env = subprocess.run(
        [*tpuft, "env", "--name", local_cluster.name], capture_output=True, text=True, check=True
    )
    assert f"export KUBECONFIG={local_cluster.kubeconfig}" in env.stdout
    logs = subprocess.run(
        [*tpuft, "logs", "--name", local_cluster.name, "kube-apiserver", "--lines", "3"],
        capture_output=True,
        text=True,
    )
    assert logs.returncode == 0 and len(logs.stdout.splitlines()) == 3, logs.stderr
    unknown = subprocess.run(
        [*tpuft, "logs", "--name", local_cluster.name, "nope"], capture_output=True, text=True
    )
    assert unknown.returncode == 1 and "unknown component 'nope'" in unknown.stderr
    # The printed lines really work in a shell: kubectl from PATH reaches this cluster.
    shell = subprocess.run(
        [
            "bash",
            "-c",
            f'eval "$({" ".join(tpuft)} env --name {local_cluster.name})" && kubectl get ns default -o name',
        ],
        capture_output=True,
        text=True,
    )
    assert shell.stdout.strip() == "namespace/default", shell.stderr


def test_kwok_stages_come_from_the_module_plus_ours(local_cluster: LocalCluster) -> None:
    stages = list(yaml.safe_load_all(local_cluster.layout.kwok_config.read_text()))
    names = {s["metadata"]["name"] for s in stages}
    assert {"node-initialize", "pod-ready", "pod-complete", "pod-delete", "tpuft-pod-exit-code"} <= names
    # A deleted kwok pod goes within 2 s, not at a random moment of its grace period (upstream's).
    (delete,) = [s for s in stages if s["metadata"]["name"] == "pod-delete"]
    assert delete["spec"]["delay"]["jitterDurationMilliseconds"] == 2000
    assert "deletionTimestamp" not in str(delete["spec"]["delay"])
