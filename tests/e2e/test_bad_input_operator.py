"""Bad input the apiserver accepts (issue 8): the operator's side of tests/cluster/bad_input_corpus.yaml.

All cases are created at once in one namespace. Each `operator` case must end in Failed with
Valid=False naming the field, with nothing run for it; each `inert` case (valid, dangerous-looking
strings) must run with an exec-form command, its strings only inside the trainer config YAML. After
the corpus the operator is still alive, logged no traceback, and still brings a valid run to Running.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.cluster.test_bad_input import (
    assert_inert,
    assert_secret_refs_local,
    case_object,
    cases_of,
)
from tests.conftest import unique
from tests.e2e.conftest import OperatorProcess
from tests.support import condition, get_json, wait_for
from tpuft_dev.cluster import kwok
from tpuft_dev.cluster.local import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

OPERATOR_CASES = cases_of("operator")
INERT_CASES = cases_of("inert")
LABEL = "tpuft.dev/finetune"


def by_label(cluster: LocalCluster, kind: str, namespace: str, name: str) -> list[dict[str, Any]]:
    return list(get_json(cluster, kind, "-n", namespace, "-l", f"{LABEL}={name}")["items"])


@pytest.fixture(scope="module")
def corpus(local_cluster: LocalCluster, operator: OperatorProcess) -> Iterator[dict[str, Any]]:
    """Creates every operator and inert case; waits until the operator has judged them all.
    Yields {"namespace", "log_offset", "finetunes": name -> object}."""
    log_offset = operator.log_path.stat().st_size if operator.log_path.exists() else 0
    namespace = unique("bad-input-op")
    local_cluster.kubectl("create", "namespace", namespace)
    objects = [case_object(c, namespace) for c in OPERATOR_CASES + INERT_CASES]
    local_cluster.kubectl("create", "-f", "-", input=yaml.safe_dump_all(objects, allow_unicode=True))

    pending: list[str] = []

    def judged() -> dict[str, dict[str, Any]] | None:
        items = {f["metadata"]["name"]: f for f in get_json(local_cluster, "tpuft", "-n", namespace)["items"]}
        with_pods = {
            p["metadata"]["labels"].get(LABEL)
            for p in get_json(local_cluster, "pods", "-n", namespace)["items"]
        }
        pending[:] = [
            f"{c['name']}: {items[c['name']].get('status', {}).get('message')}"
            for c in OPERATOR_CASES
            if items[c["name"]].get("status", {}).get("phase") != "Failed"
        ] + [f"{c['name']}: no pod" for c in INERT_CASES if c["name"] not in with_pods]
        return None if pending else items

    try:
        finetunes = wait_for(judged, timeout=90, what="the operator to judge every case", interval=1)
    except AssertionError as error:
        raise AssertionError(f"{error}\nnot judged:\n" + "\n".join(pending) + operator.log_tail(30)) from None
    yield {"namespace": namespace, "log_offset": log_offset, "finetunes": finetunes}
    local_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@pytest.mark.parametrize("case", OPERATOR_CASES, ids=lambda c: c["name"])
def test_failed_with_a_condition_naming_the_field(
    local_cluster: LocalCluster, corpus: dict[str, Any], case: dict[str, Any]
) -> None:
    name, namespace = case["name"], corpus["namespace"]
    ft = corpus["finetunes"][name]
    valid = condition(ft, "Valid")
    assert valid is not None and (valid["status"], valid["reason"]) == ("False", "InvalidSpec"), valid
    assert valid["message"].startswith(f"{case['operator']}: "), valid["message"]
    assert case.get("message", "") in valid["message"]
    assert ft["status"]["message"] == valid["message"]
    assert not by_label(local_cluster, "jobsets", namespace, name)
    assert not by_label(local_cluster, "pods", namespace, name)
    failed_events = get_json(
        local_cluster,
        "events",
        "-n",
        namespace,
        "--field-selector",
        f"involvedObject.name={name},reason=Failed",
    )["items"]
    assert failed_events and failed_events[0]["type"] == "Warning"
    assert failed_events[0]["message"] == valid["message"][:1024]


@pytest.mark.parametrize("case", INERT_CASES, ids=lambda c: c["name"])
def test_runs_without_a_shell_and_with_the_strings_as_data(
    local_cluster: LocalCluster, corpus: dict[str, Any], case: dict[str, Any]
) -> None:
    name, namespace = case["name"], corpus["namespace"]
    (jobset,) = by_label(local_cluster, "jobsets", namespace, name)
    jobs = by_label(local_cluster, "jobs", namespace, name)
    pods = by_label(local_cluster, "pods", namespace, name)
    assert jobs and pods
    live = [jobset, *jobs, *pods]
    assert_inert(live, case["inert"])
    assert_secret_refs_local(live)
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_the_operator_survives_the_corpus(
    local_cluster: LocalCluster, operator: OperatorProcess, corpus: dict[str, Any]
) -> None:
    assert operator.alive()
    log = operator.log_path.read_bytes()[corpus["log_offset"] :].decode(errors="replace")
    assert "Traceback" not in log, log[log.find("Traceback") - 2000 : log.find("Traceback") + 3000]
    # Each judged run was patched once: a resync (5 s here) does not rewrite failed runs.
    namespace = corpus["namespace"]
    before = {n: f["metadata"]["resourceVersion"] for n, f in corpus["finetunes"].items()}
    # Still working: a valid run next to the corpus reaches Running.
    local_cluster.add_nodepool("v5p", "2x2x1", prefix=unique("v5p-ok"))
    valid = {
        "apiVersion": "tpuft.dev/v1alpha1",
        "kind": "TPUFineTune",
        "metadata": {"name": "still-works", "namespace": namespace},
        "spec": {
            "model": {"name": "google/gemma-2-2b"},
            "dataset": {"name": "tatsu-lab/alpaca"},
            "tpu": {"type": "v5p", "topology": "2x2x1"},
            "training": {"maxSteps": 10},
            "output": {"uri": "gs://my-bucket/out"},
            "podAnnotations": kwok.hold_running("20s"),
        },
    }
    local_cluster.apply([valid])
    wait_for(
        lambda: (
            get_json(local_cluster, "tpuft", "still-works", "-n", namespace).get("status", {}).get("phase")
            == "Running"
        ),
        timeout=90,
        what="a valid run to reach Running after the corpus",
    )
    after = {
        f["metadata"]["name"]: f["metadata"]["resourceVersion"]
        for f in get_json(local_cluster, "tpuft", "-n", namespace)["items"]
    }
    for case in OPERATOR_CASES:
        assert after[case["name"]] == before[case["name"]], f"{case['name']} was rewritten"
    assert operator.alive()
    log = operator.log_path.read_bytes()[corpus["log_offset"] :].decode(errors="replace")
    assert "Traceback" not in log
