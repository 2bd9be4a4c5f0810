"""The worker runtime: from watch events to reconciles, off the event loop.

The watches (watches.py: the TPUFineTunes, their JobSets and pods, the TPU nodes and Kueue's
Workloads) hand each event to a `Runtime.on_*` method, on the event loop; it only *marks* the runs the event concerns in the work queue (workqueue.py: each run waits
once, runs that need their JobSet first) and returns. `workers` threads take marked runs and
reconcile each from the watches' latest objects (`Views`) as they are by then; they start once every
watch has listed. A resync task marks every unfinished run every `resync_seconds` (a missed event or a
failed API call heals without anyone touching the object) and drops the state of runs that are gone.

    watch events --> Runtime.on_* --> WorkQueue ------> worker threads --> Reconciler --> k8s.Api
    (one event loop)     mark        (urgent first)    Views.observe       decide, act
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar, cast

import kopf

from tpuft_operator import maintenance, metrics, queueing
from tpuft_operator.k8s import ApiError, controller_uid
from tpuft_operator.pacing import WritePace
from tpuft_operator.reconcile import Reconciler
from tpuft_operator.render.jobset import FINETUNE_LABEL, FINETUNE_UID_LABEL
from tpuft_operator.render.naming import label_value
from tpuft_operator.status import is_final
from tpuft_operator.watches import FINETUNES, JOBS, JOBSETS, NODES, PODS, WORKLOADS, Watches
from tpuft_operator.workqueue import WorkQueue

Key = tuple[str, str]  # (namespace, name) of a TPUFineTune
K = TypeVar("K")
# An indexed object, reduced to what the reconcile reads (slim.py).
Slim = dict[str, Any]

_log = logging.getLogger("tpuft.workers")


def _latest(index: Mapping[K, Any], key: K) -> Slim | None:
    store = index.get(key)
    return next(iter(store), None) if store else None


@dataclass
class Observation:
    """What the watches show of one run, as one reconcile reads it."""

    finetune: Slim
    jobset: Slim | None
    pods: list[Slim]
    nodes: dict[str, Slim]  # the nodes its pods run on, by name
    workload: Mapping[str, Any] | None  # Kueue's Workload of its JobSet
    prepare_job: Slim | None = None  # its prepare Job (render/prepare_job.py)


@dataclass
class Views:
    """What the reconcile reads of the watches (watches.py' stores), keyed by (namespace, the run
    label's value), but the nodes by ("", name) and the Workloads by (namespace, their JobSet)."""

    finetunes: Mapping[Key, list[Slim]]
    jobsets: Mapping[Key, list[Slim]]
    pods: Mapping[Key, list[Slim]]
    nodes: Mapping[Key, list[Slim]] | None = None  # with --watch-nodes, by ("", node name)
    workloads: Mapping[Key, list[Slim]] | None = None  # Kueue's, by (namespace, JobSet name)
    jobs: Mapping[Key, list[Slim]] | None = None  # the prepare Jobs

    def finetune(self, key: Key) -> Slim | None:
        store: list[Slim] = list(self.finetunes.get((key[0], label_value(key[1]))) or [])
        return next((ft for ft in store if ft["metadata"]["name"] == key[1]), None)

    def jobset_of(self, finetune: Mapping[str, Any]) -> Slim | None:
        """The run's JobSet: the one it controls when two runs' labels collide (a name of 64+
        characters is indexed by prefix + hash, which another run may take as its name)."""
        meta = finetune["metadata"]
        store = list(self.jobsets.get((meta["namespace"], label_value(meta["name"]))) or [])
        return next(
            (js for js in store if controller_uid(js) == meta.get("uid")), store[0] if store else None
        )

    def owners(self, namespace: str, labels: Mapping[str, str]) -> list[Slim]:
        """The run(s) a child's labels point to: by the uid label when the run label is shared."""
        store = list(self.finetunes.get((namespace, labels[FINETUNE_LABEL])) or [])
        uid = labels.get(FINETUNE_UID_LABEL)
        exact = [ft for ft in store if uid is not None and ft["metadata"].get("uid") == uid]
        return exact or store

    def observe(self, key: Key) -> Observation | None:
        """Everything the reconcile of run ``key`` reads; None if the run is gone."""
        finetune = self.finetune(key)
        if finetune is None:
            return None
        jobset = self.jobset_of(finetune)
        jobs = list((self.jobs or {}).get((key[0], label_value(key[1]))) or [])
        prepare_job = next(
            (job for job in jobs if controller_uid(job) == finetune["metadata"].get("uid")), None
        )
        pods = list(self.pods.get((key[0], label_value(key[1]))) or [])
        nodes: dict[str, Slim] = {}
        if self.nodes is not None:
            for pod in pods:
                node_name = (pod.get("spec") or {}).get("nodeName")
                if node_name and (node := _latest(self.nodes, ("", node_name))) is not None:
                    nodes[node_name] = node
        workload = None
        if jobset is not None and self.workloads is not None:
            candidates = list(self.workloads.get((key[0], jobset["metadata"]["name"])) or [])
            workload = queueing.workload_of(candidates, jobset)
        return Observation(finetune, jobset, pods, nodes, workload, prepare_job)


# The longest a Normal Event waits for a burst of JobSet creation to end. A burst of 1000 runs lasts
# 15-20 s on the benchmark machine: with a 5 s hold ~240 Events were POSTed while JobSets still
# waited (`python -m bench operator`, its audit log); an Event half a minute late costs no one.
EVENT_HOLD_SECONDS = 60.0
# The threads that post Events (EventPoster): enough that a run's Events keep up with its status.
EVENT_POSTER_THREADS = 4

# An Event as it waits: (involved object, type "Normal"/"Warning", reason, message, when it happened);
# `PostEvent` takes the same and posts it as a Kubernetes Event (k8s.Api).
EventItem = tuple[Mapping[str, Any], str, str, str, datetime]
PostEvent = Callable[[Mapping[str, Any], str, str, str, datetime], None]


class EventPoster:
    """Posts the reconciles' Events from threads of its own.

    A worker that posted its run's Events itself waited a round trip for each: under a burst of
    creates the JobSetCreated Event alone doubled the time a worker spent on a new run, while the run
    waiting behind it had no JobSet yet. Events carry the time they happened (not when they were
    posted), so `kubectl describe` orders them right although several threads post them. Bounded:
    past `limit` Events waiting in either queue below (an apiserver down for long) new ones are
    dropped, and logged.

        Normal  --> held --> gate thread: waits while JobSets are being created --+
        Warning ---------------------------------------------------------------- ready --> posting threads

    One gate holds every Normal Event (in order), so no posting thread sits waiting for a burst to
    end while a Warning queues behind it."""

    def __init__(
        self,
        post: PostEvent,
        *,
        threads: int = EVENT_POSTER_THREADS,
        limit: int = 10_000,
        wait_quiet: Callable[[float], object] = lambda seconds: True,
        hold_seconds: float = EVENT_HOLD_SECONDS,
        pace: WritePace | None = None,
    ) -> None:
        """``wait_quiet(seconds)``: returns when JobSets are no longer being created, or after
        ``seconds`` (`WorkQueue.wait_quiet`). A Normal Event waits for it, at most ``hold_seconds``
        after it happened: its POST would compete with the creates. Warnings (a recreated JobSet, a
        refusal, a failure) are posted at once. ``pace``: the write pace each post takes its turn in
        (pacing.py), shared with the status patches."""
        self._post = post
        self._pace = pace or WritePace(0, 1)
        self._wait_quiet, self._hold = wait_quiet, hold_seconds
        self._threads = threads
        self._held: queue.Queue[EventItem | None] = queue.Queue(limit)
        self._ready: queue.Queue[EventItem | None] = queue.Queue(limit)
        self._started = False

    def __call__(self, involved: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        waiting = self._held if type_ == "Normal" else self._ready  # a Warning never waits
        try:
            waiting.put_nowait((involved, type_, reason, message, datetime.now(UTC)))
        except queue.Full:
            _log.warning(
                "dropped the %s Event of %s: too many Events wait to be posted", reason, _name(involved)
            )

    def start(self) -> None:
        if not self._started:
            self._started = True
            threading.Thread(target=self._gate, name="tpuft-events-gate", daemon=True).start()
            for number in range(self._threads):
                threading.Thread(target=self._run, name=f"tpuft-events-{number}", daemon=True).start()

    def stop(self) -> None:
        with contextlib.suppress(queue.Full):
            self._held.put_nowait(None)
        for _ in range(self._threads):
            with contextlib.suppress(queue.Full):
                self._ready.put_nowait(None)

    def _gate(self) -> None:
        while (item := self._held.get()) is not None:
            hold = self._hold - (datetime.now(UTC) - item[4]).total_seconds()
            if hold > 0:  # returns at once when no burst is going on
                self._wait_quiet(hold)
            self._ready.put(item)  # blocks while the posting threads are behind: `held` then fills

    def _run(self) -> None:
        while (item := self._ready.get()) is not None:
            try:
                metrics.observe_write_pace("event", self._pace.wait())
                self._post(*item)
            except Exception:  # best effort: an Event is never worth a dead poster
                _log.exception("posting the %s Event of %s failed", item[2], _name(item[0]))


def _name(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}"


def api_connections(workers: int) -> int:
    """The connections the operator's API client keeps open: one for every thread that may call at
    once (the workers, the Event posters, and two for the calls of threads that come and go: a
    namespace's ServiceAccount create). A call beyond the pool gets a connection of its own that is
    closed after it, so the next one pays a new TLS handshake: with the pool sized for the workers
    alone, the operator of each 1000-run benchmark phase logged 4-10 "Connection pool is full", all
    once the Events were posted alongside the workers' status patches."""
    return workers + EVENT_POSTER_THREADS + 2


class Runtime:
    """The watches, the work queue, the worker threads and the resync loop; one per operator process."""

    def __init__(
        self,
        *,
        workers: int,
        resync_seconds: float,
        watches: Watches | None = None,
        post_event: PostEvent = lambda obj, type_, reason, message, at: None,
        pace: WritePace | None = None,
    ) -> None:
        """``pace``: the write pace of the Events (pacing.py); hand the Reconciler the same one."""
        self.workers = workers
        self.resync_seconds = resync_seconds
        self.watches = watches or Watches()
        self.queue = WorkQueue(waited=metrics.observe_queue_wait)
        self.events = EventPoster(post_event, wait_quiet=self.queue.wait_quiet, pace=pace)
        w = self.watches
        self.views = Views(w.finetunes, w.jobsets, w.pods, w.nodes, w.workloads, w.jobs)
        self.reconciler: Reconciler | None = None
        # The run of each JobSet, (namespace, JobSet name) -> run name: a Workload names only its JobSet.
        self._jobset_runs: dict[Key, str] = {}
        # The maintenance signals last seen per node: only a change marks the runs on it.
        self._node_signals: dict[str, maintenance.NodeSignals] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kopf_settings: kopf.OperatorSettings | None = None
        self._resync: asyncio.Task[None] | None = None
        self._lag_probe: asyncio.Task[None] | None = None

    # -- life cycle (kopf's startup and cleanup handlers) --

    def start(self, reconciler: Reconciler, settings: kopf.OperatorSettings) -> None:
        """Starts the watches, the workers and the resync loop; called on the event loop."""
        self.reconciler = reconciler
        self._loop = asyncio.get_running_loop()
        self._kopf_settings = settings
        metrics.QUEUE_DEPTH.set_function(lambda: len(self.queue))
        self.watches.start(
            settings,
            {
                FINETUNES: self.on_finetune,
                JOBSETS: lambda type_, obj: self.on_jobset(type_, *_name_and_labels(obj)),
                PODS: lambda type_, obj: self.on_pod(str(obj["metadata"]["namespace"]), _labels(obj)),
                # A prepare Job's change marks its run, as a pod's does.
                JOBS: lambda type_, obj: self.on_pod(str(obj["metadata"]["namespace"]), _labels(obj)),
                NODES: lambda type_, obj: self.on_node(type_, str(obj["metadata"]["name"]), obj),
                WORKLOADS: lambda type_, obj: self.on_workload(str(obj["metadata"]["namespace"]), obj),
            },
        )
        self.events.start()
        # Daemons: `queue.close()` at cleanup wakes each one to exit, and none holds up a shutdown.
        for number in range(self.workers):
            threading.Thread(target=self._work, name=f"tpuft-worker-{number}", daemon=True).start()
        self._resync = asyncio.create_task(self._resync_forever())
        self._lag_probe = asyncio.create_task(probe_loop_lag(metrics.EVENT_LOOP_LAG_SECONDS.observe))

    def stop(self) -> None:
        self.watches.stop()
        self.events.stop()
        for task in (self._resync, self._lag_probe):
            if task is not None:
                task.cancel()
        self.queue.close()

    # -- watch events, on the event loop: each marks the runs it concerns --

    def on_finetune(self, type_: str, body: Mapping[str, Any]) -> None:
        if type_ == "DELETED":
            if self.reconciler is not None:
                self.reconciler.forget(body)
            return
        meta = body["metadata"]
        key = (str(meta["namespace"]), str(meta["name"]))
        self.queue.add(key, urgent=self.needs_jobset(body))

    def needs_jobset(self, finetune: Mapping[str, Any]) -> bool:
        """Whether run ``finetune`` has no JobSet (yet, or any more): its reconcile then goes first,
        creating it is what the user waits for. Neither the JobSet watch's store nor this process
        must know one: under a burst the store lags the API by seconds, and a resync in that window
        took ~200 of 1000 runs whose JobSets existed as urgent; each wrote the run's first status
        in the middle of the burst, ahead of the runs still waiting (`python -m bench operator`)."""
        if self.views.jobset_of(finetune) is not None:
            return False
        return self.reconciler is None or not self.reconciler.has_jobset(finetune)

    def on_jobset(self, type_: str, namespace: str, name: str, labels: Mapping[str, str]) -> None:
        for owner in self.views.owners(namespace, labels):
            key = (namespace, str(owner["metadata"]["name"]))
            if type_ == "DELETED":
                self._jobset_runs.pop((namespace, name), None)
                if self.reconciler is not None:
                    self.reconciler.jobset_deleted(owner)
            else:
                self._jobset_runs[(namespace, name)] = key[1]
            self.queue.add(key, urgent=type_ == "DELETED")  # a deleted JobSet is recreated

    def on_pod(self, namespace: str, labels: Mapping[str, str]) -> None:
        for owner in self.views.owners(namespace, labels):
            self.queue.add((namespace, str(owner["metadata"]["name"])))

    def on_workload(self, namespace: str, body: Mapping[str, Any]) -> None:
        owner = queueing.workload_owner(body)
        run = self._jobset_runs.get((namespace, owner[0])) if owner else None
        if run is not None:
            self.queue.add((namespace, run))

    def on_node(self, type_: str, name: str, body: Mapping[str, Any]) -> None:
        """Marks the runs on a node whose maintenance signals changed (not at every heartbeat)."""
        signals = maintenance.node_signals(body) if type_ != "DELETED" else maintenance.NodeSignals(name)
        if self._node_signals.get(name, maintenance.NodeSignals(name)) == signals:
            return
        self._node_signals[name] = signals
        if type_ == "DELETED":
            self._node_signals.pop(name, None)
        for namespace, label in list(self.views.pods):
            pods = self.views.pods.get((namespace, label)) or []
            if any((pod.get("spec") or {}).get("nodeName") == name for pod in pods):
                for owner in self.views.finetunes.get((namespace, label)) or []:
                    self.queue.add((namespace, str(owner["metadata"]["name"])))

    def defer(self, key: Key, delay: float) -> None:
        """Marks run ``key`` again in ``delay`` seconds. Safe from any thread (the Reconciler's `defer`)."""
        loop = self._loop
        if loop is not None:
            mark = functools.partial(self.queue.add, key)
            loop.call_soon_threadsafe(lambda: loop.call_later(delay, mark))

    # -- the worker threads and the resync loop --

    def _work(self) -> None:
        """One worker thread: reconcile marked runs until the queue closes."""
        self.watches.listed.wait()  # a run whose JobSet is not listed yet would look as if it had none
        while (key := self.queue.get()) is not None:
            try:
                self.reconcile(key)
            except Exception:  # a bug must not kill the worker; the resync loop retries the run
                _log.exception("reconcile of %s/%s failed; retrying at the next resync", *key)
            finally:
                self.queue.done(key)

    def reconcile(self, key: Key) -> None:
        """One reconcile of run ``key`` from the latest indexed objects."""
        if self.views is None or self._kopf_settings is None or self.reconciler is None:
            return
        seen = self.views.observe(key)
        if seen is None:
            return  # deleted meanwhile
        finetune = cast(kopf.Body, seen.finetune)
        logger = kopf.LocalObjectLogger(body=finetune, settings=self._kopf_settings)
        creating, started = self.needs_jobset(seen.finetune), time.perf_counter()
        try:
            self.reconciler.reconcile(
                seen.finetune,
                seen.jobset,
                seen.pods,
                event=functools.partial(self.events, seen.finetune),
                nodes=seen.nodes,
                workload=seen.workload,
                prepare_job=seen.prepare_job,
                logger=logger,
            )
        except ApiError as error:
            # Nothing re-queues a failed reconcile at once; the resync loop retries within resync_seconds.
            metrics.API_ERRORS.labels(status=str(error.status)).inc()
            if error.retryable:
                logger.warning("%s; retrying at the next resync", error)
            else:
                logger.error("%s; a retry cannot fix this (check the operator's RBAC and the spec)", error)
        finally:
            metrics.observe_reconcile(time.perf_counter() - started, creating)

    async def _resync_forever(self) -> None:
        """A safety net instead of kopf timers (which would add a finalizer to every run).

        A resync that falls in a burst of JobSet creates waits for its end (at most another resync
        period): it marks every run, and ~1000 reconciles of runs that have their JobSet would compete
        with the creates. With the write pace on, each of those was cheap (it took a turn and returned),
        so the two workers a burst leaves to other work got through all of them: in the bursts of 1000
        runs a resync fell in, the operator made 1355-1648 such reconciles before its last JobSet
        (4-183 in the others) and create -> JobSet p99 was 4.0-4.3 s instead of 1.8-2.8 s
        (`python -m bench pace`, docs/benchmarks.md). A run whose create failed mid-burst is retried
        once the burst is over; failing creates leave nothing waiting, so they make no burst."""
        while True:
            await asyncio.sleep(self.resync_seconds)
            await asyncio.to_thread(self.queue.wait_quiet, self.resync_seconds)
            self.resync()

    def resync(self) -> None:
        """Marks every unfinished run, and drops the state of runs the watch no longer holds."""
        if self.views is None:
            return
        started = time.monotonic()
        uids = []
        for index_key in list(self.views.finetunes):
            for finetune in list(self.views.finetunes.get(index_key) or []):  # two, when labels collide
                uids.append(str(finetune["metadata"].get("uid")))
                jobset = self.views.jobset_of(finetune)
                if is_final(finetune, jobset):
                    continue  # (a terminal phase written by hand next to a running JobSet is not final)
                name = str(finetune["metadata"]["name"])
                self.queue.add((index_key[0], name), urgent=self.needs_jobset(finetune))
        if self.reconciler is not None:
            self.reconciler.forget_all_but(uids, seen_before=started)


# How often the event loop's lag is probed (`probe_loop_lag`): ten wake-ups a second cost nothing.
LAG_PROBE_SECONDS = 0.1


async def probe_loop_lag(observe: Callable[[float], None], every: float = LAG_PROBE_SECONDS) -> None:
    """Reports, every ``every`` seconds, how much later than due the event loop woke this task: the
    watches' events wait that long too. The loop shares the GIL with the worker threads, so a busy
    worker pool shows here before it shows anywhere else (`tpuft_event_loop_lag_seconds`)."""
    while True:
        due = time.monotonic() + every
        await asyncio.sleep(every)
        observe(max(0.0, time.monotonic() - due))


def _name_and_labels(obj: Mapping[str, Any]) -> tuple[str, str, Mapping[str, str]]:
    meta = obj["metadata"]
    return str(meta["namespace"]), str(meta["name"]), _labels(obj)


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return obj["metadata"].get("labels") or {}
