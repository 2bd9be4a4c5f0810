"""`python -m bench pace`: what pacing the operator's status patches and Events buys, and what it costs.

The operator phase of `python -m bench operator` (a burst of N runs through the operator, on a fresh
cluster, after the same warm-up), once per write pace (`--qps`: the operator's TPUFT_WRITE_QPS; 0
is no pace), in alternating order round by round (A B, then B A) so that the machine's drift within
a round falls on both alike. Per pace, the medians over the rounds of:

- what it buys: when the JobSet controller had made every run's first Job (where pods begin), and
  each JobSet's wait for it;
- what it costs: when users see a status at all, and Running (the client's TPUFineTune watch; at
  N=1000 the runs also wait for the 300 node pools, so Running is mostly that wait), and how late
  a run is reported Succeeded after its JobSet completed;
- and that JobSets themselves are not slowed (create -> JobSet, time to all JobSets).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import operator as bench_operator
from bench import results_file
from tpuft_operator.settings import OperatorSettings

RESULTS = results_file("pace")
QPS_ENV = "TPUFT_WRITE_QPS"


def default_paces() -> list[float]:
    """No pace (the operator's default), and two paces measured on 2026-12-05."""
    return sorted({0.0, OperatorSettings().write_qps, 20.0, 50.0})


def order(paces: Sequence[float], round_: int) -> list[float]:
    """The paces in round ``round_``: as given in even rounds, reversed in odd ones."""
    return list(paces) if round_ % 2 == 0 else list(reversed(paces))


def main(n: int, paces: Sequence[float], rounds: int, output: Path = RESULTS) -> dict[str, Any]:
    phases: list[dict[str, Any]] = []
    results: dict[str, Any] = {}
    for round_ in range(rounds):
        for position, qps in enumerate(order(paces, round_)):
            print(f">> N={n}, round {round_ + 1} of {rounds}: the operator with {QPS_ENV}={qps:g}")
            result = bench_operator.fresh_phase("operator", n, operator_settings={QPS_ENV: f"{qps:g}"})
            result.update(write_qps=qps, round=round_, position=position)
            phases.append(result)
            print("   " + "; ".join(f"{label} {value}" for label, value in headline(result)))
            results = {
                "what": "the operator's burst of N runs at several write paces (TPUFT_WRITE_QPS), local cluster",
                "machine": bench_operator.machine(),
                "node_pools": {"type": "v5e", "topology": "2x2", "pools": bench_operator.POOLS},
                "write_burst": os.environ.get("TPUFT_WRITE_BURST") or OperatorSettings().write_burst,
                "rounds": rounds,
                "phases": phases,
            }
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_text(json.dumps(results, indent=1) + "\n")  # after every phase
    return results


def _get(phase: dict[str, Any], *path: str) -> float | None:
    value: Any = phase
    for key in path:
        value = (value or {}).get(key)
    return float(value) if isinstance(value, int | float) else None


# (label, how to read it from a phase): each reported as the median over the rounds of a pace.
FIGURES: list[tuple[str, Callable[[dict[str, Any]], float | None]]] = [
    ("all JobSets s", lambda p: _get(p, "seconds_to_all_jobsets")),
    ("create->JobSet p99 s", lambda p: _get(p, "create_to_jobset", "p99")),
    ("every run's first Job s", lambda p: _get(p, "latency_breakdown", "seconds_to_all_jobs_posted")),
    ("JobSet->first Job p50 s", lambda p: _get(p, "latency_breakdown", "jobset_stored_to_job_post", "p50")),
    ("first status p50 s", lambda p: _get(p, "create_to_first_status", "p50")),
    ("first status p99 s", lambda p: _get(p, "create_to_first_status", "p99")),
    ("Running p50 s", lambda p: _get(p, "create_to_running", "p50")),
    ("Running p99 s", lambda p: _get(p, "create_to_running", "p99")),
    ("all Running s", lambda p: _get(p, "seconds_to_all_running")),
    # Runs whose status went from Pending to Succeeded: their pods ran and finished (kwok: 1-5 s)
    # before the operator wrote Running.
    (
        "runs never shown Running",
        lambda p: p["n"] - p["runs_seen_running"] if "runs_seen_running" in p else None,
    ),
    ("all Succeeded s", lambda p: _get(p, "seconds_to_all_succeeded")),
    # The status's own lag: the JobSet Completed (the client's JobSet watch) -> the run Succeeded.
    ("JobSet done->Succ p50 s", lambda p: _get(p, "jobset_completed_to_succeeded", "p50")),
    ("JobSet done->Succ p99 s", lambda p: _get(p, "jobset_completed_to_succeeded", "p99")),
    (
        "status pace wait p99 <= s",
        lambda p: _get(p, "operator_write_pace_wait", "write=status", "p99_at_most"),
    ),
    ("Event pace wait p99 <= s", lambda p: _get(p, "operator_write_pace_wait", "write=event", "p99_at_most")),
    # Reconciles that created nothing, made while JobSets were still being created: they compete
    # with the creates (a resync that fell in the burst once made 1355-1648 of them, docs/benchmarks.md).
    (
        "other reconciles in burst",
        lambda p: _get(p, "operator_reconcile_to_all_jobsets", "work=other", "count"),
    ),
    ("writes/run", lambda p: _get(p, "operator_api", "writes_per_run")),
    ("CPU ms/run", lambda p: _get(p, "operator_process", "cpu_ms_per_run")),
]


def headline(phase: dict[str, Any]) -> list[tuple[str, float | None]]:
    return [(label, read(phase)) for label, read in FIGURES]


def medians(results: dict[str, Any]) -> dict[float, dict[str, float | None]]:
    """Per pace: the median over its rounds of every figure of `FIGURES`."""
    by_pace: dict[float, list[dict[str, Any]]] = {}
    for phase in results["phases"]:
        by_pace.setdefault(float(phase["write_qps"]), []).append(phase)
    out: dict[float, dict[str, float | None]] = {}
    for qps, phases in by_pace.items():
        out[qps] = {}
        for label, read in FIGURES:
            values = [v for p in phases if (v := read(p)) is not None]
            out[qps][label] = statistics.median(values) if values else None
        out[qps]["rounds"] = len(phases)
    return out


def report(results: dict[str, Any]) -> list[str]:
    table = medians(results)
    paces = sorted(table)
    heads = [f"{QPS_ENV}={qps:g}" + (" (no pace)" if qps == 0 else "") for qps in paces]
    n = results["phases"][0]["n"] if results["phases"] else 0
    rounds = ", ".join(f"{table[q]['rounds']:.0f}" for q in paces)
    lines = [
        f"write pace (python -m bench pace): a burst of N={n} runs through the operator, medians of"
        f" {rounds} rounds per pace",
        f"{'':>26}" + "".join(f"{h:>26}" for h in heads),
    ]
    for label, _ in FIGURES:
        cells = "".join(f"{_cell(table[q][label]):>26}" for q in paces)
        lines.append(f"{label:>26}{cells}")
    if 0.0 in table:
        base = table[0.0]
        for qps in paces:
            if qps == 0.0:
                continue
            row = table[qps]
            jobs = "every run's first Job s"
            lines.append(
                f"  {QPS_ENV}={qps:g} against no pace: every run's first Job"
                f" {_ratio(row[jobs], base[jobs])}x,"
                f" first status p50 {_ratio(row['first status p50 s'], base['first status p50 s'])}x,"
                f" p99 {_ratio(row['first status p99 s'], base['first status p99 s'])}x;"
                f" JobSet done->Succeeded p99 {_cell(row['JobSet done->Succ p99 s'])} s"
                f" ({_cell(base['JobSet done->Succ p99 s'])} s);"
                f" runs never shown Running {_cell(row['runs never shown Running'])}"
                f" ({_cell(base['runs never shown Running'])});"
                f" create->JobSet p99 {_ratio(row['create->JobSet p99 s'], base['create->JobSet p99 s'])}x,"
                f" all JobSets {_ratio(row['all JobSets s'], base['all JobSets s'])}x"
            )
    return lines


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio(value: float | None, to: float | None) -> str:
    return f"{value / to:.2f}" if value is not None and to else "-"


def cli(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench pace", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="runs in the burst (default 1000)")
    parser.add_argument(
        "--qps",
        type=float,
        nargs="+",
        default=default_paces(),
        help="write paces to compare (TPUFT_WRITE_QPS; 0: no pace; default: 0 20 50)",
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds per pace, alternating order (default 2)"
    )
    parser.add_argument("--output", type=Path, default=RESULTS, help=f"results file (default {RESULTS})")
    args = parser.parse_args(argv)
    results = main(args.n, args.qps, args.rounds, args.output)
    print("\n".join(report(results)))
