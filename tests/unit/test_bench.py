"""The benchmark's own arithmetic (bench/): what the report's numbers are computed from.

The benchmark is not part of `make test` (it takes ~20 minutes), but its parsing of the audit log
and its lower bound decide what docs/benchmarks.md claims; these tests run them on made-up logs.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from bench.operator import (
    OPERATOR_USER,
    PHASES,
    REPEAT,
    audit_requests,
    histogram_between,
    latency_breakdown,
    percentiles,
    phase_order,
    wait_for_jobs,
)
from bench.operator_report import creation_bound, operator_report, phase_orders, round_figures

ROOT = Path(__file__).resolve().parents[2]


def stamp(monotonic: float) -> str:
    """An audit timestamp for a time on this process' time.monotonic() scale."""
    wall = monotonic + (time.time() - time.monotonic())
    return datetime.fromtimestamp(wall, UTC).isoformat().replace("+00:00", "Z")


def entry(
    verb: str, resource: str, name: str, *, user: str = OPERATOR_USER, phase: str | None = None, **extra: Any
) -> dict[str, Any]:
    resource, _, subresource = resource.partition("/")
    ref = {
        "resource": resource,
        "namespace": "ns",
        "name": name,
        **({"subresource": subresource} if subresource else {}),
    }
    body: dict[str, Any] = {
        "verb": verb,
        "user": {"username": user},
        "objectRef": ref,
        "responseStatus": {"code": 201 if verb == "create" else 200},
        "requestReceivedTimestamp": stamp(0.0),
        "stageTimestamp": stamp(0.0),
        **extra,
    }
    if phase is not None:
        body["requestObject"] = {"status": {"phase": phase}}
    return body


def write_log(path: Path, entries: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return path


def test_writes_to_running_count_creates_and_status_patches_but_not_events(tmp_path: Path) -> None:
    log = write_log(
        tmp_path / "audit.log",
        [
            # In order of arrival (the count sorts by it).
            entry("create", "jobsets", "r-0000", requestReceivedTimestamp=stamp(1.0)),
            entry("create", "events", "r-0000.abc", requestReceivedTimestamp=stamp(2.0)),
            entry(
                "patch", "tpufinetunes/status", "r-0000", phase="Pending", requestReceivedTimestamp=stamp(3.0)
            ),
            entry(
                "patch", "tpufinetunes/status", "r-0000", phase="Running", requestReceivedTimestamp=stamp(4.0)
            ),
            entry(
                "patch",
                "tpufinetunes/status",
                "r-0000",
                phase="Succeeded",
                requestReceivedTimestamp=stamp(5.0),
            ),
            entry("create", "jobsets", "r-0001", user="admin"),  # another client: not the operator's
            entry("list", "pods", ""),
        ],
    )
    api = audit_requests(log, 0, 1)
    assert api["writes_to_running_without_events_mean"] == 3
    assert api["writes"] == 5 and api["reads"] == 1
    assert api["events_per_run"] == 1 and api["status_patches_per_run"] == 3


def test_the_writes_made_while_jobsets_were_still_being_created_are_counted(tmp_path: Path) -> None:
    log = write_log(
        tmp_path / "audit.log",
        [
            entry("create", "jobsets", "r-0000", requestReceivedTimestamp=stamp(1.0)),
            entry(
                "patch", "tpufinetunes/status", "r-0000", phase="Pending", requestReceivedTimestamp=stamp(2.0)
            ),
            entry("create", "events", "r-0000.a", requestReceivedTimestamp=stamp(2.5)),
            entry("create", "jobsets", "r-0001", requestReceivedTimestamp=stamp(3.0)),  # the last one
            entry(
                "patch", "tpufinetunes/status", "r-0001", phase="Pending", requestReceivedTimestamp=stamp(4.0)
            ),
            entry("create", "jobsets", "r-0002", user="admin", requestReceivedTimestamp=stamp(9.0)),
        ],
    )
    during = audit_requests(log, 0, 2)["other_writes_until_last_jobset"]
    assert during == {"patch tpufinetunes/status": 1, "create events": 1}


def test_the_latency_is_split_at_the_posts(tmp_path: Path) -> None:
    base = time.monotonic()
    log = write_log(
        tmp_path / "audit.log",
        [
            entry(
                "create", "tpufinetunes", "r-0000", user="admin",
                requestReceivedTimestamp=stamp(base + 0.1), stageTimestamp=stamp(base + 0.3),
            ),
            entry(
                "create", "jobsets", "r-0000",
                requestReceivedTimestamp=stamp(base + 2.3), stageTimestamp=stamp(base + 2.8),
            ),
            # The JobSet controller's Job, and the one it made again on a restart (not its reaction).
            entry("create", "jobs", "r-0000-slice-0", user="jobset", requestReceivedTimestamp=stamp(base + 3.2)),
            entry("create", "jobs", "r-0000-slice-0", user="jobset", requestReceivedTimestamp=stamp(base + 9.0)),
        ],
    )  # fmt: skip
    split = latency_breakdown(log, 0, "ns", {"r-0000": base}, {"r-0000": base + 3.0})
    assert split["runs"] == 1

    def p50(key: str) -> float:
        return split[key]["p50"]

    assert p50("send_to_jobset_post") == pytest.approx(2.3, abs=0.01)
    assert p50("jobset_post_in_apiserver") == pytest.approx(0.5, abs=0.01)
    assert p50("jobset_post_done_to_seen") == pytest.approx(0.2, abs=0.01)
    assert p50("send_to_finetune_post") == pytest.approx(0.1, abs=0.01)
    assert p50("finetune_post_in_apiserver") == pytest.approx(0.2, abs=0.01)
    assert p50("finetune_done_to_jobset_post") == pytest.approx(2.0, abs=0.01)
    assert p50("jobset_stored_to_job_post") == pytest.approx(0.4, abs=0.01)  # the first Job's
    assert split["seconds_to_all_jobs_posted"] == pytest.approx(3.2, abs=0.01)
    assert split["seconds_to_all_jobsets_stored"] == pytest.approx(2.8, abs=0.01)  # no watch's lag


def test_the_bound_is_what_direct_creation_leaves_after_the_client_has_sent_everything() -> None:
    operator_phase = {"client_seconds_to_send_all": 1.0}
    assert creation_bound(operator_phase, {"seconds_to_all_jobsets": 5.0}) == pytest.approx(3.96)
    # A client slower than direct creation leaves no bound to report.
    assert creation_bound(operator_phase, {"seconds_to_all_jobsets": 0.5}) is None


def an_operator_phase(**codes: int) -> dict[str, Any]:
    """An operator phase: p99 2.0 s, all JobSets in 4.0 s, sent in 1.0 s; its API codes ``codes``."""
    return {
        "create_to_jobset": {"p99": 2.0, "min": 0.5},
        "create_to_jobset_samples": [],
        "client_seconds_to_send_all": 1.0,
        "seconds_to_all_jobsets": 4.0,
        "operator_api": {"writes_to_running_without_events_mean": 3, "by_code": codes},
        "operator_process": {"peak_rss_mb": 90.0, "cpu_ms_per_run": 40.0},
    }


DIRECT = {"create_to_jobset": {"p99": 0.5}, "seconds_to_all_jobsets": 3.0}


def test_a_round_is_judged_against_direct_creation_and_against_a_zero_reaction_controller() -> None:
    operator_phase, direct = an_operator_phase(**{"201": 9, "409": 1}), DIRECT
    zero = {
        "create_to_jobset": {"p99": 0.4, "min": 0.05},
        "client_seconds_to_send_all": 1.2,
        "seconds_to_all_jobsets": 3.5,
    }
    figures = round_figures(operator_phase, direct, zero)
    assert figures["limit"] == pytest.approx(1.98)  # 0.99 x (3.0 - 1.0), above the direct p99
    assert figures["all_to_direct"] == pytest.approx(4 / 3)
    # The pairs take longer to create than the JobSets alone: the limit is higher, the ratios lower.
    assert figures["zero_limit"] == pytest.approx(0.99 * 2.5)
    assert figures["p99_to_zero_limit"] == pytest.approx(2.0 / (0.99 * 2.5))
    assert figures["all_to_zero"] == pytest.approx(4 / 3.5)
    assert figures["zero_fastest"] == 0.05
    # The zero-reaction controller by the direct yardstick: its p99 against the limit its own
    # client's send time gives (0.99 x (3.0 - 1.2) = 1.78 > the direct p99), its time to all JobSets.
    assert figures["zero_p99_to_limit"] == pytest.approx(0.4 / (0.99 * 1.8))
    assert figures["zero_all_to_direct"] == pytest.approx(3.5 / 3.0)
    assert figures["operator_errors"] == 1
    older = round_figures(operator_phase, direct)  # results of a run without the zero-reaction phase
    assert older["zero_limit"] is None and older["all_to_zero"] is None


def test_a_round_is_judged_against_the_zero_reaction_controller_that_holds_the_operators_watches() -> None:
    operator_phase, direct = an_operator_phase(**{"201": 9}), DIRECT
    zero = {"create_to_jobset": {"p99": 0.4, "min": 0.05}, "seconds_to_all_jobsets": 3.5}
    watched = {"create_to_jobset": {"p99": 1.5, "min": 0.3}, "seconds_to_all_jobsets": 5.0}
    figures = round_figures(operator_phase, direct, zero, watched)
    assert figures["watched_limit"] == pytest.approx(0.99 * 4.0)  # its all JobSets - the send time
    assert figures["p99_to_watched_limit"] == pytest.approx(2.0 / (0.99 * 4.0))
    assert figures["all_to_watched"] == pytest.approx(4.0 / 5.0)  # the operator was faster
    assert figures["watched_fastest"] == 0.3
    assert round_figures(operator_phase, direct, zero)["watched_limit"] is None
    assert figures["stored_p99_to_watched"] is None  # results without the audit log's breakdown


def test_the_controllers_are_also_compared_where_the_api_server_stored_each_jobset() -> None:
    """Without the client's JobSet watch, whose lag differs from phase to phase: create -> stored
    from the audit log, and the first send -> the last JobSet stored."""

    def stored(p99: float, all_stored: float) -> dict[str, Any]:
        return {
            "send_to_jobset_stored": {"p50": p99 / 2, "p99": p99},
            "seconds_to_all_jobsets_stored": all_stored,
        }

    operator_phase = {**an_operator_phase(**{"201": 9}), "latency_breakdown": stored(1.8, 10.5)}
    watched = {
        "create_to_jobset": {"p99": 3.0, "min": 0.3},  # its client's watch lagged: 3.0 s seen, 1.5 s stored
        "seconds_to_all_jobsets": 5.0,
        "latency_breakdown": stored(1.5, 10.0),
    }
    figures = round_figures(operator_phase, DIRECT, None, watched)
    assert figures["watched_stored_p99"] == 1.5
    assert figures["stored_p99_to_watched"] == pytest.approx(1.2)
    assert figures["all_stored_to_watched"] == pytest.approx(1.05)
    # Older results (no seconds_to_all_jobsets_stored): the p99 ratio only.
    older = {**watched, "latency_breakdown": {"send_to_jobset_stored": {"p50": 0.7, "p99": 1.5}}}
    assert round_figures(operator_phase, DIRECT, None, older)["all_stored_to_watched"] is None
    assert figures["all_jobs"] is None  # results without the JobSet controller's Jobs


def test_the_time_to_every_runs_first_job_is_compared_too() -> None:
    """Where users' pods begin: the JobSet controller's last first-Job POST, phase against phase."""

    def jobs_by(seconds: float) -> dict[str, Any]:
        return {"send_to_jobset_stored": {"p50": 0.5, "p99": 1.0}, "seconds_to_all_jobs_posted": seconds}

    operator_phase = {**an_operator_phase(**{"201": 9}), "latency_breakdown": jobs_by(27.0)}
    n = 1000
    operator_phase.update(n=n, runs_with_jobs=n)
    watched = {
        "n": n,
        "create_to_jobset": {"p99": 3.0, "min": 0.3},
        "seconds_to_all_jobsets": 5.0,
        "latency_breakdown": jobs_by(25.0),
        "runs_with_jobs": n,
    }
    direct = {**DIRECT, "n": n, "latency_breakdown": jobs_by(20.0), "runs_with_jobs": n}
    figures = round_figures(operator_phase, direct, None, watched)
    assert figures["all_jobs"] == 27.0
    assert figures["all_jobs_to_watched"] == pytest.approx(1.08)
    assert figures["all_jobs_to_direct"] == pytest.approx(1.35)
    # A phase read before every run had its Job (or results from before the wait): no figure.
    cut_short = {**watched, "runs_with_jobs": n - 1}
    assert round_figures(operator_phase, direct, None, cut_short)["all_jobs_to_watched"] is None


def _with_fourth_phase(results: dict[str, Any], mode: str) -> dict[str, Any]:
    """``results`` with a fourth phase of ``mode`` in round one: its zero-reaction phase, twice as slow
    to all JobSets, its reaction split 0.3/0.6 s."""
    round_one = [p for p in results["phases"] if p.get("round", 0) == 0]
    for phase in [p for p in round_one if p["mode"] == "zero-reaction"]:
        split = dict(phase["latency_breakdown"])
        split["finetune_done_to_jobset_post"] = {"p50": 0.3, "p99": 0.6}
        results["phases"].append(
            {
                **phase,
                "mode": mode,
                "seconds_to_all_jobsets": 2 * phase["seconds_to_all_jobsets"],
                "operator_watch_events_per_run": {"pods": 7.5, "jobsets": 5.0},
                "latency_breakdown": split,
            }
        )
    return results


def _stored(ns: set[int], *, without: tuple[str, ...] = ()) -> dict[str, Any]:
    """The stored bench/results/operator.json at the sizes ``ns``, without the phases of ``without``."""
    results = json.loads((ROOT / "bench/results/operator.json").read_text())
    results["phases"] = [p for p in results["phases"] if p["n"] in ns and p["mode"] not in without]
    return results


def test_the_report_shows_the_watch_reaction_controller_where_it_ran() -> None:
    results = _stored({100, 300}, without=("watch-reaction",))  # results of a run without that phase
    assert "watch-reaction controller" not in "\n".join(operator_report(results))
    report = "\n".join(operator_report(_with_fourth_phase(results, "watch-reaction")))
    label = "a watch-reaction controller (learns of each run from its watch, as the operator must)"
    assert report.count(f"{label} (12.5 watch events per run)") == 2  # N=100, 300
    assert report.count(f"against {label}:") == 2
    assert (
        report.count("the watch-reaction controller's 0.30/0.60") == 2
    )  # its reaction, beside the operator's
    assert "operator/direct/zero-reaction/watched" in report


def test_the_report_sets_the_operators_cpu_during_the_burst_beside_the_watch_reaction_controllers() -> None:
    results = _with_fourth_phase(_stored({100, 300}, without=("watch-reaction",)), "watch-reaction")
    for phase in results["phases"]:
        if phase.get("round", 0) == 0 and phase["mode"] == "operator":
            phase["operator_process"]["cpu_ms_per_run_to_all_jobsets"] = 2.5
        if phase["mode"] == "watch-reaction":
            phase["controller_cpu_ms_per_run_to_all_jobsets"] = 1.25
    report = "\n".join(operator_report(results))
    assert report.count("CPU until the last JobSet 2.50 ms/run, the watch-reaction controller's 1.25") == 2


def test_the_report_still_reads_the_older_watched_zero_reaction_phase() -> None:
    results = _with_fourth_phase(_stored({100, 300}, without=("watch-reaction",)), "zero-reaction-watched")
    report = "\n".join(operator_report(results))
    label = "a zero-reaction controller that holds the operator's watches"
    assert report.count(f"{label} (12.5 watch events per run)") == 2
    assert report.count(f"against {label}:") == 2
    assert "watch-reaction controller's" not in report  # its reaction is the client's, not a watch's


def test_over_four_rounds_every_phase_runs_once_at_every_place() -> None:
    orders = [phase_order(round_) for round_ in range(len(PHASES))]
    assert orders[0] == PHASES  # the first round in the documented order
    for order in orders:
        assert sorted(order) == sorted(PHASES)
    for place in range(len(PHASES)):
        assert sorted(order[place] for order in orders) == sorted(PHASES)
    assert phase_order(len(PHASES)) == orders[0]  # and again from the fifth round


def test_the_report_says_how_the_phases_of_each_round_ran() -> None:
    phases = [
        {"n": n, "round": round_, "position": place, "mode": mode}
        for round_ in range(2)
        for n in (100, 300)
        for place, mode in enumerate(phase_order(round_))
    ]
    line = phase_orders({"cluster_per_phase": True, "phases": phases})[0]
    assert line.endswith(
        "1: operator, direct, zero-reaction, watch-reaction;"
        " 2: direct, zero-reaction, watch-reaction, operator"
    )
    assert "one cluster per round" in phase_orders({"phases": phases})[0]  # results before the change


def test_the_report_says_when_the_phases_places_are_not_balanced() -> None:
    def results(rounds: int) -> dict[str, object]:
        phases = [
            {"n": 100, "round": round_, "position": place, "mode": mode}
            for round_ in range(rounds)
            for place, mode in enumerate(phase_order(round_))
        ]
        return {"cluster_per_phase": True, "phases": phases}

    assert REPEAT % len(PHASES) == 0  # the default is balanced
    assert len(phase_orders(results(REPEAT))) == 1
    three = phase_orders(results(3))
    assert len(three) == 2
    assert "NOT balanced" in three[1]
    assert "operator 2.67" in three[1] and "zero-reaction 2.00" in three[1]


def test_percentiles() -> None:
    values = [float(v) for v in range(1, 101)]
    p = percentiles(values)
    assert (p["p50"], p["p95"], p["p99"], p["max"], p["count"]) == (50.5, 96.0, 100.0, 100.0, 100)
    assert percentiles([])["p99"] is None


def test_a_wall_clock_step_leaves_no_breakdown_rather_than_a_wrong_one(tmp_path: Path) -> None:
    base = time.monotonic()
    log = write_log(
        tmp_path / "audit.log",
        [
            entry(
                "create", "jobsets", "r-0000",
                requestReceivedTimestamp=stamp(base - 17.6), stageTimestamp=stamp(base - 17.4),
            ),
        ],
    )  # fmt: skip
    split = latency_breakdown(log, 0, "ns", {"r-0000": base}, {"r-0000": base + 0.3})
    assert split == {"runs": 1, "clock_stepped_runs": 1}


def test_report_of_a_file_reports_that_file_and_draws_its_plot_beside_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m bench report FILE` (and a run's `--output`) shows that run, not the stored
    operator.json, and leaves the committed plot alone."""
    from bench.__main__ import main

    stored = ROOT / "bench/results/operator.json"
    results = _stored({1000})
    assert {p["n"] for p in results["phases"]} == {1000}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(results))
    main(["report", str(path)])
    out = capsys.readouterr().out
    assert "N=1000 (4 rounds)" in out and "N=300" not in out.split("the operator's own latency")[0]
    assert (tmp_path / "run.png").stat().st_size > 0
    assert {p["n"] for p in json.loads(stored.read_text())["phases"]} != {1000}  # the other file


def test_the_operators_histograms_are_read_from_its_metrics_between_two_scrapes() -> None:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    registry = CollectorRegistry()
    waits = Histogram("waits_seconds", "", ["work"], buckets=(0.1, 0.5, 1, 5), registry=registry)
    lag = Histogram("lag_seconds", "", buckets=(0.01, 0.1), registry=registry)
    waits.labels(work="create").observe(4.0)  # before the burst: not counted
    before = generate_latest(registry).decode()
    for seconds in [0.05] * 60 + [0.3] * 39 + [3.0]:
        waits.labels(work="create").observe(seconds)
    waits.labels(work="other").observe(0.7)
    lag.observe(0.05)
    after = generate_latest(registry).decode()
    waited = histogram_between(before, after, "waits_seconds")
    assert waited["work=create"] == {"count": 100, "p50_at_most": 0.1, "p99_at_most": 0.5}
    assert waited["work=other"] == {"count": 1, "p50_at_most": 1.0, "p99_at_most": 1.0}
    assert histogram_between(before, after, "lag_seconds") == {
        "": {"count": 1, "p50_at_most": 0.1, "p99_at_most": 0.1}
    }


def test_log_lines_are_counted_from_where_the_phase_began(tmp_path: Path) -> None:
    from bench.operator import logged_since

    log = tmp_path / "operator.log"
    log.write_bytes(b"Connection pool is full, discarding connection: 127.0.0.1\nstarting\n")
    offset = log.stat().st_size  # an earlier phase's line stays out
    with log.open("ab") as more:
        more.write(b"created JobSet r-0001\nConnection pool is full, discarding connection: 127.0.0.1\n")
    assert logged_since(log, offset, "Connection pool is full") == 1
    assert logged_since(log, 0, "Connection pool is full") == 2


def test_a_phase_waits_for_the_jobset_controllers_jobs_before_counting_them(tmp_path: Path) -> None:
    """The yardstick phases end at their last JobSet, while the JobSet controller still makes Jobs:
    their Jobs must be waited for, or their time to all Jobs is cut short."""
    elsewhere = entry("create", "jobs", "r-0002-slice-0", user="jobset")
    elsewhere["objectRef"]["namespace"] = "elsewhere"  # another phase's run: never counted
    log = write_log(
        tmp_path / "audit.log", [entry("create", "jobs", "r-0000-slice-0", user="jobset"), elsewhere]
    )
    later = json.dumps(entry("create", "jobs", "r-0001-slice-0", user="jobset")) + "\n"

    def the_controller_goes_on() -> None:
        time.sleep(0.3)
        with log.open("a") as out:  # a line written in two parts: read only once it is whole
            out.write(later[:20])
            out.flush()
            time.sleep(1.5)
            out.write(later[20:])

    writer = threading.Thread(target=the_controller_goes_on)
    writer.start()
    assert wait_for_jobs(log, 0, "ns", 2, timeout=20) == 2
    writer.join()
    started = time.monotonic()
    assert wait_for_jobs(log, 0, "ns", 3, timeout=1.0) == 2  # a run whose Job never came: gives up
    assert time.monotonic() - started >= 1.0


def test_status_lag_is_measured_from_each_runs_create_and_all_running_only_when_every_run_got_there() -> None:
    from bench.operator import Observations, status_lag

    sent = {"r-0000": 10.0, "r-0001": 11.0}
    obs = Observations()
    obs.finetune_event("MODIFIED", {"metadata": {"name": "r-0000"}, "status": {}}, 10.5)  # no phase yet
    obs.finetune_event("MODIFIED", {"metadata": {"name": "r-0000"}, "status": {"phase": "Pending"}}, 12.0)
    obs.finetune_event("MODIFIED", {"metadata": {"name": "r-0000"}, "status": {"phase": "Running"}}, 14.0)
    obs.finetune_event("MODIFIED", {"metadata": {"name": "r-0001"}, "status": {"phase": "Running"}}, 13.0)
    lag = status_lag(sent, obs, started=10.0)
    assert lag["create_to_first_status"]["min"] == 2.0 and lag["create_to_first_status"]["max"] == 2.0
    assert sorted([lag["create_to_running"]["min"], lag["create_to_running"]["max"]]) == [2.0, 4.0]
    assert lag["seconds_to_all_running"] == 4.0
    sent["r-0002"] = 12.0  # a run never seen Running: no time to all of them
    assert status_lag(sent, obs, started=10.0)["seconds_to_all_running"] is None


def pace_phase(qps: float, round_: int, first_jobs: float, running_p50: float) -> dict[str, Any]:
    return {
        "n": 1000,
        "write_qps": qps,
        "round": round_,
        "seconds_to_all_jobsets": 10.0,
        "create_to_jobset": {"p99": 2.0},
        "latency_breakdown": {
            "seconds_to_all_jobs_posted": first_jobs,
            "jobset_stored_to_job_post": {"p50": 5},
        },
        "create_to_first_status": {"p50": 3.0, "p99": 9.0},
        "create_to_running": {"p50": running_p50, "p99": 40.0},
        "seconds_to_all_running": 50.0,
        "seconds_to_all_succeeded": 300.0,
        "operator_api": {"writes_per_run": 7.0},
        "runs_seen_running": 1000 - round_,
        "operator_process": {"cpu_ms_per_run": 22.0},
        "operator_reconcile_to_all_jobsets": {"work=other": {"count": 100 + 1000 * round_}},
    }


def test_the_pace_benchmark_alternates_its_order_and_reports_medians_against_no_pace() -> None:
    from bench import pace

    assert pace.order([0, 50], 0) == [0, 50] and pace.order([0, 50], 1) == [50, 0]
    results = {
        "phases": [
            pace_phase(0, 0, 60.0, 30.0),
            pace_phase(50, 0, 30.0, 20.0),
            pace_phase(50, 1, 40.0, 24.0),
            pace_phase(0, 1, 50.0, 34.0),
        ]
    }
    table = pace.medians(results)
    assert table[0.0]["every run's first Job s"] == 55.0 and table[50.0]["every run's first Job s"] == 35.0
    assert table[50.0]["rounds"] == 2
    assert table[50.0]["other reconciles in burst"] == 600  # 100 and 1100
    text = "\n".join(pace.report(results))
    assert "TPUFT_WRITE_QPS=50 against no pace: every run's first Job 0.64x, first status p50 1.00x" in text
    assert "runs never shown Running 0.50 (0.50)" in text  # the median of 0 and 1
    assert "medians of 2, 2 rounds per pace" in text


# ---- bench/scale.py: sharded checkpoints, sliced loading, streamed export at three sizes -------------

GB = 10**9


def scale_run(exit_code: int = 0, peak_gb: float = 4.0, **metrics: Any) -> dict[str, Any]:
    """A harness record of one `tpuft train` process, its trainer's metrics made up."""
    return {"exit_code": exit_code, "peak_rss_bytes": int(peak_gb * GB), "metrics": metrics or None}


def scale_runs(
    *,
    blocked: float = 0.1,
    device_wait: float | None = 1.8,
    plain_gb: float = 4.0,
    periodic_gb: float = 4.4,
    exit_s: float = 9.0,
) -> dict[str, dict[str, Any]]:
    """The five runs of one size as the current trainer leaves them (168M parameters: a 2.69 GB
    state): 8 steps, the first three compiling; saves at 2, 4 and 6 in the background, 8 at the end.
    ``device_wait``: what each save waited for the device to finish the steps dispatched ahead (None:
    a trainer that timed it with the staging, in its blocked seconds)."""
    steps = [8.0, 8.0 + blocked, 2.0, 2.0 + blocked, 2.1, 2.0 + blocked, 1.9]  # steps 2..8
    split = {} if device_wait is None else {"device_wait_seconds": device_wait, "staging_seconds": blocked}
    checkpoints = [
        {
            "step": s,
            **split,
            "blocked_seconds": blocked,
            "write_seconds": 3.0 + s / 4,
            "seconds": 3.5,
            "reason": "periodic",
        }
        for s in (2, 4, 6)
    ]
    checkpoints.append(
        {"step": 8, "blocked_seconds": 4.0, "write_seconds": 3.9, "seconds": 4.0, "reason": "final"}
    )
    return {
        "plain": scale_run(
            peak_gb=plain_gb,
            step_seconds=[8.0, 8.0, 2.0, 2.1, 1.9, 2.2, 2.0],
            peak_rss={"load": 2 * GB, "train": 4 * GB, "export": 3 * GB, "process": 4 * GB},
        ),
        "periodic": scale_run(peak_gb=periodic_gb, step_seconds=steps, attempt={"checkpoints": checkpoints}),
        "sigterm_in_save": {
            **scale_run(
                75, 4.3, stopped={"step": 4, "trained_to": 4, "steps_lost": 0, "signal_to_exit_seconds": 4.1}
            ),
            "signal": {"step_at_signal": 4, "to_exit_seconds": exit_s, "save_in_flight": True},
            "checkpoints": [2, 4],
            "steps_logged": [1, 2, 3, 4],
        },
        "sigterm_between_saves": {
            **scale_run(75, 4.3, stopped={"step": 5, "trained_to": 5, "steps_lost": 0, "save_seconds": 4.0}),
            "signal": {"step_at_signal": 4, "to_exit_seconds": exit_s, "save_in_flight": False},
            "checkpoints": [2, 4, 5],
            "steps_logged": [1, 2, 3, 4, 5],
        },
        "resume_export": scale_run(
            peak_gb=4.2,
            resumed_from="checkpoint-4",
            model_load={"seconds": 1.5},
            attempt={"startup_seconds": 20.0},
            peak_rss={"load": 1 * GB, "train": 4.2 * GB, "export": 3 * GB, "process": 4.2 * GB},
        ),
    }


def test_the_median_step_leaves_out_the_warmup_and_the_steps_a_save_ran_in() -> None:
    from bench.scale import compiled_late, median_step, save_gaps

    steps = [8.0, 9.0, 2.0, 9.0, 2.2, 8.0, 1.8]  # steps 2..8; saves after steps 2, 4 and 6
    assert median_step(steps, warmup=0) == 8.0
    assert median_step(steps) == 2.2  # steps 4..8: 2.0, 9.0, 2.2, 8.0, 1.8
    assert median_step(steps, 1, [2, 4, 6]) == 2.0  # steps 4, 6 and 8
    # The save at 2 is followed by a step that also compiles: no gap for it.
    assert save_gaps(steps, 1, [2, 4, 6]) == {4: 7.0, 6: 6.0}
    # A process resumed from checkpoint-4 ran steps 5..8: its warm-up is 5, 6 and 7.
    assert median_step([9.0, 9.0, 2.5], 5, [6]) == 2.5 and save_gaps([9.0, 9.0, 2.5], 5, [6]) == {}
    # Compilations after the warm-up are pointed out (those steps' times are not training alone).
    assert compiled_late({"1": 5, "2": 7, "3": 8, "4": 8, "5": 8}) == []
    assert compiled_late({"1": 5, "2": 7, "3": 8, "4": 8, "5": 9}) == [5]
    assert compiled_late(None) == []


def test_the_peak_rss_is_the_largest_of_the_kernels_the_samples_and_the_trainers() -> None:
    from bench.scale import peak_rss

    # A trainer that resets VmHWM between parts also resets what ru_maxrss is taken from.
    assert peak_rss(2 * GB, 3 * GB, {"load": GB, "train": 3 * GB, "export": 4 * GB}) == 4 * GB
    assert peak_rss(5 * GB, 3 * GB, None) == 5 * GB


def test_a_periodic_save_is_judged_by_what_the_trainer_says_it_blocked_or_else_by_the_step_gap() -> None:
    from bench.scale import periodic_saves

    new = periodic_saves(scale_runs(blocked=0.3)["periodic"])
    assert [(s["step"], s["blocked_seconds"], s["blocked_from"], s["write_seconds"]) for s in new] == [
        (2, 0.3, "trainer", 3.5),
        (4, 0.3, "trainer", 4.0),
        (6, 0.3, "trainer", 4.5),
    ]
    assert new[1]["median_step_seconds"] == 2.0 and new[1]["blocked_to_median_step"] == 0.15
    assert new[1]["gap_seconds"] == 0.3 and new[0]["gap_seconds"] is None  # the step times agree
    # Apart from it, the wait for the device to finish the steps dispatched ahead (not lost).
    assert [(s["device_wait_seconds"], s["staging_seconds"]) for s in new] == [(1.8, 0.3)] * 3
    assert new[1]["device_wait_to_median_step"] == 0.9
    # A trainer before issue 46 timed the device wait with the staging: its blocked seconds say so.
    unsplit = periodic_saves(scale_runs(blocked=0.3, device_wait=None)["periodic"])
    assert [(s["blocked_seconds"], s["blocked_from"], s["device_wait_seconds"]) for s in unsplit] == [
        (0.3, "trainer, device wait included", None)
    ] * 3
    # Against the plain run's median step where there is one (this run's steps ran beside writes).
    against_plain = periodic_saves(scale_runs(blocked=0.3)["periodic"], plain_median=4.0)
    assert (
        against_plain[1]["blocked_to_median_step"] == 0.075 and against_plain[1]["median_step_of"] == "plain"
    )
    # The earlier trainer's metrics have no blocked_seconds: the step that included the save tells,
    # or in the warm-up its own seconds of the (synchronous) save.
    old = periodic_saves(
        scale_run(
            step_seconds=[8.0, 12.0, 2.0, 14.0, 2.0, 13.0, 2.0],
            attempt={"checkpoints": [{"step": 2, "seconds": 9.5}]},
        )
    )
    assert [(s["blocked_seconds"], s["blocked_from"], s["save_seconds"]) for s in old] == [
        (9.5, "synchronous save seconds", 9.5),
        (12.0, "step gap", None),
        (11.0, "step gap", None),
    ]
    assert old[1]["blocked_to_median_step"] == 6.0


def test_a_stop_counts_the_saves_after_the_signal_and_the_steps_it_lost() -> None:
    from bench.scale import stop_figures

    runs = scale_runs()
    in_save = stop_figures(runs["sigterm_in_save"])
    assert in_save["saves_after_signal"] == 0 and in_save["steps_lost"] == 0
    assert in_save["signal_to_exit_seconds"] == 9.0 and in_save["trainer_signal_to_exit_seconds"] == 4.1
    between = stop_figures(runs["sigterm_between_saves"])
    assert between["saves_after_signal"] == 1 and between["stop_save_seconds"] == 4.0
    # An earlier trainer that saved again at step 5 after a SIGTERM during checkpoint-4 (no `stopped`
    # figures of its own): the harness's count, steps lost from the last step logged.
    old = stop_figures(
        {
            **scale_run(75),
            "signal": {"step_at_signal": 4, "to_exit_seconds": 40.0},
            "checkpoints": [2, 4, 5],
            "steps_logged": [1, 2, 3, 4, 5],
        }
    )
    assert old["saves_after_signal"] == 1 and old["steps_lost"] == 0
    killed = stop_figures(
        {**scale_run(-9), "signal": {"step_at_signal": 4}, "checkpoints": [2], "steps_logged": [4]}
    )
    assert killed["exit_code"] == -9 and killed["steps_lost"] is None


def test_the_targets_are_met_or_say_what_limits_them() -> None:
    from bench.scale import fits, size_figures, verdicts

    params = 168_000_000
    good = verdicts(size_figures(scale_runs(), params))
    assert [v.met for v in good] == [True, True, None, True, True, True, True]  # (no training parts)
    assert not any(v.limited_by for v in good)
    assert good[0].value == (
        "0.10 s at step 2 (0.05x), 0.10 s at step 4 (0.05x), 0.10 s at step 6 (0.05x)"
        " of a 2.00 s median step (plain run); before its staging each waited 1.80 s for the device"
        " to finish the steps dispatched ahead (not lost: the device computed them); the periodic run's own"
        " steps 2.00 s (1.00x plain's: each ran beside a save's background write)"
    )
    unsplit = verdicts(size_figures(scale_runs(device_wait=None), params))[0]
    assert unsplit.value.startswith("0.10 s at step 2 (0.05x, trainer, device wait included), ")
    assert "; device wait and staging not yet measured apart;" in unsplit.value
    assert good[3].value == "4.00 GB / 2.69 GB = 1.49x"

    bad = verdicts(size_figures(scale_runs(blocked=1.0, plain_gb=6.0, periodic_gb=8.8, exit_s=45.0), params))
    assert [v.met for v in bad] == [False, False, None, False, False, False, True]
    assert "staging copy of 2.0 GB" in bad[0].limited_by and "at 2.0 GB/s" in bad[0].limited_by
    assert "+16.7 B/param" in bad[1].limited_by and "state / H" in bad[1].limited_by
    assert bad[3].value == "6.00 GB / 2.69 GB = 2.23x" and "device memory is host memory" in bad[3].limited_by
    assert bad[4].value.startswith("45.0 s, 0 step(s) lost, 0 save(s) after the signal")

    # Resuming and exporting against the plain run's training peak; the export's gather group says why.
    big = scale_runs()
    big["resume_export"] = scale_run(
        peak_gb=5.5,
        peak_rss={"load": 1 * GB, "train": 4.2 * GB, "export": 5.5 * GB, "process": 5.5 * GB},
        export={"largest_group_bytes": 672 * 10**6},
    )
    big["periodic"]["metrics"]["peak_rss"] = {"train": 5 * GB}  # the training parts: 5 / 4 GB
    judged = verdicts(size_figures(big, params))
    assert judged[2].met is False and judged[2].value == "5.00 GB / 4.00 GB = 1.25x"
    assert judged[2].limited_by.startswith("+6.0 B/param: the staging copy")
    resumed = judged[6]
    assert resumed.met is False and resumed.value.startswith("5.50 GB / 4.00 GB = 1.38x")
    assert "export 5.50 GB" in resumed.limited_by and "largest gather group is 0.67 GB" in resumed.limited_by

    # A run that died (an earlier trainer OOM-killed) is a result: judged not met, no crash.
    dead = scale_runs()
    dead["plain"] = scale_run(-9, 20.0)
    figures = size_figures(dead, params)
    assert figures["periodic"]["peak_rss_to_plain"] is None
    assert [v.met for v in verdicts(figures)][1] is None
    # Over the sizes: peak = runtime + bytes per parameter.
    by_size = {
        "a": size_figures(scale_runs(), 100_000_000),
        "b": {**size_figures(scale_runs(), 300_000_000), "plain": {"exit_code": 0, "peak_rss_bytes": 8 * GB}},
    }
    assert fits(by_size)["plain"] == {"intercept_gb": 2.0, "bytes_per_param": 20.0}


def test_the_sampled_phase_peaks_split_the_run_at_the_data_and_the_last_step() -> None:
    from bench.scale import phase_peaks

    timeline = [(0.5, 100, 0, 0), (10.0, 300, 0, 0), (20.0, 900, 0, 0), (30.0, 700, 0, 0), (31.0, 500, 0, 0)]
    assert phase_peaks(timeline, {"data_ready": 10.0, "last_step": 25.0}, 31.0) == {
        "load": 300,
        "train": 900,
        "after": 700,
    }
    assert phase_peaks(timeline, {"data_ready": None, "last_step": None}, 31.0) == {}


def test_the_scale_report_shows_both_trainers_and_the_verdicts(tmp_path: Path) -> None:
    from bench import scale

    def side(runs: dict[str, Any]) -> dict[str, Any]:
        return {"168M": {"figures": scale.size_figures(runs, 168_000_000), "runs": runs}}

    results: dict[str, Any] = {
        "what": "made up",
        "when": "2026-12-06 10:00-11:00 UTC",
        "machine": {"cpus": 2, "memory_gib": 23.4},
        "trainer": {"head": "6c46f5e"},
        "sizes": side(scale_runs()),
        "compare_ref": {
            "ref": "768b6be",
            "commit": "768b6be" + "0" * 33,
            "sizes": side(scale_runs(blocked=8.0)),
        },
    }
    scale._judge(results)
    text = "\n".join(scale.report(results))
    assert "current trainer (6c46f5e + working tree)" in text and "768b6be (768b6be; blocked" in text
    assert "targets at 168M (current):" in text and "targets at 168M (768b6be):" in text
    assert "periodic save blocks training: 8.00 s at step 2 (4.00x)" in text
    assert "the whole save blocks" in text and "the staging copy of" not in text  # (the earlier trainer's)
    assert scale.plot(results, tmp_path / "scale.png").is_file()


# ---- the backends side by side (bench/backends.py) ----------------------------------------------------


def backend_metrics(step_seconds: list[float], blocked: float, parts: dict[str, int]) -> dict[str, Any]:
    """A made-up `tpuft-metrics.json`: 20 steps, periodic saves at 5, 10 and 15, the final one at 20."""
    saves = [
        {"step": s, "reason": "periodic", "blocked_seconds": blocked, "staging_seconds": blocked,
         "device_wait_seconds": 0.0, "write_seconds": 0.8, "seconds": 0.9}
        for s in (5, 10, 15)
    ] + [{"step": 20, "reason": "final", "blocked_seconds": 1.0, "staging_seconds": 0.1,
          "device_wait_seconds": 0.0, "write_seconds": 0.9, "seconds": 1.0}]  # fmt: skip
    return {"step_seconds": step_seconds, "attempt": {"checkpoints": saves}, "peak_rss": parts}


def test_the_backends_step_time_leaves_out_the_warmup_and_the_steps_after_a_save() -> None:
    from bench.backends import periodic_saves_of, step_figures

    # step_seconds[i] is step i + 2: steps 2 and 3 compile, 6, 11 and 16 follow a periodic save.
    odd = {2: 40.0, 3: 30.0, 6: 5.0, 11: 5.0, 16: 5.0, 4: 0.2, 20: 0.9}
    steps = [odd.get(step, 0.5) for step in range(2, 21)]
    metrics = backend_metrics(steps, 0.2, {})
    assert [s["step"] for s in periodic_saves_of(metrics)] == [5, 10, 15]  # not the final save
    figures = step_figures(metrics, positions_per_step=1000)
    assert figures["timed_steps"] == [4, 5, 7, 8, 9, 10, 12, 13, 14, 15, 17, 18, 19, 20]
    assert figures["median_step_seconds"] == 0.5 and figures["tokens_per_second"] == 2000.0
    after_warmup = steps[2:]  # steps 4..20, the saves' steps included
    assert figures["tokens_per_second_with_saves"] == round(1000 * 17 / sum(after_warmup), 1)


def test_each_process_peak_is_sampled_and_rank_zeros_at_least_what_its_trainer_recorded() -> None:
    from bench.backends import process_peaks, rss_figures

    gb = 10**9
    seen = {
        10: {"role": "launcher", "hwm": 1 * gb, "anon": 1, "file": 2},
        12: {"role": "worker 1", "hwm": 2 * gb, "anon": 1, "file": 2},
        11: {"role": "worker 0", "hwm": 2 * gb, "anon": 1, "file": 2},
    }
    # The trainer's train part peaked between two samples (just before it reset VmHWM).
    peaks = process_peaks(seen, {"load": gb, "train": 3 * gb, "export": 2 * gb})
    assert [(p["role"], p["peak_bytes"], p["from"]) for p in peaks] == [
        ("launcher", 1 * gb, "sampled"), ("worker 0", 3 * gb, "trainer"), ("worker 1", 2 * gb, "sampled"),
    ]  # fmt: skip
    figures = rss_figures(peaks, peak_total_rss=5 * gb, peak_total_pss=3 * gb)
    assert figures["sum_of_peaks_bytes"] == 6 * gb and figures["largest_process_bytes"] == 3 * gb
    assert figures["process_count"] == 3
    # The xla run: one process, rank 0; a sample above the trainer's parts stands.
    (xla,) = process_peaks({7: {"role": "process", "hwm": 4 * gb, "anon": 1, "file": 2}}, {"train": 3 * gb})
    assert (xla["peak_bytes"], xla["from"]) == (4 * gb, "sampled")


def test_the_backends_alternate_and_are_compared_by_their_means_and_round_by_round() -> None:
    from bench.backends import max_loss_difference, order, summary

    assert order(2) == ["xla", "native", "native", "xla"] and order(1) == ["xla", "native"]

    def run(backend: str, step: float, rss: int, blocked: float, losses: dict[int, float]) -> dict[str, Any]:
        return {
            "backend": backend,
            "steps": {"median_step_seconds": step, "tokens_per_second": 1000 / step,
                      "tokens_per_second_with_saves": 900 / step},
            "rss": {"sum_of_peaks_bytes": rss, "largest_process_bytes": rss, "peak_total_pss_bytes": rss},
            "saves": [{"blocked_seconds": blocked, "staging_seconds": blocked, "write_seconds": 1.0}],
            "wall_seconds": 60.0, "losses": losses,
        }  # fmt: skip

    runs = [
        run("xla", 1.0, 100, 0.2, {1: 6.0, 2: 5.5}),
        run("native", 0.5, 300, 0.1, {1: 6.0, 2: 5.5001}),
        run("native", 1.5, 300, 0.1, {1: 6.0, 2: 5.5}),
        run("xla", 1.0, 100, 0.2, {1: 6.0, 2: 5.5}),
    ]
    result = summary(runs)
    # Speed: each backend's best run (another job's burst slows one run, not the backend).
    assert result["xla"]["median_step_seconds"] == 1.0 and result["native"]["median_step_seconds"] == 0.5
    assert (
        result["native"]["tokens_per_second"] == 2000.0
        and result["native_over_xla"]["tokens_per_second"] == 2.0
    )
    assert result["native_over_xla"]["rss_sum_of_peaks_bytes"] == 3.0  # memory: the mean of the runs
    assert result["native_over_xla"]["save_blocked_seconds"] == 0.5  # saves: the median of them all
    assert [r["median_step_seconds"] for r in result["native_over_xla_by_round"]] == [0.5, 1.5]
    assert result["how"]["median_step_seconds"] == "best" and result["how"]["save_blocked_seconds"] == "saves"
    assert max_loss_difference(runs) == 0.0001


def test_the_backends_harness_samples_every_process_of_the_run_and_names_the_workers(tmp_path: Path) -> None:
    """A launcher-like parent with two children (one a worker, by LOCAL_RANK) that hold memory: every
    process is found and its peak sampled."""
    import sys

    from bench.backends import Tree

    child = "import time; b = bytearray({size}); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.0)"
    parent = (
        "import os, subprocess, sys\n"
        f"w = subprocess.Popen([sys.executable, '-c', {child.format(size=60 * 2**20)!r}], "
        "env=dict(os.environ, LOCAL_RANK='0', OMP_NUM_THREADS='1'))\n"
        f"o = subprocess.Popen([sys.executable, '-c', {child.format(size=1)!r}])\n"
        "w.wait(); o.wait()\n"
    )
    tree = Tree([sys.executable, "-c", parent], {}, tmp_path / "log", "launcher")
    harness = tree.run()
    assert harness["exit_code"] == 0, (tmp_path / "log").read_text()
    roles = {seen["role"]: seen for seen in tree.samples.values()}
    assert len(roles) == 3 and {"launcher", "worker 0"} < set(roles)
    (other,) = set(roles) - {"launcher", "worker 0"}
    assert other.startswith("other (python")  # its name, from /proc/PID/comm
    assert roles["worker 0"]["hwm"] >= 60 * 2**20 and roles["worker 0"]["omp_num_threads"] == "1"
    assert tree.peak_total_rss >= 60 * 2**20 and tree.peak_total_pss > 0
    assert 0 <= harness["others_cpu_share"] <= 1 and len(harness["load_average"]) == 2
