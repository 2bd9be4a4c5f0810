"""Small helpers for tests that talk to the local cluster."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tpuft_dev.cluster.local import LocalCluster

T = TypeVar("T")

# A label selector for a run's TPU pods: not its prepare Job's pod (render/prepare_job.py), which
# carries the run's label too. Append it: f"tpuft.dev/finetune={name},{NOT_PREPARE}".
NOT_PREPARE = "tpuft.dev/component!=prepare"


def tpu_pods_of(name: str) -> str:
    """The label selector of run ``name``'s TPU pods."""
    return f"tpuft.dev/finetune={name},{NOT_PREPARE}"


def wait_for(check: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.5) -> T:
    """Polls ``check`` until it returns something truthy; fails with ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last value: {last!r}")


def get_json(cluster: LocalCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for cond in obj.get("status", {}).get("conditions", []) or []:
        if cond.get("type") == type_:
            return dict(cond)
    return None


def finetune(
    name: str,
    namespace: str,
    *,
    tpu: dict[str, Any] | None = None,
    pod_annotations: dict[str, str] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """A minimal valid TPUFineTune (v5p 2x2x2 unless ``tpu`` says otherwise); ``spec`` adds fields."""
    body: dict[str, Any] = {
        "apiVersion": "tpuft.dev/v1alpha1",
        "kind": "TPUFineTune",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"name": "meta-llama/Llama-3.2-1B"},
            "dataset": {"name": "gs://example-bucket/data/train.jsonl"},
            "tpu": tpu or {"type": "v5p", "topology": "2x2x2"},
            "training": {"maxSteps": 10},
            "output": {"uri": "gs://example-bucket/out"},
            **spec,
        },
    }
    if pod_annotations:
        body["spec"]["podAnnotations"] = pod_annotations
    return body


def patch_status_as(kubeconfig: Any, namespace: str, name: str, body: dict[str, Any]) -> tuple[int, str]:
    """Merge-patches a TPUFineTune's status with the credentials in ``kubeconfig``, as the trainer's
    reporter does (one PATCH, no GET first: `kubectl patch` reads the object before it patches, which
    the progress identity may not). Returns (HTTP status, the error body or "")."""
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    api = client.CustomObjectsApi(config.new_client_from_config(config_file=str(kubeconfig)))
    try:
        api.patch_namespaced_custom_object_status(
            "tpuft.dev", "v1alpha1", namespace, "tpufinetunes", name, body,
            _content_type="application/merge-patch+json",
        )  # fmt: skip
    except ApiException as error:
        return int(error.status), str(error.body)
    return 200, ""
