"""The per-run identity of the progress channel: a ServiceAccount, a Role and a RoleBinding.

Rank 0 of the trainer reports progress by merge-patching `status.progress` of its own TPUFineTune.
The Role allows exactly that: `get` and `patch` on `tpufinetunes/status`, limited by
`resourceNames` to this one run. Nothing else (not the spec, not other runs, no Secrets). All three
objects are owned by the TPUFineTune, so deleting the run deletes them.

When the user sets `spec.serviceAccountName` (Workload Identity for GCS), pods run as that account;
the RoleBinding then binds the per-run Role to it instead, with the same one-resource scope.
"""

from __future__ import annotations

from typing import Any

from tpuft_operator.api.models import TPUFineTune
from tpuft_operator.render import naming
from tpuft_operator.render.jobset import common_labels, object_metadata


def identity_objects(ft: TPUFineTune) -> list[dict[str, Any]]:
    name = naming.progress_identity_name(ft.metadata.name)
    namespace = ft.metadata.namespace
    metadata = object_metadata(ft, name, {**common_labels(ft), "tpuft.dev/component": "progress"}, {})
    objects: list[dict[str, Any]] = []
    if ft.spec.service_account_name is None:
        objects.append({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata})
    objects.append(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": metadata,
            "rules": [
                {
                    "apiGroups": ["tpuft.dev"],
                    "resources": ["tpufinetunes/status"],
                    "resourceNames": [ft.metadata.name],
                    "verbs": ["get", "patch"],
                }
            ],
        }
    )
    service_account = naming.pod_service_account(ft.metadata.name, ft.spec.service_account_name)
    objects.append(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": metadata,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}],
        }
    )
    return objects
