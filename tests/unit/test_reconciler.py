"""The Reconciler's own bookkeeping (what it remembers between events), with the API recorded.

The behaviour against a real apiserver is in tests/e2e; here the API is a recorder so that the number
of writes per run, which the benchmark measures at scale, is pinned down exactly.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Mapping
from typing import Any

import pytest

from tests.unit.test_status import NOW, jobset, pod
from tests.unit.test_status import finetune as status_finetune
from tpuft_operator import reconcile
from tpuft_operator.k8s import ApiError
from tpuft_operator.pacing import WritePace
from tpuft_operator.reconcile import Reconciler
from tpuft_operator.render import RenderSettings
from tpuft_operator.status import EARLIER_RESTARTS_ANNOTATION
from tpuft_operator.topology import SliceShape

KEY = ("ns", "run")


def finetune(status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    """A run whose JobSet is created at once: these tests are about the JobSet and the status writes
    (the prepare Job that comes first by default has its own tests, test_prepare.py)."""
    spec.setdefault("prepare", {"enabled": False})
    return status_finetune(status, **spec)


# The controller reference of every JobSet the run of `finetune()` (uid u-1) owns.
OURS = [{"kind": "TPUFineTune", "name": "run", "uid": "u-1", "controller": True}]


class RecordingApi:
    """Stands in for k8s.Api: records every call and answers as the apiserver would."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.bodies: list[dict[str, Any]] = []  # what was sent to create
        self.existing: set[tuple[str, str]] = set()
        self.resource_version = 100

    def create_or_adopt(self, obj: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        key = (obj["kind"], obj["metadata"]["name"])
        created = key not in self.existing
        self.calls.append(("create" if created else "adopt", obj["kind"]))
        self.bodies.append(copy.deepcopy(dict(obj)))
        self.existing.add(key)
        return {**copy.deepcopy(dict(obj)), "status": {}}, created

    def ensure(self, obj: Mapping[str, Any]) -> bool:
        self.calls.append(("ensure", obj["kind"]))
        return True

    def patch_jobset_suspend(self, namespace: str, name: str, suspend: bool) -> None:
        self.calls.append(("suspend" if suspend else "resume", "JobSet"))

    def patch_finetune_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> dict[str, Any]:
        self.calls.append(("status", str(status.get("phase"))))
        self.last_status = {**getattr(self, "last_status", {}), **copy.deepcopy(dict(status))}
        self.resource_version += 1
        body = finetune(dict(status))
        body["metadata"]["resourceVersion"] = str(self.resource_version)
        return body

    def creation_failures(self, namespace: str) -> list[dict[str, Any]]:
        self.calls.append(("events", namespace))
        return []

    def writes(self) -> list[tuple[str, str]]:
        return [c for c in self.calls if c[0] != "adopt"]


# A refusal Event's involved objects: a Job of the run's JobSet, and of another run's.
job = {"kind": "Job", "name": "run-slice-0"}
other = {"kind": "Job", "name": "run-2-slice-0"}


class Events:
    def __init__(self) -> None:
        self.posted: list[str] = []

    def __call__(self, type_: str, reason: str, message: str) -> None:
        self.posted.append(reason)


def reconciler(api: RecordingApi, settle: float = 0.0) -> tuple[Reconciler, list[float]]:
    deferred: list[float] = []
    r = Reconciler(
        api=api,  # type: ignore[arg-type]
        render_settings=RenderSettings(),
        status_settle_seconds=settle,
        defer=lambda key, delay: deferred.append(delay),
    )
    return r, deferred


def written(r: Reconciler) -> dict[str, Any]:
    """The run as the reconciler's last status patch left it (its RunState keeps the answer)."""
    state = r.runs.find(KEY)
    assert state is not None and state.written is not None
    return dict(state.written)


def new_run() -> dict[str, Any]:
    body = finetune()
    body["metadata"]["resourceVersion"] = "1"
    return body


def running_pods() -> list[dict[str, Any]]:
    return [pod("run-slice-0-0-aaaaa"), pod("run-slice-0-1-bbbbb")]


def test_a_new_run_costs_its_jobset_and_one_status_write_with_settling() -> None:
    api, events = RecordingApi(), Events()
    r, deferred = reconciler(api, settle=2.0)
    run = new_run()
    r.reconcile(run, None, [], event=events)
    # The JobSet's own watch event: still Pending, still within the settle window -> no write. One
    # reconcile is due when the window ends (it is also when the missing pods' refusals are looked
    # up: one wake-up serves both).
    r.reconcile(run, None, [], event=events)
    assert len(deferred) == 1 and all(0 < d <= 2.0 for d in deferred)
    # The pods run: one status write says Running.
    r.reconcile(run, None, running_pods(), event=events)
    writes = api.writes()
    per_run = [w for w in writes if w[0] != "ensure"]
    assert per_run == [("create", "JobSet"), ("status", "Running")]
    # The namespace's shared identity, once.
    assert [w for w in writes if w[0] == "ensure"] == [
        ("ensure", "ServiceAccount"),
        ("ensure", "Role"),
        ("ensure", "RoleBinding"),
    ]
    # The progress RBAC comes after the JobSet (the account's create is sent on a thread of its own:
    # see test_the_jobset_is_sent_without_waiting_for_the_namespace_account).
    assert writes.index(("create", "JobSet")) < writes.index(("ensure", "Role"))
    assert events.posted == ["JobSetCreated", "Running"]


def test_without_settling_pending_is_written_at_once() -> None:
    api = RecordingApi()
    r, deferred = reconciler(api, settle=0.0)
    r.reconcile(new_run(), None, [], event=Events())
    # Written at once; the only reconcile asked for is the look at why the pods are missing.
    assert ("status", "Pending") in api.calls and deferred == [reconcile.REFUSAL_CHECK_AFTER]
    assert not [c for c in api.calls if c[0] == "events"]  # not before the JobSet is 2 s old


def test_a_settled_run_that_is_still_pending_is_written_when_the_window_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = RecordingApi()
    r, deferred = reconciler(api, settle=2.0)
    clock = [1000.0]
    monkeypatch.setattr(reconcile.time, "monotonic", lambda: clock[0])
    run = new_run()
    r.reconcile(run, None, [], event=Events())
    assert deferred == [2.0] and not [c for c in api.calls if c[0] == "status"]
    clock[0] += 2.5  # the deferred reconcile
    r.reconcile(run, None, [], event=Events())
    assert [c for c in api.calls if c[0] == "status"] == [("status", "Pending")]


def test_an_event_before_the_jobset_reaches_the_index_does_not_create_it_again() -> None:
    api = RecordingApi()
    r, _ = reconciler(api)
    run = new_run()
    r.reconcile(run, None, [], event=Events())
    # The run's status patch comes back as an event while the JobSet index is still empty.
    r.reconcile(run, None, [], event=Events())
    assert [c for c in api.calls if c[1] == "JobSet"] == [("create", "JobSet")]


def test_once_the_jobset_exists_the_reconciler_keeps_only_what_it_reads() -> None:
    # Memory at N=1000 (docs/benchmarks.md): the full render (~18 KB) and the created JobSet with its
    # pod template are not kept for the life of the run; only the shape and a slim JobSet are.
    api = RecordingApi()
    r, _ = reconciler(api)
    r.reconcile(new_run(), None, [], event=Events())
    state = r.runs.find(KEY)
    assert state is not None and isinstance(state.render, SliceShape)
    assert state.jobset is not None and set(state.jobset["spec"]) == {"suspend"}


def test_a_deleted_jobset_is_recreated() -> None:
    api = RecordingApi()
    r, _ = reconciler(api)
    run = new_run()
    r.reconcile(run, None, [], event=Events())
    api.existing.clear()  # someone deleted the JobSet
    r.jobset_deleted(run)
    events = Events()
    r.reconcile(run, None, [], event=events)
    assert [c for c in api.calls if c[1] == "JobSet"] == [("create", "JobSet"), ("create", "JobSet")]
    assert "JobSetRecreated" in events.posted


def test_a_recreated_jobset_carries_the_runs_restarts_so_far() -> None:
    # Found by the fault suite (issue 17): the new JobSet counts from 0, so a run that lost its JobSet
    # after two restarts reported 2 until the new JobSet had restarted three times.
    api = RecordingApi()
    r, _ = reconciler(api)
    run = finetune({"phase": "Running", "restarts": 2, "jobSetName": "run"})
    run["metadata"]["resourceVersion"] = "5"
    r.reconcile(run, None, [], event=Events())
    (created,) = [b for b in api.bodies if b["kind"] == "JobSet"]
    assert created["metadata"]["annotations"][EARLIER_RESTARTS_ANNOTATION] == "2"
    # A JobSet of the run's first creation carries nothing.
    first = RecordingApi()
    reconciler(first)[0].reconcile(new_run(), None, [], event=Events())
    (created,) = [b for b in first.bodies if b["kind"] == "JobSet"]
    assert EARLIER_RESTARTS_ANNOTATION not in (created["metadata"].get("annotations") or {})


def test_a_restart_is_logged_before_the_status_write_and_posted_after_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Found by the fault suite: an operator SIGKILLed between its status write and the log line left a
    # restart that no line explained, since its next life found the count already written.
    class FailingApi(RecordingApi):
        def patch_finetune_status(
            self, namespace: str, name: str, status: Mapping[str, Any]
        ) -> dict[str, Any]:
            raise ApiError("updating the status: cannot reach the API server", status=0, retryable=True)

    run = finetune({"phase": "Running", "restarts": 0, "restartsCounted": 0, "jobSetName": "run"})
    run["metadata"]["resourceVersion"] = "5"
    restarted = jobset(restarts=1)
    restarted["status"]["restartsCountTowardsMax"] = 1
    for api, written in ((FailingApi(), False), (RecordingApi(), True)):
        api.existing.add(("JobSet", "run"))
        events = Events()
        caplog.clear()
        with caplog.at_level(logging.INFO), contextlib.suppress(ApiError):
            reconciler(api)[0].reconcile(run, restarted, running_pods(), event=events)
        assert "JobSet run restarted all its slices (restart 1)" in caplog.text
        assert ("JobSetRestarted" in events.posted) == written


def test_the_render_is_reused_until_the_spec_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    api = RecordingApi()
    r, _ = reconciler(api)
    renders: list[int] = []
    real = reconcile.render_run
    monkeypatch.setattr(reconcile, "render_run", lambda ft, settings: renders.append(1) or real(ft, settings))
    run = new_run()
    for _ in range(5):
        r.reconcile(run, None, running_pods(), event=Events())
    assert len(renders) == 1
    changed = copy.deepcopy(run)
    changed["metadata"].update(generation=changed["metadata"]["generation"] + 1, resourceVersion="1000")
    changed["spec"]["suspend"] = True
    r.reconcile(changed, None, running_pods(), event=Events())
    assert len(renders) == 2


def test_the_namespace_identity_is_ensured_once_per_namespace() -> None:
    api = RecordingApi()
    r, _ = reconciler(api)
    for name in ("a", "b", "c"):
        run = new_run()
        run["metadata"].update(name=name, uid=f"u-{name}")
        r.reconcile(run, None, [], event=Events())
    assert len([c for c in api.calls if c[0] == "ensure"]) == 3
    assert len([c for c in api.calls if c == ("create", "JobSet")]) == 3


def test_slim_index_entries_derive_the_same_status_as_full_bodies() -> None:
    from tpuft_operator.slim import slim_finetune, slim_jobset, slim_pod
    from tpuft_operator.status import Observed, derive_status

    run = new_run()
    run["metadata"].update(
        managedFields=[{"manager": "kubectl"}] * 3,
        annotations={"kubectl.kubernetes.io/last-applied-configuration": "{...}" * 100},
    )
    jobset = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "metadata": {"name": "run", "namespace": "ns", "uid": "j", "managedFields": [{}]},
        "spec": {"suspend": False, "replicatedJobs": [{"name": "slice", "template": {}}]},
        "status": {
            "restarts": 1,
            "conditions": [{"type": "Failed", "status": "True", "reason": "FailedJobs"}],
        },
    }
    failed = pod("run-slice-0-0-aaaaa", phase="Failed", ready=False)
    failed["status"]["containerStatuses"] = [{"state": {"terminated": {"exitCode": 65}}}]
    failed.update(spec={"containers": [{"name": "trainer"}]})
    pods = [failed, pod("run-slice-0-1-bbbbb")]

    def derived(ft: dict[str, Any], js: dict[str, Any], ps: list[dict[str, Any]]) -> dict[str, Any]:
        return derive_status(Observed(finetune=ft, jobset=js, pods=ps, chips=8, hosts=2, now=NOW))

    full = derived(run, jobset, pods)
    slim = derived(slim_finetune(run), slim_jobset(jobset), [slim_pod(p) for p in pods])
    assert slim == full and full["phase"] == "Failed" and "exit code 65" in full["message"]
    assert "managedFields" not in slim_finetune(run)["metadata"]
    assert "spec" not in slim_pod(failed)


def test_a_first_status_that_is_unschedulable_posts_the_unschedulable_warning() -> None:
    api, events = RecordingApi(), Events()
    r, _ = reconciler(api, settle=0.0)
    stuck = pod("run-slice-0-0-aaaaa", phase="Pending", ready=False)
    stuck["status"]["conditions"].append(
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes"}
    )
    r.reconcile(new_run(), None, [stuck], event=events)
    assert events.posted == ["JobSetCreated", "Unschedulable"]


def reconcile_first_runs_at_once(r: Reconciler, n: int) -> list[Any]:
    """Starts the first reconciles of ``n`` new runs of one namespace, each on a thread; returns them."""
    import threading

    threads = []
    for i in range(n):
        run = new_run()
        run["metadata"].update(name=f"r{i}", uid=f"u-{i}")
        threads.append(threading.Thread(target=r.reconcile, args=(run, None, []), kwargs={"event": Events()}))
    for t in threads:
        t.start()
    return threads


def test_concurrent_first_runs_of_a_namespace_create_its_identity_once() -> None:
    import time

    class SlowApi(RecordingApi):
        def ensure(self, obj: Mapping[str, Any]) -> bool:
            time.sleep(0.05)  # as slow as an RBAC create: the other runs arrive meanwhile
            return super().ensure(obj)

    api = SlowApi()
    r, _ = reconciler(api)
    threads = reconcile_first_runs_at_once(r, 8)
    for t in threads:
        t.join()
    assert len([c for c in api.calls if c[0] == "ensure"]) == 3
    assert len([c for c in api.calls if c == ("create", "JobSet")]) == 8


def test_a_lagging_index_never_causes_a_second_create() -> None:
    api = RecordingApi()
    r, _ = reconciler(api)
    run = new_run()
    r.reconcile(run, None, [], event=Events())
    created = {
        "metadata": {"name": "run", "namespace": "ns", "ownerReferences": OURS},
        "spec": {},
        "status": {},
    }
    r.reconcile(run, created, [], event=Events())  # the index has it ...
    r.reconcile(run, None, [], event=Events())  # ... and a lagging copy of the index does not
    assert [c for c in api.calls if c[1] == "JobSet"] == [("create", "JobSet")]


def test_a_jobset_no_status_records_is_adopted_and_said_so(caplog: pytest.LogCaptureFixture) -> None:
    """An earlier operator created the JobSet and was killed before writing the run's status."""
    api = RecordingApi()
    r, _ = reconciler(api)
    created = {
        "metadata": {"name": "run", "namespace": "ns", "ownerReferences": OURS},
        "spec": {},
        "status": {},
    }
    with caplog.at_level("INFO", logger="tpuft.reconcile"):
        r.reconcile(new_run(), created, [], event=Events())
        r.reconcile(new_run(), created, [], event=Events())  # said once, not at every event
    assert [rec.getMessage() for rec in caplog.records if "adopted" in rec.getMessage()] == [
        "adopted existing JobSet run"
    ]
    assert not [c for c in api.calls if c[1] == "JobSet"]


def test_a_jobset_the_status_records_is_not_called_adopted(caplog: pytest.LogCaptureFixture) -> None:
    """A restarted operator continuing a run it had written status for has nothing to say about it."""
    r, _ = reconciler(RecordingApi())
    run = finetune({"phase": "Running", "jobSetName": "run"})
    created = {
        "metadata": {"name": "run", "namespace": "ns", "ownerReferences": OURS},
        "spec": {},
        "status": {},
    }
    with caplog.at_level("INFO", logger="tpuft.reconcile"):
        r.reconcile(run, created, running_pods(), event=Events())
    assert not [rec for rec in caplog.records if "adopted" in rec.getMessage()]


def test_a_new_runs_first_pending_posts_no_event_beyond_jobset_created() -> None:
    api, events = RecordingApi(), Events()
    r, _ = reconciler(api, settle=0.0)
    run = new_run()
    r.reconcile(run, None, [], event=events)
    assert ("status", "Pending") in api.calls
    assert events.posted == ["JobSetCreated"]
    # Later phase changes are Events as before.
    r.reconcile(finetune({"phase": "Pending", "jobSetName": "run"}), None, running_pods(), event=events)
    assert events.posted == ["JobSetCreated", "Running"]


# ---- ownership (issue 13) ---------------------------------------------------------------------------
def test_a_name_another_run_controls_fails_the_run_and_touches_nothing() -> None:
    from tpuft_operator.k8s import NameTaken

    api = RecordingApi()

    def taken(obj: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        api.calls.append(("create", obj["kind"]))
        raise NameTaken("JobSet", "ns", "run", "TPUFineTune victim (uid u-9)")

    api.create_or_adopt = taken  # type: ignore[method-assign]
    r, _ = reconciler(api)
    events = Events()
    r.reconcile(new_run(), None, [], event=events)
    status = written(r)["status"]
    assert status["phase"] == "Failed"
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "NameTaken" and "belongs to TPUFineTune victim" in failed["message"]
    assert "NameTaken" in events.posted
    # Final: nothing is tried again.
    calls = len(api.calls)
    r.reconcile(written(r), None, [], event=events)
    assert len(api.calls) == calls


def test_a_jobset_another_run_controls_is_never_suspended_by_this_one() -> None:
    api = RecordingApi()
    r, _ = reconciler(api)
    theirs = {
        "metadata": {
            "name": "run",
            "namespace": "ns",
            "ownerReferences": [{"kind": "TPUFineTune", "name": "victim", "uid": "u-9", "controller": True}],
        },
        "spec": {"suspend": False},
        "status": {},
    }
    attacker = finetune(suspend=True)
    attacker["metadata"]["resourceVersion"] = "1"
    r.reconcile(attacker, theirs, [], event=Events())
    assert ("suspend", "JobSet") not in api.calls and ("resume", "JobSet") not in api.calls


def test_pods_the_apiserver_refuses_surface_in_its_words_and_clear_once_created() -> None:
    """The Job controller's FailedCreate event is the only record of a refused pod: read once the
    JobSet is 2 s old and its pods are missing, shown as ReplicaFailure (and a Warning Event)."""
    refusal = (
        'Error creating: pods "run-slice-0-0-x" is forbidden: violates PodSecurity "restricted:latest": '
        "runAsNonRoot != true"
    )

    class RefusingApi(RecordingApi):
        def creation_failures(self, namespace: str) -> list[dict[str, Any]]:
            self.calls.append(("events", namespace))
            return [
                {"message": refusal, "lastTimestamp": "2099-01-01T00:00:00Z", "involvedObject": job},
                {
                    "message": "another run's",
                    "lastTimestamp": "2099-01-01T00:00:00Z",
                    "involvedObject": other,
                },
            ]

    api, events = RefusingApi(), Events()
    r, deferred = reconciler(api)
    old = {**jobset(), "metadata": {**jobset()["metadata"], "creationTimestamp": "2020-01-01T00:00:00Z"}}
    r.reconcile(new_run(), old, [], event=events)
    assert ("events", "ns") in api.calls
    status = api.last_status
    (failure,) = [c for c in status["conditions"] if c["type"] == "ReplicaFailure"]
    assert (failure["status"], failure["reason"]) == ("True", "FailedCreate")
    assert refusal in failure["message"] and refusal in status["message"]
    assert status["phase"] == "Pending" and "ReplicaFailure" in events.posted
    assert deferred and deferred[-1] == reconcile.REFUSAL_CHECK_AFTER * 1  # looks again soon
    # The namespace is fixed and the pods are created: the condition turns False.
    after = finetune(status)
    after["metadata"]["resourceVersion"] = "1"
    r.reconcile(after, old, running_pods(), event=events)
    (cleared,) = [c for c in api.last_status["conditions"] if c["type"] == "ReplicaFailure"]
    assert (cleared["status"], cleared["reason"]) == ("False", "PodsCreated")


def test_jobsets_own_wait_for_a_scheduled_leader_is_not_a_refusal() -> None:
    """With exclusive placement JobSet's pod webhook refuses a slice's followers until its leader is
    scheduled: that FailedCreate is the design, and the leader's Unschedulable condition says why."""

    class FollowerWaitApi(RecordingApi):
        def creation_failures(self, namespace: str) -> list[dict[str, Any]]:
            self.calls.append(("events", namespace))
            message = (
                'Error creating: admission webhook "vpod.kb.io" denied the request: follower pod node '
                "selector for topology domain not found. missing selector: cloud.google.com/gke-nodepool"
            )
            return [{"message": message, "lastTimestamp": "2099-01-01T00:00:00Z", "involvedObject": job}]

    api = FollowerWaitApi()
    r, _ = reconciler(api)
    old = {**jobset(), "metadata": {**jobset()["metadata"], "creationTimestamp": "2020-01-01T00:00:00Z"}}
    r.reconcile(new_run(), old, [], event=Events())
    assert ("events", "ns") in api.calls
    assert not [c for c in api.last_status["conditions"] if c["type"] == "ReplicaFailure"]


def test_runs_that_look_for_refusals_at_once_share_one_list_of_the_namespace() -> None:
    """A burst of runs whose pods are slow to appear: one list of the namespace's refusal Events
    serves every run that looks within REFUSAL_LIST_TTL (the benchmark saw ~9 lists per run)."""
    api = RecordingApi()
    r, _ = reconciler(api)
    old = {**jobset(), "metadata": {**jobset()["metadata"], "creationTimestamp": "2020-01-01T00:00:00Z"}}
    for i in range(5):
        run = new_run()
        run["metadata"].update(name=f"r{i}", uid=f"u-{i}")
        js = copy.deepcopy(old)
        js["metadata"].update(name=f"r{i}", ownerReferences=[{**OURS[0], "name": f"r{i}", "uid": f"u-{i}"}])
        r.reconcile(run, js, [], event=Events())
    assert [c for c in api.calls if c[0] == "events"] == [("events", "ns")]


def test_no_run_waits_for_another_run_s_progress_rbac() -> None:
    """The namespace's progress Role and RoleBinding are made by one reconcile after its JobSet; the
    other runs of the burst go on (they waited behind it: every worker held by two RBAC creates)."""
    import threading

    release, creating = threading.Event(), threading.Event()

    class SlowRbacApi(RecordingApi):
        def ensure(self, obj: Mapping[str, Any]) -> bool:
            if obj["kind"] == "Role":
                creating.set()
                release.wait(10)
            return super().ensure(obj)

    api = SlowRbacApi()
    r, _ = reconciler(api)
    first = threading.Thread(target=r.reconcile, args=(new_run(), None, []), kwargs={"event": Events()})
    first.start()
    assert creating.wait(10)
    other = new_run()
    other["metadata"].update(name="other", uid="u-2")
    r.reconcile(other, None, [], event=Events())
    assert first.is_alive()  # it returned while the first run's Role was still being made
    assert ("create", "JobSet") in api.calls and api.calls.count(("create", "JobSet")) == 2
    release.set()
    first.join(10)
    assert [c for c in api.calls if c[0] == "ensure"] == [
        ("ensure", "ServiceAccount"),
        ("ensure", "Role"),
        ("ensure", "RoleBinding"),
    ]


def test_a_run_with_its_own_account_gets_the_namespace_role_before_its_rolebinding() -> None:
    """Its RoleBinding binds the namespace's progress Role; the apiserver's escalation check reads
    that Role, so creating the binding first is a 404 (found by tests/e2e/test_gitops.py)."""
    from tpuft_operator.api.policy import AdminPolicy

    api = RecordingApi()
    r, _ = reconciler(api)
    r.policy = AdminPolicy(service_accounts=("team-trainer",))  # the admin allows the team's account
    run = new_run()
    run["spec"]["serviceAccountName"] = "team-trainer"
    r.reconcile(run, None, [], event=Events())
    writes = api.writes()
    assert writes.index(("ensure", "Role")) < writes.index(("create", "RoleBinding"))
    assert writes.index(("create", "RoleBinding")) < writes.index(("create", "JobSet"))


def test_the_jobset_is_sent_without_waiting_for_the_namespace_account() -> None:
    """The trainer account is needed by the JobSet's pods, two controller hops after the JobSet: the
    first runs of a namespace send their JobSets while its create is in flight, and each reconcile
    returns only once it is answered (a failure is the run's to report)."""
    import threading

    release, sending = threading.Event(), threading.Event()

    class SlowAccountApi(RecordingApi):
        def ensure(self, obj: Mapping[str, Any]) -> bool:
            if obj["kind"] == "ServiceAccount":
                sending.set()
                assert release.wait(10)
            return super().ensure(obj)

    api = SlowAccountApi()
    r, _ = reconciler(api)
    threads = reconcile_first_runs_at_once(r, 3)
    assert sending.wait(10)
    deadline = time.monotonic() + 10
    while api.calls.count(("create", "JobSet")) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    # All three JobSets are sent while the account's create is still unanswered, and nobody is done.
    assert api.calls.count(("create", "JobSet")) == 3
    assert ("ensure", "ServiceAccount") not in api.calls
    assert all(t.is_alive() for t in threads)
    release.set()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert api.calls.count(("ensure", "ServiceAccount")) == 1  # one create for the namespace


def test_a_failed_account_create_is_reported_and_sent_again_by_the_next_reconcile(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failures = [ApiError("creating ServiceAccount ns/tpuft-trainer: HTTP 503", status=503, retryable=True)]

    class FlakyAccountApi(RecordingApi):
        def ensure(self, obj: Mapping[str, Any]) -> bool:
            if obj["kind"] == "ServiceAccount" and failures:
                self.calls.append(("failed", "ServiceAccount"))
                raise failures.pop()
            return super().ensure(obj)

    api = FlakyAccountApi()
    r, _ = reconciler(api)
    run = new_run()
    with caplog.at_level(logging.WARNING), pytest.raises(ApiError, match="ServiceAccount"):
        r.reconcile(run, None, [], event=Events())  # raised to the runtime, which logs it too
    assert "cannot create the namespace's trainer ServiceAccount yet: creating" in caplog.text
    assert ("create", "JobSet") in api.calls  # sent meanwhile: its pods are what wait for the account
    # The JobSet exists now, so no create is due; the reconcile sends the account's create again.
    js = {"metadata": {"name": "run", "namespace": "ns", "ownerReferences": OURS}, "spec": {}, "status": {}}
    r.reconcile(run, js, [], event=Events())
    deadline = time.monotonic() + 10
    while ("ensure", "ServiceAccount") not in api.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert api.calls.count(("failed", "ServiceAccount")) == 1
    assert api.calls.count(("ensure", "ServiceAccount")) == 1
    assert api.calls.count(("create", "JobSet")) == 1


def paced_reconciler(api: RecordingApi, clock: list[float]) -> tuple[Reconciler, list[float]]:
    """A reconciler whose status patches take turns in a pace of one write a second, on ``clock``."""
    deferred: list[float] = []
    r = Reconciler(
        api=api,  # type: ignore[arg-type]
        render_settings=RenderSettings(),
        defer=lambda key, delay: deferred.append(delay),
        pace=WritePace(1, 1, clock=lambda: clock[0]),
    )
    return r, deferred


def test_a_status_patch_waits_its_turn_without_holding_the_worker_and_the_jobset_does_not() -> None:
    api, clock = RecordingApi(), [1000.0]
    r, deferred = paced_reconciler(api, clock)
    r.pace.reserve()  # another run's write took the only token
    r.reconcile(new_run(), None, [], event=Events())
    # The JobSet is created at once; the status patch is not written, and the reconcile returned
    # asking to be run again when the turn comes (a worker never sleeps on the pace).
    assert [c for c in api.writes() if c[0] != "ensure"] == [("create", "JobSet")]
    assert deferred == [reconcile.REFUSAL_CHECK_AFTER, 1.0]  # the look at missing pods, and the turn
    clock[0] += 0.4  # an event of the run before its turn: still not written, and no new turn taken
    r.reconcile(new_run(), None, [], event=Events())
    assert not [c for c in api.calls if c[0] == "status"]
    clock[0] += 0.6  # the deferred reconcile: its turn has come
    r.reconcile(new_run(), None, [], event=Events())
    assert [c for c in api.calls if c[0] == "status"] == [("status", "Pending")]
    # Exactly one turn used by the run (none taken on the early event): the next is a second away.
    assert r.pace.reserve() == clock[0] + 1.0


def test_a_paced_patch_writes_what_is_true_when_its_turn_comes() -> None:
    """A status that changed while it waited is written once, as it is then (Running, not Pending)."""
    api, clock = RecordingApi(), [1000.0]
    r, _ = paced_reconciler(api, clock)
    r.pace.reserve()
    r.reconcile(new_run(), None, [], event=Events())
    clock[0] += 1.0
    events = Events()
    r.reconcile(new_run(), None, running_pods(), event=events)
    assert [c for c in api.calls if c[0] == "status"] == [("status", "Running")]
    assert events.posted == ["Running"]


# ---- checkpoints and host RAM -------------------------------------------------------------------------
def test_a_skipped_checkpoint_posts_one_warning_event() -> None:
    api, events = RecordingApi(), Events()
    r, _ = reconciler(api)
    attempt = {
        "startTime": "2026-11-30T11:59:00Z",
        "resumedFromStep": 4,
        "checkpointSeconds": 0.0,
        "skippedCheckpoints": [{"step": 8, "reason": "checkpoint-8: shard __0_0.distcp is missing"}],
    }
    run = finetune({"phase": "Running", "jobSetName": "run", "progress": {"step": 5, "attempt": attempt}})
    run["metadata"]["resourceVersion"] = "5"
    r.reconcile(run, jobset(), running_pods(), event=events)
    assert events.posted == ["CheckpointSkipped"]
    (skipped,) = [c for c in api.last_status["conditions"] if c["type"] == "CheckpointSkipped"]
    assert (
        skipped["status"] == "True" and "checkpoint-8 (shard __0_0.distcp is missing)" in skipped["message"]
    )
    # Still true at the next report: no second Event.
    again = written(r)
    again["status"] = {**run["status"], **again["status"]}
    r.reconcile(again, jobset(), running_pods(), event=events)
    assert events.posted == ["CheckpointSkipped"]


def test_a_spec_a_host_cannot_hold_fails_as_invalid_naming_the_topology() -> None:
    """The operator's side of the host-RAM rule (api/validation.py): no JobSet, Valid=False."""
    api, events = RecordingApi(), Events()
    r, _ = reconciler(api)
    run = finetune(
        model={"name": "meta-llama/Llama-3.1-70B", "dtype": "float32"},
        tpu={"type": "v5p", "topology": "2x2x1"},
        training={"maxSteps": 10, "optimizer": "adamw"},
    )
    run["metadata"]["resourceVersion"] = "1"
    r.reconcile(run, None, [], event=events)
    status = written(r)["status"]
    assert status["phase"] == "Failed" and ("create", "JobSet") not in api.calls
    (valid,) = [c for c in status["conditions"] if c["type"] == "Valid"]
    assert (valid["status"], valid["reason"]) == ("False", "InvalidSpec")
    assert valid["message"].startswith("spec.tpu.topology: meta-llama/Llama-3.1-70B full fine-tune")
    assert "a ct5p-hightpu-4t host has 448 GiB" in valid["message"]
    assert "Failed" in events.posted
