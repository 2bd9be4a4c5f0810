"""The TPUFineTune CustomResourceDefinition, generated from the pydantic models.

`crd()` returns the apiextensions.k8s.io/v1 object as a plain dict. The OpenAPI schema is pydantic's
JSON schema rewritten into a Kubernetes *structural* schema: references inlined, optional fields
without the `null` branch, JSON-Schema-2020 `exclusiveMinimum: x` spelled the OpenAPI 3.0 way, titles
dropped, and a type on every node. Descriptions are kept on every field (a test enforces it), so
`kubectl explain tpufinetune.spec.tpu.topology` prints the same text as docs/api.md.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from tpuft_operator.api import cel
from tpuft_operator.api.models import (
    QUANTITY,
    SHORT_NAMES,
    SINGULAR,
    TPUFineTuneSpec,
    TPUFineTuneStatus,
)
from tpuft_operator.api.resources import FINETUNE

Schema = dict[str, Any]

CRD_NAME = f"{FINETUNE.plural}.{FINETUNE.group}"

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Phase of the run."},
    {"name": "Type", "type": "string", "jsonPath": ".spec.tpu.type", "description": "TPU type."},
    {
        "name": "Topology",
        "type": "string",
        "jsonPath": ".spec.tpu.topology",
        "description": "Topology of a slice.",
    },
    {"name": "Slices", "type": "integer", "jsonPath": ".spec.tpu.slices", "description": "Number of slices."},
    {
        "name": "Progress",
        "type": "string",
        "jsonPath": ".status.progress.summary",
        "description": "Steps done / total.",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {
        "name": "Backend",
        "type": "string",
        "jsonPath": ".spec.backend",
        "priority": 1,
        "description": "The trainer's backend: xla or native.",
    },
    {
        "name": "Chips",
        "type": "integer",
        "jsonPath": ".status.chips",
        "priority": 1,
        "description": "Chips in use.",
    },
    {
        "name": "Loss",
        "type": "number",
        "jsonPath": ".status.progress.loss",
        "priority": 1,
        "description": "Latest loss.",
    },
    {
        "name": "EvalLoss",
        "type": "number",
        "jsonPath": ".status.progress.evalLoss",
        "priority": 1,
        "description": "Latest evaluation loss.",
    },
    {
        "name": "Tokens/s",
        "type": "number",
        "jsonPath": ".status.progress.tokensPerSecond",
        "priority": 1,
        "description": "Training throughput, all chips.",
    },
    {
        "name": "Goodput",
        "type": "number",
        "jsonPath": ".status.goodput.ratio",
        "priority": 1,
        "description": "Productive training time / wall time since creation.",
    },
    {
        "name": "JobSet",
        "type": "string",
        "jsonPath": ".status.jobSetName",
        "priority": 1,
        "description": "JobSet.",
    },
    {
        "name": "Message",
        "type": "string",
        "jsonPath": ".status.message",
        "priority": 1,
        "description": "Details.",
    },
]

# Keys of pydantic's JSON schema that have no place in a Kubernetes structural schema.
_DROP = {"title", "$defs"}


def _resolve(node: Schema, defs: dict[str, Schema]) -> Schema:
    """Inline `$ref`, collapse `anyOf [X, null]`, and merge the field's own keys over the target's."""
    node = dict(node)
    if "$ref" in node:
        target = copy.deepcopy(defs[node.pop("$ref").split("/")[-1]])
        target.update(node)
        node = target
    if "allOf" in node and len(node["allOf"]) == 1:
        inner = _resolve(node.pop("allOf")[0], defs)
        inner.update(node)
        node = inner
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        if len(branches) == 1:
            del node["anyOf"]
            inner = _resolve(branches[0], defs)
            inner.update(node)
            node = inner
    return node


def _structural(node: Schema, defs: dict[str, Schema]) -> Schema:
    node = _resolve(node, defs)
    out: Schema = {}
    if node.pop("x-tpuft-quantity", False):
        # int-or-string resource quantity, in the form Kubernetes' own CRDs use.
        return {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY,
            "x-kubernetes-int-or-string": True,
        }
    volume_items = node.pop("x-tpuft-volume-items", False)
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "default" and value is None:
            continue
        if key == "additionalProperties" and value is False:
            continue
        if key == "const":
            out["enum"] = [value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "properties":
            out["properties"] = {name: _structural(prop, defs) for name, prop in value.items()}
        elif key == "items":
            out["items"] = _structural(value, defs)
        elif key == "additionalProperties" and isinstance(value, dict):
            out["additionalProperties"] = _structural(value, defs)
        else:
            out[key] = copy.deepcopy(value)
    if "enum" in out and "type" not in out:
        out["type"] = "integer" if all(isinstance(v, int) for v in out["enum"]) else "string"
    if volume_items:
        # A core/v1 Volume is large and open-ended (CSI, PVC, secret, ...); keep it as the user wrote
        # it, with only `name` checked, so the schema stays structural without copying core/v1.
        out["items"] = {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string", "maxLength": 63, "description": "Volume name."}},
            "x-kubernetes-preserve-unknown-fields": True,
            "description": "A core/v1 Volume.",
        }
    return _ordered(out)


# Reading order in the YAML: what a node is, then what it says, then its constraints, then children.
_FIRST = ("type", "description", "default", "enum")
_LAST = ("required", "properties", "additionalProperties", "items", "x-kubernetes-validations")


def _ordered(node: Schema) -> Schema:
    head = {k: node[k] for k in _FIRST if k in node}
    tail = {k: node[k] for k in _LAST if k in node}
    middle = {k: v for k, v in sorted(node.items()) if k not in head and k not in tail}
    return {**head, **middle, **tail}


def schema_of(model: type[Any]) -> Schema:
    """The structural OpenAPI v3 schema of a pydantic model (wire names, i.e. camelCase)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}))


def crd() -> dict[str, Any]:
    """The TPUFineTune CRD as a dict, ready to serialise."""
    spec = schema_of(TPUFineTuneSpec)
    for field in cel.IMMUTABLE_FIELDS:
        prop = spec["properties"][field]
        prop["x-kubernetes-validations"] = [
            *prop.get("x-kubernetes-validations", []),
            cel.immutable_field_rule(field),
        ]
    status = schema_of(TPUFineTuneStatus)
    root: Schema = {
        "type": "object",
        "description": (
            "TPUFineTune fine-tunes a language model on GKE TPU slices with PyTorch/XLA FSDPv2. The "
            "operator runs it as a JobSet (one Job per slice, one pod per TPU VM)."
        ),
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": FINETUNE.api_version},
            "kind": {"type": "string", "description": FINETUNE.kind},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": FINETUNE.group,
            "names": {
                "kind": FINETUNE.kind,
                "listKind": f"{FINETUNE.kind}List",
                "plural": FINETUNE.plural,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": FINETUNE.version,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


HEADER = (
    "# Generated by `tpuft crd --write` from operator/tpuft_operator/api/models.py. Do not edit:\n"
    "# change the models and regenerate (a unit test fails when this file is stale).\n"
)


def crd_yaml() -> str:
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=100)
