"""kopf registrations and the workers they feed: the handlers only mark runs, the workers reconcile.

Three watches feed one level-triggered reconcile: the TPUFineTunes, the JobSets and the pods that
carry the run's label; a fourth, of the TPU nodes (read-only, `--watch-nodes`), marks the runs on a
node whose maintenance signals change (maintenance.py). In-memory indexes (kopf.index) hold the latest JobSet and pods of each run,
so a reconcile reads no lists from the API. Each watch event marks its run in a work queue
(workqueue.py: each run once, JobSet creation first) and returns; `--workers` threads reconcile the
marked runs from the indexes. A fifth watch, of Kueue's Workloads, tells a queued run why it waits
(queueing.py); without Kueue installed it has nothing to watch (kopf starts it if the CRD appears).
No handler stores progress on the object and no finalizer is added:
deleting a TPUFineTune is never blocked, even with the operator down.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import kopf

from tpuft_operator import maintenance, metrics, queueing
from tpuft_operator.api.resources import FINETUNE, JOBSET, NODE, POD, WORKLOAD
from tpuft_operator.k8s import ApiError, controller_uid
from tpuft_operator.reconcile import Reconciler
from tpuft_operator.render.jobset import FINETUNE_LABEL, FINETUNE_UID_LABEL
from tpuft_operator.render.naming import label_value
from tpuft_operator.settings import OperatorSettings
from tpuft_operator.slim import slim_finetune, slim_jobset, slim_pod
from tpuft_operator.status import is_final
from tpuft_operator.topology import ACCELERATOR_LABEL
from tpuft_operator.workqueue import WorkQueue

FINETUNES = FINETUNE.gvp
JOBSETS = JOBSET.gvp
PODS = POD.gvp
WORKLOADS = WORKLOAD.gvp
NODES = NODE.gvp
OWNED = {FINETUNE_LABEL: kopf.PRESENT}
TPU_NODES = {ACCELERATOR_LABEL: kopf.PRESENT}

Key = tuple[str, str]
K = TypeVar("K")
# An indexed object, reduced to what the reconcile reads (slim.py).
Slim = dict[str, Any]

_log = logging.getLogger("tpuft.workers")


def _event_sink(body: Mapping[str, Any]) -> Any:
    # kopf.event needs only apiVersion, kind and metadata (name, namespace, uid): a slim body will do.
    def post(type_: str, reason: str, message: str) -> None:
        kopf.event(cast(kopf.Body, body), type=type_, reason=reason, message=message[:1024])

    return post


def _latest(index: kopf.Index[K, Slim], key: K) -> Slim | None:
    store = index.get(key)
    return next(iter(store), None) if store else None


def _jobset_of(jobset_index: kopf.Index[Key, Slim], index_key: Key, finetune: Slim) -> Slim | None:
    """The run's JobSet from the index: the one it controls when two runs' labels collide (a name
    of 64+ characters is indexed by prefix + hash, which another run may take as its name)."""
    store = list(jobset_index.get(index_key) or [])
    uid = finetune["metadata"].get("uid")
    return next((js for js in store if controller_uid(js) == uid), store[0] if store else None)


def _owners(finetune_index: kopf.Index[Key, Slim], namespace: str, labels: Mapping[str, str]) -> list[Slim]:
    """The run(s) a child's labels point to: by the uid label when the run label is shared."""
    store = list(finetune_index.get((namespace, labels[FINETUNE_LABEL])) or [])
    uid = labels.get(FINETUNE_UID_LABEL)
    exact = [ft for ft in store if uid is not None and ft["metadata"].get("uid") == uid]
    return exact or store


def _needs_jobset(jobset_index: kopf.Index[Key, Slim], index_key: Key) -> bool:
    """A run with no JobSet (yet, or any more) is queued ahead of status work: creating it is what
    the user waits for."""
    return _latest(jobset_index, index_key) is None


def _nodes_of(pods: list[Slim], node_index: kopf.Index[str, Slim] | None) -> dict[str, Slim]:
    """The indexed nodes the pods run on, by name."""
    if node_index is None:
        return {}
    nodes = {}
    for pod in pods:
        name = (pod.get("spec") or {}).get("nodeName")
        if name and (node := _latest(node_index, name)) is not None:
            nodes[name] = node
    return nodes


def _run(
    memo: kopf.Memo,
    finetune: Mapping[str, Any],
    jobset: Mapping[str, Any] | None,
    pod_index: kopf.Index[Key, Slim],
    node_index: kopf.Index[str, Slim] | None,
    logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
    workload_index: kopf.Index[Key, Slim] | None = None,
) -> None:
    key = (finetune["metadata"]["namespace"], label_value(finetune["metadata"]["name"]))
    reconciler: Reconciler = memo.reconciler
    pods = list(pod_index.get(key, []))
    workload = None
    if jobset is not None and workload_index is not None:
        candidates = list(workload_index.get((key[0], jobset["metadata"]["name"])) or [])
        workload = queueing.workload_of(candidates, jobset)
    try:
        reconciler.reconcile(
            finetune,
            jobset,
            pods,
            event=_event_sink(finetune),
            nodes=_nodes_of(pods, node_index),
            workload=workload,
            logger=logger,
        )
    except ApiError as error:
        # Nothing re-queues a failed reconcile at once; the resync loop retries within resync_seconds.
        metrics.API_ERRORS.labels(status=str(error.status)).inc()
        if error.retryable:
            logger.warning("%s; retrying at the next resync", error)
        else:
            logger.error("%s; a retry cannot fix this (check the operator's RBAC and the spec)", error)


@dataclass
class Dispatch:
    """What the handlers, the worker threads and the resync loop share.

    The handlers only mark runs in ``queue`` (workqueue.py); ``workers`` threads reconcile them from
    the indexes. kopf gives each resource its own shallow copy of the memo, so an attribute set on
    ``memo`` in a handler would be invisible elsewhere; this one object is shared by all the copies.
    """

    queue: WorkQueue = field(default_factory=WorkQueue)
    indexes: tuple[kopf.Index[Key, Slim], ...] | None = None
    nodes: kopf.Index[str, Slim] | None = None  # with --watch-nodes
    workloads: kopf.Index[Key, Slim] | None = None  # Kueue's, by (namespace, JobSet name)
    # The run of each JobSet, (namespace, JobSet name) -> run name: a Workload names only its JobSet.
    jobset_runs: dict[Key, str] = field(default_factory=dict)
    # The maintenance signals last seen per node: only a change marks the runs on it.
    node_signals: dict[str, maintenance.NodeSignals] = field(default_factory=dict)
    loop: asyncio.AbstractEventLoop | None = None
    kopf_settings: kopf.OperatorSettings | None = None
    # kopf.event() finds kopf's event queue in context variables that kopf sets in the tasks that
    # process watch events (not yet at start-up): the first handler call lends its context to all.
    context: contextvars.Context | None = None
    resync_task: asyncio.Task[None] | None = None

    def mark(self, key: Key, indexes: Mapping[str, Any], *, urgent: bool = False) -> None:
        """Called by the handlers, on the event loop: run ``key`` needs a reconcile.

        ``indexes`` are the handler's keyword arguments: kopf passes the indexes only to handlers,
        so the first handler call hands them to the workers."""
        if self.indexes is None:
            self.indexes = (indexes["finetunes"], indexes["jobsets"], indexes["pods"])
        if self.nodes is None and "nodes" in indexes:
            self.nodes = indexes["nodes"]
        if self.workloads is None and "workloads" in indexes:
            self.workloads = indexes["workloads"]
        if self.context is None:
            self.context = contextvars.copy_context()
        self.queue.add(key, urgent=urgent)

    def defer(self, key: Key, delay: float) -> None:
        """Marks run ``key`` (namespace, name) again in ``delay`` seconds. Safe from any thread."""
        loop = self.loop
        if loop is not None:
            mark = functools.partial(self.queue.add, key)
            loop.call_soon_threadsafe(lambda: loop.call_later(delay, mark))

    def start_workers(self, memo: kopf.Memo, count: int) -> None:
        metrics.QUEUE_DEPTH.set_function(lambda: len(self.queue))
        # Daemons: `queue.close()` at cleanup wakes each one to exit, and none holds up a shutdown.
        for number in range(count):
            threading.Thread(target=_work, args=(memo,), name=f"tpuft-worker-{number}", daemon=True).start()


def _work(memo: kopf.Memo) -> None:
    """One worker thread: reconcile marked runs until the queue closes."""
    state: Dispatch = memo.dispatch
    while (key := state.queue.get()) is not None:
        try:
            # A copy each time: one Context cannot be entered by two threads at once.
            context = state.context.copy() if state.context else contextvars.Context()
            context.run(reconcile_from_indexes, memo, key)
        except Exception:  # a bug must not kill the worker; the resync loop retries the run
            _log.exception("reconcile of %s/%s failed; retrying at the next resync", *key)
        finally:
            state.queue.done(key)


def reconcile_from_indexes(memo: kopf.Memo, key: Key) -> None:
    """One reconcile of run ``key`` (namespace, name) from the latest indexed objects."""
    state: Dispatch = memo.dispatch
    if state.indexes is None or state.kopf_settings is None:
        return
    finetune_index, jobset_index, pod_index = state.indexes
    index_key = (key[0], label_value(key[1]))
    store: list[Slim] = list(finetune_index.get(index_key) or [])
    finetune = next((ft for ft in store if ft["metadata"]["name"] == key[1]), None)
    if finetune is None:
        return  # deleted meanwhile
    logger = kopf.LocalObjectLogger(body=cast(kopf.Body, finetune), settings=state.kopf_settings)
    jobset = _jobset_of(jobset_index, index_key, finetune)
    _run(memo, finetune, jobset, pod_index, state.nodes, logger, state.workloads)


async def _resync_forever(memo: kopf.Memo, interval: float) -> None:
    """A safety net instead of kopf timers (which would add a finalizer to every run): every
    ``interval`` seconds, mark each unfinished run, so a missed event or a failed API call heals
    without anyone touching the object."""
    state: Dispatch = memo.dispatch
    while True:
        await asyncio.sleep(interval)
        if state.indexes is None:
            continue
        finetune_index, jobset_index, _ = state.indexes
        for index_key in list(finetune_index):
            for finetune in list(finetune_index.get(index_key) or []):  # two, when labels collide
                jobset = _jobset_of(jobset_index, index_key, finetune)
                if is_final(finetune, jobset):
                    continue  # (a terminal phase written by hand next to a running JobSet is not final)
                name = str(finetune["metadata"]["name"])
                state.queue.add((index_key[0], name), urgent=jobset is None)


def build_registry(operator_settings: OperatorSettings) -> kopf.OperatorRegistry:
    """All handlers, registered on a fresh registry (so settings apply and tests can build their own)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # In a pod: the ServiceAccount token; elsewhere: $KUBECONFIG (set from --kubeconfig).
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    # The index functions are async so that they run on the event loop at once: sync ones would wait
    # for a worker thread behind every queued reconcile, and the indexes would lag the API by seconds.
    @kopf.index(*FINETUNES, id="finetunes", registry=registry)
    async def finetunes(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[Key, Slim]:
        # Keyed by the label value the children carry (a hash for names longer than 63 characters).
        return {(str(namespace), label_value(name)): slim_finetune(body)}

    @kopf.index(*JOBSETS, labels=OWNED, id="jobsets", registry=registry)
    async def jobsets(
        namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
    ) -> dict[Key, Slim]:
        return {(str(namespace), labels[FINETUNE_LABEL]): slim_jobset(body)}

    @kopf.index(*PODS, labels=OWNED, id="pods", registry=registry)
    async def pods(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Key, Slim]:
        return {(str(namespace), labels[FINETUNE_LABEL]): slim_pod(body)}

    # The indexes arrive as keyword arguments named after the index functions above. The handlers
    # are async and only mark the run: they return at once, and the workers reconcile.
    @kopf.on.event(*FINETUNES, registry=registry)
    async def finetune_event(type: str, body: kopf.Body, memo: kopf.Memo, **kw: Any) -> None:
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        if type == "DELETED":
            memo.reconciler.forget((namespace, name))
            return
        urgent = _needs_jobset(kw["jobsets"], (namespace, label_value(name)))
        memo.dispatch.mark((namespace, name), kw, urgent=urgent)

    @kopf.on.event(*JOBSETS, labels=OWNED, registry=registry)
    async def jobset_event(
        type: str, namespace: str | None, name: str, labels: kopf.Labels, memo: kopf.Memo, **kw: Any
    ) -> None:
        state: Dispatch = memo.dispatch
        for owner in _owners(kw["finetunes"], str(namespace), labels):
            key = (str(namespace), str(owner["metadata"]["name"]))
            state.jobset_runs[(str(namespace), name)] = key[1]
            if type == "DELETED":
                state.jobset_runs.pop((str(namespace), name), None)
                memo.reconciler.jobset_deleted(key)
            memo.dispatch.mark(key, kw, urgent=type == "DELETED")  # a deleted JobSet is recreated

    @kopf.on.event(*PODS, labels=OWNED, registry=registry)
    async def pod_event(namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **kw: Any) -> None:
        for owner in _owners(kw["finetunes"], str(namespace), labels):
            memo.dispatch.mark((str(namespace), str(owner["metadata"]["name"])), kw)

    if operator_settings.watch_workloads:
        # Kueue's Workloads (of JobSets): a queued run's status says why it waits, and its admission
        # and eviction become Events. Indexed by the JobSet that owns each.
        @kopf.index(*WORKLOADS, registry=registry, id="workloads")
        async def workloads(namespace: str | None, body: kopf.Body, **_: Any) -> dict[Key, Slim] | None:
            owner = queueing.workload_owner(body)
            return {(str(namespace), owner[0]): queueing.slim_workload(body)} if owner else None

        @kopf.on.event(*WORKLOADS, registry=registry)
        async def workload_event(namespace: str | None, body: kopf.Body, memo: kopf.Memo, **kw: Any) -> None:
            state: Dispatch = memo.dispatch
            owner = queueing.workload_owner(body)
            run = state.jobset_runs.get((str(namespace), owner[0])) if owner else None
            if run is not None:
                state.mark((str(namespace), run), kw)

    if operator_settings.watch_nodes:

        @kopf.index(*NODES, labels=TPU_NODES, id="nodes", registry=registry)
        async def nodes(name: str, body: kopf.Body, **_: Any) -> dict[str, Slim]:
            return {name: maintenance.slim_node(body)}

        @kopf.on.event(*NODES, labels=TPU_NODES, registry=registry)
        async def node_event(type: str, name: str, body: kopf.Body, memo: kopf.Memo, **kw: Any) -> None:
            state: Dispatch = memo.dispatch
            signals = maintenance.node_signals(body) if type != "DELETED" else maintenance.NodeSignals(name)
            if state.node_signals.get(name, maintenance.NodeSignals(name)) == signals:
                return  # a heartbeat or another change that is not about maintenance
            state.node_signals[name] = signals
            if type == "DELETED":
                state.node_signals.pop(name, None)
            for (namespace, label), pods in kw["pods"].items():
                if any((pod.get("spec") or {}).get("nodeName") == name for pod in pods):
                    for owner in kw["finetunes"].get((namespace, label)) or []:
                        state.mark((namespace, str(owner["metadata"]["name"])), kw)

    @kopf.on.startup(registry=registry)
    async def start_workers(memo: kopf.Memo, settings: kopf.OperatorSettings, **_: Any) -> None:
        state: Dispatch = memo.dispatch
        state.loop = asyncio.get_running_loop()
        state.kopf_settings = settings
        memo.reconciler.defer = state.defer
        state.start_workers(memo, operator_settings.workers)
        state.resync_task = asyncio.create_task(_resync_forever(memo, operator_settings.resync_seconds))

    @kopf.on.cleanup(registry=registry)
    async def stop_workers(memo: kopf.Memo, **_: Any) -> None:
        state: Dispatch = memo.dispatch
        if state.resync_task is not None:
            state.resync_task.cancel()
        state.queue.close()

    return registry
