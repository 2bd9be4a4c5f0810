"""bench/results/ holds one current results file (and at most its plot) per benchmark, under the names
the benchmarks declare (`bench.OUTPUTS`), and the docs read only those (issue 41, item 4).

Experiment logs, profiles and variant runs stay out of it (git history keeps the old ones), and
docs/benchmarks.md stays one page a user reads in five minutes.
"""

from __future__ import annotations

import re
from pathlib import Path

import bench
import pytest
from bench import OUTPUTS, RESULTS_DIR, plot_file, results_file

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarks.md"
MAX_PAGE_LINES = 315  # ten benchmarks, a short section each (the training core with xla vs native)
# A mention of a results file in the docs: bench/results/NAME (NAME up to the first character that
# cannot be part of a file name in prose or Markdown).
MENTION = re.compile(r"bench/results/([A-Za-z0-9_.-]*[A-Za-z0-9_-])")


def declared() -> set[str]:
    return {o.results for o in OUTPUTS.values()} | {o.plot for o in OUTPUTS.values() if o.plot}


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_file_in_bench_results_is_one_a_benchmark_writes() -> None:
    stray = sorted(p.name for p in RESULTS_DIR.iterdir() if p.name not in declared())
    assert not stray, f"not the current results of any benchmark (bench.OUTPUTS): {stray}"


def test_every_benchmark_has_its_current_results_committed() -> None:
    missing = [o.results for o in OUTPUTS.values() if not (RESULTS_DIR / o.results).is_file()]
    assert not missing


def test_the_benchmarks_write_the_files_they_declare() -> None:
    from bench import data, dpo, goodput, kopf_path, operator, pace, plot, recipes, scale, trainer

    modules = {
        "operator": operator, "kopf-path": kopf_path, "trainer": trainer, "recipes": recipes,
        "dpo": dpo, "goodput": goodput, "scale": scale, "pace": pace, "data": data,
    }  # fmt: skip
    assert {name: m.RESULTS for name, m in modules.items()} == {name: results_file(name) for name in modules}
    plots = {name: plot_file(name) for name, o in OUTPUTS.items() if o.plot}
    assert plots == {"operator": plot.PNG, "goodput": goodput.PNG, "scale": scale.PNG}
    assert set(OUTPUTS) == {*modules, "faults"}
    # `make chaos` (not a bench module) writes the fault suite's.
    faults = (ROOT / "tests" / "e2e" / "test_faults.py").read_text()
    assert re.search(rf'^RESULTS = ROOT / "bench" / "results" / "{OUTPUTS["faults"].results}"$', faults, re.M)
    assert all(p.parent == RESULTS_DIR for p in map(results_file, OUTPUTS))
    assert Path(bench.__file__).parent / "results" == RESULTS_DIR


@pytest.mark.parametrize("variant", [["--profile"], ["--threads", "1"]])
def test_a_variant_operator_run_needs_its_own_output_and_never_replaces_the_current_one(
    variant: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.operator import RESULTS, THREADS, cli, results_path

    with pytest.raises(SystemExit) as refused:  # before any cluster is started
        cli(variant)
    assert refused.value.code == 2 and "needs --output" in capsys.readouterr().err
    assert results_path(None) == RESULTS
    assert results_path(Path("/tmp/run.json"), profile=True, threads=1) == Path("/tmp/run.json")
    with pytest.raises(ValueError):
        results_path(None, threads=THREADS + 1)


@pytest.mark.parametrize("doc", docs(), ids=lambda p: p.name)
def test_docs_mention_only_results_files_that_exist(doc: Path) -> None:
    plots = {o.plot for o in OUTPUTS.values()}  # drawn by `python -m bench report`, not committed
    for name in MENTION.findall(doc.read_text()):
        assert name in declared(), f"{doc.name} mentions bench/results/{name}, which no benchmark writes"
        assert name in plots or (RESULTS_DIR / name).is_file(), f"{doc.name}: bench/results/{name} is missing"


def test_the_benchmarks_page_is_one_short_current_page() -> None:
    text = PAGE.read_text()
    lines = text.splitlines()
    assert len(lines) <= MAX_PAGE_LINES, (
        f"docs/benchmarks.md has {len(lines)} lines (at most {MAX_PAGE_LINES})"
    )
    for output in OUTPUTS.values():  # every benchmark's current results, and how to rerun it
        assert f"bench/results/{output.results}" in text
    assert "make bench" in text and "make chaos" in text
    # Its in-page links point at its headings (GitHub's anchors).
    anchors = {
        re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)
    }
    for link in re.findall(r"\]\(#([^)]+)\)", text):
        assert link in anchors


def test_the_readme_troubleshooting_rows_on_bursts_are_short_and_link_the_measurements() -> None:
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Troubleshooting", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in table.splitlines() if r.startswith("| ") and "burst" in r]
    assert len(rows) >= 2
    for row in rows:
        symptom, cause = (cell.strip() for cell in row.strip("|").split(" | ")[:2])
        assert "(docs/benchmarks.md#" in cause, symptom
        assert len(cause) <= 350 and cause.count(". ") == 0, f"one sentence, with the link: {symptom}"


def _scale_section() -> str:
    return PAGE.read_text().split("## Scale: checkpoints, loading, export", 1)[1].split("\n## ", 1)[0]


def test_the_scale_sizes_have_one_name_in_the_bench_its_results_and_the_page() -> None:
    """A size is named by its parameter count in millions, rounded (46M, 168M, 340M), in
    bench/scale.py, in scale.json and on the page (they once said 40M/170M in the first two)."""
    import json

    from bench import scale

    results = json.loads(scale.RESULTS.read_text())
    assert list(results["sizes"]) == list(scale.SIZES)
    for label, size in results["sizes"].items():
        assert label == f"{round(size['figures']['params'] / 1e6)}M", label
        assert size["model"] == scale.SIZES[label]
    assert results["targets"]["size"] == scale.TARGET_SIZE
    section = _scale_section()
    (header,) = [line for line in section.splitlines() if line.startswith("| | ")]
    assert [cell.strip() for cell in header.strip("|").split("|")][1:] == list(scale.SIZES)
    assert f"| target at {scale.TARGET_SIZE} |" in section


def test_the_page_says_whether_the_saves_device_wait_was_measured_apart() -> None:
    """A trainer before issue 46 timed a save's wait for the device with its staging copy: where
    scale.json's periodic saves lack the split, the page must say so, and must stop saying so once a
    run measured it."""
    import json

    from bench import scale

    results = json.loads(scale.RESULTS.read_text())
    saves = [
        save
        for size in results["sizes"].values()
        for save in (size["figures"].get("periodic") or {}).get("saves") or []
    ]
    assert saves
    split = [save.get("device_wait_seconds") is not None for save in saves]
    assert all(split) or not any(split), "a results file from one trainer: all saves split, or none"
    says_not_measured = scale.SPLIT_NOT_MEASURED in _scale_section().lower()
    assert says_not_measured == (not all(split))
    for verdict in results["verdicts"][:1]:  # the periodic save's, as the bench judged it
        assert (scale.SPLIT_NOT_MEASURED in verdict["value"]) == (not all(split))


def test_the_trainer_results_hold_both_backends_from_one_run_on_the_same_data() -> None:
    """trainer.json's `backends` (issue 48): xla and native through `tpuft train` in the run that wrote
    the device counts, alternating, every run on the one prepared dataset, the native runs' every
    process counted; its figures are what its runs give, and the page shows them as they are."""
    import json

    from bench import backends, scale, trainer

    results = json.loads(trainer.RESULTS.read_text())
    both = results["backends"]
    assert both["started"] >= results["started"] and both["model"] == results["model"] == trainer.MODEL
    assert (both["seq_len"], both["global_batch"]) == (results["seq_len"], results["global_batch"])
    assert len(both["order"]) >= 2 and both["order"] == backends.order(len(both["order"]) // 2)
    assert [r["backend"] for r in both["runs"]] == both["order"]
    periodic = list(range(both["save_steps"], both["steps"], both["save_steps"]))
    for run in both["runs"]:
        assert run["exit_code"] == 0
        assert run["data"] == {"fingerprint": both["data"]["fingerprint"], "reused": True}
        roles = [p["role"] for p in run["rss"]["processes"] if not p["role"].startswith("other")]
        workers = [f"worker {i}" for i in range(both["devices"])]
        assert roles == (["process"] if run["backend"] == "xla" else ["launcher", *workers])
        assert run["rss"]["sum_of_peaks_bytes"] == sum(p["peak_bytes"] for p in run["rss"]["processes"])
        assert [s["step"] for s in run["saves"]] == periodic
        assert len(run["step_seconds"]) == both["steps"] - 1 and run["steps"]["compiled_after_warmup"] == []
        median = scale.median_step(run["step_seconds"], 1, periodic, both["warmup_steps"])
        assert median is not None and run["steps"]["median_step_seconds"] == round(median, 4)
    assert both["summary"] == json.loads(json.dumps(backends.summary(both["runs"])))
    losses = {r["backend"]: r["losses"] for r in both["runs"]}
    assert both["max_loss_difference"] is not None and both["max_loss_difference"] < 1e-3, losses
    section = PAGE.read_text().split("### xla and native side by side", 1)[1].split("\n## ", 1)[0]
    for row in backends.page_rows(both):
        assert row in section, row
