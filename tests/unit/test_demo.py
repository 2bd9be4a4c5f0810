"""The demo's loss curve: a PNG of the training and evaluation losses from tpuft-metrics.json."""

from __future__ import annotations

from pathlib import Path

from tpuft_dev.demo import plot_losses


def test_loss_curve_is_a_png_of_both_losses(tmp_path: Path) -> None:
    metrics = {"losses": {"1": 4.0, "2": 3.5, "3": 3.1}, "eval_losses": {"2": 3.7, "3": 3.3}}
    path = plot_losses(metrics, tmp_path / "loss-curve.png")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000
    without_eval = plot_losses({"losses": metrics["losses"]}, tmp_path / "train-only.png")
    assert without_eval.read_bytes() != data  # the evaluation line is drawn


def test_the_data_line_says_the_prepared_figures() -> None:
    from tpuft_dev.demo import data_line

    data = {
        "settingsHash": "h",
        "fingerprint": "f1",
        "reused": False,
        "documents": 230,
        "droppedDocuments": 0,
        "rows": 120,
        "positions": 3840,
        "lossTokenShare": 0.91,
        "evalRows": 26,
        "preparedSeconds": 1.24,
        "stepsPerEpoch": 15,
        "epochsCovered": 2.0,
    }
    assert data_line(data) == (
        "data: 120 rows from 230 documents (0 dropped), 26 evaluation rows, 91% of the positions in the "
        "loss; 15 steps an epoch, maxSteps covers 2.0 epochs; prepared in 1.2 s (f1)"
    )
    assert data_line({"settingsHash": "h"}) == "data prepared (no figures reported)"
