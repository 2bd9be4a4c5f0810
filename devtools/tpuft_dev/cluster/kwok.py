"""Fake GKE TPU nodes with kwok: node objects that look exactly like GKE's, and pod lifecycles.

kwok's stages come from its Go module (read at run time, never copied here): nodes become Ready and
keep a lease; pods of a Job go Pending -> Running -> Succeeded after short delays, which a pod can
override with kwok's own annotations (`hold_running("60s")` keeps it Running for a minute). Three stages are ours: a pod annotated ``kwok.tpuft.dev/exit-code`` terminates
with that exit code instead (see `simulated_exit`), so tests can play a user error (64) or a crash;
``kwok.tpuft.dev/first-attempt-exit-code`` does so only on the JobSet's first attempt
(`simulated_first_attempt_exit`), so a restart can be seen to cure it.

The prepare pods of runs (the CPU Job before the JobSet, render/prepare_job.py) carry the run's pod
annotations too, so the TPU pods' simulations above are kept off them, and kwok's own pod-complete
stage with them (a TPU pod held Running for a minute must not hold the data preparation as long):
a prepare pod starts and completes at once (exit 0, no termination message: the operator then knows
the data is prepared without its figures), or with ``kwok.tpuft.dev/prepare-exit-code`` terminates with that
code (`simulated_prepare_exit`). A prepare pod the executor runs (``tpuft.dev/run-on-host``) is left
to the executor. They run on the CPU pool (`cpu_pool_nodes`), which `tpuft cluster up` creates.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from tpuft_dev.cluster.components import KWOK_NODE_ANNOTATION
from tpuft_operator import topology
from tpuft_operator.topology import NODEPOOL_LABEL

EXIT_CODE_ANNOTATION = "kwok.tpuft.dev/exit-code"
EXIT_DELAY_ANNOTATION = "kwok.tpuft.dev/exit-delay"
# kwok's upstream pod-complete stage reads its weight from this annotation; 0 takes it out of the race.
_COMPLETE_WEIGHT_ANNOTATION = "pod-complete.stage.kwok.x-k8s.io/weight"
_COMPLETE_DELAY_ANNOTATION = "pod-complete.stage.kwok.x-k8s.io/delay"
_COMPLETE_JITTER_ANNOTATION = "pod-complete.stage.kwok.x-k8s.io/jitter-delay"
_DELETE_JITTER_ANNOTATION = "pod-delete.stage.kwok.x-k8s.io/jitter-delay"
TPU_TAINT = {"key": topology.TPU_RESOURCE, "value": "present", "effect": "NoSchedule"}

# Stage files inside the kwok module (kustomize/stage/...).
_UPSTREAM_STAGES = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "pod/general/pod-create.yaml",
    "pod/general/pod-init-container-running.yaml",
    "pod/general/pod-init-container-completed.yaml",
    "pod/general/pod-ready.yaml",
    "pod/general/pod-complete.yaml",
    "pod/general/pod-delete.yaml",
)

FIRST_ATTEMPT_EXIT_ANNOTATION = "kwok.tpuft.dev/first-attempt-exit-code"
PREPARE_EXIT_CODE_ANNOTATION = "kwok.tpuft.dev/prepare-exit-code"
# The run's prepare pods (render/prepare_job.py), and the pods the executor runs (executor.py).
_COMPONENT = '.metadata.labels["tpuft.dev/component"]'
_RUN_ON_HOST = '.metadata.annotations["tpuft.dev/run-on-host"]'
NOT_A_PREPARE_POD: dict[str, Any] = {"key": _COMPONENT, "operator": "DoesNotExist"}
# The CPU node pool's name (label cloud.google.com/gke-nodepool, as GKE names a pool).
CPU_POOL = "cpu-pool"
_RESTART_ATTEMPT = '.metadata.annotations["jobset.sigs.k8s.io/restart-attempt"]'


def _exit_stage(
    name: str,
    annotation: str | None,
    *,
    extra: list[dict[str, Any]],
    exit_code: str,
    delay_ms: int = 1000,
) -> dict[str, Any]:
    """A stage that terminates a running pod carrying ``annotation`` (None: any pod ``extra`` selects)
    with ``exit_code`` (a Go template expression), after the delay in EXIT_DELAY_ANNOTATION."""
    carries = [{"key": f'.metadata.annotations["{annotation}"]', "operator": "Exists"}] if annotation else []
    return {
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": name},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
            "selector": {
                "matchExpressions": [
                    {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
                    {"key": ".status.phase", "operator": "In", "values": ["Running"]},
                    *carries,
                    *extra,
                ]
            },
            "weight": 1,
            "delay": {
                "durationMilliseconds": delay_ms,
                "durationFrom": {"expressionFrom": f'.metadata.annotations["{EXIT_DELAY_ANNOTATION}"]'},
            },
            "next": {
                "statusTemplate": (
                    "{{ $now := Now }}\n"
                    f"{{{{ $code := {exit_code} }}}}\n"
                    "containerStatuses:\n"
                    "{{ range $index, $item := .spec.containers }}\n"
                    "- image: {{ $item.image | Quote }}\n"
                    "  name: {{ $item.name | Quote }}\n"
                    "  ready: false\n"
                    "  restartCount: 0\n"
                    "  started: false\n"
                    "  state:\n"
                    "    terminated:\n"
                    "      exitCode: {{ $code }}\n"
                    "      finishedAt: {{ $now | Quote }}\n"
                    '      reason: {{ if eq $code "0" }}Completed{{ else }}Error{{ end }}\n'
                    "      startedAt: {{ $now | Quote }}\n"
                    "{{ end }}\n"
                    'phase: {{ if eq $code "0" }}Succeeded{{ else }}Failed{{ end }}\n'
                )
            },
        },
    }


# Ours, next to kwok's: a pod exits with the code in its annotation; or, for the JobSet's first
# attempt only, exits with that code and succeeds on later attempts (a failure a restart cures).
# Never a prepare pod: those have their own two, last (kwok's pod-complete is kept off them too).
_PREPARE_POD: list[dict[str, Any]] = [
    {"key": _COMPONENT, "operator": "In", "values": ["prepare"]},
    {"key": _RUN_ON_HOST, "operator": "DoesNotExist"},
]
_OUR_STAGES = (
    _exit_stage(
        "tpuft-pod-exit-code",
        EXIT_CODE_ANNOTATION,
        extra=[NOT_A_PREPARE_POD],
        exit_code=f'index .metadata.annotations "{EXIT_CODE_ANNOTATION}"',
    ),
    _exit_stage(
        "tpuft-pod-exit-code-first-attempt",
        FIRST_ATTEMPT_EXIT_ANNOTATION,
        extra=[NOT_A_PREPARE_POD, {"key": _RESTART_ATTEMPT, "operator": "In", "values": ["0"]}],
        exit_code=f'index .metadata.annotations "{FIRST_ATTEMPT_EXIT_ANNOTATION}"',
    ),
    _exit_stage(
        "tpuft-pod-complete-after-first-attempt",
        FIRST_ATTEMPT_EXIT_ANNOTATION,
        extra=[NOT_A_PREPARE_POD, {"key": _RESTART_ATTEMPT, "operator": "NotIn", "values": ["0"]}],
        exit_code='"0"',
    ),
    _exit_stage(
        "tpuft-prepare-pod-exit-code",
        PREPARE_EXIT_CODE_ANNOTATION,
        extra=_PREPARE_POD,
        exit_code=f'index .metadata.annotations "{PREPARE_EXIT_CODE_ANNOTATION}"',
    ),
    _exit_stage(
        "tpuft-prepare-pod-complete",
        None,
        extra=[
            *_PREPARE_POD,
            {"key": f'.metadata.annotations["{PREPARE_EXIT_CODE_ANNOTATION}"]', "operator": "DoesNotExist"},
        ],
        exit_code='"0"',
        delay_ms=200,
    ),
)


def hold_running(duration: str) -> dict[str, str]:
    """Pod annotations that keep a kwok pod Running for ``duration`` (e.g. "15s") before it succeeds.

    Both are needed: kwok treats the jitter delay as an upper bound, so a delay longer than the
    stage's default jitter (5 s) alone would be cut short.
    """
    return {_COMPLETE_DELAY_ANNOTATION: duration, _COMPLETE_JITTER_ANNOTATION: duration}


def simulated_exit(exit_code: int, after: str = "1s") -> dict[str, str]:
    """Pod annotations that make a kwok pod terminate with ``exit_code`` once it has run ``after``."""
    return {
        EXIT_CODE_ANNOTATION: str(exit_code),
        EXIT_DELAY_ANNOTATION: after,
        _COMPLETE_WEIGHT_ANNOTATION: "0",
    }


def simulated_first_attempt_exit(exit_code: int, after: str = "2s") -> dict[str, str]:
    """Pod annotations: on the JobSet's first attempt the pod exits with ``exit_code`` (e.g. 137, a
    SIGKILLed host); after a restart it succeeds. Plays a failure that a restart cures."""
    return {
        FIRST_ATTEMPT_EXIT_ANNOTATION: str(exit_code),
        EXIT_DELAY_ANNOTATION: after,
        _COMPLETE_WEIGHT_ANNOTATION: "0",
    }


def hold_prepare(duration: str) -> dict[str, str]:
    """Pod annotations that keep a run's kwok prepare pod Running for ``duration`` before it completes
    (its TPU pods are not affected), so that the run is seen Preparing."""
    return {EXIT_DELAY_ANNOTATION: duration}


def simulated_prepare_exit(exit_code: int, after: str = "1s") -> dict[str, str]:
    """Pod annotations that make a run's kwok prepare pod terminate with ``exit_code`` (its TPU pods are
    not affected)."""
    return {PREPARE_EXIT_CODE_ANNOTATION: str(exit_code), EXIT_DELAY_ANNOTATION: after}


def _prepare_pod_create(upstream: dict[str, Any]) -> dict[str, Any]:
    """kwok's pod-create stage for prepare pods alone, without its random delay (1-6 s): each run's
    prepare pod is one more pod before its JobSet, and the suite creates runs one after another."""
    stage = copy.deepcopy(upstream)
    stage["metadata"]["name"] = "tpuft-prepare-pod-create"
    stage["spec"]["selector"].setdefault("matchExpressions", []).append(
        {"key": _COMPONENT, "operator": "In", "values": ["prepare"]}
    )
    stage["spec"]["delay"] = {"durationMilliseconds": 100}
    return stage


def _quick_pod_delete(upstream: dict[str, Any]) -> dict[str, Any]:
    """kwok's pod-delete stage, with the pod gone 1-2 s after its deletion instead of at a random
    moment of its whole grace period (up to the trainer pods' 60 s). No process runs in a kwok pod
    for SIGTERM to stop, and a finished pod has none at all, yet upstream's delay held every JobSet
    restart (its Jobs are deleted in the foreground: the new ones wait for the old pods to go) and
    every cascade a random half-minute. A real trainer's stop within its grace is played by the
    executor (`tpuft.dev/run-on-host`), which takes deletion off kwok. A pod can still ask for
    longer with kwok's own annotations (.../delay and .../jitter-delay)."""
    stage = copy.deepcopy(upstream)
    stage["spec"]["delay"]["jitterDurationMilliseconds"] = 2000
    stage["spec"]["delay"]["jitterDurationFrom"] = {
        "expressionFrom": f'.metadata.annotations["{_DELETE_JITTER_ANNOTATION}"]'
    }
    return stage


def stages_config(kwok_module_dir: Path) -> str:
    """kwok's --config: the upstream stages plus ours, as one multi-document YAML. kwok's pod-complete
    stage leaves the prepare pods to ours (see the module's docstring); its pod-delete stage is made
    quick (`_quick_pod_delete`)."""
    documents: list[Any] = []
    for relative in _UPSTREAM_STAGES:
        path = kwok_module_dir / "kustomize" / "stage" / relative
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            if doc["metadata"]["name"] == "pod-create":
                documents.append(_prepare_pod_create(doc))
            if doc["metadata"]["name"] in ("pod-create", "pod-complete"):
                doc["spec"]["selector"].setdefault("matchExpressions", []).append(NOT_A_PREPARE_POD)
            if doc["metadata"]["name"] == "pod-delete":
                doc = _quick_pod_delete(doc)
            documents.append(doc)
    documents.extend(_OUR_STAGES)
    return yaml.safe_dump_all(documents, sort_keys=False)


def nodepool_name(shape: topology.SliceShape, slice_index: int, prefix: str | None = None) -> str:
    base = prefix or f"tpu-{shape.family.name}-{shape.topology}"
    return f"{base}-{slice_index}".lower()


def nodepool_nodes(shape: topology.SliceShape, *, prefix: str | None = None) -> list[dict[str, Any]]:
    """Node objects for ``shape.slices`` node pools, one per slice, as GKE labels and taints them."""
    nodes = []
    for slice_index in range(shape.slices):
        pool = nodepool_name(shape, slice_index, prefix)
        for host in range(shape.hosts_per_slice):
            name = f"gke-{pool}-{host}"
            labels = {
                **topology.node_labels(shape, pool),
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
            }
            resources = {
                "cpu": "200",
                "memory": "400Gi",
                "pods": "110",
                "ephemeral-storage": "100Gi",
                topology.TPU_RESOURCE: str(shape.chips_per_host),
            }
            nodes.append(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": name,
                        "labels": labels,
                        "annotations": {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
                    },
                    "spec": {"taints": [TPU_TAINT]},
                    "status": {"capacity": resources, "allocatable": resources},
                }
            )
    return nodes


def cpu_pool_nodes(count: int = 2) -> list[dict[str, Any]]:
    """Plain CPU nodes (no TPU label, no taint), as a GKE CPU node pool: where the runs' prepare Jobs
    (and anything else that needs no TPU) schedule. Big enough for dozens of prepare pods at their
    default requests (4 CPUs, 16Gi) at once."""
    nodes = []
    for index in range(count):
        name = f"gke-{CPU_POOL}-{index}"
        resources = {"cpu": "256", "memory": "1Ti", "pods": "250", "ephemeral-storage": "500Gi"}
        nodes.append(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "labels": {
                        NODEPOOL_LABEL: CPU_POOL,
                        "kubernetes.io/hostname": name,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        "node.kubernetes.io/instance-type": "n2-standard-64",
                        "type": "kwok",
                    },
                    "annotations": {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
                },
                "status": {"capacity": resources, "allocatable": resources},
            }
        )
    return nodes
