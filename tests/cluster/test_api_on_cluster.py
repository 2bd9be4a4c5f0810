"""The TPUFineTune API and its renders against a real apiserver (issue 3).

- the generated CRD installs (server-side apply), becomes Established, and `kubectl explain` teaches it;
- every golden render passes server-side dry-run through the JobSet webhooks, and the JobSet defaulting
  webhook changes nothing in a rendered JobSet (no drift);
- every example applies, and applying it again changes nothing;
- every invalid resource of invalid_resources.yaml is rejected by the apiserver with its message, with
  client-side and server-side `kubectl apply`;
- rendered pods schedule onto kwok node pools of their shape and stay Pending on pools of another shape.
"""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import unique
from tests.support import condition, get_json, wait_for
from tests.unit.crdcheck import merge
from tpuft_dev.cluster import kwok
from tpuft_dev.cluster.local import LocalCluster
from tpuft_operator import topology
from tpuft_operator.render import render_run

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "tpufinetunes.tpuft.dev.yaml"
CRD_NAME = "tpufinetunes.tpuft.dev"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
# The goldens of a run's JobSet and identity (the prepare Job's, *.prepare-job.yaml, have no JobSet).
GOLDEN = sorted(
    p for p in (ROOT / "tests" / "unit" / "golden").glob("*.yaml") if ".prepare-job" not in p.name
)
INVALID = yaml.safe_load((Path(__file__).parent / "invalid_resources.yaml").read_text())
SCHEDULING = yaml.safe_load((Path(__file__).parent / "scheduling_cases.yaml").read_text())

JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
# Every node a scheduling test creates carries this label and its pods select it, so pools that other
# tests left in the cluster can neither hold those pods nor hide that a pool of the wrong shape cannot.
POOL_SET_LABEL = "test.tpuft.dev/pool-set"

# Server-side apply types the patch against the schema before validation, and words an unknown field
# its own way ("field not declared in schema"); create (client-side apply) says "unknown field".
SERVER_SIDE_EXPECT = {
    "unknown-field": ".spec.tpu.zone: field not declared in schema",
    # Server-side apply types the patch against the schema first, in its own words.
    "packing-is-a-word": ".spec.dataset.packing: expected boolean",
    "host-network-is-a-word": ".spec.network.hostNetwork: expected boolean",
    "dns-policy-is-not-the-runs": ".spec.network.dnsPolicy: field not declared in schema",
}


def documents(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def in_namespace(objects: list[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    out = copy.deepcopy(objects)
    for obj in out:
        obj["metadata"]["namespace"] = namespace
    return out


def kubectl_in(
    cluster: LocalCluster, *args: str, objects: list[dict[str, Any]]
) -> subprocess.CompletedProcess[str]:
    """``kubectl ARGS -f -`` with ``objects`` on stdin, without raising on failure."""
    return cluster.kubectl(*args, "-f", "-", input=yaml.safe_dump_all(objects, sort_keys=False), check=False)


def items(proc: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    """The objects ``kubectl ... -o json`` printed (one object, or a List of several)."""
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    return list(out["items"]) if out.get("kind") == "List" else [out]


@pytest.fixture(scope="module")
def crd(local_cluster: LocalCluster) -> str:
    """The committed CRD, installed with server-side apply, established, and served (discovery and
    OpenAPI lag Established by a moment)."""
    local_cluster.apply(CRD_FILE.read_text(), field_manager="tpuft-test-crd")
    # Polled rather than `kubectl wait`, which can fail outright while the new CRD has no status yet.
    wait_for(
        lambda: (
            (c := condition(get_json(local_cluster, "crd", CRD_NAME), "Established"))
            and c["status"] == "True"
        ),
        timeout=60,
        what=f"{CRD_NAME} to be Established",
    )
    wait_for(
        lambda: local_cluster.kubectl("explain", "tpufinetune.spec", check=False).returncode == 0,
        timeout=30,
        what="kubectl explain to know TPUFineTune",
    )
    return CRD_NAME


@pytest.fixture(scope="module")
def admission_namespace(local_cluster: LocalCluster, crd: str) -> Iterator[str]:
    name = unique("admission")
    local_cluster.kubectl("create", "namespace", name)
    yield name
    local_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


# 1. The CRD ----------------------------------------------------------------------------------------


def test_crd_installs_and_is_established(local_cluster: LocalCluster, crd: str) -> None:
    installed = get_json(local_cluster, "crd", crd)
    for type_ in ("Established", "NamesAccepted"):
        cond = condition(installed, type_)
        assert cond is not None and cond["status"] == "True", (type_, cond)
    names = installed["spec"]["names"]
    assert (names["kind"], names["plural"], sorted(names["shortNames"])) == (
        "TPUFineTune",
        "tpufinetunes",
        ["tft", "tpuft"],
    )
    assert installed["spec"]["scope"] == "Namespaced"
    version = installed["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    # Applying the same file again is a no-op: the apiserver stores the CRD exactly as generated.
    before = installed["metadata"]["resourceVersion"]
    local_cluster.apply(CRD_FILE.read_text(), field_manager="tpuft-test-crd")
    assert get_json(local_cluster, "crd", crd)["metadata"]["resourceVersion"] == before
    # Both short names resolve to the resource.
    for short in ("tpuft", "tft"):
        local_cluster.kubectl("get", short, "-A")


def test_kubectl_explain_describes_the_tpu_fields(local_cluster: LocalCluster, crd: str) -> None:
    out = local_cluster.kubectl("explain", "tpufinetune.spec.tpu").stdout
    assert "KIND:       TPUFineTune" in out and "VERSION:    v1alpha1" in out
    fields = out.split("FIELDS:", 1)[1]
    for field, words in {
        "type": "TPU generation",
        "topology": "Chips of one slice",
        "slices": "Number of identical slices",
        "chipsPerHost": "Chips per TPU VM",
    }.items():
        block = fields.split(f"\n  {field}\t", 1)
        assert len(block) == 2, f"{field} not listed:\n{out}"
        description = block[1].split("\n\n", 1)[0]
        assert words in description, f"{field}: {description!r}"
    assert "\n  type\t<string> -required-\n" in fields and "\n  topology\t<string> -required-\n" in fields
    # Field by field, too, with the enum.
    chips = local_cluster.kubectl("explain", "tft.spec.tpu.chipsPerHost").stdout
    assert "ENUM:" in chips and "DESCRIPTION:" in chips and "8-chip VM" in chips


# 2. Golden renders through the JobSet webhooks ------------------------------------------------------


@pytest.mark.parametrize("golden", GOLDEN, ids=lambda p: p.stem)
def test_golden_render_passes_server_dry_run_without_drift(
    local_cluster: LocalCluster, namespace: str, golden: Path
) -> None:
    # Owner references point at a TPUFineTune uid that does not exist: the apiserver accepts that
    # (only the garbage collector looks owners up), so the dry-run keeps them.
    rendered = in_namespace(documents(golden.read_text()), namespace)
    dry = items(
        kubectl_in(
            local_cluster,
            "apply",
            "--server-side",
            "--dry-run=server",
            "--field-manager=tpuft-operator",
            "-o",
            "json",
            objects=rendered,
        )
    )
    assert [(o["kind"], o["metadata"]["name"]) for o in dry] == [
        (o["kind"], o["metadata"]["name"]) for o in rendered
    ]
    for sent, got in zip(rendered, dry, strict=True):
        assert got["metadata"]["ownerReferences"] == sent["metadata"]["ownerReferences"]
    (jobset,) = [o for o in rendered if o["kind"] == "JobSet"]
    (dry_jobset,) = [o for o in dry if o["kind"] == "JobSet"]
    # The dry-run answer has been through the JobSet defaulting webhook (see the control test below).
    assert dry_jobset["spec"] == jobset["spec"]
    assert not local_cluster.kubectl("get", "jobsets", "-n", namespace, "-o", "name").stdout.strip()

    # A real create: the stored JobSet equals the render. Owner references are dropped here only: with
    # an owner uid that does not exist the garbage collector would delete the JobSet under the test.
    real = copy.deepcopy(jobset)
    del real["metadata"]["ownerReferences"]
    (created,) = items(kubectl_in(local_cluster, "create", "-o", "json", objects=[real]))
    assert created["spec"] == jobset["spec"], "the JobSet webhook or the apiserver changed the rendered spec"
    assert created["metadata"]["labels"] == jobset["metadata"]["labels"]
    assert created["metadata"]["annotations"] == jobset["metadata"]["annotations"]
    stored = get_json(local_cluster, "jobset", jobset["metadata"]["name"], "-n", namespace)
    assert stored["spec"] == jobset["spec"]
    local_cluster.kubectl("delete", "jobset", jobset["metadata"]["name"], "-n", namespace, "--wait=true")


def test_dry_run_really_goes_through_the_jobset_webhook(local_cluster: LocalCluster, namespace: str) -> None:
    """Control for the no-drift test: leave out what the renderer sets explicitly, and the same dry-run
    answers with the webhook's defaults filled in."""
    (jobset,) = [o for o in documents(GOLDEN[0].read_text()) if o["kind"] == "JobSet"]
    jobset = in_namespace([jobset], namespace)[0]
    for key in ("successPolicy", "startupPolicy", "network"):
        del jobset["spec"][key]
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    del job["completionMode"]
    del job["template"]["spec"]["restartPolicy"]
    (dry,) = items(
        kubectl_in(
            local_cluster, "apply", "--server-side", "--dry-run=server", "-o", "json", objects=[jobset]
        )
    )
    assert dry["spec"]["successPolicy"]["operator"] == "All"
    assert dry["spec"]["startupPolicy"]["startupPolicyOrder"] == "AnyOrder"
    assert dry["spec"]["network"]["enableDNSHostnames"] is True
    dry_job = dry["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert dry_job["completionMode"] == "Indexed"
    assert dry_job["template"]["spec"]["restartPolicy"] == "OnFailure"  # the webhook's, not ours (Never)


# 3. Examples apply ----------------------------------------------------------------------------------


def ensure_namespace(cluster: LocalCluster, name: str) -> None:
    cluster.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}])


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_applies_and_reapplies_unchanged(
    local_cluster: LocalCluster, crd: str, example: Path
) -> None:
    docs = documents(example.read_text())
    for ns in sorted({d["metadata"].get("namespace", "default") for d in docs}):
        ensure_namespace(local_cluster, ns)
    apply = (
        "apply",
        "--server-side",
        "--field-manager=tpuft-test-examples",
        "-f",
        str(example),
        "-o",
        "json",
    )
    try:
        first = items(local_cluster.kubectl(*apply, check=False))
        assert [(o["kind"], o["metadata"]["name"]) for o in first] == [
            (d["kind"], d["metadata"]["name"]) for d in docs
        ]
        second = items(local_cluster.kubectl(*apply, check=False))
        assert [o["metadata"]["resourceVersion"] for o in second] == [
            o["metadata"]["resourceVersion"] for o in first
        ], "a second apply of the same file changed something"

        (ft,) = [o for o in second if o["kind"] == "TPUFineTune"]
        assert ft["metadata"]["generation"] == 1
        # The apiserver's defaults (from the CRD) and the models' defaults agree: rendering the stored
        # object and rendering the file give the same objects.
        (source,) = [d for d in docs if d["kind"] == "TPUFineTune"]
        source["metadata"]["uid"] = ft["metadata"]["uid"]
        assert render_run(ft).objects == render_run(source).objects
        row = local_cluster.kubectl("get", "tft", ft["metadata"]["name"], "-n", ft["metadata"]["namespace"])
        header, values = row.stdout.splitlines()
        assert header.split() == ["NAME", "PHASE", "TYPE", "TOPOLOGY", "SLICES", "PROGRESS", "AGE"]
        assert values.split()[1:4] == [
            source["spec"]["tpu"]["type"],
            source["spec"]["tpu"]["topology"],
            str(source["spec"]["tpu"].get("slices", 1)),
        ]
    finally:
        local_cluster.kubectl("delete", "-f", str(example), "--ignore-not-found", "--wait=true", check=False)


# 4. Invalid resources are rejected ------------------------------------------------------------------


def case_object(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    base = INVALID["base"]
    return {
        "apiVersion": base["apiVersion"],
        "kind": base["kind"],
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def test_at_least_twenty_distinct_rejections() -> None:
    rejected = [c["name"] for c in INVALID["cases"] if c["expect"] is not None]
    assert len(set(rejected)) == len(rejected) >= 20


@pytest.mark.parametrize("case", INVALID["cases"], ids=lambda c: c["name"])
def test_invalid_resource_is_rejected_with_its_message(
    local_cluster: LocalCluster, admission_namespace: str, case: dict[str, Any]
) -> None:
    name, base_spec = case["name"], INVALID["base"]["spec"]
    expect: str | None = case["expect"]
    client_side = ("apply", "--field-manager=tpuft-test-client")
    server_side = ("apply", "--server-side", "--field-manager=tpuft-test-gitops")

    if "update" not in case:
        obj = case_object(name, admission_namespace, merge(base_spec, case["spec"]))
        if expect is None:  # a spec that must be accepted, by either kind of apply
            for mode in (client_side, server_side):
                proc = kubectl_in(local_cluster, *mode, objects=[obj])
                assert proc.returncode == 0, f"{' '.join(mode)} refused {name}: {proc.stderr}"
            stored = get_json(local_cluster, "tft", name, "-n", admission_namespace)
            assert merge(stored["spec"], case["spec"]) == stored["spec"], stored["spec"]
            local_cluster.kubectl("delete", "tft", name, "-n", admission_namespace)
            return
        for mode, message in ((client_side, expect), (server_side, SERVER_SIDE_EXPECT.get(name, expect))):
            proc = kubectl_in(local_cluster, *mode, objects=[obj])
            assert proc.returncode != 0, f"{' '.join(mode)} accepted {name}"
            assert message is not None and message in proc.stderr, proc.stderr
        missing = local_cluster.kubectl("get", "tft", name, "-n", admission_namespace, check=False)
        assert missing.returncode != 0 and "NotFound" in missing.stderr
        return

    old = case_object(name, admission_namespace, base_spec)
    new = case_object(name, admission_namespace, merge(base_spec, case["update"]))
    created = items(kubectl_in(local_cluster, *server_side, "-o", "json", objects=[old]))[0]
    assert created["metadata"]["generation"] == 1
    if expect is None:
        (updated,) = items(kubectl_in(local_cluster, *server_side, "-o", "json", objects=[new]))
        assert updated["metadata"]["generation"] == 2
        assert merge(updated["spec"], case["update"]) == updated["spec"]
        return
    for mode in (server_side, client_side):
        proc = kubectl_in(local_cluster, *mode, objects=[new])
        assert proc.returncode != 0, f"{' '.join(mode)} accepted {name}"
        assert expect in proc.stderr, proc.stderr
    stored = get_json(local_cluster, "tft", name, "-n", admission_namespace)
    assert stored["spec"] == created["spec"] and stored["metadata"]["generation"] == 1


# 5. Scheduling on kwok node pools -------------------------------------------------------------------


def pool_nodes(pool: dict[str, Any], name: str, pool_set: str) -> list[dict[str, Any]]:
    """Nodes of one GKE TPU node pool of ``pool``'s shape (a scheduling_cases.yaml entry)."""
    shape = topology.resolve(pool["type"], pool["topology"], chips_per_host=pool["chipsPerHost"])
    nodes = kwok.nodepool_nodes(shape, prefix=name)
    assert len(nodes) == pool["nodes"], f"scheduling_cases.yaml: {pool} has {len(nodes)} hosts"
    labels = {
        **topology.node_labels(shape, f"{name}-0", placement_policy=pool.get("placementPolicy")),
        **pool.get("labels", {}),
        POOL_SET_LABEL: pool_set,
    }
    for node in nodes:
        node["metadata"]["labels"].update(labels)
        if labels.get(topology.SPOT_LABEL) == "true":  # GKE taints Spot nodes
            node["spec"]["taints"].append(
                {"key": topology.SPOT_LABEL, "value": "true", "effect": "NoSchedule"}
            )
    return nodes


def add_pools(
    cluster: LocalCluster, pools: list[dict[str, Any]], prefix: str, pool_set: str
) -> dict[str, str]:
    """Creates the pools and waits for their nodes; returns node name -> node pool."""
    nodes = [n for i, pool in enumerate(pools) for n in pool_nodes(pool, f"{prefix}{i}", pool_set)]
    cluster.apply(nodes)
    names = [n["metadata"]["name"] for n in nodes]
    cluster.kubectl("wait", "--for=condition=Ready", "--timeout=60s", *[f"node/{n}" for n in names])
    return {n["metadata"]["name"]: n["metadata"]["labels"][topology.NODEPOOL_LABEL] for n in nodes}


def jobset_pods(cluster: LocalCluster, namespace: str, jobset: str) -> list[dict[str, Any]]:
    pods: list[dict[str, Any]] = get_json(
        cluster, "pods", "-n", namespace, "-l", f"{JOBSET_NAME_LABEL}={jobset}"
    )["items"]
    return pods


# The full matrix (10 cases, 14 right and 12 wrong pools) runs in about a minute, so all of it runs.
@pytest.mark.parametrize("case", SCHEDULING, ids=lambda c: c.get("name", Path(c["example"]).stem))
def test_rendered_pods_schedule_only_on_their_shape(
    local_cluster: LocalCluster, crd: str, namespace: str, case: dict[str, Any]
) -> None:
    docs = in_namespace(documents((ROOT / case["example"]).read_text()), namespace)
    (source,) = [d for d in docs if d["kind"] == "TPUFineTune"]
    source["spec"] = merge(source["spec"], case.get("spec", {}))
    name = source["metadata"]["name"]
    # The TPUFineTune exists, so the rendered objects carry a real owner reference (as the operator's do).
    local_cluster.apply(docs)
    account = source["spec"].get("serviceAccountName")
    if account and not any(d["kind"] == "ServiceAccount" for d in docs):
        local_cluster.kubectl("create", "serviceaccount", account, "-n", namespace)
    run = render_run(get_json(local_cluster, "tft", name, "-n", namespace))
    shape = run.shape

    pool_set = unique("ps")
    prefix = unique(f"s{Path(case['example']).stem[:12]}")
    jobset = run.jobset
    pod_spec = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod_spec["nodeSelector"][POOL_SET_LABEL] = pool_set
    try:
        # First only pools of another shape: the pods are created and the scheduler refuses them.
        wrong = add_pools(local_cluster, case["wrong"], f"{prefix}-w", pool_set)
        # What the operator makes: the namespace's trainer identity (once), then the run's objects.
        local_cluster.apply([*run.namespace_objects, *run.objects], field_manager="tpuft-operator")

        def refused() -> list[dict[str, Any]]:
            pods = jobset_pods(local_cluster, namespace, run.jobset_name)
            # With exclusive placement JobSet creates a slice's followers only once its leader is
            # scheduled: at least one pod (the leader) per slice exists.
            if len(pods) < shape.slices:
                return []
            for pod in pods:
                cond = condition(pod, "PodScheduled")
                if not (cond and cond["status"] == "False" and cond.get("reason") == "Unschedulable"):
                    return []
            return pods

        pending = wait_for(refused, timeout=60, what=f"the scheduler to refuse {name} on {case['wrong']}")
        for pod in pending:
            assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")
            message = str((condition(pod, "PodScheduled") or {}).get("message", ""))
            assert message.startswith("0/") and "nodes are available" in message, message

        # Then pools of the right shape: every pod lands on one of them, one slice per pool.
        right = add_pools(local_cluster, case["pools"], f"{prefix}-r", pool_set)

        def placed() -> list[dict[str, Any]]:
            pods = jobset_pods(local_cluster, namespace, run.jobset_name)
            if len(pods) == shape.hosts and all(p["spec"].get("nodeName") for p in pods):
                return pods
            return []

        pods = wait_for(placed, timeout=90, what=f"{shape.hosts} pods of {name} to be scheduled")
        pools_of_slice: dict[str, set[str]] = {}
        for pod in pods:
            node = pod["spec"]["nodeName"]
            assert node in right, f"{pod['metadata']['name']} went to {node}, not a pool of its shape"
            pools_of_slice.setdefault(pod["metadata"]["labels"][JOB_INDEX_LABEL], set()).add(right[node])
        assert len(pools_of_slice) == shape.slices
        assert all(len(p) == 1 for p in pools_of_slice.values()), pools_of_slice  # a slice is one pool
        assert len(set().union(*pools_of_slice.values())) == shape.slices  # each slice its own pool
        assert not set(wrong) & {p["spec"]["nodeName"] for p in pods}
    finally:
        local_cluster.kubectl(
            "delete", "nodes", "-l", f"{POOL_SET_LABEL}={pool_set}", "--wait=false", check=False
        )
