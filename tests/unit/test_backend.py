"""spec.backend (issue 48): what a `native` run renders (image, environment, trainer config, prepare
Job), what each backend refuses (validation: the field and the reason; the CEL side is
test_cel_agrees_with_catalog.py and tests/cluster/invalid_resources.yaml), and what `tpuft plan` says."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tpuft_operator import plan as planning
from tpuft_operator.api import cel
from tpuft_operator.api.validation import SpecError, parse
from tpuft_operator.render import RenderSettings, naming, render_run
from tpuft_operator.render.cli import render as render_command
from tpuft_operator.render.jobset import DEFAULT_STOP_PORT
from tpuft_operator.render.settings import DEFAULT_TRAINER_IMAGE, DEFAULT_TRAINER_IMAGE_NATIVE
from tpuft_trainer import pod_contract
from tpuft_trainer.config import TrainerConfig

NATIVE: dict[str, Any] = {
    "apiVersion": "tpuft.dev/v1alpha1",
    "kind": "TPUFineTune",
    "metadata": {"name": "nat", "namespace": "ns", "uid": "00000000-0000-0000-0000-000000000048"},
    "spec": {
        "backend": "native",
        "model": {"name": "Qwen/Qwen2.5-0.5B"},
        "dataset": {"name": "tatsu-lab/alpaca"},
        "tpu": {"type": "v6e", "topology": "4x4"},
        "training": {"maxSteps": 10},
        "output": {"uri": "gs://bucket/out"},
    },
}


def run_of(**spec: Any) -> dict[str, Any]:
    obj = copy.deepcopy(NATIVE)
    obj["spec"].update(spec)
    return obj


def container(jobset: dict[str, Any]) -> dict[str, Any]:
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (trainer,) = pod["containers"]
    return dict(trainer)


def env_of(jobset: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(jobset)["env"]}


def test_a_native_run_gets_the_native_image_the_same_command_and_the_launch_environment() -> None:
    run = render_run(run_of())
    trainer = container(run.jobset)
    assert trainer["image"] == DEFAULT_TRAINER_IMAGE_NATIVE
    # One process per pod; the trainer's own launcher starts one per chip.
    assert trainer["command"] == ["tpuft", "train", "--config", pod_contract.CONFIG_PATH]
    names = [e["name"] for e in trainer["env"]]
    assert tuple(names) == pod_contract.RENDERED_ENV + pod_contract.NATIVE_RENDERED_ENV
    env = env_of(run.jobset)
    hosts, per_host = run.shape.hosts, run.shape.chips_per_host
    assert (hosts, per_host) == (4, 4)
    first_pod = f"{run.jobset_name}-{naming.REPLICATED_JOB}-0-0.{run.jobset_name}"
    assert env["MASTER_ADDR"] == env[pod_contract.COORDINATOR_ADDRESS_ENV] == first_pod
    # Not torch's default 29500: the trainer's stop channel listens there on the first host.
    assert int(env["MASTER_PORT"]) == pod_contract.NATIVE_MASTER_PORT != DEFAULT_STOP_PORT
    assert run.trainer_config.stop.coordination_port != int(env["MASTER_PORT"])
    assert env["NNODES"] == str(hosts)
    # The host's index in its slice; the launcher makes NODE_RANK of it and the slice index.
    assert env[pod_contract.HOST_INDEX_ENV] == {
        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
    }
    assert "NODE_RANK" not in env
    assert env["TORCH_TPU_TOPOLOGY"] == "4x4"
    assert env["TORCH_TPU_DEVICES_PER_HOST"] == trainer["resources"]["limits"]["google.com/tpu"] == "4"
    assert env["TORCH_TPU_BASE_PORT"] == "8070"
    # What the wheel derives from GKE's variables, or each worker's own, is not rendered.
    for derived in ("TORCH_TPU_SLICEBUILDER_ADDRESSES", "RANK", "LOCAL_RANK", "WORLD_SIZE", "TPU_WORKER_ID"):
        assert derived not in env
    # One slice: no MegaScale (libtpu would start its client for one slice).
    assert not set(env) & set(pod_contract.NATIVE_MULTISLICE_ENV)


def test_a_native_multislice_run_counts_every_slices_hosts_and_points_megascale_at_the_first_pod() -> None:
    run = render_run(run_of(tpu={"type": "v6e", "topology": "2x4", "slices": 2}))
    names = [e["name"] for e in container(run.jobset)["env"]]
    expected = (
        pod_contract.RENDERED_ENV + pod_contract.NATIVE_RENDERED_ENV + pod_contract.NATIVE_MULTISLICE_ENV
    )
    assert tuple(names) == expected
    env = env_of(run.jobset)
    (job,) = run.jobset["spec"]["replicatedJobs"]
    assert (job["replicas"], job["template"]["spec"]["parallelism"]) == (2, 2)  # a Job per slice
    assert env["NNODES"] == "4"  # every slice's hosts, not one Job's
    first_pod = f"{run.jobset_name}-{naming.REPLICATED_JOB}-0-0.{run.jobset_name}"
    assert env["MASTER_ADDR"] == first_pod
    # The port is part of the address: torch-tpu gives every worker its own MEGASCALE_PORT.
    assert env["MEGASCALE_COORDINATOR_ADDRESS"] == f"{first_pod}:{pod_contract.NATIVE_MEGASCALE_PORT}"
    job_index = {"fieldRef": {"fieldPath": "metadata.labels['jobset.sigs.k8s.io/job-index']"}}
    assert env["MEGASCALE_SLICE_ID"] == env[pod_contract.SLICE_INDEX_ENV] == job_index
    assert env["MEGASCALE_NUM_SLICES"] == "2"
    assert env["TORCH_TPU_TOPOLOGY"] == "2x4"  # one slice's, as the wheel reads it
    # The trainer's mesh puts the slices on its dcn axis, and its world agrees with the environment.
    config = run.trainer_config
    assert (config.fsdp.mesh.dcn_data, config.world.slices, config.world.hosts_per_slice) == (2, 2, 2)


def test_an_xla_run_renders_none_of_it() -> None:
    for spec in ({}, {"backend": "xla"}):
        obj = run_of(**spec)
        if not spec:
            del obj["spec"]["backend"]  # the default
        run = render_run(obj)
        assert container(run.jobset)["image"] == DEFAULT_TRAINER_IMAGE
        assert not set(env_of(run.jobset)) & set(pod_contract.NATIVE_RENDERED_ENV)
        assert run.trainer_config.backend == "xla"
        assert run.trainer_stack_caveat is None


def test_the_trainer_config_and_the_prepare_job_follow_the_backend() -> None:
    run = render_run(run_of())
    config = TrainerConfig.from_yaml(run.trainer_config.to_yaml())
    assert config.backend == "native"
    assert (config.world.hosts_per_slice, config.world.chips_per_host) == (4, 4)
    # The prepare Job runs the run's own image, with none of the pods' torch.distributed variables.
    assert run.prepare_job is not None
    prepare = run.prepare_job["spec"]["template"]["spec"]["containers"][0]
    assert prepare["image"] == DEFAULT_TRAINER_IMAGE_NATIVE
    assert not {e["name"] for e in prepare["env"]} & set(pod_contract.NATIVE_RENDERED_ENV)


def test_a_native_run_with_a_tensor_axis_renders_it_into_the_trainer_config() -> None:
    """Tensor parallelism runs on native too (FSDP2 x DTensor tensor parallelism): accepted at apply,
    and the trainer is told the axis."""
    run = render_run(run_of(fsdp={"mesh": {"tensor": 2}}))
    config = TrainerConfig.from_yaml(run.trainer_config.to_yaml())
    assert (config.backend, config.fsdp.mesh.tensor) == ("native", 2)


def test_the_images_come_from_the_settings_and_spec_image_wins() -> None:
    settings = RenderSettings(trainer_image="r.example/t:1", trainer_image_native="r.example/t:1-tt")
    assert container(render_run(run_of(), settings).jobset)["image"] == "r.example/t:1-tt"
    assert container(render_run(run_of(backend="xla"), settings).jobset)["image"] == "r.example/t:1"
    assert container(render_run(run_of(image="mine/t:2"), settings).jobset)["image"] == "mine/t:2"


def test_tpuft_render_takes_the_native_image(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(run_of()))
    result = CliRunner().invoke(render_command, ["-f", str(path), "--image-native", "r.example/n:3"])
    assert result.exit_code == 0, result.output
    assert "image: r.example/n:3" in result.output


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        (
            {"backend": "xla", "tpu": {"type": "tpu7x", "topology": "2x2x2"}},
            "spec.backend",
            cel.XLA_ON_TPU7X_MESSAGE,
        ),
        (
            {"fsdp": {"mesh": {"tensor": 2}}, "training": {"maxSteps": 10, "method": "lora"}},
            "spec.fsdp.mesh.tensor",
            cel.NATIVE_TENSOR_RECIPE_MESSAGE,
        ),
        (
            {
                "fsdp": {"mesh": {"tensor": 2}},
                "training": {"maxSteps": 10, "objective": "dpo"},
                "dataset": {"name": "o/p", "format": "preference"},
            },
            "spec.fsdp.mesh.tensor",
            cel.NATIVE_TENSOR_RECIPE_MESSAGE,
        ),
    ],
    ids=["xla-on-tpu7x", "native-tensor-lora", "native-tensor-dpo"],
)
def test_validation_names_the_field_and_the_reason(spec: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(SpecError) as raised:
        render_run(run_of(**spec))
    assert [(e.field, e.reason) for e in raised.value.errors] == [(field, message)]


def test_the_messages_say_why_and_what_to_do_instead() -> None:
    assert "torch_xla 2.9.0 is its last release" in cel.XLA_ON_TPU7X_MESSAGE
    assert "TorchTPU" in cel.XLA_ON_TPU7X_MESSAGE and "set backend: native" in cel.XLA_ON_TPU7X_MESSAGE
    assert "tensor > 1 on backend native trains method full" in cel.NATIVE_TENSOR_RECIPE_MESSAGE
    assert "set tensor: 1 (FSDP2 alone), or backend: xla" in cel.NATIVE_TENSOR_RECIPE_MESSAGE
    # Ironwood on native is accepted (one slice), with the native caveat.
    assert render_run(run_of(tpu={"type": "tpu7x", "topology": "2x2x2"})).trainer_stack_caveat


def _plan(obj: dict[str, Any]) -> tuple[planning.Plan, str]:
    ft = parse(obj, check_host_ram=False)
    p = planning.plan(ft, planning.KNOWN_MODELS["Qwen/Qwen2.5-0.5B"])
    return p, planning.format_plan(p, ft)


def test_tpuft_plan_names_the_backend_and_counts_one_process_per_chip() -> None:
    native, native_text = _plan(run_of())
    xla, xla_text = _plan(run_of(backend="xla"))
    assert native.host.processes == 4 and xla.host.processes == 1
    assert (
        native.host.runtime_bytes
        == 4 * xla.host.runtime_bytes
        == 4 * planning.RUNTIME_HOST_GIB * planning.GIB
    )
    assert native.host.load_bytes == 4 * xla.host.load_bytes
    assert native.host.save_bytes == xla.host.save_bytes  # each process stages its own shards
    assert native.lines == xla.lines  # the per-chip HBM estimate is the same model
    assert (
        "backend     native: torch-native FSDP2 on TorchTPU" in native_text and "(4 per host)" in native_text
    )
    assert "12 GiB x 4 processes (one per chip)" in native_text and "assumed, not measured" in native_text
    assert "backend     xla: PyTorch/XLA SPMD (torch_xla 2.9.0), one process per host" in xla_text


def test_the_memory_advice_offers_lora_on_both_backends_unless_it_is_lora_already() -> None:
    """A run that does not fit is told what lowers its peak (host RAM, HBM): LoRA on either backend
    (native runs it too), never to a run that is LoRA already."""
    model = planning.KNOWN_MODELS["Qwen/Qwen2.5-0.5B"]
    for backend, method, offered in (
        ("xla", "full", True),
        ("native", "full", True),
        ("native", "lora", False),
    ):
        ft = parse(run_of(backend=backend, training={"maxSteps": 10, "method": method}), check_host_ram=False)
        assert ("training.method: lora" in planning.host_suggestions(ft.spec)) is offered, backend
        levers = planning.weight_levers(planning.plan(ft, model), ft)
        assert ("use training.method: lora" in levers) is offered, backend
        assert "use a larger topology (more hosts share the state)" in planning.host_suggestions(ft.spec)
