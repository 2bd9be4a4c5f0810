"""The ValidatingAdmissionPolicy and binding shape the chart's two policies share (the admin policy,
api/policy.py, and the progress policy, render/identity.py): pure dicts, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tpuft_operator.api.resources import FINETUNE

Obj = dict[str, Any]


def validating_policy(
    name: str,
    *,
    operation: str,
    resource: str,
    variables: Sequence[Obj],
    validations: Sequence[Obj],
    match_conditions: Sequence[Obj] = (),
) -> list[Obj]:
    """A ValidatingAdmissionPolicy on ``operation`` of ``resource`` in group tpuft.dev (any version),
    failing closed, and the binding that makes it deny (every namespace)."""
    spec: Obj = {
        "failurePolicy": "Fail",
        "matchConstraints": {
            "resourceRules": [
                {
                    "apiGroups": [FINETUNE.group],
                    "apiVersions": ["*"],
                    "operations": [operation],
                    "resources": [resource],
                }
            ]
        },
    }
    if match_conditions:
        spec["matchConditions"] = list(match_conditions)
    spec["variables"] = list(variables)
    spec["validations"] = list(validations)
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": spec,
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": ["Deny"]},
    }
    return [policy, binding]
