"""A tpu7x run is told, in its status, an Event, `tpuft plan` and docs/topology.md, that the trainer's
stack is unverified there; the run is not refused, and other families carry no such caveat."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tests.unit.test_reconciler import Events, RecordingApi, new_run, reconciler, written
from tests.unit.test_status import cond, derive, finetune
from tpuft_operator import plan as planning
from tpuft_operator import trainer_stack
from tpuft_operator.api.validation import parse
from tpuft_operator.topology_doc import topology_markdown

ROOT = Path(__file__).resolve().parents[2]
IRONWOOD = {"type": "tpu7x", "topology": "2x2x2"}


def test_only_tpu7x_carries_a_caveat() -> None:
    caveat = trainer_stack.trainer_stack_caveat({"tpu": IRONWOOD})
    assert caveat is not None and caveat.startswith("the trainer's stack is unverified on tpu7x (Ironwood)")
    # The sources, so a reader can check them.
    for source in (
        "pytorch/xla .github/workflows/_tpu_ci.yml",
        "docs.cloud.google.com/tpu/docs/tpu7x",
        "TorchTPU",
    ):
        assert source in caveat
    for other in ("v4", "v5e", "v5p", "v6e"):
        assert trainer_stack.trainer_stack_caveat({"tpu": {"type": other, "topology": "2x2"}}) is None
    assert trainer_stack.trainer_stack_caveat({}) is None


def test_the_caveat_names_the_versions_the_trainer_image_pins() -> None:
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
    caveat = trainer_stack.TPU7X_CAVEAT
    assert f"torch_xla {pins['torch_xla']} with libtpu {pins['libtpu']}" in caveat
    assert len(caveat) <= 1024  # a Kubernetes Event's message is cut there (k8s.py)


def test_a_tpu7x_run_has_the_condition_from_its_spec_alone() -> None:
    status = derive(finetune(tpu=IRONWOOD), None)
    stack = cond(status, "TrainerStackVerified")
    assert (stack["status"], stack["reason"]) == ("False", "UnverifiedOnTpu7x")
    assert stack["message"] == trainer_stack.TPU7X_CAVEAT
    assert status["phase"] == "Pending"  # not refused: it waits for its JobSet like any run
    assert "TrainerStackVerified" not in {c["type"] for c in derive(finetune(), None)["conditions"]}


def test_a_tpu7x_run_is_warned_once_with_its_jobset_and_still_created() -> None:
    api, events = RecordingApi(), Events()
    r, _ = reconciler(api)
    run = new_run()
    run["spec"]["tpu"] = dict(IRONWOOD)
    r.reconcile(run, None, [], event=events)
    assert ("create", "JobSet") in api.writes()
    assert events.posted[:2] == ["JobSetCreated", trainer_stack.EVENT_REASON]
    stack = cond(written(r)["status"], "TrainerStackVerified")
    assert (stack["status"], stack["reason"]) == ("False", "UnverifiedOnTpu7x")
    r.reconcile(written(r), None, [], event=events)
    assert events.posted.count(trainer_stack.EVENT_REASON) == 1  # once, with the JobSet's creation


def test_a_v5p_run_gets_no_such_event() -> None:
    api, events = RecordingApi(), Events()
    r, _ = reconciler(api)
    r.reconcile(new_run(), None, [], event=events)
    assert trainer_stack.EVENT_REASON not in events.posted


def _plan_text(tpu: dict[str, Any]) -> str:
    ft = parse(finetune(tpu=tpu, model={"name": "Qwen/Qwen2.5-0.5B"}), check_host_ram=False)
    return planning.format_plan(planning.plan(ft, planning.KNOWN_MODELS["Qwen/Qwen2.5-0.5B"]), ft)


def test_tpuft_plan_says_the_same() -> None:
    assert f"WARNING: {trainer_stack.TPU7X_CAVEAT}." in _plan_text(IRONWOOD)
    assert "unverified" not in _plan_text({"type": "v5p", "topology": "2x2x2"})


def test_the_topology_page_says_the_same() -> None:
    page = topology_markdown()
    assert "## The trainer's stack on each family" in page
    assert "The trainer's stack is unverified on tpu7x (Ironwood)" in page
    assert "`TrainerStackVerified=False` (reason `UnverifiedOnTpu7x`)" in page
