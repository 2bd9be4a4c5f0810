"""A JobSet too old for what tpuft renders (issue 42, item 3), on the local cluster.

The installed JobSet CRD loses `failurePolicy.rules[].onJobFailureMessagePatterns`, as JobSet v0.9
and older lack it: the apiserver then drops the field from a JobSet (shown with a server-side dry run),
so a checkpointed stop would fail the whole run. An operator started on that cluster (as the chart's
ServiceAccount, with the chart's RBAC) creates no JobSet: the run waits with Created=False, reason
JobSetTooOld, naming the field and the release to install, and a Warning Event says the same. Once
the CRD is back (byte for byte the same spec), the same operator notices within a resync and creates
the run's JobSet, with the field stored.

The session's operator (tests/e2e/conftest.py) is stopped meanwhile and restarted afterwards.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.conftest import OPERATOR_SETTINGS, OperatorProcess
from tests.support import condition, finetune, get_json, wait_for
from tpuft_dev.cluster.local import LocalCluster
from tpuft_operator.jobset_crd import CRD_NAME, MESSAGE_PATTERNS, TOO_OLD
from tpuft_operator.render import render_run

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]


def crd_spec(cluster: LocalCluster) -> dict[str, Any]:
    return dict(get_json(cluster, "crd", CRD_NAME)["spec"])


def patterns_pointer(spec: dict[str, Any]) -> str:
    """The JSON pointer of the field's schema in the CRD's v1alpha2 version."""
    (index,) = [i for i, v in enumerate(spec["versions"]) if v["name"] == "v1alpha2"]
    return (
        f"/spec/versions/{index}/schema/openAPIV3Schema/properties/spec/properties/failurePolicy"
        "/properties/rules/items/properties/onJobFailureMessagePatterns"
    )


def json_patch(cluster: LocalCluster, ops: list[dict[str, Any]]) -> None:
    cluster.kubectl("patch", "crd", CRD_NAME, "--type=json", "-p", json.dumps(ops))


@pytest.fixture
def older_jobset(local_cluster: LocalCluster) -> Iterator[dict[str, Any]]:
    """The installed JobSet CRD without onJobFailureMessagePatterns; the exact original afterwards."""
    original = crd_spec(local_cluster)
    pointer = patterns_pointer(original)
    removed: Any = original
    for part in pointer.split("/")[2:]:
        removed = removed[int(part)] if isinstance(removed, list) else removed[part]
    restore = [{"op": "add", "path": pointer, "value": removed}]
    json_patch(local_cluster, [{"op": "remove", "path": pointer}])
    try:
        yield {"original": original, "restore": restore}
    finally:
        if crd_spec(local_cluster) != original:
            json_patch(local_cluster, restore)
        assert crd_spec(local_cluster) == original
        local_cluster.wait_established(CRD_NAME)


def dry_run(cluster: LocalCluster, obj: dict[str, Any]) -> dict[str, Any]:
    """The object as the apiserver would store it (server-side dry run, unknown fields dropped as
    they are for a client that asks for no field validation, like the operator)."""
    proc = subprocess.run(
        [
            str(cluster.bins.kubectl),
            f"--kubeconfig={cluster.kubeconfig}",
            "create",
            "--dry-run=server",
            "--validate=false",
            "-o",
            "json",
            "-f",
            "-",
        ],
        input=yaml.safe_dump(obj),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


def rules_of(jobset: dict[str, Any]) -> list[dict[str, Any]]:
    return list(jobset["spec"]["failurePolicy"]["rules"])


def test_a_jobset_too_old_holds_runs_with_a_clear_condition_until_it_is_upgraded(
    local_cluster: LocalCluster,
    operator: OperatorProcess,
    older_jobset: dict[str, Any],
    namespace: str,
    tmp_path: Path,
) -> None:
    body = finetune("held", namespace)
    # Why it matters: this cluster's apiserver drops the field the JobSet rules tell stops apart by.
    rendered = render_run(body, OPERATOR_SETTINGS.render_settings()).jobset
    assert all(MESSAGE_PATTERNS.rsplit(".", 1)[1] in rule for rule in rules_of(rendered))
    stored = dry_run(local_cluster, rendered)
    assert [sorted(rule) for rule in rules_of(stored)] == [
        ["action", "name", "onJobFailureReasons"],
        ["action", "name", "onJobFailureReasons"],
    ]

    operator.stop()
    held = OperatorProcess(operator.kubeconfig, tmp_path / "operator.log", **operator.settings)
    try:
        held.start()
        local_cluster.apply([body])

        def waiting() -> dict[str, Any] | None:
            ft = get_json(local_cluster, "tpuft", "held", "-n", namespace)
            created = condition(ft, "Created")
            return ft if created and created["reason"] == TOO_OLD else None

        ft = wait_for(waiting, timeout=30, what="the run to wait for a newer JobSet")
        created = condition(ft, "Created")
        assert created is not None and created["status"] == "False"
        assert ft["status"]["phase"] == "Pending"
        assert condition(ft, "Valid")["status"] == "True"  # type: ignore[index]
        for words in (MESSAGE_PATTERNS, "(JobSet v0.10.0)", "install JobSet v0.10.0 or later"):
            assert words in created["message"], created["message"]
        assert not get_json(local_cluster, "jobsets", "-n", namespace)["items"]
        warnings = get_json(
            local_cluster,
            "events",
            "-n",
            namespace,
            "--field-selector",
            f"involvedObject.name=held,reason={TOO_OLD}",
        )["items"]
        assert [e["type"] for e in warnings] == ["Warning"]
        assert "install JobSet v0.10.0 or later" in warnings[0]["message"]
        log = held.log_path.read_text(errors="replace")
        assert "the installed JobSet is too old" in log and MESSAGE_PATTERNS in log

        # JobSet upgraded (the CRD as it was): the same operator notices within a resync or two.
        json_patch(local_cluster, older_jobset["restore"])
        assert crd_spec(local_cluster) == older_jobset["original"]

        def proceeding() -> dict[str, Any] | None:
            ft = get_json(local_cluster, "tpuft", "held", "-n", namespace)
            created = condition(ft, "Created")
            return ft if created and created["status"] == "True" else None

        ft = wait_for(proceeding, timeout=30, what="the run to get its JobSet")
        assert ft["status"]["jobSetName"] == "held"
        assert condition(ft, "Created")["reason"] == "JobSetCreated"  # type: ignore[index]
        live = get_json(local_cluster, "jobset", "held", "-n", namespace)
        assert rules_of(live) == rules_of(rendered)  # the patterns are stored now
        assert "knows every field tpuft sets now" in held.log_path.read_text(errors="replace")
    finally:
        held.stop()
        operator.start()
