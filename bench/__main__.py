"""`python -m bench` (what `make bench` runs): every benchmark, then one report and the plots.

Each benchmark rewrites its one current results file in bench/results/ (`bench.OUTPUTS`).

python -m bench                              # kopf-path, the operator at N=100, 300, 1000, the trainer
                                             # (with recipes and dpo), goodput, scale, data
python -m bench operator --n 100 300 1000    # one part (options: python -m bench operator -h)
python -m bench trainer [--skip-recipes]     # device counts, xla vs native (+ recipes and dpo)
python -m bench kopf-path                    # one watch event's cost: kopf's per-object path vs watches.py
python -m bench pace --n 1000              # the operator's write pace: what it buys (pods sooner) and costs
python -m bench goodput [--steps 6000]       # a real run, undisrupted vs suspended, SIGKILLed, maintained
python -m bench scale [--compare-ref 768b6be] # checkpoints, loading, export at 46M/168M/340M parameters
python -m bench data [--sizes 20000 100000]  # the data path: prepare vs the old path, the floor, trl
python -m bench report [FILE]                # the tables and plots from bench/results/*.json (FILE: an
                                             # operator run's --output in place of operator.json)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench import data, dpo, goodput, kopf_path, operator, pace, recipes, scale, trainer
from bench.operator_report import operator_report, p50_p99, seconds, split_phase


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
    if "backends" in results:
        from bench import backends

        lines += backends.report(results["backends"])
    return lines


def paced_report(results: dict[str, Any]) -> list[str]:
    """The operator's own latency: runs created one after another (`--threads 1`), nothing else busy."""
    lines = [
        f"the operator's own latency, {results['client_threads']} client thread(s) (runs arriving one by one):"
    ]
    for phase in results["phases"]:
        if phase["mode"] not in ("operator", "direct"):
            continue
        c = phase["create_to_jobset"]
        split = split_phase(phase)
        reaction = split.get("finetune_done_to_jobset_post")
        lines.append(
            f"  N={phase['n']} round {phase.get('round', 0) + 1} {phase['mode']:>8}: create->JobSet min/p50/p99"
            f" {seconds(c['min'])}/{seconds(c['p50'])}/{seconds(c['p99'])} s"
            + (
                f"; reaction (TPUFineTune stored -> JobSet POST) p50/p99 {p50_p99(reaction)} s"
                if reaction
                else ""
            )
        )
    return lines


def report(operator_results: Path = operator.RESULTS) -> None:
    """The short table of every benchmark that has results, and the operator's plot.
    ``operator_results``: the operator's results to report (a run's `--output`, not the stored
    operator.json); the plot is drawn next to them (operator.png for the default file). A run of
    `--threads 1` (runs arriving one by one) also gets the operator's own latency."""
    if operator_results.exists():
        from bench import plot  # matplotlib only when there is something to draw

        results = json.loads(operator_results.read_text())
        print("\n".join(operator_report(results)))
        print(f"  (plot: {plot.plot(results, operator_results.with_suffix('.png'))})")
        if results.get("client_threads") == 1:
            print()
            print("\n".join(paced_report(results)))
    if pace.RESULTS.exists():
        print()
        print("\n".join(pace.report(json.loads(pace.RESULTS.read_text()))))
    if kopf_path.RESULTS.exists():
        print()
        print("\n".join(kopf_path.report(json.loads(kopf_path.RESULTS.read_text()))))
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
    if data.RESULTS.exists():
        print()
        print("\n".join(data.report(json.loads(data.RESULTS.read_text()))))
    if scale.RESULTS.exists():
        results = json.loads(scale.RESULTS.read_text())
        print()
        print("\n".join(scale.report(results)))
        scale.plot(results)


def main(argv: list[str]) -> None:
    part, rest = (argv[0], argv[1:]) if argv else ("all", [])
    if part in ("-h", "--help", "help"):
        print(__doc__)
        return
    if part not in ("all", "kopf-path", "operator", "pace", "trainer", "goodput", "scale", "data", "report"):
        raise SystemExit(
            f"unknown benchmark {part!r}: kopf-path, operator, pace, trainer, goodput, scale, data or report "
            "(none: all)"
        )
    if part == "pace":  # a comparison of the operator's settings, not part of `all`
        pace.cli(rest)
        return
    if part in ("all", "kopf-path"):
        kopf_path.main()
    operator_results = Path(rest[0]) if part == "report" and rest else operator.RESULTS
    if part in ("all", "operator"):
        operator_results = operator.cli(rest)
    if part in ("all", "trainer"):
        trainer.main(**vars(trainer.parser().parse_args(rest if part == "trainer" else [])))
    if part in ("all", "goodput"):
        goodput.main(**vars(goodput.parser().parse_args(rest if part == "goodput" else [])))
    if part in ("all", "scale"):
        scale.cli(rest if part == "scale" else [])
    if part in ("all", "data"):
        data.cli(rest if part == "data" else [])
    report(operator_results)


if __name__ == "__main__":
    main(sys.argv[1:])
