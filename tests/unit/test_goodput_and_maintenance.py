"""status.goodput, the maintenance signals and the checkpoint requests they cause: pure parts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from tests.unit.test_reconciler import KEY, Events, RecordingApi, reconciler
from tests.unit.test_status import cond, derive, finetune, jobset, pod
from tpuft_operator import goodput, maintenance
from tpuft_operator.api.models import TPUFineTuneStatus
from tpuft_operator.slim import slim_pod

T0 = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
LOST = ("waitingSeconds", "startupSeconds", "checkpointSeconds", "redoneSeconds", "restartGapSeconds")


def at(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def report(
    start: float, first: float | None, now: float, step: int, resumed: int, saves: float
) -> dict[str, Any]:
    attempt: dict[str, Any] = {"startTime": at(start), "resumedFromStep": resumed, "checkpointSeconds": saves}
    if first is not None:
        attempt["firstStepTime"] = at(first)
    return {"step": step, "totalSteps": 100, "updateTime": at(now), "attempt": attempt}


def fold(previous: dict[str, Any] | None, progress: dict[str, Any], **kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        created=T0, pod_start=None, phase="Running", phase_changed=False, completed=None, interval=60
    )
    args.update(kw)
    result = goodput.derive_goodput(previous, progress, **args)
    assert result is not None
    return result


def assert_sums_to_wall(figures: dict[str, Any]) -> None:
    total = figures["productiveSeconds"] + sum(figures["lost"][k] for k in LOST)
    assert abs(total - figures["wallSeconds"]) < 0.05, figures
    TPUFineTuneStatus.model_validate({"goodput": figures})  # and it fits the API


def test_a_run_with_one_restart_splits_its_wall_time_into_the_buckets() -> None:
    # Created at 0; pod started at 10 (waiting 10); trainer process at 12; first step at 30
    # (start-up 20); trained to step 50 by 130 with 5 s of saves; killed.
    first = fold(None, report(12, 30, 130, 50, 0, 5.0), pod_start=T0 + timedelta(seconds=10))
    assert first["lost"]["waitingSeconds"] == 10 and first["lost"]["startupSeconds"] == 20
    # The restart: its pods start at 150 (gap 20), its trainer at 151, first step at 165; it resumed
    # from checkpoint 40, so steps 41-50 of the first attempt (10 of 50 steps of 95 s) were redone.
    second = fold(
        first, report(151, 165, 200, 60, 40, 0.0), pod_start=T0 + timedelta(seconds=150), phase_changed=True
    )
    lost = second["lost"]
    assert lost["restartGapSeconds"] == 20
    assert lost["startupSeconds"] == 20 + 15
    assert lost["checkpointSeconds"] == 5
    assert lost["redoneSeconds"] == round(95 * 10 / 50, 1)
    assert second["redoneSteps"] == 10 and first["redoneSteps"] == 0  # what the stop cost, in steps
    assert second["wallSeconds"] == 200
    assert second["productiveSeconds"] == 200 - 10 - 35 - 5 - 19 - 20
    assert second["ratio"] == round(second["productiveSeconds"] / 200, 4)
    assert len(second["attempts"]) == 2
    assert_sums_to_wall(second)


def test_reports_refresh_the_figures_once_per_interval_and_always_at_a_phase_change() -> None:
    first = fold(None, report(0, 10, 100, 10, 0, 0.0))
    assert fold(first, report(0, 10, 130, 16, 0, 0.0)) == first  # 30 s of report time: held back
    later = fold(first, report(0, 10, 170, 24, 0, 0.0))
    assert later["asOf"] == at(170) and later["attempts"][0]["lastStep"] == 24
    forced = fold(first, report(0, 10, 101, 11, 0, 0.0), phase_changed=True)
    assert forced["attempts"][0]["lastStep"] == 11
    saved = fold(first, report(0, 10, 105, 11, 0, 3.0))  # a save always counts at once
    assert saved["lost"]["checkpointSeconds"] == 3


def test_only_the_time_training_waited_for_saves_is_lost_the_background_writes_are_not() -> None:
    # Two periodic saves blocked training 1.5 s each (the copy of the shards to host memory), then
    # wrote for 40 s each in the background while training went on; a report says both totals.
    progress = report(0, 10, 200, 40, 0, 3.0)
    progress["attempt"]["checkpointWriteSeconds"] = 80.0
    figures = fold(None, progress)
    assert figures["lost"]["checkpointSeconds"] == 3
    assert figures["productiveSeconds"] == 200 - 10 - 3  # the writes overlapped the steps
    assert figures["attempts"][0]["checkpointWriteSeconds"] == 80  # kept, for information
    assert_sums_to_wall(figures)
    # A trainer that does not report the writes (an older image): no such field, same buckets.
    assert "checkpointWriteSeconds" not in fold(None, report(0, 10, 200, 40, 0, 3.0))["attempts"][0]
    # A write finishing in the background changes no bucket: it waits for the next interval.
    later = report(0, 10, 205, 41, 0, 3.0)
    later["attempt"]["checkpointWriteSeconds"] = 120.0
    assert fold(figures, later) == figures


def test_a_finished_run_is_measured_to_its_completion_and_stays_put() -> None:
    done = fold(
        None, report(0, 10, 100, 100, 0, 2.0), phase="Succeeded", completed=T0 + timedelta(seconds=104)
    )
    assert done["wallSeconds"] == 104 and done["lost"]["checkpointSeconds"] == 2 + 4  # the final save
    assert (
        fold(done, report(0, 10, 100, 100, 0, 2.0), phase="Succeeded", completed=T0 + timedelta(seconds=104))
        == done
    )
    assert_sums_to_wall(done)
    assert 0 < done["ratio"] <= 1


def test_no_figures_before_the_trainer_reports() -> None:
    assert (
        goodput.derive_goodput(
            None,
            {"step": 3},
            created=T0,
            pod_start=None,
            phase="Running",
            phase_changed=False,
            completed=None,
            interval=60,
        )
        is None
    )


def test_attempts_are_bounded() -> None:
    figures: dict[str, Any] | None = None
    for i in range(40):
        figures = fold(figures, report(i * 100, i * 100 + 5, i * 100 + 50, i + 1, i, 0.0), phase_changed=True)
    assert figures is not None and len(figures["attempts"]) == goodput.MAX_ATTEMPTS
    assert_sums_to_wall(figures)


# ---- maintenance ---------------------------------------------------------------------------------
def node(name: str, **labels: str) -> dict[str, Any]:
    taints = (
        [{"key": maintenance.TERMINATION_TAINT, "effect": "NoSchedule"}]
        if labels.pop("terminating", "")
        else []
    )
    return maintenance.slim_node(
        {
            "metadata": {"name": name, "labels": {"other": "x", **labels}},
            "spec": {"taints": [{"key": "google.com/tpu"}, *taints]},
        }
    )


def on(name: str, node_name: str, request: str | None = None) -> dict[str, Any]:
    body = pod(name)
    body["spec"] = {"nodeName": node_name}
    if request is not None:
        body["metadata"]["annotations"] = {"tpuft.dev/checkpoint-request": request}
    return slim_pod(body)


def test_signals_are_read_from_the_labels_and_taint_gke_sets() -> None:
    assert not maintenance.node_signals(node("a")).any
    soon = maintenance.node_signals(node("a", **{maintenance.SCHEDULED_LABEL: "1733083200"}))
    assert soon.scheduled == 1733083200 and "2024-12-01T20:00:00Z" in soon.describe()
    assert maintenance.node_signals(node("a", **{maintenance.ACTIVE_LABEL: "ONGOING"})).active
    assert maintenance.node_signals(node("a", terminating="yes")).terminating
    assert maintenance.node_signals(node("a", **{maintenance.SCHEDULED_LABEL: "soon"})).scheduled is None


def test_maintenance_on_one_node_concerns_the_whole_run_and_asks_every_pod_once() -> None:
    nodes = {"n0": node("n0"), "n1": node("n1", **{maintenance.SCHEDULED_LABEL: "1733083200"})}
    pods = [on("p0", "n0"), on("p1", "n1", request="1733083200")]
    found = maintenance.for_run(pods, nodes)
    assert found is not None and found.request == 1733083200 and found.reason == "MaintenanceScheduled"
    assert maintenance.pods_to_ask(pods, 1733083200) == ["p0"]  # p1 already has it
    assert maintenance.for_run([on("p0", "n0")], nodes) is None


def test_the_condition_and_its_clearing() -> None:
    nodes = {"n1": node("n1", **{maintenance.SCHEDULED_LABEL: "1733083200"})}
    ft = finetune()
    status = derive(ft, jobset(), [on("p0", "n1"), on("p1", "n1")], nodes=nodes)
    scheduled = cond(status, "MaintenanceScheduled")
    assert scheduled["status"] == "True" and scheduled["reason"] == "MaintenanceScheduled"
    assert "node n1: maintenance scheduled for 2024-12-01T20:00:00Z" in scheduled["message"]
    assert "asked the trainer to checkpoint now" in scheduled["message"]
    ignored = derive(finetune(maintenance="ignore"), jobset(), [on("p0", "n1")], nodes=nodes)
    assert "no checkpoint requested" in cond(ignored, "MaintenanceScheduled")["message"]
    # Gone (the pods moved, or GKE removed the label): False, once it had been True.
    cleared = derive(finetune(status), jobset(), [on("p0", "n9"), on("p1", "n9")], nodes=nodes)
    assert cond(cleared, "MaintenanceScheduled")["status"] == "False"
    never = derive(finetune(), jobset(), [on("p0", "n9"), on("p1", "n9")], nodes=nodes)
    assert "MaintenanceScheduled" not in {c["type"] for c in never["conditions"]}


def test_a_slow_save_is_a_warning_condition() -> None:
    def with_save(seconds: float) -> dict[str, Any]:
        return {
            "progress": {
                "lastCheckpoint": {"step": 40, "seconds": seconds, "graceSeconds": 60, "reason": "periodic"}
            }
        }

    slow = derive(finetune(with_save(31)), jobset(), [pod("a"), pod("b")])
    assert cond(slow, "CheckpointSlow")["status"] == "True"
    assert "more than half the 60 s grace period" in cond(slow, "CheckpointSlow")["message"]
    assert "a stop's save is synchronous" in cond(slow, "CheckpointSlow")["message"]
    fine = derive(
        finetune({**with_save(12), "conditions": slow["conditions"]}), jobset(), [pod("a"), pod("b")]
    )
    assert cond(fine, "CheckpointSlow")["status"] == "False"
    assert "CheckpointSlow" not in {
        c["type"] for c in derive(finetune(with_save(12)), jobset(), [pod("a")])["conditions"]
    }


def test_on_spot_a_save_over_half_a_reclaims_15_seconds_is_slow_and_says_what_a_reclaim_costs() -> None:
    """A Spot run's trainer reports the grace a reclaim gives (15 s: render/trainer_config.py), so a
    10 s save, fine against the pods' 60 s, is slow here, in words that fit a reclaim."""
    save = {"step": 40, "seconds": 10.0, "blockedSeconds": 1.0, "writeSeconds": 9.0, "graceSeconds": 15}
    spot = {"type": "v5p", "topology": "2x2x2", "spot": True}
    status = derive(
        finetune(
            {"progress": {"lastCheckpoint": save}}, tpu=spot, training={"maxSteps": 10, "saveSteps": 50}
        ),
        jobset(),
        [pod("a"), pod("b")],
    )
    slow = cond(status, "CheckpointSlow")
    assert slow["status"] == "True" and slow["reason"] == "SaveOverHalfTheSpotGrace"
    assert "more than half the 15 s a Spot reclaim gives the pods" in slow["message"]
    assert "(up to training.saveSteps, 50)" in slow["message"] and "redoneSteps" in slow["message"]
    assert "spec.tpu.spotGracePeriodSeconds" in slow["message"]


def test_a_periodic_save_that_blocked_little_but_took_long_in_all_is_slow() -> None:
    """The save a stop makes is synchronous: the whole of a periodic save (the copy to host memory and
    the background write) is what a stop would take, not just what training waited for."""
    save = {"step": 40, "seconds": 45.0, "blockedSeconds": 2.0, "writeSeconds": 43.0, "graceSeconds": 60}
    status = derive(finetune({"progress": {"lastCheckpoint": save}}), jobset(), [pod("a"), pod("b")])
    slow = cond(status, "CheckpointSlow")
    assert slow["status"] == "True"
    assert "took 45 s in all (2.0 s copying to host memory, 43 s writing)" in slow["message"]


def test_a_slow_save_names_the_device_wait_the_staging_and_the_write_apart() -> None:
    """A periodic save first waits for the device to finish the steps the loop dispatched ahead (the
    device computes them meanwhile, so it costs training nothing): the condition still counts that
    wait, because a stop's save waits for it too within the grace period, and says which part is which
    so a long device wait is not read as a slow copy."""
    save = {
        "step": 40,
        "seconds": 33.0,
        "deviceWaitSeconds": 18.2,
        "stagingSeconds": 0.7,
        "blockedSeconds": 0.7,
        "writeSeconds": 14.1,
        "graceSeconds": 60,
    }
    status = derive(finetune({"progress": {"lastCheckpoint": save}}), jobset(), [pod("a"), pod("b")])
    slow = cond(status, "CheckpointSlow")
    assert slow["status"] == "True" and slow["reason"] == "SaveOverHalfTheGrace"
    assert (
        "took 33 s in all (18 s for the device to finish the steps dispatched before it, 0.7 s copying to"
        " host memory, 14 s writing)"
    ) in slow["message"]
    # Without the device wait the same save fits in half the grace period: judged on the whole save.
    within = {**save, "seconds": 14.8, "deviceWaitSeconds": 0.0}
    fine = derive(
        finetune({"progress": {"lastCheckpoint": within}, "conditions": status["conditions"]}),
        jobset(),
        [pod("a"), pod("b")],
    )
    assert cond(fine, "CheckpointSlow")["status"] == "False"
    assert "0.0 s for the device to finish" in cond(fine, "CheckpointSlow")["message"]


def skipped_report(resumed: int, *skipped: tuple[int, str]) -> dict[str, Any]:
    attempt: dict[str, Any] = {"startTime": at(0), "resumedFromStep": resumed, "checkpointSeconds": 0.0}
    if skipped:
        attempt["skippedCheckpoints"] = [{"step": step, "reason": reason} for step, reason in skipped]
    return {"progress": {"step": resumed, "updateTime": at(30), "attempt": attempt}}


def test_checkpoints_the_trainer_skipped_are_a_warning_condition() -> None:
    pods = [pod("a"), pod("b")]
    status = derive(
        finetune(skipped_report(4, (8, "checkpoint-8: shard __0_0.distcp is missing"))), jobset(), pods
    )
    skipped = cond(status, "CheckpointSkipped")
    assert (skipped["status"], skipped["reason"]) == ("True", "NotResumable")
    assert skipped["message"].startswith(
        "the trainer skipped checkpoint-8 (shard __0_0.distcp is missing) and resumed from step 4"
    )
    several = derive(
        finetune(
            skipped_report(
                0, (12, "checkpoint-12: incomplete (no completion marker)"), (8, "shard 3 is truncated")
            )
        ),
        jobset(),
        pods,
    )
    assert cond(several, "CheckpointSkipped")["message"].startswith(
        "the trainer skipped checkpoint-12 (incomplete (no completion marker)), checkpoint-8 (shard 3 is "
        "truncated) and started from the beginning"
    )
    # A later attempt reports none: False, once it had been True.
    cleared = derive(finetune({**skipped_report(12), "conditions": status["conditions"]}), jobset(), pods)
    assert (cond(cleared, "CheckpointSkipped")["status"], cond(cleared, "CheckpointSkipped")["reason"]) == (
        "False",
        "NoneSkipped",
    )
    assert "resumed from step 12" in cond(cleared, "CheckpointSkipped")["message"]
    never = derive(finetune(skipped_report(12)), jobset(), pods)
    assert "CheckpointSkipped" not in {c["type"] for c in never["conditions"]}
    # The status these conditions come from fits the API.
    TPUFineTuneStatus.model_validate(
        {**skipped_report(4, (8, "checkpoint-8: shard __0_0.distcp is missing")), **{"phase": "Running"}}
    )


def test_the_reconciler_asks_the_pods_and_posts_the_event_once() -> None:
    api = RecordingApi()
    annotated: list[tuple[str, dict[str, str]]] = []
    api.annotate_pod = lambda ns, name, annotations: annotated.append((name, dict(annotations)))  # type: ignore[attr-defined]
    r, _ = reconciler(api)
    events = Events()
    nodes = {"n1": node("n1", **{maintenance.SCHEDULED_LABEL: "1733083200"})}
    running = finetune({"phase": "Running", "jobSetName": "run"})
    running["metadata"]["resourceVersion"] = "5"
    pods = [on("p0", "n1"), on("p1", "n1")]
    r.reconcile(running, jobset(), pods, event=events, nodes=nodes)
    assert annotated == [(p, {"tpuft.dev/checkpoint-request": "1733083200"}) for p in ("p0", "p1")]
    assert events.posted == ["MaintenanceScheduled"]
    # The pods carry it now (the watch shows the annotation): nothing more is written or posted.
    annotated.clear()
    state = r.runs.find(KEY)
    assert state is not None and state.written is not None
    written = dict(state.written)
    written["status"] = {**running["status"], **written["status"]}  # what the merge patch left
    pods = [on("p0", "n1", "1733083200"), on("p1", "n1", "1733083200")]
    r.reconcile(written, jobset(), pods, event=events, nodes=nodes)
    assert annotated == [] and events.posted == ["MaintenanceScheduled"]
    # spec.maintenance: ignore writes no request, but still says so.
    quiet_api = RecordingApi()
    quiet_api.annotate_pod = lambda ns, name, annotations: annotated.append((name, dict(annotations)))  # type: ignore[attr-defined]
    quiet, _ = reconciler(quiet_api)
    ignoring = finetune({"phase": "Running", "jobSetName": "run"}, maintenance="ignore")
    ignoring["metadata"]["resourceVersion"] = "9"
    quiet.reconcile(ignoring, jobset(), [on("p0", "n1"), on("p1", "n1")], event=events, nodes=nodes)
    assert annotated == [] and events.posted == ["MaintenanceScheduled", "MaintenanceScheduled"]


def test_the_trainers_report_of_a_save_is_what_the_api_declares() -> None:
    """attempt.py names the parts of a save as status.progress.lastCheckpoint declares them (the API
    rejects unknown fields): the device wait, the staging, what training lost, the write, the whole."""
    from tpuft_trainer.attempt import Attempt

    attempt = Attempt(started_at=datetime(2026, 12, 6, tzinfo=UTC), grace_seconds=60)
    attempt.checkpoint_saved(
        40,
        "periodic",
        device_wait_seconds=18.2,
        staging_seconds=0.7,
        blocked_seconds=0.7,
        write_seconds=5.0,
        seconds=23.9,
    )
    reported = attempt.to_status()
    saved = TPUFineTuneStatus.model_validate({"progress": reported}).progress
    assert saved is not None and saved.last_checkpoint is not None
    last = saved.last_checkpoint
    assert (last.device_wait_seconds, last.staging_seconds, last.blocked_seconds) == (18.2, 0.7, 0.7)
    assert reported["attempt"]["checkpointSeconds"] == 0.7  # goodput's lost time: not the device wait
    (record,) = attempt.to_record()["checkpoints"]
    assert (record["device_wait_seconds"], record["staging_seconds"], record["blocked_seconds"]) == (
        18.2,
        0.7,
        0.7,
    )
