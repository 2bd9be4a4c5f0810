"""The cluster's JobSet must understand what tpuft renders (issue 42, item 3).

`jobset_crd.verdict` against the JobSet v0.12.0 CRD the local cluster installs (and the goldens are
checked against), and against the same CRD with fields taken out as an older release lacks them; the
representative runs held to the renderer (every golden example, any generated spec); the operator's
verdict over time (`InstalledJobSet`); and what a run says while it waits (the reconciler).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit import crdcheck
from tests.unit.test_reconciler import Events, RecordingApi, new_run
from tests.unit.test_status import jobset as live_jobset
from tpuft_dev.cluster import versions
from tpuft_operator import jobset_crd, main
from tpuft_operator.jobset_crd import (
    MESSAGE_PATTERNS,
    NOT_INSTALLED,
    TOO_OLD,
    Gap,
    InstalledJobSet,
    Shortfall,
    field_paths,
    gaps,
    representative_jobsets,
    served_schema,
    verdict,
)
from tpuft_operator.k8s import ApiError
from tpuft_operator.reconcile import Reconciler
from tpuft_operator.render import RenderSettings, render_run
from tpuft_operator.settings import OperatorSettings

GOLDEN = Path(__file__).parent / "golden"
# What an operator renders as non-root (the default) and as root (the opt-out): their security
# contexts differ.
SETTINGS = (RenderSettings(), RenderSettings(run_as_user=0))


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.load(crdcheck.jobset_crd().read_text(), Loader=yaml.CSafeLoader)
    return loaded


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return [js for s in SETTINGS for js in representative_jobsets(s)]


def schema_of(crd: dict[str, Any]) -> dict[str, Any]:
    schema = served_schema(crd)
    assert schema is not None
    return dict(schema)


def rules_schema(crd: dict[str, Any]) -> dict[str, Any]:
    failure_policy = schema_of(crd)["properties"]["spec"]["properties"]["failurePolicy"]
    rules: dict[str, Any] = failure_policy["properties"]["rules"]["items"]
    return rules


def test_the_tested_release_is_the_one_the_local_cluster_runs() -> None:
    assert jobset_crd.TESTED_VERSION == versions.JOBSET


def test_jobset_v0_12_has_every_field_tpuft_renders(
    crd: dict[str, Any], rendered: list[dict[str, Any]]
) -> None:
    assert verdict(crd, rendered) is None
    paths = field_paths(schema_of(crd), rendered)
    # The walk went all the way down: JobSet's own fields, the Job's and the pod's.
    for path in (
        MESSAGE_PATTERNS,
        "spec.failurePolicy.restartStrategy",
        "spec.replicatedJobs[].groupName",
        "spec.replicatedJobs[].template.spec.podFailurePolicy.rules[].onExitCodes.values",
        "spec.replicatedJobs[].template.spec.template.metadata.annotations.*",
        "spec.replicatedJobs[].template.spec.template.spec.securityContext.seccompProfile.type",
        "spec.replicatedJobs[].template.spec.template.spec.containers[].env[].valueFrom.secretKeyRef.key",
    ):
        assert path in paths, path


def test_a_jobset_without_on_job_failure_message_patterns_is_too_old(
    crd: dict[str, Any], rendered: list[dict[str, Any]]
) -> None:
    older = copy.deepcopy(crd)
    del rules_schema(older)["properties"]["onJobFailureMessagePatterns"]
    found = verdict(older, rendered)
    assert found is not None and found.reason == TOO_OLD
    assert gaps(schema_of(older), rendered) == [Gap(MESSAGE_PATTERNS)]
    assert f"lacks {MESSAGE_PATTERNS} (JobSet v0.10.0)" in found.message
    assert "install JobSet v0.10.0 or later (tpuft is tested with v0.12.0)" in found.message
    assert "a checkpointed stop (exit 75: preemption, maintenance) would fail the whole run" in found.message


def test_each_missing_field_names_the_release_that_brought_it(
    crd: dict[str, Any], rendered: list[dict[str, Any]]
) -> None:
    """Each gap names the release that brought it (the scan of every release, jobset_crd.INTRODUCED);
    a whole missing subtree needs what its newest field needs; a field no release lacked (a CRD trimmed
    by hand) needs the oldest release tpuft runs on; the list is cut after five."""
    spec = schema_of(crd)["properties"]["spec"]
    trimmed = copy.deepcopy(crd)
    trimmed_spec = schema_of(trimmed)["properties"]["spec"]
    del trimmed_spec["properties"]["failurePolicy"]["properties"]["rules"]
    del trimmed_spec["properties"]["network"]["properties"]["publishNotReadyAddresses"]
    assert "rules" in spec["properties"]["failurePolicy"]["properties"]  # a copy was trimmed
    found = verdict(trimmed, rendered)
    assert found is not None
    assert "spec.failurePolicy.rules (JobSet v0.10.0)" in found.message
    assert "spec.network.publishNotReadyAddresses (JobSet v0.6.0)" in found.message
    assert "install JobSet v0.10.0 or later" in found.message
    assert "would fail the whole run" in found.message  # the rules went, and their patterns with them

    v0_8 = copy.deepcopy(crd)  # as JobSet v0.8 is, for what tpuft renders
    v0_8_spec = schema_of(v0_8)["properties"]["spec"]
    del rules_schema(v0_8)["properties"]["onJobFailureMessagePatterns"]
    del v0_8_spec["properties"]["replicatedJobs"]["items"]["properties"]["groupName"]
    found = verdict(v0_8, rendered)
    assert found is not None
    assert f"lacks {MESSAGE_PATTERNS} (JobSet v0.10.0), spec.replicatedJobs[].groupName (JobSet v0.9.0)," in (
        found.message
    )
    assert "install JobSet v0.10.0 or later" in found.message

    pod = copy.deepcopy(crd)
    template = schema_of(pod)["properties"]["spec"]["properties"]["replicatedJobs"]["items"]
    container = template["properties"]["template"]["properties"]["spec"]["properties"]["template"]
    container_props = container["properties"]["spec"]["properties"]["containers"]["items"]["properties"]
    for name in (
        "command",
        "env",
        "image",
        "imagePullPolicy",
        "resources",
        "securityContext",
        "volumeMounts",
    ):
        del container_props[name]
    found = verdict(pod, rendered)
    assert found is not None and found.message.count("(JobSet v0.10.0)") == 5
    assert "and 2 more" in found.message and "would fail the whole run" not in found.message


def test_an_enum_that_refuses_a_rendered_value_is_a_gap(
    crd: dict[str, Any], rendered: list[dict[str, Any]]
) -> None:
    older = copy.deepcopy(crd)
    action = rules_schema(older)["properties"]["action"]
    action["enum"] = [v for v in action["enum"] if v != "RestartJobSetAndIgnoreMaxRestarts"]
    assert gaps(schema_of(older), rendered) == [
        Gap("spec.failurePolicy.rules[].action", "RestartJobSetAndIgnoreMaxRestarts")
    ]
    found = verdict(older, rendered)
    assert found is not None
    assert "spec.failurePolicy.rules[].action=RestartJobSetAndIgnoreMaxRestarts (value not allowed)" in (
        found.message
    )


def test_no_crd_is_jobset_not_installed_and_no_v1alpha2_is_too_old(
    crd: dict[str, Any], rendered: list[dict[str, Any]]
) -> None:
    absent = verdict(None, rendered)
    assert absent == Shortfall(
        NOT_INSTALLED,
        "JobSet is not installed (no CustomResourceDefinition jobsets.jobset.x-k8s.io): install JobSet "
        "v0.10.0 or later (tpuft is tested with v0.12.0)",
    )
    v1alpha1 = copy.deepcopy(crd)
    v1alpha1["spec"]["versions"][0]["name"] = "v1alpha1"  # JobSet v0.1.x served only this
    found = verdict(v1alpha1, rendered)
    assert found is not None and found.reason == TOO_OLD
    assert "does not serve jobset.x-k8s.io/v1alpha2" in found.message


def test_a_field_the_renderer_starts_to_set_is_checked_without_listing_it(crd: dict[str, Any]) -> None:
    """The fields come from the renders, not a list: one more in the JobSet is looked for too."""
    jobset = copy.deepcopy(representative_jobsets(RenderSettings())[0])
    jobset["spec"]["failurePolicy"]["rules"][0]["onSomethingNew"] = ["x"]
    jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["newPodField"] = True
    assert [str(g) for g in gaps(schema_of(crd), [jobset])] == [
        "spec.failurePolicy.rules[].onSomethingNew",
        "spec.replicatedJobs[].template.spec.template.spec.newPodField",
    ]


# --- the representative runs cover what the renderer emits -------------------------------------


# The user's own volumes are free-form (any volume type of the cluster): not looked for, but for the
# downward-API volume the renderer adds.
VOLUMES = "spec.replicatedJobs[].template.spec.template.spec.volumes[]."


def renderer_set(paths: set[str]) -> set[str]:
    return {
        p for p in paths if not p.startswith(VOLUMES) or p[len(VOLUMES) :].startswith(("name", "downwardAPI"))
    }


@pytest.fixture(scope="module")
def covered(crd: dict[str, Any], rendered: list[dict[str, Any]]) -> set[str]:
    return set(field_paths(schema_of(crd), rendered))


def golden_jobsets() -> Iterator[dict[str, Any]]:
    for golden in sorted(GOLDEN.glob("*.yaml")):
        for obj in yaml.safe_load_all(golden.read_text()):
            if obj and obj["kind"] == "JobSet":
                yield obj


def test_every_golden_jobset_sets_only_fields_the_check_looks_for(
    crd: dict[str, Any], covered: set[str]
) -> None:
    goldens = list(golden_jobsets())
    assert len(goldens) >= 10
    unchecked = renderer_set(set(field_paths(schema_of(crd), goldens))) - covered
    assert not unchecked, f"add a run that renders these to jobset_crd.REPRESENTATIVE: {sorted(unchecked)}"


TPUS = [
    {"type": "v5e", "topology": "2x2"},
    {"type": "v5e", "topology": "4x4", "slices": 3},
    {"type": "v5p", "topology": "2x2x4"},
    {"type": "v6e", "topology": "2x4", "chipsPerHost": 8},
    {"type": "v4", "topology": "2x2x2", "slices": 2},
    {"type": "tpu7x", "topology": "2x2x4", "placementPolicy": "pp"},  # backend native (below)
]
OPTIONAL: dict[str, Any] = {
    "queueName": "q",
    "suspend": True,
    "image": "registry.example/t:1",
    "terminationGracePeriodSeconds": 30,
    "priorityClassName": "p",
    "serviceAccountName": "sa",
    "podAnnotations": {"x": "y"},
    "env": [{"name": "E", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}],
    "tolerations": [{"key": "k", "operator": "Exists"}],
    "resources": {"requests": {"cpu": "1"}},
    "maxRestarts": 7,
    "network": {"hostNetwork": True},
}


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tpu=st.sampled_from(TPUS),
    spot=st.booleans(),
    reservation=st.booleans(),
    token=st.booleans(),
    priority_label=st.booleans(),
    optional=st.sets(st.sampled_from(sorted(OPTIONAL))),
    settings_=st.sampled_from(SETTINGS),
)
def test_any_spec_renders_only_fields_the_check_looks_for(
    crd: dict[str, Any],
    covered: set[str],
    tpu: dict[str, Any],
    spot: bool,
    reservation: bool,
    token: bool,
    priority_label: bool,
    optional: set[str],
    settings_: RenderSettings,
) -> None:
    run = copy.deepcopy(jobset_crd.REPRESENTATIVE[0])
    run["spec"]["tpu"] = {**tpu, **({"spot": True} if spot else {})}
    # Ironwood runs backend native (xla is refused there), which renders its own environment.
    run["spec"]["backend"] = "native" if tpu["type"] == "tpu7x" else "xla"
    if reservation:
        run["spec"]["tpu"]["reservation"] = "r"
    if token:
        run["spec"]["model"]["tokenSecretRef"] = {"name": "s", "key": "k"}
    if priority_label:
        run["metadata"]["labels"] = {"kueue.x-k8s.io/priority-class": "high"}
    run["spec"].update({key: OPTIONAL[key] for key in optional})
    jobset = render_run(run, settings_).jobset
    unchecked = renderer_set(set(field_paths(schema_of(crd), [jobset]))) - covered
    assert not unchecked, f"add a run that renders these to jobset_crd.REPRESENTATIVE: {sorted(unchecked)}"


# --- the operator's verdict over time --------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Reads:
    """Stands in for Api.read_crd: answers from a list, counting the reads."""

    def __init__(self, *answers: Any) -> None:
        self.answers, self.count = list(answers), 0

    def __call__(self) -> Any:
        self.count += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_a_jobset_too_old_is_read_again_once_a_period_until_it_is_upgraded(
    crd: dict[str, Any], rendered: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    older = copy.deepcopy(crd)
    del rules_schema(older)["properties"]["onJobFailureMessagePatterns"]
    reads, clock = Reads(older, older, crd), Clock()
    installed = InstalledJobSet(reads, rendered, recheck_seconds=30, clock=clock)
    with caplog.at_level(logging.INFO, logger="tpuft.jobset"):
        first = installed.check()
        assert first is not None and first.reason == TOO_OLD
        clock.now += 29
        assert installed.shortfall() == first and reads.count == 1  # not yet due: the last verdict
        clock.now += 1
        assert installed.shortfall() == first and reads.count == 2  # read again, still too old
        clock.now += 30
        assert installed.shortfall() is None and reads.count == 3  # upgraded
        clock.now += 3600
        assert installed.shortfall() is None and reads.count == 3  # fine: never read again
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1  # said once, not at every look
    assert MESSAGE_PATTERNS in errors[0].getMessage() and "reason JobSetTooOld" in errors[0].getMessage()
    assert "knows every field tpuft sets now" in caplog.records[-1].getMessage()


def test_jobset_installed_after_the_operator_is_noticed(
    crd: dict[str, Any], rendered: list[dict[str, Any]]
) -> None:
    reads, clock = Reads(None, crd), Clock()
    installed = InstalledJobSet(reads, rendered, recheck_seconds=5, clock=clock)
    missing = installed.check()
    assert missing is not None and missing.reason == NOT_INSTALLED
    clock.now += 5
    assert installed.shortfall() is None


def test_a_crd_this_identity_may_not_read_is_not_checked(
    rendered: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    reads = Reads(
        ApiError("reading CustomResourceDefinition: HTTP 403: forbidden", status=403, retryable=False)
    )
    installed = InstalledJobSet(reads, rendered, recheck_seconds=0)
    with caplog.at_level(logging.WARNING, logger="tpuft.jobset"):
        assert installed.check() is None
        assert installed.shortfall() is None and installed.shortfall() is None
    assert reads.count == 1
    (warning,) = caplog.records
    message = warning.getMessage()
    assert "may not get the CustomResourceDefinition jobsets.jobset.x-k8s.io" in message
    assert "need JobSet v0.10.0 or later" in message and "403" not in message


def test_an_api_that_cannot_answer_is_asked_again(
    crd: dict[str, Any], rendered: list[dict[str, Any]]
) -> None:
    down = ApiError("cannot reach the API server", status=0, retryable=True)
    reads, clock = Reads(down, None, crd), Clock()
    installed = InstalledJobSet(reads, rendered, recheck_seconds=10, clock=clock)
    assert installed.check() is None  # nothing known yet: not a reason to hold runs
    clock.now += 10
    assert installed.shortfall() is not None  # then: not installed
    clock.now += 10
    assert installed.shortfall() is None


# --- what a run says while it waits --------------------------------------------------------------


def test_a_run_waits_for_a_jobset_that_understands_it_then_gets_its_jobset() -> None:
    api, events = RecordingApi(), Events()
    messages: list[str] = []
    shortfall: list[Shortfall | None] = [
        Shortfall(TOO_OLD, f"the installed JobSet is too old: it lacks {MESSAGE_PATTERNS} (JobSet v0.10.0)")
    ]
    r = Reconciler(
        api=api,  # type: ignore[arg-type]
        render_settings=RenderSettings(),
        jobset_shortfall=lambda: shortfall[0],
    )

    def event(type_: str, reason: str, message: str) -> None:
        events(type_, reason, message)
        messages.append(f"{type_} {message}")

    run = new_run()
    r.reconcile(run, None, [], event=event)
    r.reconcile(run, None, [], event=event)  # the resync: still waiting, nothing new to say
    assert not [c for c in api.calls if c[0] in ("create", "ensure")]
    status = api.last_status
    assert status["phase"] == "Pending" and status["message"].startswith("waiting for the cluster's JobSet:")
    (created,) = [c for c in status["conditions"] if c["type"] == "Created"]
    assert (created["status"], created["reason"]) == ("False", TOO_OLD)
    assert MESSAGE_PATTERNS in created["message"]
    valid = next(c for c in status["conditions"] if c["type"] == "Valid")
    assert valid["status"] == "True"  # the spec is fine: not a Failed run
    assert events.posted == [TOO_OLD] and messages[0].startswith("Warning waiting for the cluster's JobSet")

    shortfall[0] = None  # JobSet upgraded
    run = {**run, "status": status}
    r.reconcile(run, None, [], event=event)
    assert ("create", "JobSet") in api.calls
    (created,) = [c for c in api.last_status["conditions"] if c["type"] == "Created"]
    assert (created["status"], created["reason"]) == ("True", "JobSetCreated")
    assert events.posted == [TOO_OLD, "JobSetCreated"]


def test_a_run_with_its_jobset_is_not_held_by_the_check() -> None:
    """The check holds only creates: a run whose JobSet exists goes on being reported."""
    api, events = RecordingApi(), Events()
    r = Reconciler(
        api=api,  # type: ignore[arg-type]
        render_settings=RenderSettings(),
        jobset_shortfall=lambda: Shortfall(NOT_INSTALLED, "JobSet is not installed"),
    )
    r.reconcile(new_run(), live_jobset(), [], event=events)
    assert not [c for c in api.calls if c[0] == "create"]
    assert api.last_status["jobSetName"] == "run"
    assert "Created" not in {c["type"] for c in api.last_status["conditions"]}
    assert NOT_INSTALLED not in events.posted


def test_the_operator_asks_its_check_before_each_create_and_rechecks_every_resync() -> None:
    """main.py wires the check in: read at start-up with the operator's own renders, asked by the
    Reconciler, read again every resync period while it falls short."""

    class Api:
        reads = 0

        def read_crd(self, name: str) -> None:
            assert name == "jobsets.jobset.x-k8s.io"
            Api.reads += 1

        def post_event(self, *args: Any) -> None:
            return None

    settings_ = OperatorSettings(resync_seconds=7.0, run_as_user=0)
    installed = main.installed_jobset(settings_, Api())  # type: ignore[arg-type]
    memo = main.build_memo(settings_, Api(), installed)  # type: ignore[arg-type]
    found = installed.check()
    assert found is not None and found.reason == NOT_INSTALLED
    assert memo.reconciler.jobset_shortfall() == found and Api.reads == 1  # not due again yet
    assert installed._recheck == 7.0
