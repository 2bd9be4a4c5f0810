"""GitOps with kubectl: every example applies cleanly with `kubectl apply --server-side`, and once
the operator has acted a second apply of the same file changes nothing (no drift: the operator
writes only status, through the status subresource, so the user's fields stay the user's)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import unique
from tests.e2e.conftest import OperatorProcess
from tests.support import get_json, wait_for
from tpuft_dev.cluster import kwok
from tpuft_dev.cluster.local import LocalCluster
from tpuft_operator import topology

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
MANAGER = "gitops-test"
SETTLED = {"Succeeded", "Failed", "Queued"}  # phases that stay put without anyone acting


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def finetune_of(path: Path) -> dict[str, Any]:
    (ft,) = [doc for doc in documents(path) if doc["kind"] == "TPUFineTune"]
    return ft


def ref(doc: dict[str, Any]) -> list[str]:
    kind = "tpufinetune.tpuft.dev" if doc["kind"] == "TPUFineTune" else doc["kind"].lower()
    return [kind, doc["metadata"]["name"], "-n", doc["metadata"].get("namespace", "default")]


@pytest.fixture(scope="module")
def example_pools(local_cluster: LocalCluster) -> None:
    """A kwok node pool of each example's shape, labelled as its pods select (spot, placement policy)."""
    nodes: list[dict[str, Any]] = []
    for path in EXAMPLES:
        tpu = finetune_of(path)["spec"]["tpu"]
        shape = topology.resolve(tpu["type"], tpu["topology"], chips_per_host=tpu.get("chipsPerHost"))
        shape = topology.SliceShape(shape.family, shape.topology, shape.chips_per_host, tpu.get("slices", 1))
        pool = kwok.nodepool_nodes(shape, prefix=unique(f"gitops-{tpu['type']}"))
        for node in pool:
            if tpu.get("spot"):
                node["metadata"]["labels"][topology.SPOT_LABEL] = "true"
            if tpu.get("placementPolicy"):
                node["metadata"]["labels"][topology.PLACEMENT_POLICY_LABEL] = tpu["placementPolicy"]
        nodes += pool
    local_cluster.apply(nodes)
    local_cluster.kubectl(
        "wait", "--for=condition=Ready", "--timeout=90s", *[f"node/{n['metadata']['name']}" for n in nodes]
    )


@pytest.fixture(scope="module")
def example_namespaces(local_cluster: LocalCluster) -> Iterator[None]:
    """The namespaces the examples name, with the trainer ServiceAccount they run as (the user's,
    made once per namespace as docs/install-gke.md says). Afterwards the objects the files share
    (v6e-lora's Secret and ServiceAccount) go too: left under this test's field manager in a kept
    cluster, they would conflict with the next session's apply of the same file."""
    for namespace in sorted({finetune_of(p)["metadata"]["namespace"] for p in EXAMPLES}):
        local_cluster.kubectl("create", "namespace", namespace, check=False)
        local_cluster.kubectl("create", "serviceaccount", "tpuft-trainer", "-n", namespace, check=False)
    yield
    for path in EXAMPLES:
        for doc in documents(path):
            if doc["kind"] != "TPUFineTune":
                local_cluster.kubectl("delete", *ref(doc), "--ignore-not-found", check=False)


@pytest.fixture
def applied(request: pytest.FixtureRequest, local_cluster: LocalCluster) -> Iterator[Path]:
    path: Path = request.param
    yield path
    # Only the run: a file's Secret and ServiceAccount (v6e-lora's) are shared by the other examples.
    local_cluster.kubectl(
        "delete", *ref(finetune_of(path)), "--ignore-not-found", "--wait=true", "--timeout=60s"
    )


def apply(cluster: LocalCluster, path: Path) -> str:
    proc = cluster.kubectl(
        "apply", "--server-side", f"--field-manager={MANAGER}", "-f", str(path), check=False
    )
    assert proc.returncode == 0, f"kubectl apply --server-side -f {path.name}:\n{proc.stderr}"
    return proc.stdout


def versions(cluster: LocalCluster, docs: list[dict[str, Any]]) -> dict[str, tuple[str, int | None]]:
    live = {}
    for doc in docs:
        obj = get_json(cluster, *ref(doc))
        live[f"{doc['kind']}/{doc['metadata']['name']}"] = (
            obj["metadata"]["resourceVersion"],
            obj["metadata"].get("generation"),
        )
    return live


@pytest.mark.parametrize("applied", EXAMPLES, ids=[p.stem for p in EXAMPLES], indirect=True)
def test_example_applies_and_a_second_apply_changes_nothing(
    local_cluster: LocalCluster,
    operator: OperatorProcess,
    example_pools: None,
    example_namespaces: None,
    applied: Path,
) -> None:
    docs = documents(applied)
    first = apply(local_cluster, applied)
    assert first.count("serverside-applied") == len(docs), first
    ft = finetune_of(applied)

    def settled() -> dict[str, Any] | None:
        live = get_json(local_cluster, *ref(ft))
        status = live.get("status") or {}
        done = (
            status.get("phase") in SETTLED
            and status.get("observedGeneration") == live["metadata"]["generation"]
        )
        return live if done else None

    try:
        live = wait_for(settled, timeout=150, what=f"{ft['metadata']['name']} to settle")
    except AssertionError as error:
        status = get_json(local_cluster, *ref(ft)).get("status")
        pods = local_cluster.kubectl("get", "pods", "-o", "wide", "-n", ft["metadata"]["namespace"]).stdout
        raise AssertionError(f"{error}\nstatus: {status}\npods:\n{pods}") from None
    expected = "Queued" if ft["spec"].get("queueName") else "Succeeded"
    assert live["status"]["phase"] == expected, live["status"]

    # The operator wrote status only, through the status subresource, under its own field manager.
    managed = get_json(local_cluster, *ref(ft), "--show-managed-fields")["metadata"]["managedFields"]
    assert {e["manager"] for e in managed if "subresource" not in e} == {MANAGER}, managed
    for entry in managed:
        if entry["manager"] != MANAGER:
            assert entry.get("subresource") == "status", entry
            assert set(entry["fieldsV1"]) == {"f:status"}, entry

    # No drift: kubectl sees nothing to change, and re-applying leaves every object's version alone.
    diff = local_cluster.kubectl(
        "diff", "--server-side", f"--field-manager={MANAGER}", "-f", str(applied), check=False
    )
    assert diff.returncode == 0, f"kubectl diff found drift in {applied.name}:\n{diff.stdout}{diff.stderr}"
    before = versions(local_cluster, docs)
    apply(local_cluster, applied)
    assert versions(local_cluster, docs) == before
    assert get_json(local_cluster, *ref(ft))["spec"] == live["spec"]
