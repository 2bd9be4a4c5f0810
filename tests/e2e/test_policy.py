"""The admin policy and PodSecurity (issue 13, parts 2 and 3), against the local cluster with the
chart's RBAC, its ValidatingAdmissionPolicy and real PodSecurity and ResourceQuota admission.

The attacks are the `policy` cases of tests/cluster/bad_input_corpus.yaml (hostPath, reserved env,
another Secret, another ServiceAccount, a foreign image, too many chips, host networking) plus a run
in the operator's own namespace. The operator is installed four ways, as an admin would configure the chart:

1. defaults: every attack is refused at `kubectl create`, the field named; a run in a namespace
   enforcing the `restricted` Pod Security Standard gets its pods (restricted by default), and one
   in a namespace whose ResourceQuota allows no TPU says why within seconds (ReplicaFailure, the
   apiserver's words);
2. defaults without the admission policy (policy.admission=false) and requireQueueName: the
   operator fails every attack itself (Valid=False, InvalidSpec, the field named), creating nothing;
3. the same with the admission policy: a run without spec.queueName is refused at create;
4. every rule loosened, trainerSecurity.restricted off and networkPolicy.trainers on: the attacks
   are accepted and run (kwok pods Running), a run in the restricted namespace says within seconds
   that PodSecurity refuses its root pods, a host-network run's pods have the node's network (its
   IP, ClusterFirstWithHostNet, the stop port as a host port) and in a namespace enforcing
   `baseline` it says within seconds that PodSecurity refuses them, and each run gets its
   NetworkPolicy (admitted by the apiserver; kwok enforces none).

The session's operator (tests/e2e/conftest.py) is stopped meanwhile and restored afterwards.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.test_bad_input import case_object, cases_of
from tests.conftest import unique
from tests.e2e.conftest import (
    E2E_OVERRIDES,
    E2E_VALUES,
    OPERATOR_NAMESPACE,
    OPERATOR_SETTINGS,
    OperatorProcess,
)
from tests.support import NOT_PREPARE, condition, finetune, get_json, wait_for
from tpuft_dev.cluster import kwok
from tpuft_dev.cluster.local import LocalCluster
from tpuft_dev.cluster.operator_process import ADMIN_POLICY, install_operator, operator_env

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

ATTACKS = cases_of("policy")
HUGE = "policy-2-million-chips"  # stays refused when loosened (the cap is raised to 512, not off)
DEFAULTS = ("--set", f"trainerImage={OPERATOR_SETTINGS.trainer_image}")
LOOSENED = (
    *DEFAULTS,
    "--set-json",
    'policy.allowedVolumeTypes=["configMap","csi","downwardAPI","emptyDir","ephemeral",'
    '"persistentVolumeClaim","projected","secret","hostPath"]',
    "--set-json",
    'policy.allowedEnv=["HF_ENDPOINT","LD_*","PYTHONPATH","HTTPS_PROXY","REQUESTS_CA_BUNDLE","TPU_*","XLA_FLAGS"]',
    "--set-json",
    'policy.allowedSecrets=["db-admin"]',
    "--set-json",
    'policy.allowedTolerations=["*"]',
    "--set-json",
    'policy.allowedServiceAccounts=["deployer","tpuft"]',
    "--set-json",
    'policy.allowedImages=["evil.example/","ghcr.io/tpuft/"]',
    "--set",
    "policy.maxChipsPerRun=512",
    "--set",
    "policy.allowHostNetwork=true",
    "--set",
    "trainerSecurity.restricted=false",  # the opt-out for node pools whose TPU devices need root
    "--set",
    "networkPolicy.enabled=true",
    "--set",
    "networkPolicy.trainers=true",
)


class Admin:
    """Installs the chart's RBAC and policies for some values and runs the operator with the
    settings the chart's Deployment gives it for the same values."""

    def __init__(self, cluster: LocalCluster, session: OperatorProcess, logs: Path) -> None:
        self.cluster, self.session, self.logs = cluster, session, logs
        self.current: OperatorProcess | None = None

    def configure(self, values: tuple[str, ...], *, run_operator: bool = True) -> OperatorProcess | None:
        if self.current is not None:
            self.current.stop()
            self.current = None
        self.session.stop()
        kubeconfig = install_operator(self.cluster, values=values)
        if run_operator:
            self.current = OperatorProcess(
                kubeconfig,
                self.logs / f"operator-{unique('p')}.log",
                **{**operator_env(self.cluster, values), **E2E_OVERRIDES},
            )
            self.current.start()
        return self.current

    def restore(self) -> None:
        if self.current is not None:
            self.current.stop()
        install_operator(self.cluster, values=E2E_VALUES)
        self.session.start()


@pytest.fixture(scope="module")
def admin(
    local_cluster: LocalCluster, operator: OperatorProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Admin]:
    chart = Admin(local_cluster, operator, tmp_path_factory.mktemp("policy"))
    yield chart
    chart.restore()


def attack(case: dict[str, Any], namespace: str) -> dict[str, Any]:
    obj = case_object(case, namespace)
    obj["spec"]["podAnnotations"] = kwok.hold_running("600s")
    return obj


def create(cluster: LocalCluster, obj: dict[str, Any], *, dry_run: bool = False) -> tuple[int, str]:
    args = ["create", "-f", "-"] + (["--dry-run=server"] if dry_run else [])
    proc = cluster.kubectl(*args, input=json.dumps(obj), check=False)
    return proc.returncode, proc.stderr


def create_all(
    cluster: LocalCluster, objects: list[dict[str, Any]], *, dry_run: bool = False
) -> list[tuple[int, str]]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda o: create(cluster, o, dry_run=dry_run), objects))


def until_admission(
    cluster: LocalCluster, objects: list[dict[str, Any]], accepted: Callable[[int, dict[str, Any]], bool]
) -> None:
    """Waits until the (just changed) admission policy answers each dry-run create as expected: a
    policy is enforced a moment after it is written."""
    wait_for(
        lambda: all(
            (code == 0) == accepted(i, obj)
            for i, (obj, (code, _)) in enumerate(
                zip(objects, create_all(cluster, objects, dry_run=True), strict=True)
            )
        ),
        timeout=30,
        what="the admission policy to take effect",
    )


def status(cluster: LocalCluster, name: str, namespace: str) -> dict[str, Any]:
    return dict(get_json(cluster, "tpuft", name, "-n", namespace).get("status") or {})


def refused_within(cluster: LocalCluster, name: str, namespace: str) -> tuple[float, dict[str, Any]]:
    started = time.monotonic()
    found = wait_for(
        lambda: (
            (c := condition({"status": status(cluster, name, namespace)}, "ReplicaFailure"))
            and c["status"] == "True"
            and c
        ),
        timeout=30,
        what=f"{name} to say its pods are refused",
    )
    return time.monotonic() - started, found


def test_defaults_refuse_every_attack_at_apply_and_say_why_refused_pods_never_come(
    local_cluster: LocalCluster, admin: Admin
) -> None:
    operator = admin.configure(DEFAULTS)
    assert operator is not None
    namespace, restricted, quota = unique("policy"), unique("pss"), unique("quota")
    no_jobs = unique("jobs")
    for name in (namespace, restricted, quota, no_jobs):
        local_cluster.kubectl("create", "namespace", name)
    local_cluster.kubectl("label", "namespace", restricted, "pod-security.kubernetes.io/enforce=restricted")
    local_cluster.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "ResourceQuota",
                "metadata": {"name": "no-tpus", "namespace": quota},
                "spec": {"hard": {"requests.google.com/tpu": "0"}},
            },
            {
                "apiVersion": "v1",
                "kind": "ResourceQuota",
                "metadata": {"name": "no-jobs", "namespace": no_jobs},
                "spec": {"hard": {"count/jobs.batch": "0"}},
            },
        ]
    )
    objects = [attack(c, namespace) for c in ATTACKS] + [finetune("in-operator-ns", OPERATOR_NAMESPACE)]
    fields = [c["policy"] for c in ATTACKS] + ["metadata.namespace"]
    until_admission(local_cluster, objects, lambda i, o: False)
    for (code, stderr), field in zip(create_all(local_cluster, objects), fields, strict=True):
        assert code != 0
        assert (
            f"ValidatingAdmissionPolicy '{ADMIN_POLICY}' with binding '{ADMIN_POLICY}' denied request: {field}:"
            in stderr
        ), stderr
    assert not get_json(local_cluster, "tpuft", "-n", namespace)["items"]

    # By default trainer pods meet the restricted standard: the apiserver admits them there, the
    # prepare pod first (with the run's identity and security context: the same rules hold for it).
    # In the namespace that allows no Job, one run prepares on its TPU hosts (the JobSet controller's
    # Jobs are refused) and the other's prepare Job is refused to the operator itself.
    local_cluster.apply(
        [
            finetune("pss", restricted),
            finetune("quota", quota),
            finetune("jobs", no_jobs, prepare={"enabled": False}),
            finetune("prepare-job", no_jobs),
        ]
    )
    pods = wait_for(
        lambda: (
            len(
                found := get_json(local_cluster, "pods", "-n", restricted, "-l", "tpuft.dev/finetune=pss")[
                    "items"
                ]
            )
            >= 2
            and found
        ),
        timeout=60,
        what="the run's prepare pod and TPU pod in the namespace enforcing restricted",
    )
    assert {p["metadata"]["labels"].get("tpuft.dev/component") for p in pods} >= {"prepare", None}
    for pod in pods:
        security = pod["spec"]["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] == 1000
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}
        container = pod["spec"]["containers"][0]["securityContext"]
        assert (
            container["capabilities"] == {"drop": ["ALL"]} and container["allowPrivilegeEscalation"] is False
        )
    # Pods the apiserver refuses: the run says so, in the apiserver's words, within seconds.
    seconds, over = refused_within(local_cluster, "quota", quota)
    assert "exceeded quota: no-tpus" in over["message"] and seconds < 15, over
    # Jobs the apiserver refuses (the JobSet controller's JobCreationFailed): the same, in its words.
    seconds, jobs = refused_within(local_cluster, "jobs", no_jobs)
    assert jobs["message"].startswith("the JobSet controller cannot create the run's Jobs: "), jobs
    assert "exceeded quota: no-jobs" in jobs["message"] and seconds < 15, jobs
    seconds, prepare = refused_within(local_cluster, "prepare-job", no_jobs)
    assert prepare["message"].startswith("the operator cannot create the run's prepare Job, retrying: "), (
        prepare
    )
    assert "exceeded quota: no-jobs" in prepare["message"] and seconds < 15, prepare
    assert status(local_cluster, "prepare-job", no_jobs)["phase"] == "Preparing"
    assert condition({"status": status(local_cluster, "pss", restricted)}, "ReplicaFailure") is None
    events = get_json(
        local_cluster,
        "events",
        "-n",
        quota,
        "--field-selector=involvedObject.name=quota,reason=ReplicaFailure",
    )["items"]
    assert events and events[0]["type"] == "Warning"
    assert not get_json(local_cluster, "networkpolicies", "-n", restricted)["items"]  # off by default


def test_without_the_admission_policy_the_operator_fails_every_attack_naming_the_field(
    local_cluster: LocalCluster, admin: Admin
) -> None:
    values = (*DEFAULTS, "--set", "policy.admission=false", "--set", "policy.requireQueueName=true")
    operator = admin.configure(values)
    assert operator is not None
    namespace = unique("policy-op")
    local_cluster.kubectl("create", "namespace", namespace)
    objects = [attack(c, namespace) for c in ATTACKS] + [finetune("no-queue", namespace)]
    until_admission(local_cluster, objects, lambda i, o: True)  # the admission policy is gone
    assert all(code == 0 for code, _ in create_all(local_cluster, objects))
    in_operator_ns = unique("in-operator-ns")
    local_cluster.apply([finetune(in_operator_ns, OPERATOR_NAMESPACE)])
    expected = {c["name"]: c["policy"] for c in ATTACKS} | {"no-queue": "spec.queueName"}
    try:
        for name, field in [*expected.items(), (in_operator_ns, "metadata.namespace")]:
            where = OPERATOR_NAMESPACE if name == in_operator_ns else namespace
            final = wait_for(
                lambda: (s := status(local_cluster, name, where)).get("phase") == "Failed" and s,  # noqa: B023
                timeout=60,
                what=f"{name} to fail",
            )
            valid = condition({"status": final}, "Valid")
            assert valid is not None and (valid["status"], valid["reason"]) == ("False", "InvalidSpec"), final
            assert valid["message"].startswith(f"{field}: "), valid["message"]
        assert not get_json(local_cluster, "jobsets", "-n", namespace)["items"]
        assert not get_json(local_cluster, "pods", "-n", namespace)["items"]
    finally:
        local_cluster.kubectl(
            "delete", "tpuft", in_operator_ns, "-n", OPERATOR_NAMESPACE, "--wait=false", check=False
        )
    # The same values with the admission policy: the queue rule is refused at create too.
    admin.configure((*DEFAULTS, "--set", "policy.requireQueueName=true"), run_operator=False)
    no_queue = finetune("no-queue-2", namespace)
    until_admission(local_cluster, [no_queue], lambda i, o: False)
    code, stderr = create(local_cluster, no_queue)
    assert code != 0 and "denied request: spec.queueName:" in stderr, stderr
    code, _ = create(local_cluster, finetune("queued", namespace, queueName="tpu-queue"), dry_run=True)
    assert code == 0


def test_admins_loosen_each_rule_and_the_loosened_runs_work(
    local_cluster: LocalCluster, admin: Admin
) -> None:
    operator = admin.configure(LOOSENED)
    assert operator is not None
    namespace = unique("policy-loose")
    local_cluster.kubectl("create", "namespace", namespace)
    local_cluster.apply(
        [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": n, "namespace": namespace}}
            for n in ("deployer", "tpuft")
        ]
        + [
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "db-admin", "namespace": namespace},
                "stringData": {"password": "x"},
            }
        ]
    )
    runs = [c for c in ATTACKS if c["name"] != HUGE]
    objects = [attack(c, namespace) for c in runs] + [
        attack(next(c for c in ATTACKS if c["name"] == HUGE), namespace)
    ]
    until_admission(local_cluster, objects, lambda i, o: o["metadata"]["name"] != HUGE)
    results = create_all(local_cluster, objects)
    assert all(code == 0 for code, _ in results[:-1]), [e for c, e in results if c]
    huge = next(c for c in ATTACKS if c["name"] == HUGE)["spec"]["tpu"]
    chips = math.prod(int(d) for d in huge["topology"].split("x")) * huge["slices"]
    assert chips > 2_000_000, huge  # the case is what its name says
    assert (
        results[-1][0] != 0
        and f"denied request: spec.tpu: the run asks for {chips} TPU chips, more than the 512"
        in results[-1][1]
    ), results[-1]
    big = "policy-512-chips"
    small = [c["name"] for c in runs if c["name"] != big]
    local_cluster.add_nodepool("v5e", "2x2", slices=len(small) + 1, prefix=unique("loose"))
    # A restricted namespace: with trainerSecurity.restricted off the pods run as root and are refused.
    restricted = unique("pss")
    local_cluster.kubectl("create", "namespace", restricted)
    local_cluster.kubectl("label", "namespace", restricted, "pod-security.kubernetes.io/enforce=restricted")
    # A baseline namespace: root is fine there, the node's network namespace is not.
    baseline = unique("pss-baseline")
    local_cluster.kubectl("create", "namespace", baseline)
    local_cluster.kubectl("label", "namespace", baseline, "pod-security.kubernetes.io/enforce=baseline")
    local_cluster.apply(
        [
            finetune(
                "pss-root",
                restricted,
                tpu={"type": "v5e", "topology": "2x2"},
                pod_annotations=kwok.hold_running("600s"),
            ),
            finetune(
                "pss-host-network",
                baseline,
                tpu={"type": "v5e", "topology": "2x2"},
                network={"hostNetwork": True},
                pod_annotations=kwok.hold_running("600s"),
            ),
        ]
    )

    def phases() -> dict[str, str]:
        items = get_json(local_cluster, "tpuft", "-n", namespace)["items"]
        return {f["metadata"]["name"]: (f.get("status") or {}).get("phase", "") for f in items}

    try:
        wait_for(
            lambda: all(phases().get(n) == "Running" for n in small),
            timeout=120,
            what="every loosened run to be Running",
        )
    except AssertionError as error:
        raise AssertionError(f"{error}\n{phases()}\n{operator.log_tail(30)}") from None
    # The 512-chip run passed the raised cap: its JobSet exists and it waits for capacity.
    big_status = status(local_cluster, big, namespace)
    assert big_status["phase"] == "Pending" and big_status["chips"] == 512, big_status
    assert condition({"status": big_status}, "Valid")["status"] == "True"  # type: ignore[index]
    # Its prepare pod is the first the apiserver refuses (root, like the TPU pods): no JobSet comes.
    seconds, pss = refused_within(local_cluster, "pss-root", restricted)
    assert pss["message"].startswith("the Job controller cannot create the run's prepare pod: "), pss
    assert 'violates PodSecurity "restricted:latest"' in pss["message"], pss
    assert "runAsNonRoot" in pss["message"] and pss["reason"] == "FailedCreate"
    assert seconds < 15, f"took {seconds:.1f}s"
    assert status(local_cluster, "pss-root", restricted)["phase"] == "Preparing"
    assert not get_json(local_cluster, "jobsets", "-n", restricted)["items"]
    seconds, host = refused_within(local_cluster, "pss-host-network", baseline)
    assert 'violates PodSecurity "baseline:latest"' in host["message"], host
    assert "hostNetwork=true" in host["message"] and seconds < 15, (seconds, host)
    # The loosened powers reached the pods as asked (the hostPath, the other account, the env).
    pods = {
        p["metadata"]["labels"]["tpuft.dev/finetune"]: p
        for p in get_json(local_cluster, "pods", "-n", namespace, "-l", NOT_PREPARE)["items"]
    }
    assert pods["policy-other-service-account"]["spec"]["serviceAccountName"] == "deployer"
    assert any("hostPath" in v for v in pods["policy-host-path-root"]["spec"]["volumes"])
    env = {e["name"] for e in pods["policy-hf-endpoint"]["spec"]["containers"][0]["env"]}
    assert "HF_ENDPOINT" in env
    # Host networking, allowed: the node's network namespace and IP, cluster DNS kept, and the stop
    # channel's port declared on the node (the pod-network runs declare none).
    host_pod = pods["policy-host-network"]
    assert host_pod["spec"]["hostNetwork"] is True
    assert host_pod["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert host_pod["status"]["podIP"] == host_pod["status"]["hostIP"]
    (port,) = host_pod["spec"]["containers"][0]["ports"]
    assert port["hostPort"] == port["containerPort"] == 29500 and port["protocol"] == "TCP"
    other = pods["policy-hf-endpoint"]["spec"]
    assert not other.get("hostNetwork") and other["dnsPolicy"] == "ClusterFirst"
    assert "ports" not in other["containers"][0]
    # networkPolicy.trainers: each run's pods accept connections only from the same run's pods.
    policies = {
        p["metadata"]["ownerReferences"][0]["name"]: p
        for p in get_json(local_cluster, "networkpolicies", "-n", namespace)["items"]
    }
    assert set(small) <= set(policies), sorted(policies)
    uid = get_json(local_cluster, "tpuft", "policy-hf-endpoint", "-n", namespace)["metadata"]["uid"]
    own = {"matchLabels": {"tpuft.dev/finetune-uid": uid}}
    spec = policies["policy-hf-endpoint"]["spec"]
    assert spec == {
        "podSelector": own,
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": own}]}],
    }
    assert pods["policy-hf-endpoint"]["metadata"]["labels"]["tpuft.dev/finetune-uid"] == uid
