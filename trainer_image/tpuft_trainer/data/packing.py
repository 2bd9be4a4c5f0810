"""Documents (token ids + a loss mask, any length) -> fixed-length rows: padded, or packed. On arrays.

Padded: one document per row, padded to ``max_length``, padding masked by ``attention_mask`` and out
of the loss.

Packed: several whole documents per row (best-fit decreasing: longest first, each into the open row it
fills best), so most positions are real tokens. Documents never see each other:

- attention: each row carries ``position_ids`` that restart at 0 with every document and *no*
  ``attention_mask``; transformers then detects the packed format (masking_utils
  ``find_packed_sequence_indices``) and builds a block-diagonal causal mask, so a token attends only
  to earlier tokens of its own document. Rotary positions restart too, so a packed document computes
  exactly what it computes alone (tests/trainer: logits packed vs alone);
- loss: the first token of every document gets label -100. A causal LM predicts token t+1 from
  position t, so without it the last token of one document would be trained to predict the first
  token of the next one.

The free tail of a row is padding (label -100) with positions of its own, like one more document.
Every row has the same shape, so XLA compiles one graph whatever the lengths.

Packing decides only *which documents share a row* (``best_fit``: a few integers per document); the
rows themselves are built when they are read (``build_row``), from the documents' tokens in
memory-mapped files (prepared.py). No Python list per token is ever made.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Any

import numpy as np

IGNORE = -100


def best_fit(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Documents grouped into rows of at most ``capacity`` positions, best-fit decreasing over the
    whole set: longest first (ties: the earlier document), each into the open row whose free space
    is the smallest that holds it (ties: the earlier row), else a new row.

    Returns ``(members, row_starts)``: row ``r`` holds documents ``members[row_starts[r]:row_starts[r +
    1]]`` in the order they were placed. Open rows are kept by free space (a sorted list of the
    distinct free amounts, at most ``capacity`` of them, and a heap of rows for each), so a placement
    costs a binary search, not a scan: a million documents pack in seconds."""
    order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")
    row_of = np.empty(len(order), dtype=np.int64)
    free_amounts: list[int] = []  # ascending, each with at least one open row
    rows_with: dict[int, list[int]] = {}  # free amount -> heap of open rows
    rows = 0
    for placed, length in enumerate(lengths[order].tolist()):
        slot = bisect.bisect_left(free_amounts, length)
        if slot < len(free_amounts):
            space = free_amounts[slot]
            row = heapq.heappop(rows_with[space])
            if not rows_with[space]:
                del rows_with[space]
                free_amounts.pop(slot)
        else:
            space, row = capacity, rows
            rows += 1
        row_of[placed] = row
        left = space - length
        if left > 0:
            if left not in rows_with:
                rows_with[left] = []
                bisect.insort(free_amounts, left)
            heapq.heappush(rows_with[left], row)
    by_row = np.argsort(row_of, kind="stable")
    members = order[by_row]
    row_starts = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row_of, minlength=rows), out=row_starts[1:])
    return members, row_starts


def build_row(
    tokens: list[np.ndarray], masks: list[np.ndarray], max_length: int, pad_id: int, *, packed: bool
) -> dict[str, np.ndarray]:
    """One row of ``max_length`` from its documents' token ids and loss masks (1: the token counts),
    as int64 arrays: ``input_ids``, ``labels`` and ``position_ids`` (packed) or ``attention_mask``
    (padded, one document)."""
    ids = np.full(max_length, pad_id, dtype=np.int64)
    labels = np.full(max_length, IGNORE, dtype=np.int64)
    at = 0
    if not packed:
        (doc,), (mask,) = tokens, masks
        ids[: len(doc)] = doc
        labels[: len(doc)] = np.where(mask != 0, doc, IGNORE)
        attention = np.zeros(max_length, dtype=np.int64)
        attention[: len(doc)] = 1
        return {"input_ids": ids, "attention_mask": attention, "labels": labels}
    positions = np.empty(max_length, dtype=np.int64)
    for doc, mask in zip(tokens, masks, strict=True):
        end = at + len(doc)
        ids[at:end] = doc
        labels[at:end] = np.where(mask != 0, doc, IGNORE)
        labels[at] = IGNORE  # nothing predicts a document's first token
        positions[at:end] = np.arange(len(doc))
        at = end
    positions[at:] = np.arange(max_length - at)
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


# Model types whose transformers 5.24 implementation builds its attention mask with masking_utils from
# the position ids (so packed documents are isolated), each checked by tests/trainer (a document's
# logits packed vs alone). Anything else is refused rather than trusted: a model that ignored the
# position ids would attend across documents without any error.
PACKING_MODEL_TYPES = frozenset(
    {
        "llama", "gemma", "gemma2", "gemma3_text", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3",
        "qwen3_moe", "phi3",
    }
)  # fmt: skip
# The attention implementations that take masking_utils' mask (flash attention would need its own
# varlen kernels, which XLA does not have).
PACKING_ATTENTION = frozenset({"sdpa", "eager"})


def packing_refusal(model: Any) -> str | None:
    """Why ``model`` cannot train on packed rows, or None when it can."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    model_type = getattr(config, "model_type", None)
    if model_type not in PACKING_MODEL_TYPES:
        return (
            f"dataset.packing isolates documents through position ids, which is verified for model types "
            f"{sorted(PACKING_MODEL_TYPES)}; {model_type!r} is not one of them (its documents could attend "
            "to each other); set packing: false"
        )
    attention = getattr(config, "_attn_implementation", None)
    if attention not in PACKING_ATTENTION:
        return (
            f"dataset.packing needs attention 'sdpa' or 'eager' (masks from position ids); the model uses "
            f"{attention!r}"
        )
    return None
