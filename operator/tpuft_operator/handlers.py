"""kopf registrations, and nothing else: each handler hands its event to the worker runtime.

Three watches feed one level-triggered reconcile: the TPUFineTunes, the JobSets and the pods that
carry the run's label; a fourth, of the TPU nodes (read-only, `--watch-nodes`), marks the runs on a
node whose maintenance signals change (maintenance.py); a fifth, of Kueue's Workloads, tells a queued
run why it waits (queueing.py; without Kueue installed kopf starts it if the CRD appears). In-memory
indexes (kopf.index) hold the latest JobSet and pods of each run, so a reconcile reads no lists from
the API. Every event handler is async and only marks its run in the runtime's work queue
(runtime.py), which reconciles on worker threads. No handler stores progress on the object and no
finalizer is added: deleting a TPUFineTune is never blocked, even with the operator down.
"""

from __future__ import annotations

from typing import Any

import kopf

from tpuft_operator import maintenance, queueing
from tpuft_operator.render.jobset import FINETUNE_LABEL
from tpuft_operator.render.naming import label_value
from tpuft_operator.runtime import Key, Slim
from tpuft_operator.settings import OperatorSettings
from tpuft_operator.slim import slim_finetune, slim_jobset, slim_pod
from tpuft_operator.topology import ACCELERATOR_LABEL

FINETUNES = ("tpuft.dev", "v1alpha1", "tpufinetunes")
JOBSETS = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
PODS = ("", "v1", "pods")
WORKLOADS = queueing.WORKLOADS
NODES = ("", "v1", "nodes")
OWNED = {FINETUNE_LABEL: kopf.PRESENT}
TPU_NODES = {ACCELERATOR_LABEL: kopf.PRESENT}


def build_registry(operator_settings: OperatorSettings) -> kopf.OperatorRegistry:
    """All handlers, registered on a fresh registry (so settings apply and tests can build their own).

    The memo carries the `runtime` (runtime.Runtime) and the `reconciler` it feeds (main.build_memo).
    """
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # In a pod: the ServiceAccount token; elsewhere: $KUBECONFIG (set from --kubeconfig).
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    # The index functions are async so that they run on the event loop at once: sync ones would wait
    # for a thread of kopf's executor, and the indexes would lag the API by seconds.
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
    async def finetune_event(type: str, body: kopf.Body, memo: kopf.Memo, **kw: Any) -> None:
        memo.runtime.on_finetune(type, body, kw)

    @kopf.on.event(*JOBSETS, labels=OWNED, registry=registry)
    async def jobset_event(
        type: str, namespace: str | None, name: str, labels: kopf.Labels, memo: kopf.Memo, **kw: Any
    ) -> None:
        memo.runtime.on_jobset(type, str(namespace), name, labels, kw)

    @kopf.on.event(*PODS, labels=OWNED, registry=registry)
    async def pod_event(namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **kw: Any) -> None:
        memo.runtime.on_pod(str(namespace), labels, kw)

    if operator_settings.watch_workloads:
        # Kueue's Workloads (of JobSets): a queued run's status says why it waits, and its admission
        # and eviction become Events. Indexed by the JobSet that owns each.
        @kopf.index(*WORKLOADS, registry=registry, id="workloads")
        async def workloads(namespace: str | None, body: kopf.Body, **_: Any) -> dict[Key, Slim] | None:
            owner = queueing.workload_owner(body)
            return {(str(namespace), owner[0]): queueing.slim_workload(body)} if owner else None

        @kopf.on.event(*WORKLOADS, registry=registry)
        async def workload_event(namespace: str | None, body: kopf.Body, memo: kopf.Memo, **kw: Any) -> None:
            memo.runtime.on_workload(str(namespace), body, kw)

    if operator_settings.watch_nodes:

        @kopf.index(*NODES, labels=TPU_NODES, id="nodes", registry=registry)
        async def nodes(name: str, body: kopf.Body, **_: Any) -> dict[str, Slim]:
            return {name: maintenance.slim_node(body)}

        @kopf.on.event(*NODES, labels=TPU_NODES, registry=registry)
        async def node_event(type: str, name: str, body: kopf.Body, memo: kopf.Memo, **kw: Any) -> None:
            memo.runtime.on_node(type, name, body, kw)

    @kopf.on.startup(registry=registry)
    async def start_runtime(memo: kopf.Memo, settings: kopf.OperatorSettings, **_: Any) -> None:
        memo.runtime.start(memo.reconciler, settings)

    @kopf.on.cleanup(registry=registry)
    async def stop_runtime(memo: kopf.Memo, **_: Any) -> None:
        memo.runtime.stop()

    return registry
