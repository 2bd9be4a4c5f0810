"""What one watch event costs the operator's event loop: kopf's per-object path against watches.py.

No cluster: synthetic TPUFineTune and pod events (the shapes the benchmark cluster sends) go through
1. *kopf*: kopf's own `process_resource_event` with a registry shaped like the operator's before
   watches.py (an async index function and an async on.event handler per kind that marks the run in
   a work queue), as kopf's per-object workers call it for every event;
2. *lean*: what watches.py does per event: a slim copy into a `Store`, then the runtime's mark.
Each is timed over the same events (first ADDED, then MODIFIED), in one process, one after the other;
the ratio is what the figures are for (timings on a shared machine move, ratios much less).
Results: bench/results/kopf-path.json.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any, cast

import kopf
from kopf._cogs.structs import references
from kopf._core.actions import lifecycles
from kopf._core.engines import indexing
from kopf._core.reactor import inventory, processing

from bench import operator as operator_bench
from bench import results_file
from tpuft_operator.main import QuietHandlerSuccess, configure_kopf
from tpuft_operator.render.jobset import FINETUNE_LABEL
from tpuft_operator.runtime import Runtime
from tpuft_operator.settings import OperatorSettings
from tpuft_operator.slim import slim_finetune, slim_pod
from tpuft_operator.watches import FINETUNES, PODS, Watches
from tpuft_operator.workqueue import WorkQueue

RESULTS = results_file("kopf-path")
EVENTS = 3000


def finetune(i: int) -> dict[str, Any]:
    """The operator benchmark's TPUFineTune, with what the API server adds to a stored one."""
    body = operator_bench.finetune(f"r-{i:04d}", "bench")
    body["metadata"].update(
        uid=f"u-{i}",
        resourceVersion=str(1000 + i),
        generation=1,
        creationTimestamp="2026-12-01T00:00:00Z",
        managedFields=[{"manager": "kubectl", "operation": "Update", "fieldsV1": {"f:spec": {}}}],
    )
    return body


def pod(i: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"r-{i:04d}-slice-0-0-x",
            "namespace": "bench",
            "uid": f"p-{i}",
            "resourceVersion": str(5000 + i),
            "labels": {FINETUNE_LABEL: f"r-{i:04d}"},
        },
        "spec": {
            "nodeName": "bench-0",
            "containers": [
                {
                    "name": "trainer",
                    "image": "x",
                    "env": [{"name": f"E{k}", "value": "v" * 30} for k in range(20)],
                }
            ],
        },
        "status": {
            "phase": "Running",
            "conditions": [{"type": t, "status": "True"} for t in ("Ready", "PodScheduled", "Initialized")],
            "containerStatuses": [{"name": "trainer", "ready": True, "restartCount": 0}],
        },
    }


def kopf_registry(queue: WorkQueue) -> kopf.OperatorRegistry:
    """The operator's registrations before watches.py: an index and an event handler per kind."""
    registry = kopf.OperatorRegistry()
    ft, pd = FINETUNES.resource, PODS.resource

    @kopf.index(ft.group, ft.version, ft.plural, id="finetunes", registry=registry)
    async def finetunes(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
        return {(namespace, name): slim_finetune(body)}

    @kopf.index(
        pd.group, pd.version, pd.plural, labels={FINETUNE_LABEL: kopf.PRESENT}, id="pods", registry=registry
    )
    async def pods(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
        return {(namespace, labels[FINETUNE_LABEL]): slim_pod(body)}

    @kopf.on.event(ft.group, ft.version, ft.plural, registry=registry)
    async def finetune_event(namespace: str | None, name: str, **_: Any) -> None:
        queue.add((str(namespace), name), urgent=True)

    @kopf.on.event(pd.group, pd.version, pd.plural, labels={FINETUNE_LABEL: kopf.PRESENT}, registry=registry)
    async def pod_event(namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
        queue.add((str(namespace), labels[FINETUNE_LABEL]))

    return registry


def _resource(kind: Any) -> references.Resource:
    return cast(references.Resource, kind.resource)


async def through_kopf(events: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    settings = kopf.OperatorSettings()
    configure_kopf(settings, OperatorSettings(watch_nodes=False, watch_workloads=False))
    queue = WorkQueue()
    registry = kopf_registry(queue)
    indexers = indexing.OperatorIndexers()
    indexers.ensure(registry._indexing.get_all_handlers())
    memories = inventory.ResourceMemories()
    event_queue: asyncio.Queue[Any] = asyncio.Queue()
    timings = {}
    for label, raws in events.items():
        resource = _resource(FINETUNES if label.startswith("finetune") else PODS)
        started = time.perf_counter()
        for raw in raws:
            await processing.process_resource_event(
                lifecycle=lifecycles.all_at_once,
                registry=registry,
                settings=settings,
                indexers=indexers,
                memories=memories,
                memobase=cast(Any, kopf.Memo()),  # (kopf's AnyMemo: any Memo subclass)
                resource=resource,
                raw_event=cast(Any, raw),  # a watch event as kopf's RawEvent TypedDict
                event_queue=event_queue,
            )
        timings[label] = 1000 * (time.perf_counter() - started) / len(raws)
    assert len(queue) > 0
    return timings


def through_watches(events: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    runtime = Runtime(workers=1, resync_seconds=60, watches=Watches())
    stores = {"finetune": (runtime.watches.finetunes, FINETUNES), "pod": (runtime.watches.pods, PODS)}
    timings = {}
    for label, raws in events.items():
        store, kind = stores[label.split()[0]]
        started = time.perf_counter()
        for raw in raws:
            obj = raw["object"]
            meta = obj["metadata"]
            store.put(kind.key_of(obj), meta["uid"], kind.slim(obj))
            if kind is FINETUNES:
                runtime.on_finetune(raw["type"], obj)
            else:
                runtime.on_pod(meta["namespace"], meta["labels"])
        timings[label] = 1000 * (time.perf_counter() - started) / len(raws)
    assert len(runtime.queue) > 0
    return timings


def main() -> dict[str, Any]:
    logging.getLogger("kopf.objects").addFilter(QuietHandlerSuccess())

    def events() -> dict[str, list[dict[str, Any]]]:
        # New dicts each time (kopf keeps references to the bodies it has seen).
        make = {"finetune": finetune, "pod": pod}
        return {
            f"{name} {type_}": [
                json.loads(json.dumps({"type": type_, "object": fn(i)})) for i in range(EVENTS)
            ]
            for name, fn in make.items()
            for type_ in ("ADDED", "MODIFIED")
        }

    kopf_ms = asyncio.run(through_kopf(events()))
    lean_ms = through_watches(events())
    results = {
        "what": "event-loop milliseconds per watch event: kopf's per-object processing vs watches.py",
        "events_per_case": EVENTS,
        "load_average": list(os.getloadavg()),
        "ms_per_event": {
            case: {
                "kopf": round(kopf_ms[case], 4),
                "lean": round(lean_ms[case], 4),
                "ratio": round(kopf_ms[case] / lean_ms[case], 1),
            }
            for case in kopf_ms
        },
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(report(results)))
    return results


def report(results: dict[str, Any]) -> list[str]:
    lines = [f"watch event cost on the event loop, ms (load average {results['load_average']}):"]
    for case, r in results["ms_per_event"].items():
        lines.append(f"  {case:<18} kopf {r['kopf']:>7.3f}   lean {r['lean']:>7.4f}   {r['ratio']:>6.1f}x")
    return lines


if __name__ == "__main__":
    main()
