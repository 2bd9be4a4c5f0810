"""Checking a TPUFineTune without a cluster: the one error type, and the rules beyond the schema.

`parse` turns a dict (a YAML document, or the object kopf hands the operator) into a `TPUFineTune` or
raises `SpecError`. It applies, in order: the pydantic models (types, bounds, enums: what the CRD's
OpenAPI schema checks), then `validate` (what the CRD's CEL rules check, from the same catalog, plus
what CEL cannot check cheaply: URI formats, reserved names). So `tpuft render` rejects exactly what
the apiserver rejects, and a little more, with the same kind of message: the field, then the reason.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tpuft_operator.api.models import TPUFineTune, TPUFineTuneSpec
from tpuft_operator.topology import TPU_RESOURCE, TopologyError, resolve

GCS_URI = re.compile(r"^gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/[^\s]*)?$")
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")

# Environment variables the renderer sets itself; a user's env entry must not shadow them.
RESERVED_ENV = frozenset(
    {
        "TPUFT_SLICE_INDEX",
        "TPUFT_RESTART_ATTEMPT",
        "TPUFT_COORDINATOR_ADDRESS",
        "POD_NAME",
        "POD_NAMESPACE",
        "JOB_COMPLETION_INDEX",
        "TPU_WORKER_ID",
        "TPU_WORKER_HOSTNAMES",
    }
)
# Names the renderer uses for its own volume.
RESERVED_VOLUMES = frozenset({"tpuft-config"})


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


def parse(obj: dict[str, Any]) -> TPUFineTune:
    """A validated TPUFineTune from a dict, or `SpecError` listing every problem."""
    try:
        ft = TPUFineTune.model_validate(obj)
    except ValidationError as error:
        raise SpecError.of(_pydantic_errors(error)) from None
    errors = validate(ft.spec)
    if errors:
        raise SpecError.of(errors)
    return ft


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

    mesh = spec.fsdp.mesh
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

    training = spec.training
    if (training.max_steps is None) == (training.epochs is None):
        errors.append(FieldError("spec.training", "set exactly one of maxSteps or epochs"))
    if training.lora is not None and training.method != "lora":
        errors.append(FieldError("spec.training.lora", "lora settings apply only with method: lora"))
    if training.epochs is not None and not math.isfinite(training.epochs):
        errors.append(FieldError("spec.training.epochs", "must be a finite number"))

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
    for i, mount in enumerate(spec.volume_mounts or []):
        if mount.name not in volume_names:
            errors.append(
                FieldError(f"spec.volumeMounts[{i}].name", f"no volume named {mount.name!r} in spec.volumes")
            )
        if mount.mount_path == "/etc/tpuft" or mount.mount_path.startswith("/etc/tpuft/"):
            errors.append(
                FieldError(f"spec.volumeMounts[{i}].mountPath", "/etc/tpuft holds the trainer config")
            )
    return errors
