"""gitops/argocd/health.lua, the Argo CD health check of TPUFineTune, evaluated with a real Lua 5.1
(the dialect of Argo CD's gopher-lua) against status objects the operator wrote in the e2e tests."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

try:
    from lupa import lua51
except ImportError as error:  # pragma: no cover - the dev requirements pin lupa
    raise ImportError(
        "these tests need lupa (Lua from PyPI): pip install -r requirements/dev.txt (or run scripts/venv.sh)"
    ) from error

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / "gitops" / "argocd" / "health.lua").read_text()
DATA = json.loads((Path(__file__).parent / "data" / "tpufinetune_statuses.json").read_text())
ARGO_STATUSES = {"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}


def health(obj: dict[str, Any]) -> dict[str, str]:
    """Runs the script as Argo CD does: `obj` is the live object, the result a {status, message}
    table. The environment holds only pure functions (Argo CD sandboxes health scripts), so a script
    reaching for os, io or require fails here too."""
    lua = lua51.LuaRuntime(unpack_returned_tuples=True)
    sandbox = lua.eval(
        "function(obj) return {obj = obj, tostring = tostring, tonumber = tonumber, type = type, "
        "pairs = pairs, ipairs = ipairs, string = string, table = table, math = math} end"
    )(lua.table_from(obj, recursive=True))
    chunk = lua.execute(
        "return function(code, env) local f = assert(loadstring(code)); setfenv(f, env); return f end"
    )
    result = chunk(SCRIPT, sandbox)()
    assert lua.globals().type(result) == "table", f"the script must return a table, got {result!r}"
    out = {str(k): v for k, v in result.items()}
    assert set(out) <= {"status", "message"}, out
    assert isinstance(out.get("status"), str) and isinstance(out.get("message", ""), str), out
    return {"status": out["status"], "message": out.get("message", "")}


def captured(name: str, phase: str | None, message_part: str = "") -> dict[str, Any]:
    for entry in DATA["objects"]:
        obj = entry["object"]
        status = obj.get("status") or {}
        if (
            obj["metadata"]["name"] == name
            and status.get("phase") == phase
            and message_part in (status.get("message") or "")
        ):
            return copy.deepcopy(obj)
    raise AssertionError(f"no captured object {name} in phase {phase} ({message_part!r})")


def test_the_data_is_real_operator_output() -> None:
    objects = [entry["object"] for entry in DATA["objects"]]
    assert all(entry["capturedIn"].startswith("tests/e2e/") for entry in DATA["objects"])
    assert all(obj["kind"] == "TPUFineTune" and obj["apiVersion"] == "tpuft.dev/v1alpha1" for obj in objects)
    crd = yaml.safe_load((ROOT / "crds" / "tpufinetunes.tpuft.dev.yaml").read_text())
    status_schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    phases = set(status_schema["properties"]["phase"]["enum"])
    seen = {(obj.get("status") or {}).get("phase") for obj in objects}
    assert seen == phases | {None}, f"the data should hold every phase the CRD allows: {phases - seen}"


@pytest.mark.parametrize(
    ("name", "phase", "message_part", "expected"),
    [
        ("burst-4", None, "", "Progressing"),
        ("tiny", "Preparing", "", "Progressing"),
        ("llama", "Pending", "", "Progressing"),
        ("wait-pool", "Pending", "no node pool", "Progressing"),
        ("queued", "Queued", "", "Progressing"),
        ("llama", "Running", "", "Progressing"),
        ("pausable", "Suspended", "", "Suspended"),
        ("llama", "Succeeded", "", "Healthy"),
        ("bad-data", "Failed", "DATA_ERROR", "Degraded"),
        ("broken", "Failed", "preparing the data failed", "Degraded"),
        ("crashy", "Failed", "", "Degraded"),
        ("bad-mount", "Failed", "", "Degraded"),
    ],
)
def test_phase_maps_to_argo_health(name: str, phase: str | None, message_part: str, expected: str) -> None:
    obj = captured(name, phase, message_part)
    result = health(obj)
    assert result["status"] == expected, result
    assert result["message"], "Argo CD shows the message next to the status: it must say something"
    if phase is not None:
        assert obj["status"]["message"] in result["message"]


def test_failed_shows_the_operators_message_verbatim() -> None:
    for name, part in (("bad-data", "DATA_ERROR"), ("crashy", ""), ("bad-mount", "")):
        obj = captured(name, "Failed", part)
        assert health(obj) == {"status": "Degraded", "message": obj["status"]["message"]}
    assert "exit code 65 (DATA_ERROR)" in health(captured("bad-data", "Failed", "DATA_ERROR"))["message"]
    assert health(captured("bad-mount", "Failed"))["message"].startswith("spec.volumeMounts[0].name")


def test_waiting_says_why() -> None:
    unschedulable = health(captured("wait-pool", "Pending", "no node pool"))["message"]
    assert unschedulable.startswith("Pending: ") and "gke-tpu-topology=2x2x4" in unschedulable
    assert "queue tpu-queue" in health(captured("queued", "Queued"))["message"]
    assert "operator" in health(captured("burst-4", None))["message"]
    assert health(captured("tiny", "Preparing"))["message"].startswith("Preparing: preparing the data")


def test_status_behind_the_spec_is_progressing() -> None:
    # The user changed the spec (generation 2); the operator has not reconciled it yet.
    obj = captured("llama", "Succeeded")
    obj["metadata"]["generation"] = obj["status"]["observedGeneration"] + 1
    result = health(obj)
    assert result["status"] == "Progressing"
    assert "generation 2" in result["message"] and "Succeeded" in result["message"]
    obj["status"]["observedGeneration"] = obj["metadata"]["generation"]
    assert health(obj)["status"] == "Healthy"


def test_running_includes_the_trainers_progress_summary() -> None:
    obj = captured("llama", "Running")
    obj["status"]["progress"] = {"summary": "step 40/100 (40%), eta 3m"}
    assert health(obj) == {
        "status": "Progressing",
        "message": "Running: 2/2 TPU hosts running; step 40/100 (40%), eta 3m",
    }


def test_unknown_phase_is_unknown_not_healthy() -> None:
    obj = captured("llama", "Running")
    obj["status"]["phase"] = "Exploded"
    result = health(obj)
    assert result["status"] == "Unknown" and "Exploded" in result["message"]


def test_every_result_is_an_argo_status() -> None:
    for entry in DATA["objects"]:
        assert health(entry["object"])["status"] in ARGO_STATUSES
