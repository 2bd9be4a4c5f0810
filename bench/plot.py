"""The operator benchmark's plot: latency distributions (operator vs direct) and cost per run vs N.
Reads bench/results/operator.json, writes bench/results/operator.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: files only
import matplotlib.pyplot as plt

from bench import plot_file
from bench.operator import RESULTS
from bench.operator_report import (
    TARGET_ALL_TO_DIRECT,
    TARGET_P99_TO_LIMIT,
    medians,
    round_figures,
    watched_phase,
)

PNG = plot_file("operator")


def _cdf(ax: Any, samples: list[float], **style: Any) -> None:
    if not samples:
        return
    ordered = sorted(samples)
    ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post", **style)


def plot(results: dict[str, Any], path: Path = PNG) -> Path:
    phases = results["phases"]
    sizes = sorted({p["n"] for p in phases})
    colors = dict(zip(sizes, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"), strict=False))
    by_round = {(p["n"], p.get("round", 0), p["mode"]): p for p in phases}
    # The distributions of one round per N: the round whose p99/limit is the median of that N's.
    operator, direct, zero, watched = {}, {}, {}, {}
    for n in sizes:
        rounds = sorted(
            (round_figures(by_round[(n, r, "operator")], by_round[(n, r, "direct")])["p99_to_limit"] or 0, r)
            for (m, r, mode) in by_round
            if m == n and mode == "operator" and (n, r, "direct") in by_round
        )
        chosen = rounds[len(rounds) // 2][1]
        operator[n], direct[n] = by_round[(n, chosen, "operator")], by_round[(n, chosen, "direct")]
        if (n, chosen, "zero-reaction") in by_round:
            zero[n] = by_round[(n, chosen, "zero-reaction")]
        if (fourth := watched_phase(by_round, n, chosen)) is not None:
            watched[n] = fourth
    fig, (created, finished, cost, targets) = plt.subplots(1, 4, figsize=(22, 5))

    for n in sizes:
        _cdf(created, operator[n]["create_to_jobset_samples"], color=colors[n], label=f"operator N={n}")
        _cdf(created, direct[n]["create_to_jobset_samples"], color=colors[n], ls="--", label=f"direct N={n}")
        for others, ls in ((zero, ":"), (watched, "-.")):
            if n in others:
                _cdf(
                    created,
                    others[n]["create_to_jobset_samples"],
                    color=colors[n],
                    ls=ls,
                    label=f"{others[n]['mode']} N={n}",
                )
        _cdf(finished, operator[n]["jobset_completed_to_succeeded_samples"], color=colors[n], label=f"N={n}")
    created.set(
        xscale="log",
        xlabel="seconds (log)",
        ylabel="fraction of runs",
        title="create request -> JobSet seen by a watch",
    )
    finished.set(
        xlabel="seconds", ylabel="fraction of runs", title="JobSet Completed -> TPUFineTune Succeeded"
    )
    for ax in (created, finished):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)

    ns = [n for n in sizes if n in operator]
    api = [operator[n]["operator_api"] for n in ns]
    cost.plot(ns, [a["writes_per_run"] for a in api], "o-", label="API writes / run")
    cost.plot(ns, [a["reads_per_run"] for a in api], "s-", label="API reads / run")
    cost.plot(
        ns, [a["writes_to_running_per_run_mean"] or 0 for a in api], "^-", label="writes to Running / run"
    )
    cost.set(xscale="log", xlabel="N (runs applied at once)", ylabel="requests per run", title="cost per run")
    cost.set_xticks(ns, [str(n) for n in ns])
    cost.set_ylim(bottom=0)
    cpu = cost.twinx()
    cpu.plot(ns, [operator[n]["operator_process"]["cpu_ms_per_run"] for n in ns], "d--", color="tab:gray")
    cpu.set_ylabel("operator CPU ms / run (dashed)")
    cpu.set_ylim(bottom=0)
    for n in ns:
        rss = operator[n]["operator_process"]["peak_rss_mb"]
        cost.annotate(f"{rss:.0f} MB", (n, api[ns.index(n)]["writes_per_run"]), textcoords="offset points",
                      xytext=(0, 8), ha="center", fontsize=8)  # fmt: skip
    cost.legend(fontsize=8, loc="lower left")
    cost.grid(alpha=0.3)

    summary = medians(results)
    ratios = {
        "p99_to_limit": ("o-", TARGET_P99_TO_LIMIT, "p99 create->JobSet / limit"),
        "all_to_direct": ("s-", TARGET_ALL_TO_DIRECT, "time to all JobSets / direct"),
        "p99_to_zero_limit": ("o--", TARGET_P99_TO_LIMIT, "p99 / zero-reaction limit"),
        "all_to_zero": ("s--", TARGET_ALL_TO_DIRECT, "all JobSets / zero-reaction"),
        "p99_to_watched_limit": ("o-.", TARGET_P99_TO_LIMIT, "p99 / watch-reaction limit"),
        "all_to_watched": ("s-.", TARGET_ALL_TO_DIRECT, "all JobSets / watch-reaction"),
    }
    for name, (style, target, label) in ratios.items():
        if any(summary[n][name] is None for n in ns):
            continue
        line = targets.plot(ns, [summary[n][name] for n in ns], style, label=f"{label} (median)")
        for n in ns:
            values = [f[name] for f in summary[n]["rounds"] if f[name] is not None]
            targets.plot([n] * len(values), values, style[0], color=line[0].get_color(), alpha=0.35)
        targets.axhline(target, color="gray", ls=":", lw=1)
    targets.set(
        xscale="log",
        xlabel="N (runs applied at once)",
        ylabel="ratio (dotted: target)",
        title="against the targets",
    )
    targets.set_xticks(ns, [str(n) for n in ns])
    targets.set_ylim(bottom=0)
    targets.legend(fontsize=8)
    targets.grid(alpha=0.3)

    machine = results.get("machine", {})
    fig.suptitle(
        "tpuft operator vs direct JobSet creation, a zero-reaction and a watch-reaction controller - "
        f"{machine.get('cpus')} CPUs ({machine.get('cpu_model')}), "
        f"{machine.get('memory_gib')} GiB; load average (1/5/15 min) before "
        f"{results.get('load_average_before')}, after {results.get('load_average_after')}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    print(f"plot: {plot(json.loads(RESULTS.read_text()))}")


if __name__ == "__main__":
    main()
