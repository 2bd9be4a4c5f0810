"""Documents (token ids + labels of any length) -> fixed-length rows: padded, or packed.

Padded: one document per row, cut or padded to ``max_length``, padding masked by ``attention_mask``
and out of the loss.

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
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

IGNORE = -100


@dataclass(frozen=True)
class Document:
    input_ids: list[int]
    labels: list[int]  # IGNORE where the token does not count in the loss

    def cut(self, max_length: int) -> Document:
        return Document(self.input_ids[:max_length], self.labels[:max_length])


def padded_rows(documents: Iterable[Document], max_length: int, pad_id: int) -> dict[str, list[list[int]]]:
    rows: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": [], "labels": []}
    for document in documents:
        doc = document.cut(max_length)
        free = max_length - len(doc.input_ids)
        rows["input_ids"].append(doc.input_ids + [pad_id] * free)
        rows["attention_mask"].append([1] * len(doc.input_ids) + [0] * free)
        rows["labels"].append(doc.labels + [IGNORE] * free)
    return rows


def best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indexes of ``lengths`` grouped into bins of at most ``capacity``: best-fit decreasing. Open bins
    are kept sorted by free space, so each placement is a binary search."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free space, bin index), ascending
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        slot = bisect.bisect_left(free, (length, -1))
        if slot < len(free):
            space, chosen = free.pop(slot)
        else:
            space, chosen = capacity, len(bins)
            bins.append([])
        bins[chosen].append(index)
        if space - length > 0:
            bisect.insort(free, (space - length, chosen))
    return bins


def packed_rows(documents: Sequence[Document], max_length: int, pad_id: int) -> dict[str, list[list[int]]]:
    docs = [d.cut(max_length) for d in documents if d.input_ids]
    rows: dict[str, list[list[int]]] = {"input_ids": [], "position_ids": [], "labels": []}
    for members in best_fit([len(d.input_ids) for d in docs], max_length):
        ids: list[int] = []
        positions: list[int] = []
        labels: list[int] = []
        for index in members:
            doc = docs[index]
            ids += doc.input_ids
            positions += range(len(doc.input_ids))
            labels += [IGNORE, *doc.labels[1:]]  # nothing predicts a document's first token
        free = max_length - len(ids)
        rows["input_ids"].append(ids + [pad_id] * free)
        rows["position_ids"].append(positions + list(range(free)))
        rows["labels"].append(labels + [IGNORE] * free)
    return rows


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
