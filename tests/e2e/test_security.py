"""Security (issue 8): a planted model token never leaves its Secret, a run's pods can do exactly one
thing with their credentials (report their own run's progress) and lose them with the run, and trainer
pods cannot escalate privileges.

The token reaches pods only as a secretKeyRef to a Secret of the run's own namespace; its value must not
appear in the run's status, the namespace's Events, the operator's log, the JobSet (and the trainer
config inside it), Jobs and pods, nor in `tpuft render` output. Each search is checked against a control (the Secret itself,
where the value is) so a search that could never find anything cannot pass unnoticed.
"""

from __future__ import annotations

import base64
import json
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import unique
from tests.e2e.conftest import OperatorProcess
from tests.support import get_json, patch_status_as, tpu_pods_of, wait_for
from tpuft_dev.cluster import kwok
from tpuft_dev.cluster.local import LocalCluster
from tpuft_operator.render import RenderSettings, naming, render_run

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

SECRET, KEY = "hf-token", "token"
LABEL = "tpuft.dev/finetune"


def gated_run(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "tpuft.dev/v1alpha1",
        "kind": "TPUFineTune",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"name": "meta-llama/Llama-3.1-8B", "tokenSecretRef": {"name": SECRET, "key": KEY}},
            "dataset": {"name": "gs://example-bucket/data/train.jsonl"},
            "tpu": {"type": "v5p", "topology": "2x2x1"},
            "training": {"method": "lora", "maxSteps": 10},
            "output": {"uri": "gs://example-bucket/out"},
            "podAnnotations": kwok.hold_running("60s"),
            **spec,
        },
    }


def forms(token: str) -> list[str]:
    """The token as it could leak: raw, base64 (as a Secret stores it) and JSON-escaped."""
    return [token, base64.b64encode(token.encode()).decode(), json.dumps(token)[1:-1]]


def leaks(text: str, token: str) -> list[str]:
    return [f for f in forms(token) if f in text]


@pytest.fixture(scope="module")
def namespace(local_cluster: LocalCluster) -> Iterator[str]:
    """One namespace for the module: the run is created once and its deletion is the last test."""
    name = unique("security")
    local_cluster.kubectl("create", "namespace", name)
    yield name
    local_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def running(
    local_cluster: LocalCluster, operator: OperatorProcess, namespace: str
) -> tuple[str, str, dict[str, Any]]:
    """A gated run, Running, with its token in a Secret. Returns (token, run name, the applied body)."""
    token = f"hf_planted_{secrets.token_urlsafe(24)}"
    local_cluster.kubectl(
        "create", "secret", "generic", SECRET, "-n", namespace, f"--from-literal={KEY}={token}"
    )
    local_cluster.add_nodepool("v5p", "2x2x1", prefix=unique("sec"))
    body = gated_run("gated", namespace)
    local_cluster.apply([body])
    wait_for(
        lambda: (
            get_json(local_cluster, "tpuft", "gated", "-n", namespace).get("status", {}).get("phase")
            == "Running"
        ),
        timeout=90,
        what="the gated run to be Running",
    )
    return token, "gated", body


def test_the_token_never_leaves_its_secret(
    local_cluster: LocalCluster,
    operator: OperatorProcess,
    namespace: str,
    running: tuple[str, str, dict[str, Any]],
    tmp_path: Path,
) -> None:
    token, name, body = running
    # Control: the search finds the value where it is.
    assert leaks(json.dumps(get_json(local_cluster, "secret", SECRET, "-n", namespace)), token)

    def text_of(*args: str) -> str:
        return json.dumps(get_json(local_cluster, *args, "-n", namespace))

    places = {
        "TPUFineTune (with status)": text_of("tpuft", name),
        "Events": text_of("events"),
        "JobSets": text_of("jobsets"),
        "Jobs": text_of("jobs"),
        "Pods": text_of("pods"),
        "ServiceAccounts/Roles/RoleBindings": text_of("serviceaccounts,roles,rolebindings"),
        "operator log": operator.log_path.read_text(errors="replace"),
    }
    source = tmp_path / "run.yaml"
    source.write_text(yaml.safe_dump(body))
    render = subprocess.run(
        [sys.executable, "-m", "tpuft_operator", "render", "-f", str(source)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert render.returncode == 0, render.stderr
    places["tpuft render"] = render.stdout + render.stderr
    found = {place: leaks(text, token) for place, text in places.items()}
    assert not any(found.values()), found

    # The only way in: a secretKeyRef (no namespace field exists) to the run's own Secret, in the
    # JobSet, its Jobs and its pods alike.
    jobset = get_json(local_cluster, "jobset", naming.jobset_name(name), "-n", namespace)
    jobs = get_json(local_cluster, "jobs", "-n", namespace, "-l", f"{LABEL}={name}")["items"]
    pods = get_json(local_cluster, "pods", "-n", namespace, "-l", f"{LABEL}={name}")["items"]
    assert jobs and pods
    pod_specs = [
        jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"],
        *[j["spec"]["template"]["spec"] for j in jobs],
        *[p["spec"] for p in pods],
    ]
    for spec in pod_specs:
        (container,) = spec["containers"]
        refs = [e for e in container["env"] if SECRET in json.dumps(e)]
        assert refs == [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": SECRET, "key": KEY}}}]
        assert "envFrom" not in container
        assert SECRET not in json.dumps(spec.get("volumes", []))
        assert all("secret" not in v for v in spec.get("volumes", []))


def test_trainer_pods_cannot_escalate(
    local_cluster: LocalCluster, namespace: str, running: tuple[str, str, dict[str, Any]]
) -> None:
    _, name, body = running
    rendered = render_run(body, RenderSettings()).jobset
    live_pods = get_json(local_cluster, "pods", "-n", namespace, "-l", f"{LABEL}={name}")["items"]
    specs = [rendered["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]]
    specs += [p["spec"] for p in live_pods]
    assert len(specs) > 1
    for spec in specs:
        (container,) = spec["containers"]
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False
        assert security["privileged"] is False
        assert not security.get("capabilities", {}).get("add")
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(host), host
        assert spec["serviceAccountName"] == naming.TRAINER_SERVICE_ACCOUNT
    # By default pods are non-root and drop every capability (restricted).
    hardened = render_run(body, RenderSettings()).jobset
    pod = hardened["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def pod_kubeconfig(local_cluster: LocalCluster, namespace: str, run: str, path: Path) -> tuple[Path, str]:
    """A kubeconfig with the token a kubelet would mount in the run's first pod (bound to the pod)."""
    pods = get_json(local_cluster, "pods", "-n", namespace, "-l", tpu_pods_of(run))["items"]
    pod = pods[0]
    path.write_text(
        local_cluster.service_account_kubeconfig(
            namespace,
            pod["spec"]["serviceAccountName"],
            pod=(pod["metadata"]["name"], pod["metadata"]["uid"]),
        )
    )
    return path, pod["metadata"]["name"]


def test_a_runs_pods_can_only_report_its_own_progress(
    local_cluster: LocalCluster, namespace: str, running: tuple[str, str, dict[str, Any]], tmp_path: Path
) -> None:
    _, name, _ = running
    other = gated_run("other", namespace, suspend=True)
    local_cluster.apply([other])
    wait_for(
        lambda: (
            get_json(local_cluster, "tpuft", "other", "-n", namespace).get("status", {}).get("jobSetName")
        ),
        timeout=60,
        what="the other run's status",
    )
    who = f"--as=system:serviceaccount:{namespace}:{naming.TRAINER_SERVICE_ACCOUNT}"

    def can(*args: str) -> bool:
        result = local_cluster.kubectl("auth", "can-i", *args, who, check=False)
        return result.stdout.strip() == "yes"

    # RBAC: the namespace's trainer account may get and patch run statuses, and nothing else.
    assert can("patch", f"tpufinetunes.tpuft.dev/{name}", "--subresource=status", "-n", namespace)
    denied = [
        ("patch", f"tpufinetunes.tpuft.dev/{name}", "-n", namespace),  # the spec
        ("get", f"tpufinetunes.tpuft.dev/{name}", "-n", namespace),
        ("list", "tpufinetunes.tpuft.dev", "-n", namespace),
        ("list", "tpufinetunes.tpuft.dev", "-A"),
        ("delete", f"tpufinetunes.tpuft.dev/{name}", "-n", namespace),
        ("patch", "tpufinetunes.tpuft.dev", "--subresource=status", "-n", "default"),
        ("get", f"secrets/{SECRET}", "-n", namespace),
        ("list", "secrets", "-n", namespace),
        ("create", "pods", "-n", namespace),
        ("create", "pods", "--subresource=exec", "-n", namespace),
        ("get", "configmaps", "-n", namespace),
        ("create", "jobsets.jobset.x-k8s.io", "-n", namespace),
        ("create", "serviceaccounts", "--subresource=token", "-n", namespace),
        ("create", "rolebindings.rbac.authorization.k8s.io", "-n", namespace),
        ("list", "nodes"),
    ]
    allowed = [args for args in denied if can(*args)]
    assert not allowed, allowed

    # Admission, for real with the pod's own token: its run's progress, and only that.
    config, pod = pod_kubeconfig(local_cluster, namespace, name, tmp_path / "pod.kubeconfig")

    def as_pod(*args: str, kubeconfig: Path = config) -> subprocess.CompletedProcess[str]:
        return local_cluster.kubectl(*args, kubeconfig=kubeconfig, check=False)

    def patch_status(run: str, status: dict[str, Any], kubeconfig: Path = config) -> tuple[int, str]:
        # One PATCH, as the trainer's reporter does (`kubectl patch` GETs first, which pods may not).
        return patch_status_as(kubeconfig, namespace, run, {"status": status})

    progress = {"progress": {"step": 1, "totalSteps": 10, "summary": "1/10 (10%)"}}
    own = patch_status(name, progress)
    assert own[0] == 200, own
    refused = {
        "another run's progress": (patch_status("other", progress), "does not belong to TPUFineTune other"),
        "its own phase": (patch_status(name, {"phase": "Succeeded"}), "status.progress only"),
        "its own message": (patch_status(name, {"message": "all good"}), "status.progress only"),
        "its own conditions": (patch_status(name, {"conditions": []}), "status.progress only"),
    }
    unbound = tmp_path / "unbound.kubeconfig"
    unbound.write_text(local_cluster.service_account_kubeconfig(namespace, naming.TRAINER_SERVICE_ACCOUNT))
    refused["a token not bound to a pod"] = (
        patch_status(name, progress, kubeconfig=unbound),
        "pod-bound token",
    )
    for what, ((code, body), reason) in refused.items():
        assert code == 403, (what, code, body)
        assert reason in body, (what, body)
    for args in (
        ("get", "tpufinetunes", "-n", namespace),
        ("get", "secret", SECRET, "-n", namespace),
        ("run", "shell", "--image=busybox", "-n", namespace, "--restart=Never"),
    ):
        result = as_pod(*args)
        assert result.returncode != 0 and "forbidden" in result.stderr.lower(), (args, result.stderr)
    assert "progress" not in get_json(local_cluster, "tpuft", "other", "-n", namespace).get("status", {})
    assert pod.startswith(naming.jobset_name(name))


def test_a_runs_credentials_die_with_the_run(
    local_cluster: LocalCluster, namespace: str, running: tuple[str, str, dict[str, Any]], tmp_path: Path
) -> None:
    _, name, _ = running
    config, _ = pod_kubeconfig(local_cluster, namespace, name, tmp_path / "pod.kubeconfig")

    def report() -> tuple[int, str]:
        return patch_status_as(config, namespace, name, {"status": {"progress": {"step": 2}}})

    assert report()[0] == 200
    local_cluster.kubectl("delete", "tpuft", name, "-n", namespace, "--wait=true", "--timeout=30s")
    wait_for(
        lambda: not get_json(local_cluster, "pods", "-n", namespace, "-l", f"{LABEL}={name}")["items"],
        timeout=90,
        what="the run's pods to be deleted",
    )
    # The token was bound to a pod that no longer exists: the apiserver stops accepting it (its
    # token cache keeps a valid answer for ~10 s).
    wait_for(
        lambda: report()[0] == 401,
        timeout=60,
        what="the pod's token to be refused",
        interval=2,
    )
    # The namespace's shared trainer identity stays for the next run; the Secret is the user's.
    local_cluster.kubectl("get", "serviceaccount", naming.TRAINER_SERVICE_ACCOUNT, "-n", namespace)
    local_cluster.kubectl("get", "secret", SECRET, "-n", namespace)
