"""Faults (issue 8): 50+ runs in flight on a dedicated local cluster (stopping components of the
shared one would break other tests) survive, one fault at a time:

- the operator SIGKILLed at a random moment of a burst of creates, then restarted;
- the JobSet controller (and its webhooks) stopped 20 s, runs created meanwhile;
- kube-apiserver stopped 30 s; etcd restarted with its data kept;
- a TPU node deleted while its pod runs (preemption; a replacement node pool is added);
- a pod failing with an infrastructure exit code (137);
- a run's JobSet deleted by someone; a run's status edited by hand (phase Failed, Succeeded,
  Pending, or the whole status wiped).

After each fault every run converges to Running with exactly one JobSet (the same object unless it
was deleted), `status.restarts` equals what the fault caused (1 for the preempted and the
infra-failed run, 0 otherwise) and the JobSet's own count agrees, no run is lost or duplicated, the
operator is still alive (it never exits on its own), its log (JSON lines) since the fault has a
line that explains what it saw and no Python traceback. A fault that does not converge is recorded
as violations and fails the test at the end. Figures go to bench/results/faults.json.
`TPUFT_CHAOS_ROUNDS=N` repeats the fault sequence N times (`make chaos`); `TPUFT_CHAOS_SEED` fixes
the random choices (victims, the moment of the SIGKILL).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TEST_CLUSTER
from tests.support import finetune, get_json, wait_for
from tpuft_operator.cluster import kwok
from tpuft_operator.cluster.local import LocalCluster
from tpuft_operator.cluster.operator_process import OperatorProcess, install_operator
from tpuft_operator.render import naming

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "faults.json"
ROUNDS = int(os.environ.get("TPUFT_CHAOS_ROUNDS", "1"))
SEED = int(os.environ.get("TPUFT_CHAOS_SEED", str(int(time.time()))))
NAMESPACE = "faults"
RUNS_IN_FLIGHT = 50  # before the first fault; each round adds the runs below
BURST_DURING_SIGKILL = 6
CREATED_DURING_JOBSET_OUTAGE = 2
JOBSET_CONTROLLER_OUTAGE_SECONDS = 20
APISERVER_OUTAGE_SECONDS = 30
ETCD_DOWN_SECONDS = 5
SETTLE_SECONDS = 20  # how long runs must stay converged after a control plane outage
SPARE_SLICES = 2  # headroom for a recreated JobSet's pod while the old one is still terminating
INFRASTRUCTURE_EXIT_CODE = 137  # SIGKILL, not one of the trainer's user-error codes
HAND_EDITS: dict[str, dict[str, Any]] = {
    "phase Failed": {"status": {"phase": "Failed", "message": "edited by hand"}},
    "phase Succeeded": {"status": {"phase": "Succeeded", "message": "edited by hand"}},
    "phase Pending": {"status": {"phase": "Pending", "message": "edited by hand"}},
    "status wiped": {"status": None},
}
LABEL = "tpuft.dev/finetune"
TRACEBACK = "Traceback (most recent call last)"


def run_body(name: str) -> dict[str, Any]:
    return finetune(
        name,
        NAMESPACE,
        tpu={"type": "v5p", "topology": "2x2x1"},  # one host per run
        # In flight for the whole suite.
        pod_annotations=kwok.hold_running("3600s"),
        # Room for the one restart a preemption or an infrastructure exit causes.
        maxRestarts=3,
    )


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
        TPUFT_LOG_FORMAT="json",  # as deployed; each line says which object it is about
        # As the image sets it: a SIGKILLed operator would otherwise lose the lines still buffered.
        PYTHONUNBUFFERED="1",
    )
    process.start()
    yield process
    process.stop()


@dataclass(frozen=True)
class LogLine:
    message: str
    severity: str
    about: str  # the name of the object the line is about ("" for the operator itself)


class OperatorLog:
    """The operator's log file, read from an offset (both lives of a SIGKILLed operator append)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def offset(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def since(self, offset: int) -> tuple[list[LogLine], list[str]]:
        """The JSON lines written since ``offset``, and the raw lines that are not JSON."""
        with self.path.open("rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
        lines: list[LogLine] = []
        raw: list[str] = []
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                raw.append(line)
                continue
            lines.append(
                LogLine(
                    message=str(record.get("message", "")) + str(record.get("exc_info") or ""),
                    severity=str(record.get("severity", "")),
                    about=str((record.get("object") or {}).get("name", "")),
                )
            )
        return lines, raw


@dataclass(frozen=True)
class Explanation:
    """A log line that must follow a fault: ``pattern`` (a regex) in a line about ``run`` (the run
    itself or one of its pods; None: any line)."""

    pattern: str
    run: str | None = None

    def found_in(self, lines: list[LogLine]) -> bool:
        return any(
            re.search(self.pattern, line.message)
            and (self.run is None or line.about == self.run or line.about.startswith(f"{self.run}-"))
            for line in lines
        )


@dataclass
class Expected:
    """What one run should look like once a fault has played out."""

    restarts: int = 0  # status.restarts of the run
    jobset_restarts: int = 0  # status.restarts of its current JobSet (a recreated JobSet starts at 0)
    jobset_uid: str | None = None  # the JobSet object; changes only when someone deletes it


@dataclass
class Ledger:
    """What the suite injected and checked, and what every run should look like."""

    cluster: LocalCluster
    operator: OperatorProcess
    rng: random.Random
    log: OperatorLog = field(init=False)
    runs: dict[str, Expected] = field(default_factory=dict)
    victims: set[str] = field(default_factory=set)  # each fault takes runs no other fault touched
    faults: list[dict[str, Any]] = field(default_factory=list)
    checks: int = 0
    violations: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.log = OperatorLog(self.operator.log_path)

    def create(self, count: int, during: Callable[[], None] | None = None) -> list[str]:
        """Creates ``count`` runs with one `kubectl apply`; ``during`` is called while it runs."""
        names = [f"run-{len(self.runs) + i:03d}" for i in range(count)]
        for name in names:
            self.runs[name] = Expected()
        body = json.dumps({"apiVersion": "v1", "kind": "List", "items": [run_body(n) for n in names]})
        command = [
            str(self.cluster.bins.kubectl),
            f"--kubeconfig={self.cluster.kubeconfig}",
            "apply",
            "-f",
            "-",
        ]
        with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL) as apply:
            assert apply.stdin is not None
            apply.stdin.write(body.encode())
            apply.stdin.close()
            if during is not None:
                during()
            applied = apply.wait(timeout=120) == 0
        if not applied:
            # While a component is down the apiserver may refuse; the runs are created when it is back.
            wait_for(
                lambda: self.cluster.kubectl("apply", "-f", "-", input=body, check=False).returncode == 0,
                timeout=120,
                what="the runs to be created",
                interval=2,
            )
        return names

    def pick_victims(self, count: int) -> list[str]:
        victims = self.rng.sample(sorted(set(self.runs) - self.victims), count)
        self.victims.update(victims)
        return victims

    def pod_of(self, run: str) -> dict[str, Any]:
        pods = get_json(self.cluster, "pods", "-n", NAMESPACE, "-l", f"{LABEL}={run}")["items"]
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        assert len(live) == 1, f"{run}: expected one pod, found {[p['metadata']['name'] for p in pods]}"
        return dict(live[0])

    def violations_now(self) -> list[str]:
        found: list[str] = []
        finetunes = {
            f["metadata"]["name"]: f for f in get_json(self.cluster, "tpuft", "-n", NAMESPACE)["items"]
        }
        per_run: dict[str, list[dict[str, Any]]] = {}
        for js in get_json(self.cluster, "jobsets", "-n", NAMESPACE)["items"]:
            per_run.setdefault(js["metadata"]["labels"].get(LABEL, "?"), []).append(js)
        for name, expected in self.runs.items():
            ft = finetunes.get(name)
            if ft is None:
                found.append(f"{name}: lost")
                continue
            status = ft.get("status", {})
            if status.get("phase") != "Running":
                found.append(f"{name}: phase {status.get('phase')} ({status.get('message')})")
            if status.get("jobSetName") != naming.jobset_name(name):
                found.append(f"{name}: status.jobSetName {status.get('jobSetName')}")
            jobsets = per_run.get(name, [])
            if [js["metadata"]["name"] for js in jobsets] != [naming.jobset_name(name)]:
                found.append(f"{name}: JobSets {[js['metadata']['name'] for js in jobsets]}")
                continue
            jobset = jobsets[0]
            if expected.jobset_uid is not None and jobset["metadata"]["uid"] != expected.jobset_uid:
                found.append(f"{name}: its JobSet was replaced though nobody deleted it")
            if status.get("restarts", 0) != expected.restarts:
                found.append(f"{name}: restarts {status.get('restarts')}, expected {expected.restarts}")
            ready = sum(r.get("ready", 0) for r in jobset.get("status", {}).get("replicatedJobsStatus", []))
            if ready != 1:  # one slice per run: the JobSet itself must agree that it runs
                found.append(f"{name}: JobSet has {ready} ready Jobs")
            jobset_restarts = jobset.get("status", {}).get("restarts", 0)
            if jobset_restarts != expected.jobset_restarts:
                found.append(
                    f"{name}: JobSet restarts {jobset_restarts}, expected {expected.jobset_restarts}"
                )
        extra = sorted(set(per_run) - set(self.runs))
        if extra or len(finetunes) != len(self.runs):
            found.append(
                f"unexpected objects: JobSets of {extra}, {len(finetunes)} runs for {len(self.runs)}"
            )
        if not self.operator.alive():
            found.append("the operator exited")
        return found

    def record_jobset_uids(self, runs: list[str] | None = None) -> None:
        """Remembers each run's JobSet object, so a later check sees one replaced behind our back."""
        uids = {
            js["metadata"]["labels"].get(LABEL): js["metadata"]["uid"]
            for js in get_json(self.cluster, "jobsets", "-n", NAMESPACE)["items"]
        }
        for name in runs if runs is not None else list(self.runs):
            self.runs[name].jobset_uid = uids.get(name)

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

    def converge(
        self,
        fault: str,
        log_offset: int,
        *,
        explanations: tuple[Explanation, ...] = (),
        timeout: float = 180,
        kubelet: bool = False,
        settle: float = 0,
        **facts: Any,
    ) -> dict[str, Any]:
        """Waits until every run is as expected (and stays so for ``settle`` seconds: after a control
        plane outage the node lifecycle controller may mark pods not ready a while later), then
        checks the operator's log since the fault. Returns the fault's record."""
        started = time.monotonic()
        last: list[str] = []
        healed = 0
        good_since: float | None = None

        def converged() -> bool:
            nonlocal last, healed, good_since
            if kubelet:
                healed += self.play_kubelet()
            last = self.violations_now()
            if last:
                good_since = None
                return False
            good_since = good_since or time.monotonic()
            return time.monotonic() - good_since >= settle

        try:
            wait_for(converged, timeout=timeout, what=f"convergence after {fault}", interval=2)
        except AssertionError:
            self.violations += [f"after {fault}: {v}" for v in last]
        seconds = round((good_since or time.monotonic()) - started, 1)
        self.checks += len(self.runs)

        # Log lines can trail the status patch by a moment (kopf posts and logs asynchronously).
        lines: list[LogLine] = []
        raw: list[str] = []

        def explained() -> bool:
            nonlocal lines, raw
            lines, raw = self.log.since(log_offset)
            return all(e.found_in(lines) for e in explanations)

        try:
            wait_for(explained, timeout=20, what=f"the operator's log to explain {fault}", interval=1)
        except AssertionError:
            missing = [e for e in explanations if not e.found_in(lines)]
            self.violations += [f"after {fault}: no log line matches {e}" for e in missing]
        if any(TRACEBACK in line.message for line in lines) or any(TRACEBACK in line for line in raw):
            self.violations.append(f"after {fault}: a Python traceback in the operator's log")
        if raw:
            self.violations.append(f"after {fault}: {len(raw)} log lines that are not JSON, e.g. {raw[0]!r}")
        if not self.operator.alive():
            self.violations.append(f"after {fault}: the operator exited")
        record = {
            "fault": fault,
            "runs": len(self.runs),
            "seconds_to_converge": seconds,
            "operator_log": {
                "lines": len(lines),
                "warnings": sum(line.severity in ("warn", "warning") for line in lines),
                "errors": sum(line.severity == "error" for line in lines),
            },
            **({"pods_marked_ready_by_the_test": healed} if kubelet else {}),
            **facts,
        }
        self.faults.append(record)
        return record


def sigkill_the_operator_during_a_burst(
    ledger: Ledger, cluster: LocalCluster, operator: OperatorProcess
) -> None:
    offset = ledger.log.offset()
    kill_after = round(ledger.rng.uniform(0.0, 0.5), 2)

    def kill_at_a_random_moment() -> None:
        # Once the operator has created the burst's first JobSet, it is busy with the others: a
        # fixed delay from the apply mostly killed it before it had seen the burst at all.
        wait_for(
            lambda: any(line.message.startswith("created JobSet") for line in ledger.log.since(offset)[0]),
            timeout=60,
            what="the operator to create the burst's first JobSet",
            interval=0.05,
        )
        time.sleep(kill_after)
        operator.kill()

    burst = ledger.create(BURST_DURING_SIGKILL, during=kill_at_a_random_moment)
    existing = {js["metadata"]["name"] for js in get_json(cluster, "jobsets", "-n", NAMESPACE)["items"]}
    created_before_kill = sum(naming.jobset_name(run) in existing for run in burst)
    time.sleep(3)
    operator.start()
    ledger.converge(
        "operator SIGKILLed during a burst of creates, restarted",
        offset,
        explanations=(
            Explanation("^starting: watching"),  # the restarted operator
            # Every run of the burst got its JobSet, from whichever life of the operator.
            *(Explanation(f"^(created|adopted existing) JobSet {naming.jobset_name(r)}$") for r in burst),
        ),
        killed_seconds_after_the_first_create=kill_after,
        burst_jobsets_created_before_the_kill=f"{created_before_kill}/{len(burst)}",
    )
    ledger.record_jobset_uids(burst)


def stop_the_jobset_controller(ledger: Ledger, cluster: LocalCluster) -> None:
    offset = ledger.log.offset()
    cluster.stop_component("jobset-controller", sig=signal.SIGKILL)
    # Their JobSets are refused until the webhook is back: the operator says so and retries on resync.
    created = ledger.create(CREATED_DURING_JOBSET_OUTAGE)
    time.sleep(JOBSET_CONTROLLER_OUTAGE_SECONDS)
    cluster.up()
    ledger.converge(
        f"jobset-controller stopped {JOBSET_CONTROLLER_OUTAGE_SECONDS} s",
        offset,
        explanations=tuple(
            Explanation(f"creating JobSet {NAMESPACE}/{naming.jobset_name(r)}: .*retrying at the next resync")
            for r in created
        ),
    )
    ledger.record_jobset_uids(created)


def stop_the_apiserver(ledger: Ledger, cluster: LocalCluster, operator: OperatorProcess) -> None:
    """SIGTERM: kube-apiserver stops listening at once but exits only when its open watches end, up
    to --request-timeout (60 s) later; after the outage whatever is left is SIGKILLed, as a kubelet
    does after the grace period. (This used to wait 30 s for the exit, SIGKILL, then sleep 30 s
    more: a 65 s outage, longer than the node lifecycle controller's 50 s grace, so every node went
    NotReady and every pod not ready, in every round.)"""
    offset = ledger.log.offset()
    cluster.stop_component("kube-apiserver", timeout=APISERVER_OUTAGE_SECONDS)  # every call fails
    assert operator.alive(), operator.log_tail()
    cluster.up()
    ledger.converge(
        f"kube-apiserver stopped {APISERVER_OUTAGE_SECONDS} s",
        offset,
        # kopf's own retries of the broken watches, with the connection error.
        explanations=(Explanation(r"Request attempt #\d+/\d+ failed; will retry: .*Connect"),),
        kubelet=True,
        settle=SETTLE_SECONDS,
    )


def restart_etcd(ledger: Ledger, cluster: LocalCluster) -> None:
    offset = ledger.log.offset()
    cluster.stop_component("etcd")
    time.sleep(ETCD_DOWN_SECONDS)
    cluster.start_component("etcd")  # same data directory: nothing may be lost
    cluster.up()  # waits for the apiserver to be healthy again
    # No explanation is required: the watches survive (the apiserver serves them from its cache) and
    # a few seconds without etcd may pass unnoticed by the operator.
    ledger.converge(
        f"etcd stopped {ETCD_DOWN_SECONDS} s and restarted, data kept",
        offset,
        kubelet=True,
        settle=SETTLE_SECONDS,
    )


def preempt_a_node(ledger: Ledger, cluster: LocalCluster, round_index: int) -> None:
    offset = ledger.log.offset()
    (victim,) = ledger.pick_victims(1)
    pod = ledger.pod_of(victim)
    node = pod["spec"]["nodeName"]
    # As GKE would bring the node pool back: a fresh node, since a node of the deleted name would
    # make the orphaned pod look alive again.
    replacement = cluster.add_nodepool("v5p", "2x2x1", slices=1, prefix=f"faults-spare-{round_index}")
    expected = ledger.runs[victim]
    expected.restarts += 1
    expected.jobset_restarts += 1
    watch_log = ledger.operator.log_path.parent / f"watch-{pod['metadata']['name']}.json"
    with PodWatch(cluster, pod["metadata"]["name"], watch_log) as watch:
        cluster.kubectl("delete", "node", node)
        record = ledger.converge(
            "TPU node deleted under a running pod (preemption)",
            offset,
            # PodGC deletes pods of a vanished node after a 40 s quarantine; only then does the Job fail.
            timeout=240,
            explanations=(Explanation(f"JobSet {naming.jobset_name(victim)} restarted all its slices"),),
            run=victim,
            deleted_node=node,
            replacement_nodes=replacement,
        )
    record["now_on_node"] = ledger.pod_of(victim)["spec"]["nodeName"]
    record["preempted_pod_went_through"] = watch.transitions()


class PodWatch:
    """`kubectl get pod --watch` on one pod while a fault plays out: what happened to it, as facts
    for the results file (PodGC's marks come and go within milliseconds, too fast to poll)."""

    def __init__(self, cluster: LocalCluster, pod: str, output: Path) -> None:
        self.cluster = cluster
        self.pod = pod
        self.output = output
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PodWatch:
        with self.output.open("wb") as output:  # the child keeps its own copy of the descriptor
            self.process = subprocess.Popen(
                [
                    str(self.cluster.bins.kubectl), f"--kubeconfig={self.cluster.kubeconfig}", "get",
                    "pod", self.pod, "-n", NAMESPACE, "--watch", "--output-watch-events", "-o", "json",
                ],
                stdout=output,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
        return self

    def __exit__(self, *_: object) -> None:
        assert self.process is not None
        self.process.terminate()
        self.process.wait(timeout=30)

    def transitions(self) -> list[str]:
        """Distinct states in order, e.g. "MODIFIED Failed DisruptionTarget=DeletionByPodGC"."""
        text = self.output.read_text(errors="replace")
        decoder = json.JSONDecoder()
        states: list[str] = []
        position = 0
        while True:
            while position < len(text) and text[position].isspace():
                position += 1
            if position >= len(text):
                break
            try:
                event, position = decoder.raw_decode(text, position)
            except ValueError:
                break
            pod = event.get("object", {})
            disruption = [
                f"DisruptionTarget={c.get('reason')}"
                for c in pod.get("status", {}).get("conditions", [])
                if c.get("type") == "DisruptionTarget" and c.get("status") == "True"
            ]
            deleting = ["deleting"] if pod.get("metadata", {}).get("deletionTimestamp") else []
            state = " ".join(
                [event.get("type", "?"), pod.get("status", {}).get("phase", "?"), *disruption, *deleting]
            )
            if not states or states[-1] != state:
                states.append(state)
        return states


def fail_a_pod_with_an_infrastructure_exit(ledger: Ledger, cluster: LocalCluster) -> None:
    offset = ledger.log.offset()
    (victim,) = ledger.pick_victims(1)
    pod = ledger.pod_of(victim)["metadata"]["name"]
    # Annotating the live pod makes kwok terminate it with that code now; the pods of the restarted
    # JobSet come from the template, without the annotation, and keep running.
    annotations = kwok.simulated_exit(INFRASTRUCTURE_EXIT_CODE, after="1s")
    cluster.kubectl("annotate", "pod", pod, "-n", NAMESPACE, *[f"{k}={v}" for k, v in annotations.items()])
    expected = ledger.runs[victim]
    expected.restarts += 1
    expected.jobset_restarts += 1
    ledger.converge(
        f"pod exited with infrastructure code {INFRASTRUCTURE_EXIT_CODE}",
        offset,
        explanations=(Explanation(f"JobSet {naming.jobset_name(victim)} restarted all its slices"),),
        run=victim,
    )


def delete_a_jobset(ledger: Ledger, cluster: LocalCluster) -> None:
    offset = ledger.log.offset()
    (victim,) = ledger.pick_victims(1)
    jobset = naming.jobset_name(victim)
    cluster.kubectl("delete", "jobset", jobset, "-n", NAMESPACE)
    expected = ledger.runs[victim]
    old_uid, expected.jobset_uid = expected.jobset_uid, None  # a new object is expected
    expected.jobset_restarts = 0  # the run keeps its count; the new JobSet starts from zero
    ledger.converge(
        "a run's JobSet deleted by someone",
        offset,
        explanations=(Explanation(f"JobSet {jobset} was deleted while the run was active; recreated it"),),
        run=victim,
    )
    ledger.record_jobset_uids([victim])
    if ledger.runs[victim].jobset_uid == old_uid:
        ledger.violations.append(f"{victim}: its JobSet was not deleted and recreated")
    events = get_json(
        cluster,
        "events",
        "-n",
        NAMESPACE,
        f"--field-selector=involvedObject.name={victim},reason=JobSetRecreated",
    )["items"]
    if len(events) != 1:
        ledger.violations.append(f"{victim}: {len(events)} JobSetRecreated events, expected 1")


def edit_statuses_by_hand(ledger: Ledger, cluster: LocalCluster) -> None:
    offset = ledger.log.offset()
    victims = dict(zip(ledger.pick_victims(len(HAND_EDITS)), HAND_EDITS.items(), strict=True))
    for run, (_, patch) in victims.items():
        cluster.kubectl(
            "patch", "tpuft", run, "-n", NAMESPACE, "--subresource=status", "--type=merge",
            "-p", json.dumps(patch),
        )  # fmt: skip
    ledger.converge(
        "run statuses edited by hand",
        offset,
        # The operator derives the status again from what it observes and says so.
        explanations=tuple(Explanation(r"^phase .* -> Running", run) for run in victims),
        injected=len(victims),
        edits={run: what for run, (what, _) in victims.items()},
    )


def test_runs_survive_faults(cluster: LocalCluster, fault_operator: OperatorProcess) -> None:
    started = time.monotonic()
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    per_round = BURST_DURING_SIGKILL + CREATED_DURING_JOBSET_OUTAGE
    cluster.add_nodepool(
        "v5p", "2x2x1", slices=RUNS_IN_FLIGHT + per_round * ROUNDS + SPARE_SLICES, prefix="faults"
    )
    ledger = Ledger(cluster, fault_operator, random.Random(SEED))
    offset = ledger.log.offset()
    ledger.create(RUNS_IN_FLIGHT)
    ledger.converge("start", offset, timeout=300)
    ledger.record_jobset_uids()

    for round_index in range(ROUNDS):
        sigkill_the_operator_during_a_burst(ledger, cluster, fault_operator)
        stop_the_jobset_controller(ledger, cluster)
        stop_the_apiserver(ledger, cluster, fault_operator)
        restart_etcd(ledger, cluster)
        preempt_a_node(ledger, cluster, round_index)
        fail_a_pod_with_an_infrastructure_exit(ledger, cluster)
        delete_a_jobset(ledger, cluster)
        edit_statuses_by_hand(ledger, cluster)

    result = {
        "faults_injected": sum(f.get("injected", 1) for f in ledger.faults[1:]),
        "rounds": ROUNDS,
        "seed": SEED,
        "runs": len(ledger.runs),
        "run_checks": ledger.checks,
        "violations": ledger.violations,
        "seconds": round(time.monotonic() - started),
        "faults": ledger.faults,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    assert not ledger.violations, "\n".join(ledger.violations) + "\n" + fault_operator.log_tail(40)
    assert fault_operator.alive()
