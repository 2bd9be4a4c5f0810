"""derive_status: what a TPUFineTune's status is, from what was observed. Pure.

The phase machine (one transition a line; "terminal" phases never change again):

    Failed     <- the spec is invalid (condition Valid=False names the field)
    Preparing  <- no JobSet yet and the data is not prepared: the prepare Job (spec.prepare,
                  preparing.py) runs on CPU; condition DataPrepared=False says how far it is
    Failed     <- the prepare Job failed: a user error of the trainer (exit codes 64-78, its message
                  names the field) or its retries or deadline ran out; no JobSet was ever created
    Failed     <- the prepare Job succeeded, but the plan recomputed with the model's real dimensions
                  says a host cannot hold the run (MemoryFits=False, spec.tpu.topology); no JobSet
    Suspended  <- spec.suspend is true
    Queued     <- spec.queueName is set and the JobSet is still suspended (Kueue has not admitted it,
                  or evicted it): the `Queued` condition says why, from Kueue's Workload (queueing.py)
    Pending    <- no JobSet yet, or not every pod is running (Scheduled=False says why; Created=False
                  why no JobSet can be created yet: the API failed, or the cluster's JobSet is
                  missing or too old for what tpuft renders, jobset_crd.py)
    Running    <- every pod of every slice is running
    Succeeded  <- the JobSet completed (terminal)
    Failed     <- the JobSet failed: a user error, or restarts exhausted (terminal)

A terminal phase is final only while no active JobSet contradicts it (see `is_final`): one written by
hand next to a running JobSet is derived again from what is observed.

Beside the phase, three warnings: MaintenanceScheduled (GKE announced maintenance of a node the run's
pods run on, maintenance.py), CheckpointSlow (a save took more than half the pods' grace period in
all, so a stop's save, which is synchronous, may be cut off) and CheckpointSkipped (the current
attempt found checkpoints it could not resume from: incomplete, a shard missing or truncated);
TrainerStackVerified=False from the spec alone, for a backend the trainer's stack is unverified with
(trainer_stack.py); and status.goodput (goodput.py).

It reads only its input, so a restarted operator derives the same status from the same cluster,
and it never writes `status.progress` (the trainer owns that field).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from tpuft_operator import goodput, maintenance, preparing, queueing, trainer_stack
from tpuft_operator.api.models import TERMINAL_PHASES, Phase
from tpuft_operator.preparing import DATA_PREPARED, PrepareSeen, Stage
from tpuft_trainer.exit_codes import ExitCode, is_user_error

Obj = Mapping[str, Any]


@dataclass(frozen=True)
class Observed:
    """Everything derive_status may look at."""

    finetune: Obj
    jobset: Obj | None
    pods: Sequence[Obj] = ()
    # From validation/rendering: ("spec.tpu.topology", "reason") when the spec cannot run.
    spec_error: tuple[str, str] | None = None
    # A retryable API error while creating the run's objects (e.g. the JobSet webhook is down).
    creation_error: str | None = None
    # (reason, message) when no JobSet may be created yet: the cluster's JobSet is not installed or
    # too old for what tpuft renders (jobset_crd.py).
    jobset_shortfall: tuple[str, str] | None = None
    # An object this run needs exists under another run's control (k8s.NameTaken): the run fails.
    name_taken: str | None = None
    # The apiserver refused pods of the run's Jobs (the Job controller's FailedCreate event) or the
    # Jobs themselves (the JobSet controller's JobCreationFailed): PodSecurity, ResourceQuota, a
    # webhook. Who could not create what, then the apiserver's words; None while nothing is refused.
    pods_refused: str | None = None
    # Kueue's Workload of the JobSet (queueing.slim_workload), for a run with spec.queueName.
    workload: Obj | None = None
    # The run's data preparation (preparing.py): None when spec.prepare.enabled is false or the spec
    # does not render.
    prepare: PrepareSeen | None = None
    # The apiserver refused the run's prepare Job (a quota on Jobs, a webhook): its words.
    prepare_refused: str | None = None
    chips: int | None = None
    hosts: int | None = None
    accelerator: str | None = None
    topology: str | None = None
    # The nodes the run's pods run on, by name (as maintenance.slim_node keeps them).
    nodes: Mapping[str, Obj] = field(default_factory=dict)
    # Least report time between two refreshes of status.goodput (goodput.py).
    goodput_interval: float = 60.0
    now: datetime = field(default_factory=lambda: datetime.now(UTC))


def global_batch(spec: Obj, chips: int) -> int:
    """Sequences per optimizer step: the batch of a chip, times the chips the batch is split over
    (every axis but tensor), times the micro-batches accumulated into one step. Defaults as the API's."""
    training = spec.get("training") or {}
    mesh = (spec.get("fsdp") or {}).get("mesh") or {}
    per_chip = int(training.get("perDeviceBatchSize", 8))
    accumulation = int(training.get("gradientAccumulationSteps", 1))
    return per_chip * (chips // int(mesh.get("tensor", 1) or 1)) * accumulation


def _condition(obj: Obj | None, type_: str) -> Obj | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return None


def _is_true(obj: Obj | None, type_: str) -> bool:
    cond = _condition(obj, type_)
    return bool(cond and cond.get("status") == "True")


def _jobset_finished(jobset: Obj) -> bool:
    return _is_true(jobset, "Completed") or _is_true(jobset, "Failed")


def is_final(finetune: Obj, jobset: Obj | None) -> bool:
    """Whether the run's terminal phase stands: nothing is recreated and the status stays as first
    derived. The operator writes a terminal phase only once the JobSet finished (or, for an invalid
    spec, without one), so a terminal phase next to a JobSet that has not finished was written by
    someone else (`kubectl patch --subresource=status`): believing it would freeze a run whose TPUs
    are still busy, so the status is derived again from the cluster instead."""
    phase = (finetune.get("status") or {}).get("phase")
    return phase in TERMINAL_PHASES and (jobset is None or _jobset_finished(jobset))


def _timestamp(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _pod_running(pod: Obj) -> bool:
    """Running and ready, or already finished well: a host that succeeded before the JobSet's
    Completed condition arrives must not turn a running run back into Pending."""
    phase = (pod.get("status") or {}).get("phase")
    return (phase == "Running" and _is_true(pod, "Ready")) or phase == "Succeeded"


JOBSET_UID_LABEL = "jobset.sigs.k8s.io/jobset-uid"
RESTART_ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
# On a JobSet the operator recreated (someone deleted the run's earlier one): status.restarts as it
# stood then, so the run's count is the earlier JobSets' restarts plus this one's.
EARLIER_RESTARTS_ANNOTATION = "tpuft.dev/earlier-restarts"


def earlier_restarts(jobset: Obj) -> int:
    """The restarts of the run's JobSets before ``jobset`` (0 for its first JobSet)."""
    value = str(
        ((jobset.get("metadata") or {}).get("annotations") or {}).get(EARLIER_RESTARTS_ANNOTATION, "")
    )
    return int(value) if value.isdigit() else 0


def current_pods(pods: Sequence[Obj], jobset: Obj | None) -> list[Obj]:
    """The pods of the JobSet's current attempt: not of a deleted (and recreated) JobSet, not of an
    earlier restart, not being deleted. Those linger for seconds and would make a restarted or
    recreated run look Running before its new pods are. Labels absent (not made by JobSet): kept."""
    if jobset is None:
        return list(pods)
    uid = (jobset.get("metadata") or {}).get("uid")
    attempt = int((jobset.get("status") or {}).get("restarts") or 0)
    kept = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if meta.get("deletionTimestamp") or preparing.is_prepare_pod(pod):
            continue
        if uid and labels.get(JOBSET_UID_LABEL, uid) != uid:
            continue
        # A newer attempt than the JobSet we hold is fine (our copy of the JobSet may lag).
        pod_attempt = labels.get(RESTART_ATTEMPT_LABEL)
        if pod_attempt is not None and pod_attempt.isdigit() and int(pod_attempt) < attempt:
            continue
        kept.append(pod)
    return kept


def _unschedulable_message(pods: Sequence[Obj]) -> str | None:
    for pod in pods:
        cond = _condition(pod, "PodScheduled")
        if cond and cond.get("status") == "False" and cond.get("reason") == "Unschedulable":
            return str(cond.get("message") or "unschedulable")
    return None


def _terminated_exit(pods: Sequence[Obj]) -> tuple[str, int] | None:
    """(pod name, exit code) of the first trainer container that failed, preferring user errors."""
    failures = []
    for pod in pods:
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (status.get("state") or {}).get("terminated")
            if terminated and terminated.get("exitCode"):
                failures.append((pod["metadata"]["name"], int(terminated["exitCode"])))
    failures.sort(key=lambda failure: not is_user_error(failure[1]))
    return failures[0] if failures else None


def _describe_exit(code: int) -> str:
    try:
        name = ExitCode(code).name
    except ValueError:
        return f"exit code {code}"
    return f"exit code {code} ({name})"


@dataclass
class _Derived:
    phase: str
    reason: str
    message: str
    conditions: dict[str, tuple[str, str, str]] = field(default_factory=dict)  # type -> (status, reason, msg)


def _derive_phase(obs: Observed) -> _Derived:
    spec = obs.finetune.get("spec") or {}
    previous_phase = (obs.finetune.get("status") or {}).get("phase")
    if obs.spec_error is not None:
        path, reason = obs.spec_error
        message = f"{path}: {reason}"
        return _Derived(Phase.FAILED, "InvalidSpec", message, {"Valid": ("False", "InvalidSpec", message)})
    valid = {"Valid": ("True", "SpecValid", "the spec renders to a JobSet")}
    if not ((spec.get("prepare") or {}).get("enabled", True)):
        valid[DATA_PREPARED] = ("False", "OnTpuHosts", ON_TPU_HOSTS_MESSAGE)
    if obs.name_taken is not None and not is_final(obs.finetune, None):
        message = (
            f"name taken: {obs.name_taken}; nothing of it was touched. Rename this TPUFineTune "
            "(the name of its JobSet derives from it)"
        )
        return _Derived(
            Phase.FAILED, "NameTaken", message, {**valid, "Failed": ("True", "NameTaken", message)}
        )
    if is_final(obs.finetune, obs.jobset):
        # Final means final: the phase, message and conditions of a finished run stay as first derived,
        # even when its JobSet or pods are gone later (deleted by someone, GC, namespace deletion) and
        # the exit code that explained a failure can no longer be seen.
        status = obs.finetune.get("status") or {}
        return _Derived(str(previous_phase), "Finished", status.get("message") or "", {})
    jobset = obs.jobset
    prepare = obs.prepare
    if prepare is not None and not preparing.is_prepared(obs.finetune, prepare.settings_hash):
        state = prepare.state()
        if state.stage is Stage.SUCCEEDED:
            reused = state.summary is not None and state.summary.reused
            valid[DATA_PREPARED] = ("True", "Reused" if reused else "Prepared", state.message)
            verdict = preparing.memory_verdict(obs.finetune, state.summary)
            if verdict is not None:
                valid[preparing.MEMORY_FITS] = preparing.memory_condition(verdict)
            if jobset is None and verdict is not None and verdict.host_refusal is not None:
                # As validation refuses the catalog's models: the spec cannot run on its topology.
                message = preparing.host_refusal_message(verdict)
                reason = preparing.HOST_RAM_EXCEEDED
                return _Derived(
                    Phase.FAILED,
                    reason,
                    message,
                    {
                        **valid,
                        "Valid": ("False", "InvalidSpec", message),
                        "Failed": ("True", reason, message),
                    },
                )
        elif jobset is None and state.stage is Stage.FAILED:
            failed = ("False", state.reason, state.message)
            return _Derived(
                Phase.FAILED,
                state.reason,
                state.message,
                {**valid, DATA_PREPARED: failed, "Failed": ("True", state.reason, state.message)},
            )
        elif jobset is None and obs.prepare_refused is not None and state.stage is Stage.ABSENT:
            return _prepare_refused(
                f"the operator cannot create the run's prepare Job, retrying: {obs.prepare_refused}", valid
            )
        elif jobset is None and obs.pods_refused is not None:
            # the prepare pod, refused (PodSecurity, a quota, a webhook)
            return _prepare_refused(obs.pods_refused, valid)
        elif jobset is None:
            return _Derived(
                Phase.PREPARING,
                "Preparing",
                state.message,
                {**valid, DATA_PREPARED: ("False", "Preparing", state.message)},
            )
        # (A JobSet made before reads the data it was rendered with: nothing to say then.)
    if jobset is None:
        if obs.jobset_shortfall is not None:
            reason, message = obs.jobset_shortfall
            message = f"waiting for the cluster's JobSet: {message}"
            return _Derived(Phase.PENDING, reason, message, {**valid, "Created": ("False", reason, message)})
        if obs.creation_error is not None:
            message = f"creating the JobSet failed, retrying: {obs.creation_error}"
            return _Derived(
                Phase.PENDING, "CreateFailed", message, {**valid, "Created": ("False", "ApiError", message)}
            )
        if (obs.finetune.get("status") or {}).get("jobSetName"):
            return _Derived(Phase.PENDING, "JobSetMissing", "the JobSet was deleted; recreating it", valid)
        return _Derived(Phase.PENDING, "Creating", "creating the JobSet", valid)
    if _is_true(jobset, "Completed"):
        return _Derived(
            Phase.SUCCEEDED,
            "Completed",
            "training finished",
            {**valid, "Complete": ("True", "Completed", "training finished")},
        )
    if _is_true(jobset, "Failed"):
        cond = _condition(jobset, "Failed") or {}
        failure = _terminated_exit(current_pods(obs.pods, jobset))
        if failure and is_user_error(failure[1]):
            pod, code = failure
            message = (
                f"the trainer failed with a user error, {_describe_exit(code)} on pod {pod}; not retried "
                "(fix the spec or the data and recreate the TPUFineTune)"
            )
            reason = "UserError"
        else:
            restarts = (jobset.get("status") or {}).get("restarts", 0)
            message = (
                f"the JobSet failed after {restarts} restart(s): {cond.get('message') or cond.get('reason')}"
            )
            reason = str(cond.get("reason") or "JobSetFailed")
        return _Derived(Phase.FAILED, reason, message, {**valid, "Failed": ("True", reason, message)})
    jobset_suspended = bool((jobset.get("spec") or {}).get("suspend"))
    if spec.get("suspend"):
        message = "suspended by spec.suspend; set it to false to resume"
        return _Derived(
            Phase.SUSPENDED, "Suspended", message, {**valid, "Suspended": ("True", "SpecSuspend", message)}
        )
    queue = queueing.queue_state(obs.workload, str(spec["queueName"])) if spec.get("queueName") else None
    if jobset_suspended and queue is not None:
        message = queue.message
        if not queue.waiting:  # admitted: Kueue unsuspends the JobSet next
            message = f"{queue.message}; waiting for Kueue to unsuspend the JobSet"
        return _Derived(
            Phase.QUEUED,
            "Queued",
            message,
            {
                **valid,
                "Suspended": ("True", "Queued", message),
                "Queued": ("True" if queue.waiting else "False", queue.reason, queue.message),
            },
        )
    not_suspended: dict[str, tuple[str, str, str]] = {"Suspended": ("False", "Resumed", "not suspended")}
    if queue is not None:
        # Unsuspended with a queue: Kueue admitted it (its Workload may not have reached us yet).
        admitted = queue if not queue.waiting else queueing.QueueState(False, "Admitted", "admitted by Kueue")
        not_suspended["Queued"] = ("False", admitted.reason, admitted.message)
    expected = obs.hosts or 0
    pods = current_pods(obs.pods, jobset)
    running = [pod for pod in pods if _pod_running(pod)]
    if expected and len(running) >= expected:
        message = f"{len(running)}/{expected} TPU hosts running"
        return _Derived(
            Phase.RUNNING,
            "Running",
            message,
            {
                **valid,
                **not_suspended,
                "Scheduled": ("True", "Scheduled", message),
                "Running": ("True", "Running", message),
            },
        )
    if obs.pods_refused is not None:
        message = obs.pods_refused
        return _Derived(
            Phase.PENDING,
            "FailedCreate",
            message,
            {**valid, **not_suspended, "ReplicaFailure": ("True", "FailedCreate", message)},
        )
    unschedulable = _unschedulable_message(pods)
    if unschedulable:
        message = (
            f"no node pool can take the TPU pods: they need nodes with "
            f"cloud.google.com/gke-tpu-accelerator={obs.accelerator} and "
            f"cloud.google.com/gke-tpu-topology={obs.topology} (one node pool per slice) with free "
            f"google.com/tpu chips; the scheduler says: {unschedulable}"
        )
        return _Derived(
            Phase.PENDING,
            "Unschedulable",
            message,
            {**valid, **not_suspended, "Scheduled": ("False", "Unschedulable", message)},
        )
    message = f"{len(running)}/{expected} TPU hosts running"
    return _Derived(Phase.PENDING, "Starting", message, {**valid, **not_suspended})


ON_TPU_HOSTS_MESSAGE = (
    "spec.prepare.enabled is false: each TPU host prepares the data when it starts (on the TPUs' time)"
)


def _data(obs: Observed, previous: Obj, chips: int | None) -> dict[str, Any] | bool | None:
    """status.data: new figures (the prepare Job succeeded for figures not yet written), None to remove
    figures of other data settings, or False to leave it as it is."""
    prepare = obs.prepare
    if prepare is None:
        return False
    before = previous.get("data") or {}
    if before.get("settingsHash") == prepare.settings_hash:
        return False  # written once: the Job (or its pod) may be gone later
    state = prepare.state()
    if state.stage is Stage.SUCCEEDED:
        spec = obs.finetune.get("spec") or {}
        return preparing.data_status(
            state.summary,
            prepare.settings_hash,
            global_batch=global_batch(spec, chips) if chips else None,
            max_steps=(spec.get("training") or {}).get("maxSteps"),
            verdict=preparing.memory_verdict(obs.finetune, state.summary),
        )
    return None if before else False


def _skipped_message(skipped: Sequence[Obj], resumed: Any) -> str:
    """E.g. the trainer skipped checkpoint-8 (shard __0_0.distcp is missing) and resumed from step 4."""
    named = []
    for entry in skipped:
        name = f"checkpoint-{entry.get('step')}"
        reason = str(entry.get("reason") or "not resumable")
        reason = reason.removeprefix(f"{name}:").strip() or "not resumable"  # the trainer names it too
        named.append(f"{name} ({reason})")
    return (
        f"the trainer skipped {', '.join(named)} and {_resumed(resumed)}: the steps after that are trained "
        "again. A save cut off by SIGKILL leaves an incomplete checkpoint; a missing or truncated shard "
        "of a complete one points at the output storage"
    )


def _resumed(step: Any) -> str:
    if isinstance(step, int) and step > 0:
        return f"resumed from step {step}"
    if step == 0:
        return "started from the beginning"
    return "resumed from an older checkpoint"


def _save_parts(save: Obj) -> str:
    """ " (the parts of a save)" for condition CheckpointSlow's message, from what the trainer reported:
    the device wait, the staging copy and the write (an earlier trainer reported the first two as
    one, blockedSeconds), or nothing."""

    def number(key: str) -> float | None:
        value = save.get(key)
        return float(value) if isinstance(value, (int, float)) else None

    device, staging, write = number("deviceWaitSeconds"), number("stagingSeconds"), number("writeSeconds")
    blocked = number("blockedSeconds")
    if device is not None and staging is not None and write is not None:
        return (
            f" ({_seconds(device)} s for the device to finish the steps dispatched before it,"
            f" {_seconds(staging)} s copying to host memory, {_seconds(write)} s writing)"
        )
    if blocked is not None and write is not None:
        return f" ({_seconds(blocked)} s copying to host memory, {_seconds(write)} s writing)"
    return ""


def _seconds(value: float) -> str:
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


def _warnings(obs: Observed, previous: Obj) -> dict[str, tuple[str, str, str]]:
    """MaintenanceScheduled, CheckpointSlow and CheckpointSkipped: True while they hold; False once
    they stop holding (only if they were True: a run that never had maintenance carries no such
    condition)."""
    was_true = {c.get("type") for c in previous.get("conditions") or [] if c.get("status") == "True"}
    wanted: dict[str, tuple[str, str, str]] = {}
    found = maintenance.for_run(current_pods(obs.pods, obs.jobset), obs.nodes)
    policy = str((obs.finetune.get("spec") or {}).get("maintenance") or "checkpoint")
    if found is not None:
        wanted["MaintenanceScheduled"] = ("True", found.reason, found.message(policy))
    elif "MaintenanceScheduled" in was_true:
        wanted["MaintenanceScheduled"] = (
            "False",
            "NoMaintenance",
            "no maintenance announced for the run's nodes",
        )
    created = _condition(obs.finetune, "Created")
    if obs.jobset is not None and created is not None and created.get("status") == "False":
        # Why creating it failed (ApiError, JobSetTooOld, ...) is over once the JobSet exists.
        name = obs.jobset["metadata"]["name"]
        wanted["Created"] = ("True", "JobSetCreated", f"created JobSet {name}")
    if obs.pods_refused is None and obs.prepare_refused is None and "ReplicaFailure" in was_true:
        wanted["ReplicaFailure"] = ("False", "PodsCreated", "the apiserver accepts the run's pods")
    progress = previous.get("progress") or {}
    save = progress.get("lastCheckpoint") or {}
    # The whole save, not just what it cost training: a periodic save writes in the background and
    # waits for the device to finish its dispatched steps while the device computes them, but a
    # stop's save is synchronous and takes all of it (the device wait too) within the grace period.
    seconds, grace = save.get("seconds"), save.get("graceSeconds")
    if isinstance(seconds, (int, float)) and isinstance(grace, (int, float)) and grace > 0:
        split = _save_parts(save)
        tpu = (obs.finetune.get("spec") or {}).get("tpu") or {}
        if seconds > grace / 2 and tpu.get("spot"):
            save_steps = ((obs.finetune.get("spec") or {}).get("training") or {}).get("saveSteps")
            wanted["CheckpointSlow"] = (
                "True",
                "SaveOverHalfTheSpotGrace",
                f"saving checkpoint-{save.get('step')} took {seconds:.0f} s in all{split}, more than half the "
                f"{grace:.0f} s a Spot reclaim gives the pods (GKE: ~15 s of the VM's 30 s notice, whatever "
                "terminationGracePeriodSeconds says): a reclaim's save is synchronous, so it is likely cut off and "
                f"the steps since the last complete checkpoint (up to training.saveSteps, {save_steps}) are "
                "trained again (status.goodput.redoneSteps); lower training.saveSteps to bound that, or give the "
                "node pool more shutdown time (node system config, GKE 1.35.0-gke.1171000+, up to 120 s) and "
                "set spec.tpu.spotGracePeriodSeconds",
            )
        elif seconds > grace / 2:
            wanted["CheckpointSlow"] = (
                "True",
                "SaveOverHalfTheGrace",
                f"saving checkpoint-{save.get('step')} took {seconds:.0f} s in all{split}, more than half the "
                f"{grace:.0f} s grace period after SIGTERM: a stop's save is synchronous, so it takes about as "
                "long and may be cut off by SIGKILL (and lose the steps since the last complete checkpoint); "
                "raise spec.terminationGracePeriodSeconds",
            )
        elif "CheckpointSlow" in was_true:
            wanted["CheckpointSlow"] = (
                "False",
                "SaveWithinTheGrace",
                f"saving checkpoint-{save.get('step')} took {seconds:.0f} s in all{split} of the {grace:.0f} s "
                "grace period",
            )
    attempt = progress.get("attempt") or {}
    skipped = [s for s in attempt.get("skippedCheckpoints") or [] if isinstance(s, Mapping)]
    if skipped:
        wanted["CheckpointSkipped"] = (
            "True",
            "NotResumable",
            _skipped_message(skipped, attempt.get("resumedFromStep")),
        )
    elif attempt and "CheckpointSkipped" in was_true:
        wanted["CheckpointSkipped"] = (
            "False",
            "NoneSkipped",
            f"the current attempt skipped no checkpoint and {_resumed(attempt.get('resumedFromStep'))}",
        )
    return wanted


def _pod_start(pods: Sequence[Obj]) -> datetime | None:
    starts = [goodput.parse_time((p.get("status") or {}).get("startTime")) for p in pods]
    known = [s for s in starts if s is not None]
    return min(known) if known else None


def _merge_conditions(
    previous: Sequence[Obj], wanted: Mapping[str, tuple[str, str, str]], generation: int | None, now: datetime
) -> list[dict[str, Any]]:
    """Standard conditions; lastTransitionTime moves only when a condition's status changes."""
    by_type = {c.get("type"): c for c in previous}
    merged = []
    for type_, (status, reason, message) in sorted(wanted.items()):
        old = by_type.get(type_)
        changed = old is None or old.get("status") != status
        merged.append(
            {
                "type": type_,
                "status": status,
                "reason": reason,
                "message": message,
                "observedGeneration": generation,
                "lastTransitionTime": _timestamp(now) if changed else old["lastTransitionTime"],  # type: ignore[index]
            }
        )
    # Conditions we no longer assert keep their last value (e.g. Running=True after success).
    merged += [dict(c) for t, c in by_type.items() if t not in wanted]
    # One order (by type) whatever is asserted now: a re-derived finished run, which asserts nothing,
    # must compare equal to what was written, or every later event would patch a reordered list.
    return sorted(merged, key=lambda c: str(c.get("type")))


def derive_status(obs: Observed) -> dict[str, Any]:
    """The operator-owned part of `status` (camelCase, ready to merge-patch). Never `progress`."""
    previous: Obj = obs.finetune.get("status") or {}
    metadata = obs.finetune.get("metadata") or {}
    derived = _derive_phase(obs)
    if derived.reason != "Finished":  # a finished run's conditions stay as they were
        derived.conditions.update(_warnings(obs, previous))
        # Derived from the spec alone (trainer_stack.py): TrainerStackVerified=False for backend native.
        derived.conditions.update(trainer_stack.condition(obs.finetune.get("spec") or {}))
    jobset_status: Obj = (obs.jobset or {}).get("status") or {}
    status: dict[str, Any] = {
        "phase": derived.phase,
        "message": derived.message,
        "observedGeneration": metadata.get("generation"),
        "conditions": _merge_conditions(
            previous.get("conditions") or [], derived.conditions, metadata.get("generation"), obs.now
        ),
    }
    if obs.chips is not None:
        status["chips"] = obs.chips
        status["globalBatch"] = global_batch((obs.finetune.get("spec") or {}), obs.chips)
    if obs.hosts is not None:
        status["hosts"] = obs.hosts
    data = _data(obs, previous, obs.chips) if derived.reason != "Finished" else False
    if data is not False:
        status["data"] = data
    if obs.jobset is not None:
        status["jobSetName"] = obs.jobset["metadata"]["name"]
        # The larger: a count raised by hand sticks. Found by the fault suite: with the JobSet's own
        # count alone, a run whose JobSet was recreated did not count its next restarts until the
        # new JobSet's count caught up with the old one (nor a wiped status the earlier ones).
        status["restarts"] = max(
            earlier_restarts(obs.jobset) + int(jobset_status.get("restarts") or 0),
            int(previous.get("restarts") or 0),
        )
        status["restartsCounted"] = int(jobset_status.get("restartsCountTowardsMax") or 0)
    elif previous.get("jobSetName"):
        status["jobSetName"] = previous["jobSetName"]
        status["restarts"] = previous.get("restarts", 0)
        if previous.get("restartsCounted") is not None:
            status["restartsCounted"] = previous["restartsCounted"]
    start = previous.get("startTime")
    if start is None and derived.phase in {Phase.RUNNING, Phase.SUCCEEDED}:
        start = _timestamp(obs.now)
    if start is not None:
        status["startTime"] = start
    completion = previous.get("completionTime")
    if derived.phase in TERMINAL_PHASES and completion is None:
        completion = _timestamp(obs.now)
    if completion is not None and derived.phase in TERMINAL_PHASES:
        status["completionTime"] = completion
    elif completion is not None:
        status["completionTime"] = None  # a hand-set terminal phase was overruled; merge-patch null deletes
    figures = goodput.derive_goodput(
        previous.get("goodput"),
        previous.get("progress"),
        created=goodput.parse_time(metadata.get("creationTimestamp")),
        pod_start=_pod_start(current_pods(obs.pods, obs.jobset)),
        phase=derived.phase,
        phase_changed=derived.phase != previous.get("phase"),
        completed=goodput.parse_time(status.get("completionTime")),
        interval=obs.goodput_interval,
    )
    if figures is not None:
        status["goodput"] = figures
    return status


def status_patch(current: Obj, derived: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch that brings `current` status to `derived`, or None when nothing changed."""
    changes = {key: value for key, value in derived.items() if current.get(key) != value}
    return changes or None


def _prepare_refused(message: str, valid: dict[str, Any]) -> _Derived:
    """Preparing, with the apiserver's refusal of the prepare Job or its pod said (and retried)."""
    return _Derived(
        Phase.PREPARING,
        "FailedCreate",
        message,
        {
            **valid,
            DATA_PREPARED: ("False", "Preparing", message),
            "ReplicaFailure": ("True", "FailedCreate", message),
        },
    )
