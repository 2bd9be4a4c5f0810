"""Evaluation rows: a named split of the same source, or a fraction of the training rows held out.

The hold-out is drawn by ``training.seed`` (datasets' ``train_test_split``), so a restarted run holds
out the same rows and never trains on its evaluation set. Rows are split before tokenising: a
conversation or document is either trained on or evaluated on, never cut between the two.

An evaluation set of any size works: its last batch is filled with rows that carry no loss, and the
loss reported is the mean over every real token (``pad_to_full_batches``, ``token_mean_loss``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tpuft_trainer import data
from tpuft_trainer.config import DatasetSource
from tpuft_trainer.errors import DataError
from tpuft_trainer.packing import IGNORE

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class EvalBatches:
    """An evaluation set laid out in full global batches (one compiled shape), and what it holds."""

    rows: int  # real rows
    padding: int  # fully masked rows added to fill the last batch
    loss_tokens: int  # the real rows' positions that count in the loss
    batches: int

    @property
    def items_per_batch(self) -> float:
        """The divisor that makes each batch's summed loss add up to the mean over every real token
        once the Trainer averages the batches' losses (it weighs batches equally)."""
        return self.loss_tokens / self.batches


def pad_to_full_batches(
    dataset: Any, global_batch: int, pad_id: int, *, name: str
) -> tuple[Any, EvalBatches]:
    """The evaluation rows padded to a whole number of global batches with rows that carry no loss.

    Every batch must be full under SPMD (one compiled shape; the Trainer's ``drop_last`` would drop
    the rest silently), and a small evaluation set is still worth evaluating. A padding row attends to
    its own pad tokens (a row of attention_mask zeros gives NaN attention on some backends) and has
    every label IGNORE, so it adds nothing to the loss's sum or its token count."""
    import datasets

    figures = data.figures(dataset)
    padding = -len(dataset) % global_batch
    if len(dataset) < global_batch:
        log.warning(
            "evaluation set %s has %d rows (%d tokens in the loss), fewer than one global batch (%d): "
            "its loss will be noisy; hold out more rows (dataset.evalFraction) or name a larger dataset.evalSplit",
            name,
            len(dataset),
            figures.loss_tokens,
            global_batch,
        )
    if padding:
        log.info("evaluation set %s: %d rows padded with %d that carry no loss", name, len(dataset), padding)
        width = len(dataset[0]["input_ids"])
        blank = {
            "input_ids": [pad_id] * width,
            "labels": [IGNORE] * width,
            "attention_mask": [1] * width,
            "position_ids": list(range(width)),
        }
        rows = {column: [blank[column]] * padding for column in dataset.column_names}
        dataset = datasets.concatenate_datasets(
            [dataset, datasets.Dataset.from_dict(rows, features=dataset.features)]
        )
    return dataset, EvalBatches(figures.rows, padding, figures.loss_tokens, len(dataset) // global_batch)


def token_mean_loss(trainer_class: type, items_per_batch: float) -> type:
    """``trainer_class`` whose evaluation loss is the mean over every real token of the set.

    The Trainer averages its evaluation batches' losses with equal weights, and each is its batch's
    own token mean: a padded last batch (fewer real tokens) would count as much as a full one. Here
    each batch's loss is its summed token loss over ``items_per_batch`` (the set's loss tokens / its
    batches): their average is the set's token mean, exactly. A constant, so no new graph."""

    class TokenMeanEvaluation(trainer_class):
        def compute_loss(
            self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
        ) -> Any:
            if not model.training:
                num_items_in_batch = items_per_batch
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )

    TokenMeanEvaluation.__name__ = TokenMeanEvaluation.__qualname__ = trainer_class.__name__
    return TokenMeanEvaluation
