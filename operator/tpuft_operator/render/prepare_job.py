"""TPUFineTune -> the prepare Job (batch/v1): the data prepared once, on CPU, before any TPU is held.

The Job runs `tpuft prepare` (tpuft_trainer/prepare_contract.py) with the very trainer config the
JobSet's pods read, mounted the same way (a downward-API volume of the pod annotation), with the same
image, ServiceAccount, hub token (a secretKeyRef), environment, volumes and security context as the
TPU pods: what it can read, they can read, and it is held to the same tenancy rules (api/policy.py
judges the spec both are rendered from). No TPU: no google.com/tpu request, no TPU node selector or
toleration, no Kueue queue label (it holds no TPU, so it is none of Kueue's business; the JobSet,
created only once the data is prepared, is what Kueue admits).

Its failures, told apart as the JobSet's are (render/jobset.py `failure_policies`):
- exit codes 64-78 of the trainer (a bad dataset, a missing model, a denied bucket): FailJob at once,
  the run fails with the trainer's message (the container's termination message names the field);
- a pod disrupted by the cluster (preemption, a drain, node loss: condition DisruptionTarget):
  Ignore, the Job makes a new pod without counting it;
- anything else (a crash, an OOM kill): counted against backoffLimit, PREPARE_BACKOFF_LIMIT retries.
activeDeadlineSeconds bounds the whole (spec.prepare.deadlineSeconds).

The Job is keyed on the data settings (`data_settings_hash`): a label and annotation carry the hash of
the rendered config's `TrainerConfig.data_settings()`, and status.data.settingsHash the hash its
figures belong to; the reconciler replaces a Job of another hash, and never runs one again for a
hash already prepared (a restart, a resume, a deleted JobSet reuse it).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from tpuft_operator.api.models import (
    DEFAULT_PREPARE_CPU,
    DEFAULT_PREPARE_DEADLINE_SECONDS,
    DEFAULT_PREPARE_MEMORY,
    TPUFineTune,
)
from tpuft_operator.api.resources import JOB
from tpuft_operator.api.validation import quantity
from tpuft_operator.render import naming
from tpuft_operator.render.jobset import (
    common_labels,
    config_file_item,
    object_metadata,
    security_context,
    user_error_rule,
)
from tpuft_operator.render.settings import RenderSettings
from tpuft_trainer.config import TrainerConfig
from tpuft_trainer.pod_contract import (
    CONFIG_DIR,
    CONFIG_PATH,
    CONFIG_VOLUME,
    POD_NAME_ENV,
    POD_NAMESPACE_ENV,
    TRAINER_CONFIG_ANNOTATION,
)

Obj = dict[str, Any]

CONTAINER = "prepare"
COMPONENT_LABEL = "tpuft.dev/component"
PREPARE_COMPONENT = "prepare"
# The hash of the data settings the Job prepares for (label: selectable; annotation: the same, read back).
DATA_SETTINGS_LABEL = "tpuft.dev/data-settings"
# The Job controller's label on its pods: which Job (by uid) a pod is of.
JOB_UID_LABEL = "batch.kubernetes.io/controller-uid"
# Where Kubernetes takes the container's termination message from (its default path), written by
# `tpuft prepare --summary-file`: the summary on success, the error on failure.
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
# Retries of infrastructure failures (a crash, an OOM kill); disruptions are not counted (Ignore).
PREPARE_BACKOFF_LIMIT = 2
# More processes than this rarely help: the input is read by one reader, and memory grows with each.
MAX_WORKERS = 64
_HASH_CHARS = 16


PREPARE_SUFFIX = "-prepare"


def prepare_job_name(ft: TPUFineTune) -> str:
    """``<jobset>-prepare``: at most 42 + 8 characters, so its pods' names (+ 6) stay within 63."""
    return f"{naming.jobset_name(ft.metadata.name, ft.metadata.uid)}{PREPARE_SUFFIX}"


def data_settings_hash(config: TrainerConfig) -> str:
    """A short, stable hash of every setting that decides the prepared content."""
    text = json.dumps(config.data_settings(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:_HASH_CHARS]


def prepare_resources(ft: TPUFineTune) -> Obj:
    """The pod's requests and limits: the spec's, with the defaults for what it leaves out. The memory
    limit defaults to the memory request: a pod that outgrows it is OOM-killed (an infrastructure
    failure, retried) instead of squeezing its node's other pods."""
    given = ft.spec.prepare.resources
    requests: dict[str, Any] = dict(given.requests or {}) if given else {}
    limits: dict[str, Any] = dict(given.limits or {}) if given else {}
    requests.setdefault("cpu", DEFAULT_PREPARE_CPU)
    requests.setdefault("memory", limits.get("memory", DEFAULT_PREPARE_MEMORY))
    limits.setdefault("memory", requests["memory"])
    return {"requests": requests, "limits": limits}


def workers(resources: Obj) -> int:
    """Tokenising processes: the CPU request rounded up (at least 1, at most MAX_WORKERS)."""
    cores = quantity(resources["requests"]["cpu"])
    if cores is None:
        return 1
    return max(1, min(MAX_WORKERS, math.ceil(cores)))


def _env(ft: TPUFineTune, settings: RenderSettings) -> list[Obj]:
    """The TPU pods' environment without what only a JobSet pod has (its slice, restart attempt and
    coordinator): the hub token by secretKeyRef and the spec's variables, as there."""
    out: list[Obj] = [
        {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": POD_NAMESPACE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    ref = ft.spec.model.token_secret_ref
    if ref is not None:
        out.append(
            {"name": settings.token_env, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
        )
    out += [e.model_dump(by_alias=True, exclude_none=True) for e in ft.spec.env or []]
    return out


def pod_failure_policy() -> Obj:
    return {
        "rules": [
            user_error_rule(CONTAINER),
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]
    }


def prepare_job(ft: TPUFineTune, config: TrainerConfig, settings: RenderSettings) -> Obj:
    """The run's prepare Job; ``config`` is the trainer config its JobSet's pods read."""
    spec, prepare = ft.spec, ft.spec.prepare
    settings_hash = data_settings_hash(config)
    labels = {**common_labels(ft), COMPONENT_LABEL: PREPARE_COMPONENT, DATA_SETTINGS_LABEL: settings_hash}
    resources = prepare_resources(ft)
    pod_security, container_security = security_context(settings)
    container: Obj = {
        "name": CONTAINER,
        # The run's own image (the native one for backend native): preparing is backend-neutral, but
        # then the checks it makes (model, tokenizer, output) run with the trainer's own libraries,
        # and a cluster that runs only native runs pulls one image.
        "image": spec.image or settings.image_for(spec.backend),
        "imagePullPolicy": settings.image_pull_policy,
        # Exec form, fixed arguments: no spec value is ever parsed by a shell.
        "command": [
            "tpuft",
            "prepare",
            "--config",
            CONFIG_PATH,
            "--workers",
            str(workers(resources)),
            "--summary-file",
            TERMINATION_MESSAGE_PATH,
        ],
        "env": _env(ft, settings),
        "resources": resources,
        "securityContext": container_security,
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "File",
        "volumeMounts": [
            {"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": True},
            *[m.model_dump(by_alias=True, exclude_none=True) for m in spec.volume_mounts or []],
        ],
    }
    pod_spec: Obj = {
        # Required by podFailurePolicy; the Job, not the kubelet, decides about a retry.
        "restartPolicy": "Never",
        "serviceAccountName": naming.pod_service_account(spec.service_account_name),
        "securityContext": pod_security,
        "containers": [container],
        "volumes": [
            {
                "name": CONFIG_VOLUME,
                "downwardAPI": {"items": [config_file_item()]},
            },
            *[dict(v) for v in spec.volumes or []],
        ],
    }
    if prepare.node_selector:
        pod_spec["nodeSelector"] = dict(prepare.node_selector)
    if prepare.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in prepare.tolerations
        ]
    # The spec's pod annotations too (GCS FUSE's gke-gcsfuse/volumes); the config last, as in the JobSet.
    annotations = {**(spec.pod_annotations or {}), TRAINER_CONFIG_ANNOTATION: config.to_yaml()}
    deadline = prepare.deadline_seconds or DEFAULT_PREPARE_DEADLINE_SECONDS
    return {
        "apiVersion": JOB.api_version,
        "kind": JOB.kind,
        "metadata": object_metadata(ft, prepare_job_name(ft), labels, {DATA_SETTINGS_LABEL: settings_hash}),
        "spec": {
            "backoffLimit": PREPARE_BACKOFF_LIMIT,
            "activeDeadlineSeconds": deadline,
            "podFailurePolicy": pod_failure_policy(),
            "template": {"metadata": {"labels": dict(labels), "annotations": annotations}, "spec": pod_spec},
        },
    }
