"""Evaluation in the Trainer: the prepared evaluation rows (a named split of the same source, or a
fraction of the training rows held out by ``training.seed``: data.prepare.split_rows) in whole batches.

An evaluation set of any size works: its last batch is filled with rows that carry no loss, and the
loss reported is the mean over every real token (``full_batches``, ``token_mean_loss``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tpuft_trainer.data.prepare import Prepared
from tpuft_trainer.data.prepared import EVAL, PreparedRows

log = logging.getLogger(__name__)


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


def full_batches(ready: Prepared, global_batch: int, *, name: str) -> tuple[PreparedRows, EvalBatches]:
    """The prepared evaluation rows followed by rows that carry no loss, up to whole global batches.

    Every batch must be full under SPMD (one compiled shape; the Trainer's ``drop_last`` would drop
    the rest silently), and a small evaluation set is still worth evaluating. A padding row attends to
    its own pad tokens (a row of attention_mask zeros gives NaN attention on some backends) and has
    every label IGNORE, so it adds nothing to the loss's sum or its token count (prepared.py)."""
    figures = ready.manifest.splits[EVAL]
    padding = -figures.rows % global_batch
    if figures.rows < global_batch:
        log.warning(
            "evaluation set %s has %d rows (%d tokens in the loss), fewer than one global batch (%d): "
            "its loss will be noisy; hold out more rows (dataset.evalFraction) or name a larger dataset.evalSplit",
            name,
            figures.rows,
            figures.loss_tokens,
            global_batch,
        )
    if padding:
        log.info("evaluation set %s: %d rows padded with %d that carry no loss", name, figures.rows, padding)
    rows = ready.rows(EVAL, padding_rows=padding)
    return rows, EvalBatches(figures.rows, padding, figures.loss_tokens, len(rows) // global_batch)


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
