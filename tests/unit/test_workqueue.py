"""The work queue's guarantees (workqueue.py): each run waits once, creation first, one worker per run."""

from __future__ import annotations

import threading
import time
from typing import Any

from tpuft_operator.workqueue import WorkQueue

A, B, C = ("ns", "a"), ("ns", "b"), ("ns", "c")


def drain(queue: WorkQueue) -> list[tuple[str, str]]:
    taken = []
    while len(queue):
        key = queue.get()
        assert key is not None
        taken.append(key)
        queue.done(key)
    return taken


def test_a_run_marked_many_times_is_reconciled_once() -> None:
    queue = WorkQueue()
    for _ in range(10):
        queue.add(A)
    queue.add(B)
    assert len(queue) == 2
    assert drain(queue) == [A, B]


def test_runs_that_need_a_jobset_go_first() -> None:
    queue = WorkQueue()
    queue.add(A)
    queue.add(B)
    queue.add(C, urgent=True)
    assert drain(queue) == [C, A, B]


def test_a_waiting_run_marked_urgent_is_promoted_and_taken_once() -> None:
    queue = WorkQueue()
    queue.add(A)
    queue.add(B)
    queue.add(B, urgent=True)
    queue.add(B)  # a later ordinary mark does not demote it
    assert drain(queue) == [B, A]


def test_a_run_marked_while_being_reconciled_waits_for_that_reconcile_then_runs_again() -> None:
    queue = WorkQueue()
    queue.add(A)
    assert queue.get() == A
    queue.add(A)  # an event arrives during the reconcile
    queue.add(B)
    assert queue.get() == B  # A is not handed to a second worker meanwhile
    queue.done(B)
    queue.done(A)
    assert queue.get() == A  # the event is not lost
    queue.done(A)
    assert len(queue) == 0


def test_no_two_workers_ever_hold_the_same_run() -> None:
    queue = WorkQueue()
    holding: set[tuple[str, str]] = set()
    overlaps: list[tuple[str, str]] = []
    reconciles: list[tuple[str, str]] = []
    guard = threading.Lock()

    def worker() -> None:
        while (key := queue.get()) is not None:
            with guard:
                if key in holding:
                    overlaps.append(key)
                holding.add(key)
                reconciles.append(key)
            time.sleep(0.001)
            with guard:
                holding.discard(key)
            queue.done(key)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for i in range(2000):
        queue.add(("ns", f"run-{i % 20}"), urgent=i % 7 == 0)
    deadline = time.monotonic() + 10
    while len(queue) and time.monotonic() < deadline:
        time.sleep(0.01)
    queue.close()
    for t in threads:
        t.join(timeout=5)
    assert not overlaps
    assert {k for k in reconciles} == {("ns", f"run-{i}") for i in range(20)}
    assert len(reconciles) < 2000  # marks were coalesced


def test_close_wakes_every_waiting_worker() -> None:
    queue = WorkQueue()
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(queue.get())) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    queue.close()
    for t in threads:
        t.join(timeout=5)
    assert results == [None, None, None]
    queue.add(A)
    assert len(queue) == 0


def test_status_work_waits_while_jobsets_are_being_created_but_not_for_ever(monkeypatch: Any) -> None:
    from tpuft_operator import workqueue

    monkeypatch.setattr(workqueue, "QUIET_SECONDS", 0.0)
    queue = WorkQueue()
    queue.add(A)  # a run whose status is to be written
    queue.add(B, urgent=True)  # a run that needs its JobSet
    assert queue.get() == B
    assert not queue.wait_quiet(0)  # a burst of creates is going on
    got: list[Any] = []
    taker = threading.Thread(target=lambda: got.append(queue.get()))
    taker.start()
    taker.join(0.5)
    assert got == [] and taker.is_alive()  # A waits while B's JobSet is being created
    queue.done(B)
    taker.join(5)
    assert got == [A] and queue.wait_quiet(0)
    queue.done(A)
    # However long creation goes on, a waiting run is taken HOLD_SECONDS after it was marked.
    monkeypatch.setattr(workqueue, "HOLD_SECONDS", 0.0)
    queue.add(C, urgent=True)
    assert queue.get() == C
    queue.add(A)
    assert not queue.wait_quiet(0) and queue.get() == A


def test_wait_quiet_returns_when_the_burst_of_creates_ends_or_at_its_timeout(monkeypatch: Any) -> None:
    from tpuft_operator import workqueue

    monkeypatch.setattr(workqueue, "QUIET_SECONDS", 0.0)
    queue = WorkQueue()
    assert queue.wait_quiet(0.0)  # nothing is being created
    queue.add(A, urgent=True)
    assert not queue.wait_quiet(0.05)  # A waits for its JobSet: the burst goes on
    assert queue.get() == A
    assert not queue.wait_quiet(0.05)  # and while it is being created
    quiet: list[bool] = []
    waiter = threading.Thread(target=lambda: quiet.append(queue.wait_quiet(30)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()
    started = time.monotonic()
    queue.done(A)  # the end of the last urgent reconcile wakes the waiter, long before its timeout
    waiter.join(5)
    assert quiet == [True] and time.monotonic() - started < 5


def test_a_run_promoted_to_urgent_counts_once(monkeypatch: Any) -> None:
    from tpuft_operator import workqueue

    monkeypatch.setattr(workqueue, "QUIET_SECONDS", 0.0)
    queue = WorkQueue()
    queue.add(A)
    queue.add(A, urgent=True)  # promoted
    queue.add(A, urgent=True)  # already urgent: nothing changes
    assert not queue.wait_quiet(0)  # a burst of creates is going on
    assert queue.get() == A
    queue.done(A)
    assert queue.wait_quiet(0)  # its one urgent mark was taken: the count is back to zero


def test_during_a_burst_only_a_few_workers_take_runs_whose_hold_has_ended(monkeypatch: Any) -> None:
    from tpuft_operator import workqueue

    monkeypatch.setattr(workqueue, "QUIET_SECONDS", 0.0)
    monkeypatch.setattr(workqueue, "HOLD_SECONDS", 0.0)  # every hold has ended at once
    monkeypatch.setattr(workqueue, "BURST_OTHER_WORKERS", 2)
    queue = WorkQueue()
    queue.add(("ns", "creating"), urgent=True)
    assert queue.get() == ("ns", "creating")  # its JobSet is being created: a burst
    for name in "abc":
        queue.add(("ns", name))
    first, second = queue.get(), queue.get()
    assert {first, second} == {A, B}
    got: list[Any] = []
    taker = threading.Thread(target=lambda: got.append(queue.get()))
    taker.start()
    taker.join(0.3)
    assert got == [] and taker.is_alive()  # C waits: two workers are on such runs already
    assert first is not None
    queue.done(first)  # one of them ends: C goes in its place
    taker.join(5)
    assert got == [C]
    # Once no JobSet is being created, every worker may take such runs.
    assert second is not None
    queue.done(("ns", "creating"))
    queue.add(("ns", "d"))
    queue.add(("ns", "e"))
    assert {queue.get(), queue.get()} == {("ns", "d"), ("ns", "e")}


def test_a_held_run_goes_when_the_last_create_of_a_burst_ends_not_at_each_one(monkeypatch: Any) -> None:
    from tpuft_operator import workqueue

    monkeypatch.setattr(workqueue, "QUIET_SECONDS", 0.0)
    queue = WorkQueue()
    queue.add(A)  # a status to write: held while JobSets are created (HOLD_SECONDS: 5 s)
    queue.add(B, urgent=True)
    queue.add(C, urgent=True)
    assert queue.get() == B and queue.get() == C  # two creates at once
    got: list[Any] = []
    taker = threading.Thread(target=lambda: got.append(queue.get()))
    taker.start()
    taker.join(0.3)
    queue.done(B)  # one create ends: the burst goes on, A still waits
    taker.join(0.3)
    assert got == [] and taker.is_alive()
    queue.done(C)  # the last one ends: A goes now, not when its hold runs out
    taker.join(2)
    assert got == [A]


def test_each_wait_is_reported_with_whether_the_run_needed_its_jobset() -> None:
    waits: list[tuple[float, bool]] = []
    queue = WorkQueue(waited=lambda seconds, urgent: waits.append((seconds, urgent)))
    queue.add(A)
    queue.add(B, urgent=True)
    time.sleep(0.05)
    assert drain(queue) == [B, A]  # B first: it needs its JobSet; A once the burst (B) is over
    assert [urgent for _, urgent in waits] == [True, False]
    assert all(seconds >= 0.05 for seconds, _ in waits)  # from its mark to a worker taking it
