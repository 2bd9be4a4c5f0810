"""GKE's maintenance signals on the nodes a run's pods run on, and the checkpoint request they cause. Pure.

GKE announces host maintenance of TPU (and GPU) VMs, which cannot live-migrate, on the node
(docs: "Manage GKE node disruption for GPUs and TPUs"; GKE >= 1.31.1-gke.2008000):

- label ``cloud.google.com/scheduled-maintenance-time``: the start, in Unix seconds (e.g. 1733083200);
- label ``cloud.google.com/active-node-maintenance: ONGOING`` while it runs;
- taint ``cloud.google.com/impending-node-termination:NoSchedule`` shortly before the VM stops.

A host event on one VM of a slice interrupts the whole slice, so a signal on any node of a run
concerns the whole run. With ``spec.maintenance: checkpoint`` the operator asks the trainer to save
a checkpoint now: it sets the pod annotation ``tpuft.dev/checkpoint-request`` to the announced time
on every pod of the run; a downward-API file shows it to the trainer, whose hosts agree on the step
to save at (tpuft_trainer/stop.py). The request is the maintenance time, so a new announcement is a
new request and the same one is asked for once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tpuft_trainer.pod_contract import CHECKPOINT_REQUEST_ANNOTATION

SCHEDULED_LABEL = "cloud.google.com/scheduled-maintenance-time"
ACTIVE_LABEL = "cloud.google.com/active-node-maintenance"
TERMINATION_TAINT = "cloud.google.com/impending-node-termination"
Obj = Mapping[str, Any]


@dataclass(frozen=True)
class NodeSignals:
    node: str
    scheduled: int | None = None  # Unix seconds
    active: bool = False
    terminating: bool = False

    @property
    def any(self) -> bool:
        return self.scheduled is not None or self.active or self.terminating

    def describe(self) -> str:
        parts = []
        if self.scheduled is not None:
            when = datetime.fromtimestamp(self.scheduled, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            parts.append(f"maintenance scheduled for {when}")
        if self.active:
            parts.append("maintenance in progress")
        if self.terminating:
            parts.append("the node is about to be terminated")
        return f"node {self.node}: {', '.join(parts)}"


def node_signals(node: Obj) -> NodeSignals:
    """The signals of a node object (full, or as `slim_node` keeps it)."""
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    raw = str(labels.get(SCHEDULED_LABEL, "")).strip()
    taints = (node.get("spec") or {}).get("taints") or []
    return NodeSignals(
        node=str(meta.get("name", "")),
        scheduled=int(raw) if raw.isdigit() else None,
        active=str(labels.get(ACTIVE_LABEL, "")).upper() == "ONGOING",
        terminating=any(t.get("key") == TERMINATION_TAINT for t in taints),
    )


def slim_node(body: Obj) -> dict[str, Any]:
    """What the operator keeps of a TPU node: its name and its maintenance signals."""
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    taints = (body.get("spec") or {}).get("taints") or []
    return {
        "metadata": {
            "name": meta.get("name"),
            "labels": {k: labels[k] for k in (SCHEDULED_LABEL, ACTIVE_LABEL) if k in labels},
        },
        "spec": {"taints": [{"key": t["key"]} for t in taints if t.get("key") == TERMINATION_TAINT]},
    }


@dataclass(frozen=True)
class Maintenance:
    """The signals on the nodes of one run, in node order."""

    signals: tuple[NodeSignals, ...]

    @property
    def request(self) -> int | None:
        """The checkpoint request: the earliest announced maintenance time (None: nothing announced
        ahead; an ongoing maintenance or an impending termination brings SIGTERM itself)."""
        times = [s.scheduled for s in self.signals if s.scheduled is not None]
        return min(times) if times else None

    @property
    def reason(self) -> str:
        if any(s.terminating for s in self.signals):
            return "NodeTerminating"
        if any(s.active for s in self.signals):
            return "MaintenanceOngoing"
        return "MaintenanceScheduled"

    def message(self, policy: str) -> str:
        what = "; ".join(s.describe() for s in self.signals)
        if policy != "checkpoint":
            return f"{what} (spec.maintenance is ignore: no checkpoint requested)"
        if self.request is not None:
            return f"{what}; asked the trainer to checkpoint now (it saves again on the SIGTERM that follows)"
        return f"{what}; the trainer saves the step it reaches on SIGTERM"


def for_run(pods: Iterable[Obj], nodes: Mapping[str, Obj]) -> Maintenance | None:
    """The maintenance signals on the nodes ``pods`` run on, or None when there are none."""
    names = sorted(
        {str((p.get("spec") or {}).get("nodeName")) for p in pods if (p.get("spec") or {}).get("nodeName")}
    )
    found = tuple(s for s in (node_signals(nodes[n]) for n in names if n in nodes) if s.any)
    return Maintenance(found) if found else None


def pods_to_ask(pods: Iterable[Obj], request: int) -> list[str]:
    """Names of the pods whose checkpoint-request annotation is not yet ``request``."""
    return [
        str(p["metadata"]["name"])
        for p in pods
        if ((p.get("metadata") or {}).get("annotations") or {}).get(CHECKPOINT_REQUEST_ANNOTATION)
        != str(request)
    ]
