"""Faults (issue 8, short version): runs in flight survive the operator being SIGKILLed, the JobSet
controller and kube-apiserver being stopped, on a dedicated local cluster (stopping components of the
shared one would break other tests).

After each fault every run converges to Running with exactly one JobSet, none is lost, duplicated or
restarted, and the operator is still alive (it never exits on its own). Runs created while a component
is down are created once it is back. Figures go to bench/results/faults.json.
`TPUFT_CHAOS_ROUNDS=N` repeats the fault sequence N times (`make chaos`).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TEST_CLUSTER
from tests.support import get_json, wait_for
from tpuft_operator.cluster import kwok
from tpuft_operator.cluster.local import LocalCluster
from tpuft_operator.cluster.operator_process import OperatorProcess, install_operator
from tpuft_operator.render import naming

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "faults.json"
ROUNDS = int(os.environ.get("TPUFT_CHAOS_ROUNDS", "1"))
NAMESPACE = "faults"
INITIAL_RUNS = 10
OUTAGE_SECONDS = 20
LABEL = "tpuft.dev/finetune"


def run_body(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "tpuft.dev/v1alpha1",
        "kind": "TPUFineTune",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"name": "google/gemma-2-2b"},
            "dataset": {"name": "tatsu-lab/alpaca"},
            "tpu": {"type": "v5p", "topology": "2x2x1"},
            "training": {"maxSteps": 10},
            "output": {"uri": "gs://my-bucket/out"},
            "maxRestarts": 0,
            # In flight for the whole suite.
            "podAnnotations": kwok.hold_running("3600s"),
        },
    }


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    name = "faults" if TEST_CLUSTER == "pytest" else f"{TEST_CLUSTER}-faults"
    dedicated = LocalCluster(name=name, log=lambda line: print(f"[faults] {line}"))
    was_running = dedicated.layout.state.exists() and all(s.healthy for s in dedicated.status())
    dedicated.up()
    yield dedicated
    if not was_running and os.environ.get("TPUFT_KEEP_CLUSTER") != "1":
        dedicated.down()


@pytest.fixture(scope="module")
def fault_operator(
    cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    process = OperatorProcess(
        install_operator(cluster),
        tmp_path_factory.mktemp("faults") / "operator.log",
        TPUFT_RESYNC_SECONDS="5",
        TPUFT_TRAINER_IMAGE="example.invalid/tpuft-trainer:test",
    )
    process.start()
    yield process
    process.stop()


class Ledger:
    """What the suite injected and checked."""

    def __init__(self, cluster: LocalCluster, operator: OperatorProcess) -> None:
        self.cluster = cluster
        self.operator = operator
        self.runs: list[str] = []
        self.faults: list[dict[str, Any]] = []
        self.checks = 0
        self.violations: list[str] = []

    def create(self, count: int) -> None:
        names = [f"run-{len(self.runs) + i:02d}" for i in range(count)]
        self.runs += names
        # While a component is down the apiserver may refuse; the runs are created when it is back.
        wait_for(
            lambda: (
                self.cluster.kubectl(
                    "apply",
                    "-f",
                    "-",
                    input=json.dumps(
                        {"apiVersion": "v1", "kind": "List", "items": [run_body(n) for n in names]}
                    ),
                    check=False,
                ).returncode
                == 0
            ),
            timeout=120,
            what="the runs to be created",
            interval=2,
        )

    def violations_now(self) -> list[str]:
        found: list[str] = []
        finetunes = {
            f["metadata"]["name"]: f for f in get_json(self.cluster, "tpuft", "-n", NAMESPACE)["items"]
        }
        jobsets = get_json(self.cluster, "jobsets", "-n", NAMESPACE)["items"]
        per_run: dict[str, list[str]] = {}
        for js in jobsets:
            per_run.setdefault(js["metadata"]["labels"].get(LABEL, "?"), []).append(js["metadata"]["name"])
        for name in self.runs:
            ft = finetunes.get(name)
            if ft is None:
                found.append(f"{name}: lost")
                continue
            status = ft.get("status", {})
            if status.get("phase") != "Running":
                found.append(f"{name}: phase {status.get('phase')} ({status.get('message')})")
            if per_run.get(name) != [naming.jobset_name(name)]:
                found.append(f"{name}: JobSets {per_run.get(name)}")
            if status.get("restarts", 0) != 0:
                found.append(f"{name}: restarts {status.get('restarts')}")
        extra = sorted(set(per_run) - set(self.runs))
        if extra or len(finetunes) != len(self.runs):
            found.append(
                f"unexpected objects: JobSets of {extra}, {len(finetunes)} runs for {len(self.runs)}"
            )
        if not self.operator.alive():
            found.append("the operator exited")
        return found

    def play_kubelet(self) -> int:
        """kwok stands in for the kubelets and could not renew its nodes' leases while the apiserver
        was down: the node lifecycle controller then marked their pods Ready=False, and kwok never
        reports a running pod ready again (a real kubelet would). Do what the kubelet would; returns
        the pods healed. Until then the operator rightly reports those runs Pending."""
        healed = 0
        for pod in get_json(self.cluster, "pods", "-n", NAMESPACE)["items"]:
            status = pod.get("status", {})
            conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
            stale = status.get("phase") == "Running" and conditions.get("Ready") == "False"
            if stale and conditions.get("ContainersReady") == "True":
                patch = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
                self.cluster.kubectl(
                    "patch", "pod", pod["metadata"]["name"], "-n", NAMESPACE, "--subresource=status",
                    "--type=strategic", "-p", json.dumps(patch), check=False,
                )  # fmt: skip
                healed += 1
        return healed

    def converge(self, fault: str, timeout: float = 180, kubelet: bool = False) -> None:
        started = time.monotonic()
        last: list[str] = []
        healed = 0

        def converged() -> bool:
            nonlocal last, healed
            if kubelet:
                healed += self.play_kubelet()
            last = self.violations_now()
            return not last

        try:
            wait_for(converged, timeout=timeout, what=f"convergence after {fault}", interval=2)
        except AssertionError:
            self.violations += [f"after {fault}: {v}" for v in last]
        self.checks += len(self.runs)
        self.faults.append(
            {
                "fault": fault,
                "runs": len(self.runs),
                "seconds_to_converge": round(time.monotonic() - started, 1),
                "pods_marked_ready_by_the_test": healed,
            }
        )


def test_runs_survive_faults(cluster: LocalCluster, fault_operator: OperatorProcess) -> None:
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    cluster.add_nodepool("v5p", "2x2x1", slices=INITIAL_RUNS + 4 * ROUNDS, prefix="faults")
    ledger = Ledger(cluster, fault_operator)
    ledger.create(INITIAL_RUNS)
    ledger.converge("start")

    for _ in range(ROUNDS):
        # The operator is SIGKILLed; two runs are created while it is down.
        fault_operator.kill()
        ledger.create(2)
        time.sleep(3)
        fault_operator.start()
        ledger.converge("operator SIGKILL + restart")

        # The JobSet controller (and its webhooks) is down for a while; two runs are created meanwhile
        # (their JobSets are refused until the webhook is back: the operator retries on resync).
        cluster.stop_component("jobset-controller", sig=signal.SIGKILL)
        ledger.create(2)
        time.sleep(OUTAGE_SECONDS)
        cluster.up()
        ledger.converge("jobset-controller stopped 20 s")

        # kube-apiserver is down: every watch breaks, every call fails.
        cluster.stop_component("kube-apiserver")
        time.sleep(OUTAGE_SECONDS)
        assert fault_operator.alive(), fault_operator.log_tail()
        cluster.up()
        ledger.converge("kube-apiserver stopped 20 s", kubelet=True)

    result = {
        "faults_injected": len(ledger.faults) - 1,
        "rounds": ROUNDS,
        "runs": len(ledger.runs),
        "run_checks": ledger.checks,
        "violations": ledger.violations,
        "faults": ledger.faults,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    assert not ledger.violations, "\n".join(ledger.violations) + "\n" + fault_operator.log_tail(40)
    assert fault_operator.alive()
