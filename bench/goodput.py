"""What stops cost a real run: the same tiny fine-tune through the local cluster twice, side by side on
two nodes, one left alone and one disrupted by a suspend and resume, a SIGKILLed host, and GKE
maintenance (the label, then the drain). Results: bench/results/goodput.json and goodput.png.
Side by side, the machine's other load slows both alike; the disrupted run's last stretch, after
the calm one has ended, runs alone (faster), which flatters it by a little.

The pods' `tpuft train` runs on this machine (the local executor, as in `make demo`: 4 PJRT CPU
devices for a v5e 2x2 host), with the pod's environment, config and token; the executor plays the
kubelet (SIGTERM on deletion, SIGKILL after the grace period). Steps lost per disruption come from the
trainer's own logs (the step each attempt reached against the step the next one resumed from);
goodput from status.goodput. Targets (issue 17): at most 1 step lost on SIGTERM and on maintenance,
and the disrupted run's goodput at least 0.9 x the undisrupted one's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from datetime import datetime
from pathlib import Path
from typing import Any

from bench import plot_file, results_file
from tpuft_dev.cluster.executor import LocalExecutor
from tpuft_dev.cluster.local import ClusterError, LocalCluster
from tpuft_dev.cluster.operator_process import (
    HOST_PATH_VALUES,
    OperatorProcess,
    install_operator,
    operator_env,
)
from tpuft_dev.demo import build_assets, host_run
from tpuft_operator.api.models import TERMINAL_PHASES, Phase
from tpuft_operator.maintenance import SCHEDULED_LABEL
from tpuft_trainer.storage import COMPLETE

RESULTS = results_file("goodput")
PNG = plot_file("goodput")
CLUSTER = "bench-goodput"
NAMESPACE = "goodput"  # each run in its own: goodput-calm, goodput-disrupted
# 6000 steps: runs long enough (~15 min here) that a restart's fixed cost is the share a real run's
# would be; the 0.9x target needs >= ~860 s (docs/benchmarks.md).
STEPS, SAVE_STEPS = 6000, 100
TARGET_STEPS_LOST, TARGET_GOODPUT_RATIO = 1, 0.9
RUNS = ("calm", "disrupted")
LOST = ("waitingSeconds", "startupSeconds", "checkpointSeconds", "redoneSeconds", "restartGapSeconds")
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+ ")


def namespace_of(name: str) -> str:
    return f"{NAMESPACE}-{name}"


def run_body(name: str, root: Path, steps: int) -> dict[str, Any]:
    body = host_run(
        name,
        namespace_of(name),
        root,
        steps,
        output=f"output-{name}",
        maxRestarts=1,  # the SIGKILL counts; the checkpointed stops must not
    )
    body["spec"]["training"]["saveSteps"] = SAVE_STEPS  # bounds what the SIGKILL loses
    return body


class Run:
    """One TPUFineTune and the cluster calls the disruptions need."""

    def __init__(self, cluster: LocalCluster, executor: LocalExecutor, name: str, output: Path) -> None:
        self.cluster, self.executor, self.name, self.output = cluster, executor, name, output
        self.namespace = namespace_of(name)

    def kubectl(self, *args: str) -> str:
        """A cluster call the benchmark needs to succeed: asked again while kubectl fails."""
        for attempt in range(10):
            try:
                return self.cluster.kubectl(*args).stdout
            except ClusterError as error:
                if attempt == 9:
                    raise
                print(f"   [{self.name}] asking again: {error}")
                time.sleep(2)
        raise AssertionError("unreachable")

    def status(self) -> dict[str, Any]:
        out = self.kubectl("get", "tpuft", self.name, "-n", self.namespace, "-o", "json")
        return dict(json.loads(out).get("status") or {})

    def step(self) -> int:
        return int((self.status().get("progress") or {}).get("step") or 0)

    def wait(self, what: str, check: Callable[[], bool], timeout: float = 600) -> None:
        """Until ``check()``; a kubectl call that fails on a loaded machine is asked again."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if check():
                    return
            except ClusterError as error:
                print(f"   [{self.name}] asking again: {error}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: timed out waiting for {what}; status {self.status()}")
            time.sleep(0.5)

    def wait_for_step(self, step: int) -> None:
        self.wait(f"step {step}", lambda: self.step() >= step, timeout=4 * 3600)

    def suspend(self, value: bool) -> None:
        body = json.dumps({"spec": {"suspend": value}})
        self.kubectl("patch", "tpuft", self.name, "-n", self.namespace, "--type=merge", "-p", body)

    def node(self) -> str:
        out = self.kubectl(
            "get", "pods", "-n", self.namespace, "-l", f"tpuft.dev/finetune={self.name}", "-o",
            "jsonpath={.items[?(@.status.phase=='Running')].spec.nodeName}",
        )  # fmt: skip
        return out.split()[0]

    def checkpoints(self) -> list[int]:
        return sorted(
            int(p.name.split("-")[1]) for p in self.output.glob("checkpoint-*") if (p / COMPLETE).exists()
        )


def disrupt(run: Run, steps: int) -> list[dict[str, Any]]:
    """The three disruptions at 20%, 45% and 70% of the run; what each did, in order."""
    done: list[dict[str, Any]] = []
    run.wait_for_step(steps // 5)
    started = time.monotonic()
    run.suspend(True)
    run.wait(
        "phase Suspended, no trainer",
        lambda: run.status().get("phase") == Phase.SUSPENDED and not run.executor.logs(),
    )
    time.sleep(2)
    run.suspend(False)
    done.append({"disruption": "suspend, resume 2 s later", "seconds": round(time.monotonic() - started, 1)})

    run.wait_for_step(steps * 45 // 100)
    hit = run.executor.kill_all()
    done.append({"disruption": "SIGKILL of the host (a VM lost without notice)", "pods": hit})

    run.wait_for_step(steps * 70 // 100)
    node = run.node()
    announced = int(time.time()) + 3600
    saved_before = run.checkpoints()
    started = time.monotonic()
    run.kubectl("label", "node", node, f"{SCHEDULED_LABEL}={announced}", "--overwrite")
    run.wait(
        "the maintenance checkpoint",
        lambda: (
            ((run.status().get("progress") or {}).get("lastCheckpoint") or {}).get("reason")
            == f"checkpoint request {announced}"
        ),
    )
    asked = {
        "disruption": "GKE maintenance announced on the run's node",
        "seconds_to_checkpoint": round(time.monotonic() - started, 1),
        "checkpoint": next((s for s in run.checkpoints() if s not in saved_before), None),
    }
    run.wait_for_step(steps * 75 // 100)
    run.kubectl("drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--force", "--timeout=300s")
    run.kubectl("uncordon", node)
    run.kubectl("label", "node", node, f"{SCHEDULED_LABEL}-")
    done += [asked, {"disruption": "the maintenance: node drained (SIGTERM), back at once"}]
    return done


def attempts_from_logs(logs: Sequence[Path]) -> list[dict[str, Any]]:
    """Per trainer process, in order: the step it resumed from and the last step it reached."""
    found = []
    for path in logs:
        text = path.read_text(errors="replace")
        stamp = next((m.group(1) for line in text.splitlines() if (m := _STAMP.match(line))), None)
        resumed = re.search(r"resuming from \S*checkpoint-(\d+)", text)
        reached = [int(s) for s in re.findall(r"progress: step (\d+)/", text)]
        reached += [int(s) for s in re.findall(r"stopped at step (\d+)", text)]
        found.append(
            {
                "pod": path.stem,
                "started": stamp,
                "resumed_from": int(resumed.group(1)) if resumed else 0,
                "last_step": max(reached, default=0),
                "stopped_with_checkpoint": "after saving checkpoint-" in text,
            }
        )
    return sorted(
        found, key=lambda a: datetime.strptime(a["started"] or "9999-01-01 00:00:00", "%Y-%m-%d %H:%M:%S")
    )


def steps_lost(attempts: list[dict[str, Any]]) -> list[int]:
    return [max(0, a["last_step"] - b["resumed_from"]) for a, b in itertools.pairwise(attempts)]


def measure(cluster: LocalCluster, root: Path, name: str, steps: int, disrupted: bool) -> dict[str, Any]:
    logs = root / f"pods-{name}"
    load_before = _load_average()
    executor = LocalExecutor(cluster, namespace_of(name), logs)
    executor.start()
    run = Run(cluster, executor, name, root / f"output-{name}")
    try:
        cluster.apply([run_body(name, root, steps)])
        disruptions = disrupt(run, steps) if disrupted else []
        run.wait("the end", lambda: run.status().get("phase") in TERMINAL_PHASES, timeout=4 * 3600)
    finally:
        executor.stop()
    status = run.status()
    attempts = attempts_from_logs(sorted(logs.glob("*.log")))
    lost = steps_lost(attempts)
    # One attempt ends at each disruption but the announcement (its checkpoint ends nothing).
    restarting = [d for d in disruptions if "seconds_to_checkpoint" not in d]
    for disruption, count in zip(restarting, lost, strict=False):
        disruption["steps_lost"] = count
    return {
        "run": name,
        # Machine load around the run: productive seconds differ between runs only by it.
        "load_average": [load_before, _load_average()],
        "phase": status.get("phase"),
        "steps": steps,
        "restarts": status.get("restarts", 0),
        "goodput": status.get("goodput"),
        "attempts": attempts,
        "steps_lost": lost,
        "disruptions": disruptions,
    }


def _load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def main(steps: int = STEPS) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="tpuft-goodput-"))
    build_assets(root)
    cluster = LocalCluster(name=CLUSTER, log=lambda line: print(f"   [cluster] {line}"))
    cluster.down()
    cluster.up()
    # The runs read their model and data from this host (hostPath): the admin opts in.
    operator = OperatorProcess(
        install_operator(cluster, values=HOST_PATH_VALUES),
        root / "operator.log",
        **{
            **operator_env(cluster, HOST_PATH_VALUES),
            "TPUFT_RESYNC_SECONDS": "5",
            "TPUFT_PROGRESS_INTERVAL_SECONDS": "1",
            "TPUFT_GOODPUT_INTERVAL_SECONDS": "5",
            "TPUFT_TRAINER_IMAGE": "example.invalid/tpuft-trainer:bench",
        },
    )
    try:
        for name in RUNS:
            cluster.kubectl("create", "namespace", namespace_of(name))
            cluster.add_nodepool("v5e", "2x2", prefix=f"goodput-{name}")
        operator.start()
        # Side by side, each on its own node: whatever else loads the machine loads both alike, so
        # their goodputs compare (one after the other, the load of the hour decided the ratio).
        print(f">> goodput: two runs of {steps} steps at once; one is suspended, SIGKILLed and maintained")
        pool = ThreadPoolExecutor(len(RUNS))
        futures = [pool.submit(measure, cluster, root, name, steps, name == "disrupted") for name in RUNS]
        # One run failing ends the benchmark now, not when the other has finished.
        wait(futures, return_when=FIRST_EXCEPTION)
        pool.shutdown(wait=False, cancel_futures=True)
        calm, rough = (f.result() for f in futures)
    finally:
        operator.stop()
        cluster.down()
    results = {
        "what": "a tiny Llama fine-tune on 4 PJRT CPU devices through the local cluster, undisrupted vs disrupted, side by side",
        "steps": steps,
        "save_steps": SAVE_STEPS,
        "runs": [calm, rough],
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    plot(results)
    return results


def report(results: dict[str, Any]) -> list[str]:
    calm, rough = results["runs"]
    lines = [
        f"goodput under disruption ({results['what']}; {results['steps']} steps, saveSteps {results['save_steps']}):"
    ]
    lines.append(
        f"{'run':>10} {'phase':>9} {'restarts':>8} {'goodput':>7} {'wall s':>7} "
        + " ".join(f"{k[:-7]:>12}" for k in LOST)
    )
    for run in (calm, rough):
        g = run["goodput"] or {}
        lost = g.get("lost") or {}
        lines.append(
            f"{run['run']:>10} {run['phase']:>9} {run['restarts']:>8} {g.get('ratio', '-'):>7} {g.get('wallSeconds', '-'):>7} "
            + " ".join(f"{lost.get(k, '-'):>12}" for k in LOST)
        )
    for d in rough["disruptions"]:
        extra = f": {d['steps_lost']} step(s) lost" if "steps_lost" in d else ""
        if "seconds_to_checkpoint" in d:
            extra = f": checkpoint-{d['checkpoint']} {d['seconds_to_checkpoint']} s after the label"
        lines.append(f"  {d['disruption']}{extra}")
    ratio = None
    if calm["goodput"] and rough["goodput"] and calm["goodput"]["ratio"]:
        ratio = rough["goodput"]["ratio"] / calm["goodput"]["ratio"]
        # What the disruptions cost in seconds does not depend on how fast the steps ran (machine
        # load); the target then holds for any run whose undisrupted wall time is >= 9 x that cost.
        extra = sum(rough["goodput"]["lost"].values()) - sum(calm["goodput"]["lost"].values())
        count = sum(1 for d in rough["disruptions"] if "steps_lost" in d)
        lines.append(
            f"  the disruptions cost {extra:.0f} s in all ({extra / max(count, 1):.0f} s each, mostly start-up); "
            f"productive s calm/disrupted {calm['goodput']['productiveSeconds']}/{rough['goodput']['productiveSeconds']} "
            f"(load average {calm.get('load_average')} / {rough.get('load_average')}); the 0.9x target holds for "
            f"undisrupted runs of >= {9 * extra:.0f} s here"
        )
    stops = [
        d["steps_lost"]
        for d in rough["disruptions"]
        if "steps_lost" in d and "SIGKILL" not in d["disruption"]
    ]
    lines.append("targets:")
    if stops:
        verdict = "met" if max(stops) <= TARGET_STEPS_LOST else "NOT met"
        lines.append(f"  steps lost on SIGTERM (suspend, drain) <= {TARGET_STEPS_LOST}: {stops}, {verdict}")
    if ratio is not None:
        verdict = "met" if ratio >= TARGET_GOODPUT_RATIO else "NOT met"
        lines.append(f"  disrupted goodput >= {TARGET_GOODPUT_RATIO} x undisrupted: {ratio:.3f}x, {verdict}")
    return lines


def plot(results: dict[str, Any], path: Path = PNG) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results["runs"] if r["goodput"]]
    fig, ax = plt.subplots(figsize=(9, 3.5))
    names = [r["run"] for r in runs]
    left = [0.0] * len(runs)
    parts = [("productive", lambda g: g["productiveSeconds"])] + [
        (k[:-7], lambda g, k=k: g["lost"][k]) for k in LOST
    ]
    for label, value in parts:
        widths = [value(r["goodput"]) for r in runs]
        ax.barh(names, widths, left=left, label=label)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("seconds since creation")
    ax.set_title("where the wall time of a run went (status.goodput)")
    ax.legend(ncols=3, fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parser() -> argparse.ArgumentParser:
    parsed = argparse.ArgumentParser(prog="python -m bench goodput")
    parsed.add_argument("--steps", type=int, default=STEPS, help="training steps of each run")
    return parsed
