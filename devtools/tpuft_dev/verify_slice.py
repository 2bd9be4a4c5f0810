"""`scripts/verify-on-slice.sh`: check the trainer on a real TPU slice, end to end, and say what held.

NOT YET RUN ON A SLICE BY THE PROJECT: everything here is proven on PJRT CPU devices and with two
gloo processes only (docs/trainer.md, "What CPU runs prove, and what they cannot"). This is the
check to run on one; please report its output.

On a GKE cluster with tpuft installed (docs/install-gke.md), against a node pool of the shape you
name, whose pods can reach the Hugging Face hub (or pass ``--model`` a gs:// copy) and write to the
``--output`` bucket (Workload Identity: ``--service-account``), it:

1. writes a small text dataset to ``<output>/data/train.jsonl`` (``gcloud storage cp``);
2. applies a TPUFineTune: a full fine-tune of a small public model (default Qwen/Qwen2.5-0.5B:
   safetensors, so it loads slice by slice) for 40 steps, saving every 10, evaluating 10% held out;
3. once the run is past step 15, suspends it (every pod gets SIGTERM: the stop saves the step it
   reached) and waits for the pods to be gone;
4. resumes it and waits for Succeeded;
5. checks the status and ``<output>/run/tpuft-metrics.json``: the run resumed from the stop's
   checkpoint, the stop was not counted as a restart, every host joined one program (processes and
   devices of the shape), the model loaded by slice, the losses are finite, the final model is there.

Exit 0 when every check holds, 1 when one does not (each is printed), 2 when it could not run.
``--dry-run`` prints the manifest and the commands instead of running them (no cluster needed).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import click
import yaml

from tpuft_operator.api.resources import FINETUNE
from tpuft_operator.api.validation import SpecError, parse_run

MAX_STEPS, SAVE_STEPS, STOP_AFTER_STEP = 40, 10, 15
DEFAULT_MODEL = "Qwen/Qwen2.5-0.5B"
ROWS = 2000


@dataclass(frozen=True)
class Plan:
    """What one verification run is: the names and the shape it expects to see."""

    name: str
    namespace: str
    output: str
    dataset: str
    hosts: int
    chips: int
    manifest: dict[str, Any]

    @property
    def run_output(self) -> str:
        return f"{self.output}/run"


def build_plan(
    *,
    tpu_type: str,
    topology: str,
    output: str,
    namespace: str = "default",
    model: str = DEFAULT_MODEL,
    dataset: str | None = None,
    chips_per_host: int | None = None,
    placement_policy: str | None = None,
    service_account: str | None = None,
    image: str | None = None,
    backend: str = "xla",
) -> Plan:
    """The TPUFineTune to apply and what its status and metrics must then show. Raises the
    operator's own SpecError for a shape or field it would refuse."""
    suffix = "-native" if backend == "native" else ""
    name = f"tpuft-verify-{tpu_type}-{topology.replace('x', '-')}{suffix}".lower()
    output = output.rstrip("/")
    data = dataset or f"{output}/data/train.jsonl"
    tpu: dict[str, Any] = {"type": tpu_type, "topology": topology}
    if chips_per_host is not None:
        tpu["chipsPerHost"] = chips_per_host
    if placement_policy is not None:
        tpu["placementPolicy"] = placement_policy
    spec: dict[str, Any] = {
        "backend": backend,
        "model": {"name": model},
        "dataset": {"name": data, "evalFraction": 0.1},
        "tpu": tpu,
        "training": {
            "method": "full",
            "maxSteps": MAX_STEPS,
            "saveSteps": SAVE_STEPS,
            "loggingSteps": 1,
            "evalSteps": 20,
            "perDeviceBatchSize": 1,
            "maxSeqLength": 256,
            "optimizer": "adamw",
            "learningRate": 1.0e-5,
        },
        "output": {"uri": f"{output}/run"},
        # A stop here saves a 0.5B model's weights and AdamW state: minutes are plenty, seconds may not be.
        "terminationGracePeriodSeconds": 600,
        "maxRestarts": 1,
    }
    if service_account is not None:
        spec["serviceAccountName"] = service_account
    if image is not None:
        spec["image"] = image
    manifest = {
        "apiVersion": f"{FINETUNE.group}/{FINETUNE.version}",
        "kind": "TPUFineTune",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }
    shape = parse_run(manifest, check_host_ram=False).shape  # what the operator will make of it
    return Plan(name, namespace, output, data, shape.hosts, shape.chips, manifest)


def dataset_rows(n: int = ROWS) -> str:
    """A deterministic text dataset (JSON lines): enough rows for any slice's global batch."""
    words = ["tpu", "slice", "host", "chip", "mesh", "shard", "step", "save", "resume", "model"]
    lines = []
    for i in range(n):
        sentence = " ".join(words[(i * 7 + k * 3) % len(words)] for k in range(12 + i % 20))
        lines.append(json.dumps({"text": f"row {i}: {sentence}."}))
    return "\n".join(lines) + "\n"


def check_run(
    plan: Plan, status: dict[str, Any], stop_step: int | None, metrics: dict[str, Any] | None
) -> list[str]:
    """Every check that failed, in words (empty: the slice did what the CPU tests show)."""
    failures = []
    progress = status.get("progress") or {}
    attempt = progress.get("attempt") or {}
    if status.get("phase") != "Succeeded":
        failures.append(f"phase {status.get('phase')!r}, not Succeeded: {status.get('message')}")
    if progress.get("step") != MAX_STEPS:
        failures.append(f"status.progress.step is {progress.get('step')}, not {MAX_STEPS}")
    if stop_step is None or stop_step < STOP_AFTER_STEP:
        failures.append(
            f"after the suspend (SIGTERM past step {STOP_AFTER_STEP}) the newest checkpoint is {stop_step}: "
            "the stop saved nothing"
        )
    elif attempt.get("resumedFromStep") != stop_step:
        failures.append(
            f"the resumed attempt started from step {attempt.get('resumedFromStep')}, not from the stop's checkpoint {stop_step}"
        )
    if status.get("restartsCounted") not in (None, 0):
        failures.append(
            f"restartsCounted is {status.get('restartsCounted')}: the stop counted against maxRestarts"
        )
    if metrics is None:
        return [*failures, f"no {plan.run_output}/tpuft-metrics.json"]
    if metrics.get("process_count") != plan.hosts:
        failures.append(
            f"{metrics.get('process_count')} process(es) joined, the slice has {plan.hosts} hosts"
        )
    if metrics.get("devices") != plan.chips:
        failures.append(f"the runtime saw {metrics.get('devices')} devices, the slice has {plan.chips} chips")
    if stop_step and metrics.get("resumed_from") != f"checkpoint-{stop_step}":
        failures.append(
            f"tpuft-metrics.json: resumed_from {metrics.get('resumed_from')!r}, not checkpoint-{stop_step}"
        )
    if not (metrics.get("model_load") or {}).get("sharded"):
        failures.append(f"the model was not loaded by slice: {(metrics.get('model_load') or {}).get('why')}")
    losses = [float(v) for v in (metrics.get("losses") or {}).values()]
    if not losses or not all(math.isfinite(v) for v in losses):
        failures.append(f"losses missing or not finite: {losses[:5]}")
    if metrics.get("final_step") != MAX_STEPS:
        failures.append(f"tpuft-metrics.json: final_step {metrics.get('final_step')}, not {MAX_STEPS}")
    return failures


def check_files(names: Sequence[str], stop_step: int | None) -> list[str]:
    """The final model at the output root (the config and the weights: one file, or shards + index),
    and the stop's checkpoint beside it."""
    failures = []
    if stop_step is not None and f"checkpoint-{stop_step}" not in names:
        failures.append(f"no checkpoint-{stop_step} at the output")
    if "config.json" not in names:
        failures.append("no config.json at the output")
    if "model.safetensors" not in names and "model.safetensors.index.json" not in names:
        failures.append("no model.safetensors (or model.safetensors.index.json) at the output")
    return failures


Runner = Callable[[Sequence[str], str | None], str]


def run_command(command: Sequence[str], stdin: str | None = None) -> str:
    done = subprocess.run(list(command), input=stdin, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise click.ClickException(
            f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}"
        )
    return done.stdout


def dry_runner(command: Sequence[str], stdin: str | None = None) -> str:
    print("$ " + " ".join(command) + (" <<EOF ... EOF" if stdin else ""))
    return ""


class Slice:
    """The cluster side: kubectl and gcloud, through one runner (``dry_runner`` prints instead)."""

    def __init__(self, plan: Plan, run: Runner, poll_seconds: float = 20.0) -> None:
        self.plan, self.run, self.poll_seconds = plan, run, poll_seconds

    def status(self) -> dict[str, Any]:
        out = self.run(
            ["kubectl", "get", FINETUNE.plural, self.plan.name, "-n", self.plan.namespace, "-o", "json"], None
        )
        return dict(json.loads(out).get("status") or {}) if out else {}

    def pods(self) -> list[str]:
        selector = f"jobset.sigs.k8s.io/jobset-name={self.plan.name}"
        out = self.run(
            ["kubectl", "get", "pods", "-n", self.plan.namespace, "-l", selector, "-o", "name"], None
        )
        return out.split()

    def suspend(self, value: bool) -> None:
        patch = json.dumps({"spec": {"suspend": value}})
        self.run(
            [
                "kubectl",
                "patch",
                FINETUNE.plural,
                self.plan.name,
                "-n",
                self.plan.namespace,
                "--type",
                "merge",
                "-p",
                patch,
            ],
            None,
        )

    def wait(self, what: str, done: Callable[[], bool], timeout_seconds: float) -> None:
        deadline = time.monotonic() + timeout_seconds
        while not done():
            if time.monotonic() > deadline:
                raise click.ClickException(
                    f"timed out waiting for {what}; `kubectl describe tpuft {self.plan.name}` says why"
                )
            time.sleep(self.poll_seconds)
        print(f"ok: {what}", flush=True)


def verify(plan: Plan, run: Runner, *, timeout_minutes: float, keep: bool, dry_run: bool) -> list[str]:
    cluster = Slice(plan, run)
    body = yaml.safe_dump(plan.manifest, sort_keys=False)
    if plan.dataset.startswith(f"{plan.output}/data/"):
        run(["gcloud", "storage", "cp", "-", plan.dataset], dataset_rows())
    run(["kubectl", "apply", "--server-side", "-f", "-"], body)
    if dry_run:
        print(
            f"then: wait for status.progress.step >= {STOP_AFTER_STEP}; suspend; wait for the pods to go; "
            "resume; wait for Succeeded;"
        )
        print(
            f"read {plan.run_output}/tpuft-metrics.json and list {plan.run_output}/; check (check_run, check_files)"
        )
        return []
    timeout = timeout_minutes * 60

    def past_the_stop_point() -> bool:
        status = cluster.status()
        step = (status.get("progress") or {}).get("step") or 0
        return step >= STOP_AFTER_STEP or status.get("phase") in ("Failed", "Succeeded")

    cluster.wait(f"{plan.name} past step {STOP_AFTER_STEP}", past_the_stop_point, timeout)
    cluster.suspend(True)
    cluster.wait(
        "every pod of the suspended run gone (SIGTERM: each host saves)", lambda: not cluster.pods(), 30 * 60
    )
    # The stop's save: of the step reached, or the periodic save that was writing when SIGTERM came.
    saved = (cluster.status().get("progress") or {}).get("lastCheckpoint") or {}
    stop_step = saved.get("step")
    print(f"the newest checkpoint after the stop: {json.dumps(saved)}", flush=True)
    cluster.suspend(False)
    cluster.wait(
        f"{plan.name} finished", lambda: cluster.status().get("phase") in ("Failed", "Succeeded"), timeout
    )
    status = cluster.status()
    try:
        metrics = json.loads(run(["gcloud", "storage", "cat", f"{plan.run_output}/tpuft-metrics.json"], None))
    except click.ClickException:
        metrics = None
    listing = run(["gcloud", "storage", "ls", f"{plan.run_output}/"], None)
    names = [line.rstrip("/").rsplit("/", 1)[-1] for line in listing.split()]
    failures = check_run(plan, status, stop_step, metrics) + check_files(names, stop_step)
    if not keep:
        run(["kubectl", "delete", FINETUNE.plural, plan.name, "-n", plan.namespace], None)
    return failures


@click.command(name="verify-on-slice")
@click.option(
    "--type", "tpu_type", required=True, help="TPU type of the node pool: v4, v5e, v5p, v6e, tpu7x."
)
@click.option(
    "--topology", required=True, help="Topology of one slice, e.g. 2x4 or 2x2x2 (multi-host shows the joins)."
)
@click.option(
    "--output", required=True, help="gs:// prefix the run may write to (data/ and run/ go under it)."
)
@click.option("--namespace", default="default", show_default=True)
@click.option(
    "--model", default=DEFAULT_MODEL, show_default=True, help="A small public model with safetensors."
)
@click.option("--dataset", default=None, help="A text dataset (field `text`) instead of the generated one.")
@click.option(
    "--chips-per-host", type=int, default=None, help="spec.tpu.chipsPerHost (v5e/v6e 2x4 on one VM: 8)."
)
@click.option("--placement-policy", default=None, help="spec.tpu.placementPolicy (multi-host tpu7x pools).")
@click.option(
    "--service-account",
    default=None,
    help="The pods' Kubernetes ServiceAccount (Workload Identity for gs://).",
)
@click.option("--image", default=None, help="Trainer image (default: the operator's).")
@click.option(
    "--backend",
    type=click.Choice(["xla", "native"]),
    default="xla",
    show_default=True,
    help="spec.backend (tpu7x runs native only).",
)
@click.option(
    "--timeout-minutes", type=float, default=90, show_default=True, help="Per wait (capacity, compilation)."
)
@click.option("--keep", is_flag=True, help="Leave the TPUFineTune (and its output) for inspection.")
@click.option("--dry-run", is_flag=True, help="Print the manifest and the commands; touch nothing.")
def main(**options: Any) -> None:
    """Check tpuft's trainer on a real TPU slice: saves, a SIGTERM stop, a resume and the export.
    NOT YET RUN ON A SLICE BY THE PROJECT (see the module's docstring); please report its output."""
    keep, dry_run, timeout = options.pop("keep"), options.pop("dry_run"), options.pop("timeout_minutes")
    if not options["output"].startswith("gs://"):
        raise click.UsageError(
            "--output must be a gs:// prefix: the check reads the run's files back with gcloud"
        )
    try:
        plan = build_plan(**options)
    except SpecError as error:
        raise click.UsageError("; ".join(f"{e.field}: {e.reason}" for e in error.errors)) from None
    print(f"# {plan.name}: {plan.hosts} host(s), {plan.chips} chips; output {plan.run_output}")
    if dry_run:
        print(yaml.safe_dump(plan.manifest, sort_keys=False))
    failures = verify(
        plan, dry_runner if dry_run else run_command, timeout_minutes=timeout, keep=keep, dry_run=dry_run
    )
    for failure in failures:
        print(f"FAILED: {failure}")
    if failures:
        sys.exit(1)
    print("dry run: nothing was checked" if dry_run else "every check held")


if __name__ == "__main__":
    main()
