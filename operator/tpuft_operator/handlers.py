"""kopf registrations, and nothing else: each handler hands its event to the worker runtime.

The runtime (runtime.py) watches the TPUFineTunes, their JobSets and their pods itself, on kopf's
watch client (watches.py), and kopf calls the handlers here for the rest: its login, the start and
stop of the runtime, and the two quiet watches with their in-memory indexes: the TPU nodes
(read-only, `--watch-nodes`: a change of their maintenance signals marks the runs on them,
maintenance.py) and Kueue's Workloads (a queued run's status says why it waits, queueing.py; kopf
starts that watch if the CRD appears). Handlers only mark runs; no handler stores progress on the
object and no finalizer is added: deleting a TPUFineTune is never blocked, even with the operator down.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kopf

from tpuft_operator import maintenance, queueing
from tpuft_operator.api.resources import NODE, WORKLOAD
from tpuft_operator.runtime import Key, Slim
from tpuft_operator.settings import OperatorSettings
from tpuft_operator.topology import ACCELERATOR_LABEL

WORKLOADS = WORKLOAD.gvp
NODES = NODE.gvp
TPU_NODES = {ACCELERATOR_LABEL: kopf.PRESENT}


def build_registry(
    operator_settings: OperatorSettings,
    configure: Callable[[kopf.OperatorSettings], None] = lambda kopf_settings: None,
) -> kopf.OperatorRegistry:
    """All handlers, registered on a fresh registry (so settings apply and tests can build their own).

    The memo carries the `runtime` (runtime.Runtime) and the `reconciler` it feeds (main.build_memo).
    """
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # In a pod: the ServiceAccount token; elsewhere: $KUBECONFIG (set from --kubeconfig).
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    # The TPUFineTunes, their JobSets and their pods are watched by the runtime itself (watches.py:
    # kopf's per-object processing capped JobSet creation at ~45 runs a second). kopf keeps the
    # watches of the nodes and Workloads, a few events an hour, and its indexes of them.
    # The index functions are async so that they run on the event loop at once: sync ones would wait
    # for a thread of kopf's executor. The indexes arrive as keyword arguments named after them.
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
        configure(settings)  # first: the runtime's watches read their selectors and timeouts from it
        memo.runtime.start(memo.reconciler, settings)

    @kopf.on.cleanup(registry=registry)
    async def stop_runtime(memo: kopf.Memo, **_: Any) -> None:
        memo.runtime.stop()

    return registry
