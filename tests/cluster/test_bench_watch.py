"""The benchmark's watch (`bench.operator.Watcher`) against the real API server: every latency the
operator benchmark reports is taken where this watch sees an object, so it must see each one once,
in order, across the reconnects its short timeout makes. And the benchmark's watch-reaction
controller (`OperatorWatches` with a `Reaction`), the yardstick the operator is judged against: it
must create each run's JobSet, owned by the run, from its watch alone, with the operator's
credentials (its ServiceAccount's RBAC)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from bench.operator import (
    PLACEHOLDER_UID,
    Listing,
    OperatorWatches,
    Reaction,
    Watcher,
    api_client,
    finetune,
)
from kubernetes import client

from tests.cluster.test_api_on_cluster import crd  # noqa: F401  (the fixture: the committed CRD, served)
from tpuft_dev.cluster.local import LocalCluster
from tpuft_dev.cluster.operator_process import install_operator
from tpuft_operator.api.resources import FINETUNE, JOBSET
from tpuft_operator.render import RenderSettings, render_run

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


@pytest.mark.usefixtures("crd")
def test_the_watch_reaction_controller_creates_each_runs_jobset_from_its_watch(
    local_cluster: LocalCluster, namespace: str
) -> None:
    runs = ("wr-0", "wr-1")
    jobsets = {
        name: json.dumps(
            render_run(
                {
                    **finetune(name, namespace),
                    "metadata": {"name": name, "namespace": namespace, "uid": PLACEHOLDER_UID},
                },
                RenderSettings(trainer_image="example.invalid/tpuft-trainer:test"),
            ).jobset
        )
        for name in runs
    }
    api = api_client(local_cluster.kubeconfig)
    custom = client.CustomObjectsApi(api)
    (fg, fv, fp), (jg, jv, jp) = FINETUNE.gvp, JOBSET.gvp
    # As the benchmark runs it: with the operator's ServiceAccount and RBAC, as any controller would.
    operator_kubeconfig = install_operator(local_cluster)
    watches = OperatorWatches(operator_kubeconfig, Reaction(namespace, jobsets, workers=2))
    watches.start()
    try:
        uids = {
            name: custom.create_namespaced_custom_object(fg, fv, namespace, fp, finetune(name, namespace))[
                "metadata"
            ]["uid"]
            for name in runs
        }
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            listed = custom.list_namespaced_custom_object(jg, jv, namespace, jp)["items"]
            if len(listed) == len(runs):
                break
            time.sleep(0.2)
    finally:
        events, outcome = watches.stop()
    assert outcome == {"errors": {}, "failed": []}
    owners = {
        js["metadata"]["ownerReferences"][0]["name"]: js["metadata"]["ownerReferences"][0]["uid"]
        for js in listed
    }
    assert owners == uids  # each run's JobSet, owned by the run as it was stored
    assert events["tpufinetunes"] >= len(runs)  # what it reacted to came from its watch
