"""The identity of the progress channel: who may write a run's ``status.progress``, and how little.

Rank 0 of the trainer reports progress by merge-patching ``status.progress`` of its own TPUFineTune,
with the token Kubernetes mounts in its pod. That token is *bound to the pod*: the apiserver adds the
pod's name to the request's user info, and the token stops working when the pod is deleted. Two
parts keep the channel to its one purpose:

- RBAC, once per namespace (`namespace_objects`): the ServiceAccount ``tpuft-trainer`` that trainer
  pods run as, and a Role + RoleBinding that let it ``patch`` ``tpufinetunes/status`` in the
  namespace (no ``get``: a status GET returns the whole object, spec included, and the reporter
  only patches; the policy below stops a patch of any run but the pod's own). Created by the operator the first time it sees a run in the namespace, then never again:
  no RBAC objects per run, so a run costs three writes to reach Running (JobSet, Pending, Running),
  and Role creates, slow because the apiserver checks them for privilege escalation, happen once per
  namespace.
- A ValidatingAdmissionPolicy (the chart's ``progress-policy.yaml``, generated from the status model
  by `progress_policy`): a caller without the ``operate`` permission on ``tpufinetunes/status``
  (which only the chart's operator role and wildcard administrators hold) may change a
  TPUFineTune's status only from a pod of that run's JobSet, and only ``status.progress``. Tokens
  not bound to a pod are refused. So a pod can neither report for another run nor mark its own run
  Succeeded, and an account that merely may list runs (a CI account named as a run's
  serviceAccountName, say) is not exempt.

When the user sets ``spec.serviceAccountName`` (Workload Identity for GCS), pods run as that account;
one RoleBinding per run (owned by it, deleted with it) binds the namespace Role to that account.
"""

from __future__ import annotations

from typing import Any

from tpuft_operator.api.admission import validating_policy
from tpuft_operator.api.models import TPUFineTune, TPUFineTuneStatus
from tpuft_operator.api.resources import FINETUNE, ROLE, ROLE_BINDING, SERVICE_ACCOUNT
from tpuft_operator.render import naming
from tpuft_operator.render.jobset import common_labels, object_metadata

Obj = dict[str, Any]

TRAINER_SERVICE_ACCOUNT = naming.TRAINER_SERVICE_ACCOUNT
PROGRESS_ROLE = "tpuft-progress"
# Marks the shared per-namespace objects (they belong to no run, so they carry no owner).
SHARED_LABELS = {"app.kubernetes.io/managed-by": "tpuft", "tpuft.dev/component": "progress"}
POLICY_NAME = "tpuft-progress"
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
# The permission that exempts a caller from the progress policy: only the operator's role has it.
OPERATE_VERB = "operate"


def namespace_objects(namespace: str) -> list[Obj]:
    """The trainer ServiceAccount and the progress Role and RoleBinding of ``namespace``."""

    def meta(name: str) -> Obj:
        return {"name": name, "namespace": namespace, "labels": dict(SHARED_LABELS)}

    return [
        {
            "apiVersion": SERVICE_ACCOUNT.api_version,
            "kind": SERVICE_ACCOUNT.kind,
            "metadata": meta(TRAINER_SERVICE_ACCOUNT),
        },
        {
            "apiVersion": ROLE.api_version,
            "kind": ROLE.kind,
            "metadata": meta(PROGRESS_ROLE),
            "rules": [
                {
                    "apiGroups": [FINETUNE.group],
                    "resources": [f"{FINETUNE.plural}/status"],
                    "verbs": ["patch"],
                }
            ],
        },
        _binding(meta(PROGRESS_ROLE), TRAINER_SERVICE_ACCOUNT, namespace),
    ]


def run_objects(ft: TPUFineTune) -> list[Obj]:
    """Per-run identity objects: only a RoleBinding for a user-named ServiceAccount, else none."""
    account = ft.spec.service_account_name
    if account is None:
        return []
    name = naming.progress_identity_name(ft.metadata.name, ft.metadata.uid)
    metadata = object_metadata(ft, name, {**common_labels(ft), "tpuft.dev/component": "progress"}, {})
    return [_binding(metadata, account, ft.metadata.namespace)]


def _binding(metadata: Obj, account: str, namespace: str) -> Obj:
    return {
        "apiVersion": ROLE_BINDING.api_version,
        "kind": ROLE_BINDING.kind,
        "metadata": metadata,
        "roleRef": {"apiGroup": ROLE.group, "kind": ROLE.kind, "name": PROGRESS_ROLE},
        "subjects": [{"kind": SERVICE_ACCOUNT.kind, "name": account, "namespace": namespace}],
    }


def _status_fields_except_progress() -> list[str]:
    return [
        field.alias or name
        for name, field in TPUFineTuneStatus.model_fields.items()
        if (field.alias or name) != "progress"
    ]


def progress_policy(name: str = POLICY_NAME) -> list[Obj]:
    """The ValidatingAdmissionPolicy and its binding (see the module docstring).

    Exempt are callers who hold the ``operate`` verb on ``tpufinetunes/status`` in the run's
    namespace: a permission that means "is a tpuft operator", held by the chart's operator role of
    every release (so several namespaced releases each see their own operator exempt) and by
    wildcard administrators; not by anyone who merely may list or patch runs. Not a username: the
    policy of one release would then refuse the operator of another. The JobSet name comes
    from the status the operator wrote (``status.jobSetName``): it is the run's name when that fits,
    else a hash, which CEL cannot compute. Pods are named ``<jobset>-slice-<slice>-<host>-<5 random>``.
    """
    unchanged = " && ".join(
        f"(has(object.status.{f}) == has(oldObject.status.{f}))"
        f" && (!has(object.status.{f}) || object.status.{f} == oldObject.status.{f})"
        for f in _status_fields_except_progress()
    )
    pod_pattern = (
        f"'^' + oldObject.status.jobSetName + '-{naming.REPLICATED_JOB}-[0-9]+-[0-9]+-[a-z0-9]{{5}}$'"
    )
    return validating_policy(
        name,
        operation="UPDATE",
        resource=f"{FINETUNE.plural}/status",
        match_conditions=[
            {
                "name": "not-the-operator-or-an-administrator",
                "expression": f"!authorizer.group('{FINETUNE.group}').resource('{FINETUNE.plural}')"
                ".subresource('status')"
                f".namespace(object.metadata.namespace).check('{OPERATE_VERB}').allowed()",
            }
        ],
        variables=[
            {
                "name": "pod",
                "expression": f"'{POD_NAME_EXTRA}' in request.userInfo.extra"
                f" && size(request.userInfo.extra['{POD_NAME_EXTRA}']) == 1"
                f" ? request.userInfo.extra['{POD_NAME_EXTRA}'][0] : ''",
            },
            {
                "name": "jobSetKnown",
                "expression": "has(oldObject.status) && has(oldObject.status.jobSetName)",
            },
        ],
        validations=[
            {
                "expression": "variables.pod != ''",
                "message": "only the operator, administrators and the pods of a run (with their pod-bound token) may "
                "write a TPUFineTune's status",
                "reason": "Forbidden",
            },
            {
                "expression": f"variables.jobSetKnown && variables.pod.matches({pod_pattern})",
                "messageExpression": "'pod ' + variables.pod + ' does not belong to TPUFineTune ' + "
                "object.metadata.name + ': a pod may report progress only for its own run'",
                "reason": "Forbidden",
            },
            {
                "expression": f"variables.jobSetKnown && has(object.status) && {unchanged}",
                "message": "a run's pods may write status.progress only; the operator owns the rest "
                "of the status",
                "reason": "Forbidden",
            },
        ],
    )
