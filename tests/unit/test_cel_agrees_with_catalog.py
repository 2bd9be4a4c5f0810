"""The CRD's CEL rules and the Python catalog accept exactly the same TPU shapes.

Both come from topology.FAMILIES, but through different code (CEL strings vs `resolve`); this runs
thousands of (type, topology, chipsPerHost, slices, placementPolicy) combinations through the
apiserver's CEL (tools/crdcheck) and through `tpuft render`'s validation and requires the same verdict.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

from tests.unit import crdcheck
from tpuft_operator import topology
from tpuft_operator.api.models import TPUFineTuneSpec
from tpuft_operator.api.validation import validate

CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / "tpufinetunes.tpuft.dev.yaml"

BASE: dict[str, Any] = {
    "apiVersion": "tpuft.dev/v1alpha1",
    "kind": "TPUFineTune",
    "metadata": {"name": "cel"},
    "spec": {
        "model": {"name": "google/gemma-2-2b"},
        "dataset": {"name": "tatsu-lab/alpaca"},
        "tpu": {"type": "v5e", "topology": "2x2"},
        "training": {"maxSteps": 10},
        "output": {"uri": "gs://bucket/out"},
    },
}

# Near misses of every rule: wrong order, not a multiple of 4, too large, too long a side, 2-D vs 3-D.
EXTRA_TOPOLOGIES = [
    "1x1x1", "1x2", "2x1", "4x2", "2x8", "16x32", "32x32", "1x1x2", "2x1x2", "4x2x2", "8x4x4", "4x4x6",
    "4x6x8", "8x8x32", "16x16x20", "16x16x32", "4x4x244", "4x4x248", "12x24x24", "16x20x28", "16x24x24",
    "20x24x24", "16x16x16", "12x16x16", "3x3x3", "6x6x6", "4x4x256", "4x4x260", "4x4x548", "2x64",
]  # fmt: skip


def _topologies() -> list[str]:
    shapes: set[str] = set(EXTRA_TOPOLOGIES)
    for fam in topology.FAMILIES.values():
        valid = topology.valid_shapes(fam)
        shapes.update(valid[:25])
        shapes.update(valid[-5:])
    return sorted(shapes)


def _backend(tpu_type: str) -> str:
    """Ironwood runs backend native (xla is refused there, on both sides)."""
    return "native" if tpu_type == "tpu7x" else "xla"


def _python_accepts(tpu: dict[str, Any]) -> bool:
    spec = TPUFineTuneSpec.model_validate({**BASE["spec"], "tpu": tpu, "backend": _backend(tpu["type"])})
    return not [e for e in validate(spec) if e.field.startswith("spec.tpu")]


def test_cel_and_python_agree_on_every_shape() -> None:
    cases = []
    for tpu_type, topo, per_host, slices, policy in itertools.product(
        topology.FAMILIES, _topologies(), (None, 1, 4, 8), (1, 2), (None, "policy")
    ):
        if policy and slices == 2:
            continue  # keeps the product small; placement and multislice are independent rules
        tpu: dict[str, Any] = {"type": tpu_type, "topology": topo, "slices": slices}
        if per_host is not None:
            tpu["chipsPerHost"] = per_host
        if policy is not None:
            tpu["placementPolicy"] = policy
        obj = copy.deepcopy(BASE)
        obj["spec"]["tpu"] = tpu
        obj["spec"]["backend"] = _backend(tpu_type)
        cases.append({"name": f"{tpu_type}/{topo}/{per_host}/{slices}/{policy}", "object": obj, "tpu": tpu})
    results = crdcheck.admit(CRD_FILE, [{"name": c["name"], "object": c["object"]} for c in cases])
    disagreements = []
    accepted = 0
    for case in cases:
        cel_ok = results[case["name"]] == []
        python_ok = _python_accepts(case["tpu"])
        accepted += cel_ok
        if cel_ok != python_ok:
            disagreements.append(f"{case['name']}: CEL {cel_ok}, Python {python_ok}: {results[case['name']]}")
    assert not disagreements, "\n".join(disagreements[:20])
    assert 100 < accepted < len(cases) - 100  # the grid exercises both verdicts


def test_cel_and_python_agree_on_every_backend_refusal() -> None:
    """spec.backend's rules (xla refused on tpu7x; native runs DPO, LoRA, several slices and a tensor
    axis, the tensor axis with method full and objective sft only): the same verdict, and the same
    field, from the apiserver's CEL and from validation, over every combination."""
    cases = []
    for backend, tpu_type, objective, slices, method, tensor in itertools.product(
        (None, "xla", "native"), ("v5p", "tpu7x"), ("sft", "dpo"), (1, 2), ("full", "lora"), (None, 1, 2)
    ):
        obj = copy.deepcopy(BASE)
        spec = obj["spec"]
        spec["tpu"] = {"type": tpu_type, "topology": "2x2x2", "slices": slices}
        if backend is not None:
            spec["backend"] = backend
        spec["training"] = {"maxSteps": 10, "method": method}
        if objective == "dpo":
            spec["training"]["objective"] = "dpo"
            spec["dataset"] = {"name": "org/pairs", "format": "preference"}
        if tensor is not None:
            spec["fsdp"] = {"mesh": {"tensor": tensor}}
        cases.append({"name": f"{backend}/{tpu_type}/{objective}/{slices}/{method}/{tensor}", "object": obj})
    results = crdcheck.admit(CRD_FILE, cases)
    seen: set[str] = set()
    native_lora_accepted = 0
    for case in cases:
        errors = validate(TPUFineTuneSpec.model_validate(case["object"]["spec"]))
        fields = sorted(e.field for e in errors)
        cel = results[case["name"]]
        assert bool(cel) == bool(fields), f"{case['name']}: CEL {cel}, Python {fields}"
        for error in errors:  # the apiserver names the same field, with the same reason
            assert any(f"{error.field}: Invalid value" in m and error.reason in m for m in cel), (
                case["name"],
                error,
                cel,
            )
        assert len(cel) == len(errors), (case["name"], cel, fields)  # and no refusal of its own
        seen.update(fields)
        native_lora_accepted += case["name"].startswith("native/") and "/lora/" in case["name"] and not cel
    assert seen == {"spec.backend", "spec.fsdp.mesh.tensor"}
    # LoRA on native is accepted (with everything else native runs): sft and dpo, on either TPU type,
    # one slice or two, tensor unset or 1.
    assert native_lora_accepted == 2 * 2 * 2 * 2
    # Native multislice is accepted by both, on every type it runs on (tpu7x too, where xla cannot).
    for tpu_type in ("v5p", "tpu7x"):
        for backend in ("native", "xla"):
            name = f"{backend}/{tpu_type}/sft/2/full/None"
            assert (results[name] == []) is (backend == "native" or tpu_type != "tpu7x"), (
                name,
                results[name],
            )
    # Tensor parallelism on native: full sft accepted, on either type, one slice or two.
    for tpu_type in ("v5p", "tpu7x"):
        for slices in (1, 2):
            assert results[f"native/{tpu_type}/sft/{slices}/full/2"] == []
