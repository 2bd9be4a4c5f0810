"""Multi-tenant safety (issue 13): a TPUFineTune must not be a way to act on another user's run.

Through the operator as the chart installs it, on the local cluster (kwok TPU pods):
- the takeover: a run named after another run's JobSet (a long or dotted name becomes a prefix plus a
  hash, itself a valid run name) fails with NameTaken and never suspends the victim's pods;
- the squat: a run created first under the name a later run's JobSet would have had under the old
  naming (a hash of the name) takes nothing from it: long names now end in a hash of the run's uid,
  which no one knows in advance.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.conftest import unique
from tests.e2e.conftest import OperatorProcess
from tests.support import condition, finetune, get_json, patch_status_as, tpu_pods_of, wait_for
from tpuft_dev.cluster import kwok
from tpuft_dev.cluster.local import LocalCluster
from tpuft_operator.render import naming

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

VICTIM = "llama-3.1-8b-sft"  # a dot: its JobSet name is derived (prefix + hash)


def run(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    return finetune(
        name,
        namespace,
        tpu={"type": "v5p", "topology": "2x2x1"},
        pod_annotations=kwok.hold_running("600s"),
        **spec,
    )


def status_of(cluster: LocalCluster, name: str, namespace: str) -> dict[str, Any]:
    return dict(get_json(cluster, "tpuft", name, "-n", namespace).get("status") or {})


def running(cluster: LocalCluster, name: str, namespace: str) -> dict[str, Any]:
    return wait_for(
        lambda: (s := status_of(cluster, name, namespace)) and s.get("phase") == "Running" and s,
        timeout=120,
        what=f"{name} to be Running",
    )


def test_a_run_named_after_another_runs_jobset_cannot_take_it_over(
    local_cluster: LocalCluster, operator: OperatorProcess, namespace: str
) -> None:
    local_cluster.add_nodepool("v5p", "2x2x1", slices=2, prefix=unique("tenancy"))
    local_cluster.apply([run(VICTIM, namespace)])
    victim = running(local_cluster, VICTIM, namespace)
    jobset_name = victim["jobSetName"]
    assert jobset_name != VICTIM and jobset_name.startswith("llama-3-1-8b-sft-")
    pods_before = {
        p["metadata"]["uid"]
        for p in get_json(local_cluster, "pods", "-n", namespace, "-l", tpu_pods_of(VICTIM))["items"]
    }
    # The attacker: allowed to create TPUFineTunes, names one after the victim's JobSet, suspended.
    local_cluster.apply([run(jobset_name, namespace, suspend=True)])
    attacker = wait_for(
        lambda: (s := status_of(local_cluster, jobset_name, namespace)) and s.get("phase") == "Failed" and s,
        timeout=60,
        what="the attacker to fail",
    )
    failed = condition({"status": attacker}, "Failed")
    assert failed is not None and failed["reason"] == "NameTaken", attacker
    # Its first object, the prepare Job, already bears the victim's name: refused there, before any JobSet.
    assert (
        f"Job {namespace}/{jobset_name}-prepare already exists and belongs to TPUFineTune {VICTIM}"
        in failed["message"]
    )
    assert "jobSetName" not in attacker
    events = get_json(
        local_cluster,
        "events",
        "-n",
        namespace,
        f"--field-selector=involvedObject.name={jobset_name},reason=NameTaken",
    )["items"]
    assert len(events) == 1, events
    # Several resyncs later (5 s each here) the victim's JobSet was never suspended, its pods never
    # replaced, and it is still the victim's.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        jobset = get_json(local_cluster, "jobset", jobset_name, "-n", namespace)
        assert not jobset["spec"].get("suspend"), "the attacker suspended the victim's JobSet"
        time.sleep(2)
    pods_after = {
        p["metadata"]["uid"]
        for p in get_json(local_cluster, "pods", "-n", namespace, "-l", tpu_pods_of(VICTIM))["items"]
    }
    assert pods_after == pods_before
    assert status_of(local_cluster, VICTIM, namespace)["phase"] == "Running"
    assert status_of(local_cluster, VICTIM, namespace)["jobSetName"] == jobset_name


def test_a_run_created_first_under_a_later_runs_old_jobset_name_squats_nothing(
    local_cluster: LocalCluster, operator: OperatorProcess, namespace: str
) -> None:
    local_cluster.add_nodepool("v5p", "2x2x1", slices=2, prefix=unique("squat"))
    squatter = naming.jobset_name(VICTIM)  # what the victim's JobSet was called before (hash of the name)
    local_cluster.apply([run(squatter, namespace)])
    running(local_cluster, squatter, namespace)
    local_cluster.apply([run(VICTIM, namespace)])
    victim = running(local_cluster, VICTIM, namespace)
    assert victim["jobSetName"] != squatter
    (owner,) = get_json(local_cluster, "jobset", victim["jobSetName"], "-n", namespace)["metadata"][
        "ownerReferences"
    ]
    assert owner["name"] == VICTIM
    assert status_of(local_cluster, squatter, namespace)["jobSetName"] == squatter


def test_an_account_that_may_list_runs_is_not_exempt_from_the_progress_rules(
    local_cluster: LocalCluster, operator: OperatorProcess, namespace: str, tmp_path: Any
) -> None:
    """A CI account that may list TPUFineTunes, named as a run's serviceAccountName, gets the progress
    Role bound; its tokens that are not bound to one of the run's pods may still write no status."""
    local_cluster.add_nodepool("v5p", "2x2x1", slices=2, prefix=unique("ci"))
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "ci-reader", "namespace": namespace},
        "rules": [
            {"apiGroups": ["tpuft.dev"], "resources": ["tpufinetunes"], "verbs": ["get", "list", "watch"]}
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "ci-reader", "namespace": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "ci-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "ci", "namespace": namespace}],
    }
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": "ci", "namespace": namespace},
    }
    local_cluster.apply([account, role, binding])
    local_cluster.apply([run("ci-run", namespace, serviceAccountName="ci"), run("other", namespace)])
    running(local_cluster, "ci-run", namespace)
    running(local_cluster, "other", namespace)
    config = tmp_path / "ci.kubeconfig"
    config.write_text(local_cluster.service_account_kubeconfig(namespace, "ci"))  # not bound to a pod
    for target in ("other", "ci-run"):
        code, message = patch_status_as(config, namespace, target, {"status": {"phase": "Succeeded"}})
        assert code == 403, f"the CI account rewrote {target}'s phase"
        assert "only the operator, administrators and the pods of a run" in message, message
    assert status_of(local_cluster, "other", namespace)["phase"] == "Running"
    # A trainer pod's own token reads no run back (the progress Role has no get).
    (pod,) = get_json(local_cluster, "pods", "-n", namespace, "-l", tpu_pods_of("other"))["items"]
    pod_config = tmp_path / "pod.kubeconfig"
    pod_config.write_text(
        local_cluster.service_account_kubeconfig(
            namespace,
            pod["spec"]["serviceAccountName"],
            pod=(pod["metadata"]["name"], pod["metadata"]["uid"]),
        )
    )
    for target in ("other", "ci-run"):
        read = local_cluster.kubectl(
            "get",
            "tpuft",
            target,
            "-n",
            namespace,
            "--subresource=status",
            kubeconfig=pod_config,
            check=False,
        )
        assert read.returncode != 0 and "forbidden" in read.stderr.lower(), read.stderr
