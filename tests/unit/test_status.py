"""The phase machine and the reconcile decision: pure functions, tested without a cluster."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tpuft_operator.reconcile import Decision, Reconciler, decide
from tpuft_operator.status import EARLIER_RESTARTS_ANNOTATION, Observed, derive_status, status_patch

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def finetune(status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "tpuft.dev/v1alpha1",
        "kind": "TPUFineTune",
        "metadata": {"name": "run", "namespace": "ns", "uid": "u-1", "generation": 3},
        "spec": {
            "model": {"name": "org/model"},
            "dataset": {"name": "org/data"},
            "tpu": {"type": "v5p", "topology": "2x2x2"},
            "training": {"maxSteps": 10},
            "output": {"uri": "gs://bucket/out"},
            **spec,
        },
        "status": status or {},
    }


def jobset(
    *, suspend: bool = False, conditions: list[dict[str, Any]] | None = None, restarts: int = 0
) -> dict[str, Any]:
    return {
        # Controlled by the run of `finetune()` (uid u-1), as every JobSet the operator makes.
        "metadata": {
            "name": "run",
            "ownerReferences": [{"kind": "TPUFineTune", "name": "run", "uid": "u-1", "controller": True}],
        },
        "spec": {"suspend": suspend},
        "status": {"conditions": conditions or [], "restarts": restarts},
    }


def pod(name: str, phase: str = "Running", ready: bool = True, **extra: Any) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}, *extra.pop("conditions", [])]
    return {"metadata": {"name": name}, "status": {"phase": phase, "conditions": conditions, **extra}}


def derive(
    ft: dict[str, Any], js: dict[str, Any] | None, pods: list[dict[str, Any]] = (), **kw: Any
) -> dict[str, Any]:  # type: ignore[assignment]
    return derive_status(
        Observed(
            finetune=ft,
            jobset=js,
            pods=pods,
            chips=8,
            hosts=2,
            accelerator="tpu-v5p-slice",
            topology="2x2x2",
            now=NOW,
            **kw,
        )
    )


def cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == type_)


def test_no_jobset_yet_is_pending_creating() -> None:
    status = derive(finetune(), None)
    assert status["phase"] == "Pending"
    assert status["chips"] == 8 and status["hosts"] == 2
    assert status["observedGeneration"] == 3
    assert cond(status, "Valid")["status"] == "True"


def test_global_batch_counts_chips_but_tensor_and_accumulation() -> None:
    assert derive(finetune(), None)["globalBatch"] == 8 * 8  # the API's default batch per chip
    recipe = finetune(
        training={"maxSteps": 10, "perDeviceBatchSize": 2, "gradientAccumulationSteps": 4},
        fsdp={"mesh": {"tensor": 2}},
    )
    assert derive(recipe, None)["globalBatch"] == 2 * (8 // 2) * 4


def test_invalid_spec_is_failed_naming_the_field() -> None:
    status = derive(
        finetune(), None, spec_error=("spec.fsdp.mesh", "fsdp x tensor = 3 but the slice has 8 chips")
    )
    assert status["phase"] == "Failed"
    assert status["message"] == "spec.fsdp.mesh: fsdp x tensor = 3 but the slice has 8 chips"
    valid = cond(status, "Valid")
    assert (valid["status"], valid["reason"]) == ("False", "InvalidSpec")
    assert status["completionTime"] == "2026-11-30T12:00:00Z"


def test_all_hosts_running_is_running_with_start_time() -> None:
    status = derive(finetune(), jobset(), [pod("a"), pod("b")])
    assert status["phase"] == "Running"
    assert status["startTime"] == "2026-11-30T12:00:00Z"
    assert "completionTime" not in status


def test_a_host_that_already_succeeded_does_not_turn_running_back_to_pending() -> None:
    assert (
        derive(finetune(), jobset(), [pod("a"), pod("b", phase="Succeeded", ready=False)])["phase"]
        == "Running"
    )


def test_some_hosts_not_ready_is_pending() -> None:
    status = derive(finetune(), jobset(), [pod("a"), pod("b", phase="Pending", ready=False)])
    assert status["phase"] == "Pending"
    assert status["message"] == "1/2 TPU hosts running"


def test_unschedulable_says_which_node_pool_is_missing() -> None:
    refused = pod(
        "a",
        phase="Pending",
        ready=False,
        conditions=[
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes"}
        ],
    )
    status = derive(finetune(), jobset(), [refused])
    scheduled = cond(status, "Scheduled")
    assert (scheduled["status"], scheduled["reason"]) == ("False", "Unschedulable")
    for fragment in ("tpu-v5p-slice", "2x2x2", "0/3 nodes"):
        assert fragment in scheduled["message"]


def test_suspended_and_queued() -> None:
    assert derive(finetune(suspend=True), jobset(suspend=True))["phase"] == "Suspended"
    queued = derive(finetune(queueName="q"), jobset(suspend=True))
    assert queued["phase"] == "Queued" and "q" in queued["message"]


def test_completed_jobset_is_succeeded() -> None:
    done = derive(
        finetune({"phase": "Running", "startTime": "2026-11-30T11:00:00Z"}),
        jobset(conditions=[{"type": "Completed", "status": "True"}]),
    )
    assert done["phase"] == "Succeeded"
    assert done["startTime"] == "2026-11-30T11:00:00Z"
    assert done["completionTime"] == "2026-11-30T12:00:00Z"


def test_user_error_exit_code_is_reported_as_such() -> None:
    failed_pod = pod(
        "host-0",
        phase="Failed",
        ready=False,
        containerStatuses=[{"state": {"terminated": {"exitCode": 66}}}],
    )
    status = derive(
        finetune(),
        jobset(conditions=[{"type": "Failed", "status": "True", "reason": "FailedJobs"}]),
        [failed_pod],
    )
    assert status["phase"] == "Failed"
    assert cond(status, "Failed")["reason"] == "UserError"
    assert "exit code 66 (NOT_FOUND) on pod host-0" in status["message"]


def test_exhausted_restarts_report_the_count() -> None:
    js = jobset(
        conditions=[{"type": "Failed", "status": "True", "reason": "MaxRestarts", "message": "too many"}],
        restarts=3,
    )
    status = derive(finetune(), js)
    assert status["phase"] == "Failed" and status["restarts"] == 3
    assert "after 3 restart(s)" in status["message"]


def test_terminal_phase_survives_a_deleted_jobset() -> None:
    ft = finetune(
        {"phase": "Succeeded", "jobSetName": "run", "message": "training finished", "completionTime": "x"}
    )
    status = derive(ft, None)
    assert status["phase"] == "Succeeded" and status["completionTime"] == "x"


def test_condition_transition_time_moves_only_when_status_changes() -> None:
    first = derive(finetune(), jobset(), [pod("a"), pod("b")])
    later = derive_status(
        Observed(
            finetune=finetune(first),
            jobset=jobset(),
            pods=[pod("a"), pod("b")],
            hosts=2,
            now=NOW + timedelta(hours=1),
        )
    )
    assert cond(later, "Running")["lastTransitionTime"] == cond(first, "Running")["lastTransitionTime"]
    assert status_patch(first, later) is None  # nothing to write: no status churn, no API call


def test_status_patch_contains_only_what_changed() -> None:
    assert status_patch({"phase": "Pending", "chips": 8}, {"phase": "Running", "chips": 8}) == {
        "phase": "Running"
    }


@pytest.mark.parametrize(
    ("status", "spec", "observed", "expected"),
    [
        ({}, {}, None, Decision(create=True)),
        ({"jobSetName": "run", "phase": "Running"}, {}, None, Decision(create=True, recreated=True)),
        ({"jobSetName": "run", "phase": "Succeeded"}, {}, None, Decision()),
        ({"phase": "Failed"}, {}, None, Decision()),
        ({"phase": "Running"}, {"suspend": True}, jobset(), Decision(set_suspend=True)),
        ({"phase": "Suspended"}, {"suspend": False}, jobset(suspend=True), Decision(set_suspend=False)),
        ({"phase": "Queued"}, {"queueName": "q"}, jobset(suspend=True), Decision()),  # Kueue's call
        ({"phase": "Running"}, {}, jobset(), Decision()),
    ],
)
def test_decide(
    status: dict[str, Any], spec: dict[str, Any], observed: dict[str, Any] | None, expected: Decision
) -> None:
    ft = finetune(status, **spec)
    assert decide(ft, True, observed) == expected


def test_decide_does_nothing_for_an_invalid_spec() -> None:
    assert decide(finetune(), False, None) == Decision()


def test_a_finished_run_keeps_its_first_explanation_when_its_pods_are_gone() -> None:
    failed_pod = pod(
        "host-0", phase="Failed", ready=False, containerStatuses=[{"state": {"terminated": {"exitCode": 65}}}]
    )
    failed_js = jobset(conditions=[{"type": "Failed", "status": "True", "reason": "FailedJobs"}])
    first = derive(finetune(), failed_js, [failed_pod])
    assert "DATA_ERROR" in first["message"]
    later = derive(finetune(first), failed_js, [])  # the pods were deleted since
    assert later["message"] == first["message"]
    assert status_patch(first, later) is None


@pytest.mark.parametrize("hand_set_phase", ["Failed", "Succeeded"])
def test_a_terminal_phase_written_by_hand_next_to_an_active_jobset_is_derived_again(
    hand_set_phase: str,
) -> None:
    # Found by the fault suite: `kubectl patch --subresource=status` setting Failed or Succeeded on a
    # running run froze it (no reconcile would ever change it again) while its JobSet kept its TPUs.
    edited = finetune(
        {"phase": hand_set_phase, "message": "edited by hand", "jobSetName": "run", "completionTime": "x"}
    )
    active = jobset(restarts=1)
    status = derive(edited, active, [pod("a"), pod("b")])
    assert status["phase"] == "Running" and status["restarts"] == 1
    assert status["completionTime"] is None  # merge-patching null removes the stale field
    assert decide(edited, True, active) == Decision()


def test_a_terminal_phase_stands_when_its_jobset_finished_or_is_gone() -> None:
    failed_js = jobset(conditions=[{"type": "Failed", "status": "True", "reason": "FailedJobs"}])
    done_js = jobset(conditions=[{"type": "Completed", "status": "True"}])
    for js in (failed_js, done_js, None):
        ft = finetune({"phase": "Failed", "message": "kept", "jobSetName": "run", "completionTime": "x"})
        status = derive(ft, js)
        assert status["phase"] == "Failed" and status["message"] == "kept" and status["completionTime"] == "x"
        assert decide(ft, True, js) == Decision()  # in particular: a deleted JobSet is not recreated


def test_a_rising_restart_count_is_logged_and_posted_as_an_event(caplog: pytest.LogCaptureFixture) -> None:
    # Without it a preemption shows in the operator's log only as Running -> Pending -> Running.
    current = {"phase": "Running", "restarts": 0, "jobSetName": "run"}
    derived = {**current, "restarts": 1}
    with caplog.at_level(logging.WARNING):
        announced = Reconciler._announce_restart(current, derived, {"restarts": 1}, logging.getLogger("t"))
    assert announced is not None and announced[0] == "Warning"
    assert "JobSet run restarted all its slices (restart 1)" in caplog.text
    assert (
        Reconciler._announce_restart(derived, derived, {"phase": "Running"}, logging.getLogger("t")) is None
    )


def test_restarts_counted_follow_the_jobsets_count_towards_max() -> None:
    js = jobset(restarts=3)
    js["status"]["restartsCountTowardsMax"] = 1  # two of the three followed a checkpointed stop
    status = derive(
        finetune({"phase": "Running", "restarts": 2, "jobSetName": "run"}), js, [pod("a"), pod("b")]
    )
    assert status["restarts"] == 3 and status["restartsCounted"] == 1
    # A deleted JobSet: the record stands until the new one is seen.
    gone = derive(finetune(status), None)
    assert gone["restarts"] == 3 and gone["restartsCounted"] == 1


def test_a_recreated_jobsets_restarts_add_to_the_earlier_ones() -> None:
    js = jobset(restarts=1)
    js["metadata"]["annotations"] = {EARLIER_RESTARTS_ANNOTATION: "2"}
    before = finetune({"phase": "Running", "restarts": 2, "jobSetName": "run"})
    assert derive(before, js, [pod("a"), pod("b")])["restarts"] == 3
    assert derive(finetune(), js, [pod("a"), pod("b")])["restarts"] == 3  # also from a wiped status
    raised = finetune({"phase": "Running", "restarts": 7, "jobSetName": "run"})
    assert derive(raised, js, [pod("a"), pod("b")])["restarts"] == 7  # a count raised by hand sticks


@pytest.mark.parametrize(
    ("counted_before", "counted_now", "kind", "says"),
    [
        # Found by the fault suite (issue 17): a stop after which every host saved its step (exit 75)
        # was reported as a failed host, a Warning, though it cost no work and no restart budget.
        (1, 1, "Normal", "restarted all its slices (restart 3) after a checkpointed stop: every host saved "
         "the step it reached (exit 75), so it does not count against maxRestarts (1 of 3 used)"),
        (1, 2, "Warning", "restarted all its slices (restart 3): a TPU host failed, was preempted or lost "
         "its node (not a user error); counted against maxRestarts (2 of 3 used)"),
    ],
)  # fmt: skip
def test_a_restart_after_a_checkpointed_stop_is_told_from_a_failure(
    counted_before: int, counted_now: int, kind: str, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    current = {"phase": "Running", "restarts": 2, "restartsCounted": counted_before, "jobSetName": "run"}
    derived = {**current, "restarts": 3, "restartsCounted": counted_now}
    with caplog.at_level(logging.INFO):
        announced = Reconciler._announce_restart(
            current, derived, {"restarts": 3}, logging.getLogger("t"), max_restarts=3
        )
    assert announced is not None and announced[0] == kind
    assert says in announced[1] and says in caplog.text
    assert caplog.records[-1].levelno == (logging.INFO if kind == "Normal" else logging.WARNING)


def test_a_finished_run_derived_again_needs_no_patch() -> None:
    running = derive(finetune(), jobset(), [pod("a"), pod("b")])
    done = derive(finetune(running), jobset(conditions=[{"type": "Completed", "status": "True"}]))
    assert done["phase"] == "Succeeded"
    finished = finetune(done)
    # Every later event of a finished run (its pods going away, a resync) derives the same status.
    assert (
        status_patch(done, derive(finished, jobset(conditions=[{"type": "Completed", "status": "True"}])))
        is None
    )
    assert status_patch(done, derive(finished, None)) is None


def test_pods_of_an_earlier_attempt_or_a_deleted_jobset_do_not_count() -> None:
    def labelled(name: str, uid: str, attempt: int, **meta: Any) -> dict[str, Any]:
        p = pod(name)
        p["metadata"].update(
            labels={"jobset.sigs.k8s.io/jobset-uid": uid, "jobset.sigs.k8s.io/restart-attempt": str(attempt)},
            **meta,
        )
        return p

    js = jobset(restarts=1)
    js["metadata"]["uid"] = "js-2"
    stale = [
        labelled("old-attempt", "js-2", 0),
        labelled("old-jobset", "js-1", 1),
        labelled("deleting", "js-2", 1, deletionTimestamp="2026-11-30T12:00:00Z"),
    ]
    assert derive(finetune(), js, stale)["phase"] == "Pending"
    current = [labelled("a", "js-2", 1), labelled("b", "js-2", 2)]  # "b": our JobSet copy lags
    assert derive(finetune(), js, stale + current)["phase"] == "Running"
