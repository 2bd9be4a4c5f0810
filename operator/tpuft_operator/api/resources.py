"""The Kubernetes resources the operator reads and writes: group, version, plural and kind, once.

kopf's handlers and indexes (handlers.py), the REST client (k8s.py), the renderer's objects
(render/*), the CRD (api/crd.py), the admission policies and the benchmarks all take their API
coordinates from this table, so a version bump (JobSet v1alpha2 -> v1, Kueue v1beta2 -> v1) is one
line. The trainer reports progress to FINETUNE too: its config's progress.group/version/plural are
rendered from here (render/trainer_config.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Resource:
    group: str  # "" for the core API
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        """An object's ``apiVersion``: ``group/version``, or the version alone for the core API."""
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def gvp(self) -> tuple[str, str, str]:
        """(group, version, plural): how kopf's decorators and settings name a resource."""
        return (self.group, self.version, self.plural)

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        """The REST path of the namespace's collection, of one object, or of its subresource."""
        base = f"/api/{self.version}" if self.group == "" else f"/apis/{self.group}/{self.version}"
        path = f"{base}/namespaces/{namespace}/{self.plural}"
        if name is not None:
            path += f"/{name}"
        if subresource is not None:
            path += f"/{subresource}"
        return path


FINETUNE = Resource("tpuft.dev", "v1alpha1", "tpufinetunes", "TPUFineTune")
JOBSET = Resource("jobset.x-k8s.io", "v1alpha2", "jobsets", "JobSet")
# Kueue's Workload of a queued run's JobSet: watched (handlers.py); only spec.active is ever patched.
WORKLOAD = Resource("kueue.x-k8s.io", "v1beta2", "workloads", "Workload")
# The run's prepare Job (render/prepare_job.py): created, watched, deleted when its settings change.
JOB = Resource("batch", "v1", "jobs", "Job")
POD = Resource("", "v1", "pods", "Pod")
NODE = Resource("", "v1", "nodes", "Node")
EVENT = Resource("", "v1", "events", "Event")
SERVICE_ACCOUNT = Resource("", "v1", "serviceaccounts", "ServiceAccount")
ROLE = Resource("rbac.authorization.k8s.io", "v1", "roles", "Role")
ROLE_BINDING = Resource("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding")
NETWORK_POLICY = Resource("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy")
