"""Objects reduced to what the reconcile reads of them (status.py, reconcile.py).

The operator keeps the latest TPUFineTune, JobSet and pods of every run in memory (the handlers'
indexes; the reconciler's JobSet of record). Full bodies (managedFields, last-applied annotations,
pod specs, the JobSet's pod template with its trainer config) cost tens of KB per run at scale.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tpuft_operator.render.jobset import KUEUE_PRIORITY_CLASS_LABEL
from tpuft_operator.render.prepare_job import COMPONENT_LABEL, JOB_UID_LABEL
from tpuft_operator.status import EARLIER_RESTARTS_ANNOTATION, JOBSET_UID_LABEL, RESTART_ATTEMPT_LABEL
from tpuft_trainer.pod_contract import CHECKPOINT_REQUEST_ANNOTATION


def slim_finetune(body: Mapping[str, Any]) -> dict[str, Any]:
    meta = body.get("metadata") or {}
    keep = (
        "name",
        "namespace",
        "uid",
        "generation",
        "resourceVersion",
        "deletionTimestamp",
        "creationTimestamp",
    )
    # The one label the render reads: Kueue's WorkloadPriorityClass, copied to the JobSet.
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if k == KUEUE_PRIORITY_CLASS_LABEL}
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": {k: meta[k] for k in keep if k in meta} | ({"labels": labels} if labels else {}),
        "spec": body.get("spec") or {},
        "status": body.get("status") or {},
    }


def slim_jobset(body: Mapping[str, Any]) -> dict[str, Any]:
    meta = body.get("metadata") or {}
    # Its controller: the one run that may act on it (k8s.controller_uid).
    owners = [r for r in meta.get("ownerReferences") or [] if r.get("controller")]
    earlier = (meta.get("annotations") or {}).get(EARLIER_RESTARTS_ANNOTATION)
    return {
        "metadata": {
            # creationTimestamp: how long its pods may take to appear before the operator asks why.
            **{k: meta[k] for k in ("name", "namespace", "uid", "creationTimestamp") if k in meta},
            **({"ownerReferences": owners} if owners else {}),
            **({"annotations": {EARLIER_RESTARTS_ANNOTATION: earlier}} if earlier is not None else {}),
        },
        "spec": {"suspend": (body.get("spec") or {}).get("suspend")},
        "status": body.get("status") or {},
    }


def slim_pod(body: Mapping[str, Any]) -> dict[str, Any]:
    status = body.get("status") or {}
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    # The JobSet's attempt (status.current_pods), and for a prepare pod its component and its Job.
    kept = (JOBSET_UID_LABEL, RESTART_ATTEMPT_LABEL, COMPONENT_LABEL, JOB_UID_LABEL)
    attempt_labels = {k: labels[k] for k in kept if k in labels}
    request = (meta.get("annotations") or {}).get(CHECKPOINT_REQUEST_ANNOTATION)
    node = (body.get("spec") or {}).get("nodeName")
    return {
        "metadata": {
            "name": meta.get("name"),
            "labels": attempt_labels,
            **({"deletionTimestamp": meta["deletionTimestamp"]} if meta.get("deletionTimestamp") else {}),
            # The operator's checkpoint request (maintenance.py), so it is made once per pod.
            **({"annotations": {CHECKPOINT_REQUEST_ANNOTATION: request}} if request is not None else {}),
        },
        # The node it runs on: where maintenance signals are looked up.
        **({"spec": {"nodeName": node}} if node else {}),
        "status": {
            k: status[k] for k in ("phase", "conditions", "containerStatuses", "startTime") if k in status
        },
    }
