"""The pod contract (tpuft_trainer/pod_contract.py), the API resource table (api/resources.py) and
the phases: what the renderer emits is reserved, what the trainer reads is named there, and the
copies that cannot import the tables (Literal types, the trainer's defaults, the Dockerfile, the
CRD's phase enum) agree with them."""

from __future__ import annotations

import copy
import re
import typing
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_render_golden import EXAMPLE_FILES, finetune
from tpuft_operator import metrics
from tpuft_operator.api import crd
from tpuft_operator.api.models import TERMINAL_PHASES, Phase, TPUFineTune
from tpuft_operator.api.policy import env_reserved
from tpuft_operator.api.resources import FINETUNE, JOBSET
from tpuft_operator.api.validation import SpecError, parse, parse_run, validate_run
from tpuft_operator.k8s import KINDS
from tpuft_operator.render import RenderedRun, RenderSettings, render_run
from tpuft_trainer import pod_contract
from tpuft_trainer.config import ProgressConfig
from tpuft_trainer.world import ENV_VARS

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = RenderSettings(network_policy=True)

# What a spec adds to the pod: the renderer's own names must be told apart from these.
USER_PARTS: dict[str, Any] = {
    "env": [
        {"name": "MY_FLAG", "value": "1"},
        {"name": "MY_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ],
    "volumes": [{"name": "scratch", "emptyDir": {}}],
    "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
    "podAnnotations": {"example.com/team": "ml"},
}


def with_user_parts(doc: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    spec = doc["spec"]
    spec["model"]["tokenSecretRef"] = {"name": "hub-token", "key": "token"}
    for key, value in USER_PARTS.items():
        if isinstance(value, list):
            spec[key] = [*(spec.get(key) or []), *copy.deepcopy(value)]
        else:
            spec[key] = {**(spec.get(key) or {}), **value}
    return doc


def pod_template(run: RenderedRun) -> dict[str, Any]:
    template: dict[str, Any] = run.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    return template


RUNS = [pytest.param(with_user_parts(finetune(path)), id=path.stem) for path in EXAMPLE_FILES]


@pytest.mark.parametrize("doc", RUNS)
def test_every_name_the_renderer_adds_to_the_pod_is_reserved(doc: dict[str, Any]) -> None:
    """A new env var, volume, mount or annotation in render/jobset.py fails here until it is reserved
    in pod_contract.py (so no spec can shadow it)."""
    run = render_run(doc, SETTINGS)
    spec = doc["spec"]
    template = pod_template(run)
    (container,) = template["spec"]["containers"]

    own_env = [e["name"] for e in container["env"]][: -len(spec["env"])]
    assert [e["name"] for e in container["env"]][len(own_env) :] == [e["name"] for e in spec["env"]]
    # The hub token's variable (RenderSettings.token_env) is rendered only with tokenSecretRef, and
    # validation refuses it in spec.env then (below); the admin policy's HF_ prefix reserves it too.
    assert own_env[-1] == SETTINGS.token_env == pod_contract.DEFAULT_TOKEN_ENV
    assert env_reserved(SETTINGS.token_env)
    native = pod_contract.NATIVE_RENDERED_ENV if spec.get("backend") == "native" else ()
    if native and spec["tpu"].get("slices", 1) > 1:
        native += pod_contract.NATIVE_MULTISLICE_ENV
    assert tuple(own_env[:-1]) == pod_contract.RENDERED_ENV + native
    assert set(own_env[:-1]) <= pod_contract.RESERVED_ENV

    user_volumes = {v["name"] for v in spec["volumes"]}
    own_volumes = {v["name"] for v in template["spec"]["volumes"]} - user_volumes
    assert own_volumes and own_volumes <= pod_contract.RESERVED_VOLUMES

    user_mounts = {m["mountPath"] for m in spec["volumeMounts"]}
    own_mounts = [m for m in container["volumeMounts"] if m["mountPath"] not in user_mounts]
    assert own_mounts == [
        {"name": pod_contract.CONFIG_VOLUME, "mountPath": pod_contract.CONFIG_DIR, "readOnly": True}
    ]

    own_annotations = set(template["metadata"]["annotations"]) - set(spec["podAnnotations"])
    # The renderer writes the config annotation; the reconciler adds the checkpoint request later.
    assert own_annotations == {pod_contract.TRAINER_CONFIG_ANNOTATION}
    assert own_annotations <= set(pod_contract.RESERVED_ANNOTATIONS)
    referenced = {
        m.group(1)
        for item in template["spec"]["volumes"][0]["downwardAPI"]["items"]
        for m in [re.fullmatch(r"metadata\.annotations\['(.+)'\]", item["fieldRef"]["fieldPath"])]
        if m
    }
    assert referenced == set(pod_contract.RESERVED_ANNOTATIONS)


def test_the_pod_reads_the_config_where_the_trainer_image_looks() -> None:
    run = render_run(finetune(EXAMPLE_FILES[0]))
    template = pod_template(run)
    (container,) = template["spec"]["containers"]
    assert container["command"] == ["tpuft", "train", "--config", pod_contract.CONFIG_PATH]
    items = {i["path"] for i in template["spec"]["volumes"][0]["downwardAPI"]["items"]}
    assert items == {pod_contract.CONFIG_FILE, pod_contract.REQUEST_FILE}
    assert run.trainer_config.stop.request_file == pod_contract.REQUEST_FILE
    dockerfile = (ROOT / "trainer_image" / "Dockerfile").read_text()
    assert f'CMD ["--config", "{pod_contract.CONFIG_PATH}"]' in dockerfile


@pytest.mark.parametrize(
    ("part", "field"),
    [
        *[
            ({"env": [{"name": name, "value": "x"}]}, "spec.env[0].name")
            for name in pod_contract.RESERVED_ENV
        ],
        *[
            ({"volumes": [{"name": name, "emptyDir": {}}]}, "spec.volumes[0].name")
            for name in pod_contract.RESERVED_VOLUMES
        ],
        *[
            ({"podAnnotations": {key: "x"}}, "spec.podAnnotations")
            for key in pod_contract.RESERVED_ANNOTATIONS
        ],
        (
            {
                "volumes": [{"name": "v", "emptyDir": {}}],
                "volumeMounts": [{"name": "v", "mountPath": f"{pod_contract.CONFIG_DIR}/x"}],
            },
            "spec.volumeMounts[0].mountPath",
        ),
    ],
)
def test_validation_refuses_every_reserved_name(part: dict[str, Any], field: str) -> None:
    doc = finetune(EXAMPLE_FILES[0])
    doc["spec"].update(part)
    with pytest.raises(SpecError) as error:
        parse(doc)
    assert field in {e.field for e in error.value.errors}


def test_the_token_variable_is_refused_in_env_only_when_the_token_comes_from_a_secret() -> None:
    doc = finetune(EXAMPLE_FILES[0])
    doc["spec"]["env"] = [{"name": pod_contract.DEFAULT_TOKEN_ENV, "value": "x"}]
    doc["spec"]["model"].pop("tokenSecretRef", None)
    parse(doc)  # the admin policy decides whether spec.env may set HF_ variables
    doc["spec"]["model"]["tokenSecretRef"] = {"name": "hub", "key": "token"}
    with pytest.raises(SpecError) as error:
        parse(doc)
    (refused,) = error.value.errors
    assert refused.field == "spec.env[0].name" and "tokenSecretRef" in refused.reason


def test_the_trainer_reads_only_variables_of_the_contract() -> None:
    named = {v for k, v in vars(pod_contract).items() if k.endswith("_ENV") and isinstance(v, str)}
    assert set(ENV_VARS) <= named
    package = ROOT / "trainer_image" / "tpuft_trainer"
    for module in sorted(set(package.rglob("*.py")) - {package / "pod_contract.py"}):
        source = module.read_text()
        quoted = set(re.findall(r"[\"']((?:TPUFT|TPU|MEGASCALE|JOB)_[A-Z_]+)[\"']", source))
        assert not quoted, f"{module.relative_to(package)} spells out {quoted}: name them in pod_contract.py"


def test_copies_that_cannot_import_the_table_agree_with_it() -> None:
    # The trainer's own defaults (it ships without the operator); the renderer writes them anyway.
    defaults = ProgressConfig()
    assert (defaults.group, defaults.version, defaults.plural) == (
        FINETUNE.group,
        FINETUNE.version,
        FINETUNE.plural,
    )
    # The model's Literal types must spell the values out.
    fields = TPUFineTune.model_fields
    assert typing.get_args(fields["api_version"].annotation) == (FINETUNE.api_version,)
    assert typing.get_args(fields["kind"].annotation) == (FINETUNE.kind,)
    assert crd.CRD_NAME == "tpufinetunes.tpuft.dev"


def test_the_operator_can_create_every_kind_it_renders() -> None:
    run = render_run(with_user_parts({**finetune(EXAMPLE_FILES[0])}), SETTINGS)
    objects = [*run.namespace_objects, *run.objects]
    assert {o["kind"] for o in objects} >= {JOBSET.kind, "NetworkPolicy", "ServiceAccount", "Role"}
    for obj in objects:
        assert KINDS[obj["kind"]].api_version == obj["apiVersion"], obj["kind"]


def test_phases() -> None:
    assert {Phase.SUCCEEDED, Phase.FAILED} == TERMINAL_PHASES
    assert "Failed" in TERMINAL_PHASES and Phase.RUNNING == "Running" and f"{Phase.QUEUED}" == "Queued"
    assert tuple(p.value for p in Phase) == metrics._PHASES
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert schema["properties"]["status"]["properties"]["phase"]["enum"] == [p.value for p in Phase]


def test_validation_returns_the_shape_the_renderer_uses() -> None:
    doc = finetune(EXAMPLE_FILES[0])
    run = parse_run(doc)
    assert validate_run(run.finetune) == run
    rendered = render_run(run)
    assert rendered.shape is run.shape
    assert rendered == render_run(doc) == render_run(run.finetune)
    doc["spec"]["tpu"]["topology"] = "3x3"
    with pytest.raises(SpecError) as error:
        parse_run(doc)
    assert error.value.field == "spec.tpu.topology"
