"""kopf registrations, and nothing else: every handler is a few lines calling the Reconciler.

Three watches feed one level-triggered reconcile: the TPUFineTunes, the JobSets and the pods that
carry the run's label. In-memory indexes (kopf.index) hold the latest JobSet and pods of each run,
so a reconcile reads no lists from the API. No handler stores progress on the object and no
finalizer is added: deleting a TPUFineTune is never blocked, even with the operator down.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import kopf

from tpuft_operator import metrics
from tpuft_operator.k8s import ApiError
from tpuft_operator.reconcile import Reconciler
from tpuft_operator.render.jobset import FINETUNE_LABEL
from tpuft_operator.render.naming import label_value
from tpuft_operator.settings import OperatorSettings
from tpuft_operator.status import JOBSET_UID_LABEL, RESTART_ATTEMPT_LABEL, is_final

FINETUNES = ("tpuft.dev", "v1alpha1", "tpufinetunes")
JOBSETS = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
PODS = ("", "v1", "pods")
OWNED = {FINETUNE_LABEL: kopf.PRESENT}

Key = tuple[str, str]
# An indexed object, reduced to what the reconcile reads (slim_finetune, slim_jobset, slim_pod).
Slim = dict[str, Any]


def _event_sink(body: Mapping[str, Any]) -> Any:
    # kopf.event needs only apiVersion, kind and metadata (name, namespace, uid): a slim body will do.
    def post(type_: str, reason: str, message: str) -> None:
        kopf.event(cast(kopf.Body, body), type=type_, reason=reason, message=message[:1024])

    return post


# What the reconcile reads of each kind (status.py, reconcile.py). The indexes keep only this: full
# bodies (managedFields, last-applied annotations, pod specs) cost ~0.3 MB per run at scale.
def slim_finetune(body: Mapping[str, Any]) -> dict[str, Any]:
    meta = body.get("metadata") or {}
    keep = (
        "name",
        "namespace",
        "uid",
        "generation",
        "resourceVersion",
        "deletionTimestamp",
        "creationTimestamp",
    )
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": {k: meta[k] for k in keep if k in meta},
        "spec": body.get("spec") or {},
        "status": body.get("status") or {},
    }


def slim_jobset(body: Mapping[str, Any]) -> dict[str, Any]:
    meta = body.get("metadata") or {}
    return {
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid") if k in meta},
        "spec": {"suspend": (body.get("spec") or {}).get("suspend")},
        "status": body.get("status") or {},
    }


def slim_pod(body: Mapping[str, Any]) -> dict[str, Any]:
    status = body.get("status") or {}
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    attempt_labels = {k: labels[k] for k in (JOBSET_UID_LABEL, RESTART_ATTEMPT_LABEL) if k in labels}
    return {
        "metadata": {
            "name": meta.get("name"),
            "labels": attempt_labels,
            **({"deletionTimestamp": meta["deletionTimestamp"]} if meta.get("deletionTimestamp") else {}),
        },
        "status": {k: status[k] for k in ("phase", "conditions", "containerStatuses") if k in status},
    }


def _latest(index: kopf.Index[Key, Slim], key: Key) -> Slim | None:
    store = index.get(key)
    return next(iter(store), None) if store else None


def _run(
    memo: kopf.Memo,
    finetune: Mapping[str, Any],
    jobset: Mapping[str, Any] | None,
    pod_index: kopf.Index[Key, Slim],
    logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
) -> None:
    key = (finetune["metadata"]["namespace"], label_value(finetune["metadata"]["name"]))
    reconciler: Reconciler = memo.reconciler
    try:
        reconciler.reconcile(
            finetune, jobset, list(pod_index.get(key, [])), event=_event_sink(finetune), logger=logger
        )
    except ApiError as error:
        # Event handlers are not retried by kopf; the resync loop retries within resync_seconds.
        metrics.API_ERRORS.labels(status=str(error.status)).inc()
        if error.retryable:
            logger.warning("%s; retrying at the next resync", error)
        else:
            logger.error("%s; a retry cannot fix this (check the operator's RBAC and the spec)", error)


@dataclass
class Resync:
    """State of the resync loop and of deferred reconciles, shared by every handler.

    kopf gives each resource its own shallow copy of the memo, so an attribute set on ``memo`` in a
    handler is invisible to the loop; this object is shared by all the copies. Reconciles started
    here run on their own threads, because kopf parks blocking waits in asyncio's default executor.
    """

    indexes: tuple[kopf.Index[Key, Slim], ...] | None = None
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=2, thread_name_prefix="tpuft-resync")
    )
    task: asyncio.Task[None] | None = None
    loop: asyncio.AbstractEventLoop | None = None
    deferred: set[asyncio.Task[None]] = field(default_factory=set)

    def defer(self, memo: kopf.Memo, key: Key, delay: float) -> None:
        """Reconciles run ``key`` (namespace, name) again in ``delay`` seconds, from the indexes as
        they are then. Safe to call from any thread."""
        loop = self.loop
        if loop is None:
            return
        context = contextvars.copy_context()  # kopf.event() finds its event queue there

        def spawn() -> None:
            task = loop.create_task(reconcile_from_indexes(memo, key, logging.getLogger("tpuft.defer")))
            self.deferred.add(task)
            task.add_done_callback(self.deferred.discard)

        loop.call_soon_threadsafe(lambda: loop.call_later(delay, spawn, context=context))


async def reconcile_from_indexes(
    memo: kopf.Memo, key: Key, log: logging.Logger, *, skip_finished: bool = False
) -> None:
    """One reconcile of run ``key`` (namespace, name) from the latest indexed objects, off the loop."""
    state: Resync = memo.resync
    if state.indexes is None:
        return
    finetune_index, jobset_index, pod_index = state.indexes
    index_key = (key[0], label_value(key[1]))
    finetune = _latest(finetune_index, index_key)
    if finetune is None:
        return
    jobset = _latest(jobset_index, index_key)
    if skip_finished and is_final(finetune, jobset):
        return  # (a terminal phase written by hand next to a running JobSet is not final: retried)
    call = functools.partial(contextvars.copy_context().run, _run, memo, finetune, jobset, pod_index, log)
    await asyncio.get_running_loop().run_in_executor(state.executor, call)


async def _resync_forever(memo: kopf.Memo, interval: float) -> None:
    """A safety net instead of kopf timers (which would add a finalizer to every run): every
    ``interval`` seconds, re-reconcile each unfinished run from the in-memory indexes, so a missed
    event or a failed API call heals without anyone touching the object."""
    resync_log = logging.getLogger("tpuft.resync")
    state: Resync = memo.resync
    while True:
        await asyncio.sleep(interval)
        if state.indexes is None:
            continue
        finetune_index = state.indexes[0]
        for index_key in list(finetune_index):
            finetune = _latest(finetune_index, index_key)
            if finetune is None:
                continue
            key = (index_key[0], str(finetune["metadata"]["name"]))
            try:
                await reconcile_from_indexes(memo, key, resync_log, skip_finished=True)
            except Exception as error:  # the next pass retries; the loop must never die
                resync_log.warning("resync of %s/%s failed: %s", key[0], key[1], error)


def build_registry(settings: OperatorSettings) -> kopf.OperatorRegistry:
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

    # The indexes arrive as keyword arguments named after the index functions above.
    @kopf.on.event(*FINETUNES, registry=registry)
    def finetune_event(type: str, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **kw: Any) -> None:
        memo.resync.indexes = (kw["finetunes"], kw["jobsets"], kw["pods"])
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        if type == "DELETED":
            memo.reconciler.forget((namespace, name))
            return
        _run(memo, body, _latest(kw["jobsets"], (namespace, label_value(name))), kw["pods"], logger)

    @kopf.on.event(*JOBSETS, labels=OWNED, registry=registry)
    def jobset_event(
        type: str,
        namespace: str | None,
        labels: kopf.Labels,
        body: kopf.Body,
        memo: kopf.Memo,
        logger: kopf.Logger,
        **kw: Any,
    ) -> None:
        owner = _latest(kw["finetunes"], (str(namespace), labels[FINETUNE_LABEL]))
        if owner is None:
            return
        if type == "DELETED":
            memo.reconciler.jobset_deleted((str(namespace), owner["metadata"]["name"]))
        _run(memo, owner, None if type == "DELETED" else slim_jobset(body), kw["pods"], logger)

    @kopf.on.event(*PODS, labels=OWNED, registry=registry)
    def pod_event(
        namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, logger: kopf.Logger, **kw: Any
    ) -> None:
        key = (str(namespace), labels[FINETUNE_LABEL])
        owner = _latest(kw["finetunes"], key)
        if owner is not None:
            _run(memo, owner, _latest(kw["jobsets"], key), kw["pods"], logger)

    @kopf.on.startup(registry=registry)
    async def start_resync(memo: kopf.Memo, **_: Any) -> None:
        state: Resync = memo.resync
        state.loop = asyncio.get_running_loop()
        memo.reconciler.defer = functools.partial(state.defer, memo)
        state.task = asyncio.create_task(_resync_forever(memo, settings.resync_seconds))

    @kopf.on.cleanup(registry=registry)
    async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
        if memo.resync.task is not None:
            memo.resync.task.cancel()
        memo.resync.executor.shutdown(wait=False, cancel_futures=True)

    return registry
