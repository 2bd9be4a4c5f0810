"""The Helm chart against the local cluster's real API server: lint, schema, server-side dry-run of
what it renders (default and non-default values, the pod under the restricted Pod Security
Standard), install/upgrade/uninstall, and the RBAC it grants, read back with `kubectl auth can-i`.
With watchNamespaces, the operator itself runs as the chart's ServiceAccount on namespaced Roles."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import unique
from tests.support import finetune, get_json, wait_for
from tpuft_dev.cluster.local import LocalCluster
from tpuft_dev.cluster.operator_process import OperatorProcess
from tpuft_operator.api.policy import AdminPolicy, admission_policy, cel_parameters
from tpuft_operator.settings import OperatorSettings

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tpuft"

# Exactly what the operator may do in a namespace it watches (resource -> verbs), as
# `kubectl auth can-i --list` reports it. A change to the chart's rules must change this too.
NAMESPACED = {
    "tpufinetunes.tpuft.dev": {"list", "watch"},
    "tpufinetunes.tpuft.dev/status": {"get", "patch", "operate"},
    "jobsets.jobset.x-k8s.io": {"get", "list", "watch", "create", "patch"},
    # The prepare Job; delete: only when the run's data settings changed (it is made again).
    "jobs.batch": {"get", "list", "watch", "create", "delete"},
    "pods": {"list", "watch", "patch"},  # patch: only the checkpoint-request annotation (maintenance)
    "serviceaccounts": {"get", "create"},
    "roles.rbac.authorization.k8s.io": {"get", "create"},
    "rolebindings.rbac.authorization.k8s.io": {"get", "create"},
    "events": {"create", "list"},  # list: the Job controller's FailedCreate events (refused pods)
    # Kueue's reasons for a queued run; patch: only spec.active (holding a suspended queued run).
    "workloads.kueue.x-k8s.io": {"list", "watch", "patch"},
}
CLUSTER_ONLY = {
    "customresourcedefinitions.apiextensions.k8s.io": {"list", "watch"},
    # The JobSet CRD alone: is the installed JobSet new enough for what the operator renders?
    "customresourcedefinitions.apiextensions.k8s.io[jobsets.jobset.x-k8s.io]": {"get"},
    "nodes": {"get", "list", "watch"},  # GKE's maintenance signals (watchNodes, on by default here)
}
# Every authenticated user has these (system:basic-user): not the chart's.
EVERYONE = {
    "selfsubjectreviews.authentication.k8s.io",
    "selfsubjectaccessreviews.authorization.k8s.io",
    "selfsubjectrulesreviews.authorization.k8s.io",
}


class Helm:
    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.binary = cluster.bins.helm
        if not self.binary.exists():
            raise AssertionError(f"helm is missing at {self.binary}: run `tpuft cluster build`")

    def run(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.binary), f"--kubeconfig={self.cluster.kubeconfig}", *args],
            capture_output=True,
            text=True,
            timeout=180,
            input=input,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def template(self, release: str, namespace: str, *values: str) -> list[dict[str, Any]]:
        text = self.run("template", release, str(CHART), "--namespace", namespace, *values).stdout
        return [doc for doc in yaml.safe_load_all(text) if doc]


@pytest.fixture(scope="module")
def helm(local_cluster: LocalCluster) -> Helm:
    return Helm(local_cluster)


@pytest.fixture(scope="module")
def crd_installed(local_cluster: LocalCluster) -> None:
    local_cluster.apply((ROOT / "crds" / "tpufinetunes.tpuft.dev.yaml").read_text())
    local_cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/tpufinetunes.tpuft.dev"
    )


@pytest.fixture
def servicemonitor_crd(local_cluster: LocalCluster) -> Iterator[None]:
    """A minimal stand-in for the Prometheus Operator's ServiceMonitor CRD (same group, version,
    kind and scope; the schema is open), so a ServiceMonitor can be dry-run on the server."""
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {"plural": "servicemonitors", "singular": "servicemonitor", "kind": "ServiceMonitor"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                            },
                        }
                    },
                }
            ],
        },
    }
    local_cluster.apply([crd])
    local_cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/servicemonitors.monitoring.coreos.com"
    )
    yield
    local_cluster.kubectl(
        "delete", "crd", "servicemonitors.monitoring.coreos.com", "--wait=false", check=False
    )


def dry_run(cluster: LocalCluster, objects: list[dict[str, Any]]) -> str:
    proc = cluster.kubectl(
        "apply",
        "--server-side",
        "--dry-run=server",
        "--field-manager=helm-test",
        "-f",
        "-",
        input=yaml.safe_dump_all(objects),
        check=False,
    )
    assert proc.returncode == 0, f"server-side dry-run rejected the chart:\n{proc.stderr}"
    return proc.stdout


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def effective_rules(cluster: LocalCluster, who: str, namespace: str) -> dict[str, set[str]]:
    """resource -> verbs the subject holds in ``namespace`` (SelfSubjectRulesReview through
    `kubectl auth can-i --list`), without non-resource URLs and what every user has. A rule limited
    to some objects is keyed ``resource[name ...]``."""
    out = cluster.kubectl("auth", "can-i", "--list", f"--as={who}", "-n", namespace).stdout
    rules: dict[str, set[str]] = {}
    for line in out.splitlines()[1:]:
        match = re.fullmatch(r"(\S+)\s+\[\]\s+\[(.*?)\]\s+\[(.*)\]", line.strip())
        if match and match.group(1) not in EVERYONE:
            resource = f"{match.group(1)}[{match.group(2)}]" if match.group(2) else match.group(1)
            rules.setdefault(resource, set()).update(match.group(3).split())
    return rules


def can(cluster: LocalCluster, who: str, *args: str) -> bool:
    proc = cluster.kubectl("auth", "can-i", *args, f"--as={who}", check=False)
    assert proc.stdout.strip() in ("yes", "no"), proc.stderr
    return proc.stdout.strip() == "yes"


# ---------------------------------------------------------------- offline


def test_chart_crds_are_the_generated_ones() -> None:
    for generated in (ROOT / "crds").glob("*.yaml"):
        assert (CHART / "crds" / generated.name).read_text() == generated.read_text(), (
            f"charts/tpuft/crds/{generated.name} differs from crds/: run `tpuft crd --write`"
        )
    assert {p.name for p in (CHART / "crds").iterdir()} == {p.name for p in (ROOT / "crds").glob("*.yaml")}


def test_helm_lint(helm: Helm) -> None:
    out = helm.run("lint", "--strict", str(CHART)).stdout
    assert "0 chart(s) failed" in out
    helm.run("lint", "--strict", str(CHART), "--set", "watchNamespaces={team-a,team-b}")
    helm.run("lint", "--strict", str(CHART), "--set", "metrics.serviceMonitor.enabled=true")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            ["--set", "logLevel=LOUD"],
            "at '/logLevel': value must be one of 'DEBUG', 'INFO', 'WARNING', 'ERROR'",
        ),
        (["--set", "logFormat=xml"], "at '/logFormat'"),
        (["--set", "watchNamespaces={Team_A}"], "at '/watchNamespaces/0': 'Team_A' does not match pattern"),
        (["--set", "watchNamespaces={a,a}"], "at '/watchNamespaces'"),
        (["--set-json", 'watchNamespaces="team-a"'], "at '/watchNamespaces': got string, want array"),
        (["--set", "metrics.port=0"], "at '/metrics/port'"),
        (["--set", "health.port=99999"], "at '/health/port'"),
        (["--set", "metrics.port=8081"], "metrics.port and health.port must differ"),
        (["--set", "image.pullPolicy=Sometimes"], "at '/image/pullPolicy'"),
        (["--set", "image.repository=Not An Image"], "at '/image/repository'"),
        (["--set", "trainerImage="], "at '/trainerImage'"),
        (["--set", "trainerImageNative=Not An Image"], "at '/trainerImageNative'"),
        (["--set", "resources.limits.memory=lots"], "at '/resources/limits/memory'"),
        (["--set", "metrics.serviceMonitor.interval=often"], "at '/metrics/serviceMonitor/interval'"),
        (["--set", "logleve=DEBUG"], "additional properties 'logleve' not allowed"),
        (["--set", "workers=0"], "at '/workers'"),
        (["--set", "statusSettleSeconds=-1"], "at '/statusSettleSeconds'"),
        (["--set", "writeQps=-5"], "at '/writeQps'"),
        (["--set", "writeBurst=0"], "at '/writeBurst'"),
        (["--set", "policy.allowedVolumeTypes={hostpath}"], "at '/policy/allowedVolumeTypes/0'"),
        (["--set", "policy.maxChipsPerRun=-1"], "at '/policy/maxChipsPerRun'"),
        (["--set", "policy.allowedEnv={HF ENDPOINT}"], "at '/policy/allowedEnv/0'"),
        (["--set", "policy.allowedServiceAccounts={Admin}"], "at '/policy/allowedServiceAccounts/0'"),
        (["--set", "policy.requireQueueName=yes"], "at '/policy/requireQueueName'"),
        (["--set", "policy.allowHostNetwork=yes"], "at '/policy/allowHostNetwork'"),
        (["--set", "trainerSecurity.runAsUser=0"], "at '/trainerSecurity/runAsUser'"),
        (["--set", "networkPolicy.enable=true"], "additional properties 'enable' not allowed"),
    ],
)
def test_bad_values_fail_with_the_path_of_the_value(helm: Helm, values: list[str], message: str) -> None:
    proc = helm.run("template", "bad", str(CHART), *values, check=False)
    assert proc.returncode != 0 and not proc.stdout.strip()
    assert message in proc.stderr, proc.stderr


def test_rendered_deployment_is_restricted_single_and_probed(helm: Helm) -> None:
    objects = helm.template("tpuft", "tpuft-system")
    (deployment,) = by_kind(objects, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
    }
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert set(container["resources"]) == {"requests", "limits"}
    assert container["args"] == ["operator"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["TPUFT_NAMESPACES"] == "" and env["TPUFT_LOG_LEVEL"] == "INFO"
    # The chart's defaults are the operator's own (settings.py), passed explicitly.
    defaults = {
        "TPUFT_WORKERS": OperatorSettings.workers,
        "TPUFT_STATUS_SETTLE_SECONDS": OperatorSettings.status_settle_seconds,
        "TPUFT_RESYNC_SECONDS": OperatorSettings.resync_seconds,
        "TPUFT_WRITE_QPS": OperatorSettings.write_qps,
        "TPUFT_WRITE_BURST": OperatorSettings.write_burst,
    }
    assert {k: float(env[k]) for k in defaults} == defaults
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"metrics": 8080, "health": 8081}
    assert pod["serviceAccountName"] == "tpuft"
    assert not by_kind(objects, "ServiceMonitor") and not by_kind(objects, "Role")
    (service,) = by_kind(objects, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_notes_say_what_to_do_next(helm: Helm) -> None:
    notes = helm.run("template", "tpuft", str(CHART), "-n", "ops", "--set", "watchNamespaces={a,b}")
    # helm template does not print NOTES; `install --dry-run` does (checked on the server below).
    assert notes.returncode == 0


# ---------------------------------------------------------------- against the API server


VALUE_SETS = {
    "default": [],
    "policy-security-network": [
        "--set-json",
        'policy.allowedImages=["registry.example.com/team/"]',
        "--set-json",
        'policy.allowedEnv=["HF_ENDPOINT","XLA_*"]',
        "--set-json",
        'policy.allowedVolumeTypes=["csi","emptyDir","hostPath"]',
        "--set",
        "policy.maxChipsPerRun=0",
        "--set",
        "policy.requireQueueName=true",
        "--set",
        "policy.allowHostNetwork=true",
        "--set",
        "trainerSecurity.restricted=true",
        "--set",
        "networkPolicy.enabled=true",
        "--set",
        "networkPolicy.trainers=true",
    ],
    "watch-namespaces": [
        "--set",
        "watchNamespaces={NS1,NS2}",
        "--set",
        "metrics.serviceMonitor.enabled=false",
    ],
    "watch-namespaces-and-nodes": ["--set", "watchNamespaces={NS1}", "--set", "watchNodes=true"],
    "custom": [
        "--set",
        "image.repository=registry.example.com/platform/tpuft-operator",
        "--set",
        "image.tag=0.1.0-rc1",
        "--set",
        "trainerImage=registry.example.com/platform/tpuft-trainer@sha256:" + "a" * 64,
        "--set",
        "trainerImageNative=registry.example.com/platform/tpuft-trainer@sha256:" + "b" * 64,
        "--set",
        "logLevel=DEBUG",
        "--set",
        "logFormat=text",
        "--set",
        "serviceAccount.name=fine-tuner",
        "--set",
        "serviceAccount.annotations.iam\\.gke\\.io/gcp-service-account=op@p.iam.gserviceaccount.com",
        "--set-json",
        'imagePullSecrets=[{"name":"regcred"}]',
        "--set-json",
        'resources={"requests":{"cpu":"50m","memory":"100Mi"},"limits":{"memory":"300Mi"}}',
        "--set",
        "metrics.port=9090",
        "--set",
        "health.port=9091",
        "--set-json",
        'tolerations=[{"key":"dedicated","operator":"Equal","value":"ops","effect":"NoSchedule"}]',
    ],
}


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_template_passes_server_side_dry_run(
    helm: Helm, local_cluster: LocalCluster, crd_installed: None, namespace: str, value_set: str
) -> None:
    watched = [unique("watched"), unique("watched")]
    for name in watched:
        local_cluster.kubectl("create", "namespace", name)
    values = [v.replace("NS1", watched[0]).replace("NS2", watched[1]) for v in VALUE_SETS[value_set]]
    release = unique("r")
    objects = helm.template(release, namespace, *values)
    try:
        out = dry_run(local_cluster, objects)
    finally:
        for name in watched:
            local_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
    assert out.count("serverside-applied (server dry run)") == len(objects), out
    (deployment,) = by_kind(objects, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    if value_set == "watch-namespaces":
        assert env["TPUFT_NAMESPACES"] == ",".join(watched)
        # Namespaced mode asks for nothing cluster-wide (watchNodes defaults to off there).
        assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")
        assert env["TPUFT_WATCH_NODES"] == "false"
        assert sorted(r["metadata"]["namespace"] for r in by_kind(objects, "Role")) == sorted(watched)
        assert sorted(r["metadata"]["namespace"] for r in by_kind(objects, "RoleBinding")) == sorted(watched)
    if value_set == "watch-namespaces-and-nodes":
        # The one cluster-wide grant namespaced mode can opt into: reading TPU nodes.
        (role,) = by_kind(objects, "ClusterRole")
        assert role["rules"] == [
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}
        ]
        assert env["TPUFT_WATCH_NODES"] == "true"
    if value_set == "policy-security-network":
        assert env["TPUFT_ALLOWED_ENV"] == "HF_ENDPOINT,XLA_*" and env["TPUFT_MAX_CHIPS_PER_RUN"] == "0"
        assert env["TPUFT_REQUIRE_QUEUE_NAME"] == "true" and env["TPUFT_RUN_AS_USER"] == "1000"
        assert env["TPUFT_TRAINER_NETWORK_POLICY"] == "true" and env["TPUFT_ALLOW_HOST_NETWORK"] == "true"
        (policy,) = [
            p
            for p in by_kind(objects, "ValidatingAdmissionPolicy")
            if p["metadata"]["name"].endswith("-admin")
        ]
        variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
        assert json.loads(variables["images"]) == ["registry.example.com/team/", "ghcr.io/tpuft/trainer"]
        assert json.loads(variables["volumeTypes"]) == ["csi", "emptyDir", "hostPath"]
        assert variables["hostNetwork"] == "true"
        (network,) = by_kind(objects, "NetworkPolicy")
        assert network["spec"]["ingress"][0]["ports"] == [{"port": "metrics", "protocol": "TCP"}]
        (role,) = by_kind(objects, "ClusterRole")
        assert {
            "apiGroups": ["networking.k8s.io"],
            "resources": ["networkpolicies"],
            "verbs": ["get", "create"],
        } in role["rules"]
    if value_set == "default":
        assert not by_kind(objects, "NetworkPolicy")
        assert env["TPUFT_RUN_AS_USER"] == "1000" and env["TPUFT_TRAINER_NETWORK_POLICY"] == "false"
        assert env["TPUFT_TRAINER_IMAGE_NATIVE"] == OperatorSettings().trainer_image_native
        assert env["TPUFT_ALLOW_HOST_NETWORK"] == "false"
    if value_set == "custom":
        assert container["image"] == "registry.example.com/platform/tpuft-operator:0.1.0-rc1"
        assert env["TPUFT_TRAINER_IMAGE"].endswith("@sha256:" + "a" * 64)
        assert env["TPUFT_TRAINER_IMAGE_NATIVE"].endswith("@sha256:" + "b" * 64)
        assert env["TPUFT_LOG_LEVEL"] == "DEBUG" and env["TPUFT_METRICS_PORT"] == "9090"
        (account,) = by_kind(objects, "ServiceAccount")
        assert account["metadata"]["name"] == "fine-tuner"
        assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "fine-tuner"
        (binding,) = by_kind(objects, "ClusterRoleBinding")
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "fine-tuner", "namespace": namespace}
        ]


def test_the_charts_admin_policy_is_the_one_python_renders(helm: Helm) -> None:
    """One source of truth: the chart's admission policy for its default values is exactly what
    api/policy.py renders for the operator's default AdminPolicy (and the Deployment's env, read
    back as settings, is that policy too)."""
    objects = helm.template("tpuft", "ops", "--show-only", "templates/admin-policy.yaml")
    expected = admission_policy(
        "tpuft-admin", cel_parameters(AdminPolicy(operator_namespace="ops"), "ghcr.io/tpuft/trainer:0.1.0")
    )
    for obj in objects:
        del obj["metadata"]["labels"]
    assert objects == expected
    (deployment,) = by_kind(helm.template("tpuft", "ops"), "Deployment")
    env = {
        e["name"]: e["value"]
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        if "value" in e
    }
    settings = OperatorSettings(
        operator_namespace=env["TPUFT_OPERATOR_NAMESPACE"],
        allowed_volume_types=tuple(env["TPUFT_ALLOWED_VOLUME_TYPES"].split(",")),
        max_chips_per_run=int(env["TPUFT_MAX_CHIPS_PER_RUN"]),
    )
    assert settings.admin_policy() == AdminPolicy(operator_namespace="ops")
    assert env["TPUFT_ALLOWED_IMAGES"] == env["TPUFT_ALLOWED_ENV"] == env["TPUFT_ALLOWED_SECRETS"] == ""
    # Namespaced mode: the policy binds only to the watched namespaces.
    scoped = helm.template(
        "tpuft", "ops", "--show-only", "templates/admin-policy.yaml", "--set", "watchNamespaces={a,b}"
    )
    assert scoped[1]["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["a", "b"]}
    ]
    assert not helm.template(
        "tpuft", "ops", "--show-only", "templates/admin-policy.yaml", "--set", "policy.admission=false"
    )


def test_operator_pod_is_admitted_under_restricted_pod_security(
    helm: Helm, local_cluster: LocalCluster, namespace: str
) -> None:
    local_cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    (deployment,) = by_kind(helm.template("tpuft", namespace), "Deployment")
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "operator-pss", "namespace": namespace},
        "spec": {**deployment["spec"]["template"]["spec"], "serviceAccountName": "default"},
    }
    proc = local_cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
    # The check is live: the same pod without the container's securityContext is refused.
    del pod["spec"]["containers"][0]["securityContext"]
    refused = local_cluster.kubectl(
        "create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False
    )
    assert refused.returncode != 0 and 'violates PodSecurity "restricted' in refused.stderr


def test_servicemonitor_passes_server_side_dry_run(
    helm: Helm, local_cluster: LocalCluster, namespace: str, servicemonitor_crd: None
) -> None:
    objects = helm.template(
        "tpuft",
        namespace,
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.serviceMonitor.interval=15s",
        "--set",
        "metrics.serviceMonitor.labels.release=prometheus",
    )
    (monitor,) = by_kind(objects, "ServiceMonitor")
    (service,) = by_kind(objects, "Service")
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert all(
        service["metadata"]["labels"][k] == v for k, v in monitor["spec"]["selector"]["matchLabels"].items()
    )
    dry_run(local_cluster, [service, monitor])


def test_bad_values_fail_helm_install_and_install_nothing(helm: Helm, namespace: str) -> None:
    release = unique("bad")
    proc = helm.run("install", release, str(CHART), "-n", namespace, "--set", "logLevel=verbose", check=False)
    assert proc.returncode != 0 and "at '/logLevel'" in proc.stderr
    assert json.loads(helm.run("list", "-n", namespace, "-a", "-o", "json").stdout) == []


def test_install_upgrade_uninstall(helm: Helm, local_cluster: LocalCluster, namespace: str) -> None:
    release = unique("tpuft")
    fullname = f"{release}"  # the release name contains the chart name: it is the full name
    installed = helm.run("install", release, str(CHART), "-n", namespace)
    assert "STATUS: deployed" in installed.stdout
    assert "kubectl apply --server-side -f examples/v5e-single-host.yaml" in installed.stdout  # NOTES
    assert f"deploy/{fullname}" in installed.stdout
    status = json.loads(helm.run("status", release, "-n", namespace, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed" and status["version"] == 1
    for kind in ("deployment", "serviceaccount", "service"):
        assert get_json(local_cluster, kind, "-n", namespace, "-l", f"app.kubernetes.io/instance={release}")[
            "items"
        ], kind
    assert get_json(local_cluster, "clusterrole", fullname)["rules"]
    assert get_json(local_cluster, "clusterrolebinding", fullname)["subjects"][0]["namespace"] == namespace
    local_cluster.kubectl("get", "crd", "tpufinetunes.tpuft.dev")  # from the chart's crds/ (or already there)

    helm.run("upgrade", release, str(CHART), "-n", namespace, "--reuse-values", "--set", "logLevel=DEBUG")
    deployment = get_json(local_cluster, "deployment", fullname, "-n", namespace)
    env = {
        e["name"]: e.get("value", "") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["TPUFT_LOG_LEVEL"] == "DEBUG"
    assert json.loads(helm.run("status", release, "-n", namespace, "-o", "json").stdout)["version"] == 2
    refused = helm.run(
        "upgrade",
        release,
        str(CHART),
        "-n",
        namespace,
        "--reuse-values",
        "--set",
        "logLevel=NOISY",
        check=False,
    )
    assert refused.returncode != 0 and "at '/logLevel'" in refused.stderr
    assert json.loads(helm.run("status", release, "-n", namespace, "-o", "json").stdout)["version"] == 2

    helm.run("uninstall", release, "-n", namespace, "--wait", "--timeout=60s")
    assert json.loads(helm.run("list", "-n", namespace, "-a", "-o", "json").stdout) == []
    assert local_cluster.kubectl("get", "clusterrole", fullname, check=False).returncode != 0
    # The Deployment is gone when helm returns; its pod goes by garbage collection, a moment later.
    deadline = time.monotonic() + 60
    while (
        left := get_json(
            local_cluster, "all", "-n", namespace, "-l", f"app.kubernetes.io/instance={release}"
        )["items"]
    ) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, [o["metadata"]["name"] for o in left]
    # Helm never deletes CRDs from crds/: uninstalling the operator leaves users' runs in place.
    local_cluster.kubectl("get", "crd", "tpufinetunes.tpuft.dev")


def test_cluster_wide_rbac_is_exactly_what_the_operator_uses(
    helm: Helm, local_cluster: LocalCluster, namespace: str
) -> None:
    release = unique("tpuft")
    helm.run("install", release, str(CHART), "-n", namespace)
    who = f"system:serviceaccount:{namespace}:{release}"
    try:
        assert effective_rules(local_cluster, who, "default") == {**NAMESPACED, **CLUSTER_ONLY}
        assert can(local_cluster, who, "list", "tpufinetunes.tpuft.dev", "-A")
        assert can(local_cluster, who, "watch", "pods", "-A")
        assert can(local_cluster, who, "create", "jobsets.jobset.x-k8s.io", "-n", "team-x")
        assert can(
            local_cluster,
            who,
            "get",
            "customresourcedefinitions.apiextensions.k8s.io/jobsets.jobset.x-k8s.io",
        )
        assert can(
            local_cluster, who, "patch", "tpufinetunes.tpuft.dev", "--subresource=status", "-n", "team-x"
        )
        for denied in (
            ("get", "secrets", "-A"),
            ("list", "secrets", "-A"),
            ("watch", "secrets", "-n", "default"),
            ("create", "pods", "-n", "default"),
            ("create", "pods", "--subresource=exec", "-n", "default"),
            ("delete", "pods", "-n", "default"),
            ("update", "tpufinetunes.tpuft.dev", "-n", "default"),
            ("patch", "tpufinetunes.tpuft.dev", "-n", "default"),
            ("delete", "jobsets.jobset.x-k8s.io", "-n", "default"),
            ("escalate", "roles.rbac.authorization.k8s.io", "-n", "default"),
            ("bind", "roles.rbac.authorization.k8s.io", "-n", "default"),
            ("bind", "clusterroles.rbac.authorization.k8s.io"),
            ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
            ("update", "roles.rbac.authorization.k8s.io", "-n", "default"),
            ("impersonate", "serviceaccounts", "-n", "default"),
            ("create", "serviceaccounts", "--subresource=token", "-n", "default"),
            ("create", "customresourcedefinitions.apiextensions.k8s.io"),
            ("get", "customresourcedefinitions.apiextensions.k8s.io/tpufinetunes.tpuft.dev"),
            ("patch", "customresourcedefinitions.apiextensions.k8s.io/jobsets.jobset.x-k8s.io"),
            ("patch", "jobs.batch", "-n", "default"),
            ("patch", "nodes"),
            ("delete", "nodes"),
            ("create", "pods", "--subresource=eviction", "-n", "default"),
        ):
            assert not can(local_cluster, who, *denied), f"the operator can {' '.join(denied)}"
    finally:
        helm.run("uninstall", release, "-n", namespace, check=False)


def test_watch_namespaces_grants_rights_only_there_and_the_operator_runs_on_them(
    helm: Helm,
    local_cluster: LocalCluster,
    crd_installed: None,
    namespace: str,
    tmp_path: Path,
) -> None:
    watched, other = unique("team-a"), unique("team-b")
    for name in (watched, other):
        local_cluster.kubectl("create", "namespace", name)
    release = unique("tpuft")
    operator: OperatorProcess | None = None
    try:
        helm.run("install", release, str(CHART), "-n", namespace, "--set", f"watchNamespaces={{{watched}}}")
        who = f"system:serviceaccount:{namespace}:{release}"
        assert effective_rules(local_cluster, who, watched) == NAMESPACED
        assert effective_rules(local_cluster, who, other) == {}
        assert effective_rules(local_cluster, who, namespace) == {}
        assert not can(local_cluster, who, "list", "tpufinetunes.tpuft.dev", "-A")
        assert not can(local_cluster, who, "list", "customresourcedefinitions.apiextensions.k8s.io")
        assert not can(local_cluster, who, "get", "secrets", "-n", watched)
        assert local_cluster.kubectl("get", "clusterrole", release, check=False).returncode != 0

        # The operator, as this ServiceAccount with only these Roles, runs a fine-tune in the watched
        # namespace and leaves the other one alone.
        local_cluster.add_nodepool("v5p", "2x2x2", prefix=unique("v5p"))
        kubeconfig = tmp_path / "sa.kubeconfig"
        kubeconfig.write_text(local_cluster.service_account_kubeconfig(namespace, release))
        operator = OperatorProcess(
            kubeconfig,
            tmp_path / "operator.log",
            TPUFT_NAMESPACES=watched,
            TPUFT_RESYNC_SECONDS="5",
            TPUFT_TRAINER_IMAGE="example.invalid/tpuft-trainer:test",
        )
        operator.start()
        for ns in (watched, other):
            local_cluster.apply([finetune("ft", ns)])
        done = wait_for(
            lambda: (
                (get_json(local_cluster, "tpuft", "ft", "-n", watched).get("status") or {}).get("phase")
                == "Succeeded"
            ),
            # Up to ~110 s of this is kopf retrying the cluster-scoped namespace and CRD listings it
            # is (rightly) denied here before it falls back to the exact namespaces; the operator
            # can skip them with kopf's settings.scanning.disabled when --namespaces is given.
            timeout=240,
            what="the run in the watched namespace to succeed",
        )
        assert done
        assert "status" not in get_json(local_cluster, "tpuft", "ft", "-n", other)
        assert not get_json(local_cluster, "jobsets", "-n", other)["items"]
        # Every API call it needed in the namespace was allowed. The only denials are kopf's
        # optional cluster-scoped scans (namespaces, CRDs), which it does without.
        # 403 as a number of its own: the start-up line's random ports (":44403") are not denials.
        denied = [
            line
            for line in operator.log_path.read_text(errors="replace").splitlines()
            if re.search(r"\b403\b", line)
        ]
        unexpected = [
            line
            for line in denied
            if not re.search(r'cannot list resource "(namespaces|customresourcedefinitions)"', line)
            or "at the cluster scope" not in line
        ]
        assert not unexpected, "\n".join(unexpected)
        # Started with --watch-nodes on (the flag's default) but no node read: it says so and runs
        # without the maintenance signals rather than waiting for a node index it may not fill.
        assert "may not list and watch nodes: running without GKE's maintenance signals" in (
            operator.log_path.read_text(errors="replace")
        )
        # Nor may it read the JobSet CRD (nothing cluster-wide): it says so and runs unchecked.
        assert "may not get the CustomResourceDefinition jobsets.jobset.x-k8s.io" in (
            operator.log_path.read_text(errors="replace")
        )
    finally:
        if operator is not None:
            operator.stop()
        helm.run("uninstall", release, "-n", namespace, check=False)
        for name in (watched, other):
            local_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
