"""The generated CRD installs, and rejects each invalid TPUFineTune with its expected message.

Uses the apiserver's own code offline (tools/crdcheck, Kubernetes 0.36 libraries): structural schema,
CEL compilation and cost limits at install time; pruning, defaults, OpenAPI and CEL (including
transition rules on updates) per object. The same cases must fail `tpuft render`'s validation too,
so the offline tools never accept what the apiserver rejects. The cluster tests repeat the cases
against a real apiserver.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit import crdcheck
from tpuft_operator.api.crd import crd_yaml
from tpuft_operator.api.validation import SpecError, parse

ROOT = Path(__file__).resolve().parents[2]
CASES_FILE = ROOT / "tests" / "cluster" / "invalid_resources.yaml"
CRD_FILE = ROOT / "crds" / "tpufinetunes.tpuft.dev.yaml"


def load_cases() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    data = yaml.safe_load(CASES_FILE.read_text())
    return data["base"], data["cases"]


def expand(base: dict[str, Any], case: dict[str, Any]) -> dict[str, Any]:
    """The case as crdcheck input: {name, object, old?}."""
    if "update" in case:
        new = dict(base, spec=crdcheck.merge(base["spec"], case["update"]))
        return {"name": case["name"], "object": new, "old": base}
    return {"name": case["name"], "object": dict(base, spec=crdcheck.merge(base["spec"], case["spec"]))}


def test_generated_crd_installs() -> None:
    assert crdcheck.check_crd(crd_yaml()) == []


def test_there_are_at_least_twenty_invalid_resources() -> None:
    _, cases = load_cases()
    assert len([c for c in cases if c["expect"] is not None]) >= 20
    assert len({c["name"] for c in cases}) == len(cases)


def test_apiserver_validation_rejects_each_case_with_its_message() -> None:
    base, cases = load_cases()
    results = crdcheck.admit(CRD_FILE, [{"name": "base", "object": base}] + [expand(base, c) for c in cases])
    assert results["base"] == []
    failures = []
    for case in cases:
        errors = results[case["name"]]
        if case["expect"] is None:
            if errors:
                failures.append(f"{case['name']}: expected acceptance, got {errors}")
        elif not any(case["expect"] in e for e in errors):
            failures.append(f"{case['name']}: expected {case['expect']!r} in {errors}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", load_cases()[1], ids=lambda c: c["name"])
def test_render_validation_agrees(case: dict[str, Any]) -> None:
    base, _ = load_cases()
    if "update" in case:
        return  # transition rules: only the apiserver sees the old object
    obj = expand(base, case)["object"]
    if case["expect"] is None:
        parse(obj)  # accepted by both
        return
    with pytest.raises(SpecError):
        parse(obj)


def test_the_async_checkpoint_fields_of_the_status_are_accepted_and_bounded() -> None:
    """What the trainer reports of its sharded, asynchronous saves (status.progress) and what the
    operator records of them (status.goodput) are in the schema: not pruned, and bounded."""
    base, _ = load_cases()
    skipped = {"step": 8, "reason": "checkpoint-8: shard __0_0.distcp is missing"}
    status = {
        "progress": {
            "step": 9,
            "attempt": {
                "startTime": "2026-12-01T10:00:00Z",
                "resumedFromStep": 4,
                "checkpointSeconds": 3.5,
                "checkpointWriteSeconds": 80.25,
                "skippedCheckpoints": [skipped],
            },
            "lastCheckpoint": {
                "step": 8,
                "seconds": 41.5,
                "blockedSeconds": 1.5,
                "writeSeconds": 40.0,
                "reason": "periodic",
                "graceSeconds": 60,
                "time": "2026-12-01T10:05:00Z",
            },
        },
        "goodput": {
            "attempts": [
                {
                    "startTime": "2026-12-01T10:00:00Z",
                    "endTime": "2026-12-01T10:06:00Z",
                    "checkpointSeconds": 3.5,
                    "checkpointWriteSeconds": 80.25,
                }
            ]
        },
    }

    def with_status(**changes: Any) -> dict[str, Any]:
        return dict(base, status=crdcheck.merge(status, {"progress": changes}))

    cases = [
        {"name": "reported", "object": dict(base, status=status)},
        {"name": "nine-skipped", "object": with_status(attempt={"skippedCheckpoints": [skipped] * 9})},
        {
            "name": "long-reason",
            "object": with_status(attempt={"skippedCheckpoints": [{"step": 8, "reason": "x" * 257}]}),
        },
        {"name": "negative-blocked", "object": with_status(lastCheckpoint={"blockedSeconds": -1})},
        {"name": "negative-write", "object": with_status(attempt={"checkpointWriteSeconds": -1})},
    ]
    results = crdcheck.admit(CRD_FILE, cases)
    assert results["reported"] == []
    assert any("must have at most 8 items" in e for e in results["nine-skipped"]), results["nine-skipped"]
    assert any("may not be more than 256" in e for e in results["long-reason"]), results["long-reason"]
    assert any("greater than or equal to 0" in e for e in results["negative-blocked"])
    assert any("greater than or equal to 0" in e for e in results["negative-write"])
