"""The admin policy (api/policy.py), offline: each rule, each loosening, the chart's defaults equal
the operator's, and the operator refuses a run that breaks a rule before it creates anything (the
admission policy's side, against a real apiserver, is tests/e2e/test_policy.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.test_reconciler import Events, RecordingApi, new_run
from tpuft_operator.api.policy import (
    DEFAULT_MAX_CHIPS,
    DEFAULT_VOLUME_TYPES,
    AdminPolicy,
    admission_policy,
    cel_parameters,
    image_allowed,
    image_repository,
    policy_errors,
)
from tpuft_operator.api.validation import parse
from tpuft_operator.reconcile import Reconciler
from tpuft_operator.render import RenderSettings
from tpuft_operator.settings import OperatorSettings

ROOT = Path(__file__).resolve().parents[2]
TRAINER = "ghcr.io/tpuft/trainer:0.1.0"


def run(namespace: str = "team-a", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "tpuft.dev/v1alpha1",
        "kind": "TPUFineTune",
        "metadata": {"name": "r", "namespace": namespace},
        "spec": {
            "model": {"name": "google/gemma-2-2b"},
            "dataset": {"name": "tatsu-lab/alpaca"},
            "tpu": {"type": "v5e", "topology": "2x2"},
            "training": {"maxSteps": 10},
            "output": {"uri": "gs://bucket/out"},
            **spec,
        },
    }


def fields(obj: dict[str, Any], policy: AdminPolicy | None = None) -> list[str]:
    return [f for f, _ in policy_errors(parse(obj), policy or AdminPolicy(), TRAINER)]


# Each attack of issue 13, the field it is refused on by default, and the loosening that lets it run.
ATTACKS: list[tuple[str, dict[str, Any], str, AdminPolicy]] = [
    (
        "hostPath",
        {"volumes": [{"name": "root", "hostPath": {"path": "/"}}], "volumeMounts": [{"name": "root", "mountPath": "/host"}]},
        "spec.volumes[0].hostPath",
        AdminPolicy(volume_types=(*DEFAULT_VOLUME_TYPES, "hostPath")),
    ),
    (
        "HF_ENDPOINT",
        {"env": [{"name": "A", "value": "1"}, {"name": "HF_ENDPOINT", "value": "https://evil.example"}]},
        "spec.env[1].name",
        AdminPolicy(env=("HF_ENDPOINT",)),
    ),
    ("LD_PRELOAD", {"env": [{"name": "LD_PRELOAD", "value": "/x.so"}]}, "spec.env[0].name", AdminPolicy(env=("LD_*",))),
    ("PYTHONPATH", {"env": [{"name": "PYTHONPATH", "value": "/x"}]}, "spec.env[0].name", AdminPolicy(env=("PYTHON*",))),
    ("proxy", {"env": [{"name": "https_proxy", "value": "http://x"}]}, "spec.env[0].name", AdminPolicy(env=("https_proxy",))),
    (
        "env secret",
        {"env": [{"name": "DB", "valueFrom": {"secretKeyRef": {"name": "db-admin", "key": "password"}}}]},
        "spec.env[0].valueFrom.secretKeyRef.name",
        AdminPolicy(secrets=("db-admin",)),
    ),
    (
        "secret volume",
        {"volumes": [{"name": "s", "secret": {"secretName": "db-admin"}}]},
        "spec.volumes[0].secret.secretName",
        AdminPolicy(secrets=("*",)),
    ),
    (
        "projected secret",
        {"volumes": [{"name": "s", "projected": {"sources": [{"configMap": {"name": "c"}}, {"secret": {"name": "x"}}]}}]},
        "spec.volumes[0].projected.sources[1].secret.name",
        AdminPolicy(secrets=("x",)),
    ),
    ("ServiceAccount", {"serviceAccountName": "deployer"}, "spec.serviceAccountName", AdminPolicy(service_accounts=("deployer",))),
    ("image", {"image": "evil.example/miner:1"}, "spec.image", AdminPolicy(images=("evil.example/",))),
    ("look-alike image", {"image": "ghcr.io/tpuft/trainer-evil:1"}, "spec.image", AdminPolicy(images=("*",))),
    ("chips", {"tpu": {"type": "v5p", "topology": "8x8x8", "slices": 2}}, "spec.tpu", AdminPolicy(max_chips=0)),
    ("every taint", {"tolerations": [{"operator": "Exists"}]}, "spec.tolerations[0].key", AdminPolicy(tolerations=("*",))),
    (
        "control-plane taint",
        {"tolerations": [{"key": "team", "value": "ml"}, {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]},
        "spec.tolerations[1].key",
        AdminPolicy(tolerations=("node-role.kubernetes.io/*",)),
    ),
    ("host network", {"network": {"hostNetwork": True}}, "spec.network.hostNetwork", AdminPolicy(host_network=True)),
    # The prepare pod is held to the same rule as the TPU pods (it runs with the same identity and Secrets).
    (
        "prepare pod's control-plane taint",
        {"prepare": {"tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]}},
        "spec.prepare.tolerations[0].key",
        AdminPolicy(tolerations=("node-role.kubernetes.io/*",)),
    ),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "field", "loosened"), [a[1:] for a in ATTACKS], ids=[a[0] for a in ATTACKS])
def test_each_attack_is_refused_naming_the_field_and_runs_once_loosened(
    spec: dict[str, Any], field: str, loosened: AdminPolicy
) -> None:
    assert fields(run(**spec)) == [field]
    assert fields(run(**spec), loosened) == []


def test_the_default_identity_trainer_image_and_token_need_no_loosening() -> None:
    obj = run(
        serviceAccountName="tpuft-trainer",
        image="ghcr.io/tpuft/trainer@sha256:" + "a" * 64,
        env=[{"name": "WANDB_MODE", "value": "offline"}, {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "d"}}, {"name": "gcs", "csi": {"driver": "gcsfuse.csi.storage.gke.io"}}],
        tpu={"type": "v5e", "topology": "16x16"},  # exactly the default cap
        network={"hostNetwork": False},  # the pod network, said explicitly
    )  # fmt: skip
    obj["spec"]["model"]["tokenSecretRef"] = {"name": "hf-token", "key": "token"}
    assert fields(obj) == []
    assert DEFAULT_MAX_CHIPS == 256


def test_queue_and_operator_namespace() -> None:
    assert fields(run(), AdminPolicy(require_queue=True)) == ["spec.queueName"]
    assert fields(run(queueName="q"), AdminPolicy(require_queue=True)) == []
    assert fields(run("tpuft-system"), AdminPolicy(operator_namespace="tpuft-system")) == [
        "metadata.namespace"
    ]
    assert fields(run("team-a"), AdminPolicy(operator_namespace="tpuft-system")) == []


def test_every_broken_rule_is_listed_in_order() -> None:
    obj = run(
        image="evil.example/x",
        serviceAccountName="tpuft",
        env=[{"name": "XLA_FLAGS", "value": "--x"}],
        volumes=[{"name": "h", "hostPath": {"path": "/"}}],
    )
    assert fields(obj, AdminPolicy(operator_namespace="team-a")) == [
        "metadata.namespace",
        "spec.image",
        "spec.serviceAccountName",
        "spec.volumes[0].hostPath",
        "spec.env[0].name",
    ]


def test_image_repository_and_prefixes() -> None:
    assert image_repository("ghcr.io/tpuft/trainer:0.1.0") == "ghcr.io/tpuft/trainer"
    assert image_repository("registry:5000/a/b@sha256:" + "0" * 64) == "registry:5000/a/b"
    assert image_repository("registry:5000/a/b") == "registry:5000/a/b"
    assert image_allowed("ghcr.io/tpuft/trainer/sub:1", ["ghcr.io/tpuft/trainer"])
    assert not image_allowed("ghcr.io/tpuft/trainers:1", ["ghcr.io/tpuft/trainer"])
    assert image_allowed("reg.example/team/x:1", ["reg.example/team/"])
    assert not image_allowed("reg.example/teamx/x:1", ["reg.example/team/"])


def test_chart_defaults_are_the_operators() -> None:
    values = yaml.safe_load((ROOT / "charts" / "tpuft" / "values.yaml").read_text())["policy"]
    default = AdminPolicy()
    assert values["admission"] is True
    assert tuple(values["allowedImages"]) == default.images
    assert tuple(values["allowedServiceAccounts"]) == default.service_accounts
    assert tuple(values["allowedVolumeTypes"]) == default.volume_types
    assert tuple(values["allowedEnv"]) == default.env
    assert tuple(values["allowedSecrets"]) == default.secrets
    assert tuple(values["allowedTolerations"]) == default.tolerations
    assert values["allowHostNetwork"] is default.host_network is False
    assert values["maxChipsPerRun"] == default.max_chips
    assert values["requireQueueName"] is default.require_queue
    settings = OperatorSettings()
    assert settings.admin_policy() == default
    # Restricted by default, everywhere: the chart's value, the operator's setting, `tpuft render`.
    security = yaml.safe_load((ROOT / "charts" / "tpuft" / "values.yaml").read_text())["trainerSecurity"]
    assert security["restricted"] is True
    assert settings.run_as_user == RenderSettings().run_as_user == security["runAsUser"]
    # "none" stands for an empty list in the env var (an empty env var would mean the default).
    assert OperatorSettings(allowed_volume_types=("none",)).admin_policy().volume_types == ()


def test_the_admission_policy_carries_every_parameter_and_reserved_name() -> None:
    policy, binding = admission_policy("p", cel_parameters(AdminPolicy(operator_namespace="ops"), TRAINER))
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert variables["images"] == '["ghcr.io/tpuft/trainer"]'
    assert variables["operatorNamespace"] == '"ops"' and variables["maxChips"] == "256"
    assert variables["hostNetwork"] == "false"
    assert '"LD_"' in variables["badEnv"] and '"HTTPS_PROXY"' in variables["badEnv"]
    assert policy["spec"]["matchConstraints"]["resourceRules"][0]["operations"] == ["CREATE"]
    messages = " ".join(v["messageExpression"] for v in policy["spec"]["validations"])
    for field in (
        "metadata.namespace",
        "spec.image",
        "spec.serviceAccountName",
        "spec.volumes[",
        "spec.env[",
        "spec.tolerations[",
        "spec.network.hostNetwork",
        "spec.tpu",
        "spec.queueName",
    ):
        assert field in messages, field
    assert binding["spec"]["validationActions"] == ["Deny"]


def test_the_operator_refuses_a_run_the_policy_forbids_before_creating_anything() -> None:
    api = RecordingApi()
    r = Reconciler(api=api, render_settings=RenderSettings(), policy=AdminPolicy())  # type: ignore[arg-type]
    body = new_run()
    body["spec"] = {
        **copy.deepcopy(body["spec"]),
        "env": [{"name": "HF_ENDPOINT", "value": "https://evil.example"}],
    }
    r.reconcile(body, None, [], event=Events())
    assert api.calls == [("status", "Failed")]
    loosened = Reconciler(
        api=RecordingApi(), render_settings=RenderSettings(), policy=AdminPolicy(env=("HF_*",))
    )  # type: ignore[arg-type]
    loosened.reconcile(body, None, [], event=Events())
    assert ("create", "JobSet") in loosened.api.calls  # type: ignore[attr-defined]


def test_the_restricted_user_is_the_trainer_images_user() -> None:
    """trainerSecurity.runAsUser must be the image's numeric USER: a pod running as another uid
    could not write the image's HF_HOME and caches."""
    values = yaml.safe_load((ROOT / "charts" / "tpuft" / "values.yaml").read_text())["trainerSecurity"]
    users = [
        line.split()[1]
        for line in (ROOT / "trainer_image" / "Dockerfile").read_text().splitlines()
        if line.startswith("USER ")
    ]
    assert users and users[-1].split(":") == [str(values["runAsUser"])] * 2
    assert values["restricted"] is True  # the safe setting is the one people get


def test_a_run_gets_its_network_policy_only_when_asked_and_only_with_a_uid() -> None:
    from tpuft_operator.render import render_run

    obj = run()
    obj["metadata"]["uid"] = "0b7e4a3e-0000-4000-8000-000000000001"
    assert [o["kind"] for o in render_run(obj).objects] == ["JobSet"]
    kinds = [o["kind"] for o in render_run(obj, RenderSettings(network_policy=True)).objects]
    assert kinds == ["NetworkPolicy", "JobSet"]  # before the pods exist
    (policy, _) = render_run(obj, RenderSettings(network_policy=True)).objects
    own = {"matchLabels": {"tpuft.dev/finetune-uid": obj["metadata"]["uid"]}}
    assert policy["spec"]["podSelector"] == own and policy["spec"]["ingress"] == [
        {"from": [{"podSelector": own}]}
    ]
    assert policy["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    del obj["metadata"]["uid"]
    assert [o["kind"] for o in render_run(obj, RenderSettings(network_policy=True)).objects] == ["JobSet"]


def test_restricted_trainer_pods_meet_the_restricted_standard() -> None:
    from tpuft_operator.render import render_run

    pod = render_run(run()).jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["securityContext"] == {
        "seccompProfile": {"type": "RuntimeDefault"},
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "runAsNonRoot": True,
        "fsGroup": 1000,
    }
    container = pod["containers"][0]["securityContext"]
    assert container == {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
    }
    assert OperatorSettings(run_as_user=1000).render_settings().run_as_user == 1000
    assert OperatorSettings().render_settings().run_as_user == 1000
    # The opt-out (trainerSecurity.restricted=false sets TPUFT_RUN_AS_USER=0): root, baseline.
    assert OperatorSettings(run_as_user=0).render_settings().run_as_user == 0
    opted_out = render_run(run(), RenderSettings(run_as_user=0)).jobset["spec"]["replicatedJobs"][0]
    pod = opted_out["template"]["spec"]["template"]["spec"]
    # Root said explicitly (the image's USER is 1000, which is what the opt-out is for).
    assert pod["securityContext"] == {
        "seccompProfile": {"type": "RuntimeDefault"},
        "runAsUser": 0,
        "runAsGroup": 0,
    }
    assert pod["containers"][0]["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False}


def test_one_default_trainer_image_for_render_operator_and_chart() -> None:
    """`tpuft render` prints what the operator creates: the same default images everywhere, the native
    one in the trainer image's repository (so the admin policy's rule on spec.image allows it)."""
    from tpuft_operator.render.settings import (
        DEFAULT_TRAINER_IMAGE,
        DEFAULT_TRAINER_IMAGE_NATIVE,
        RenderSettings,
    )
    from tpuft_operator.settings import OperatorSettings

    values = yaml.safe_load((ROOT / "charts" / "tpuft" / "values.yaml").read_text())
    assert values["trainerImage"] == DEFAULT_TRAINER_IMAGE
    assert OperatorSettings().trainer_image == RenderSettings().trainer_image == DEFAULT_TRAINER_IMAGE
    assert values["trainerImageNative"] == DEFAULT_TRAINER_IMAGE_NATIVE != DEFAULT_TRAINER_IMAGE
    assert OperatorSettings().trainer_image_native == RenderSettings().trainer_image_native
    assert OperatorSettings().render_settings().trainer_image_native == DEFAULT_TRAINER_IMAGE_NATIVE
    assert image_repository(DEFAULT_TRAINER_IMAGE_NATIVE) == image_repository(DEFAULT_TRAINER_IMAGE)
