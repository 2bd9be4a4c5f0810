"""Prometheus metrics of the operator (served on /metrics by prometheus-client)."""

from __future__ import annotations

import contextlib
import threading

from prometheus_client import Counter, Gauge, Histogram

from tpuft_operator.api.models import Phase

RECONCILES = Counter("tpuft_reconciles_total", "Reconcile passes, by result.", ["result"])
API_ERRORS = Counter("tpuft_api_errors_total", "Failed Kubernetes API calls, by HTTP status.", ["status"])
# Fine between 0.1 and 3 s: where a burst's waits and JobSet creates fall (`python -m bench operator`).
_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1, 1.5, 2, 3, 5, 10, 30)  # fmt: skip
RECONCILE_SECONDS = Histogram(
    "tpuft_reconcile_duration_seconds",
    "Time of one reconcile pass (render, API calls, status patch), from a worker taking the run to "
    "its release; work=create: a run that needed its JobSet, work=other: the rest.",
    ["work"],
    buckets=_SECONDS_BUCKETS,
)
QUEUE_DEPTH = Gauge(
    "tpuft_workqueue_depth", "Runs marked for a reconcile and waiting for a worker (workqueue.py)."
)
QUEUE_WAIT_SECONDS = Histogram(
    "tpuft_workqueue_queue_duration_seconds",
    "Time a run waits in the work queue, from the event that marked it to a worker taking it; "
    "work=create: a run that needs its JobSet (taken first), work=other: the rest (status, held while "
    "JobSets are being created).",
    ["work"],
    buckets=_SECONDS_BUCKETS,
)


def _work(creating: bool) -> str:
    return "create" if creating else "other"


def observe_queue_wait(seconds: float, urgent: bool) -> None:
    """A run's wait in the work queue (workqueue.WorkQueue's ``waited``)."""
    QUEUE_WAIT_SECONDS.labels(work=_work(urgent)).observe(seconds)


def observe_reconcile(seconds: float, creating: bool) -> None:
    """One reconcile pass of a run (``creating``: it needed its JobSet when a worker took it)."""
    RECONCILE_SECONDS.labels(work=_work(creating)).observe(seconds)


EVENT_LOOP_LAG_SECONDS = Histogram(
    "tpuft_event_loop_lag_seconds",
    "How late the event loop that reads every watch runs what is due (probed every 0.1 s): each watch "
    "event waits about this long before it marks its run.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
WRITE_PACE_SECONDS = Histogram(
    "tpuft_write_pace_wait_seconds",
    "How long a status patch (write=status) or an Event (write=event) waited for its turn under "
    "--write-qps (pacing.py): 0 unless a burst of writes outran the pace.",
    ["write"],
    buckets=(0, 0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120),
)


def observe_write_pace(write: str, seconds: float) -> None:
    WRITE_PACE_SECONDS.labels(write=write).observe(seconds)


RUNS = Gauge("tpuft_runs", "TPUFineTunes known to the operator, by phase.", ["phase"])
GOODPUT = Gauge(
    "tpuft_run_goodput_ratio",
    "Productive training time / wall time since creation, per run (status.goodput.ratio).",
    ["namespace", "name"],
)

_PHASES = tuple(p.value for p in Phase)
_phase_of: dict[tuple[str, str], str] = {}
_guard = threading.Lock()
for _phase in _PHASES:
    RUNS.labels(phase=_phase).set(0)


def _move(key: tuple[str, str], phase: str | None) -> None:
    """Moves run ``key`` to ``phase`` (None: gone) in the per-phase gauge: O(1) per reconcile (a
    recount of every run on each one cost O(runs), ~0.2 ms at 600 runs, growing with them)."""
    before = _phase_of.pop(key, None) if phase is None else _phase_of.get(key)
    if before == phase:
        return
    if phase is not None:
        _phase_of[key] = phase
        RUNS.labels(phase=phase).inc()
    if before is not None:
        RUNS.labels(phase=before).dec()


def observe_phase(key: tuple[str, str], phase: str) -> None:
    with _guard:
        _move(key, phase)


def observe_goodput(key: tuple[str, str], ratio: float | None) -> None:
    if ratio is not None:
        GOODPUT.labels(namespace=key[0], name=key[1]).set(ratio)


def forget_run(key: tuple[str, str]) -> None:
    with _guard:
        _move(key, None)
    with contextlib.suppress(KeyError):  # a run that never reported goodput
        GOODPUT.remove(key[0], key[1])
