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
