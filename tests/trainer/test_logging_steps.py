"""`training.logging_steps` through `tpuft train` (issue 41, item 7): the loss is read to the host (a
host-device sync) only every N steps and at the last, each read the mean of the steps since the one
before; progress still reports every step."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import pytest
from runs import full, logged_losses, losses, metrics, write_config
from spmd import Pool, Proc, run_train

pytestmark = pytest.mark.trainer


def every_third_step() -> tuple[Proc, Path]:
    """The reference run (runs.full: 8 steps) reading its loss every 3 steps."""
    config, output = write_config({"training": {"logging_steps": 3}})
    return run_train(config), output


SPMD_JOBS = {"train:full": full, "train:logging-3": every_third_step}


def test_the_loss_is_read_every_logging_steps_and_at_the_last_step(pool: Pool) -> None:
    proc, output = pool.get("train:logging-3")
    reference_proc, reference_output = pool.get("train:full")
    assert proc.returncode == 0, proc.tail()
    assert reference_proc.returncode == 0, reference_proc.tail()
    record, reference = metrics(output), losses(metrics(reference_output))
    got = losses(record)
    # Steps 3 and 6, and the last (8, not a multiple): each the mean of the steps since the last read.
    expected = {
        end: statistics.mean(reference[s] for s in range(start, end + 1))
        for start, end in [(1, 3), (4, 6), (7, 8)]
    }
    assert got == pytest.approx(expected, rel=1e-5), (got, reference)
    assert (
        sorted(int(s) for s in record["learning_rates"])
        == sorted(int(s) for s in record["grad_norms"])
        == [3, 6, 8]
    )
    # Reading less often adds no graph: the same ones compile, the last by the step after the first read.
    compiles = {int(k): v for k, v in record["compiles_after_step"].items()}
    assert compiles[5] == compiles[8] == metrics(reference_output)["compiles_after_step"]["8"], compiles


def test_progress_reports_every_step_between_reads(pool: Pool) -> None:
    proc, output = pool.get("train:logging-3")
    assert proc.returncode == 0, proc.tail()
    steps = [int(s) for s in re.findall(r"progress: step (\d+)/8", proc.stderr)]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8, 8]  # the last twice: at its read and when training ends
    # A line carries a loss only at a step that read one; the others carry throughput and ETA.
    assert logged_losses(proc) == pytest.approx(losses(metrics(output)), abs=1e-4)
    assert re.search(r"progress: step 5/8 \| [\d,]+ tokens/s \| ETA \d+:\d\d\n", proc.stderr), proc.tail()
