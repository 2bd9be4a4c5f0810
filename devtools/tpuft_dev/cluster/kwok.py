"""Fake GKE TPU nodes with kwok: node objects that look exactly like GKE's, and pod lifecycles.

kwok's stages come from its Go module (read at run time, never copied here): nodes become Ready and
keep a lease; pods of a Job go Pending -> Running -> Succeeded after short delays, which a pod can
override with kwok's own annotations (`hold_running("60s")` keeps it Running for a minute). Three stages are ours: a pod annotated ``kwok.tpuft.dev/exit-code`` terminates
with that exit code instead (see `simulated_exit`), so tests can play a user error (64) or a crash;
``kwok.tpuft.dev/first-attempt-exit-code`` does so only on the JobSet's first attempt
(`simulated_first_attempt_exit`), so a restart can be seen to cure it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tpuft_dev.cluster.components import KWOK_NODE_ANNOTATION
from tpuft_operator import topology

EXIT_CODE_ANNOTATION = "kwok.tpuft.dev/exit-code"
EXIT_DELAY_ANNOTATION = "kwok.tpuft.dev/exit-delay"
# kwok's upstream pod-complete stage reads its weight from this annotation; 0 takes it out of the race.
_COMPLETE_WEIGHT_ANNOTATION = "pod-complete.stage.kwok.x-k8s.io/weight"
_COMPLETE_DELAY_ANNOTATION = "pod-complete.stage.kwok.x-k8s.io/delay"
_COMPLETE_JITTER_ANNOTATION = "pod-complete.stage.kwok.x-k8s.io/jitter-delay"
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
_RESTART_ATTEMPT = '.metadata.annotations["jobset.sigs.k8s.io/restart-attempt"]'


def _exit_stage(name: str, annotation: str, *, extra: list[dict[str, Any]], exit_code: str) -> dict[str, Any]:
    """A stage that terminates a running pod carrying ``annotation`` with ``exit_code`` (a Go
    template expression), after the delay in EXIT_DELAY_ANNOTATION."""
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
                    {"key": f'.metadata.annotations["{annotation}"]', "operator": "Exists"},
                    *extra,
                ]
            },
            "weight": 1,
            "delay": {
                "durationMilliseconds": 1000,
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
_OUR_STAGES = (
    _exit_stage(
        "tpuft-pod-exit-code",
        EXIT_CODE_ANNOTATION,
        extra=[],
        exit_code=f'index .metadata.annotations "{EXIT_CODE_ANNOTATION}"',
    ),
    _exit_stage(
        "tpuft-pod-exit-code-first-attempt",
        FIRST_ATTEMPT_EXIT_ANNOTATION,
        extra=[{"key": _RESTART_ATTEMPT, "operator": "In", "values": ["0"]}],
        exit_code=f'index .metadata.annotations "{FIRST_ATTEMPT_EXIT_ANNOTATION}"',
    ),
    _exit_stage(
        "tpuft-pod-complete-after-first-attempt",
        FIRST_ATTEMPT_EXIT_ANNOTATION,
        extra=[{"key": _RESTART_ATTEMPT, "operator": "NotIn", "values": ["0"]}],
        exit_code='"0"',
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


def stages_config(kwok_module_dir: Path) -> str:
    """kwok's --config: the upstream stages plus ours, as one multi-document YAML."""
    documents: list[Any] = []
    for relative in _UPSTREAM_STAGES:
        path = kwok_module_dir / "kustomize" / "stage" / relative
        documents.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
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
