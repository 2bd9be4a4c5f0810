"""Faults (issues 8 and 17): 50+ runs in flight on a dedicated local cluster (stopping components of
the shared one would break other tests) survive rounds of faults, one kind at a time, each kind
injected in a batch that hits many runs at once:

- the operator SIGKILLed at a random moment of a burst of creates, then restarted;
- the JobSet controller (and its webhooks) stopped 10 s, runs created meanwhile;
- kube-apiserver stopped 15 s; etcd restarted with its data kept;
- TPU nodes deleted while their pods run (preemption; replacement node pools are added);
- pods failing with an infrastructure exit code (137), and the operator SIGKILLed meanwhile;
- SIGTERM stops: pods exiting 75 (every host saved the step it reached), a restart that does not
  count against maxRestarts, so runs with maxRestarts 0 survive them;
- GKE maintenance labels on nodes of running runs, later removed;
- runs' JobSets deleted by someone; runs' statuses edited by hand (phase Failed, Succeeded,
  Pending, or the whole status wiped).

After each batch every run converges to Running with exactly one JobSet (the same object unless it
was deleted), `status.restarts` equals what the faults caused and the JobSet's own counts agree
(`restarts`, and `restartsCountTowardsMax`: only the counted faults), a run on a node announcing
maintenance has condition MaintenanceScheduled=True naming node and time, one Warning Event and the
checkpoint request on its pod, and False once the label is gone; no run is lost or duplicated, the
operator is still alive (it never exits on its own), its log (JSON lines) since the fault has a line
that explains what it saw for each run hit and no Python traceback. A fault that does not converge
is recorded as violations and fails the test at the end.

Knobs: `TPUFT_CHAOS_ROUNDS=N` repeats the sequence N times; `TPUFT_CHAOS_BATCH=B` sets the batch
sizes (B pods exiting 137, B exiting 75, B nodes labelled, B/2 nodes deleted, ...; 1, as in
`make test`, hits one run per kind); `make chaos` runs 5 rounds of batch 25 (500+ faults).
`TPUFT_CHAOS_SEED` fixes the random choices (victims, the moments of the SIGKILLs). The suite has a
time budget of its own, from rounds and batch (pytest's per-test timeout does not fit a suite of
any length), prints a line per round (faults, elapsed time, violations so far) and fails with a
clear message when the budget runs out. The record of a run of several rounds goes to
bench/results/faults.json (of one round, to the test's temporary directory; `TPUFT_CHAOS_RESULTS`
names another file).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TEST_CLUSTER, session_cluster
from tests.support import NOT_PREPARE, finetune, get_json, wait_for
from tpuft_dev.cluster import kwok
from tpuft_dev.cluster.local import LocalCluster
from tpuft_dev.cluster.operator_process import OperatorProcess, install_operator
from tpuft_operator.maintenance import SCHEDULED_LABEL
from tpuft_operator.preparing import split_pods
from tpuft_operator.render import naming
from tpuft_trainer.exit_codes import ExitCode
from tpuft_trainer.pod_contract import CHECKPOINT_REQUEST_ANNOTATION

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "faults.json"
ROUNDS = int(os.environ.get("TPUFT_CHAOS_ROUNDS", "1"))
BATCH = int(os.environ.get("TPUFT_CHAOS_BATCH", "1"))
SEED = int(os.environ.get("TPUFT_CHAOS_SEED", str(int(time.time()))))
NAMESPACE = "faults"

# Batch sizes. Victims are drawn afresh for every batch; a run may be hit again later (its
# expectations follow), but only while its JobSet has a counted restart left.
RUNS_IN_FLIGHT = max(50, 4 * BATCH)  # before the first fault; each round adds the runs below
TIGHT_RUNS = max(2, BATCH)  # of those, with maxRestarts 0: any counted restart would fail them
BURST_DURING_SIGKILL = 6
CREATED_DURING_JOBSET_OUTAGE = 2
NODES_DELETED = max(1, BATCH // 2)
INFRASTRUCTURE_EXITS = BATCH
CHECKPOINTED_STOPS = BATCH
MAINTENANCE_NODES = BATCH
JOBSETS_DELETED = max(1, BATCH // 5)
HAND_EDIT_SETS = max(1, BATCH // 8)  # each set edits four runs, one per kind of edit
MAX_RESTARTS = 3  # of the other runs

# Two of the operator's resyncs (5 s): the runs created meanwhile are refused at least once.
JOBSET_CONTROLLER_OUTAGE_SECONDS = 10
# Long enough for kopf's requests and watches to fail and retry several times.
APISERVER_OUTAGE_SECONDS = 15
ETCD_DOWN_SECONDS = 5
SETTLE_SECONDS = 20  # how long runs must stay converged after etcd's restart
# kube-controller-manager's defaults (--node-monitor-grace-period, --node-monitor-period): it marks
# a node NotReady, and its pods not ready, once it has seen no lease renewal for the grace period.
NODE_MONITOR_GRACE_SECONDS = 50
NODE_MONITOR_PERIOD_SECONDS = 5
SPARE_SLICES = 2  # headroom for a recreated JobSet's pod while the old one is still terminating
INFRASTRUCTURE_EXIT_CODE = 137  # SIGKILL, not one of the trainer's user-error codes
CHECKPOINTED_STOP_EXIT_CODE = int(ExitCode.STOPPED_AFTER_CHECKPOINT)  # 75
HAND_EDITS: dict[str, dict[str, Any]] = {
    "phase Failed": {"status": {"phase": "Failed", "message": "edited by hand"}},
    "phase Succeeded": {"status": {"phase": "Succeeded", "message": "edited by hand"}},
    "phase Pending": {"status": {"phase": "Pending", "message": "edited by hand"}},
    "status wiped": {"status": None},
}
LABEL = "tpuft.dev/finetune"
TRACEBACK = "Traceback (most recent call last)"

# The suite's own time budget: generous for a loaded 2-core machine (one round of batch 1 takes
# about 4 minutes there), yet a hang shows as a clear failure rather than pytest's timeout.
START_BUDGET_SECONDS = 300
ROUND_BUDGET_SECONDS = 420 + 12 * BATCH
BUDGET_SECONDS = START_BUDGET_SECONDS + ROUNDS * ROUND_BUDGET_SECONDS


def faults_per_round() -> int:
    return (
        4  # the SIGKILL during a burst, the JobSet controller, kube-apiserver, etcd
        + NODES_DELETED
        + INFRASTRUCTURE_EXITS
        + 1  # the SIGKILL while those pods fail
        + CHECKPOINTED_STOPS
        + MAINTENANCE_NODES
        + JOBSETS_DELETED
        + HAND_EDIT_SETS * len(HAND_EDITS)
    )


def run_body(name: str, max_restarts: int) -> dict[str, Any]:
    return finetune(
        name,
        NAMESPACE,
        tpu={"type": "v5p", "topology": "2x2x1"},  # one host per run
        # In flight for the whole suite.
        pod_annotations=kwok.hold_running("3h"),
        maxRestarts=max_restarts,
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    # Always a new one: its runs are run-000, run-001, ... in namespace faults, so in a cluster kept from
    # an earlier session (TPUFT_KEEP_CLUSTER=1) they would already exist, JobSets and restarts included
    # (the second session on a kept cluster waited in vain for the operator to create a JobSet).
    name = f"{TEST_CLUSTER}-faults"
    yield from session_cluster(name, log=lambda line: print(f"[faults] {line}"), fresh=True)


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
        TPUFT_WATCH_NODES="true",  # the default, said out loud: the maintenance faults need it
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

    max_restarts: int = MAX_RESTARTS
    restarts: int = 0  # status.restarts of the run
    jobset_restarts: int = 0  # status.restarts of its current JobSet (a recreated JobSet starts at 0)
    jobset_counted: int = 0  # its restartsCountTowardsMax: a restart after a checkpointed stop is free
    jobset_uid: str | None = None  # the JobSet object; changes only when someone deletes it
    maintenance: tuple[str, int] | None = None  # (node, time) announced on the node of its pod
    maintenance_over: bool = False  # condition MaintenanceScheduled is False (it was True)
    checkpointed_stops: int = 0  # survived so far (with maxRestarts 0 each one proves it was free)

    @property
    def counted_restart_left(self) -> bool:
        return self.jobset_counted < self.max_restarts


def utc(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition_of(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for cond in obj.get("status", {}).get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return {}


@dataclass
class Ledger:
    """What the suite injected and checked, and what every run should look like."""

    cluster: LocalCluster
    operator: OperatorProcess
    rng: random.Random
    say: Callable[[str], None] = print
    log: OperatorLog = field(init=False)
    runs: dict[str, Expected] = field(default_factory=dict)
    faults: list[dict[str, Any]] = field(default_factory=list)
    checks: int = 0
    violations: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    # Until when (time.monotonic()) the node lifecycle controller may still mark nodes, and their
    # pods, not ready after the apiserver's outage; the etcd step, next, holds its runs until then.
    not_ready_possible_until: float = 0

    def __post_init__(self) -> None:
        self.log = OperatorLog(self.operator.log_path)

    # ----------------------------------------------------------------- bookkeeping
    def injected(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for record in self.faults:
            total.update(record.get("injected") or {})
        return total

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def out_of_time(self, where: str) -> bool:
        """Whether the suite's budget is spent; says so (and records it as a violation) once."""
        if self.elapsed() <= BUDGET_SECONDS:
            return False
        message = (
            f"the fault suite ran out of its time budget ({BUDGET_SECONDS} s for {ROUNDS} round(s) of "
            f"batch {BATCH}) at {where}, after {self.elapsed():.0f} s and {sum(self.injected().values())} "
            "faults; see the seconds per fault in the results"
        )
        if message not in self.violations:
            self.violations.append(message)
            self.say(f"[faults] {message}")
        return True

    # ----------------------------------------------------------------- runs
    def create(self, count: int, during: Callable[[], None] | None = None, *, tight: int = 0) -> list[str]:
        """Creates ``count`` runs with one `kubectl apply` (the first ``tight`` with maxRestarts 0);
        ``during`` is called while it runs."""
        names = [f"run-{len(self.runs) + i:03d}" for i in range(count)]
        for index, name in enumerate(names):
            self.runs[name] = Expected(max_restarts=0 if index < tight else MAX_RESTARTS)
        items = [run_body(n, self.runs[n].max_restarts) for n in names]
        body = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
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

    def pick(self, count: int, *, counted: bool = False, tight_first: bool = False) -> list[str]:
        """``count`` distinct victims at random. ``counted``: the fault costs a counted restart, so
        only runs whose JobSet has one left, the least used first (so the budget lasts every round).
        ``tight_first``: runs with maxRestarts 0 first (where a counted restart would show)."""
        candidates = sorted(self.runs)
        if counted:
            candidates = [r for r in candidates if self.runs[r].counted_restart_left]
        self.rng.shuffle(candidates)
        if counted:
            candidates.sort(key=lambda r: self.runs[r].jobset_counted)
        if tight_first:
            candidates.sort(key=lambda r: self.runs[r].max_restarts)
        assert len(candidates) >= count, f"only {len(candidates)} runs can take this fault, {count} asked"
        return candidates[:count]

    def pods_by_run(self) -> dict[str, dict[str, Any]]:
        """The live pod of every run (one host each)."""
        pods: dict[str, list[dict[str, Any]]] = {}
        for pod in get_json(self.cluster, "pods", "-n", NAMESPACE, "-l", NOT_PREPARE)["items"]:
            if not pod["metadata"].get("deletionTimestamp"):
                pods.setdefault(pod["metadata"]["labels"].get(LABEL, "?"), []).append(pod)
        for run, live in pods.items():
            assert len(live) == 1, f"{run}: expected one pod, found {[p['metadata']['name'] for p in live]}"
        return {run: live[0] for run, live in pods.items()}

    def events_by_run(self, reason: str) -> Counter[str]:
        """How many Events of ``reason`` each run has (Warnings only: all of ours that matter are)."""
        selector = f"--field-selector=reason={reason}"
        items = get_json(self.cluster, "events", "-n", NAMESPACE, selector)["items"]
        return Counter(
            e["involvedObject"]["name"]
            for e in items
            if e["involvedObject"].get("kind") == "TPUFineTune" and e.get("type") == "Warning"
        )

    def check_events(self, fault: str, reason: str, before: Counter[str], runs: list[str]) -> None:
        """Exactly one new ``reason`` Event for each of ``runs``, none for any other run."""

        def settled() -> Counter[str]:
            now = self.events_by_run(reason)
            now.subtract(before)
            return now

        delta: Counter[str] = Counter()
        before_checks = len(self.violations)

        def all_posted() -> bool:
            nonlocal delta
            delta = settled()
            return all(delta[r] >= 1 for r in runs)

        # kopf posts Events asynchronously, a moment after the status patch.
        with contextlib.suppress(AssertionError):
            wait_for(all_posted, timeout=20, what=f"{reason} Events", interval=1)
        for run in runs:
            if delta[run] != 1:
                self.violations.append(f"after {fault}: {run}: {delta[run]} new {reason} Events, expected 1")
        others = {r: n for r, n in delta.items() if r not in runs and n}
        if others:
            self.violations.append(f"after {fault}: {reason} Events for runs not hit: {others}")
        self.faults[-1]["violations"] += len(self.violations) - before_checks

    # ----------------------------------------------------------------- the checks
    def violations_now(self) -> list[str]:
        found: list[str] = []
        objects = get_json(self.cluster, "tpuft,jobsets,pods", "-n", NAMESPACE)["items"]
        finetunes = {o["metadata"]["name"]: o for o in objects if o["kind"] == "TPUFineTune"}
        per_run: dict[str, list[dict[str, Any]]] = {}
        pods: dict[str, list[dict[str, Any]]] = {}
        for obj in objects:
            run = obj["metadata"].get("labels", {}).get(LABEL, "?")
            if obj["kind"] == "JobSet":
                per_run.setdefault(run, []).append(obj)
            elif obj["kind"] == "Pod" and not obj["metadata"].get("deletionTimestamp"):
                pods.setdefault(run, []).append(obj)
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
            found += self._maintenance_violations(name, ft, expected, pods.get(name, []))
            jobsets = per_run.get(name, [])
            if [js["metadata"]["name"] for js in jobsets] != [naming.jobset_name(name)]:
                found.append(f"{name}: JobSets {[js['metadata']['name'] for js in jobsets]}")
                continue
            jobset = jobsets[0]
            if expected.jobset_uid is not None and jobset["metadata"]["uid"] != expected.jobset_uid:
                found.append(f"{name}: its JobSet was replaced though nobody deleted it")
            if status.get("restarts", 0) != expected.restarts:
                found.append(f"{name}: restarts {status.get('restarts')}, expected {expected.restarts}")
            jobset_status = jobset.get("status", {})
            ready = sum(r.get("ready", 0) for r in jobset_status.get("replicatedJobsStatus", []))
            if ready != 1:  # one slice per run: the JobSet itself must agree that it runs
                found.append(f"{name}: JobSet has {ready} ready Jobs")
            if jobset_status.get("restarts", 0) != expected.jobset_restarts:
                found.append(
                    f"{name}: JobSet restarts {jobset_status.get('restarts', 0)}, expected {expected.jobset_restarts}"
                )
            counted = jobset_status.get("restartsCountTowardsMax", 0)
            if counted != expected.jobset_counted:
                found.append(
                    f"{name}: JobSet restartsCountTowardsMax {counted}, expected {expected.jobset_counted}"
                )
        extra = sorted(set(per_run) - set(self.runs))
        if extra or len(finetunes) != len(self.runs):
            found.append(
                f"unexpected objects: JobSets of {extra}, {len(finetunes)} runs for {len(self.runs)}"
            )
        if not self.operator.alive():
            found.append("the operator exited")
        return found

    @staticmethod
    def _maintenance_violations(
        name: str, ft: dict[str, Any], expected: Expected, pods: list[dict[str, Any]]
    ) -> list[str]:
        cond = condition_of(ft, "MaintenanceScheduled")
        if expected.maintenance is None:
            over = (cond.get("status"), cond.get("reason")) == ("False", "NoMaintenance")
            if expected.maintenance_over and not over:
                return [f"{name}: maintenance is over but MaintenanceScheduled is {cond or 'absent'}"]
            if not expected.maintenance_over and cond.get("status") == "True":
                return [f"{name}: MaintenanceScheduled=True though none of its nodes announced any"]
            return []
        node, when = expected.maintenance
        found = []
        wanted = f"node {node}: maintenance scheduled for {utc(when)}"
        if cond.get("status") != "True" or cond.get("reason") != "MaintenanceScheduled":
            found.append(f"{name}: MaintenanceScheduled is {cond or 'absent'} while {node} announces {when}")
        elif wanted not in str(cond.get("message")):
            found.append(f"{name}: MaintenanceScheduled says {cond.get('message')!r}, not {wanted!r}")
        for pod in split_pods(pods)[0]:  # the TPU pods: the prepare pod is asked nothing
            request = (pod["metadata"].get("annotations") or {}).get(CHECKPOINT_REQUEST_ANNOTATION)
            if request != str(when):
                found.append(f"{name}: pod {pod['metadata']['name']} has checkpoint request {request!r}")
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
        """kwok stands in for the kubelets. When the node lifecycle controller has marked pods
        Ready=False (nodes whose leases it saw no renewal of for its grace period), kwok never reports
        a running pod ready again (a real kubelet would). Do what the kubelet would; returns the pods
        healed. Until then the operator rightly reports those runs Pending."""
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
        injected: dict[str, int],
        explanations: tuple[Explanation, ...] = (),
        timeout: float = 180,
        kubelet: bool = False,
        settle: float = 0,
        hold_until: float = 0,
        **facts: Any,
    ) -> dict[str, Any]:
        """Waits until every run is as expected, and stays so for ``settle`` seconds and until
        ``hold_until`` (time.monotonic()), then checks the operator's log since the fault. Returns
        the fault's record; ``injected`` counts the faults by kind."""
        started = time.monotonic()
        violations_before = len(self.violations)
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
            return time.monotonic() - good_since >= settle and time.monotonic() >= hold_until

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
            "injected": injected,
            "runs": len(self.runs),
            "seconds_to_converge": seconds,
            "seconds": round(time.monotonic() - started, 1),  # with the settling and the log checks
            "operator_log": {
                "lines": len(lines),
                "warnings": sum(line.severity in ("warn", "warning") for line in lines),
                "errors": sum(line.severity == "error" for line in lines),
            },
            **({"pods_marked_ready_by_the_test": healed} if kubelet else {}),
            **facts,
        }
        self.faults.append(record)
        record["violations"] = len(self.violations) - violations_before
        return record


def restarted(run: str, *, counted: bool) -> Explanation:
    """The operator's line for a restart: counted against maxRestarts, or free after a checkpoint."""
    why = ": a TPU host failed.*counted against maxRestarts" if counted else " after a checkpointed stop"
    return Explanation(
        rf"^JobSet {naming.jobset_name(run)} restarted all its slices \(restart \d+\){why}", run
    )


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
    record = ledger.converge(
        "operator SIGKILLed during a burst of creates, restarted",
        offset,
        injected={"operator SIGKILL": 1},
        explanations=(
            Explanation("^starting: watching"),  # the restarted operator
            # Every run of the burst got its JobSet, from whichever life of the operator.
            *(Explanation(f"^(created|adopted existing) JobSet {naming.jobset_name(r)}$") for r in burst),
        ),
        killed_seconds_after_the_first_create=kill_after,
        burst_jobsets_created_before_the_kill=f"{created_before_kill}/{len(burst)}",
    )
    ledger.record_jobset_uids(burst)
    record["runs_created"] = len(burst)


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
        injected={"JobSet controller outage": 1},
        explanations=tuple(
            Explanation(f"creating JobSet {NAMESPACE}/{naming.jobset_name(r)}: .*retrying at the next resync")
            for r in created
        ),
        runs_created=len(created),
    )
    ledger.record_jobset_uids(created)


def stop_the_apiserver(ledger: Ledger, cluster: LocalCluster, operator: OperatorProcess) -> None:
    """SIGTERM: kube-apiserver stops listening at once but exits only when its open watches end, up
    to --request-timeout (60 s) later; after the outage whatever is left is SIGKILLed, as a kubelet
    does after the grace period, and it is started again. (The suite used to wait 30 s for the exit,
    then SIGKILL, then sleep 30 s more: a 65 s outage, longer than the node lifecycle controller's
    50 s grace, so every node went NotReady and every pod not ready, in each round.)"""
    offset = ledger.log.offset()
    began = time.monotonic()
    cluster.stop_component("kube-apiserver", timeout=APISERVER_OUTAGE_SECONDS)  # every call fails
    assert operator.alive(), operator.log_tail()
    cluster.up()
    down = time.monotonic() - began
    ledger.converge(
        f"kube-apiserver stopped {APISERVER_OUTAGE_SECONDS} s",
        offset,
        injected={"kube-apiserver restart": 1},
        # kopf's own retries of the broken watches, with the connection error.
        explanations=(Explanation(r"Request attempt #\d+/\d+ failed; will retry: .*Connect"),),
        kubelet=True,
        settle=NODE_MONITOR_PERIOD_SECONDS,
        seconds_without_apiserver=round(down, 1),
    )
    # The controller manager lost its watches too; until a node's lease renewal after the outage
    # reaches it, it may still mark the node (and its pods) not ready: at the latest one grace period
    # after the last renewal it saw, which was before the outage began. The etcd step that follows
    # plays the kubelet too and holds until then (this step holding alone made each round ~30 s longer).
    ledger.not_ready_possible_until = began + NODE_MONITOR_GRACE_SECONDS + NODE_MONITOR_PERIOD_SECONDS


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
        injected={"etcd restart": 1},
        kubelet=True,
        settle=SETTLE_SECONDS,
        hold_until=ledger.not_ready_possible_until,
    )


def preempt_nodes(ledger: Ledger, cluster: LocalCluster, round_index: int) -> None:
    offset = ledger.log.offset()
    victims = ledger.pick(NODES_DELETED, counted=True)
    pods = ledger.pods_by_run()
    nodes = [pods[v]["spec"]["nodeName"] for v in victims]
    # As GKE would bring the node pools back: fresh nodes, since a node of a deleted name would make
    # the orphaned pod look alive again.
    replacements = cluster.add_nodepool(
        "v5p", "2x2x1", slices=len(victims), prefix=f"faults-spare-{round_index}"
    )
    for victim in victims:
        expected = ledger.runs[victim]
        expected.restarts += 1
        expected.jobset_restarts += 1
        expected.jobset_counted += 1
    watched = pods[victims[0]]["metadata"]["name"]
    watch_log = ledger.operator.log_path.parent / f"watch-{watched}.json"
    with PodWatch(cluster, watched, watch_log) as watch:
        cluster.kubectl("delete", "node", *nodes)
        record = ledger.converge(
            f"{len(nodes)} TPU node(s) deleted under running pods (preemption)",
            offset,
            injected={"node deletion": len(nodes)},
            # PodGC deletes pods of a vanished node after a 40 s quarantine; only then does the Job fail.
            timeout=300,
            explanations=tuple(restarted(v, counted=True) for v in victims),
            deleted_nodes=dict(zip(victims, nodes, strict=True)),
            replacement_nodes=len(replacements),
        )
    record["first_victim_now_on_node"] = ledger.pods_by_run()[victims[0]]["spec"]["nodeName"]
    record["first_victim_pod_went_through"] = watch.transitions()


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


def exit_pods(ledger: Ledger, victims: list[str], code: int) -> None:
    """Annotating a live pod makes kwok terminate it with that code a second later; the pods of the
    restarted JobSet come from the template, without the annotation, and keep running."""
    pods = ledger.pods_by_run()
    annotations = kwok.simulated_exit(code, after="1s")
    ledger.cluster.kubectl(
        "annotate", "pod", "-n", NAMESPACE, *[pods[v]["metadata"]["name"] for v in victims],
        *[f"{k}={v}" for k, v in annotations.items()],
    )  # fmt: skip


def fail_pods_with_an_infrastructure_exit(
    ledger: Ledger, cluster: LocalCluster, operator: OperatorProcess
) -> None:
    """Pods exit 137, and the operator is SIGKILLed before they do: its next life finds the runs
    restarting (or restarted) and must count each restart once."""
    offset = ledger.log.offset()
    victims = ledger.pick(INFRASTRUCTURE_EXITS, counted=True)
    exit_pods(ledger, victims, INFRASTRUCTURE_EXIT_CODE)
    kill_after = round(ledger.rng.uniform(0.0, 0.5), 2)  # kwok's exit comes 1 s after the annotation
    time.sleep(kill_after)
    operator.kill()
    time.sleep(2)
    operator.start()
    for victim in victims:
        expected = ledger.runs[victim]
        expected.restarts += 1
        expected.jobset_restarts += 1
        expected.jobset_counted += 1
    ledger.converge(
        f"{len(victims)} pod(s) exited with infrastructure code {INFRASTRUCTURE_EXIT_CODE}, "
        "the operator SIGKILLed meanwhile",
        offset,
        injected={"infrastructure exit": len(victims), "operator SIGKILL": 1},
        explanations=(Explanation("^starting: watching"), *(restarted(v, counted=True) for v in victims)),
        victims=victims,
        killed_seconds_after_the_exits_were_asked=kill_after,
    )


def stop_pods_after_a_checkpoint(ledger: Ledger) -> None:
    """Pods exit 75, as the trainer does after SIGTERM once every host saved the step it reached:
    the JobSet restarts without counting it against maxRestarts. Runs with maxRestarts 0 go first,
    so a stop that were counted would fail them."""
    offset = ledger.log.offset()
    victims = ledger.pick(CHECKPOINTED_STOPS, tight_first=True)
    exit_pods(ledger, victims, CHECKPOINTED_STOP_EXIT_CODE)
    for victim in victims:
        expected = ledger.runs[victim]
        expected.restarts += 1
        expected.jobset_restarts += 1  # but not jobset_counted
        expected.checkpointed_stops += 1
    tight = [v for v in victims if ledger.runs[v].max_restarts == 0]
    ledger.converge(
        f"{len(victims)} pod(s) stopped after a checkpoint (exit {CHECKPOINTED_STOP_EXIT_CODE})",
        offset,
        injected={"SIGTERM stop": len(victims)},
        explanations=tuple(restarted(v, counted=False) for v in victims),
        victims=victims,
        victims_with_max_restarts_0=len(tight),
        most_stops_survived_with_max_restarts_0=max(
            (e.checkpointed_stops for e in ledger.runs.values() if e.max_restarts == 0), default=0
        ),
    )


def announce_maintenance(ledger: Ledger, cluster: LocalCluster) -> None:
    """GKE's scheduled-maintenance label on the nodes of running runs: each run shows the condition,
    gets one Warning Event and the checkpoint request on its pod, and keeps running; once the label
    is gone the condition is False."""
    offset = ledger.log.offset()
    victims = ledger.pick(MAINTENANCE_NODES)
    pods = ledger.pods_by_run()
    nodes = {v: pods[v]["spec"]["nodeName"] for v in victims}
    when = int(time.time()) + 3600  # a new time each round: a new request
    events = ledger.events_by_run("MaintenanceScheduled")
    cluster.kubectl("label", "node", *nodes.values(), f"{SCHEDULED_LABEL}={when}", "--overwrite")
    for victim, node in nodes.items():
        ledger.runs[victim].maintenance = (node, when)
    fault = f"maintenance announced on {len(nodes)} node(s)"
    ledger.converge(
        fault,
        offset,
        injected={"maintenance label": len(nodes)},
        explanations=tuple(
            e
            for v, node in nodes.items()
            for e in (
                Explanation(f"^MaintenanceScheduled: node {node}: maintenance scheduled for {utc(when)}", v),
                Explanation(rf"^asked pod \S+ to checkpoint now \(request {when}\)", v),
            )
        ),
        victims=victims,
        announced_for=utc(when),
    )
    ledger.check_events(fault, "MaintenanceScheduled", events, victims)

    offset = ledger.log.offset()
    cluster.kubectl("label", "node", *nodes.values(), f"{SCHEDULED_LABEL}-")
    for victim in victims:
        ledger.runs[victim].maintenance = None
        ledger.runs[victim].maintenance_over = True
    ledger.converge(f"maintenance label removed from {len(nodes)} node(s)", offset, injected={})


def delete_jobsets(ledger: Ledger, cluster: LocalCluster) -> None:
    offset = ledger.log.offset()
    victims = ledger.pick(JOBSETS_DELETED)
    old_uids = {v: ledger.runs[v].jobset_uid for v in victims}
    events = ledger.events_by_run("JobSetRecreated")
    cluster.kubectl("delete", "jobset", "-n", NAMESPACE, *[naming.jobset_name(v) for v in victims])
    for victim in victims:
        expected = ledger.runs[victim]
        expected.jobset_uid = None  # a new object is expected
        # The run keeps its count; the new JobSet starts from zero, with all of maxRestarts again.
        expected.jobset_restarts = 0
        expected.jobset_counted = 0
    fault = f"{len(victims)} run(s)' JobSet deleted by someone"
    ledger.converge(
        fault,
        offset,
        injected={"JobSet deletion": len(victims)},
        explanations=tuple(
            Explanation(
                f"JobSet {naming.jobset_name(v)} was deleted while the run was active; recreated it", v
            )
            for v in victims
        ),
        victims=victims,
    )
    ledger.record_jobset_uids(victims)
    for victim in victims:
        if ledger.runs[victim].jobset_uid == old_uids[victim]:
            ledger.violations.append(f"{victim}: its JobSet was not deleted and recreated")
    ledger.check_events(fault, "JobSetRecreated", events, victims)


def edit_statuses_by_hand(ledger: Ledger, cluster: LocalCluster) -> None:
    offset = ledger.log.offset()
    kinds = list(HAND_EDITS) * HAND_EDIT_SETS
    victims = dict(zip(ledger.pick(len(kinds)), kinds, strict=True))
    for run, what in victims.items():
        cluster.kubectl(
            "patch", "tpuft", run, "-n", NAMESPACE, "--subresource=status", "--type=merge",
            "-p", json.dumps(HAND_EDITS[what]),
        )  # fmt: skip
        if what == "status wiped":
            # Derived again from what exists: restarts from the JobSet (with those of the JobSets
            # before it, which a recreated one carries), no memory of a maintenance that is over.
            ledger.runs[run].maintenance_over = False
    ledger.converge(
        f"{len(victims)} run status(es) edited by hand",
        offset,
        injected={"status edited by hand": len(victims)},
        # The operator derives the status again from what it observes and says so.
        explanations=tuple(Explanation(r"^phase .* -> Running", run) for run in victims),
        edits=victims,
    )


def summary_by_kind(faults: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Faults, steps, seconds to converge (median, max) and violations, per kind of fault."""
    kinds: dict[str, dict[str, Any]] = {}
    for record in faults:
        for kind, count in (record.get("injected") or {}).items():
            entry = kinds.setdefault(kind, {"faults": 0, "steps": 0, "violations": 0, "_seconds": []})
            entry["faults"] += count
            entry["steps"] += 1
            entry["violations"] += record.get("violations", 0)
            entry["_seconds"].append(record["seconds_to_converge"])
    for entry in kinds.values():
        seconds = entry.pop("_seconds")
        entry["seconds_to_converge_median"] = round(statistics.median(seconds), 1)
        entry["seconds_to_converge_max"] = max(seconds)
    return kinds


@pytest.mark.timeout(BUDGET_SECONDS + 600)  # a backstop only: the suite checks its own budget
def test_runs_survive_faults(
    cluster: LocalCluster,
    fault_operator: OperatorProcess,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    def say(line: str) -> None:
        with capsys.disabled():  # progress for whoever watches `make chaos`
            print(line, flush=True)

    ledger = Ledger(cluster, fault_operator, random.Random(SEED), say=say)
    per_round = BURST_DURING_SIGKILL + CREATED_DURING_JOBSET_OUTAGE
    say(
        f"\n[faults] {ROUNDS} round(s) of batch {BATCH}: {RUNS_IN_FLIGHT} runs in flight (+{per_round} a "
        f"round), {faults_per_round()} faults a round, time budget {BUDGET_SECONDS} s, seed {SEED}"
    )
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    cluster.add_nodepool(
        "v5p", "2x2x1", slices=RUNS_IN_FLIGHT + per_round * ROUNDS + SPARE_SLICES, prefix="faults"
    )
    offset = ledger.log.offset()
    ledger.create(RUNS_IN_FLIGHT, tight=TIGHT_RUNS)
    ledger.converge("start", offset, injected={}, timeout=300)
    ledger.record_jobset_uids()

    steps: list[tuple[str, Callable[[int], None]]] = [
        ("operator SIGKILL", lambda _: sigkill_the_operator_during_a_burst(ledger, cluster, fault_operator)),
        ("JobSet controller outage", lambda _: stop_the_jobset_controller(ledger, cluster)),
        ("kube-apiserver outage", lambda _: stop_the_apiserver(ledger, cluster, fault_operator)),
        ("etcd restart", lambda _: restart_etcd(ledger, cluster)),
        ("node deletions", lambda i: preempt_nodes(ledger, cluster, i)),
        ("exits 137", lambda _: fail_pods_with_an_infrastructure_exit(ledger, cluster, fault_operator)),
        ("exits 75", lambda _: stop_pods_after_a_checkpoint(ledger)),
        ("maintenance labels", lambda _: announce_maintenance(ledger, cluster)),
        ("JobSet deletions", lambda _: delete_jobsets(ledger, cluster)),
        ("status edits", lambda _: edit_statuses_by_hand(ledger, cluster)),
    ]
    round_seconds: list[float] = []
    completed = 0
    for round_index in range(ROUNDS):
        round_started = time.monotonic()
        for name, step in steps:
            if ledger.out_of_time(f"round {round_index + 1}/{ROUNDS}, before {name}"):
                break
            known = len(ledger.violations)
            step(round_index)
            for violation in ledger.violations[known : known + 5]:  # at once, not only at the end
                say(f"[faults]   round {round_index + 1}, {name}: {violation}")
        else:
            completed += 1
        round_seconds.append(round(time.monotonic() - round_started))
        say(
            f"[faults] round {round_index + 1}/{ROUNDS}: {sum(ledger.injected().values())} faults so far, "
            f"{len(ledger.runs)} runs, {ledger.elapsed():.0f} s elapsed (this round {round_seconds[-1]} s), "
            f"{len(ledger.violations)} violations so far"
        )
        if completed <= round_index:
            break

    result = {
        "faults_injected": sum(ledger.injected().values()),
        "rounds": ROUNDS,
        "rounds_completed": completed,
        "batch": BATCH,
        "seed": SEED,
        "runs": len(ledger.runs),
        "runs_with_max_restarts_0": sum(e.max_restarts == 0 for e in ledger.runs.values()),
        "run_checks": ledger.checks,
        "violations": ledger.violations,
        "seconds": round(ledger.elapsed()),
        "budget_seconds": BUDGET_SECONDS,
        "seconds_per_round": round_seconds,
        "by_kind": summary_by_kind(ledger.faults),
        "faults": ledger.faults,
    }
    # The record of the long suite is kept; one round (`make test`) leaves the repository alone.
    default = RESULTS if ROUNDS > 1 else tmp_path / "faults.json"
    results = Path(os.environ.get("TPUFT_CHAOS_RESULTS") or default)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(result, indent=2) + "\n")
    say(
        f"[faults] done: {result['faults_injected']} faults, {result['runs']} runs, {ledger.checks} run "
        f"checks, {len(ledger.violations)} violations, {result['seconds']} s; record in {results}"
    )
    assert not ledger.violations, "\n".join(ledger.violations) + "\n" + fault_operator.log_tail(40)
    assert fault_operator.alive()
