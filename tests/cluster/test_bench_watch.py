"""The benchmark's watch (`bench.operator.Watcher`) against the real API server: every latency the
operator benchmark reports is taken where this watch sees an object, so it must see each one once,
in order, across the reconnects its short timeout makes."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from bench.operator import Listing, Watcher, api_client
from kubernetes import client

from tpuft_dev.cluster.local import LocalCluster

pytestmark = pytest.mark.cluster


def test_the_bench_watch_lists_then_follows_each_change_once(
    local_cluster: LocalCluster, namespace: str
) -> None:
    api = api_client(local_cluster.kubeconfig)
    core = client.CoreV1Api(api)

    def config_map(name: str) -> client.V1ConfigMap:
        return client.V1ConfigMap(metadata=client.V1ObjectMeta(name=name), data={"k": name})

    core.create_namespaced_config_map(namespace, config_map("before"))
    seen: list[tuple[str, str]] = []
    changed = threading.Condition()

    def on_event(type_: str, obj: dict[str, Any], at: float) -> None:
        assert isinstance(obj, dict) and at <= time.monotonic()
        with changed:
            seen.append((type_, obj["metadata"]["name"]))
            changed.notify_all()

    def wait_for(event: tuple[str, str]) -> None:
        with changed:
            assert changed.wait_for(lambda: event in seen, timeout=30), f"{event} not seen: {seen}"

    # A one-second watch: the stream ends and is opened again from the last resourceVersion while
    # the test runs, as the benchmark's 5 s watches do during a phase.
    watcher = Watcher(Listing(core.list_namespaced_config_map, (namespace,)), on_event, timeout_seconds=1)
    watcher.start()
    try:
        assert watcher.ready.wait(30)
        wait_for(("ADDED", "before"))  # from the listing
        time.sleep(2.5)  # at least two reconnects
        core.create_namespaced_config_map(namespace, config_map("after"))
        wait_for(("ADDED", "after"))
        core.delete_namespaced_config_map("before", namespace)
        wait_for(("DELETED", "before"))
    finally:
        watcher.stopped.set()
    ours = [event for event in seen if event[1] in ("before", "after")]
    assert ours == [("ADDED", "before"), ("ADDED", "after"), ("DELETED", "before")]
