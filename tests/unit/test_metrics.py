"""The per-phase run gauge (tpuft_runs): each run counted once, in its latest phase, until forgotten."""

from __future__ import annotations

from prometheus_client import REGISTRY

from tpuft_operator import metrics


def runs(phase: str) -> float:
    value = REGISTRY.get_sample_value("tpuft_runs", {"phase": phase})
    assert value is not None, f"tpuft_runs has no {phase} series"
    return value


def test_a_run_is_counted_in_its_latest_phase_until_forgotten() -> None:
    before = {phase: runs(phase) for phase in ("Pending", "Running", "Succeeded")}
    a, b = ("ns-metrics", "a"), ("ns-metrics", "b")

    metrics.observe_phase(a, "Pending")
    metrics.observe_phase(b, "Pending")
    metrics.observe_phase(a, "Pending")  # a reconcile that changed nothing counts nothing
    assert runs("Pending") - before["Pending"] == 2

    metrics.observe_phase(a, "Running")
    assert (runs("Pending") - before["Pending"], runs("Running") - before["Running"]) == (1, 1)

    metrics.observe_phase(a, "Succeeded")
    metrics.forget_run(b)
    metrics.forget_run(b)  # forgotten twice (the resync and the DELETED event): once is enough
    assert runs("Pending") - before["Pending"] == 0
    assert runs("Running") - before["Running"] == 0
    assert runs("Succeeded") - before["Succeeded"] == 1

    metrics.forget_run(a)
    assert {phase: runs(phase) for phase in before} == before
