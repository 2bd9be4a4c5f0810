"""Bad input (issue 8): every case of bad_input_corpus.yaml, offline and against the apiserver.

- offline, `render_run` (what `tpuft render` and the operator run) raises only `SpecError`, naming the
  field the corpus names; valid inputs that look dangerous render to an exec-form command and reach the
  trainer only as quoted YAML inside the trainer-config pod annotation;
- on the cluster, each `apiserver` case is refused by `kubectl create` with its message, each `policy`
  case by the chart's admin ValidatingAdmissionPolicy (its defaults installed) with a message naming
  the field, and each other case is accepted (the operator's side is
  tests/e2e/test_bad_input_operator.py, and tests/e2e/test_policy.py for the `policy` cases).
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import unique
from tests.support import wait_for
from tests.unit.crdcheck import merge
from tpuft_dev.cluster.local import LocalCluster
from tpuft_dev.cluster.operator_process import ADMIN_POLICY, install_operator
from tpuft_operator.api.policy import AdminPolicy, policy_errors
from tpuft_operator.api.validation import SpecError, parse
from tpuft_operator.render import RenderedRun, render_run
from tpuft_trainer.pod_contract import TRAINER_CONFIG_ANNOTATION

CORPUS_FILE = Path(__file__).parent / "bad_input_corpus.yaml"
CORPUS: dict[str, Any] = yaml.safe_load(CORPUS_FILE.read_text())
EXPECTATIONS = ("apiserver", "operator", "inert", "policy")
# The trainer image the corpus' `policy` cases are judged against (the chart's default).
CHART_TRAINER_IMAGE = "ghcr.io/tpuft/trainer:0.1.0"
EXEC_COMMAND = ["tpuft", "train", "--config", "/etc/tpuft/config.yaml"]
# The prepare Job's (render/prepare_job.py): as fixed; --workers is a number the renderer computes.
PREPARE_COMMAND = re.compile(
    r"^tpuft prepare --config /etc/tpuft/config\.yaml --workers [1-9][0-9]* --summary-file /dev/termination-log$"
)
CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / "tpufinetunes.tpuft.dev.yaml"


def expand(value: Any) -> Any:
    """Resolves the corpus' `$repeat` / `$repeat_item` shorthands."""
    if isinstance(value, dict):
        if "$repeat" in value:
            return str(value["$repeat"]) * int(value["times"])
        if "$repeat_item" in value:
            return [expand(copy.deepcopy(value["$repeat_item"])) for _ in range(int(value["times"]))]
        return {k: expand(v) for k, v in value.items()}
    if isinstance(value, list):
        return [expand(v) for v in value]
    return value


CASES: list[dict[str, Any]] = [expand(c) for c in CORPUS["cases"]]


def kind_of(case: dict[str, Any]) -> str:
    (kind,) = [k for k in EXPECTATIONS if k in case]
    return kind


def cases_of(*kinds: str) -> list[dict[str, Any]]:
    return [c for c in CASES if kind_of(c) in kinds]


def case_object(case: dict[str, Any], namespace: str, name: str | None = None) -> dict[str, Any]:
    """The TPUFineTune of a case. ``name`` overrides metadata.name unless the case is about the name."""
    base = CORPUS["base"]
    if "object" in case:
        obj = copy.deepcopy(case["object"])
        obj["metadata"] = {"name": name or case["name"]}
    else:
        obj = copy.deepcopy(base)
        obj["metadata"] = merge({**base["metadata"], "name": name or case["name"]}, case.get("metadata", {}))
        obj["spec"] = merge(base["spec"], case.get("spec", {}))
    obj["metadata"]["namespace"] = namespace
    return obj


def strings_in(obj: Any) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield str(k)
            yield from strings_in(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from strings_in(v)


def config_annotations(obj: Any) -> Iterator[str]:
    """Every trainer-config annotation anywhere inside ``obj`` (JobSet and Job templates, pods)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "annotations" and isinstance(value, dict) and TRAINER_CONFIG_ANNOTATION in value:
                yield value[TRAINER_CONFIG_ANNOTATION]
            else:
                yield from config_annotations(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from config_annotations(value)


def without_config(obj: Any) -> Any:
    """``obj`` with every trainer-config annotation left out."""
    if isinstance(obj, dict):
        return {
            k: without_config(
                {a: t for a, t in v.items() if a != TRAINER_CONFIG_ANNOTATION} if k == "annotations" else v
            )
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [without_config(v) for v in obj]
    return obj


def assert_inert(objects: list[dict[str, Any]], planted: list[str]) -> None:
    """No shell: exec-form command, and each planted string only inside the trainer config (the pod
    template's annotation), from which it loads back unchanged. ``objects``: the JobSet and anything
    made from it (Jobs, pods), each carrying that same config."""
    texts = [text for obj in objects for text in config_annotations(obj)]
    assert texts and len(set(texts)) == 1, "every object must carry the one trainer config"
    config_text = texts[0]
    config_values = list(strings_in(yaml.safe_load(config_text)))
    for obj in objects:
        for container in containers_of(obj):
            command = container["command"]
            assert command == EXEC_COMMAND or PREPARE_COMMAND.match(" ".join(command)), command
            assert "args" not in container
        text = json.dumps(without_config(obj), ensure_ascii=False)
        for value in planted:
            assert value not in text and json.dumps(value)[1:-1] not in text, (
                f"{value!r} leaked into {obj['kind']}"
            )
    for value in planted:
        assert value in config_values, f"{value!r} did not round-trip through the config YAML"
    # One YAML document, so nothing in a value can start a second object.
    assert len(list(yaml.safe_load_all(config_text))) == 1


def containers_of(obj: Any) -> Iterator[dict[str, Any]]:
    """Every container spec anywhere inside ``obj`` (JobSet, Job or Pod)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from value
            else:
                yield from containers_of(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from containers_of(value)


def assert_secret_refs_local(objects: list[dict[str, Any]]) -> None:
    """A secretKeyRef has no namespace field in Kubernetes: pods can only read their own namespace's
    Secrets. Make sure nothing smuggles one in (the apiserver would drop an unknown field silently
    in a JobSet's embedded template only if its schema preserved unknown fields)."""
    for obj in objects:
        for container in containers_of(obj):
            for env in container.get("env", []):
                ref = (env.get("valueFrom") or {}).get("secretKeyRef")
                if ref is not None:
                    assert set(ref) <= {"name", "key", "optional"}, ref


# Offline ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", cases_of("policy"), ids=lambda c: c["name"])
def test_the_admin_policy_refuses_it_and_render_alone_does_not(case: dict[str, Any]) -> None:
    """A `policy` case is a valid spec the admin policy's defaults forbid: the policy names the
    corpus' field first; `tpuft render` (which knows no cluster policy) renders it."""
    obj = case_object(case, "ns")
    render_run(obj)
    broken = policy_errors(parse(obj), AdminPolicy(), CHART_TRAINER_IMAGE)
    assert broken and broken[0][0] == case["policy"], broken


def test_the_corpus_has_at_least_sixty_bad_inputs() -> None:
    names = [c["name"] for c in CASES]
    assert len(names) == len(set(names))
    assert len(cases_of("apiserver", "operator")) >= 60
    for case in CASES:
        kind_of(case)  # exactly one expectation


@pytest.mark.parametrize("case", cases_of("apiserver", "operator"), ids=lambda c: c["name"])
def test_render_refuses_it_with_spec_error(case: dict[str, Any]) -> None:
    """What the apiserver or the operator refuses, `tpuft render` refuses offline, with SpecError."""
    obj = case_object(case, "ns")
    if case.get("render") == "accepts":
        # Only the apiserver knows (see the corpus): the render goes through, and the operator's
        # create is refused (tests/e2e/test_bad_input_operator.py).
        render_run(obj)
        return
    with pytest.raises(SpecError) as raised:
        render_run(obj)
    error = raised.value
    assert error.errors and all(e.field and e.reason for e in error.errors)
    if kind_of(case) == "operator":
        # The operator's condition shows the first error: it must name the corpus' field.
        assert error.field == case["operator"], str(error)
        assert case.get("message", "") in error.reason, str(error)


@pytest.mark.parametrize("case", cases_of("inert"), ids=lambda c: c["name"])
def test_dangerous_looking_valid_input_renders_inert(case: dict[str, Any]) -> None:
    obj = case_object(case, "ns")
    obj["metadata"]["uid"] = "0b7e4a3e-0000-4000-8000-000000000001"
    run: RenderedRun = render_run(obj)
    assert_inert(run.objects, case["inert"])
    assert_secret_refs_local(run.objects)


def test_exec_form_and_local_secret_refs_hold_for_a_token_and_extra_env() -> None:
    obj = case_object({"name": "token", "spec": {}}, "ns")
    obj["spec"]["model"]["tokenSecretRef"] = {"name": "hf-token", "key": "token"}
    obj["spec"]["env"] = [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "other", "key": "k"}}}]
    run = render_run(obj)
    assert_secret_refs_local(run.objects)
    pod = run.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    refs = [e["valueFrom"]["secretKeyRef"] for e in pod["containers"][0]["env"] if "secretKeyRef" in str(e)]
    assert refs == [{"name": "hf-token", "key": "token"}, {"name": "other", "key": "k"}]
    # The assertion helpers can fail: a command that goes through a shell is caught.
    bad = copy.deepcopy(run.objects)
    bad[-1]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
        "command"
    ] = ["sh", "-c", "tpuft train"]
    with pytest.raises(AssertionError):
        assert_inert(bad, [])


# On the cluster -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def created(local_cluster: LocalCluster) -> Iterator[dict[str, subprocess.CompletedProcess[str]]]:
    """Every case sent to the apiserver with `kubectl create`, in parallel; name -> result. The
    chart's admission policies are installed with their default values (removed afterwards)."""
    local_cluster.apply(CRD_FILE.read_text(), field_manager="tpuft-test-crd")
    local_cluster.wait_established("tpufinetunes.tpuft.dev")
    install_operator(local_cluster)
    namespace = unique("bad-input")
    local_cluster.kubectl("create", "namespace", namespace)
    # A policy is enforced a moment after it is created: wait until it refuses a probe.
    probe = case_object(cases_of("policy")[0], namespace, name="policy-probe")
    wait_for(
        lambda: (
            local_cluster.kubectl(
                "create", "--dry-run=server", "-f", "-", input=json.dumps(probe), check=False
            ).returncode
        ),
        timeout=30,
        what="the admin policy to be enforced",
    )

    def create(case: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        obj = case_object(case, namespace)
        return local_cluster.kubectl(
            "create", "-o", "json", "-f", "-", input=json.dumps(obj, ensure_ascii=False), check=False
        )

    with ThreadPoolExecutor(max_workers=6) as pool:
        results = dict(zip([c["name"] for c in CASES], pool.map(create, CASES), strict=True))
    yield results
    local_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    for kind in ("validatingadmissionpolicybinding", "validatingadmissionpolicy"):
        local_cluster.kubectl("delete", kind, ADMIN_POLICY, "--ignore-not-found", check=False)


@pytest.mark.cluster
@pytest.mark.parametrize("case", cases_of("apiserver"), ids=lambda c: c["name"])
def test_apiserver_refuses_it_naming_the_field(
    created: dict[str, subprocess.CompletedProcess[str]], case: dict[str, Any]
) -> None:
    result = created[case["name"]]
    assert result.returncode != 0, f"the apiserver accepted {case['name']}"
    assert case["apiserver"] in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.cluster
@pytest.mark.parametrize("case", cases_of("policy"), ids=lambda c: c["name"])
def test_admin_policy_refuses_it_at_create_naming_the_field(
    created: dict[str, subprocess.CompletedProcess[str]], case: dict[str, Any]
) -> None:
    result = created[case["name"]]
    assert result.returncode != 0, f"the admin policy accepted {case['name']}"
    assert f"ValidatingAdmissionPolicy '{ADMIN_POLICY}'" in result.stderr, result.stderr
    assert f"denied request: {case['policy']}" in result.stderr, result.stderr


@pytest.mark.cluster
@pytest.mark.parametrize("case", cases_of("operator", "inert"), ids=lambda c: c["name"])
def test_apiserver_accepts_what_only_the_operator_can_judge(
    created: dict[str, subprocess.CompletedProcess[str]], case: dict[str, Any]
) -> None:
    result = created[case["name"]]
    assert result.returncode == 0, result.stderr
    stored = json.loads(result.stdout)
    # Stored as sent: no string pruned or normalised (the odd unicode reaches the operator intact).
    sent = set(strings_in(case_object(case, "x")["spec"]))
    assert sent <= set(strings_in(stored["spec"])), sent - set(strings_in(stored["spec"]))
