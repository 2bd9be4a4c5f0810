"""The operator's busy watches (TPUFineTunes, their JobSets, prepare Jobs and pods) on kopf's watch client,
without kopf's per-object processing.

kopf turns every watch event into a per-object task that recalls the object's memory, builds three
loggers, runs the index functions and the handlers through its handler machinery and applies an empty
patch: 0.7-3 ms of the event loop per event on the benchmark machine (`python -m bench kopf-path`;
more under load), and a run brings ~10 events (its TPUFineTune and status writes, its JobSet's and
pods' changes). One loop thread at ~2 ms per event takes no more than ~45 runs a second, which is
where the operator's JobSet creation topped out (docs/benchmarks.md). Here an event costs what it must: kopf's client
decodes it, a slim copy (slim.py) replaces the last one in a `Store`, and the run is marked.

kopf still provides everything around it: the credentials (its login handler and vault), the watch
stream itself (`infinite_watch`: list, then watch from the list's resourceVersion, reconnect, relist on
410, server-side label selectors from kopf's settings), its timeouts and backoffs. The watches start
from kopf's startup handler (handlers.py); the nodes and Kueue's Workloads, a few events an hour,
stay on kopf's handlers.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import kopf
from kopf._cogs.clients import errors, watching
from kopf._cogs.structs import references

from tpuft_operator import maintenance, preparing, queueing
from tpuft_operator.api import resources
from tpuft_operator.render.jobset import FINETUNE_LABEL
from tpuft_operator.render.naming import label_value
from tpuft_operator.slim import slim_finetune, slim_jobset, slim_pod

Key = tuple[str, str]  # (namespace, the run label's value)
Slim = dict[str, Any]
# (event type "ADDED"/"MODIFIED"/"DELETED", the object as the API sent it)
OnEvent = Callable[[str, Mapping[str, Any]], None]

_log = logging.getLogger("tpuft.watches")


def _resource(table: resources.Resource, *, namespaced: bool = True) -> references.Resource:
    """kopf's description of a resource of our table (what its watch client needs of it)."""
    return references.Resource(
        group=table.group,
        version=table.version,
        plural=table.plural,
        kind=table.kind,
        namespaced=namespaced,
        verbs=frozenset({"list", "watch"}),
    )


@dataclass(frozen=True)
class Kind:
    """One watched kind: its API resource, the index key of an object, and what of it is kept.
    ``optional``: its resource may not be served (Kueue not installed): the watch tries again every
    OPTIONAL_RETRY_SECONDS until it is, and the workers do not wait for its first listing."""

    resource: references.Resource
    key_of: Callable[[Mapping[str, Any]], Key | None]
    slim: Callable[[Mapping[str, Any]], Slim]
    optional: bool = False


def _run_key(obj: Mapping[str, Any]) -> Key:
    # By the label value the children carry (a hash for names longer than 63 characters).
    meta = obj["metadata"]
    return (str(meta["namespace"]), label_value(str(meta["name"])))


def _owner_key(obj: Mapping[str, Any]) -> Key | None:
    meta = obj["metadata"]
    label = (meta.get("labels") or {}).get(FINETUNE_LABEL)
    return (str(meta["namespace"]), str(label)) if label else None


def _node_key(obj: Mapping[str, Any]) -> Key:
    return ("", str(obj["metadata"]["name"]))


def _workload_key(obj: Mapping[str, Any]) -> Key | None:
    # By the JobSet that owns it: a Workload names only its JobSet.
    owner = queueing.workload_owner(obj)
    return (str(obj["metadata"]["namespace"]), owner[0]) if owner else None


FINETUNES = Kind(_resource(resources.FINETUNE), _run_key, slim_finetune)
JOBSETS = Kind(_resource(resources.JOBSET), _owner_key, slim_jobset)
PODS = Kind(_resource(resources.POD), _owner_key, slim_pod)
# The runs' prepare Jobs (render/prepare_job.py; server-side selector on their component label,
# main.configure_kopf: the JobSets' own Jobs carry the run's label too).
JOBS = Kind(_resource(resources.JOB), _owner_key, preparing.slim_job)
# The TPU nodes (server-side selector on the accelerator label, main.configure_kopf): their
# maintenance signals (--watch-nodes). Cluster-scoped, keyed ("", name).
NODES = Kind(_resource(resources.NODE, namespaced=False), _node_key, maintenance.slim_node)
# Kueue's Workloads (--watch-workloads), keyed by (namespace, owning JobSet): optional, Kueue may be
# installed after the operator starts.
WORKLOADS = Kind(_resource(resources.WORKLOAD), _workload_key, queueing.slim_workload, optional=True)
OPTIONAL_RETRY_SECONDS = 10.0


class Store(Mapping[Key, list[Slim]]):
    """The latest slim copy of every watched object of one kind, grouped by index key.

    Written only on the event loop; read from the worker threads as well: a read returns a new list
    (one C-level copy under the GIL), never a view that a later event could change."""

    def __init__(self) -> None:
        self._groups: dict[Key, dict[str, Slim]] = {}
        self._where: dict[str, Key] = {}  # uid -> its key (a label can change)

    def put(self, key: Key | None, uid: str, obj: Slim) -> None:
        old = self._where.get(uid)
        if old is not None and old != key:
            self.discard(uid)
        if key is None:
            return
        self._groups.setdefault(key, {})[uid] = obj
        self._where[uid] = key

    def discard(self, uid: str) -> Slim | None:
        """Forgets the object ``uid``; returns its last copy, if it was known."""
        key = self._where.pop(uid, None)
        group = self._groups.get(key) if key is not None else None
        if key is None or group is None:
            return None
        obj = group.pop(uid, None)
        if not group:
            del self._groups[key]
        return obj

    def uids(self, namespace: str | None = None) -> set[str]:
        """The uids held (of ``namespace`` only, if given)."""
        return {uid for uid, key in self._where.items() if namespace is None or key[0] == namespace}

    def __getitem__(self, key: Key) -> list[Slim]:
        return list(self._groups[key].values())

    def get(self, key: Key, default: Any = None) -> Any:
        group = self._groups.get(key)
        return list(group.values()) if group is not None else default

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self._groups))

    def __len__(self) -> int:
        return len(self._groups)


class Watches:
    """The watches, for all namespaces or for each of ``namespaces``: the runs, their JobSets, prepare
    Jobs and pods,
    and with ``nodes`` / ``workloads`` the TPU nodes and Kueue's Workloads. `listed` is set once every
    watch of a required kind has delivered its first listing (before that a reconcile could see a
    run's JobSet as missing only because it was not listed yet)."""

    def __init__(
        self, namespaces: tuple[str, ...] = (), *, nodes: bool = False, workloads: bool = False
    ) -> None:
        self.namespaces: list[str | None] = list(namespaces) or [None]
        self.finetunes, self.jobsets, self.pods, self.jobs = Store(), Store(), Store(), Store()
        self.nodes = Store() if nodes else None
        self.workloads = Store() if workloads else None
        self.listed = threading.Event()
        self._pending = 4 * len(self.namespaces)
        self._tasks: list[asyncio.Task[None]] = []

    def kinds(self) -> list[tuple[Kind, Store, list[str | None]]]:
        """Each watched kind, its store and the namespaces it is watched in (None: cluster-wide)."""
        kinds = [(FINETUNES, self.finetunes), (JOBSETS, self.jobsets), (JOBS, self.jobs), (PODS, self.pods)]
        out = [(kind, store, self.namespaces) for kind, store in kinds]
        if self.workloads is not None:
            out.append((WORKLOADS, self.workloads, self.namespaces))
        if self.nodes is not None:
            out.append((NODES, self.nodes, [None]))
        return out

    def start(self, settings: kopf.OperatorSettings, on: Mapping[Kind, OnEvent]) -> None:
        """Starts one task per kind and namespace, on the running loop (kopf's startup handler)."""
        if self._pending <= 0:
            self.listed.set()
        for kind, store, namespaces in self.kinds():
            for namespace in namespaces:
                task = asyncio.create_task(self._watch(settings, kind, store, namespace, on[kind]))
                self._tasks.append(task)

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def _watch(
        self,
        settings: kopf.OperatorSettings,
        kind: Kind,
        store: Store,
        namespace: str | None,
        on_event: OnEvent,
    ) -> None:
        where = f"in {namespace}" if namespace else "cluster-wide"
        first_listing = True
        listing: set[str] | None = None  # the uids of a listing in progress
        configured = settings.networking.error_backoffs
        backoffs = [configured] if isinstance(configured, float | int) else list(configured) or [5.0]
        failures = 0
        absent = False  # an optional kind's resource was not served at the last try
        while True:
            try:
                async for raw in watching.infinite_watch(
                    settings=settings,
                    resource=kind.resource,
                    namespace=references.NamespaceName(namespace) if namespace else None,
                ):
                    if raw is watching.Bookmark.LISTED:
                        # Whatever this listing did not show was deleted while the watch was away.
                        for uid in store.uids(namespace) - (listing or set()):
                            gone = store.discard(uid)
                            if gone is not None:
                                on_event("DELETED", gone)
                        listing = None
                        failures = 0
                        if absent:
                            _log.info("%s are served now: watching them", kind.resource.plural)
                            absent = False
                        if first_listing:
                            first_listing = False
                            if not kind.optional:
                                self._listed_one()
                            _log.debug("listed %s %s", kind.resource.plural, where)
                        continue
                    if not isinstance(raw, dict):
                        continue
                    type_, obj = raw.get("type"), raw.get("object")
                    if type_ == "BOOKMARK" or not isinstance(obj, dict):
                        continue
                    uid = str(obj["metadata"].get("uid"))
                    if type_ is None:  # an object of a listing (kopf's convention)
                        if listing is None:
                            listing = set()
                        listing.add(uid)  # (a new set per object made a listing of N cost N^2)
                        type_ = "ADDED"
                    if type_ == "DELETED":
                        store.discard(uid)
                    else:
                        store.put(kind.key_of(obj), uid, kind.slim(obj))
                    on_event(str(type_), obj)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a watch must never die: report it and start again
                listing = None
                if kind.optional and isinstance(error, errors.APINotFoundError):
                    if not absent:
                        _log.info(
                            "%s are not served (yet): looking again every %.0f s",
                            kind.resource.plural,
                            OPTIONAL_RETRY_SECONDS,
                        )
                    absent = True
                    await asyncio.sleep(OPTIONAL_RETRY_SECONDS)
                    continue
                delay = backoffs[min(failures, len(backoffs) - 1)]
                failures += 1
                _log.warning(
                    "the watch of %s %s failed (%s); again in %.0f s",
                    kind.resource.plural,
                    where,
                    error,
                    delay,
                )
                listing = None
                await asyncio.sleep(delay)

    def _listed_one(self) -> None:
        self._pending -= 1
        if self._pending <= 0:
            self.listed.set()
