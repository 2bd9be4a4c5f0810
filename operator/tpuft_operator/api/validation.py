"""Checking a TPUFineTune without a cluster: the one error type, and the rules beyond the schema.

`parse` turns a dict (a YAML document, or the object kopf hands the operator) into a `TPUFineTune` or
raises `SpecError`. It applies, in order: the pydantic models (types, bounds, enums: what the CRD's
OpenAPI schema checks), then `validate` (what the CRD's CEL rules check, from the same catalog, plus
what CEL cannot check cheaply: URI formats, reserved names). So `tpuft render` rejects exactly what
the apiserver rejects, and a little more, with the same kind of message: the field, then the reason.
`parse_run` (of a dict) and `validate_run` (of a model) return a `ValidatedRun` instead: the run and
the TPU slice shape validation resolved, which the renderer uses rather than resolving it again.

One rule needs the model: a host (TPU VM) must hold its share of a checkpoint in RAM while saving it.
The operator cannot read a model's config.json, so the rule applies to the models of `tpuft plan`'s
built-in table (plan.KNOWN_MODELS) and is computed there (`plan.host_ram_refusal`); this module
imports plan, never the reverse (plan imports only api.models and topology), so there is no cycle.
`tpuft plan` parses with ``check_host_ram=False`` to show the whole estimate of such a spec instead.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from pydantic import ValidationError

from tpuft_operator import plan
from tpuft_operator.api.cel import (
    ASSISTANT_ONLY_MESSAGE,
    COMPILATION_CACHE_MESSAGE,
    DPO_FORMAT_MESSAGE,
    DPO_SETTINGS_MESSAGE,
    EVAL_SOURCE_MESSAGE,
    EVAL_SPLIT_MESSAGE,
    EVAL_STEPS_MESSAGE,
    NATIVE_TENSOR_RECIPE_MESSAGE,
    PREFERENCE_OBJECTIVE_MESSAGE,
    PREFERENCE_PACKING_MESSAGE,
    RESERVED_ANNOTATION_MESSAGE,
    SPOT_GRACE_MESSAGE,
    WARMUP_LENGTH_MESSAGE,
    WARMUP_MESSAGE,
    XLA_ON_TPU7X_MESSAGE,
)
from tpuft_operator.api.models import (
    DNS_LABEL,
    DNS_SUBDOMAIN,
    Resources,
    Toleration,
    TPUFineTune,
    TPUFineTuneSpec,
)
from tpuft_operator.topology import TPU_RESOURCE, SliceShape, TopologyError, resolve
from tpuft_trainer.pod_contract import (
    CONFIG_DIR,
    DEFAULT_TOKEN_ENV,
    RESERVED_ANNOTATIONS,
    RESERVED_ENV,
    RESERVED_VOLUMES,
)

GCS_URI = re.compile(r"^gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/[^\s]*)?$")
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")

# The names a spec may not take over (the renderer's environment variables and volume, the pod
# identity Kubernetes and GKE set, the operator's annotations) are in tpuft_trainer/pod_contract.py.

# What core/v1 pod validation checks in the parts of the pod a spec fills in, and the CRD cannot: a
# JobSet with such a pod template is accepted, but its Jobs are refused and the run never starts.
QUALIFIED_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
VOLUME_SOURCES = frozenset(
    {
        "awsElasticBlockStore", "azureDisk", "azureFile", "cephfs", "cinder", "configMap", "csi",
        "downwardAPI", "emptyDir", "ephemeral", "fc", "flexVolume", "flocker", "gcePersistentDisk",
        "gitRepo", "glusterfs", "hostPath", "image", "iscsi", "nfs", "persistentVolumeClaim",
        "photonPersistentDisk", "portworxVolume", "projected", "quobyte", "rbd", "scaleIO", "secret",
        "storageos", "vsphereVolume",
    }
)  # fmt: skip
STANDARD_RESOURCES = frozenset({"cpu", "memory", "ephemeral-storage"})
FIELD_PATHS = frozenset(
    {
        "metadata.name", "metadata.namespace", "metadata.uid", "metadata.labels", "metadata.annotations",
        "spec.nodeName", "spec.serviceAccountName", "status.hostIP", "status.hostIPs", "status.podIP",
        "status.podIPs",
    }
)  # fmt: skip
FIELD_PATH_KEY = re.compile(r"^metadata\.(labels|annotations)\['[^']+'\]$")
_QUANTITY_SUFFIX: dict[str, Decimal | int] = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}  # fmt: skip
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$")


@dataclass(frozen=True)
class FieldError:
    """One problem: the spec path to fix (wire names, e.g. ``spec.tpu.topology``) and why."""

    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.field}: {self.reason}"


class SpecError(ValueError):
    """The project's one error for a TPUFineTune that cannot run. ``field`` and ``reason`` name the
    first problem; ``errors`` holds all of them."""

    def __init__(self, field: str, reason: str, *, errors: tuple[FieldError, ...] = ()) -> None:
        self.errors = errors or (FieldError(field, reason),)
        self.field = field
        self.reason = reason
        super().__init__("; ".join(str(e) for e in self.errors))

    @classmethod
    def of(cls, errors: list[FieldError]) -> SpecError:
        return cls(errors[0].field, errors[0].reason, errors=tuple(errors))


def _loc(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += ("." if path else "") + part
    return path


def _is_type_tag(part: str) -> bool:
    return (
        "[" in part
        or part.startswith(("function-", "constrained-"))
        or part in {"int", "str", "float", "bool"}
    )


def _pydantic_errors(error: ValidationError) -> list[FieldError]:
    out = []
    for item in error.errors():
        # Union members and constrained types add their own names to the path; keep the user's fields.
        loc = tuple(p for p in item["loc"] if not (isinstance(p, str) and _is_type_tag(p)))
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown field"
        out.append(FieldError(_loc(loc) or "(root)", message))
    return out


@dataclass(frozen=True)
class ValidatedRun:
    """A TPUFineTune that passed every rule, and the TPU slice shape its spec resolved to."""

    finetune: TPUFineTune
    shape: SliceShape


def parse_run(obj: dict[str, Any], *, check_host_ram: bool = True) -> ValidatedRun:
    """A validated TPUFineTune from a dict, with its slice shape, or `SpecError` listing every problem.

    Strict types, as the apiserver's schema: "yes" is not a boolean, "3" not an integer. The status
    (timestamps as strings) is not needed to render and is left out. ``check_host_ram=False`` skips
    the host-RAM rule (for `tpuft plan`, which shows that estimate in full)."""
    try:
        ft = TPUFineTune.model_validate({k: v for k, v in obj.items() if k != "status"}, strict=True)
    except ValidationError as error:
        raise SpecError.of(_pydantic_errors(error)) from None
    errors = []
    name = ft.metadata.name
    if len(name) > 253 or not re.match(DNS_SUBDOMAIN, name):
        errors.append(FieldError("metadata.name", f"{name!r} is not a lowercase RFC 1123 subdomain"))
    spec_errors, shape = _check(ft.spec, check_host_ram=check_host_ram)
    errors += spec_errors
    if errors or shape is None:  # no shape means a spec.tpu error in the list
        raise SpecError.of(errors)
    return ValidatedRun(ft, shape)


def parse(obj: dict[str, Any], *, check_host_ram: bool = True) -> TPUFineTune:
    """A validated TPUFineTune from a dict, or `SpecError` listing every problem (see `parse_run`)."""
    return parse_run(obj, check_host_ram=check_host_ram).finetune


def validate_run(ft: TPUFineTune) -> ValidatedRun:
    """``ft`` with its slice shape, or `SpecError` listing every problem of its spec (the model's
    field types were checked when it was built)."""
    errors, shape = _check(ft.spec)
    if errors or shape is None:
        raise SpecError.of(errors)
    return ValidatedRun(ft, shape)


def _uri_or_path(value: str, field: str, *, hub: bool) -> list[FieldError]:
    if value.startswith("gs://"):
        if not GCS_URI.match(value):
            return [FieldError(field, f"{value!r} is not a valid gs://bucket/path URI")]
        return []
    if value.startswith("/"):
        return []
    if hub and HUB_ID.match(value):
        return []
    kinds = (
        "a hub id (org/name), a gs:// URI or an absolute path" if hub else "a gs:// URI or an absolute path"
    )
    return [FieldError(field, f"{value!r} must be {kinds}")]


def validate(spec: TPUFineTuneSpec) -> list[FieldError]:
    """Every rule beyond the field types, as a list (empty when the spec can run). Pure."""
    return _check(spec)[0]


def _check(
    spec: TPUFineTuneSpec, *, check_host_ram: bool = True
) -> tuple[list[FieldError], SliceShape | None]:
    """`validate`'s errors, and the slice shape spec.tpu resolves to (None when it does not)."""
    errors: list[FieldError] = []
    tpu = spec.tpu
    try:
        shape = resolve(tpu.type, tpu.topology, slices=tpu.slices, chips_per_host=tpu.chips_per_host)
    except TopologyError as error:
        errors.append(FieldError(error.field, error.reason))
        shape = None
    placement_ok = shape is None or (shape.family.multihost_uses_placement_policy and shape.multi_host)
    if tpu.placement_policy is not None and not placement_ok:
        errors.append(
            FieldError("spec.tpu.placementPolicy", "applies only to multi-host slices of tpu7x (Ironwood)")
        )
    if tpu.spot_grace_period_seconds is not None and not tpu.spot:
        errors.append(FieldError("spec.tpu.spotGracePeriodSeconds", SPOT_GRACE_MESSAGE))

    mesh = spec.fsdp.mesh
    before_mesh = len(errors)
    if shape is not None and mesh is not None:
        chips = shape.chips_per_slice
        others = mesh.tensor * mesh.data
        if mesh.fsdp is not None and mesh.fsdp * others != chips:
            errors.append(
                FieldError(
                    "spec.fsdp.mesh",
                    f"fsdp x tensor x data = {mesh.fsdp} x {mesh.tensor} x {mesh.data} = {mesh.fsdp * others}, "
                    f"but a {tpu.topology} slice has {chips} chips (slices add the DCN axis)",
                )
            )
        elif mesh.fsdp is None and chips % others != 0:
            errors.append(
                FieldError(
                    "spec.fsdp.mesh",
                    f"tensor x data = {others} does not divide the {chips} chips of a {tpu.topology} slice",
                )
            )
    if check_host_ram and shape is not None and len(errors) == before_mesh:
        # A host must hold its chips' share of a checkpoint (plan.py: known models only).
        refusal = plan.host_ram_refusal(spec, shape)
        if refusal is not None:
            errors.append(FieldError("spec.tpu.topology", refusal))

    training = spec.training
    if (training.max_steps is None) == (training.epochs is None):
        errors.append(FieldError("spec.training", "set exactly one of maxSteps or epochs"))
    if training.lora is not None and training.method != "lora":
        errors.append(FieldError("spec.training.lora", "lora settings apply only with method: lora"))
    if training.epochs is not None and not math.isfinite(training.epochs):
        errors.append(FieldError("spec.training.epochs", "must be a finite number"))
    errors += _recipe_errors(spec)

    errors += _uri_or_path(spec.model.name, "spec.model.name", hub=True)
    errors += _uri_or_path(spec.dataset.name, "spec.dataset.name", hub=True)
    errors += _uri_or_path(spec.output.uri, "spec.output.uri", hub=False)

    if spec.resources is not None:
        for kind, values in (("requests", spec.resources.requests), ("limits", spec.resources.limits)):
            if values and TPU_RESOURCE in values:
                errors.append(
                    FieldError(
                        f"spec.resources.{kind}",
                        f"{TPU_RESOURCE} is set from the topology (chips per host); remove it",
                    )
                )
    for i, env in enumerate(spec.env or []):
        if env.name in RESERVED_ENV:
            errors.append(
                FieldError(f"spec.env[{i}].name", f"{env.name} is set by tpuft; choose another name")
            )
        elif env.name == DEFAULT_TOKEN_ENV and spec.model.token_secret_ref is not None:
            # The renderer sets it from the Secret: a second entry would leave which one wins to the kubelet.
            errors.append(
                FieldError(
                    f"spec.env[{i}].name",
                    f"{env.name} is set from spec.model.tokenSecretRef; remove one of the two",
                )
            )
        if (env.value is None) == (env.value_from is None):
            errors.append(FieldError(f"spec.env[{i}]", "set exactly one of value or valueFrom"))
    volume_names = [str(v.get("name", "")) for v in spec.volumes or []]
    for i, name in enumerate(volume_names):
        if name in RESERVED_VOLUMES:
            errors.append(
                FieldError(f"spec.volumes[{i}].name", f"{name} is used by tpuft; choose another name")
            )
        if volume_names.count(name) > 1:
            errors.append(FieldError(f"spec.volumes[{i}].name", f"duplicate volume name {name!r}"))
    errors += _pod_template_errors(spec)
    for i, mount in enumerate(spec.volume_mounts or []):
        if mount.name not in volume_names:
            errors.append(
                FieldError(f"spec.volumeMounts[{i}].name", f"no volume named {mount.name!r} in spec.volumes")
            )
        if mount.mount_path == CONFIG_DIR or mount.mount_path.startswith(f"{CONFIG_DIR}/"):
            errors.append(
                FieldError(f"spec.volumeMounts[{i}].mountPath", f"{CONFIG_DIR} holds the trainer config")
            )
    cache = spec.fsdp.compilation_cache_path
    if cache is not None and not any(
        cache == m.mount_path or cache.startswith(m.mount_path.rstrip("/") + "/")
        for m in spec.volume_mounts or []
    ):
        errors.append(FieldError("spec.fsdp.compilationCachePath", COMPILATION_CACHE_MESSAGE))
    return errors, shape


def _recipe_errors(spec: TPUFineTuneSpec) -> list[FieldError]:
    """The cross-field rules of the recipe (the CEL rules of the same names, in Python)."""
    errors: list[FieldError] = []
    dataset, training = spec.dataset, spec.training
    if dataset.eval_split is not None and dataset.eval_fraction is not None:
        errors.append(FieldError("spec.dataset.evalSplit", EVAL_SOURCE_MESSAGE))
    if dataset.eval_split is not None and dataset.eval_split == dataset.split:
        errors.append(FieldError("spec.dataset.evalSplit", EVAL_SPLIT_MESSAGE))
    if dataset.assistant_only_loss and dataset.format != "chat":
        errors.append(FieldError("spec.dataset.assistantOnlyLoss", ASSISTANT_ONLY_MESSAGE))
    if training.objective == "dpo" and dataset.format != "preference":
        errors.append(FieldError("spec.dataset.format", DPO_FORMAT_MESSAGE))
    if dataset.format == "preference" and training.objective != "dpo":
        errors.append(FieldError("spec.training.objective", PREFERENCE_OBJECTIVE_MESSAGE))
    if dataset.format == "preference" and dataset.packing:
        errors.append(FieldError("spec.dataset.packing", PREFERENCE_PACKING_MESSAGE))
    if training.dpo is not None and training.objective != "dpo":
        errors.append(FieldError("spec.training.dpo", DPO_SETTINGS_MESSAGE))
    if training.eval_steps is not None and dataset.eval_split is None and dataset.eval_fraction is None:
        errors.append(FieldError("spec.training.evalSteps", EVAL_STEPS_MESSAGE))
    # spec.backend: the CEL rules of _backend_rules, in Python.
    if spec.tpu.type == "tpu7x" and spec.backend != "native":
        errors.append(FieldError("spec.backend", XLA_ON_TPU7X_MESSAGE))
    if (
        spec.backend == "native"
        and spec.fsdp.mesh is not None
        and spec.fsdp.mesh.tensor > 1
        and (training.method == "lora" or training.objective == "dpo")
    ):
        errors.append(FieldError("spec.fsdp.mesh.tensor", NATIVE_TENSOR_RECIPE_MESSAGE))
    if training.warmup_steps is not None and training.warmup_ratio is not None:
        errors.append(FieldError("spec.training.warmupSteps", WARMUP_MESSAGE))
    elif (
        training.warmup_steps is not None
        and training.max_steps is not None
        and training.warmup_steps >= training.max_steps
    ):
        errors.append(FieldError("spec.training.warmupSteps", WARMUP_LENGTH_MESSAGE))
    for name, value in (
        ("evalFraction", dataset.eval_fraction),
        ("warmupRatio", training.warmup_ratio),
        ("weightDecay", training.weight_decay),
        ("maxGradNorm", training.max_grad_norm),
    ):
        if value is not None and not math.isfinite(value):
            section = "dataset" if name == "evalFraction" else "training"
            errors.append(FieldError(f"spec.{section}.{name}", "must be a finite number"))
    return errors


def quantity(value: int | str) -> Decimal | None:
    """A resource quantity's value ("500m" -> 0.5, "16Gi" -> 17179869184); None when it is not one."""
    match = _QUANTITY.match(str(value))
    if match is None:
        return None
    number, suffix = match.group(1), match.group(2) or ""
    try:
        if suffix[:1] in ("e", "E"):
            return Decimal(number + suffix)
        return Decimal(number) * Decimal(_QUANTITY_SUFFIX[suffix])
    except (InvalidOperation, KeyError):
        return None


def _pod_template_errors(spec: TPUFineTuneSpec) -> list[FieldError]:
    """The pod rules the apiserver applies only when the JobSet controller creates the Jobs: caught
    here, the run fails with the field named instead of waiting forever for pods that never come."""
    errors: list[FieldError] = []
    for key in spec.pod_annotations or {}:
        if key in RESERVED_ANNOTATIONS:
            errors.append(FieldError("spec.podAnnotations", RESERVED_ANNOTATION_MESSAGE))
        elif not QUALIFIED_NAME.match(key):
            errors.append(FieldError("spec.podAnnotations", f"{key!r} is not a valid annotation key"))
    errors += _toleration_errors(spec.tolerations, "spec.tolerations")
    for i, volume in enumerate(spec.volumes or []):
        where = f"spec.volumes[{i}]"
        name = str(volume.get("name", ""))
        if not re.match(DNS_LABEL, name):
            errors.append(FieldError(f"{where}.name", f"{name!r} is not a lowercase RFC 1123 label"))
        unknown = sorted(set(volume) - VOLUME_SOURCES - {"name"})
        if unknown:
            errors.append(FieldError(where, f"unknown field(s) {', '.join(unknown)} in a core/v1 Volume"))
        sources = sorted(set(volume) & VOLUME_SOURCES)
        if len(sources) > 1:
            errors.append(
                FieldError(where, f"a volume has one source, not {len(sources)}: {', '.join(sources)}")
            )
    errors += _resource_errors(spec.resources, "spec.resources")
    errors += _prepare_errors(spec)
    for i, env in enumerate(spec.env or []):
        source = env.value_from
        if source is None:
            continue
        chosen = [s for s in (source.secret_key_ref, source.config_map_key_ref, source.field_ref) if s]
        if len(chosen) != 1:
            errors.append(
                FieldError(
                    f"spec.env[{i}].valueFrom", "set exactly one of secretKeyRef, configMapKeyRef, fieldRef"
                )
            )
        ref = source.field_ref
        if ref is not None:
            path = ref.field_path
            if path not in FIELD_PATHS and not FIELD_PATH_KEY.match(path):
                errors.append(
                    FieldError(f"spec.env[{i}].valueFrom.fieldRef.fieldPath", f"{path!r} is not a pod field")
                )
    paths: set[str] = set()
    for i, mount in enumerate(spec.volume_mounts or []):
        where = f"spec.volumeMounts[{i}]"
        sub = mount.sub_path
        if sub and (sub.startswith("/") or ".." in sub.split("/")):
            errors.append(FieldError(f"{where}.subPath", "must be a relative path without '..'"))
        if mount.mount_path in paths:
            errors.append(FieldError(f"{where}.mountPath", f"{mount.mount_path} is mounted twice"))
        paths.add(mount.mount_path)
    return errors


def _toleration_errors(tolerations: Sequence[Toleration] | None, path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    for i, t in enumerate(tolerations or []):
        where = f"{path}[{i}]"
        if t.key and not QUALIFIED_NAME.match(t.key):
            errors.append(FieldError(f"{where}.key", f"{t.key!r} is not a valid taint key"))
        if not t.key and t.operator != "Exists":
            errors.append(FieldError(f"{where}.operator", "must be Exists when key is empty"))
        if t.operator == "Exists" and t.value:
            errors.append(FieldError(f"{where}.value", "must be empty when operator is Exists"))
        if t.toleration_seconds is not None and t.effect != "NoExecute":
            errors.append(FieldError(f"{where}.tolerationSeconds", "applies only with effect NoExecute"))
    return errors


def _resource_errors(resources: Resources | None, path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    if resources is None:
        return errors
    requests, limits = resources.requests or {}, resources.limits or {}
    for kind, values in (("requests", requests), ("limits", limits)):
        for name in values:
            prefixed = "/" in name
            if not QUALIFIED_NAME.match(name) or not (
                prefixed or name in STANDARD_RESOURCES or name.startswith("hugepages-")
            ):
                errors.append(
                    FieldError(f"{path}.{kind}", f"{name!r} is not a standard or qualified resource name")
                )
    for name, request in requests.items():
        if name in limits:
            low, high = quantity(request), quantity(limits[name])
            if low is not None and high is not None and low > high:
                errors.append(
                    FieldError(f"{path}.requests.{name}", f"{request} is more than the limit {limits[name]}")
                )
    return errors


def _prepare_errors(spec: TPUFineTuneSpec) -> list[FieldError]:
    """spec.prepare: the prepare pod's own scheduling and resources (a CPU pod: no TPU)."""
    prepare = spec.prepare
    errors = _toleration_errors(prepare.tolerations, "spec.prepare.tolerations")
    errors += _resource_errors(prepare.resources, "spec.prepare.resources")
    resources = prepare.resources
    for kind, values in (
        ("requests", resources.requests if resources else None),
        ("limits", resources.limits if resources else None),
    ):
        if values and TPU_RESOURCE in values:
            errors.append(
                FieldError(
                    f"spec.prepare.resources.{kind}",
                    f"the prepare pod runs on CPU: remove {TPU_RESOURCE} (the TPU pods get their chips from spec.tpu)",
                )
            )
    cpu = (resources.requests or {}).get("cpu") if resources else None
    if cpu is not None:
        cores = quantity(cpu)
        if cores is None or cores <= 0:
            errors.append(
                FieldError("spec.prepare.resources.requests.cpu", f"{cpu} is not a positive CPU quantity")
            )
    for key in prepare.node_selector or {}:
        if not QUALIFIED_NAME.match(key):
            errors.append(FieldError("spec.prepare.nodeSelector", f"{key!r} is not a valid label key"))
    return errors
