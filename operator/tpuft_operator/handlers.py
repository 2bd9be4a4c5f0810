"""kopf registrations, and nothing else: its login, and the start and stop of the worker runtime.

The runtime (runtime.py) watches everything itself on kopf's watch client (watches.py): the
TPUFineTunes, their JobSets and pods, the TPU nodes (`--watch-nodes`) and Kueue's Workloads
(`--watch-workloads`). kopf's per-object processing of watch events capped JobSet creation at ~45
runs a second (docs/benchmarks.md), and its readiness gate for indexes once held the Workloads'
events of a long-running operator for good (Kueue installed after it; found by the e2e suite).
No finalizer is added and nothing is stored on the objects: deleting a TPUFineTune is never blocked,
even with the operator down.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kopf

from tpuft_operator.settings import OperatorSettings


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

    @kopf.on.startup(registry=registry)
    async def start_runtime(memo: kopf.Memo, settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings)  # first: the runtime's watches read their selectors and timeouts from it
        memo.runtime.start(memo.reconciler, settings)

    @kopf.on.cleanup(registry=registry)
    async def stop_runtime(memo: kopf.Memo, **_: Any) -> None:
        memo.runtime.stop()

    return registry
