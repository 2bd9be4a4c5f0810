"""Kueue's Workload read as the `Queued` condition (queueing.py), the decision to hold a queued run
through its Workload, and the Events of admission and eviction: pure, without a cluster.

The Workload conditions below are the shapes Kueue v0.19 writes (pkg/workload, pkg/scheduler,
pkg/controller/core/workload_controller.go), messages included."""

from __future__ import annotations

from typing import Any

import pytest

from tpuft_operator import queueing
from tpuft_operator.reconcile import Decision, _post_queue_events, decide
from tpuft_operator.slim import slim_finetune
from tpuft_operator.status import Observed, derive_status

from .test_status import NOW, finetune, jobset


def cond(type_: str, status: str, reason: str = "", message: str = "") -> dict[str, str]:
    return {"type": type_, "status": status, "reason": reason, "message": message}


def workload(*conditions: dict[str, str], active: bool = True, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "jobset-run-1a2b3",
            "namespace": "ns",
            "ownerReferences": [
                {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "name": "run", "uid": "js-1"}
            ],
        },
        "spec": {"queueName": "q", "active": active},
        "status": {"conditions": list(conditions), **status},
    }


QUOTA = (
    "couldn't assign flavors to pod set slice: insufficient unused quota for google.com/tpu in flavor "
    "v5p-2x2x2, 8 more needed"
)


@pytest.mark.parametrize(
    ("wl", "reason", "says"),
    [
        (None, "WaitingForWorkload", "no Workload"),
        (workload(), "PendingEvaluation", "waiting for Kueue to consider it"),
        (
            workload(cond("QuotaReserved", "False", "Inadmissible", "LocalQueue q doesn't exist")),
            "LocalQueueMissing",
            "LocalQueue q doesn't exist",
        ),
        (
            workload(cond("QuotaReserved", "False", "Misconfigured", "ClusterQueue cq doesn't exist")),
            "ClusterQueueMissing",
            "ClusterQueue cq doesn't exist",
        ),
        (
            workload(cond("QuotaReserved", "False", "Inadmissible", "ClusterQueue cq is inactive")),
            "ClusterQueueInactive",
            "ClusterQueue cq is inactive",
        ),
        (workload(cond("QuotaReserved", "False", "Pending", QUOTA)), "InsufficientQuota", "8 more needed"),
        (
            workload(cond("QuotaReserved", "False", "WaitingForQuota", QUOTA)),
            "InsufficientQuota",
            "v5p-2x2x2",
        ),
        (
            workload(cond("QuotaReserved", "False", "ExceedsMaxQuota", "insufficient quota ... > maximum")),
            "ExceedsMaxQuota",
            "maximum",
        ),
        (
            workload(
                cond(
                    "QuotaReserved",
                    "False",
                    "Pending",
                    "couldn't assign flavors: flavor v5e doesn't match node affinity",
                )
            ),
            "NoMatchingFlavor",
            "doesn't match",
        ),
        (
            workload(
                cond("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cq"),
                cond(
                    "Admitted",
                    "False",
                    "UnsatisfiedAdmissionChecks",
                    "The workload has not all admissionChecks",
                ),
                admission={"clusterQueue": "cq"},
                admissionChecks=[{"name": "dws-prov", "state": "Pending", "message": "Waiting for capacity"}],
            ),
            "WaitingForAdmissionChecks",
            "dws-prov (Pending: Waiting for capacity)",
        ),
        (workload(active=False), "Deactivated", "spec.active=false"),
        (
            workload(
                cond("Evicted", "True", "DeactivatedDueToRequeuingLimitExceeded", "limit"), active=False
            ),
            "DeactivatedByKueue",
            "set the Workload's spec.active to true",
        ),
    ],
)
def test_why_a_queued_run_waits(wl: dict[str, Any] | None, reason: str, says: str) -> None:
    state = queueing.queue_state(wl, "q")
    assert state.waiting
    assert state.reason == reason
    assert says in state.message


def test_admitted_and_finished_are_not_waiting() -> None:
    admitted = workload(
        cond("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cq"),
        cond("Admitted", "True", "Admitted", "The workload is admitted"),
        admission={"clusterQueue": "cq"},
    )
    state = queueing.queue_state(admitted, "q")
    assert (state.waiting, state.reason, state.cluster_queue) == (False, "Admitted", "cq")
    assert "ClusterQueue cq" in state.message
    done = queueing.queue_state(workload(cond("Finished", "True", "Succeeded", "")), "q")
    assert (done.waiting, done.reason) == (False, "Finished")


def test_an_evicted_run_says_why_it_was_evicted_and_why_it_waits_again() -> None:
    evicted = workload(
        cond(
            "Evicted",
            "True",
            "Preempted",
            "Preempted to accommodate a workload (UID: w2) due to prioritization",
        ),
        cond("Preempted", "True", "InClusterQueue", "Preempted to accommodate a higher priority workload"),
        cond("Requeued", "True", "Preempted", ""),
        cond("QuotaReserved", "False", "Pending", QUOTA),
    )
    state = queueing.queue_state(evicted, "q")
    assert state.waiting and state.reason == "InsufficientQuota"
    assert state.message.startswith(queueing.EVICTED_PREFIX)
    assert "Preempted: Preempted to accommodate a higher priority workload" in state.message
    assert "8 more needed" in state.message
    # Once quota is reserved again Kueue sets Evicted=False: no longer an eviction.
    readmitted = workload(
        cond("Evicted", "False", "QuotaReserved", "Previously: ..."),
        cond("QuotaReserved", "True", "QuotaReserved", ""),
        cond("Admitted", "True", "Admitted", ""),
    )
    assert queueing.queue_state(readmitted, "q").evicted is None


def test_the_workload_of_a_jobset_is_found_by_its_owner_uid() -> None:
    old = workload()
    old["metadata"]["ownerReferences"][0]["uid"] = "js-0"
    new = workload()
    js = {"metadata": {"name": "run", "uid": "js-1"}}
    assert queueing.workload_of([old, new], js) is new
    assert queueing.workload_of([old], js) is None
    assert queueing.workload_owner({"metadata": {"ownerReferences": [{"kind": "Job", "name": "x"}]}}) is None


def test_slim_workload_keeps_what_the_condition_reads() -> None:
    full = workload(
        cond("QuotaReserved", "False", "Pending", QUOTA),
        admission={"clusterQueue": "cq", "podSetAssignments": [{"name": "slice", "count": 2}]},
    )
    full["spec"]["podSets"] = [{"name": "slice", "count": 2, "template": {"spec": {"containers": []}}}]
    slim = queueing.slim_workload(full)
    assert "podSets" not in slim["spec"]
    assert slim["status"]["admission"] == {"clusterQueue": "cq"}
    assert queueing.queue_state(slim, "q") == queueing.queue_state(full, "q")


def derive(ft: dict[str, Any], js: dict[str, Any] | None, wl: dict[str, Any] | None) -> dict[str, Any]:
    return derive_status(Observed(finetune=ft, jobset=js, workload=wl, hosts=2, chips=8, now=NOW))


def queued_condition(status: dict[str, Any]) -> dict[str, Any] | None:
    return next((c for c in status["conditions"] if c["type"] == "Queued"), None)


def test_the_queued_phase_and_condition_carry_kueues_reason() -> None:
    status = derive(
        finetune(queueName="q"),
        jobset(suspend=True),
        workload(cond("QuotaReserved", "False", "Pending", QUOTA)),
    )
    assert status["phase"] == "Queued"
    assert "8 more needed" in status["message"]
    queued = queued_condition(status)
    assert queued is not None
    assert (queued["status"], queued["reason"]) == ("True", "InsufficientQuota")


def test_an_admitted_run_has_queued_false() -> None:
    admitted = workload(cond("Admitted", "True", "Admitted", ""), admission={"clusterQueue": "cq"})
    status = derive(finetune(queueName="q"), jobset(suspend=False), admitted)
    assert status["phase"] == "Pending"
    queued = queued_condition(status)
    assert queued is not None and (queued["status"], queued["reason"]) == ("False", "Admitted")
    # Admitted while the JobSet is still suspended: Queued, but not waiting for quota any more.
    status = derive(finetune(queueName="q"), jobset(suspend=True), admitted)
    assert status["phase"] == "Queued" and "unsuspend" in status["message"]
    assert queued_condition(status)["status"] == "False"  # type: ignore[index]


def test_a_run_without_a_queue_has_no_queued_condition() -> None:
    assert queued_condition(derive(finetune(), jobset(), None)) is None


@pytest.mark.parametrize(
    ("spec", "js", "wl", "expected"),
    [
        # Suspending a queued run holds its Workload first (Kueue would unsuspend an admitted JobSet).
        (
            {"queueName": "q", "suspend": True},
            jobset(suspend=False),
            workload(),
            Decision(set_suspend=True, set_workload_active=False),
        ),
        (
            {"queueName": "q", "suspend": True},
            jobset(suspend=True),
            workload(),
            Decision(set_workload_active=False),
        ),
        ({"queueName": "q", "suspend": True}, jobset(suspend=True), workload(active=False), Decision()),
        # Resuming releases it; Kueue unsuspends the JobSet when it admits it (never the operator).
        (
            {"queueName": "q"},
            jobset(suspend=True),
            workload(active=False),
            Decision(set_workload_active=True),
        ),
        ({"queueName": "q"}, jobset(suspend=True), workload(), Decision()),
        ({"queueName": "q", "suspend": True}, jobset(suspend=True), None, Decision()),  # no Workload yet
        # Kueue deactivated it itself (its requeuing limit): not ours to undo.
        (
            {"queueName": "q"},
            jobset(suspend=True),
            workload(
                cond("Evicted", "True", "DeactivatedDueToRequeuingLimitExceeded", "exceeded"), active=False
            ),
            Decision(),
        ),
    ],
)
def test_decide_holds_a_suspended_queued_run_through_its_workload(
    spec: dict[str, Any], js: dict[str, Any], wl: dict[str, Any] | None, expected: Decision
) -> None:
    assert decide(finetune(**spec), True, js, wl) == expected


def events_for(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, str]]:
    posted: list[tuple[str, str]] = []

    class Log:
        def info(self, *_: Any) -> None: ...
        def warning(self, *_: Any) -> None: ...

    _post_queue_events(before, after, lambda kind, reason, _message: posted.append((kind, reason)), Log())  # type: ignore[arg-type]
    return posted


def test_admission_and_eviction_are_events_once() -> None:
    waiting = derive(
        finetune(queueName="q"),
        jobset(suspend=True),
        workload(cond("QuotaReserved", "False", "Pending", QUOTA)),
    )
    admitted = derive(
        finetune(waiting, queueName="q"),
        jobset(suspend=False),
        workload(cond("Admitted", "True", "Admitted", "")),
    )
    assert events_for(waiting, admitted) == [("Normal", "Admitted")]
    assert events_for(admitted, admitted) == []
    evicted_wl = workload(
        cond("Evicted", "True", "Preempted", "Preempted to accommodate a workload"),
        cond("QuotaReserved", "False", "Pending", QUOTA),
    )
    evicted = derive(finetune(admitted, queueName="q"), jobset(suspend=True), evicted_wl)
    assert evicted["phase"] == "Queued"
    assert events_for(admitted, evicted) == [("Warning", "Evicted")]
    assert events_for(evicted, evicted) == []


def test_the_workload_priority_class_label_is_kept_and_rendered() -> None:
    ft = finetune(queueName="q")
    ft["metadata"]["labels"] = {"kueue.x-k8s.io/priority-class": "high", "team": "x"}
    assert slim_finetune(ft)["metadata"]["labels"] == {"kueue.x-k8s.io/priority-class": "high"}
