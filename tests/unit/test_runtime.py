"""The worker runtime (runtime.py) and the per-run state (runs.py), with plain dicts for kopf's indexes.

What matters to users: an event marks exactly the runs it concerns (with JobSet creation first), a
deleted run leaves no state behind (even when its DELETED event was missed), and a run deleted and
created again under its name starts from nothing. The real watches are in tests/e2e.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from tpuft_operator import workqueue
from tpuft_operator.reconcile import Reconciler
from tpuft_operator.render import RenderSettings
from tpuft_operator.render.jobset import FINETUNE_LABEL, FINETUNE_UID_LABEL
from tpuft_operator.runs import RunBook
from tpuft_operator.runtime import Runtime, Views, probe_loop_lag
from tpuft_operator.watches import FINETUNES, Store, Watches


def finetune(name: str, uid: str, namespace: str = "ns", **status: Any) -> dict[str, Any]:
    return {
        "apiVersion": "tpuft.dev/v1alpha1",
        "kind": "TPUFineTune",
        "metadata": {"namespace": namespace, "name": name, "uid": uid, "resourceVersion": "1"},
        "status": status,
    }


def jobset(name: str, owner_uid: str, completed: bool = False) -> dict[str, Any]:
    conditions = [{"type": "Completed", "status": "True"}] if completed else []
    return {
        "metadata": {
            "namespace": "ns",
            "name": name,
            "labels": {FINETUNE_LABEL: name},
            "ownerReferences": [{"kind": "TPUFineTune", "uid": owner_uid, "controller": True}],
        },
        "status": {"conditions": conditions},
    }


def runtime_with(*runs: dict[str, Any], jobsets: tuple[dict[str, Any], ...] = ()) -> Runtime:
    """A runtime whose watches hold ``runs`` and ``jobsets`` (as watches.Watches fills them)."""
    runtime = Runtime(workers=1, resync_seconds=60, watches=Watches())
    for run in runs:
        runtime.watches.finetunes.put(FINETUNES.key_of(run), run["metadata"]["uid"], run)
    for js in jobsets:
        key = ("ns", js["metadata"]["labels"][FINETUNE_LABEL])
        runtime.watches.jobsets.put(key, js["metadata"]["name"] + "-uid", js)
    return runtime


def drain(runtime: Runtime) -> list[tuple[str, str]]:
    """The runs marked so far, in the order the workers would take them."""
    taken = []
    while len(runtime.queue):
        key = runtime.queue.get()
        assert key is not None
        taken.append(key)
        runtime.queue.done(key)
    return taken


def test_a_new_run_goes_ahead_of_status_work() -> None:
    running, new = finetune("running", "u-1"), finetune("new", "u-2")
    runtime = runtime_with(running, new, jobsets=(jobset("running", "u-1"),))
    runtime.on_finetune("MODIFIED", running)
    runtime.on_finetune("ADDED", new)
    assert drain(runtime) == [("ns", "new"), ("ns", "running")]


def test_a_run_whose_jobset_this_process_created_is_not_urgent_before_the_watch_shows_it() -> None:
    # Under a burst the JobSet watch lags the API by seconds: a resync (or a status event) in that
    # window must not put runs that have their JobSet ahead of the runs that still wait for theirs.
    reconciler = Reconciler(api=None, render_settings=RenderSettings())  # type: ignore[arg-type]
    created, waiting = finetune("created", "u-1"), finetune("waiting", "u-2")
    runtime = runtime_with(created, waiting)  # the JobSet watch shows neither JobSet
    runtime.reconciler = reconciler
    reconciler.runs.of(created).jobset = jobset("created", "u-1")  # created by this process
    assert not runtime.needs_jobset(created) and runtime.needs_jobset(waiting)
    runtime.on_finetune("MODIFIED", created)
    runtime.on_finetune("ADDED", waiting)
    assert drain(runtime) == [("ns", "waiting"), ("ns", "created")]
    runtime.resync()
    assert drain(runtime) == [("ns", "waiting"), ("ns", "created")]
    runtime.on_jobset("DELETED", "ns", "created", {FINETUNE_LABEL: "created"})  # gone: needed again
    assert runtime.needs_jobset(created)


def test_a_child_event_marks_only_its_own_run_when_labels_collide() -> None:
    # Two runs whose label values collide (a long name is indexed by prefix + hash): the uid label decides.
    one, two = finetune("a", "u-1"), finetune("a-twin", "u-2")
    runtime = runtime_with()
    for run in (one, two):  # both under the label value "a"
        runtime.watches.finetunes.put(("ns", "a"), run["metadata"]["uid"], run)
    runtime.on_pod("ns", {FINETUNE_LABEL: "a", FINETUNE_UID_LABEL: "u-2"})
    assert drain(runtime) == [("ns", "a-twin")]
    runtime.on_pod("ns", {FINETUNE_LABEL: "a"})  # no uid label (an older pod): both are looked at
    assert drain(runtime) == [("ns", "a"), ("ns", "a-twin")]


def test_a_deleted_jobset_is_urgent_and_forgotten_as_the_run_s_jobset() -> None:
    reconciler = Reconciler(api=None, render_settings=RenderSettings())  # type: ignore[arg-type]
    run = finetune("run", "u-1")
    runtime = runtime_with(run)
    runtime.reconciler = reconciler
    state = reconciler.runs.of(run)
    state.jobset = jobset("run", "u-1")
    runtime.on_jobset("DELETED", "ns", "run", {FINETUNE_LABEL: "run"})
    assert state.jobset is None
    assert runtime.queue.get() == ("ns", "run")


def test_a_resync_waits_for_the_end_of_a_burst_of_creates(monkeypatch: pytest.MonkeyPatch) -> None:
    # Mid-burst, marking every run would set the reconciles of runs that have their JobSet against
    # the creates; the resync comes once no run needs its JobSet (at most a resync period later).
    monkeypatch.setattr(workqueue, "QUIET_SECONDS", 0.01)
    running, new = finetune("running", "u-1", phase="Running"), finetune("new", "u-2")
    runtime = runtime_with(running, new, jobsets=(jobset("running", "u-1"),))
    runtime.resync_seconds = 1.0

    async def scenario() -> None:
        runtime.queue.add(("ns", "new"), urgent=True)  # a run waits for its JobSet: a burst
        assert runtime.queue.get() == ("ns", "new")  # a worker creates it...
        resyncs = asyncio.create_task(runtime._resync_forever())
        await asyncio.sleep(1.3)  # the resync was due at 1.0
        assert len(runtime.queue) == 0
        runtime.queue.done(("ns", "new"))  # ...and is done: the burst is over
        await asyncio.sleep(0.3)  # well before the resync's bound (2.0)
        resyncs.cancel()
        assert drain(runtime) == [("ns", "new"), ("ns", "running")]

    asyncio.run(scenario())


def test_the_resync_marks_unfinished_runs_and_drops_the_state_of_runs_that_are_gone() -> None:
    reconciler = Reconciler(api=None, render_settings=RenderSettings())  # type: ignore[arg-type]
    done = finetune("done", "u-1", phase="Succeeded")
    active = finetune("active", "u-2", phase="Running")
    runtime = runtime_with(
        done, active, jobsets=(jobset("done", "u-1", completed=True), jobset("active", "u-2"))
    )
    runtime.reconciler = reconciler
    for run in (done, active, finetune("deleted-while-we-were-down", "u-3")):
        reconciler.runs.of(run)
    time.sleep(0.01)
    runtime.resync()
    assert drain(runtime) == [("ns", "active")]
    assert reconciler.runs.get("u-3") is None  # its DELETED event was never seen
    assert reconciler.runs.get("u-1") is not None and reconciler.runs.get("u-2") is not None


def test_a_run_first_seen_during_a_sweep_keeps_its_state() -> None:
    book = RunBook()
    started = time.monotonic()
    book.of(finetune("new", "u-9"))  # created by a worker after the sweep listed the index
    assert book.retain([], seen_before=started) == []
    assert book.get("u-9") is not None


def test_a_run_created_again_under_its_name_starts_from_nothing() -> None:
    reconciler = Reconciler(api=None, render_settings=RenderSettings())  # type: ignore[arg-type]
    first = finetune("run", "u-1")
    reconciler.runs.of(first).jobset = jobset("run", "u-1")
    reconciler.forget(first)
    assert reconciler.runs.of(finetune("run", "u-2")).jobset is None
    assert len(reconciler.runs) == 1


def test_views_observe_a_run_with_its_own_jobset_and_pods() -> None:
    run = finetune("run", "u-1")
    theirs, ours = jobset("run", "u-other"), jobset("run", "u-1")
    pod = {"metadata": {"name": "p"}, "spec": {"nodeName": "n1"}}
    views = Views(
        finetunes={("ns", "run"): [run]},
        jobsets={("ns", "run"): [theirs, ours]},
        pods={("ns", "run"): [pod]},
        nodes={("", "n1"): [{"metadata": {"name": "n1"}}]},
    )
    seen = views.observe(("ns", "run"))
    assert seen is not None
    assert seen.jobset is ours and seen.pods == [pod] and list(seen.nodes) == ["n1"]
    assert views.observe(("ns", "gone")) is None


def test_a_store_moves_an_object_whose_label_changed_and_returns_copies() -> None:
    store = Store()
    store.put(("ns", "a"), "u-1", {"v": 1})
    held = store.get(("ns", "a"))
    store.put(("ns", "b"), "u-1", {"v": 2})
    assert held == [{"v": 1}]  # a reader's list is its own
    assert store.get(("ns", "a")) is None and store[("ns", "b")] == [{"v": 2}]
    assert store.uids("ns") == {"u-1"} and store.uids("other") == set()
    assert store.discard("u-1") == {"v": 2} and len(store) == 0


def test_events_are_posted_off_the_worker_with_the_time_they_happened() -> None:
    from datetime import UTC, datetime

    from tpuft_operator.runtime import EventPoster

    release, posted = threading.Event(), []

    def slow_post(obj: Any, type_: str, reason: str, message: str, at: datetime) -> None:
        release.wait(5)  # an apiserver slow to answer
        posted.append((reason, at))

    poster = EventPoster(slow_post, threads=1, limit=2)
    poster.start()
    before = datetime.now(UTC)
    poster(finetune("run", "u-1"), "Normal", "JobSetCreated", "created")  # returns at once
    poster(finetune("run", "u-1"), "Normal", "Running", "running")
    release.set()
    deadline = time.monotonic() + 5
    while len(posted) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    poster.stop()
    assert [reason for reason, _ in posted] == ["JobSetCreated", "Running"]
    assert all(before <= at <= datetime.now(UTC) for _, at in posted)


def test_events_beyond_the_limit_are_dropped_not_waited_for() -> None:
    from tpuft_operator.runtime import EventPoster

    posted = []
    poster = EventPoster(lambda obj, t, reason, m, at: posted.append(reason), threads=1, limit=1)
    poster(finetune("run", "u-1"), "Normal", "A", "")  # not started: waits in the queue
    poster(finetune("run", "u-1"), "Normal", "B", "")  # full: dropped (and logged)
    poster.start()
    deadline = time.monotonic() + 5
    while not posted and time.monotonic() < deadline:
        time.sleep(0.01)
    poster.stop()
    assert posted == ["A"]


def test_a_watch_lists_then_follows_and_a_relisting_forgets_what_was_deleted_meanwhile(
    monkeypatch: Any,
) -> None:
    """watches.Watches on kopf's watch stream (replaced here by the events it would yield): a listing
    fills the store and opens the gate, later events follow, and a relisting (after a 410) drops and
    reports what it no longer shows."""
    import asyncio

    import kopf
    from kopf._cogs.clients import watching

    from tpuft_operator import watches as watches_module

    def ft(name: str, uid: str) -> dict[str, Any]:
        return finetune(name, uid)

    stream = [
        {"type": None, "object": ft("a", "u-a")},
        {"type": None, "object": ft("b", "u-b")},
        watching.Bookmark.LISTED,
        {"type": "MODIFIED", "object": ft("a", "u-a")},
        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}},
        {"type": None, "object": ft("a", "u-a")},  # the relisting: b was deleted while away
        watching.Bookmark.LISTED,
    ]

    async def fake_watch(*, settings: Any, resource: Any, namespace: Any) -> Any:
        if resource is watches_module.FINETUNES.resource:
            for item in stream:
                yield item
        else:
            yield watching.Bookmark.LISTED
        await asyncio.sleep(3600)

    monkeypatch.setattr(watching, "infinite_watch", fake_watch)
    seen: list[tuple[str, str]] = []
    w = watches_module.Watches(workloads=True)

    async def run() -> None:
        w.start(
            kopf.OperatorSettings(),
            {
                kind: (lambda kind: lambda type_, obj: seen.append((type_, obj["metadata"]["name"])))(kind)
                for kind, _, _ in w.kinds()
            },
        )
        for _ in range(50):
            await asyncio.sleep(0)
        w.stop()

    asyncio.run(run())
    assert w.listed.is_set()  # the Workloads (optional) never held it
    assert seen == [("ADDED", "a"), ("ADDED", "b"), ("MODIFIED", "a"), ("ADDED", "a"), ("DELETED", "b")]
    assert set(w.finetunes) == {("ns", "a")}


def test_workloads_are_kept_by_their_jobset_and_nodes_by_name() -> None:
    from tpuft_operator.watches import NODES, WORKLOADS

    workload = {
        "metadata": {
            "namespace": "ns",
            "name": "jobset-run-1a2b",
            "ownerReferences": [
                {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "name": "run", "uid": "j"}
            ],
        }
    }
    assert WORKLOADS.key_of(workload) == ("ns", "run") and WORKLOADS.optional
    assert WORKLOADS.key_of({"metadata": {"namespace": "ns", "name": "other"}}) is None  # not a JobSet's
    assert NODES.key_of({"metadata": {"name": "tpu-node-1"}}) == ("", "tpu-node-1")


def test_a_warning_is_posted_at_once_while_jobsets_are_being_created() -> None:
    from tpuft_operator.runtime import EventPoster

    posted: list[str] = []
    poster = EventPoster(
        lambda obj, t, reason, m, at: posted.append(reason),
        threads=1,
        wait_quiet=lambda seconds: time.sleep(seconds),
    )
    poster.start()
    poster(finetune("run", "u-1"), "Warning", "JobSetRecreated", "")
    deadline = time.monotonic() + 2  # far less than the hold of Normal Events
    while not posted and time.monotonic() < deadline:
        time.sleep(0.01)
    poster.stop()
    assert posted == ["JobSetRecreated"]


def test_a_warning_passes_normal_events_held_for_a_burst_as_long_as_it_lasts() -> None:
    from tpuft_operator.runtime import EVENT_HOLD_SECONDS, EventPoster

    burst_over, asked, posted = threading.Event(), [], []

    def wait_quiet(seconds: float) -> bool:
        asked.append(seconds)
        return burst_over.wait(seconds)

    # As many posting threads as held Events: each would have sat in the burst's wait before.
    poster = EventPoster(
        lambda obj, t, reason, m, at: posted.append(reason), threads=2, wait_quiet=wait_quiet
    )
    poster.start()
    poster(finetune("run", "u-1"), "Normal", "JobSetCreated", "")
    poster(finetune("run", "u-2"), "Normal", "JobSetCreated", "")
    poster(finetune("run", "u-3"), "Warning", "JobSetRecreated", "")
    deadline = time.monotonic() + 2
    while not posted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert posted == ["JobSetRecreated"]
    # Held for the whole burst (a burst of 1000 runs lasts 15-20 s), not a few seconds of it.
    assert asked and asked[0] > EVENT_HOLD_SECONDS - 1 and EVENT_HOLD_SECONDS >= 30
    burst_over.set()
    deadline = time.monotonic() + 2
    while len(posted) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    poster.stop()
    assert posted == ["JobSetRecreated", "JobSetCreated", "JobSetCreated"]


def test_a_normal_event_waits_for_the_burst_of_creates_then_is_posted(monkeypatch: Any) -> None:
    from tpuft_operator import workqueue
    from tpuft_operator.runtime import EventPoster
    from tpuft_operator.workqueue import WorkQueue

    monkeypatch.setattr(workqueue, "QUIET_SECONDS", 0.0)
    queue = WorkQueue()
    posted: list[str] = []
    poster = EventPoster(
        lambda obj, t, reason, m, at: posted.append(reason), threads=1, wait_quiet=queue.wait_quiet
    )
    poster.start()
    queue.add(("ns", "other"), urgent=True)
    assert queue.get() == ("ns", "other")  # another run's JobSet is being created
    poster(finetune("run", "u-1"), "Normal", "Running", "")
    time.sleep(0.3)
    assert posted == []  # held: its POST would compete with the create
    queue.done(("ns", "other"))
    deadline = time.monotonic() + 2  # far less than its hold
    while not posted and time.monotonic() < deadline:
        time.sleep(0.01)
    poster.stop()
    assert posted == ["Running"]


def test_the_event_loops_lag_is_how_late_it_ran_what_was_due() -> None:
    lags: list[float] = []

    async def scenario() -> None:
        probe = asyncio.create_task(probe_loop_lag(lags.append, every=0.02))
        await asyncio.sleep(0.1)  # an idle loop: on time
        time.sleep(0.3)  # the loop held (as by a thread holding the GIL, or a blocking call on it)
        await asyncio.sleep(0.1)
        probe.cancel()

    asyncio.run(scenario())
    assert len(lags) >= 3
    assert max(lags) >= 0.25  # the probe due during the hold woke ~0.28 s late
    assert min(lags) < 0.05  # and the others on time (an idle loop adds no lag)


def test_every_thread_that_calls_the_api_at_once_finds_a_kept_connection(
    tmp_path: Any, caplog: Any, monkeypatch: Any
) -> None:
    """The workers and the Event posters all calling at once (a burst's status patches and its
    Events): none is handed a connection that is closed after its call, whose successor would pay a
    new TLS handshake. A real HTTP server answering after a pause, the operator's real client."""
    import logging
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kubernetes import client

    from tpuft_operator.k8s import Api, load_client
    from tpuft_operator.runtime import EVENT_POSTER_THREADS, api_connections

    workers = 6
    callers = workers + EVENT_POSTER_THREADS
    arrived = threading.Barrier(callers, timeout=10)

    class Slow(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the API server

        def do_GET(self) -> None:
            if self.path == "/version":
                arrived.wait()  # every caller holds its connection at the same time
            body = b"{}"
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{server.server_port}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    monkeypatch.setattr(client.Configuration, "_default", None)  # load_kube_config sets the default
    try:
        api = Api(load_client(str(kubeconfig), connections=api_connections(workers)))
        with caplog.at_level(logging.WARNING, logger="urllib3.connectionpool"):
            calls = [threading.Thread(target=api._call, args=("GET", "/version")) for _ in range(callers)]
            for call in calls:
                call.start()
            for call in calls:
                call.join(10)
    finally:
        server.shutdown()
    assert not arrived.broken
    assert not [r for r in caplog.records if "Connection pool is full" in r.getMessage()]


def test_events_take_turns_in_the_write_pace() -> None:
    """EventPoster posts each Event in its turn of the pace it shares with the status patches: four
    Events at once under one write a tenth of a second, one at a time after the first."""
    from datetime import datetime

    from tpuft_operator.pacing import WritePace
    from tpuft_operator.runtime import EventPoster

    posted: list[float] = []

    def post(obj: Any, type_: str, reason: str, message: str, at: datetime) -> None:
        posted.append(time.monotonic())

    pace = WritePace(10, 1)
    poster = EventPoster(post, threads=4, pace=pace)
    poster.start()
    for reason in "ABCD":
        poster(finetune("run", "u-1"), "Warning", reason, "")  # Warnings: not held for a burst
    deadline = time.monotonic() + 10
    while len(posted) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    poster.stop()
    assert len(posted) == 4
    # Three turns of 0.1 s after the free first one (a lower bound: a slow machine only adds to it).
    assert max(posted) - min(posted) >= 0.3 - 0.02
