"""scripts/verify-on-slice.sh (tpuft_dev.verify_slice): it has not run on a slice here; what can be
checked without one is that it parses, that the run it would apply is one the operator accepts for
the shape named, and that its checks fail on the results they are meant to catch."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from tpuft_dev import verify_slice
from tpuft_operator.api.validation import SpecError, parse_run

OUTPUT = "gs://my-bucket/tpuft-verify"


def test_help_says_it_has_not_run_on_a_slice() -> None:
    result = CliRunner().invoke(verify_slice.main, ["--help"])
    assert result.exit_code == 0, result.output
    assert "NOT YET RUN ON A SLICE" in result.output
    assert "--dry-run" in result.output


def test_a_dry_run_prints_a_manifest_the_operator_accepts_and_touches_nothing() -> None:
    args = [
        "--type",
        "v5p",
        "--topology",
        "2x2x2",
        "--output",
        OUTPUT,
        "--service-account",
        "tpuft-trainer",
        "--dry-run",
    ]
    result = CliRunner().invoke(verify_slice.main, args)
    assert result.exit_code == 0, result.output
    first, rest = result.output.split("\n", 1)
    assert first == f"# tpuft-verify-v5p-2-2-2: 2 host(s), 8 chips; output {OUTPUT}/run"
    manifest = yaml.safe_load(rest.split("\n$ ")[0])
    assert parse_run(manifest).shape.hosts == 2
    assert manifest["spec"]["serviceAccountName"] == "tpuft-trainer"
    assert f"$ gcloud storage cp - {OUTPUT}/data/train.jsonl" in result.output
    assert "dry run: nothing was checked" in result.output


@pytest.mark.parametrize(
    ("options", "hosts", "chips"),
    [
        ({"tpu_type": "v5e", "topology": "2x4"}, 2, 8),
        ({"tpu_type": "v6e", "topology": "2x4", "chips_per_host": 8}, 1, 8),
        (
            {
                "tpu_type": "tpu7x",
                "topology": "2x2x2",
                "placement_policy": "ironwood-2x2x2",
                "backend": "native",
            },
            2,
            8,
        ),
        ({"tpu_type": "v4", "topology": "2x2x1"}, 1, 4),
    ],
)
def test_the_plan_expects_the_shapes_hosts_and_chips(options: dict[str, Any], hosts: int, chips: int) -> None:
    plan = verify_slice.build_plan(output=OUTPUT, **options)
    assert (plan.hosts, plan.chips) == (hosts, chips)
    training = plan.manifest["spec"]["training"]
    assert training["saveSteps"] < verify_slice.STOP_AFTER_STEP < training["maxSteps"]


def test_what_the_operator_refuses_is_refused_before_anything_runs() -> None:
    with pytest.raises(SpecError):
        verify_slice.build_plan(tpu_type="v5e", topology="3x3", output=OUTPUT)
    result = CliRunner().invoke(
        verify_slice.main, ["--type", "v5e", "--topology", "2x2", "--output", "/tmp/x"]
    )
    assert result.exit_code == 2 and "gs://" in result.output


def test_the_generated_dataset_is_text_rows() -> None:
    rows = [json.loads(line) for line in verify_slice.dataset_rows(50).splitlines()]
    assert len(rows) == 50 and all(set(r) == {"text"} and r["text"] for r in rows)


def good_results(plan: verify_slice.Plan) -> tuple[dict[str, Any], int, dict[str, Any]]:
    status = {
        "phase": "Succeeded",
        "restartsCounted": 0,
        "progress": {"step": verify_slice.MAX_STEPS, "attempt": {"resumedFromStep": 17}},
    }
    metrics = {
        "process_count": plan.hosts,
        "devices": plan.chips,
        "resumed_from": "checkpoint-17",
        "model_load": {"sharded": True},
        "losses": {"18": 2.5, "40": 1.9},
        "final_step": verify_slice.MAX_STEPS,
    }
    return status, 17, metrics


def test_the_checks_hold_on_a_good_run_and_name_each_thing_that_went_wrong() -> None:
    plan = verify_slice.build_plan(tpu_type="v5p", topology="2x2x2", output=OUTPUT)
    status, stop_step, metrics = good_results(plan)
    assert verify_slice.check_run(plan, status, stop_step, metrics) == []
    files = ["config.json", "model.safetensors", "checkpoint-17", "tpuft-metrics.json"]
    assert verify_slice.check_files(files, stop_step) == []

    def failures(path: tuple[str, ...], value: Any, *, in_metrics: bool = False) -> list[str]:
        s, m = copy.deepcopy(status), copy.deepcopy(metrics)
        target = m if in_metrics else s
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return verify_slice.check_run(plan, s, stop_step, m)

    assert "not Succeeded" in failures(("phase",), "Failed")[0]
    assert "not from the stop's checkpoint 17" in failures(("progress", "attempt", "resumedFromStep"), 10)[0]
    assert "counted against maxRestarts" in failures(("restartsCounted",), 1)[0]
    assert (
        "1 process(es) joined, the slice has 2 hosts" in failures(("process_count",), 1, in_metrics=True)[0]
    )
    assert "4 devices" in failures(("devices",), 4, in_metrics=True)[0]
    assert (
        "not loaded by slice" in failures(("model_load",), {"sharded": False, "why": "x"}, in_metrics=True)[0]
    )
    assert "not finite" in failures(("losses",), {"40": float("nan")}, in_metrics=True)[0]
    assert "the stop saved nothing" in verify_slice.check_run(plan, status, 10, metrics)[0]
    assert verify_slice.check_run(plan, status, stop_step, None) == [f"no {OUTPUT}/run/tpuft-metrics.json"]
    assert verify_slice.check_files(["config.json", "model.safetensors.index.json"], 17) == [
        "no checkpoint-17 at the output"
    ]
    assert "no config.json" in verify_slice.check_files(["model.safetensors", "checkpoint-17"], 17)[0]
