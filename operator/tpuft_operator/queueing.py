"""Why a queued run waits: Kueue's Workload of the run's JobSet, read as a `Queued` condition. Pure.

Kueue (sigs.k8s.io/kueue, v1beta2 API) makes one Workload per JobSet that carries the
`kueue.x-k8s.io/queue-name` label, owned by the JobSet, with one pod set per replicated job: a
multislice run is admitted whole or not at all. Its conditions say where it stands:

    QuotaReserved=False  not admitted; reason and message say why (Kueue's own words): the
                         LocalQueue or ClusterQueue does not exist or is stopped, no flavor fits,
                         not enough unused quota ("insufficient unused quota for google.com/tpu in
                         flavor v5p, 8 more needed")
    QuotaReserved=True, Admitted=False
                         quota is held, admission checks are not all Ready yet (on GKE: the
                         ProvisioningRequest of a queued or flex-start node pool)
    Admitted=True        admitted: Kueue unsuspends the JobSet
    Evicted=True         evicted (Preempted by a higher-priority workload, its ClusterQueue
                         stopped, ...): Kueue suspends the JobSet and queues it again; the condition
                         stays True until quota is reserved again
    Finished=True        the JobSet finished

`queue_state` maps that to the reason and message of the run's `Queued` condition; `status.py`
puts it in the status, `reconcile.py` posts the Events of its transitions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tpuft_operator.api.resources import JOBSET

Obj = Mapping[str, Any]

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Kueue's WorkloadPriorityClass of a workload (a label on the job: the JobSet).
PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"
# How the message of a run that Kueue evicted (and queued again) begins.
EVICTED_PREFIX = "evicted by Kueue"


@dataclass(frozen=True)
class QueueState:
    """What the `Queued` condition says: True while the run waits for Kueue, False once admitted."""

    waiting: bool
    reason: str
    message: str
    # The eviction that sent an admitted run back to the queue, while it waits again (else None).
    evicted: str | None = None
    cluster_queue: str | None = None


def _condition(workload: Obj, type_: str) -> Obj | None:
    for cond in (workload.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return None


def _true(workload: Obj, type_: str) -> bool:
    cond = _condition(workload, type_)
    return bool(cond and cond.get("status") == "True")


_MISSING = re.compile(r"\b(LocalQueue|ClusterQueue) (\S+) doesn't exist")
_INACTIVE = re.compile(r"\b(LocalQueue|ClusterQueue) (\S+) is (inactive|stopped)")


def _pending_reason(reason: str, message: str) -> str:
    """Our reason for a QuotaReserved=False workload: Kueue's granular reasons where it gives them
    (UnadmittedWorkloadsObservability), else told apart by its message, as its older reasons
    (Pending, Inadmissible) cover every case."""
    missing = _MISSING.search(message)
    if missing:
        return f"{missing[1]}Missing"
    inactive = _INACTIVE.search(message)
    if inactive:
        return f"{inactive[1]}Inactive"
    if reason in {
        "ExceedsMaxQuota",
        "NoMatchingFlavor",
        "TopologyPlacementFailed",
        "WaitingForPreemptedWorkloads",
    }:
        return reason
    lowered = message.lower()
    if "insufficient" in lowered or "quota" in lowered or reason == "WaitingForQuota":
        return "InsufficientQuota"
    if "flavor" in lowered and (
        "doesn't match" in lowered or "no flavor" in lowered or "untolerated" in lowered
    ):
        return "NoMatchingFlavor"
    return "Pending"


def _checks(workload: Obj) -> list[str]:
    """The admission checks that are not Ready, as "name (State: message)"."""
    waiting = []
    for check in (workload.get("status") or {}).get("admissionChecks") or []:
        if check.get("state") != "Ready":
            detail = f"{check.get('state') or 'Pending'}" + (
                f": {check['message']}" if check.get("message") else ""
            )
            waiting.append(f"{check.get('name')} ({detail})")
    return waiting


def _eviction(workload: Obj) -> str | None:
    evicted = _condition(workload, "Evicted")
    if not evicted or evicted.get("status") != "True":
        return None
    preempted = _condition(workload, "Preempted")
    reason = str(evicted.get("reason") or "Evicted")
    message = str(evicted.get("message") or "")
    if preempted and preempted.get("status") == "True" and preempted.get("message"):
        message = str(preempted["message"])
    return f"{reason}: {message}" if message else reason


def queue_state(workload: Obj | None, queue_name: str) -> QueueState:
    """The `Queued` condition of a run in queue ``queue_name`` whose JobSet has ``workload``
    (None: Kueue has made none yet, or is not installed, or does not manage JobSets)."""
    if workload is None:
        return QueueState(
            True,
            "WaitingForWorkload",
            f"waiting for Kueue to admit it from LocalQueue {queue_name}; Kueue has made no Workload for "
            "the JobSet yet (if this lasts: is Kueue installed, with the jobset.x-k8s.io/jobset integration?)",
        )
    admission = (workload.get("status") or {}).get("admission") or {}
    cluster_queue = admission.get("clusterQueue")
    if _true(workload, "Finished"):
        return QueueState(False, "Finished", "Kueue's workload finished", cluster_queue=cluster_queue)
    if _true(workload, "Admitted"):
        return QueueState(
            False,
            "Admitted",
            f"admitted by Kueue to ClusterQueue {cluster_queue} from LocalQueue {queue_name}",
            cluster_queue=cluster_queue,
        )
    evicted = _eviction(workload)
    again = f"{EVICTED_PREFIX} ({evicted}) and queued again; " if evicted else ""
    if _true(workload, "QuotaReserved"):
        checks = _checks(workload)
        waiting_on = "; ".join(checks) if checks else "admission checks"
        return QueueState(
            True,
            "WaitingForAdmissionChecks",
            f"{again}quota reserved in ClusterQueue {cluster_queue}; waiting for its admission checks "
            f"(e.g. capacity provisioning) to be Ready: {waiting_on}",
            evicted=evicted,
            cluster_queue=cluster_queue,
        )
    if deactivated_by_kueue(workload):
        name = (workload.get("metadata") or {}).get("name")
        return QueueState(
            True,
            "DeactivatedByKueue",
            f"Kueue deactivated its Workload {name} ({evicted}): it admits it no more; set the Workload's "
            "spec.active to true to queue it again, or delete the TPUFineTune",
            evicted=evicted,
        )
    if not (workload.get("spec") or {}).get("active", True):
        return QueueState(
            True,
            "Deactivated",
            f"{again}Kueue's workload is deactivated (spec.active=false): Kueue will not admit it until "
            "it is active again",
            evicted=evicted,
        )
    reserved = _condition(workload, "QuotaReserved")
    if reserved is None:
        return QueueState(
            True,
            "Evicted" if evicted else "PendingEvaluation",
            f"{again}waiting for Kueue to consider it in LocalQueue {queue_name}",
            evicted=evicted,
        )
    kueue_reason = str(reserved.get("reason") or "Pending")
    kueue_message = str(reserved.get("message") or kueue_reason)
    reason = _pending_reason(kueue_reason, kueue_message)
    return QueueState(
        True,
        reason,
        f"{again}not admitted by Kueue from LocalQueue {queue_name}: {kueue_message}",
        evicted=evicted,
    )


def deactivated_by_kueue(workload: Obj) -> bool:
    """Kueue itself set spec.active=false (requeuing limit, maximum execution time): its Evicted
    reason is "DeactivatedDueTo<cause>", where a deactivation by someone else is "Deactivated"."""
    evicted = _condition(workload, "Evicted")
    return bool(
        evicted
        and evicted.get("status") == "True"
        and str(evicted.get("reason", "")).startswith("DeactivatedDueTo")
    )


def workload_owner(workload: Obj) -> tuple[str, str] | None:
    """(name, uid) of the JobSet that owns ``workload``, if a JobSet does."""
    for ref in (workload.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == JOBSET.kind and str(ref.get("apiVersion", "")).startswith(f"{JOBSET.group}/"):
            return str(ref.get("name")), str(ref.get("uid"))
    return None


def workload_of(workloads: Sequence[Obj], jobset: Obj | None) -> Obj | None:
    """The workload of this JobSet (by owner uid) among those indexed under its name: a recreated
    JobSet's predecessor may still have one."""
    if jobset is None:
        return None
    uid = (jobset.get("metadata") or {}).get("uid")
    for workload in workloads:
        owner = workload_owner(workload)
        if owner is not None and (uid is None or owner[1] == uid):
            return workload
    return None


def slim_workload(body: Obj) -> dict[str, Any]:
    """What `queue_state` and the handlers read of a Workload (its pod sets are large)."""
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    spec = body.get("spec") or {}
    return {
        "metadata": {
            **{k: meta[k] for k in ("name", "namespace", "uid") if k in meta},
            "ownerReferences": [
                {k: ref.get(k) for k in ("apiVersion", "kind", "name", "uid")}
                for ref in meta.get("ownerReferences") or []
            ],
        },
        "spec": {k: spec[k] for k in ("queueName", "active", "priority", "priorityClassRef") if k in spec},
        "status": {
            "conditions": [
                {k: c.get(k) for k in ("type", "status", "reason", "message")}
                for c in status.get("conditions") or []
            ],
            **(
                {"admission": {"clusterQueue": status["admission"].get("clusterQueue")}}
                if status.get("admission")
                else {}
            ),
            **(
                {
                    "admissionChecks": [
                        {k: c.get(k) for k in ("name", "state", "message")} for c in status["admissionChecks"]
                    ]
                }
                if status.get("admissionChecks")
                else {}
            ),
        },
    }
