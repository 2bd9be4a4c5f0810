"""The operator at scale, side by side with the limit, on the local cluster (`LocalCluster("bench")`).

For each N (100, 300, 1000 by default), `repeat` rounds of four phases. **Every phase runs on a fresh
cluster of its own**, warmed up the same way (`Bench.warm_up`: WARMUP_RUNS runs through a fresh
operator, until they have Succeeded): no phase inherits the N runs of another (on one cluster a
later phase paid ~12% per place, and the operator's phase, always first, was flattered by it), and
the order of the phases is rotated one place a round (`phase_order`), so the machine's drift during
a round favours none of them.

1. *operator*: the operator of the warm-up (as the chart's ServiceAccount, with the chart's RBAC,
   watching all namespaces as the chart does by default) meets N TPUFineTunes created by a client as
   fast as it can (16 threads); then the phase waits for every run to be `Succeeded`.
2. *direct* (the limit), the operator stopped after the warm-up: the same N JobSets that
   `render_run` makes for the same specs, created the same way (each carries its trainer config).
   The namespace's trainer ServiceAccount is created first, untimed, so their pods start exactly as
   the operator's do.
3. *zero-reaction*, the operator stopped: a controller that takes no time at all. The client
   creates the TPUFineTunes as in the operator phase, and the moment each is stored its JobSet
   (rendered and encoded beforehand: `send_jobset`) is sent from a pool of as many threads as the
   operator has workers: the same arrivals and creates in flight, no reaction. Every controller
   pays for both creates on the same API server; the direct phase pays for the JobSets only, so on
   a CPU-bound API server it is a limit no controller can reach.
4. *watch-reaction*, the operator stopped: the least any Kubernetes controller can do. Another
   process holds the watches the operator holds (`OperatorWatches`: TPUFineTunes, their JobSets and
   pods, the TPU nodes), decoding every event, and the moment its TPUFineTune watch shows a run it
   sends the run's JobSet from as many threads as the operator has workers. It learns of a run as
   the operator must, from a watch event (the zero-reaction controller learns of it from the client's
   own POST), and pays for every event the operator's watches bring; the gap between it and the
   operator is what the operator itself costs. (Until 2026-12-04 this phase was *zero-reaction,
   watched*: the zero-reaction controller while the watches were held, `zero-reaction-watched` in
   older results.)

Latencies are taken at the client with one clock: from the moment a thread sends the create request
(of the JobSet, or of the TPUFineTune) to the moment the client's watch sees the JobSet; and from the
moment the watch sees the JobSet `Completed` to the moment it sees the TPUFineTune `Succeeded`.
*Where the latency goes*, per run, from the audit log's JobSet create (logged for every client):
send -> the JobSet POST reaches the apiserver (for the operator: the TPUFineTune's create, its watch
event, the queue and the reconcile), the apiserver's handling of the POST (admission, the JobSet
webhooks, etcd), and its completion -> the client's watch sees the JobSet.
The operator's API requests come from the apiserver's audit log (opt-in for this cluster: see
`components.Layout.audit_policy`), filtered to the operator's user; 409/429/5xx of the whole
cluster come from the apiserver's `apiserver_request_total`. Peak RSS (VmHWM) and CPU seconds
(utime+stime) are read from /proc for the operator's process.

Capacity: one v5e 2x2 host (4 chips, one pod) per run, `POOLS` single-host node pools. N=100 and
N=300 are all placed at once; at N=1000 the runs flow through the pools as kwok completes pods
(1-5 s each), so later runs wait unschedulable for a while: creation latency is measured for all
runs regardless, and the per-run write count separates status patches made while waiting.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property, partial
from pathlib import Path
from typing import Any, cast

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from bench import results_file
from tpuft_dev.cluster.local import LocalCluster
from tpuft_dev.cluster.operator_process import (
    OPERATOR_NAMESPACE,
    SERVICE_ACCOUNT,
    OperatorProcess,
    install_operator,
)
from tpuft_operator.api.models import Phase
from tpuft_operator.api.resources import FINETUNE, JOBSET, POD
from tpuft_operator.render import RenderedRun, RenderSettings, render_run
from tpuft_operator.render.jobset import FINETUNE_LABEL
from tpuft_operator.settings import OperatorSettings
from tpuft_operator.topology import ACCELERATOR_LABEL

RESULTS = results_file("operator")
CLUSTER = "bench"
POOLS = 300  # v5e 2x2 single-host node pools: one run each at a time
SIZES = (100, 300, 1000)
# The phases of a round, each on a fresh cluster of its own (`main`), in this order in the first
# round and rotated one place in each next one (`phase_order`).
PHASES = ("operator", "direct", "zero-reaction", "watch-reaction")
# Rounds per N: the figures swing by 2x between runs on the 2-CPU machine, and a phase pays ~12% per
# place later in a round; four rounds put every phase once at every place (three put the operator
# at mean place 2.67 against the zero-reaction controller's 2.0, the 2026-12-03 21:57 run).
REPEAT = len(PHASES)
DESCRIBED = {
    "operator": "through the operator",
    "direct": "direct JobSet creation (the limit)",
    "zero-reaction": "a zero-reaction controller (each TPUFineTune's JobSet sent the moment it is stored)",
    "watch-reaction": "a watch-reaction controller (each JobSet sent the moment the TPUFineTune watch shows its run)",
}
THREADS = 16
WARMUP_RUNS = 32  # through the operator before its burst (`Bench.warm_up`)
TRAINER_IMAGE = "example.invalid/tpuft-trainer:bench"
# The zero-reaction phase renders its JobSets before their TPUFineTunes exist, with this uid, and
# puts the stored TPUFineTune's in its place (owner reference, uid label) when it sends each.
PLACEHOLDER_UID = "00000000-0000-4000-8000-000000000000"
OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{SERVICE_ACCOUNT}"
# The operator's status writes, as the audit log's requests are tallied (f"{verb} {resource}").
STATUS_PATCH = f"patch {FINETUNE.plural}/status"
WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})
RUN_NAME = re.compile(r"^(r-\d{4})")

# Only the operator's requests are logged; its status patches with their bodies (to see the phase).
AUDIT_POLICY = f"""apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived, ResponseStarted]
rules:
- level: Request
  users: ["{OPERATOR_USER}"]
  verbs: [patch]
  resources: [{{group: {FINETUNE.group}, resources: [{FINETUNE.plural}/status]}}]
- level: Metadata
  users: ["{OPERATOR_USER}"]
- level: Metadata
  verbs: [create]
  resources: [{{group: {JOBSET.group}, resources: [{JOBSET.plural}]}}, {{group: {FINETUNE.group}, resources: [{FINETUNE.plural}]}}, {{group: batch, resources: [jobs]}}]
- level: None
"""


def finetune(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": FINETUNE.api_version,
        "kind": FINETUNE.kind,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"name": "meta-llama/Llama-3.2-1B"},
            "dataset": {"name": "gs://example-bucket/data/train.jsonl"},
            "tpu": {"type": "v5e", "topology": "2x2"},
            "training": {"maxSteps": 10},
            "output": {"uri": "gs://example-bucket/out"},
            # The operator's reaction to a burst, from the run to its JobSet, as measured before the
            # prepare Job existed (a prepare Job per run would add the Job's round trip to every run).
            "prepare": {"enabled": False},
        },
    }


def names(n: int) -> list[str]:
    return [f"r-{i:04d}" for i in range(n)]


def operator_workers() -> int:
    """How many worker threads the operator runs (TPUFT_WORKERS, else its default): the controllers
    of phases 3 and 4 send their JobSets from as many."""
    return int(os.environ.get("TPUFT_WORKERS") or OperatorSettings().workers)


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"min": None, "p50": None, "p95": None, "p99": None, "max": None, "count": 0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)

    return {
        "min": round(ordered[0], 4),
        "p50": round(statistics.median(ordered), 4),
        "p95": at(0.95),
        "p99": at(0.99),
        "max": round(ordered[-1], 4),
        "count": len(ordered),
    }


# --------------------------------------------------------------------------- clients and watches
def api_client(kubeconfig: Path) -> client.ApiClient:
    """A client whose pool keeps a connection for each of the client's threads, a controller's as many
    as the operator's workers, and a few watches: a call beyond it would pay a new TLS handshake."""
    configuration = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    configuration.connection_pool_maxsize = THREADS + operator_workers() + 8
    return client.ApiClient(configuration)


@dataclass(frozen=True)
class Listing:
    """What one watch lists and then follows: a list call of the client, with its arguments
    (``custom.list_namespaced_custom_object`` and a group, version, namespace and plural; or
    ``core.list_pod_for_all_namespaces`` and a label selector)."""

    call: Callable[..., Any]
    args: tuple[str, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def custom(cls, api: client.ApiClient, gvp: tuple[str, str, str], namespace: str) -> Listing:
        """The custom objects of kind ``gvp`` in ``namespace``."""
        group, version, plural = gvp
        call = client.CustomObjectsApi(api).list_namespaced_custom_object
        return cls(call, (group, version, namespace, plural))


class Watcher(threading.Thread):
    """Lists, then watches from the listing's resourceVersion (and lists again when that has
    expired), and hands every object, with the time it arrived, to ``on_event``: each item of a
    listing as ADDED, then each watch event. Objects are decoded to dicts with json.loads only, as
    kopf's client does (the client's models would cost more than the watch itself)."""

    def __init__(
        self,
        listing: Listing,
        on_event: Callable[[str, dict[str, Any], float], None],
        *,
        timeout_seconds: int = 5,
    ) -> None:
        super().__init__(daemon=True)
        self.listing, self.on_event, self.timeout_seconds = listing, on_event, timeout_seconds
        self.stopped = threading.Event()
        self.ready = threading.Event()  # set after the first listing

    def run(self) -> None:
        call, args, kwargs = self.listing.call, self.listing.args, self.listing.kwargs
        version = ""
        while not self.stopped.is_set():
            if not version:
                listed = json.loads(call(*args, _preload_content=False, **kwargs).data)
                now = time.monotonic()
                for item in listed["items"]:
                    self.on_event("ADDED", item, now)
                version = listed["metadata"]["resourceVersion"]
                self.ready.set()
            try:
                for event in watch.Watch().stream(
                    call,
                    *args,
                    resource_version=version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=self.timeout_seconds,
                    deserialize=False,
                    **kwargs,
                ):
                    obj = event["object"]
                    version = obj["metadata"].get("resourceVersion") or version
                    if event["type"] != "BOOKMARK":
                        self.on_event(event["type"], obj, time.monotonic())
                    if self.stopped.is_set():
                        return
            except ApiException as error:
                if error.status != 410:
                    raise
                version = ""  # expired: list again


def _slim(obj: dict[str, Any]) -> dict[str, Any]:
    """What `Observations` reads of an object: small to pass between processes."""
    meta, status = obj["metadata"], obj.get("status") or {}
    return {
        "metadata": {"name": meta["name"], "labels": meta.get("labels") or {}},
        "status": {"phase": status.get("phase"), "conditions": status.get("conditions") or []},
    }


def _watch(
    kubeconfig: str, gvp: tuple[str, str, str], namespace: str, out: Any, stop: Any, ready: Any
) -> None:
    """The body of `WatchProcess`: a `Watcher` thread, each event slimmed and put on ``out`` with its
    arrival time (CLOCK_MONOTONIC: the same clock in every process)."""
    listing = Listing.custom(api_client(Path(kubeconfig)), gvp, namespace)
    watcher = Watcher(listing, partial(_put, out))
    watcher.start()
    watcher.ready.wait(60)
    ready.set()
    stop.wait()
    watcher.stopped.set()


@dataclass(frozen=True)
class Reaction:
    """What the watch-reaction controller (`OperatorWatches`, phase 4) does: the moment its watch of
    TPUFineTunes shows one of ``jobsets`` (by name) ADDED in ``namespace``, it sends that run's JobSet
    (rendered beforehand, JSON with PLACEHOLDER_UID where the stored TPUFineTune's uid goes) from a
    pool of ``workers`` threads."""

    namespace: str
    jobsets: dict[str, str]
    workers: int


class OperatorWatches:
    """The watches the operator holds (watches.py, with main.configure_kopf's server-side label
    selectors), in a process of their own, without the operator: each lists, then watches from the
    listing's resourceVersion, and decodes every event to a dict (as kopf's client does).
    Kueue's Workloads are left out: the benchmark installs no Kueue, and the operator's watch of them
    is then a 404 every 10 s.

    With a ``reaction`` this is the *watch-reaction* controller: it learns of each run from its
    TPUFineTune watch, as every Kubernetes controller must, and sends the run's JobSet at once,
    nothing else. The zero-reaction phase learns of a run from the client's own POST (no watch in
    between), so no controller can match it; this one is what any controller holding the operator's
    watches could do at best, and the difference between it and the operator is the operator's own."""

    KINDS = ("tpufinetunes", "jobsets", "pods", "nodes")

    def __init__(self, kubeconfig: Path, reaction: Reaction | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop, self._ready = context.Event(), context.Event()
        self._events = context.Array("q", len(self.KINDS))
        self._outcome = context.Queue()  # the controller's errors, put once it has stopped
        self._process = context.Process(
            target=_operator_watches,
            args=(str(kubeconfig), self._events, self._stop, self._ready, reaction, self._outcome),
            daemon=True,
        )
        self._before: list[int] = []

    def start(self, timeout: float = 90) -> None:
        """Starts the watches; returns once every one has listed."""
        self._process.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the operator's watches did not start")
        self._before = self._events[:]

    def cpu_seconds(self) -> float:
        """The CPU the process has used so far (user + system)."""
        assert self._process.pid is not None
        return proc_usage(self._process.pid)["cpu_seconds"]

    def stop(self) -> tuple[dict[str, int], dict[str, Any]]:
        """Stops the watches (after the reaction's creates in flight); returns the events each
        received since `start` returned, and the reaction's outcome: ``errors``, its failed creates
        by HTTP status, and ``failed``, the runs whose JobSet it could not create."""
        now = self._events[:]
        counts = {kind: now[i] - self._before[i] for i, kind in enumerate(self.KINDS)}
        self._stop.set()
        try:
            outcome = cast(dict[str, Any], self._outcome.get(timeout=120))
        except queue.Empty:
            outcome = {"errors": {}, "failed": ["(the watch-reaction process did not report)"]}
        self._process.join(15)
        return counts, outcome


def _operator_watches(
    kubeconfig: str, events: Any, stop: Any, ready: Any, reaction: Reaction | None, outcome: Any
) -> None:
    """The body of `OperatorWatches`: a `Watcher` per kind; ``events[i]`` counts the i-th's events
    (and the items of a listing again after an expired watch); with a ``reaction``, the TPUFineTune
    watch's thread hands each run's JobSet create to the reaction's pool."""
    api = api_client(Path(kubeconfig))
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    selected = {"label_selector": FINETUNE_LABEL}
    listings = [
        Listing(custom.list_cluster_custom_object, FINETUNE.gvp),
        Listing(custom.list_cluster_custom_object, JOBSET.gvp, selected),
        Listing(core.list_pod_for_all_namespaces, (), selected),
        Listing(core.list_node, (), {"label_selector": ACCELERATOR_LABEL}),
    ]
    pool = ThreadPoolExecutor(reaction.workers, "watch-reaction") if reaction else None
    sent: dict[str, Future[None]] = {}
    errors: Counter[int] = Counter()

    def react(obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        name = meta["name"]
        if reaction is None or pool is None or meta.get("namespace") != reaction.namespace:
            return
        if name in reaction.jobsets and name not in sent:
            own = reaction.jobsets[name].replace(PLACEHOLDER_UID, meta["uid"])
            create = partial(send_jobset, api, reaction.namespace, own)
            sent[name] = pool.submit(retried, name, create, errors)

    def count(index: int, type_: str, obj: dict[str, Any], at: float) -> None:
        if index == 0 and type_ == "ADDED":  # listings[0]: the TPUFineTunes
            react(obj)
        with events.get_lock():
            events[index] += 1

    watchers = [
        Watcher(listing, partial(count, index), timeout_seconds=30) for index, listing in enumerate(listings)
    ]
    for watcher in watchers:
        watcher.start()
    for watcher in watchers:
        watcher.ready.wait(60)
    ready.set()
    stop.wait()
    for watcher in watchers:
        watcher.stopped.set()
    failed = []
    if pool is not None:
        pool.shutdown(wait=True)
        failed = [name for name, future in sent.items() if future.exception() is not None]
    outcome.put({"errors": {str(k): v for k, v in errors.items()}, "failed": failed})


def _put(out: Any, type_: str, obj: dict[str, Any], at: float) -> None:
    out.put((type_, _slim(obj), at))


class WatchProcess:
    """One of the benchmark client's watches (a kind in a namespace), in a process of its own.

    In the client's process the watch threads shared the GIL with the 16 threads sending creates and
    fell behind: in one N=1000 round the client's watch saw JobSets 2.1 s (p50) after the API server
    had stored them, in another 0.1 s. And two watches in one process delay each other: in the
    operator phase the TPUFineTunes' ~3 status events per run held up the JobSet events (at N=1000 the
    JobSet watch saw JobSets 2.4 s, p50, after the API server had stored them, against 0.04 s in the
    direct phase). Arrival times are taken in a process that does nothing else."""

    def __init__(
        self,
        kubeconfig: Path,
        gvp: tuple[str, str, str],
        namespace: str,
        on_event: Callable[[str, dict[str, Any], float], None],
    ) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self._out = context.Queue()
        self._stop, self._ready = context.Event(), context.Event()
        self._on_event = on_event
        self._process = context.Process(
            target=_watch,
            args=(str(kubeconfig), gvp, namespace, self._out, self._stop, self._ready),
            daemon=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)

    def start(self, timeout: float = 90) -> None:
        """Starts the watch; returns once it has listed (its callback follows every event)."""
        self._process.start()
        self._reader.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the benchmark's watch did not start")

    def _read(self) -> None:
        while (item := self._out.get()) is not None:
            self._on_event(*item)

    def stop(self) -> None:
        self._stop.set()
        self._process.join(10)
        self._out.put(None)


def _true(obj: dict[str, Any], type_: str) -> bool:
    return any(
        c.get("type") == type_ and c.get("status") == "True"
        for c in (obj.get("status") or {}).get("conditions") or []
    )


@dataclass
class Observations:
    """First-seen times (time.monotonic) per run, filled by the watch threads."""

    jobset_seen: dict[str, float] = field(default_factory=dict)
    jobset_completed: dict[str, float] = field(default_factory=dict)
    first_status: dict[str, float] = field(default_factory=dict)  # the run's first phase, any
    running: dict[str, float] = field(default_factory=dict)
    succeeded: dict[str, float] = field(default_factory=dict)

    def jobset_event(self, type_: str, obj: dict[str, Any], at: float) -> None:
        if type_ == "DELETED":
            return
        run = obj["metadata"].get("labels", {}).get(FINETUNE_LABEL, obj["metadata"]["name"])
        self.jobset_seen.setdefault(run, at)
        if _true(obj, "Completed"):
            self.jobset_completed.setdefault(run, at)

    def finetune_event(self, type_: str, obj: dict[str, Any], at: float) -> None:
        phase = (obj.get("status") or {}).get("phase")
        name = obj["metadata"]["name"]
        if phase:
            self.first_status.setdefault(name, at)
        if phase == Phase.RUNNING:
            self.running.setdefault(name, at)
        elif phase == Phase.SUCCEEDED:
            self.succeeded.setdefault(name, at)


def status_lag(sent: Mapping[str, float], obs: Observations, started: float) -> dict[str, Any]:
    """Per run, from its create to the client seeing its first status and its status Running, and
    from the first create to the last run's Running."""
    first = [obs.first_status[r] - sent[r] for r in sent if r in obs.first_status]
    running = [obs.running[r] - sent[r] for r in sent if r in obs.running]
    return {
        "create_to_first_status": percentiles(first),
        "create_to_running": percentiles(running),
        "seconds_to_all_running": (
            round(max(obs.running[r] for r in sent) - started, 2)
            if all(r in obs.running for r in sent)
            else None
        ),
    }


def retried(name: str, create: Callable[[], Any], errors: Counter[int]) -> None:
    """``create()``, tried again (5 times in all) on a failure but a conflict (already created)."""
    for _ in range(5):
        try:
            create()
            return
        except ApiException as error:
            errors[int(error.status or 0)] += 1
            if error.status == 409:
                return
            time.sleep(0.2)
    raise RuntimeError(f"could not create {name}")


def send_jobset(api: client.ApiClient, namespace: str, body: str) -> None:
    """POSTs a JobSet already encoded as JSON, as it is: the controllers of phases 3 and 4 take no
    time, so they do not walk it through the client's `sanitize_for_serialization` and encode it
    again (the operator does neither either: `k8s.Api._call`). Raises ApiException as the client's
    calls do, for `retried`."""
    group, version, plural = JOBSET.gvp
    method, url, headers, _, _ = api.param_serialize(
        method="POST",
        resource_path=f"/apis/{group}/{version}/namespaces/{namespace}/{plural}",
        header_params={"Content-Type": "application/json", "Accept": "application/json"},
        auth_settings=["BearerToken"],
    )
    response = api.rest_client.pool_manager.request(method, url, body=body, headers=headers, timeout=60)
    if not 200 <= response.status < 300:
        raise ApiException(status=response.status, reason=response.reason)


def create_all(
    items: Sequence[tuple[str, Callable[[], Any]]],
    sent: dict[str, float],
    errors: Counter[int],
    threads: int = THREADS,
) -> None:
    """Runs every create on ``threads`` threads, as fast as they go; records when each was sent."""

    def one(item: tuple[str, Callable[[], Any]]) -> None:
        sent.setdefault(item[0], time.monotonic())
        retried(*item, errors)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, items))


def wait_until(what: str, done: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(0.05)
    print(f"   ! timed out after {timeout:.0f}s waiting for {what}")
    return False


# --------------------------------------------------------------------------- measurements
def proc_usage(pid: int) -> dict[str, float]:
    """Peak and current RSS (MB) and CPU seconds (user+system) of a process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    kb = {
        key: int(value.split()[0])
        for key, value in re.findall(r"^(VmHWM|VmRSS):\s+(.*)$", status, re.MULTILINE)
    }
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return {
        "peak_rss_mb": round(kb["VmHWM"] / 1024, 1),
        "rss_mb": round(kb["VmRSS"] / 1024, 1),
        "cpu_seconds": round((int(fields[11]) + int(fields[12])) / ticks, 2),
    }


def ms_per_run(cpu_before: float, cpu_after: float, n: int) -> float:
    """CPU milliseconds per run between two readings of a process' CPU seconds."""
    return round(1000 * (cpu_after - cpu_before) / n, 2)


def components_cpu(cluster: LocalCluster) -> dict[str, float]:
    """CPU seconds (user+system) so far of each of the cluster's processes (kube-apiserver, etcd, ...)."""
    used = {}
    for pid_file in sorted(cluster.layout.pids.glob("*.pid")):
        try:
            used[pid_file.stem] = proc_usage(int(pid_file.read_text()))["cpu_seconds"]
        except (OSError, ValueError, KeyError):
            continue  # not running
    return used


def cpu_between(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, Any]:
    """Per component: CPU seconds spent between two `components_cpu` readings, and ms per run."""
    seconds = {name: round(after[name] - before.get(name, 0.0), 2) for name in after}
    return {"seconds": seconds, "ms_per_run": {name: round(1000 * v / n, 1) for name, v in seconds.items()}}


def apiserver_codes(cluster: LocalCluster) -> Counter[str]:
    """apiserver_request_total summed by response code (the whole cluster, every client)."""
    url = f"{cluster.server}/metrics"
    with urllib.request.urlopen(url, timeout=30, context=cluster._ssl_context(url)) as response:
        text = response.read().decode()
    codes: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith("apiserver_request_total{"):
            match = re.search(r'code="(\d+)"', line)
            if match:
                codes[match.group(1)] += int(float(line.rsplit(" ", 1)[1]))
    return codes


def storm_codes(before: Counter[str], after: Counter[str]) -> dict[str, int]:
    delta = {code: after[code] - before.get(code, 0) for code in after}
    return {
        "409": delta.get("409", 0),
        "429": delta.get("429", 0),
        "5xx": sum(v for code, v in delta.items() if code.startswith("5")),
    }


def audit_requests(path: Path, offset: int, n: int) -> dict[str, Any]:
    """The operator's requests since ``offset`` of the audit log: by verb and resource, by response
    code, and per run the writes it took to reach Running (or Succeeded, if it never saw Running)."""
    by_kind: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    per_run: dict[str, list[tuple[str, str, str | None]]] = {}
    writes_at: list[tuple[str, str]] = []  # (received, f"{verb} {resource}") of every write
    with path.open() as log:
        log.seek(offset)
        for line in log:
            entry = json.loads(line)
            if entry.get("user", {}).get("username") != OPERATOR_USER:
                continue
            ref = entry.get("objectRef") or {}
            resource = ref.get("resource", "?") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
            verb = entry["verb"]
            by_kind[f"{verb} {resource}"] += 1
            codes[str((entry.get("responseStatus") or {}).get("code", "?"))] += 1
            if verb in WRITE_VERBS:
                writes_at.append((entry["requestReceivedTimestamp"], f"{verb} {resource}"))
            match = RUN_NAME.match(ref.get("name") or "")
            if verb in WRITE_VERBS and match:
                phase = ((entry.get("requestObject") or {}).get("status") or {}).get("phase")
                per_run.setdefault(match.group(1), []).append(
                    (entry["requestReceivedTimestamp"], f"{verb} {resource}", phase)
                )
    writes = sum(v for k, v in by_kind.items() if k.split()[0] in WRITE_VERBS)
    to_running: list[int] = []
    to_running_without_events: list[int] = []
    status_patches: list[int] = []
    for requests in per_run.values():
        requests.sort()
        status_patches.append(sum(1 for _, kind, _ in requests if kind == STATUS_PATCH))
        for i, (_, kind, phase) in enumerate(requests):
            if kind == STATUS_PATCH and phase in (Phase.RUNNING, Phase.SUCCEEDED):
                to_running.append(i + 1)
                to_running_without_events.append(sum(1 for r in requests[: i + 1] if "events" not in r[1]))
                break

    # What else the operator wrote while it was still creating JobSets (same-format UTC stamps
    # compare as strings): writes that competed with its creates for the API server.
    last_create = max((at for at, kind in writes_at if kind == f"create {JOBSET.plural}"), default="")
    during_creates = Counter(kind for at, kind in writes_at if at <= last_create)
    del during_creates[f"create {JOBSET.plural}"]

    def mean(values: list[int]) -> float | None:
        return round(statistics.mean(values), 2) if values else None

    return {
        "total": sum(by_kind.values()),
        "writes": writes,
        "reads": sum(by_kind.values()) - writes,
        "writes_per_run": round(writes / n, 2),
        "object_creates_per_run": round(
            sum(v for k, v in by_kind.items() if k.startswith("create ") and k != "create events") / n, 2
        ),
        "status_patches_per_run": round(by_kind[STATUS_PATCH] / n, 2),
        "events_per_run": round(by_kind["create events"] / n, 2),
        "reads_per_run": round((sum(by_kind.values()) - writes) / n, 2),
        "by_verb_and_resource": dict(by_kind.most_common()),
        "by_code": dict(codes.most_common()),
        "other_writes_until_last_jobset": dict(during_creates.most_common()),
        "writes_to_running_per_run_mean": mean(to_running),
        "writes_to_running_per_run_max": max(to_running) if to_running else None,
        "writes_to_running_without_events_mean": mean(to_running_without_events),
        "status_patches_per_run_mean": mean(status_patches),
        "status_patches_per_run_max": max(status_patches) if status_patches else None,
    }


BUCKET_LINE = re.compile(r"^(\w+)_bucket\{([^}]*)\} (\S+)$", re.MULTILINE)
LABEL = re.compile(r'(\w+)="([^"]*)"')


def histogram_buckets(metrics_text: str, name: str) -> dict[str, dict[float, float]]:
    """A cumulative histogram of an operator's /metrics text: per series (its labels but ``le``, as
    "work=create", or "" for an unlabelled one), bucket upper bound -> observations within it."""
    series: dict[str, dict[float, float]] = {}
    for metric, labels, count in BUCKET_LINE.findall(metrics_text):
        if metric != name:
            continue
        pairs = dict(LABEL.findall(labels))
        bound = float(pairs.pop("le"))
        key = ",".join(f"{k}={v}" for k, v in sorted(pairs.items()))
        series.setdefault(key, {})[bound] = float(count)
    return series


def histogram_between(before: str, after: str, name: str) -> dict[str, dict[str, float | int | None]]:
    """Per series of histogram ``name``, the observations made between two scrapes of the operator's
    /metrics and the bucket bounds their median and 99th percentile fall within (an upper bound: the
    histogram's resolution; 0.5 means somewhere in the bucket below 0.5 s)."""
    start, end = histogram_buckets(before, name), histogram_buckets(after, name)
    out: dict[str, dict[str, float | int | None]] = {}
    for key, counts in end.items():
        delta = {bound: count - start.get(key, {}).get(bound, 0.0) for bound, count in sorted(counts.items())}
        out[key] = {
            "count": int(delta.get(float("inf"), 0.0)),
            "p50_at_most": _bucket_of(delta, 0.5),
            "p99_at_most": _bucket_of(delta, 0.99),
        }
    return out


def _bucket_of(cumulative: dict[float, float], q: float) -> float | None:
    """The upper bound of the first bucket (in ascending order) holding the q-quantile, if any."""
    total = cumulative.get(float("inf"), 0.0)
    return next((bound for bound, count in cumulative.items() if count >= q * total), None) if total else None


def _audit_time(stamp: str, wall_minus_monotonic: float) -> float:
    """An audit timestamp (RFC 3339, UTC) on the time.monotonic() scale of this process."""
    return datetime.fromisoformat(stamp).timestamp() - wall_minus_monotonic


def run_created(entry: dict[str, Any], namespace: str) -> tuple[str, str] | None:
    """(resource, run) when audit ``entry`` is a successful create of one of the benchmark's runs'
    objects in ``namespace`` (its name starts with the run's), else None."""
    ref = entry.get("objectRef") or {}
    if (
        entry["verb"] != "create"
        or ref.get("namespace") != namespace
        or (entry.get("responseStatus") or {}).get("code") != 201
    ):
        return None
    match = RUN_NAME.match(ref.get("name") or "")
    return (str(ref.get("resource")), match.group(1)) if match else None


def latency_breakdown(
    path: Path, offset: int, namespace: str, sent: dict[str, float], seen: dict[str, float]
) -> dict[str, Any]:
    """Per run: send -> JobSet POST received, the POST in the apiserver, POST done -> watch sees it,
    JobSet stored -> the JobSet controller's first Job POST (its reaction); in the operator phase the
    first part is split at the TPUFineTune's POST (send -> received, in the apiserver, done -> the
    operator's JobSet POST received: the operator's reaction)."""
    posts: dict[str, dict[str, tuple[float, float]]] = {JOBSET.plural: {}, FINETUNE.plural: {}, "jobs": {}}
    offset_of_clocks = time.time() - time.monotonic()  # once: every stamp is converted alike
    with path.open() as log:
        log.seek(offset)
        for line in log:
            entry = json.loads(line)
            created = run_created(entry, namespace)
            # A run's first create of each kind only (the JobSet controller makes a run's Jobs
            # again when it restarts them).
            if created is not None and created[0] in posts and created[1] not in posts[created[0]]:
                posts[created[0]][created[1]] = (
                    _audit_time(entry["requestReceivedTimestamp"], offset_of_clocks),
                    _audit_time(entry["stageTimestamp"], offset_of_clocks),
                )
    jobsets, finetunes, jobs = posts[JOBSET.plural], posts[FINETUNE.plural], posts["jobs"]
    runs = [r for r in jobsets if r in sent and r in seen]
    # A POST received before it was sent: the wall clock was stepped (NTP) between the phase and
    # now, so no audit time converts right (seen once, by 17.6 s): no figures rather than wrong ones.
    stepped = sum(1 for r in runs if jobsets[r][0] < sent[r] - 0.05)
    if stepped:
        return {"runs": len(runs), "clock_stepped_runs": stepped}
    split: dict[str, Any] = {
        "runs": len(runs),
        # create -> the JobSet stored (the POST's response): the latency without any watch's lag.
        "send_to_jobset_stored": percentiles([jobsets[r][1] - sent[r] for r in runs]),
        "send_to_jobset_post": percentiles([jobsets[r][0] - sent[r] for r in runs]),
        "jobset_post_in_apiserver": percentiles([jobsets[r][1] - jobsets[r][0] for r in runs]),
        "jobset_post_done_to_seen": percentiles([seen[r] - jobsets[r][1] for r in runs]),
        # The first send -> the last JobSet stored: the phase's time to all JobSets without the
        # client's JobSet watch, whose lag swung from 0.03 to 2.9 s (p50) between phases of one round.
        "seconds_to_all_jobsets_stored": round(
            max((jobsets[r][1] for r in runs), default=0.0) - min(sent.values(), default=0.0), 4
        ),
    }
    # JobSet stored -> the JobSet controller's first Job POST for it: that controller's reaction,
    # through its own JobSet watch. Where the client's watch lags, this says whether the API server
    # was late to deliver JobSet events to every watcher or only to the client's.
    controlled = [r for r in runs if r in jobs]
    if controlled:
        split["jobset_stored_to_job_post"] = percentiles([jobs[r][0] - jobsets[r][1] for r in controlled])
        # The first send -> the JobSet controller's last first-Job POST: when every run's pods could
        # start to be made, whoever made the JobSets.
        split["seconds_to_all_jobs_posted"] = round(
            max(jobs[r][0] for r in controlled) - min(sent.values(), default=0.0), 4
        )
    runs = [r for r in runs if r in finetunes]
    if runs:
        split["send_to_finetune_post"] = percentiles([finetunes[r][0] - sent[r] for r in runs])
        split["finetune_post_in_apiserver"] = percentiles([finetunes[r][1] - finetunes[r][0] for r in runs])
        split["finetune_done_to_jobset_post"] = percentiles([jobsets[r][0] - finetunes[r][1] for r in runs])
    return split


def wait_for_jobs(path: Path, offset: int, namespace: str, n: int, timeout: float = 300) -> int:
    """Waits until the audit log, from ``offset``, shows a Job created for each of the ``n`` runs of
    ``namespace`` (or ``timeout`` passes); returns how many runs have one. Reads on from where it
    stopped: the log holds every create of the phase."""
    runs: set[str] = set()
    deadline = time.monotonic() + timeout
    with path.open() as log:
        log.seek(offset)
        while len(runs) < n:
            position = log.tell()
            line = log.readline()
            if not line.endswith("\n"):  # the end, or a line still being written: look again
                if time.monotonic() > deadline:
                    break
                log.seek(position)
                time.sleep(1.0)
                continue
            created = run_created(json.loads(line), namespace)
            if created is not None and created[0] == "jobs":
                runs.add(created[1])
    return len(runs)


def logged_since(path: Path, offset: int, text: str) -> int:
    """The lines of log ``path`` past byte ``offset`` that contain ``text``."""
    with path.open("rb") as log:
        log.seek(offset)
        return sum(1 for line in log if text.encode() in line)


def operator_listed(path: Path) -> bool:
    """Whether the operator's lists of TPUFineTunes, JobSets and pods have succeeded (its watches follow)."""
    listed = set()
    with path.open() as log:
        for line in log:
            entry = json.loads(line)
            if (
                entry.get("user", {}).get("username") == OPERATOR_USER
                and entry["verb"] == "list"
                and (entry.get("responseStatus") or {}).get("code") == 200
            ):
                listed.add((entry.get("objectRef") or {}).get("resource"))
    return {FINETUNE.plural, JOBSET.plural, POD.plural} <= listed


# --------------------------------------------------------------------------- phases
@dataclass
class Burst:
    """A phase's burst of creates, measured up to the last JobSet its watch saw (`Bench._burst`)."""

    namespace: str
    n: int
    started: float  # time.monotonic of the first send
    client_seconds: float  # to send every create
    all_jobsets: float  # first send -> last JobSet seen
    cluster_cpu: dict[str, Any]  # the cluster's processes, per run, over the same span
    sent: dict[str, float]  # when each run's create was sent
    errors: Counter[int]  # the client's failed creates, by HTTP status
    codes_before: Counter[str]  # the API server's responses by code, before the burst
    audit_offset: int  # where the burst's requests begin in the audit log

    def figures(
        self, mode: str, cluster: LocalCluster, obs: Observations, codes_after: Counter[str]
    ) -> dict[str, Any]:
        """What every phase reports: ``codes_after`` ends its span of API server responses. Waits
        first for the JobSet controller to have posted every run's first Job (the yardstick phases
        end at their last JobSet, long before that), so that every phase's Jobs are counted alike."""
        jobs_posted = wait_for_jobs(cluster.layout.audit_log, self.audit_offset, self.namespace, self.n)
        latencies = [obs.jobset_seen[r] - self.sent[r] for r in self.sent if r in obs.jobset_seen]
        return {
            "mode": mode,
            "n": self.n,
            "load_average_at_end": load_average(),
            "client_seconds_to_send_all": round(self.client_seconds, 2),
            "seconds_to_all_jobsets": round(self.all_jobsets, 2),
            "create_to_jobset": percentiles(latencies),
            "create_to_jobset_samples": [round(v, 4) for v in sorted(latencies)],
            "client_errors": {str(k): v for k, v in self.errors.items()},
            "apiserver_error_codes": storm_codes(self.codes_before, codes_after),
            "cluster_cpu_to_all_jobsets": self.cluster_cpu,
            "latency_breakdown": latency_breakdown(
                cluster.layout.audit_log, self.audit_offset, self.namespace, self.sent, obs.jobset_seen
            ),
            "runs_with_jobs": jobs_posted,
        }


@dataclass
class Bench:
    cluster: LocalCluster
    api: client.ApiClient
    operator_kubeconfig: Path
    logs: Path
    threads: int = THREADS  # the client's: how many creates are in flight at once
    # Settings (TPUFT_* environment variables) of the operator processes this bench starts, beyond
    # its defaults: what `python -m bench pace` varies.
    operator_settings: Mapping[str, str] = field(default_factory=dict)

    @cached_property
    def operator_api(self) -> client.ApiClient:
        """A client acting as the operator's ServiceAccount, for the yardstick controllers.

        Any controller runs as a ServiceAccount under RBAC, authenticated by its token; the client
        is the cluster's admin (system:masters), whose requests skip authorization and are exempt
        from API Priority and Fairness. Until 2026-12-05 the yardstick controllers ran as the admin
        while the operator ran as its ServiceAccount."""
        return api_client(self.operator_kubeconfig)

    def namespace(self, name: str) -> None:
        self.cluster.kubectl("create", "namespace", name)

    def _rendered(self, ns: str, n: int, uid: str | None = None) -> list[RenderedRun]:
        """The namespace ``ns`` and the N runs rendered for it, as `render_run` makes them for the
        operator; ``uid``: the TPUFineTunes' uid to render with (their owner references, uid labels).
        Untimed: the namespace's trainer ServiceAccount, which the JobSets' pods need."""
        self.namespace(ns)
        runs = [
            render_run(
                {
                    **finetune(name, ns),
                    "metadata": {"name": name, "namespace": ns, **({"uid": uid} if uid else {})},
                },
                RenderSettings(trainer_image=TRAINER_IMAGE),
            )
            for name in names(n)
        ]
        sa = next(o for o in runs[0].namespace_objects if o["kind"] == "ServiceAccount")
        client.CoreV1Api(self.api).create_namespaced_service_account(ns, cast(Any, sa))
        return runs

    def direct(self, n: int) -> dict[str, Any]:
        """The N JobSets the operator would make, created by the client: the API server's own rate."""
        ns = f"bench-direct-{n}"
        custom = client.CustomObjectsApi(self.api)
        group, version, plural = JOBSET.gvp
        items = [
            (
                run.jobset_name,
                partial(custom.create_namespaced_custom_object, group, version, ns, plural, run.jobset),
            )
            for run in self._rendered(ns, n)
        ]
        return self._created_by_client("direct", ns, n, items)

    def zero_reaction(self, n: int) -> dict[str, Any]:
        """A controller that takes no time at all, the operator stopped: the client's threads create
        the TPUFineTunes exactly as in the operator phase, and the moment the API server has stored
        one, its JobSet (rendered beforehand, the stored object's uid filled in) is sent from a pool
        of as many threads as the operator has workers, as the operator's ServiceAccount
        (`operator_api`). The same arrivals, the same creates in flight, no reaction: every
        controller pays what this phase pays (both creates, on the same API server, in the same
        order) and more; the operator's latency is judged against it as well as against the direct
        phase (`bench.operator_report.zero_reaction_limit`).

        (Until 2026-12-03 each client thread created a TPUFineTune and then its JobSet before its next
        TPUFineTune: the arrivals slowed to the pace of the creates, so no run waited inside the API
        server, and its p99 left out the queueing that the operator phase's includes.)"""
        ns = f"bench-zero-{n}"
        custom = client.CustomObjectsApi(self.api)
        runs = self._rendered(ns, n, uid=PLACEHOLDER_UID)
        fg, fv, fp = FINETUNE.gvp
        finetunes = (fg, fv, ns, fp)
        controller = ThreadPoolExecutor(operator_workers(), thread_name_prefix="zero-reaction")
        reactions: list[Future[None]] = []
        errors: Counter[int] = Counter()

        def then_jobset(name: str, jobset: str) -> None:
            created = cast(
                dict[str, Any], custom.create_namespaced_custom_object(*finetunes, finetune(name, ns))
            )
            own = jobset.replace(PLACEHOLDER_UID, created["metadata"]["uid"])
            create = partial(send_jobset, self.operator_api, ns, own)
            reactions.append(controller.submit(retried, name, create, errors))

        items = [
            (name, partial(then_jobset, name, json.dumps(run.jobset)))
            for name, run in zip(names(n), runs, strict=True)
        ]
        try:
            result = self._created_by_client("zero-reaction", ns, n, items)
        finally:
            controller.shutdown(wait=True)
        for reaction in reactions:
            reaction.result()  # a JobSet that could not be created fails the benchmark, saying which
        result["controller_errors"] = {str(k): v for k, v in errors.items()}
        return result

    def watch_reaction(self, n: int) -> dict[str, Any]:
        """The least any controller can do, the operator stopped: another process holds the
        operator's watches (`OperatorWatches`), as the operator's ServiceAccount, and, the moment
        its TPUFineTune watch shows a run, sends the run's JobSet (rendered beforehand) from a pool
        of as many threads as the operator has workers. The client creates the TPUFineTunes exactly
        as in the operator phase. Unlike the zero-reaction controller it learns of a run as the
        operator must: from a watch event, after the API server has stored the TPUFineTune and
        fanned it out to its watchers."""
        ns = f"bench-watch-{n}"
        runs = self._rendered(ns, n, uid=PLACEHOLDER_UID)
        jobsets = {name: json.dumps(run.jobset) for name, run in zip(names(n), runs, strict=True)}
        watches = OperatorWatches(self.operator_kubeconfig, Reaction(ns, jobsets, operator_workers()))
        watches.start()
        try:
            idle = watches.cpu_seconds()
            result = self._created_by_client("watch-reaction", ns, n, self.finetune_creates(ns, n))
            # Until its last JobSet, as the operator's `cpu_ms_per_run_to_all_jobsets`.
            result["controller_cpu_ms_per_run_to_all_jobsets"] = ms_per_run(idle, watches.cpu_seconds(), n)
        finally:
            events, outcome = watches.stop()
        if outcome["failed"]:
            raise RuntimeError(
                f"the watch-reaction controller could not create the JobSets of {outcome['failed']}"
            )
        result["operator_watch_events_per_run"] = {kind: round(v / n, 2) for kind, v in events.items()}
        result["controller_errors"] = outcome["errors"]
        return result

    def _created_by_client(
        self, mode: str, ns: str, n: int, items: Sequence[tuple[str, Callable[[], Any]]]
    ) -> dict[str, Any]:
        """Runs ``items`` (the creates of a phase without the operator) and measures them as the
        operator phase is measured, up to the last JobSet seen."""
        obs = Observations()
        watchers = self.client_watches(ns, obs)
        burst = self._burst(ns, n, items, obs, timeout=300)
        codes_after = apiserver_codes(self.cluster)
        for watcher in watchers:
            watcher.stop()
        return burst.figures(mode, self.cluster, obs, codes_after)

    def client_watches(self, ns: str, obs: Observations) -> list[WatchProcess]:
        """The client's two watches of ``ns``, started, one process each (see `WatchProcess`): its
        JobSets (when each run got its JobSet) and its TPUFineTunes (when each Succeeded).

        Every phase holds both, though only the operator's waits for runs to Succeed: a watch costs
        the API server a fan-out of every event and the machine a process reading them, and until
        2026-12-05 only the operator's phase paid for the second one (see docs/benchmarks.md)."""
        watchers = [
            WatchProcess(self.cluster.kubeconfig, JOBSET.gvp, ns, obs.jobset_event),
            WatchProcess(self.cluster.kubeconfig, FINETUNE.gvp, ns, obs.finetune_event),
        ]
        for watcher in watchers:
            watcher.start()
        return watchers

    def _burst(
        self,
        ns: str,
        n: int,
        items: Sequence[tuple[str, Callable[[], Any]]],
        obs: Observations,
        *,
        timeout: float,
    ) -> Burst:
        """Sends a phase's creates from `threads` client threads and waits until its watch has seen
        N JobSets: what every phase measures the same way."""
        codes_before = apiserver_codes(self.cluster)
        audit_offset = self.cluster.layout.audit_log.stat().st_size
        sent: dict[str, float] = {}
        errors: Counter[int] = Counter()
        cpu_before = components_cpu(self.cluster)
        started = time.monotonic()
        create_all(items, sent, errors, self.threads)
        client_seconds = time.monotonic() - started
        wait_until(f"{n} JobSets", lambda: len(obs.jobset_seen) >= n, timeout)
        return Burst(
            namespace=ns,
            n=n,
            started=started,
            client_seconds=client_seconds,
            all_jobsets=max(obs.jobset_seen.values()) - started,
            cluster_cpu=cpu_between(cpu_before, components_cpu(self.cluster), n),
            sent=sent,
            errors=errors,
            codes_before=codes_before,
            audit_offset=audit_offset,
        )

    def finetune_creates(self, namespace: str, n: int) -> list[tuple[str, Callable[[], Any]]]:
        """The N TPUFineTune creates of a phase, for `create_all`."""
        custom = client.CustomObjectsApi(self.api)
        group, version, plural = FINETUNE.gvp
        return [
            (
                name,
                partial(
                    custom.create_namespaced_custom_object,
                    group,
                    version,
                    namespace,
                    plural,
                    finetune(name, namespace),
                ),
            )
            for name in names(n)
        ]

    def start_operator(self, log_name: str) -> OperatorProcess:
        """A fresh `tpuft operator` process logging to ``log_name`` in `logs`, returned once kopf's
        watches have listed."""
        process = OperatorProcess(
            self.operator_kubeconfig,
            self.logs / log_name,
            **{"TPUFT_TRAINER_IMAGE": TRAINER_IMAGE, **self.operator_settings},
        )
        process.start()
        # /healthz answers before kopf's watches are open (its first list can even get a 429 while
        # the new CRD's watch cache initializes): wait until its three lists have succeeded.
        wait_until(
            "the operator's initial lists", lambda: operator_listed(self.cluster.layout.audit_log), 120
        )
        return process

    def warm_up(self) -> None:
        """Untimed, before every phase: WARMUP_RUNS runs through the operator (`start_operator`), in
        a namespace of their own, until they have Succeeded and their last writes have landed.

        A fresh cluster's first JobSet POSTs took 0.5-0.75 s inside the API server, a warm one's
        0.1-0.2 s; and an operator that has just started has yet to open its connections and render
        its first runs. A production operator meets a burst warm, on a cluster that has served runs:
        every phase starts from this same state (the phases other than the operator's stop the
        operator first)."""
        ns = "bench-warmup"
        self.namespace(ns)
        obs = Observations()
        watcher = WatchProcess(self.cluster.kubeconfig, FINETUNE.gvp, ns, obs.finetune_event)
        watcher.start()
        create_all(self.finetune_creates(ns, WARMUP_RUNS), {}, Counter(), self.threads)
        wait_until("the warm-up runs Succeeded", lambda: len(obs.succeeded) >= WARMUP_RUNS, 300)
        watcher.stop()
        time.sleep(3)  # their last status writes and Events, before the operator counts as idle

    def phase(self, mode: str, n: int, *, profile: Path | None = None) -> dict[str, Any]:
        """One phase (`PHASES`) of N runs, after the warm-up, on this bench's cluster."""
        process = self.start_operator(f"operator-{n}-{mode}.log")  # the operator phase's log, or a warm-up's
        try:
            self.warm_up()
            if mode == "operator":
                return self.operator(n, process, profile=profile)
        finally:
            process.stop()  # the operator's phase: after its runs have Succeeded
        if mode == "direct":
            return self.direct(n)
        if mode == "zero-reaction":
            return self.zero_reaction(n)
        return self.watch_reaction(n)

    def operator(self, n: int, process: OperatorProcess, *, profile: Path | None = None) -> dict[str, Any]:
        """N runs through ``process``, the operator that ran the warm-up, until all have Succeeded."""
        ns = f"bench-operator-{n}"
        self.namespace(ns)
        audit_log = self.cluster.layout.audit_log
        assert process.process is not None
        pid = process.process.pid
        idle = proc_usage(pid)
        spy = None
        if profile is not None:
            # --gil: only the thread that holds the GIL, i.e. where the operator's CPU goes. Without
            # it the 32 workers waiting on their sockets filled the profile (SSLSocket.read).
            spy = subprocess.Popen(
                [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid), "--rate", "50", "--format", "speedscope",
                 "--output", str(profile), "--nonblocking", "--gil"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip

        log_offset = process.log_path.stat().st_size
        obs = Observations()
        watchers = self.client_watches(ns, obs)
        metrics_before = process.metrics()
        burst = self._burst(ns, n, self.finetune_creates(ns, n), obs, timeout=600)
        at_jobsets = proc_usage(pid)
        metrics_after = process.metrics()
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # the burst of creates only; py-spy writes its output on SIGINT
            spy.wait(60)
        wait_until(f"{n} runs Succeeded", lambda: len(obs.succeeded) >= n, 1500)
        all_succeeded = max(obs.succeeded.values(), default=burst.started) - burst.started
        time.sleep(3)  # late writes (events) land in the audit log
        usage = proc_usage(pid)
        metrics_end = process.metrics()
        codes_after = apiserver_codes(self.cluster)
        for watcher in watchers:
            watcher.stop()
        to_succeeded = [
            obs.succeeded[r] - obs.jobset_completed[r] for r in obs.succeeded if r in obs.jobset_completed
        ]
        return {
            **burst.figures("operator", self.cluster, obs, codes_after),
            "seconds_to_all_succeeded": round(all_succeeded, 2),
            "jobset_completed_to_succeeded": percentiles(to_succeeded),
            "jobset_completed_to_succeeded_samples": [round(v, 4) for v in sorted(to_succeeded)],
            "runs_seen_running": len(obs.running),
            # What users see of the burst (the client's TPUFineTune watch): a status at all, and
            # Running (the JobSet controller's Jobs, their pods, and the operator's status write).
            **status_lag(burst.sent, obs, burst.started),
            "runs_succeeded": len(obs.succeeded),
            "operator_api": audit_requests(audit_log, burst.audit_offset, n),
            # Until the last JobSet (the operator's /metrics): how long runs waited for a worker, and
            # how late the event loop that reads the watches ran.
            "operator_queue_wait_to_all_jobsets": histogram_between(
                metrics_before, metrics_after, "tpuft_workqueue_queue_duration_seconds"
            ),
            # From the burst to the end: how long status patches and Events waited for their turn
            # under the operator's write pace (--write-qps; pacing.py).
            "operator_write_pace_wait": histogram_between(
                metrics_before, metrics_end, "tpuft_write_pace_wait_seconds"
            ),
            "operator_loop_lag_to_all_jobsets": histogram_between(
                metrics_before, metrics_after, "tpuft_event_loop_lag_seconds"
            ),
            # ...and how long a worker was busy with each run it took (a create: render + POSTs).
            "operator_reconcile_to_all_jobsets": histogram_between(
                metrics_before, metrics_after, "tpuft_reconcile_duration_seconds"
            ),
            # urllib3's "Connection pool is full": a call beyond the client's pool, whose connection
            # was closed after it (the next call pays a TLS handshake); from the burst to the end.
            "operator_connections_discarded": logged_since(
                process.log_path, log_offset, "Connection pool is full"
            ),
            "operator_process": {
                "idle": idle,
                "at_all_jobsets": at_jobsets,
                "end": usage,
                "peak_rss_mb": usage["peak_rss_mb"],
                "cpu_seconds_under_load": round(usage["cpu_seconds"] - idle["cpu_seconds"], 2),
                "cpu_ms_per_run": ms_per_run(idle["cpu_seconds"], usage["cpu_seconds"], n),
                # From the burst's start to its last JobSet: what the machine's 2 CPUs gave the
                # operator while the API server was creating (the watch-reaction controller's too).
                "cpu_ms_per_run_to_all_jobsets": ms_per_run(
                    idle["cpu_seconds"], at_jobsets["cpu_seconds"], n
                ),
            },
        }


def phase_order(round_: int) -> tuple[str, ...]:
    """The order of round ``round_``'s phases: `PHASES` rotated by one place a round, so that over
    len(PHASES) rounds every phase runs once at every place (a Latin square). Each phase has a fresh
    cluster, so no phase inherits another's runs; the rotation spreads the machine's drift within a
    round over all of them."""
    k = round_ % len(PHASES)
    return PHASES[k:] + PHASES[:k]


def start_cluster(log: Callable[[str], None]) -> LocalCluster:
    """A fresh `bench` cluster with the operator's audit log on and POOLS v5e 2x2 node pools."""
    cluster = LocalCluster(name=CLUSTER, log=log)
    cluster.down()
    cluster.layout.root.mkdir(parents=True, exist_ok=True)
    cluster.layout.audit_policy.write_text(AUDIT_POLICY)
    cluster.up()
    nodes = cluster.add_nodepool("v5e", "2x2", slices=POOLS, prefix="bench", wait=False)
    wait_until(
        f"{len(nodes)} nodes Ready",
        lambda: cluster.kubectl(
            "get", "nodes", "-l", "type=kwok", "-o",
            'jsonpath={range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\\n"}{end}',
        ).stdout.split().count("True") >= len(nodes),
        300,
    )  # fmt: skip
    return cluster


# The operator logs of every phase, kept after the cluster is torn down.
LOGS = Path(tempfile.gettempdir()) / "tpuft-bench"


def fresh_phase(
    mode: str,
    n: int,
    *,
    threads: int = THREADS,
    profile: Path | None = None,
    keep_cluster: bool = False,
    operator_settings: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """One phase (`PHASES`) of N runs on a fresh `bench` cluster of its own (`start_cluster`), torn
    down after it unless ``keep_cluster``."""
    cluster = start_cluster(lambda line: print(f"   [cluster] {line}"))
    try:
        bench = Bench(
            cluster,
            api_client(cluster.kubeconfig),
            install_operator(cluster),
            LOGS,
            threads,
            dict(operator_settings or {}),
        )
        return bench.phase(mode, n, profile=profile)
    finally:
        if not keep_cluster:
            cluster.down()


def load_average() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def main(
    sizes: Iterable[int] = SIZES,
    *,
    repeat: int = REPEAT,
    keep_cluster: bool = False,
    profile: bool = False,
    threads: int = THREADS,
    output: Path | None = None,
) -> dict[str, Any]:
    sizes = list(sizes)
    path = results_path(output, profile=profile, threads=threads)
    load_before = load_average()
    phases: list[dict[str, Any]] = []
    # Round-robin over the sizes, `repeat` times: a slow minute of the machine then spreads over the
    # sizes instead of spoiling one; the report takes the median of the rounds per N.
    plan = [(round_, n) for round_ in range(repeat) for n in sizes]
    results: dict[str, Any] = {}
    for round_, n in plan:
        order = phase_order(round_)
        for position, mode in enumerate(order):
            print(
                f">> N={n}, round {round_ + 1} of {repeat}, phase {position + 1} of {len(order)}: {DESCRIBED[mode]},"
                f" on a fresh cluster with {POOLS} v5e 2x2 node pools"
            )
            last = (round_, n) == plan[-1] and position == len(order) - 1
            spy = (
                path.with_name(f"{path.stem}-profile-{n}.speedscope.json")
                if profile and mode == "operator" and n == max(sizes) and round_ == 0
                else None
            )
            result = fresh_phase(mode, n, threads=threads, profile=spy, keep_cluster=keep_cluster and last)
            result["round"], result["position"] = round_, position
            phases.append(result)
        by_mode = {p["mode"]: p for p in phases if p["n"] == n and p["round"] == round_}
        print(summary_line(by_mode["direct"], by_mode["operator"]))
        # Written after every round: an interrupted benchmark keeps the rounds it finished.
        results = {
            "what": "tpuft operator at scale vs direct JobSet creation, local cluster (kwok TPU nodes)",
            "machine": machine(),
            "load_average_before": load_before,
            "load_average_after": load_average(),
            "node_pools": {"type": "v5e", "topology": "2x2", "pools": POOLS, "hosts_per_pool": 1},
            "client_threads": threads,
            "rounds": repeat,
            "cluster_per_phase": True,
            "client_watches": "jobsets and tpufinetunes, every phase",  # until 2026-12-05: both in the operator's only
            # Until 2026-12-05 the yardstick controllers (zero-reaction, watch-reaction) ran as the admin.
            "yardstick_controllers_as": "the operator's ServiceAccount",
            "phases": phases,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")
    return results


def results_path(output: Path | None, *, profile: bool = False, threads: int = THREADS) -> Path:
    """Where a run's results go: ``output``, else the current results, operator.json. A variant run
    must name its own file: a profiled one (py-spy shares the cores: its numbers are slower) and one
    with other client threads (`--threads 1`: runs arriving one by one) measure something else, and
    bench/results/ holds only the current run of each benchmark."""
    if output is not None:
        return output
    if profile or threads != THREADS:
        raise ValueError("a profiled run, or one with --threads other than the default, needs --output")
    return RESULTS


def machine() -> dict[str, Any]:
    meminfo = Path("/proc/meminfo").read_text()
    total_kb = int(re.search(r"MemTotal:\s+(\d+)", meminfo).group(1))  # type: ignore[union-attr]
    model = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text())
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(total_kb / 1024 / 1024, 1),
        "cpu_model": model.group(1) if model else None,
    }


def summary_line(direct: dict[str, Any], operator: dict[str, Any]) -> str:
    d, o = direct["create_to_jobset"], operator["create_to_jobset"]
    return (
        f"   N={operator['n']}: p99 create->JobSet {o['p99']}s vs direct {d['p99']}s; "
        f"all JobSets {operator['seconds_to_all_jobsets']}s vs {direct['seconds_to_all_jobsets']}s; "
        f"writes/run {operator['operator_api']['writes_per_run']}; "
        f"peak RSS {operator['operator_process']['peak_rss_mb']} MB"
    )


def cli(argv: Sequence[str] | None = None) -> Path:
    """Runs the benchmark; returns the file its results went to (the report prints that one)."""
    parser = argparse.ArgumentParser(prog="python -m bench operator")
    parser.add_argument("--n", type=int, nargs="+", default=list(SIZES))
    parser.add_argument(
        "--repeat",
        type=int,
        default=REPEAT,
        help="rounds per N, each on a fresh cluster (the report: medians)",
    )
    parser.add_argument("--keep-cluster", action="store_true", help="leave the bench cluster running")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="py-spy the operator's CPU (the thread holding the GIL) at the largest N, from the first create "
        "to the last JobSet (speedscope JSON beside --output, which a profiled run needs: its numbers are "
        "slower and must not replace operator.json)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=THREADS,
        help=f"the client's threads, i.e. creates in flight at once (default {THREADS}: a burst; 1: runs "
        "arriving one after another, the operator's own latency without a flood to compete with; "
        "other than the default, needs --output)",
    )
    parser.add_argument(
        "--output", type=Path, default=None, help="results file (default: bench/results/operator.json)"
    )
    args = parser.parse_args(argv)
    try:
        path = results_path(args.output, profile=args.profile, threads=args.threads)
    except ValueError as e:
        parser.error(str(e))
    main(
        args.n,
        repeat=args.repeat,
        keep_cluster=args.keep_cluster,
        profile=args.profile,
        threads=args.threads,
        output=path,
    )
    return path
