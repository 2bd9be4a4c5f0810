"""Benchmarks run by `make bench` (`python -m bench`); results go to bench/results/.

Each benchmark keeps one current results file there, and at most one plot beside it, under the
names in `OUTPUTS`, which every module takes its paths from; a run rewrites them. A variant run
(the operator's `--profile` or `--threads 1`) must be given its own `--output`: by default nothing
else lands here. Earlier results are in git history (`git log -- bench/results/`); docs/benchmarks.md
shows these.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

RESULTS_DIR = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Output:
    command: str  # what rewrites the files
    results: str  # the results file's name in RESULTS_DIR
    plot: str | None = None  # its plot's name (bench/results/*.png: drawn by the report, not committed)


OUTPUTS: dict[str, Output] = {
    "operator": Output("make bench (python -m bench operator)", "operator.json", "operator.png"),
    "kopf-path": Output("make bench (python -m bench kopf-path)", "kopf-path.json"),
    "trainer": Output("make bench (python -m bench trainer)", "trainer.json"),
    "recipes": Output("make bench (python -m bench trainer)", "recipes.json"),
    "dpo": Output("make bench (python -m bench trainer)", "dpo.json"),
    "goodput": Output("make bench (python -m bench goodput)", "goodput.json", "goodput.png"),
    "scale": Output("make bench (python -m bench scale)", "scale.json", "scale.png"),
    "data": Output("make bench (python -m bench data)", "data.json"),
    "pace": Output("python -m bench pace", "operator-pace.json"),
    # tests/e2e/test_faults.py writes it (its RESULTS) when it runs more than one round.
    "faults": Output("make chaos", "faults.json"),
}


def results_file(benchmark: str) -> Path:
    """The current results file of ``benchmark`` (a key of `OUTPUTS`)."""
    return RESULTS_DIR / OUTPUTS[benchmark].results


def plot_file(benchmark: str) -> Path:
    """The plot of ``benchmark``, beside its results file."""
    plot = OUTPUTS[benchmark].plot
    if plot is None:
        raise KeyError(f"{benchmark} draws no plot")
    return RESULTS_DIR / plot
