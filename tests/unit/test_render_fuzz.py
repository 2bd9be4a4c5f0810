"""Whatever a user writes, `render_run` either renders or raises `SpecError`: never anything else."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpuft_operator.api.validation import SpecError
from tpuft_operator.render import render_run

BASE: dict[str, Any] = {
    "apiVersion": "tpuft.dev/v1alpha1",
    "kind": "TPUFineTune",
    "metadata": {"name": "fuzz", "namespace": "ns"},
    "spec": {
        "model": {"name": "google/gemma-2-2b", "tokenSecretRef": {"name": "s", "key": "k"}},
        "dataset": {"name": "tatsu-lab/alpaca"},
        "tpu": {"type": "v5p", "topology": "2x2x2", "slices": 2},
        "fsdp": {"mesh": {"tensor": 2}},
        "training": {"method": "lora", "maxSteps": 10, "lora": {"r": 4}},
        "output": {"uri": "gs://bucket/out"},
        "env": [{"name": "A", "value": "b"}],
    },
}

PATHS = [
    ("spec", "model", "name"),
    ("spec", "model", "dtype"),
    ("spec", "tpu", "type"),
    ("spec", "tpu", "topology"),
    ("spec", "tpu", "slices"),
    ("spec", "tpu", "chipsPerHost"),
    ("spec", "fsdp", "mesh", "fsdp"),
    ("spec", "fsdp", "layerClsToWrap"),
    ("spec", "training", "maxSteps"),
    ("spec", "training", "epochs"),
    ("spec", "training", "learningRate"),
    ("spec", "training", "lora"),
    ("spec", "output", "uri"),
    ("spec", "env"),
    ("spec", "volumes"),
    ("spec", "resources"),
    ("spec",),
    ("metadata", "name"),
]

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=True)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)


def set_path(obj: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node: Any = obj
    for key in path[:-1]:
        if not isinstance(node, dict):
            return
        node = node.setdefault(key, {})
    if isinstance(node, dict):
        node[path[-1]] = value


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(PATHS), values), min_size=1, max_size=3))
def test_render_raises_only_spec_error(mutations: list[tuple[tuple[str, ...], Any]]) -> None:
    obj = copy.deepcopy(BASE)
    for path, value in mutations:
        set_path(obj, path, value)
    try:
        run = render_run(obj)
    except SpecError as error:
        assert error.errors and all(e.field and e.reason for e in error.errors)
        return
    assert run.jobset["kind"] == "JobSet"


def test_the_unmutated_base_renders() -> None:
    assert render_run(copy.deepcopy(BASE)).trainer_config.fsdp.mesh.fsdp == 4
