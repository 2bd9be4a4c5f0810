"""`python -m bench` (what `make bench` runs): every benchmark, then one report and the plot.

python -m bench                              # the operator at N=100, 300, 1000, then the trainer
python -m bench operator --n 100 300 1000    # one part (options: python -m bench operator -h)
python -m bench trainer
python -m bench goodput --steps 1200         # a real run, undisrupted vs suspended, SIGKILLed, maintained
python -m bench report                       # the table and the plot from bench/results/*.json
"""

from __future__ import annotations

import json
import sys
from typing import Any

from bench import dpo, goodput, operator, recipes, trainer

TARGET_RATIO_N, TARGET_RATIO = 300, 2.0
TARGET_WRITES_TO_RUNNING = 3
TARGET_RSS_N, TARGET_RSS_MB = 1000, 150.0


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _p50_p99(percentiles: dict[str, Any]) -> str:
    return f"{_s(percentiles['p50'])}/{_s(percentiles['p99'])}"


def creation_bound(operator_phase: dict[str, Any], direct_phase: dict[str, Any]) -> float | None:
    """A lower bound on any controller's p99 create -> JobSet, from the same run.

    The direct phase shows how fast the API server can create N JobSets (its send-to-last time); the
    operator phase's client sends all N TPUFineTunes in less. The k-th of N JobSets exists no sooner
    than k/N of the direct time, its TPUFineTune was sent at k/N of the client's send time, so the
    latency of the 99th-percentile run is at least 0.99 x the difference."""
    direct_all = direct_phase.get("seconds_to_all_jobsets")
    sent_all = operator_phase.get("client_seconds_to_send_all")
    if direct_all is None or sent_all is None:
        return None
    return max(0.0, 0.99 * (direct_all - sent_all)) or None


def operator_report(results: dict[str, Any]) -> list[str]:
    machine = results["machine"]
    lines = [
        f"operator at scale: {machine['cpus']} CPUs ({machine['cpu_model']}), {machine['memory_gib']} GiB; "
        f"load average before {results['load_average_before']}, after {results['load_average_after']}",
        f"{'N':>5} {'create->JobSet p50/p95/p99/max s':>33} {'direct p99':>10} {'ratio':>6} "
        f"{'all JobSets op/direct s':>23} {'done->Succ p50/p99':>18} {'writes/run':>10} {'to Running':>10} "
        f"{'reads/run':>9} {'409/429/5xx':>11} {'RSS MB':>6} {'CPU ms/run':>10}",
    ]
    operator_phases = {p["n"]: p for p in results["phases"] if p["mode"] == "operator"}
    direct_phases = {p["n"]: p for p in results["phases"] if p["mode"] == "direct"}
    ratios: dict[int, float | None] = {}
    for n in sorted(operator_phases):
        o, d = operator_phases[n], direct_phases[n]
        c, api, proc = o["create_to_jobset"], o["operator_api"], o["operator_process"]
        ratio = c["p99"] / d["create_to_jobset"]["p99"] if c["p99"] and d["create_to_jobset"]["p99"] else None
        ratios[n] = ratio
        storm = o["apiserver_error_codes"]
        done = o["jobset_completed_to_succeeded"]
        lines.append(
            f"{n:>5} {_s(c['p50']) + '/' + _s(c['p95']) + '/' + _s(c['p99']) + '/' + _s(c['max']):>33} "
            f"{_s(d['create_to_jobset']['p99']):>10} {_s(ratio):>6} "
            f"{_s(o['seconds_to_all_jobsets']) + '/' + _s(d['seconds_to_all_jobsets']):>23} "
            f"{_s(done['p50']) + '/' + _s(done['p99']):>18} {api['writes_per_run']:>10} "
            f"{_s(api['writes_to_running_without_events_mean']):>10} {api['reads_per_run']:>9} "
            f"{str(storm['409']) + '/' + str(storm['429']) + '/' + str(storm['5xx']):>11} "
            f"{proc['peak_rss_mb']:>6} {proc['cpu_ms_per_run']:>10}"
        )
    lines.append(
        "  ('to Running': the operator's object creates and status patches up to the patch that set Running;"
        " writes/run adds the Events it posts; 409/429/5xx: every client of the apiserver during the phase)"
    )
    lines.append(
        "where create->JobSet goes, p50/p99 s (operator | direct): send -> JobSet POST at the apiserver;"
        " the POST in the apiserver; POST done -> client's watch sees it"
    )
    for n in sorted(operator_phases):
        parts = []
        for phase in (operator_phases[n], direct_phases[n]):
            split = phase.get("latency_breakdown")
            if not split:
                parts.append("-")
                continue
            parts.append(
                "; ".join(
                    _p50_p99(split[k])
                    for k in ("send_to_jobset_post", "jobset_post_in_apiserver", "jobset_post_done_to_seen")
                )
            )
        lines.append(f"{n:>5}  {parts[0]:<36} | {parts[1]}")
        split = operator_phases[n].get("latency_breakdown") or {}
        if "finetune_done_to_jobset_post" in split:
            lines.append(
                "       operator's first part: send -> TPUFineTune POST at the apiserver "
                f"{_p50_p99(split['send_to_finetune_post'])}; in the apiserver "
                f"{_p50_p99(split['finetune_post_in_apiserver'])}; done -> the operator's JobSet POST "
                f"(its reaction) {_p50_p99(split['finetune_done_to_jobset_post'])}"
            )
    lines.append(
        "  bound: at the creation rate of the direct phase, no controller gets p99 below ~0.99 x (direct all"
        " JobSets - client's send time): its TPUFineTunes were all sent sooner than the JobSets could be made"
    )
    for n in sorted(operator_phases):
        bound = creation_bound(operator_phases[n], direct_phases[n])
        c = operator_phases[n]["create_to_jobset"]["p99"]
        if bound and c:
            lines.append(f"{n:>5}  p99 bound {bound:.2f} s; the operator's p99 is {c / bound:.2f}x the bound")
    lines += ["targets:"]
    if TARGET_RATIO_N in ratios and ratios[TARGET_RATIO_N] is not None:
        ratio = ratios[TARGET_RATIO_N]
        assert ratio is not None
        verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
        lines.append(
            f"  p99 create->JobSet within {TARGET_RATIO}x of direct at N={TARGET_RATIO_N}: {ratio:.2f}x, {verdict}"
        )
    to_running = [
        p["operator_api"]["writes_to_running_without_events_mean"] for p in operator_phases.values()
    ]
    worst = max((v for v in to_running if v is not None), default=None)
    if worst is not None:
        verdict = "met" if worst <= TARGET_WRITES_TO_RUNNING else "NOT met"
        lines.append(
            f"  at most {TARGET_WRITES_TO_RUNNING} API writes per run to reach Running: {worst:.2f}, {verdict}"
        )
    if TARGET_RSS_N in operator_phases:
        rss = operator_phases[TARGET_RSS_N]["operator_process"]["peak_rss_mb"]
        verdict = "met" if rss < TARGET_RSS_MB else "NOT met"
        lines.append(f"  peak RSS under {TARGET_RSS_MB:.0f} MB at N={TARGET_RSS_N}: {rss} MB, {verdict}")
    storms = {n: p["operator_api"]["by_code"] for n, p in sorted(operator_phases.items())}
    errors = {
        n: sum(v for code, v in codes.items() if code in ("409", "429") or code.startswith("5"))
        for n, codes in storms.items()
    }
    lines.append(f"  the operator's own 409/429/5xx responses per N: {errors}")
    cpu = {n: p["operator_process"]["cpu_ms_per_run"] for n, p in sorted(operator_phases.items())}
    writes = {n: p["operator_api"]["writes_per_run"] for n, p in sorted(operator_phases.items())}
    lines.append(
        f"  cost per run vs N: CPU ms {cpu}; API writes {writes} (plot: {operator.RESULTS.with_suffix('.png')})"
    )
    return lines


def trainer_report(results: dict[str, Any]) -> list[str]:
    lines = [
        f"trainer ({results['what']}; {results['cpu_count']} CPUs; bench/results/trainer.json):",
        f"{'devices':>7} {'steps/s':>8} {'tokens/s':>9} {'compiles':>9} {'bytes/device':>13} {'total/N':>9}",
    ]
    for r in results["results"]:
        compiles = f"{r['compiles_after_warmup']}->{r['compiles_at_end']}"
        lines.append(
            f"{r['devices']:>7} {r['steps_per_second']:>8} {r['tokens_per_second']:>9} {compiles:>9} "
            f"{r['parameter_bytes_per_device_max']:>13} {r['parameter_bytes_total_over_n']:>9}"
        )
    return lines


def report() -> None:
    """The short table of every benchmark that has results, and the operator's plot."""
    if operator.RESULTS.exists():
        from bench import plot  # matplotlib only when there is something to draw

        results = json.loads(operator.RESULTS.read_text())
        print("\n".join(operator_report(results)))
        plot.plot(results)
    if trainer.RESULTS.exists():
        print()
        print("\n".join(trainer_report(json.loads(trainer.RESULTS.read_text()))))
    if recipes.RESULTS.exists():
        print()
        print("\n".join(recipes.report(json.loads(recipes.RESULTS.read_text()))))
    if dpo.RESULTS.exists():
        print()
        print("\n".join(dpo.report(json.loads(dpo.RESULTS.read_text()))))
    if goodput.RESULTS.exists():
        results = json.loads(goodput.RESULTS.read_text())
        print()
        print("\n".join(goodput.report(results)))
        goodput.plot(results)


def main(argv: list[str]) -> None:
    part, rest = (argv[0], argv[1:]) if argv else ("all", [])
    if part not in ("all", "operator", "trainer", "goodput", "report"):
        raise SystemExit(f"unknown benchmark {part!r}: operator, trainer, goodput or report (none: all)")
    if part in ("all", "operator"):
        operator.cli(rest)
    if part in ("all", "trainer"):
        trainer.main()
    if part in ("all", "goodput"):
        goodput.main(**vars(goodput.parser().parse_args(rest if part == "goodput" else [])))
    report()


if __name__ == "__main__":
    main(sys.argv[1:])
