"""CEL `x-kubernetes-validations` rules of the TPUFineTune CRD, generated from the topology catalog.

Why CEL: the apiserver then rejects a wrong TPU shape at `kubectl apply`, with a message a person
understands, before anything is created. Every value in these rules (valid topologies, host sizes,
largest slice) is read from `tpuft_operator.topology.FAMILIES`; nothing is copied by hand, so the
catalog and the CRD cannot disagree. `tpuft_operator.api.validation.validate` enforces the same rules
in Python (for `tpuft render`/`plan` and the operator), and the unit tests compare the two.

Each rule returns a dict in the apiextensions.k8s.io/v1 ValidationRule shape:
``{rule, message, fieldPath?, reason?}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import JsonValue

from tpuft_operator.topology import FAMILIES, TpuFamily
from tpuft_operator.trainer_stack import LIBTPU_VERSION, TORCH_XLA_VERSION
from tpuft_trainer.pod_contract import (
    CHECKPOINT_REQUEST_ANNOTATION,
    RESERVED_ANNOTATIONS,
    TRAINER_CONFIG_ANNOTATION,
)

# Up to three dimensions of up to four digits: long enough for every GKE shape (16x20x28, 4x4x244),
# short enough that int() and products in CEL stay cheap and cannot overflow.
TOPOLOGY_PATTERN = r"^[1-9][0-9]{0,3}(x[1-9][0-9]{0,3}){1,2}$"

IMMUTABLE_MESSAGE = (
    "is immutable: delete and recreate the TPUFineTune to change it; only spec.suspend may change on a run"
)

Rule = dict[str, Any]

# The pod annotations the operator writes (the trainer config, its checkpoint requests) are reserved:
# tpuft_trainer/pod_contract.py names them.
RESERVED_ANNOTATION_MESSAGE = (
    f"{TRAINER_CONFIG_ANNOTATION} and {CHECKPOINT_REQUEST_ANNOTATION} are reserved: the operator writes "
    "the trainer config and its checkpoint requests there"
)
COMPILATION_CACHE_MESSAGE = (
    "must be inside one of spec.volumeMounts (a volume every host sees): in the container's own "
    "filesystem the cache would be lost with the pod, and a restart could not use it"
)

# CEL building blocks over a TpuSpec (`self` is spec.tpu).
_WELL_FORMED = f"self.topology.matches('{TOPOLOGY_PATTERN}')"
_DIMS = "self.topology.split('x')"


def _dim(i: int, dims: str = _DIMS) -> str:
    return f"int({dims}[{i}])"


def _chips(dims: str = _DIMS) -> str:
    """CEL product of the topology's dimensions (2-D or 3-D)."""
    two = f"{_dim(0, dims)} * {_dim(1, dims)}"
    return f"(size({dims}) == 2 ? {two} : {two} * {_dim(2, dims)})"


def _cel_list(values: Sequence[str]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


def _topology_ok(fam: TpuFamily) -> str:
    if fam.dimensions == 2:
        return f"self.topology in {_cel_list(fam.topologies_2d)}"
    cube = (
        f"size({_DIMS}) == 3 && {_DIMS}.all(d, int(d) % 4 == 0)"
        f" && {_dim(0)} <= {_dim(1)} && {_dim(1)} <= {_dim(2)}"
        f" && {_chips()} <= {fam.max_chips_per_slice}"
        f" && {_dim(2)} <= {fam.max_side}"  # ascending: the last side is the longest
    )
    return f"self.topology in {_cel_list(fam.small_topologies_3d)} || ({cube})"


def _topology_message(fam: TpuFamily) -> str:
    if fam.dimensions == 2:
        return f"{fam.name} slices have a 2-D topology AxB, one of: {fam.describe_topologies()}"
    return f"{fam.name} slices have a 3-D topology {fam.describe_topologies()}"


def _default_host_size() -> str:
    """CEL map literal: the family's default chips per host (every family uses 4 today)."""
    return "{" + ", ".join(f"'{f.name}': {f.default_chips_per_host}" for f in FAMILIES.values()) + "}"


def _multihost_host_size() -> str:
    return "{" + ", ".join(f"'{f.name}': {f.multihost_chips_per_host}" for f in FAMILIES.values()) + "}"


def _hosts_more_than_one() -> str:
    """CEL: the slice spans several hosts (chipsPerHost, or its documented default)."""
    per_host = f"(has(self.chipsPerHost) ? self.chipsPerHost : {_default_host_size()}[self.type])"
    return f"{_chips()} > {per_host}"


def as_json(rules: list[Rule]) -> list[JsonValue]:
    """The rules typed as JSON values (what pydantic's json_schema_extra accepts)."""
    return [dict(rule) for rule in rules]


def tpu_rules() -> list[Rule]:
    """Rules on spec.tpu: topology per type, host size per type and topology, multislice, placement."""
    rules: list[Rule] = []
    for fam in FAMILIES.values():
        rules.append(
            {
                "rule": f"self.type != '{fam.name}' || !{_WELL_FORMED} || {_topology_ok(fam)}",
                "message": _topology_message(fam),
                "fieldPath": ".topology",
                "reason": "FieldValueInvalid",
            }
        )
    for fam in FAMILIES.values():
        choices = ", ".join(str(c) for c in fam.chips_per_host_choices)
        rules.append(
            {
                "rule": (
                    f"self.type != '{fam.name}' || !has(self.chipsPerHost) || self.chipsPerHost in [{choices}]"
                ),
                "message": f"{fam.name} hosts have {fam.describe_chips_per_host()} chips",
                "fieldPath": ".chipsPerHost",
                "reason": "FieldValueInvalid",
            }
        )
    multi = _multihost_host_size()
    rules.append(
        {
            "rule": (
                f"!has(self.chipsPerHost) || !{_WELL_FORMED} || {_chips()} == self.chipsPerHost"
                f" || (self.chipsPerHost == {multi}[self.type] && {_chips()} % self.chipsPerHost == 0"
                f" && {_chips()} > self.chipsPerHost)"
            ),
            "message": (
                "chipsPerHost does not fit the topology: 1-chip and 8-chip hosts exist only as a single-host "
                "slice of exactly that many chips; larger slices use 4-chip hosts"
            ),
            "fieldPath": ".chipsPerHost",
            "reason": "FieldValueInvalid",
        }
    )
    rules.append(
        {
            "rule": f"self.slices <= 1 || !{_WELL_FORMED} || {_hosts_more_than_one()}",
            "message": (
                "multislice (slices > 1) needs multi-host slices, e.g. v5e/v6e 4x4 or v4/v5p/tpu7x 2x2x2 "
                "and larger; a single-host slice cannot join a multislice run"
            ),
            "fieldPath": ".slices",
            "reason": "FieldValueInvalid",
        }
    )
    placement = [f.name for f in FAMILIES.values() if f.multihost_uses_placement_policy]
    rules.append(
        {
            "rule": (
                f"!has(self.placementPolicy) || (self.type in {_cel_list(placement)}"
                f" && (!{_WELL_FORMED} || {_hosts_more_than_one()}))"
            ),
            "message": f"placementPolicy applies only to multi-host slices of {', '.join(placement)}",
            "fieldPath": ".placementPolicy",
            "reason": "FieldValueInvalid",
        }
    )
    rules.append(
        {
            "rule": "!has(self.spotGracePeriodSeconds) || (has(self.spot) && self.spot)",
            "message": SPOT_GRACE_MESSAGE,
            "fieldPath": ".spotGracePeriodSeconds",
            "reason": "FieldValueForbidden",
        }
    )
    return rules


def training_rules() -> list[Rule]:
    return [
        {
            "rule": "has(self.maxSteps) != has(self.epochs)",
            "message": "set exactly one of maxSteps or epochs",
            "reason": "FieldValueRequired",
        },
        {
            "rule": "!has(self.lora) || self.method == 'lora'",
            "message": "lora settings apply only with method: lora",
            "fieldPath": ".lora",
            "reason": "FieldValueForbidden",
        },
        {
            "rule": "!has(self.dpo) || (has(self.objective) && self.objective == 'dpo')",
            "message": DPO_SETTINGS_MESSAGE,
            "fieldPath": ".dpo",
            "reason": "FieldValueForbidden",
        },
        {
            "rule": "!has(self.warmupSteps) || !has(self.warmupRatio)",
            "message": WARMUP_MESSAGE,
            "fieldPath": ".warmupSteps",
            "reason": "FieldValueForbidden",
        },
        {
            "rule": "!has(self.warmupSteps) || !has(self.maxSteps) || self.warmupSteps < self.maxSteps",
            "message": WARMUP_LENGTH_MESSAGE,
            "fieldPath": ".warmupSteps",
            "reason": "FieldValueInvalid",
        },
    ]


WARMUP_MESSAGE = "set at most one of warmupSteps and warmupRatio"
SPOT_GRACE_MESSAGE = "spotGracePeriodSeconds applies only with spot: true"
DPO_SETTINGS_MESSAGE = "dpo settings apply only with objective: dpo"
DPO_FORMAT_MESSAGE = (
    "objective dpo needs dataset.format: preference (a prompt, a chosen and a rejected completion)"
)
PREFERENCE_OBJECTIVE_MESSAGE = "format preference needs training.objective: dpo"
PREFERENCE_PACKING_MESSAGE = (
    "packing applies only to formats text and chat (preference pairs are scored whole)"
)
WARMUP_LENGTH_MESSAGE = "warmupSteps must be fewer than maxSteps (the run would never reach learningRate)"
EVAL_SOURCE_MESSAGE = "set at most one of evalSplit and evalFraction"
EVAL_SPLIT_MESSAGE = "evalSplit must differ from split: evaluating on the training rows measures nothing"
ASSISTANT_ONLY_MESSAGE = "assistantOnlyLoss applies only to format: chat (text rows have no assistant turns)"
EVAL_STEPS_MESSAGE = "evalSteps needs evaluation rows: set dataset.evalSplit or dataset.evalFraction"


def dataset_rules() -> list[Rule]:
    return [
        {
            "rule": "!has(self.evalSplit) || !has(self.evalFraction)",
            "message": EVAL_SOURCE_MESSAGE,
            "fieldPath": ".evalSplit",
            "reason": "FieldValueForbidden",
        },
        {
            "rule": "!has(self.evalSplit) || self.evalSplit != (has(self.split) ? self.split : 'train')",
            "message": EVAL_SPLIT_MESSAGE,
            "fieldPath": ".evalSplit",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": "!has(self.assistantOnlyLoss) || !self.assistantOnlyLoss || (has(self.format) && self.format == 'chat')",
            "message": ASSISTANT_ONLY_MESSAGE,
            "fieldPath": ".assistantOnlyLoss",
            "reason": "FieldValueForbidden",
        },
        {
            "rule": "!has(self.packing) || !self.packing || !has(self.format) || self.format != 'preference'",
            "message": PREFERENCE_PACKING_MESSAGE,
            "fieldPath": ".packing",
            "reason": "FieldValueForbidden",
        },
    ]


def _objective_rules() -> list[Rule]:
    """objective dpo <=> format preference, each way with the field to change named."""
    dpo = "(has(self.training.objective) && self.training.objective == 'dpo')"
    preference = "(has(self.dataset.format) && self.dataset.format == 'preference')"
    return [
        {
            "rule": f"!{dpo} || {preference}",
            "message": DPO_FORMAT_MESSAGE,
            "fieldPath": ".dataset.format",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": f"!{preference} || {dpo}",
            "message": PREFERENCE_OBJECTIVE_MESSAGE,
            "fieldPath": ".training.objective",
            "reason": "FieldValueInvalid",
        },
    ]


# spec.backend (docs/trainer.md, "Backends"). What is refused for a backend at apply time, and why.
# Sources: torch_xla's tags (v2.9.0, 2025-11, the last), its setup.py (libtpu pin), its TPU CI
# (.github/workflows/_tpu_ci.yml, runs-on: v4-runner-set), Google's Ironwood page
# (docs.cloud.google.com/tpu/docs/tpu7x), which points PyTorch users to TorchTPU.
XLA_ON_TPU7X_MESSAGE = (
    f"backend xla cannot run on tpu7x (Ironwood): torch_xla {TORCH_XLA_VERSION} is its last release and "
    f"pins libtpu {LIBTPU_VERSION}, no torch_xla release note says tpu7x works (its TPU CI runs on v4 "
    "only), and Google points PyTorch users on Ironwood to TorchTPU; set backend: native (torch-native "
    "FSDP2 on TorchTPU)"
)
# The trainer refuses this too (tpuft_trainer/config.py, TrainerConfig's validators); here it is
# refused at `kubectl apply`, on the field to change, before a prepare Job or a TPU.
NATIVE_TENSOR_RECIPE_MESSAGE = (
    "tensor > 1 on backend native trains method full with objective sft only for now: transformers' "
    "tensor-parallel plan names the base model's linear layers (peft's LoRA layers wrap them), and trl's "
    "fused LM head for DPO reads the LM head's weight whole (the plan splits it over the vocabulary); "
    "set tensor: 1 (FSDP2 alone), or backend: xla"
)
_NATIVE = "(has(self.backend) && self.backend == 'native')"


def _backend_rules() -> list[Rule]:
    """Each refusal on the field a person would change: backend for tpu7x, the mesh's tensor axis for
    tensor parallelism with LoRA or DPO on native (spec.backend defaults to xla, so a spec without it
    is an xla run)."""
    return [
        {
            "rule": f"self.tpu.type != 'tpu7x' || {_NATIVE}",
            "message": XLA_ON_TPU7X_MESSAGE,
            "fieldPath": ".backend",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": (
                f"!{_NATIVE} || !has(self.fsdp) || !has(self.fsdp.mesh) || !has(self.fsdp.mesh.tensor) "
                "|| self.fsdp.mesh.tensor <= 1 || ((!has(self.training.method) || self.training.method "
                "!= 'lora') && (!has(self.training.objective) || self.training.objective != 'dpo'))"
            ),
            "message": NATIVE_TENSOR_RECIPE_MESSAGE,
            "fieldPath": ".fsdp.mesh.tensor",
            "reason": "FieldValueInvalid",
        },
    ]


def _eval_steps_rule() -> Rule:
    return {
        "rule": "!has(self.training.evalSteps) || has(self.dataset.evalSplit) || has(self.dataset.evalFraction)",
        "message": EVAL_STEPS_MESSAGE,
        "fieldPath": ".training.evalSteps",
        "reason": "FieldValueRequired",
    }


# Fields of the spec that never change after creation, with whether they are optional (no default):
# an optional field's rule must also catch it being added or removed. CEL transition rules cannot
# see status, so "while a run is active" is enforced as "always"; docs/api.md explains the choice.
IMMUTABLE_FIELDS: dict[str, bool] = {
    "model": False,
    "dataset": False,
    "tpu": False,
    "backend": False,
    "fsdp": False,
    "training": False,
    "output": False,
    "image": True,
    "maxRestarts": False,
    "terminationGracePeriodSeconds": True,
    "maintenance": False,
    "queueName": True,
    "priorityClassName": True,
    "serviceAccountName": True,
    "resources": True,
    "tolerations": True,
    "volumes": True,
    "volumeMounts": True,
    "env": True,
    "podAnnotations": True,
    "network": True,
    "prepare": False,
}


def _mesh_rule() -> Rule:
    dims = "self.tpu.topology.split('x')"
    chips = _chips(dims)
    m = "self.fsdp.mesh"
    tensor = f"(has({m}.tensor) ? {m}.tensor : 1)"
    data = f"(has({m}.data) ? {m}.data : 1)"
    well_formed = f"self.tpu.topology.matches('{TOPOLOGY_PATTERN}')"
    return {
        "rule": (
            f"!has(self.fsdp) || !has({m}) || !{well_formed} || (has({m}.fsdp)"
            f" ? {m}.fsdp * {tensor} * {data} == {chips}"
            f" : {chips} % ({tensor} * {data}) == 0)"
        ),
        "message": (
            "fsdp x tensor x data must equal the chips of one slice (slices add the DCN axis); "
            "leave fsdp out to give it every chip left"
        ),
        "fieldPath": ".fsdp.mesh",
        "reason": "FieldValueInvalid",
    }


def _reserved_annotation_rule() -> Rule:
    absent = " && ".join(f"!('{key}' in self.podAnnotations)" for key in RESERVED_ANNOTATIONS)
    return {
        "rule": f"!has(self.podAnnotations) || ({absent})",
        "message": RESERVED_ANNOTATION_MESSAGE,
        "fieldPath": ".podAnnotations",
        "reason": "FieldValueForbidden",
    }


def _compilation_cache_rule() -> Rule:
    path = "self.fsdp.compilationCachePath"
    return {
        "rule": (
            f"!has(self.fsdp) || !has({path}) || (has(self.volumeMounts) && self.volumeMounts.exists(m, "
            f"{path} == m.mountPath || {path}.startsWith(m.mountPath.endsWith('/') ? m.mountPath : m.mountPath + '/')))"
        ),
        "message": COMPILATION_CACHE_MESSAGE,
        "fieldPath": ".fsdp.compilationCachePath",
        "reason": "FieldValueInvalid",
    }


def spec_rules() -> list[Rule]:
    return [
        _mesh_rule(),
        _reserved_annotation_rule(),
        _compilation_cache_rule(),
        _eval_steps_rule(),
        *_objective_rules(),
        *_backend_rules(),
        _optional_fields_stay_rule(),
    ]


def immutable_field_rule(field: str) -> Rule:
    """The rule on spec.<field> itself: it may not change once the run exists.

    On the field, not on spec: the apiserver evaluates every transition rule (one using oldSelf) on
    each update of the object, status patches included (the operator's and every pod's progress
    reports). Measured at 300 patches: 8.2-8.7 ms of kube-apiserver CPU per status patch with nineteen
    such rules on spec, 6.6-7.9 ms with one on each field, 5.0-5.9 ms with no CEL. An optional field's
    rule runs only while the field is present before and after, so adding or removing one is
    `_optional_fields_stay_rule`'s."""
    return {
        "message": f"spec.{field} {IMMUTABLE_MESSAGE}",
        "reason": "FieldValueForbidden",
        "rule": "self == oldSelf",
    }


def _optional_fields_stay_rule() -> Rule:
    """No optional immutable field is added or removed on a run (one cheap rule: `has` only); the
    message names the first such field."""
    optional = [field for field, is_optional in IMMUTABLE_FIELDS.items() if is_optional]
    first_changed = "".join(f"has(self.{f}) != has(oldSelf.{f}) ? '{f}' : " for f in optional[:-1])
    return {
        "rule": " && ".join(f"has(self.{f}) == has(oldSelf.{f})" for f in optional),
        "messageExpression": f"'spec.' + ({first_changed}'{optional[-1]}') + ' {IMMUTABLE_MESSAGE}'",
        "message": f"spec.<field> {IMMUTABLE_MESSAGE}",
        "reason": "FieldValueForbidden",
    }
