"""The operator benchmark's figures and report (issue 18's targets): from bench/results/operator.json,
for `python -m bench report` (bench/__main__.py) and the plot (bench/plot.py), which both import it."""

from __future__ import annotations

import statistics
from typing import Any

# Issue 18's targets, at every N (each figure: the median of the rounds).
TARGET_P99_TO_LIMIT = 1.2  # p99 create -> JobSet, as a multiple of the limit (`creation_limit`)
TARGET_ALL_TO_DIRECT = 1.1  # time to all N JobSets, as a multiple of the direct client's
TARGET_FASTEST_S = 0.2  # the fastest run's create -> JobSet
TARGET_WRITES_TO_RUNNING = 3
TARGET_RSS_N, TARGET_RSS_MB = 1000, 150.0


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def p50_p99(percentiles: dict[str, Any]) -> str:
    return f"{seconds(percentiles['p50'])}/{seconds(percentiles['p99'])}"


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


def creation_limit(operator_phase: dict[str, Any], direct_phase: dict[str, Any]) -> float | None:
    """The least p99 a controller can have here: the bound above, or where it is below the direct
    client's own p99 (small N, where the client sends faster than anything can be created), that p99."""
    direct_p99 = direct_phase["create_to_jobset"]["p99"]
    bound = creation_bound(operator_phase, direct_phase) or 0.0
    return max(bound, direct_p99) if direct_p99 is not None else None


def zero_reaction_limit(operator_phase: dict[str, Any], zero_phase: dict[str, Any]) -> float | None:
    """`creation_limit` with the zero-reaction phase in place of the direct one: the creation rate of
    TPUFineTune + JobSet pairs, which is what any controller's runs cost the API server, instead of
    JobSets alone. The least p99 a controller can have when the API server is what is busy."""
    return creation_limit(operator_phase, zero_phase)


# The fourth phase: the watch-reaction controller, or in results before 2026-12-04 the zero-reaction
# controller with the operator's watches held (bench/operator.py, phase 4).
WATCHED_MODES = ("watch-reaction", "zero-reaction-watched")
WATCHED_LABELS = {
    "watch-reaction": "a watch-reaction controller (learns of each run from its watch, as the operator must)",
    "zero-reaction-watched": "a zero-reaction controller that holds the operator's watches",
}


def watched_phase(
    phases: dict[tuple[int, int, str], dict[str, Any]], n: int, round_: int
) -> dict[str, Any] | None:
    """Round ``round_``'s fourth phase at N=``n`` (`WATCHED_MODES`), if it ran."""
    return next((phases[key] for mode in WATCHED_MODES if (key := (n, round_, mode)) in phases), None)


def _ratio(value: float | None, to: float | None) -> float | None:
    return value / to if value and to else None


def split_phase(phase: dict[str, Any]) -> dict[str, Any]:
    """The phase's latency breakdown (audit log), or {} when its clocks disagree: a POST received
    before it was sent means the wall clock was stepped during the round (`latency_breakdown`)."""
    split = phase.get("latency_breakdown") or {}
    if split.get("clock_stepped_runs") or ((split.get("send_to_jobset_post") or {}).get("p50") or 0) < 0:
        return {}
    return split


def _stored_p99(phase: dict[str, Any]) -> float | None:
    return (split_phase(phase).get("send_to_jobset_stored") or {}).get("p99")


def _all_stored(phase: dict[str, Any]) -> float | None:
    """The first send -> the last JobSet stored (results since 2026-12-05)."""
    return split_phase(phase).get("seconds_to_all_jobsets_stored")


def _all_jobs(phase: dict[str, Any] | None) -> float | None:
    """The first send -> the JobSet controller's last first-Job POST, where every run has its Job
    (results since 2026-12-05 05:00 UTC: earlier ones read the yardstick phases' audit log before
    the JobSet controller was done, and cut their time short)."""
    if phase is None or phase.get("runs_with_jobs") != phase.get("n"):
        return None
    return split_phase(phase).get("seconds_to_all_jobs_posted")


def _operator_errors(phase: dict[str, Any]) -> int:
    codes = phase["operator_api"]["by_code"]
    return sum(v for code, v in codes.items() if code in ("409", "429") or code.startswith("5"))


def round_figures(
    o: dict[str, Any],
    d: dict[str, Any],
    zero: dict[str, Any] | None = None,
    watched: dict[str, Any] | None = None,
) -> dict[str, float | None]:
    """One round's figures against issue 18's targets (against the direct phase), and against the
    zero-reaction controller and the ``watched`` one (`WATCHED_MODES`) of the same round where they ran."""
    p99, limit = o["create_to_jobset"]["p99"], creation_limit(o, d)
    zero_limit = zero_reaction_limit(o, zero) if zero else None
    watched_limit = zero_reaction_limit(o, watched) if watched else None
    return {
        "p99": p99,
        "limit": limit,
        "p99_to_limit": p99 / limit if p99 and limit else None,
        "all_to_direct": o["seconds_to_all_jobsets"] / d["seconds_to_all_jobsets"],
        "zero_limit": zero_limit,
        "p99_to_zero_limit": p99 / zero_limit if p99 and zero_limit else None,
        "all_to_zero": o["seconds_to_all_jobsets"] / zero["seconds_to_all_jobsets"] if zero else None,
        "zero_fastest": zero["create_to_jobset"]["min"] if zero else None,
        # The zero-reaction controller itself against issue 18's limit and direct creation: what no
        # controller can do better than, measured by the issue's own yardstick.
        "zero_p99_to_limit": _ratio(zero["create_to_jobset"]["p99"], creation_limit(zero, d))
        if zero
        else None,
        "zero_all_to_direct": zero["seconds_to_all_jobsets"] / d["seconds_to_all_jobsets"] if zero else None,
        # The watch-reaction controller (or, before, the zero-reaction one holding the operator's
        # watches): the least any controller that watches what the operator must watch can do.
        "watched_limit": watched_limit,
        "p99_to_watched_limit": p99 / watched_limit if p99 and watched_limit else None,
        "all_to_watched": o["seconds_to_all_jobsets"] / watched["seconds_to_all_jobsets"]
        if watched
        else None,
        "watched_fastest": watched["create_to_jobset"]["min"] if watched else None,
        # create -> the JobSet stored (the audit log's POST response), no watch in between.
        "stored_p99": _stored_p99(o),
        "zero_stored_p99": _stored_p99(zero) if zero else None,
        # The same against the watch-reaction controller, and the time to all JobSets stored: both
        # without the client's JobSet watch, whose lag is not the controller's (docs/benchmarks.md).
        "watched_stored_p99": _stored_p99(watched) if watched else None,
        "stored_p99_to_watched": _ratio(_stored_p99(o), _stored_p99(watched)) if watched else None,
        "all_stored_to_watched": _ratio(_all_stored(o), _all_stored(watched)) if watched else None,
        # When the JobSet controller had made every run's first Job: where users' pods begin,
        # downstream of whichever controller made the JobSets.
        "all_jobs": _all_jobs(o),
        "watched_all_jobs": _all_jobs(watched),
        "direct_all_jobs": _all_jobs(d),
        "all_jobs_to_watched": _ratio(_all_jobs(o), _all_jobs(watched)),
        "all_jobs_to_direct": _ratio(_all_jobs(o), _all_jobs(d)),
        "fastest": o["create_to_jobset"].get("min") or min(o["create_to_jobset_samples"], default=None),
        "writes_to_running": o["operator_api"]["writes_to_running_without_events_mean"],
        "rss_mb": o["operator_process"]["peak_rss_mb"],
        "operator_errors": _operator_errors(o),
        "cpu_ms_per_run": o["operator_process"]["cpu_ms_per_run"],
    }


def medians(results: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Per N: the median over the rounds of every figure of `round_figures`, and the rounds'."""
    Round = tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]
    pairs: dict[int, list[Round]] = {}
    by_round = {(p["n"], p.get("round", 0), p["mode"]): p for p in results["phases"]}
    for (n, round_, mode), phase in sorted(by_round.items()):
        if mode == "operator" and (n, round_, "direct") in by_round:
            zero = by_round.get((n, round_, "zero-reaction"))
            watched = watched_phase(by_round, n, round_)
            pairs.setdefault(n, []).append((phase, by_round[(n, round_, "direct")], zero, watched))
    out: dict[int, dict[str, Any]] = {}
    for n, rounds in sorted(pairs.items()):
        figures = [round_figures(o, d, zero, watched) for o, d, zero, watched in rounds]
        out[n] = {"rounds": figures}
        for name in figures[0]:
            values = [v for f in figures if (v := f[name]) is not None]
            out[n][name] = statistics.median(values) if values else None
        modes = dict.fromkeys(watched["mode"] for *_, watched in rounds if watched is not None)
        out[n]["watched_label"] = " / ".join(WATCHED_LABELS[mode] for mode in modes) or None
    return out


def phase_orders(results: dict[str, Any]) -> list[str]:
    """How the phases of each round ran: on clusters of their own (and in which order), or one after
    another on the round's cluster (results before 2026-12-03 evening: a later phase inherited the
    runs of the earlier ones)."""
    if not results.get("cluster_per_phase"):
        return ["phases: one after another on one cluster per round (operator first, direct second)"]
    orders: dict[int, list[tuple[int, str]]] = {}
    for phase in results["phases"]:
        orders.setdefault(phase.get("round", 0), []).append((phase.get("position", 0), phase["mode"]))
    shown = "; ".join(
        f"{round_ + 1}: " + ", ".join(dict.fromkeys(mode for _, mode in sorted(placed)))
        for round_, placed in sorted(orders.items())
    )
    lines = [f"phases: each on a fresh cluster of its own, warmed up alike; their order by round: {shown}"]
    places = mean_places(results)
    if len(set(places.values())) > 1:
        listed = ", ".join(f"{mode} {place:.2f}" for mode, place in places.items())
        lines.append(
            f"  NOT balanced: the phases' mean place (1 = first) is {listed}; a later place costs ~12%,"
            " so ratios between them lean; run a multiple of four rounds"
        )
    return lines


def mean_places(results: dict[str, Any]) -> dict[str, float]:
    """Each phase's mean place in its rounds (1 = first), over every N and round of `results`."""
    placed: dict[str, list[int]] = {}
    for phase in results["phases"]:
        placed.setdefault(phase["mode"], []).append(phase.get("position", 0) + 1)
    return {mode: statistics.mean(places) for mode, places in placed.items()}


def operator_report(results: dict[str, Any]) -> list[str]:
    machine = results["machine"]
    lines = [
        f"operator at scale: {machine['cpus']} CPUs ({machine['cpu_model']}), {machine['memory_gib']} GiB; "
        f"load average before {results['load_average_before']}, after {results['load_average_after']}",
        f"{'N':>5} {'round':>5} {'create->JobSet min/p50/p99 s':>28} {'direct p99':>10} {'limit':>6} {'x limit':>7} "
        f"{'all JobSets op/direct s':>23} {'done->Succ p50/p99':>18} {'writes/run':>10} {'to Running':>10} "
        f"{'409/429/5xx':>11} {'RSS MB':>6} {'CPU ms/run':>10}",
    ]
    lines += phase_orders(results)
    phases = {(p["n"], p.get("round", 0), p["mode"]): p for p in results["phases"]}
    for n, round_, mode in sorted(phases):
        if mode != "operator" or (n, round_, "direct") not in phases:
            continue
        o, d = phases[(n, round_, mode)], phases[(n, round_, "direct")]
        c, api, proc = o["create_to_jobset"], o["operator_api"], o["operator_process"]
        zero = phases.get((n, round_, "zero-reaction"))
        watched = watched_phase(phases, n, round_)
        figures = round_figures(o, d, zero, watched)
        storm = o["apiserver_error_codes"]
        done = o["jobset_completed_to_succeeded"]
        lines.append(
            f"{n:>5} {round_ + 1:>5} {seconds(figures['fastest']) + '/' + seconds(c['p50']) + '/' + seconds(c['p99']):>28} "
            f"{seconds(d['create_to_jobset']['p99']):>10} {seconds(figures['limit']):>6} {seconds(figures['p99_to_limit']):>7} "
            f"{seconds(o['seconds_to_all_jobsets']) + '/' + seconds(d['seconds_to_all_jobsets']):>23} "
            f"{seconds(done['p50']) + '/' + seconds(done['p99']):>18} {api['writes_per_run']:>10} "
            f"{seconds(api['writes_to_running_without_events_mean']):>10} "
            f"{str(storm['409']) + '/' + str(storm['429']) + '/' + str(storm['5xx']):>11} "
            f"{proc['peak_rss_mb']:>6} {proc['cpu_ms_per_run']:>10}"
        )
        during = api.get("other_writes_until_last_jobset")
        if during is not None:
            shown = ", ".join(f"{count} {kind}" for kind, count in during.items()) or "none"
            discarded = o.get("operator_connections_discarded")
            if discarded is not None:  # results since 2026-12-05
                shown += f"; connections opened beyond its pool and closed after one call: {discarded}"
            lines.append(f"{'':>11} the operator's other writes until its last JobSet create: {shown}")
        if zero is not None:
            z = zero["create_to_jobset"]
            lines.append(
                f"{'':>11} zero-reaction controller: create->JobSet {seconds(z['min'])}/{seconds(z['p50'])}/{seconds(z['p99'])} s,"
                f" all JobSets {seconds(zero['seconds_to_all_jobsets'])} s (operator {seconds(figures['all_to_zero'])}x);"
                f" its limit {seconds(figures['zero_limit'])} s (operator p99 {seconds(figures['p99_to_zero_limit'])}x)"
            )
        if watched is not None:
            w = watched["create_to_jobset"]
            per_run = watched.get("operator_watch_events_per_run") or {}
            held = f"{sum(per_run.values()):.1f} watch events per run"
            lines.append(
                f"{'':>11} {WATCHED_LABELS[watched['mode']]} ({held}):"
                f" create->JobSet {seconds(w['min'])}/{seconds(w['p50'])}/{seconds(w['p99'])} s,"
                f" all JobSets {seconds(watched['seconds_to_all_jobsets'])} s (operator {seconds(figures['all_to_watched'])}x);"
                f" its limit {seconds(figures['watched_limit'])} s (operator p99 {seconds(figures['p99_to_watched_limit'])}x)"
            )
    lines.append(
        "  (limit: the least p99 any controller can have at the direct phase's creation rate, 0.99 x (direct"
        " all JobSets - the client's send time), or the direct p99 where that is more; 'to Running': the"
        " operator's creates and status patches up to the one that set Running; writes/run adds its Events;"
        " 409/429/5xx: every client of the apiserver during the phase)"
    )
    lines.append(
        "where create->JobSet goes, p50/p99 s (operator | direct | zero-reaction | watch-reaction, or before"
        " 2026-12-04 zero-reaction watched, where they ran):"
        " send -> JobSet POST at the apiserver;"
        " the POST in the apiserver; POST done -> client's watch sees it; JobSet stored -> the JobSet"
        " controller's first Job POST (its watch and queue; results since 2026-12-05)"
    )
    for n, round_, mode in sorted(phases):
        if mode != "operator" or (n, round_, "direct") not in phases:
            continue
        o, watcher = phases[(n, round_, mode)], watched_phase(phases, n, round_)
        columns = [("operator", o), ("direct", phases[(n, round_, "direct")])]
        columns += [
            (label, other)
            for label, other in (
                ("zero-reaction", phases.get((n, round_, "zero-reaction"))),
                ("watched", watcher),
            )
            if other is not None
        ]
        parts = []
        for _, phase in columns:
            split = split_phase(phase)
            if not split:
                parts.append("- (the wall clock was stepped)")
                continue
            parts.append(
                "; ".join(
                    p50_p99(split[k])
                    for k in (
                        "send_to_jobset_post",
                        "jobset_post_in_apiserver",
                        "jobset_post_done_to_seen",
                        "jobset_stored_to_job_post",
                    )
                    if k in split
                )
            )
        split = split_phase(o)
        reaction = (
            f"; the operator's reaction (TPUFineTune stored -> its JobSet POST) {p50_p99(split['finetune_done_to_jobset_post'])}"
            if "finetune_done_to_jobset_post" in split
            else ""
        )
        watcher_split = (
            split_phase(watcher) if watcher is not None and watcher["mode"] == "watch-reaction" else {}
        )
        if "finetune_done_to_jobset_post" in watcher_split:
            reaction += (
                f", the watch-reaction controller's {p50_p99(watcher_split['finetune_done_to_jobset_post'])}"
            )
        waited = o.get("operator_queue_wait_to_all_jobsets") or {}
        if waited.get("work=create"):
            c = waited["work=create"]
            reaction += (
                f"; in the operator's queue, runs that needed a JobSet waited p50 <= {seconds(c['p50_at_most'])} s,"
                f" p99 <= {seconds(c['p99_at_most'])} s ({c['count']} takes)"
            )
        busy = (o.get("operator_reconcile_to_all_jobsets") or {}).get("work=create")
        if busy:  # results since 2026-12-05
            reaction += (
                f"; a worker took p50 <= {seconds(busy['p50_at_most'])} s, p99 <= {seconds(busy['p99_at_most'])} s"
                " over each of those runs"
            )
        cpu = o["operator_process"].get("cpu_ms_per_run_to_all_jobsets")
        if cpu is not None:  # results since 2026-12-05
            reaction += f"; CPU until the last JobSet {cpu:.2f} ms/run"
            controller_cpu = (watcher or {}).get("controller_cpu_ms_per_run_to_all_jobsets")
            if controller_cpu is not None:
                reaction += f", the watch-reaction controller's {controller_cpu:.2f}"
        lag = (o.get("operator_loop_lag_to_all_jobsets") or {}).get("")
        if lag:
            reaction += f"; its event loop ran late p50 <= {seconds(lag['p50_at_most'])} s, p99 <= {seconds(lag['p99_at_most'])} s"
        lines.append(f"{n:>5} {round_ + 1:>5}  {' | '.join(parts)}{reaction}")
        cpus: list[tuple[dict[str, float], str]] = [
            (cpu, label)
            for label, phase in columns
            if (cpu := (phase.get("cluster_cpu_to_all_jobsets") or {}).get("ms_per_run"))
        ]
        if len(cpus) >= 2:
            shown = ", ".join(
                f"{name} " + "/".join(f"{cpu.get(name, 0):.0f}" for cpu, _ in cpus)
                for name in sorted(cpus[0][0])
                if cpus[0][0].get(name)
            )
            which = "/".join(label for _, label in cpus)
            lines.append(f"             cluster CPU ms per run until the last JobSet ({which}): {shown}")
    lines.append("targets (each figure the median of the rounds at that N):")
    for n, m in medians(results).items():

        def verdict(ok: bool) -> str:
            return "met" if ok else "NOT met"

        rounds = len(m["rounds"])
        rss = f" ({verdict(m['rss_mb'] < TARGET_RSS_MB)}, < {TARGET_RSS_MB:.0f})" if n == TARGET_RSS_N else ""
        lines.append(
            f"  N={n} ({rounds} round{'s' if rounds > 1 else ''}): p99 {seconds(m['p99'])} s vs limit {seconds(m['limit'])} s ="
            f" {seconds(m['p99_to_limit'])}x ({verdict((m['p99_to_limit'] or 99) <= TARGET_P99_TO_LIMIT)}, <= {TARGET_P99_TO_LIMIT}x);"
            f" all JobSets {seconds(m['all_to_direct'])}x direct ({verdict(m['all_to_direct'] <= TARGET_ALL_TO_DIRECT)},"
            f" <= {TARGET_ALL_TO_DIRECT}x);"
            f" fastest {seconds(m['fastest'])} s"
            f" ({verdict((m['fastest'] or 99) <= TARGET_FASTEST_S)}, <= {TARGET_FASTEST_S} s);"
            f" writes to Running {seconds(m['writes_to_running'])} ({verdict((m['writes_to_running'] or 99) <= TARGET_WRITES_TO_RUNNING)});"
            f" operator 409/429/5xx {m['operator_errors']:.0f} ({verdict(m['operator_errors'] == 0)});"
            f" RSS {m['rss_mb']:.0f} MB{rss};"
            f" CPU {m['cpu_ms_per_run']:.0f} ms/run"
        )
        if m["zero_limit"] is not None:
            lines.append(
                f"  {'':>{len(str(n)) + 2}} against a zero-reaction controller (it pays for the TPUFineTunes too):"
                f" p99 {seconds(m['p99_to_zero_limit'])}x its limit of {seconds(m['zero_limit'])} s"
                f" ({verdict((m['p99_to_zero_limit'] or 99) <= TARGET_P99_TO_LIMIT)});"
                f" all JobSets {seconds(m['all_to_zero'])}x its ({verdict((m['all_to_zero'] or 99) <= TARGET_ALL_TO_DIRECT)});"
                f" its fastest run {seconds(m['zero_fastest'])} s; by the direct yardstick the zero-reaction controller"
                f" itself is at p99 {seconds(m['zero_p99_to_limit'])}x the limit, all JobSets {seconds(m['zero_all_to_direct'])}x direct"
                + (
                    f"; create -> JobSet stored (no watch) p99 {seconds(m['stored_p99'])} s, zero-reaction's {seconds(m['zero_stored_p99'])} s"
                    if m["stored_p99"] is not None
                    else ""
                )
            )
        if m["watched_limit"] is not None:
            lines.append(
                f"  {'':>{len(str(n)) + 2}} against {m['watched_label']}:"
                f" p99 {seconds(m['p99_to_watched_limit'])}x its limit of {seconds(m['watched_limit'])} s"
                f" ({verdict((m['p99_to_watched_limit'] or 99) <= TARGET_P99_TO_LIMIT)});"
                f" all JobSets {seconds(m['all_to_watched'])}x its"
                f" ({verdict((m['all_to_watched'] or 99) <= TARGET_ALL_TO_DIRECT)}); its fastest run {seconds(m['watched_fastest'])} s"
            )
        if m["stored_p99_to_watched"] is not None:
            all_stored = m["all_stored_to_watched"]
            lines.append(
                f"  {'':>{len(str(n)) + 2}} the same without the client's watch (create -> JobSet stored, audit log):"
                f" p99 {seconds(m['stored_p99'])} s vs its {seconds(m['watched_stored_p99'])} s = {seconds(m['stored_p99_to_watched'])}x"
                f" ({verdict(m['stored_p99_to_watched'] <= TARGET_P99_TO_LIMIT)}, <= {TARGET_P99_TO_LIMIT}x)"
                + (
                    f"; all JobSets stored {seconds(all_stored)}x its ({verdict(all_stored <= TARGET_ALL_TO_DIRECT)})"
                    if all_stored is not None
                    else ""
                )
            )
        if m["all_jobs"] is not None:
            lines.append(
                f"  {'':>{len(str(n)) + 2}} every run's first Job posted by the JobSet controller (where pods begin):"
                f" {seconds(m['all_jobs'])} s after the first create; {seconds(m['all_jobs_to_watched'])}x the watch-reaction"
                f" phase's ({seconds(m['watched_all_jobs'])} s), {seconds(m['all_jobs_to_direct'])}x direct ({seconds(m['direct_all_jobs'])} s)"
            )
    return lines
