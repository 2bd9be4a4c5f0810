"""Whether the cluster's JobSet understands every field tpuft renders: read from its CRD.

An older JobSet's CRD lacks fields the renderer sets, and the apiserver then drops them from the
JobSet without a word (structural pruning; a value outside one of its enums it refuses). The one
that matters most: `spec.failurePolicy.rules[].onJobFailureMessagePatterns` (JobSet v0.10.0) tells a
checkpointed stop (exit 75, restart without counting) from a user error (fail at once); pruned, both
rules match every PodFailurePolicy failure and the first, `FailJobSet`, fails the whole run on the
first preemption that saved its checkpoint.

The fields to look for are not a hand-kept list: they are every field path of the JobSets rendered
from `REPRESENTATIVE` runs (one per branch of render/jobset.py), walked through the CRD's schema of
jobset.x-k8s.io/v1alpha2 (`gaps`). tests/unit/test_jobset_crd.py holds the representative runs to
the renderer: every golden example and any generated spec renders no field path they miss.

`InstalledJobSet` is the one stateful part: the operator's last verdict on the CRD (main.py reads it
at start-up), looked at again while it says JobSet is missing or too old.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tpuft_operator.api.resources import JOBSET
from tpuft_operator.k8s import ApiError
from tpuft_operator.render import RenderSettings, render_run

Obj = Mapping[str, Any]
log = logging.getLogger("tpuft.jobset")

CRD_NAME = f"{JOBSET.plural}.{JOBSET.group}"
# The JobSet release the tests run against (the local cluster's pinned versions; a unit test keeps
# the two equal) and, for a field path missing from an installed CRD that no release lacked, the
# oldest release that has every field tpuft renders.
TESTED_VERSION = "v0.12.0"
MINIMUM_VERSION = "v0.10.0"
# The first JobSet release whose CRD has each rendered field path that an earlier release lacks: found
# by running `gaps` over the CRD (config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml) of every
# release tag of sigs.k8s.io/jobset, v0.1.0 to v0.12.0, for the representative renders (v0.1.x serve
# only v1alpha1; v1alpha2 came with v0.2.0). A path is listed where it is missing as a whole (its
# fields are then not looked at). The release notes agree: CHANGELOG-0.10.md "Add
# onJobFailureMessagePatterns to distinguish retriable from non retriable Pod failure policies (#1033)".
INTRODUCED: dict[str, str] = {
    "spec.startupPolicy": "v0.4.0",
    "spec.failurePolicy.rules": "v0.6.0",
    "spec.network.publishNotReadyAddresses": "v0.6.0",
    "spec.failurePolicy.restartStrategy": "v0.7.0",
    "spec.replicatedJobs[].groupName": "v0.9.0",
    "spec.failurePolicy.rules[].onJobFailureMessagePatterns": "v0.10.0",
}
# The field whose absence costs most: it tells a checkpointed stop from a user error (render/jobset.py).
MESSAGE_PATTERNS = "spec.failurePolicy.rules[].onJobFailureMessagePatterns"
# Why the run waits (the `Created` condition's reason and the Warning Event's).
NOT_INSTALLED = "JobSetNotInstalled"
TOO_OLD = "JobSetTooOld"
# Fields named in a message at most; the rest are counted.
SHOWN = 5


@dataclass(frozen=True)
class Gap:
    """A rendered field path the CRD's schema lacks (``value`` None), or a value its enum refuses."""

    path: str
    value: str | None = None

    def __str__(self) -> str:
        return self.path if self.value is None else f"{self.path}={self.value}"


@dataclass(frozen=True)
class Shortfall:
    """Why no JobSet can be created for now: ``reason`` (NOT_INSTALLED or TOO_OLD) and the words."""

    reason: str
    message: str


def _walk(schema: Obj, value: Any, path: str, seen: dict[str, Gap | None]) -> None:
    """Records in ``seen`` each field path of ``value`` (map keys as ``*``, list items as ``[]``): None
    where ``schema`` has it, a Gap where it does not (not descended) or its enum refuses the value."""
    if isinstance(value, Mapping):
        properties = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        for key, child in value.items():
            if key in properties:
                sub, child_path = properties[key], f"{path}.{key}" if path else str(key)
            elif isinstance(additional, Mapping):
                sub, child_path = additional, f"{path}.*"
            elif additional is True or schema.get("x-kubernetes-preserve-unknown-fields"):
                continue  # anything goes below: kept as given
            else:
                gap_path = f"{path}.{key}" if path else str(key)
                seen[gap_path] = Gap(gap_path)
                continue
            if not path and key == "metadata":
                seen.setdefault(child_path, None)  # the apiserver's own ObjectMeta, whatever the CRD says
                continue
            seen.setdefault(child_path, None)
            _walk(sub, child, child_path, seen)
    elif isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, Mapping):
            for item in value:
                _walk(items, item, f"{path}[]", seen)
    else:
        allowed = schema.get("enum")
        if allowed is not None and value not in allowed:
            seen[path] = Gap(path, str(value))


def field_paths(schema: Obj, objects: Iterable[Obj]) -> dict[str, Gap | None]:
    """Every field path of ``objects`` as ``schema`` sees it (``spec.replicatedJobs[].name``, map keys
    as ``*``) -> None, or the Gap found there."""
    seen: dict[str, Gap | None] = {}
    for obj in objects:
        _walk(schema, obj, "", seen)
    return seen


def gaps(schema: Obj, objects: Iterable[Obj]) -> list[Gap]:
    """The field paths of ``objects`` that ``schema`` (an openAPIV3Schema) lacks, and the values its
    enums refuse; outermost paths only, sorted."""
    return sorted((g for g in field_paths(schema, objects).values() if g is not None), key=str)


def served_schema(crd: Obj, version: str = JOBSET.version) -> Obj | None:
    """The openAPIV3Schema of ``version`` of an apiextensions.k8s.io/v1 CRD, None if it serves none."""
    for entry in (crd.get("spec") or {}).get("versions") or []:
        if entry.get("name") == version and entry.get("served", True):
            return ((entry.get("schema") or {}).get("openAPIV3Schema")) or {}
    return None


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.lstrip("v").split("."))


def _within(path: str, outer: str) -> bool:
    """Whether field path ``path`` is ``outer`` or lies beneath it."""
    return path == outer or path.startswith((f"{outer}.", f"{outer}["))


def needed_version(gap: Gap) -> str:
    """The oldest JobSet release whose CRD has the gap's path (and what tpuft renders beneath it)."""
    under = [version for path, version in INTRODUCED.items() if _within(path, gap.path)]
    return max(under, key=_version_key) if under else MINIMUM_VERSION


def _upgrade(version: str) -> str:
    return f"install JobSet {version} or later (tpuft is tested with {TESTED_VERSION})"


def verdict(crd: Obj | None, rendered: Sequence[Obj]) -> Shortfall | None:
    """What keeps tpuft from creating JobSets on a cluster whose JobSet CRD is ``crd`` (None: absent),
    for the JobSets ``rendered`` from the representative runs; None when nothing does."""
    if crd is None:
        return Shortfall(
            NOT_INSTALLED,
            f"JobSet is not installed (no CustomResourceDefinition {CRD_NAME}): {_upgrade(MINIMUM_VERSION)}",
        )
    schema = served_schema(crd)
    if schema is None:
        return Shortfall(
            TOO_OLD,
            f"the installed JobSet does not serve {JOBSET.api_version} (CustomResourceDefinition "
            f"{CRD_NAME}): {_upgrade(MINIMUM_VERSION)}",
        )
    found = gaps(schema, rendered)
    if not found:
        return None
    version = max((needed_version(g) for g in found), key=_version_key)
    named = [
        f"{g} (JobSet {needed_version(g)})" if g.value is None else f"{g} (value not allowed)"
        for g in found[:SHOWN]
    ]
    more = f" and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
    stops = any(_within(MESSAGE_PATTERNS, g.path) for g in found)
    consequence = (
        "; without onJobFailureMessagePatterns a checkpointed stop (exit 75: preemption, maintenance) "
        "would fail the whole run instead of restarting it"
        if stops
        else ""
    )
    return Shortfall(
        TOO_OLD,
        f"the installed JobSet is too old: its CustomResourceDefinition {CRD_NAME} lacks "
        f"{', '.join(named)}{more}, which tpuft sets (the apiserver would drop or refuse them)"
        f"{consequence}: {_upgrade(version)}",
    )


# One TPUFineTune per branch of render/jobset.py: single- and multi-host, multislice, Kueue (queue and
# priority class), Spot, a reservation, a placement policy, host networking (its DNS policy and host
# port), a token Secret, the user's env (each kind of source), tolerations, volume mounts, resources,
# a priority class, a pod ServiceAccount and annotations. The user's own volumes are free-form (any volume type of the cluster) and are not
# looked for: there is the downward-API volume the renderer adds, and an emptyDir for the mount.
_BASE: dict[str, Any] = {
    "apiVersion": "tpuft.dev/v1alpha1",
    "kind": "TPUFineTune",
    "metadata": {
        "name": "jobset-fields",
        "namespace": "default",
        "uid": "00000000-0000-4000-8000-000000000000",
    },
    "spec": {
        "model": {"name": "google/gemma-2-2b"},
        "dataset": {"name": "tatsu-lab/alpaca"},
        "tpu": {"type": "v5e", "topology": "2x2"},
        "training": {"maxSteps": 10},
        "output": {"uri": "gs://bucket/out"},
    },
}


def _run(metadata: Mapping[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    run = copy.deepcopy(_BASE)
    run["metadata"].update(metadata or {})
    run["spec"].update(spec)
    return run


REPRESENTATIVE: tuple[dict[str, Any], ...] = (
    _run(),
    _run(
        {"labels": {"kueue.x-k8s.io/priority-class": "high"}},
        tpu={
            "type": "v5p",
            "topology": "2x2x2",
            "slices": 2,
            "spot": True,
            "reservation": "r",
        },
        model={"name": "google/gemma-2-2b", "tokenSecretRef": {"name": "hf", "key": "token"}},
        queueName="q",
        suspend=True,
        image="registry.example/trainer:1",
        terminationGracePeriodSeconds=120,
        priorityClassName="high",
        serviceAccountName="sa",
        podAnnotations={"a": "b"},
        env=[
            {"name": "A", "value": "b"},
            {"name": "B", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k", "optional": True}}},
            {"name": "C", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
            {"name": "D", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name", "apiVersion": "v1"}}},
        ],
        tolerations=[
            {"key": "k", "operator": "Equal", "value": "v", "effect": "NoExecute", "tolerationSeconds": 5}
        ],
        volumes=[{"name": "data", "emptyDir": {}}],
        volumeMounts=[{"name": "data", "mountPath": "/data", "readOnly": True, "subPath": "x"}],
        resources={"requests": {"memory": "1Gi"}, "limits": {"memory": "2Gi"}},
    ),
    _run(
        # Ironwood runs on backend native (xla is refused there): its environment is checked too.
        tpu={"type": "tpu7x", "topology": "2x2x4", "placementPolicy": "ironwood"},
        backend="native",
        network={"hostNetwork": True},
    ),
)


def representative_jobsets(settings: RenderSettings) -> list[dict[str, Any]]:
    """The JobSets of the representative runs, as an operator with ``settings`` renders them."""
    return [render_run(copy.deepcopy(run), settings).jobset for run in REPRESENTATIVE]


class InstalledJobSet:
    """The operator's verdict on the cluster's JobSet CRD: `shortfall()` is None while JobSets may be
    created. Read at start-up (`check`); while it says JobSet is missing or too old it is read again,
    at most once every ``recheck_seconds`` (the reconciles that ask meanwhile get the last verdict),
    so installing or upgrading JobSet needs no restart. A CRD this identity may not read (the chart's
    namespaced mode grants nothing cluster-wide) is not checked at all. Safe from any thread."""

    def __init__(
        self,
        read: Callable[[], Obj | None],
        rendered: Sequence[Obj],
        *,
        recheck_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # read: the CRD, None when it does not exist (k8s.Api.read_crd); raises ApiError.
        self._read, self._rendered = read, rendered
        self._recheck, self._clock = recheck_seconds, clock
        self._lock = threading.Lock()
        self._shortfall: Shortfall | None = None
        self._checked: float | None = None  # when the CRD was last read; None: not yet, or unreadable
        self._final = False  # no need to read it again: it was fine, or may not be read

    def check(self) -> Shortfall | None:
        """Reads the CRD now and logs the verdict; returns it."""
        with self._lock:
            return self._check()

    def _check(self) -> Shortfall | None:
        previous = self._shortfall
        try:
            crd = self._read()
        except ApiError as error:
            if error.status != 403:  # the API cannot answer now: the next look tries again
                log.warning("cannot read the CustomResourceDefinition %s yet: %s", CRD_NAME, error)
                self._checked = self._clock()
                return self._shortfall
            # (Not the error's own words: its status code would read as a denied call of the runs'.)
            log.warning(
                "cannot check that the installed JobSet knows every field tpuft sets: this identity may "
                "not get the CustomResourceDefinition %s (the chart grants it only in its cluster-wide "
                "mode); runs get their JobSets unchecked, and need JobSet %s or later",
                CRD_NAME,
                MINIMUM_VERSION,
            )
            self._shortfall, self._final = None, True
            return None
        self._checked = self._clock()
        self._shortfall = verdict(crd, self._rendered)
        self._final = self._shortfall is None
        if self._shortfall is not None and self._shortfall != previous:
            log.error(
                "%s; no JobSet is created until then: runs wait with condition Created=False, reason %s",
                self._shortfall.message,
                self._shortfall.reason,
            )
        elif self._shortfall is None:
            log.info(
                "the installed JobSet knows every field tpuft sets%s",
                " now; creating the runs' JobSets" if previous is not None else "",
            )
        return self._shortfall

    def shortfall(self) -> Shortfall | None:
        """The verdict, read again first when it is bad and older than ``recheck_seconds`` (unless
        another thread is reading it: then the last verdict)."""
        if self._final:
            return None
        due = self._checked is None or self._clock() - self._checked >= self._recheck
        if due and self._lock.acquire(blocking=False):
            try:
                if not self._final:
                    return self._check()
            finally:
                self._lock.release()
        return self._shortfall
