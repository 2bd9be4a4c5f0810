"""Evaluation rows: a named split of the same source, or a fraction of the training rows held out.

The hold-out is drawn by ``training.seed`` (datasets' ``train_test_split``), so a restarted run holds
out the same rows and never trains on its evaluation set. Rows are split before tokenising: a
conversation or document is either trained on or evaluated on, never cut between the two.
"""

from __future__ import annotations

from typing import Any

from tpuft_trainer import data
from tpuft_trainer.config import DatasetSource
from tpuft_trainer.errors import DataError


def split(rows: Any, source: DatasetSource, seed: int) -> tuple[Any, Any | None]:
    """(training rows, evaluation rows or None)."""
    if source.eval_fraction is not None:
        held = max(1, round(len(rows) * source.eval_fraction))
        if held >= len(rows):
            raise DataError(
                f"dataset {source.name}: dataset.evalFraction {source.eval_fraction} of {len(rows)} rows "
                "leaves nothing to train on"
            )
        parts = rows.train_test_split(test_size=held, seed=seed, shuffle=True)
        return parts["train"], parts["test"]
    if source.eval_split is not None:
        if source.eval_split == source.split:
            raise DataError(
                f"dataset {source.name}: dataset.evalSplit {source.eval_split!r} is the training split; "
                "evaluating on the training rows measures nothing (use evalFraction to hold rows out)"
            )
        return rows, data.load_rows(source.model_copy(update={"split": source.eval_split}))
    return rows, None
