"""What is known of the trainer's stack per backend: xla is refused on tpu7x at apply time (CEL and
validation, tests/unit/test_backend.py), and a native run, on any family, is told in its status, an
Event, `tpuft plan` and docs/topology.md that tpuft has verified that backend on CPU only."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tests.unit.test_reconciler import Events, RecordingApi, new_run, reconciler, written
from tests.unit.test_status import cond, derive, finetune
from tpuft_operator import plan as planning
from tpuft_operator import trainer_stack
from tpuft_operator.api.cel import XLA_ON_TPU7X_MESSAGE
from tpuft_operator.api.validation import parse
from tpuft_operator.topology_doc import topology_markdown

ROOT = Path(__file__).resolve().parents[2]
IRONWOOD = {"type": "tpu7x", "topology": "2x2x2"}


def test_only_native_carries_a_caveat_on_every_family() -> None:
    for tpu_type in ("v4", "v5e", "v5p", "v6e", "tpu7x"):
        tpu = {"type": tpu_type, "topology": "2x2"}
        caveat = trainer_stack.trainer_stack_caveat({"backend": "native", "tpu": tpu})
        assert caveat == trainer_stack.NATIVE_CAVEAT
        assert trainer_stack.trainer_stack_caveat({"backend": "xla", "tpu": tpu}) is None
        assert trainer_stack.trainer_stack_caveat({"tpu": tpu}) is None  # no backend: xla
    # What it rests on, so a reader can check it.
    for source in ("torch-tpu 0.2.0", "Beta", "CPU with gloo only", "docs/trainer.md"):
        assert source in trainer_stack.NATIVE_CAVEAT
    assert len(trainer_stack.NATIVE_CAVEAT) <= 1024  # a Kubernetes Event's message is cut there (k8s.py)


def test_the_tpu7x_refusal_names_the_versions_the_trainer_image_pins() -> None:
    pins = dict(
        re.findall(
            r"^([a-z_]+)(?:\[[a-z]+\])?==(\S+)$",
            (ROOT / "trainer_image/requirements-tpu.txt").read_text(),
            re.M,
        )
    )
    assert (pins["torch_xla"], pins["libtpu"]) == (
        trainer_stack.TORCH_XLA_VERSION,
        trainer_stack.LIBTPU_VERSION,
    )
    assert f"torch_xla {pins['torch_xla']} is its last release and pins libtpu {pins['libtpu']}" in (
        XLA_ON_TPU7X_MESSAGE
    )
    assert "backend: native" in XLA_ON_TPU7X_MESSAGE


def test_a_native_run_has_the_condition_from_its_spec_alone() -> None:
    status = derive(finetune(tpu=IRONWOOD, backend="native"), None)
    stack = cond(status, "TrainerStackVerified")
    assert (stack["status"], stack["reason"]) == ("False", "NativeUnverifiedOnTpu")
    assert stack["message"] == trainer_stack.NATIVE_CAVEAT
    assert status["phase"] == "Pending"  # not refused: it waits for its JobSet like any run
    assert "TrainerStackVerified" not in {c["type"] for c in derive(finetune(), None)["conditions"]}


def test_a_native_run_is_warned_once_with_its_jobset_and_still_created() -> None:
    api, events = RecordingApi(), Events()
    r, _ = reconciler(api)
    run = new_run()
    run["spec"]["tpu"] = dict(IRONWOOD)
    run["spec"]["backend"] = "native"
    r.reconcile(run, None, [], event=events)
    assert ("create", "JobSet") in api.writes()
    assert events.posted[:2] == ["JobSetCreated", trainer_stack.EVENT_REASON]
    stack = cond(written(r)["status"], "TrainerStackVerified")
    assert (stack["status"], stack["reason"]) == ("False", "NativeUnverifiedOnTpu")
    r.reconcile(written(r), None, [], event=events)
    assert events.posted.count(trainer_stack.EVENT_REASON) == 1  # once, with the JobSet's creation


def test_an_xla_run_gets_no_such_event() -> None:
    api, events = RecordingApi(), Events()
    r, _ = reconciler(api)
    r.reconcile(new_run(), None, [], event=events)
    assert trainer_stack.EVENT_REASON not in events.posted


def _plan_text(tpu: dict[str, Any], **spec: Any) -> str:
    ft = parse(finetune(tpu=tpu, model={"name": "Qwen/Qwen2.5-0.5B"}, **spec), check_host_ram=False)
    return planning.format_plan(planning.plan(ft, planning.KNOWN_MODELS["Qwen/Qwen2.5-0.5B"]), ft)


def test_tpuft_plan_says_the_same() -> None:
    assert f"WARNING: {trainer_stack.NATIVE_CAVEAT}." in _plan_text(IRONWOOD, backend="native")
    assert "unverified" not in _plan_text({"type": "v5p", "topology": "2x2x2"})


def test_the_topology_page_says_the_same() -> None:
    page = topology_markdown()
    assert "## The trainer's stack on each family" in page
    assert "Backend xla cannot run on tpu7x (Ironwood)" in page
    assert "Backend native is unverified on TPU" in page
    assert "`TrainerStackVerified=False` (reason `NativeUnverifiedOnTpu`)" in page
