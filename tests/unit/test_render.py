"""Rendering properties over the whole catalog, and the details a golden file does not explain."""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from tpuft_operator import topology
from tpuft_operator.api.validation import SpecError, parse
from tpuft_operator.plan import GIB, KNOWN_MODELS, RUNTIME_HOST_GIB, host_memory
from tpuft_operator.render import RenderSettings, naming, render_run
from tpuft_operator.render.cli import render as render_command
from tpuft_operator.render.jobset import config_of
from tpuft_trainer.config import TrainerConfig
from tpuft_trainer.exit_codes import USER_ERROR_EXIT_CODES, ExitCode
from tpuft_trainer.pod_contract import TRAINER_CONFIG_ANNOTATION

BASE: dict[str, Any] = {
    "apiVersion": "tpuft.dev/v1alpha1",
    "kind": "TPUFineTune",
    "metadata": {"name": "run", "namespace": "ns", "uid": "00000000-0000-0000-0000-000000000001"},
    "spec": {
        "model": {"name": "google/gemma-2-2b"},
        "dataset": {"name": "tatsu-lab/alpaca"},
        "tpu": {"type": "v5e", "topology": "2x2"},
        "training": {"maxSteps": 10},
        "output": {"uri": "gs://bucket/out"},
    },
}


def with_spec(**changes: Any) -> dict[str, Any]:
    obj = copy.deepcopy(BASE)
    obj["spec"].update(changes)
    return obj


def backend_for(tpu_type: str) -> str:
    """The backend a run on ``tpu_type`` can use: native on Ironwood (xla is refused there), else xla."""
    return "native" if tpu_type == "tpu7x" else "xla"


def pod_spec(jobset: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    return spec


def _shapes() -> list[tuple[str, str, int, int]]:
    out = []
    for fam in topology.FAMILIES.values():
        for topo in topology.valid_shapes(fam):
            chips = math.prod(topology.parse_topology(topo))
            for per_host in topology.host_sizes_for(fam, chips):
                out.append((fam.name, topo, per_host, chips))
    return out


@settings(max_examples=300)
@given(st.sampled_from(_shapes()), st.integers(min_value=1, max_value=16))
def test_every_jobset_requests_exactly_the_chips_of_its_slices(
    shape: tuple[str, str, int, int], slices: int
) -> None:
    tpu_type, topo, per_host, chips = shape
    if chips <= per_host or backend_for(tpu_type) == "native":
        slices = 1  # multislice needs multi-host slices, and backend xla
    run = render_run(
        with_spec(
            tpu={"type": tpu_type, "topology": topo, "chipsPerHost": per_host, "slices": slices},
            backend=backend_for(tpu_type),
        )
    )
    rjob = run.jobset["spec"]["replicatedJobs"][0]
    job = rjob["template"]["spec"]
    container = job["template"]["spec"]["containers"][0]
    requests, limits = container["resources"]["requests"], container["resources"]["limits"]
    assert requests[topology.TPU_RESOURCE] == limits[topology.TPU_RESOURCE] == str(per_host)
    assert job["parallelism"] == job["completions"] == chips // per_host
    assert rjob["replicas"] == slices
    assert int(requests[topology.TPU_RESOURCE]) * job["parallelism"] == chips
    assert run.trainer_config.world.hosts_per_slice * run.trainer_config.world.chips_per_host == chips
    mesh = run.trainer_config.fsdp.mesh
    assert (mesh.fsdp or 0) * mesh.tensor * mesh.data == chips and mesh.dcn_data == slices
    selector = job["template"]["spec"]["nodeSelector"]
    assert selector[topology.TOPOLOGY_LABEL] == topo
    exclusive = "alpha.jobset.sigs.k8s.io/exclusive-topology" in run.jobset["metadata"]["annotations"]
    assert exclusive == (chips > per_host or slices > 1)


@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-.", min_size=1, max_size=253))
def test_names_stay_valid_dns_labels(name: str) -> None:
    js = naming.jobset_name(name)
    assert len(js) <= naming.MAX_JOBSET_NAME
    assert js[0].isalpha() and js[-1].isalnum() and set(js) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")
    # the longest pod name JobSet will create: <jobset>-slice-<255>-<2303>-<5 random>
    assert len(f"{js}-slice-255-2303-abcde") <= 63
    assert len(naming.label_value(name)) <= 63
    assert naming.jobset_name(name) == js  # deterministic


def test_distinct_long_names_get_distinct_jobsets() -> None:
    a, b = "x" * 60 + "-a", "x" * 60 + "-b"
    assert naming.jobset_name(a) != naming.jobset_name(b)


def test_short_valid_name_is_kept() -> None:
    assert render_run(BASE).jobset_name == "run"


def test_owner_reference_and_labels_link_both_ways() -> None:
    run = render_run(BASE)
    for obj in run.objects:
        (owner,) = obj["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "tpuft.dev/v1alpha1",
            "kind": "TPUFineTune",
            "name": "run",
            "uid": BASE["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert obj["metadata"]["labels"]["tpuft.dev/finetune"] == "run"
        assert obj["metadata"]["namespace"] == "ns"


def test_no_owner_reference_without_uid() -> None:
    obj = copy.deepcopy(BASE)
    del obj["metadata"]["uid"]
    assert "ownerReferences" not in render_run(obj).jobset["metadata"]


def test_token_only_through_secret_key_ref() -> None:
    obj = with_spec(
        model={"name": "meta-llama/Llama-3.1-8B", "tokenSecretRef": {"name": "hf", "key": "token"}}
    )
    run = render_run(obj, RenderSettings(token_env="HF_TOKEN"))
    env = pod_spec(run.jobset)["containers"][0]["env"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in env
    config = TrainerConfig.from_yaml(config_of(run.jobset))
    assert config.model.token_env == "HF_TOKEN"
    assert "secretKeyRef" not in config_of(run.jobset)


def test_command_is_exec_form_and_never_carries_spec_values() -> None:
    hostile = "x; rm -rf / #$(reboot)"
    obj = with_spec(dataset={"name": "/data/" + hostile})
    container = pod_spec(render_run(obj).jobset)["containers"][0]
    assert container["command"] == ["tpuft", "train", "--config", "/etc/tpuft/config.yaml"]
    assert "args" not in container


def test_failure_policy_split() -> None:
    """User errors fail the run; a checkpointed stop (75) restarts it without counting; the rest
    restarts it up to maxRestarts. The JobSet tells the two FailJob pod rules apart by the rule index
    in the Job controller's failure message ("... matching FailJob rule at index N")."""
    spec = render_run(with_spec(maxRestarts=7)).jobset["spec"]
    assert spec["failurePolicy"]["maxRestarts"] == 7
    user, stop = spec["failurePolicy"]["rules"]
    assert user == {
        "name": "userError",
        "action": "FailJobSet",
        "onJobFailureReasons": ["PodFailurePolicy"],
        "onJobFailureMessagePatterns": ["matching FailJob rule at index 0$"],
    }
    assert stop == {
        "name": "checkpointedStop",
        "action": "RestartJobSetAndIgnoreMaxRestarts",
        "onJobFailureReasons": ["PodFailurePolicy"],
        "onJobFailureMessagePatterns": ["matching FailJob rule at index 1$"],
    }
    job = spec["replicatedJobs"][0]["template"]["spec"]
    assert job["backoffLimit"] == 0 and job["completionMode"] == "Indexed"
    user_rule, stop_rule = job["podFailurePolicy"]["rules"]
    assert user_rule["action"] == stop_rule["action"] == "FailJob"
    assert user_rule["onExitCodes"] == {
        "containerName": "trainer",
        "operator": "In",
        "values": sorted(USER_ERROR_EXIT_CODES),
    }
    assert stop_rule["onExitCodes"]["values"] == [ExitCode.STOPPED_AFTER_CHECKPOINT] == [75]
    assert 75 not in USER_ERROR_EXIT_CODES
    # The message patterns match what the Job controller writes for each rule, and only that one.
    message = "Container trainer for pod ns/run-slice-0-0-x failed with exit code {code} matching FailJob rule at index {i}"
    assert re.search(user["onJobFailureMessagePatterns"][0], message.format(code=65, i=0))
    assert not re.search(user["onJobFailureMessagePatterns"][0], message.format(code=75, i=1))
    assert re.search(stop["onJobFailureMessagePatterns"][0], message.format(code=75, i=1))
    assert job["template"]["spec"]["restartPolicy"] == "Never"


def test_grace_period_and_the_checkpoint_request_file() -> None:
    run = render_run(with_spec(terminationGracePeriodSeconds=300))
    pod = pod_spec(run.jobset)
    assert pod["terminationGracePeriodSeconds"] == 300
    config = TrainerConfig.from_yaml(config_of(run.jobset))
    assert config.stop.grace_seconds == 300
    assert config.stop.request_file == "checkpoint-request"  # next to the config file, in its volume
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tpuft-config"]
    assert {
        "path": "checkpoint-request",
        "fieldRef": {"fieldPath": "metadata.annotations['tpuft.dev/checkpoint-request']"},
    } in volume["downwardAPI"]["items"]
    # The operator's default when the spec says nothing.
    default = render_run(BASE, RenderSettings(termination_grace_period_seconds=45))
    assert pod_spec(default.jobset)["terminationGracePeriodSeconds"] == 45
    assert TrainerConfig.from_yaml(config_of(default.jobset)).stop.grace_seconds == 45


def test_webhook_defaults_are_explicit() -> None:
    spec = render_run(BASE).jobset["spec"]
    assert spec["successPolicy"] == {"operator": "All"}
    assert spec["startupPolicy"] == {"startupPolicyOrder": "AnyOrder"}
    assert spec["network"] == {
        "enableDNSHostnames": True,
        "publishNotReadyAddresses": True,
        "subdomain": "run",
    }
    assert spec["replicatedJobs"][0]["groupName"] == "default"
    assert spec["failurePolicy"]["restartStrategy"] == "Recreate"


@pytest.mark.parametrize(
    ("changes", "suspended", "queue"),
    [({}, False, None), ({"suspend": True}, True, None), ({"queueName": "q"}, True, "q")],
)
def test_suspend_and_kueue(changes: dict[str, Any], suspended: bool, queue: str | None) -> None:
    js = render_run(with_spec(**changes)).jobset
    assert js["spec"]["suspend"] is suspended
    assert js["metadata"]["labels"].get("kueue.x-k8s.io/queue-name") == queue


def test_kueue_priority_class_label_and_pod_priority() -> None:
    """Kueue's WorkloadPriorityClass is a label of the TPUFineTune, copied to the JobSet (where Kueue
    reads it); spec.priorityClassName is the pods' (Kueue's priority when there is no such label)."""
    obj = with_spec(queueName="q", priorityClassName="tpu-high")
    obj["metadata"]["labels"] = {"kueue.x-k8s.io/priority-class": "research-high", "team": "a"}
    js = render_run(obj).jobset
    assert js["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "research-high"
    assert "team" not in js["metadata"]["labels"]
    assert pod_spec(js)["priorityClassName"] == "tpu-high"
    assert (
        "kueue.x-k8s.io/priority-class"
        not in render_run(with_spec(queueName="q")).jobset["metadata"]["labels"]
    )


def test_spot_and_reservation_selectors() -> None:
    obj = with_spec(tpu={"type": "v5p", "topology": "2x2x2", "spot": True, "reservation": "res-a"})
    pod = pod_spec(render_run(obj).jobset)
    assert pod["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
    assert pod["nodeSelector"]["cloud.google.com/reservation-name"] == "res-a"
    assert {
        "key": "cloud.google.com/gke-spot",
        "operator": "Equal",
        "value": "true",
        "effect": "NoSchedule",
    } in pod["tolerations"]


def test_security_context() -> None:
    pod = pod_spec(render_run(BASE).jobset)  # restricted by default
    assert pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
    pod = pod_spec(render_run(BASE, RenderSettings(run_as_user=0)).jobset)  # the opt-out: root, baseline
    assert "runAsNonRoot" not in pod["securityContext"] and pod["securityContext"]["runAsUser"] == 0


def test_trainer_env_for_the_world() -> None:
    env = {e["name"]: e for e in pod_spec(render_run(BASE).jobset)["containers"][0]["env"]}
    assert env["TPUFT_RESTART_ATTEMPT"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['jobset.sigs.k8s.io/restart-attempt']"
    )
    assert env["TPUFT_SLICE_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['jobset.sigs.k8s.io/job-index']"
    )
    assert env["TPUFT_COORDINATOR_ADDRESS"]["value"] == "run-slice-0-0.run"


def test_trainer_config_round_trips_and_names_the_progress_target() -> None:
    run = render_run(with_spec(training={"method": "lora", "epochs": 2, "lora": {"r": 8}}))
    config = TrainerConfig.from_yaml(config_of(run.jobset))
    assert config == run.trainer_config
    assert (config.progress.namespace, config.progress.name) == ("ns", "run")
    assert config.training.lora is not None and config.training.lora.r == 8
    assert config.training.epochs == 2 and config.training.max_steps is None


def test_the_config_travels_in_the_pod_template_and_reaches_the_trainer_as_a_file() -> None:
    run = render_run(with_spec(podAnnotations={"gke-gcsfuse/volumes": "true"}))
    template = run.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    # The user's annotations stay; the config joins them (no separate object to create or lose).
    assert template["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"
    assert (
        TrainerConfig.from_yaml(template["metadata"]["annotations"][TRAINER_CONFIG_ANNOTATION])
        == run.trainer_config
    )
    (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == "tpuft-config"]
    assert volume["downwardAPI"]["items"][0] == {
        "path": "config.yaml",
        "fieldRef": {"fieldPath": f"metadata.annotations['{TRAINER_CONFIG_ANNOTATION}']"},
    }
    (container,) = template["spec"]["containers"]
    assert {"name": "tpuft-config", "mountPath": "/etc/tpuft", "readOnly": True} in container["volumeMounts"]
    assert container["command"][-1] == "/etc/tpuft/config.yaml"
    assert [o["kind"] for o in run.objects] == ["JobSet"]


def test_a_pod_annotation_may_not_replace_the_trainer_config() -> None:
    with pytest.raises(SpecError) as error:
        render_run(with_spec(podAnnotations={TRAINER_CONFIG_ANNOTATION: "model: {name: evil/model}"}))
    assert error.value.field == "spec.podAnnotations"
    assert "reserved" in error.value.reason


def test_logging_steps_reach_the_trainer_config_with_the_measured_default() -> None:
    from tpuft_operator.api.models import DEFAULT_LOGGING_STEPS

    def rendered(training: dict[str, Any]) -> int:
        run = render_run(with_spec(training={"maxSteps": 100, **training}))
        return TrainerConfig.from_yaml(config_of(run.jobset)).training.logging_steps

    assert rendered({}) == DEFAULT_LOGGING_STEPS == 10  # docs/trainer.md, "Reading the loss"
    assert rendered({"loggingSteps": 1}) == 1
    assert rendered({"loggingSteps": 250}) == 250
    with pytest.raises(SpecError) as error:
        render_run(with_spec(training={"maxSteps": 100, "loggingSteps": 0}))
    assert [e.field for e in error.value.errors] == ["spec.training.loggingSteps"]


def test_lora_method_without_settings_uses_defaults() -> None:
    run = render_run(with_spec(training={"method": "lora", "maxSteps": 5}))
    assert run.trainer_config.training.lora is not None


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"fsdp": {"mesh": {"fsdp": 3}}}, "spec.fsdp.mesh"),
        ({"output": {"uri": "relative/path"}}, "spec.output.uri"),
        ({"output": {"uri": "gs://B"}}, "spec.output.uri"),
        ({"model": {"name": "not a model id"}}, "spec.model.name"),
        ({"fsdp": {"layerClsToWrap": ["Llama Decoder"]}}, "spec.fsdp.layerClsToWrap[0]"),
        ({"resources": {"limits": {"google.com/tpu": 8}}}, "spec.resources.limits"),
        ({"env": [{"name": "TPUFT_SLICE_INDEX", "value": "3"}]}, "spec.env[0].name"),
        ({"volumeMounts": [{"name": "data", "mountPath": "/data"}]}, "spec.volumeMounts[0].name"),
        ({"training": {"maxSteps": 5, "learningRate": -1}}, "spec.training.learningRate"),
        ({"tpu": {"type": "v5e", "topology": "2x2x2"}}, "spec.tpu.topology"),
    ],
)
def test_render_raises_spec_error_naming_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as error:
        render_run(with_spec(**changes))
    assert field in [e.field for e in error.value.errors]


def _llama_70b_fp32_adamw(topology: str) -> dict[str, Any]:
    return with_spec(
        model={"name": "meta-llama/Llama-3.1-70B", "dtype": "float32"},
        tpu={"type": "v5e", "topology": topology},
        training={"maxSteps": 10, "optimizer": "adamw"},
    )


def test_a_spec_whose_host_cannot_hold_its_share_of_a_checkpoint_is_refused_with_the_numbers() -> None:
    """A 4x4 v5e slice: 16 chips on 4 hosts of 192 GiB (ct5lp-hightpu-4t). The float32 AdamW checkpoint
    of Llama 3.1 70B is 3 x 4 B x 70.55 B = 788.5 GiB; a host stages 4/16 of it, 197 GiB, + 12."""
    params = KNOWN_MODELS["meta-llama/Llama-3.1-70B"].params
    staging = 12 * params / 16 * 4 / GIB
    peak = staging + RUNTIME_HOST_GIB
    with pytest.raises(SpecError) as error:
        render_run(_llama_70b_fp32_adamw("4x4"))
    (refusal,) = [e for e in error.value.errors if e.field == "spec.tpu.topology"]
    assert refusal.reason.startswith(
        f"meta-llama/Llama-3.1-70B full fine-tune with adamw in float32 needs ~{peak:.0f} GiB of host RAM "
        f"per host to save a checkpoint (staging {staging:.0f} GiB of its chips' shards + "
        f"{RUNTIME_HOST_GIB} GiB runtime); a ct5lp-hightpu-4t host has 192 GiB: use a larger topology"
    ), refusal.reason
    for lever in ("training.method: lora", "training.optimizer: adafactor", "model.dtype: bfloat16"):
        assert lever in refusal.reason
    # Twice the hosts share the state: 99 GiB + 12 fits in 192.
    assert render_run(_llama_70b_fp32_adamw("4x8")).shape.hosts == 8


def test_a_spec_just_under_its_hosts_ram_is_accepted() -> None:
    # Qwen2.5 14B, float32 AdamW on one 4-chip v5e host: 12 B x 14.77 B = 165 GiB + 12 of 192.
    obj = with_spec(
        model={"name": "Qwen/Qwen2.5-14B", "dtype": "float32"},
        training={"maxSteps": 10, "optimizer": "adamw"},
    )
    host = host_memory(parse(obj).spec, render_run(obj).shape, KNOWN_MODELS["Qwen/Qwen2.5-14B"])
    assert 0.85 * 192 * GIB < host.peak_bytes <= 192 * GIB


def test_host_ram_is_checked_only_for_the_models_of_the_built_in_table() -> None:
    obj = _llama_70b_fp32_adamw("4x4")
    obj["spec"]["model"]["name"] = "acme/llama-70b-finetuned"  # no config.json to read
    render_run(obj)


def test_cli_renders_yaml_and_json(tmp_path: Any) -> None:
    path = tmp_path / "ft.yaml"
    path.write_text(yaml.safe_dump(BASE))
    runner = CliRunner()
    result = runner.invoke(render_command, ["-f", str(path)])
    assert result.exit_code == 0, result.output
    kinds = [d["kind"] for d in yaml.safe_load_all(result.output)]
    assert kinds == ["ServiceAccount", "Role", "RoleBinding", "Job", "JobSet"]  # the prepare Job first
    result = runner.invoke(render_command, ["-f", str(path), "-o", "json"])
    assert result.exit_code == 0 and '"kind": "List"' in result.output


def test_cli_reads_a_tpufinetune_written_as_json_with_characters_beyond_the_bmp(tmp_path: Any) -> None:
    path = tmp_path / "ft.json"
    finetune = with_spec()
    finetune["spec"]["output"] = {"uri": "gs://bucket/runs/\U0001f999"}
    path.write_text(json.dumps(finetune))  # the llama as JSON spells it: "\\ud83e\\udd99"
    result = CliRunner().invoke(render_command, ["-f", str(path)])
    assert result.exit_code == 0, result.output
    jobset = next(d for d in yaml.safe_load_all(result.output) if d["kind"] == "JobSet")
    assert TrainerConfig.from_yaml(config_of(jobset)).output.uri.endswith("/\U0001f999")


def test_cli_invalid_input_names_field_and_reason(tmp_path: Any) -> None:
    path = tmp_path / "ft.yaml"
    path.write_text(yaml.safe_dump(with_spec(tpu={"type": "v5e", "topology": "2x2", "slices": 2})))
    result = CliRunner().invoke(render_command, ["-f", str(path)])
    assert result.exit_code != 0
    assert "spec.tpu.slices" in result.output and "multislice" in result.output


def test_a_long_names_jobset_ends_in_a_hash_of_the_runs_uid() -> None:
    """Not of the name: a derived name is itself a valid run name, so a hash of the name could be
    taken by another user's run before or after this one (issue 13); a uid is known to no one."""
    name = "llama-3.1-8b-sft"
    a, b = naming.jobset_name(name, "uid-a"), naming.jobset_name(name, "uid-b")
    assert a != b and a.startswith("llama-3-1-8b-sft-") and b.startswith("llama-3-1-8b-sft-")
    assert naming.jobset_name(name, "uid-a") == a
    assert naming.jobset_name(name) not in (a, b)  # `tpuft render -f` (no uid yet): a hash of the name
    obj = with_spec()
    obj["metadata"] = {"name": name, "namespace": "ns", "uid": "uid-a"}
    assert render_run(obj).jobset_name == a
    assert naming.jobset_name("short-name", "uid-a") == "short-name"  # a name that fits is kept


def test_the_machine_type_is_selected_where_one_topology_has_more_than_one() -> None:
    """v5e/v6e 2x4 is two 4-chip VMs or one 8-chip VM, and both pools carry the same accelerator and
    topology labels: the pods select the machine type too, there and only there."""
    ambiguous = set()
    for tpu_type, topo, per_host, chips in _shapes():
        spec = {"type": tpu_type, "topology": topo, "chipsPerHost": per_host}
        run = render_run(with_spec(tpu=spec, backend=backend_for(tpu_type)))
        selector = pod_spec(run.jobset)["nodeSelector"]
        expected = len(topology.host_sizes_for(topology.family(tpu_type), chips)) > 1
        assert (topology.INSTANCE_TYPE_LABEL in selector) is expected, (tpu_type, topo, per_host)
        if expected:
            assert selector[topology.INSTANCE_TYPE_LABEL] == run.shape.machine_type
            ambiguous.add((tpu_type, topo))
    assert ambiguous == {("v5e", "2x4"), ("v6e", "2x4")}
    selector = pod_spec(render_run(with_spec(tpu={"type": "v5e", "topology": "2x4"})).jobset)["nodeSelector"]
    assert selector[topology.INSTANCE_TYPE_LABEL] == "ct5lp-hightpu-4t"  # xpk's default: two hosts
    eight = {"type": "v6e", "topology": "2x4", "chipsPerHost": 8}
    assert pod_spec(render_run(with_spec(tpu=eight)).jobset)["nodeSelector"][
        topology.INSTANCE_TYPE_LABEL
    ] == ("ct6e-standard-8t")


def test_a_spot_runs_trainer_measures_its_saves_against_a_reclaims_15_seconds() -> None:
    def stop_config(**tpu: Any) -> Any:
        run = render_run(with_spec(tpu={"type": "v5e", "topology": "2x2", **tpu}))
        return TrainerConfig.from_yaml(config_of(run.jobset)).stop

    def stop_grace(**tpu: Any) -> float:
        return float(stop_config(**tpu).grace_seconds)

    # The trainer is told it is on Spot, so a slow save's advice is not "raise the grace period".
    assert (stop_config(spot=True).spot, stop_config().spot) == (True, False)
    assert stop_grace() == 60  # the pods' grace period (the operator's default)
    assert stop_grace(spot=True) == 15  # GKE gives ordinary pods ~15 s of a reclaim's 30 s notice
    assert stop_grace(spot=True, spotGracePeriodSeconds=45) == 45  # a node system config gives more
    assert stop_grace(spot=True, spotGracePeriodSeconds=120) == 60  # never more than the pods' own
    pod = pod_spec(render_run(with_spec(tpu={"type": "v5e", "topology": "2x2", "spot": True})).jobset)
    assert pod["terminationGracePeriodSeconds"] == 60  # suspend, drain and maintenance still give 60
    with pytest.raises(SpecError) as error:
        render_run(with_spec(tpu={"type": "v5e", "topology": "2x2", "spotGracePeriodSeconds": 30}))
    assert [e.field for e in error.value.errors] == ["spec.tpu.spotGracePeriodSeconds"]


def test_a_known_spot_run_whose_save_cannot_fit_a_reclaim_carries_the_warning() -> None:
    heavy = {"model": {"name": "Qwen/Qwen2.5-7B"}, "training": {"maxSteps": 10, "optimizer": "adamw"}}
    spot = {"type": "v6e", "topology": "4x4", "spot": True}
    run = render_run(with_spec(tpu=spot, **heavy))
    assert run.spot_stop_warning is not None and run.spot_stop_warning.startswith("a Spot reclaim gives")
    assert render_run(with_spec(tpu={**spot, "spot": False}, **heavy)).spot_stop_warning is None
    assert (
        render_run(
            with_spec(tpu=spot, model={"name": "org/unknown"}, training=heavy["training"])
        ).spot_stop_warning
        is None
    )
