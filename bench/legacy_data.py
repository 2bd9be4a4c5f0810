"""The data path of tpuft up to commit ffed871, kept verbatim in behaviour as the yardstick the
prepared-data path (trainer_image/tpuft_trainer/data/) is measured and tested against: ``python -m
bench data`` times it ("today's in-process path"), and tests/trainer hold the new rows equal to its
rows, bit for bit. It builds a Python ``Document`` (two lists of ints) per conversation and Python lists
per row: do not use it for training.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tpuft_trainer.config import DatasetSource
from tpuft_trainer.data import chat
from tpuft_trainer.errors import DataError

log = logging.getLogger(__name__)

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


def documents(rows: Any, tokenizer: Any, source: DatasetSource, max_length: int) -> Any:
    """One document per row: ``input_ids`` and ``labels`` (-100 where the token is not trained on),
    cut to ``max_length``, not padded. Chat rows are rendered with the tokenizer's chat template; with
    assistant-only loss only the assistant's turns are labelled (chat.py)."""
    field = source.text_field if source.format == "text" else source.messages_field
    if field not in rows.column_names:
        raise DataError(
            f"dataset {source.name} has no {field!r} field (format {source.format}); its fields are "
            f"{rows.column_names}. Set dataset.{'textField' if source.format == 'text' else 'messagesField'}."
        )
    if source.format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise DataError(f"dataset {source.name} is in chat format but the tokenizer has no chat template")
    assistant_only = source.trains_on_assistant_only

    def encode(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"input_ids": [], "labels": []}
        if source.format == "text":
            encoded = tokenizer([str(text) for text in batch[field]], max_length=max_length, truncation=True)
            out["input_ids"] = encoded["input_ids"]
            out["labels"] = [list(ids) for ids in encoded["input_ids"]]
            return out
        for messages in batch[field]:
            ids, mask = chat.encode(tokenizer, messages, assistant_only=assistant_only, dataset=source.name)
            out["input_ids"].append(ids[:max_length])
            out["labels"].append(
                [t if keep else IGNORE for t, keep in zip(ids, mask, strict=True)][:max_length]
            )
        return out

    try:
        return rows.map(encode, batched=True, remove_columns=rows.column_names, desc="tokenising")
    except (KeyError, TypeError, ValueError) as error:
        if isinstance(error, DataError):
            raise
        raise DataError(f"dataset {source.name}: rows cannot be tokenised ({error})") from error


def tokenize(
    rows: Any, tokenizer: Any, source: DatasetSource, max_length: int, min_rows: int, *, what: str = "dataset"
) -> Any:
    """Fixed-length rows: padded (``input_ids``/``attention_mask``/``labels``) or packed
    (``input_ids``/``position_ids``/``labels``), see packing.py."""
    import datasets

    docs = _with_a_target(documents(rows, tokenizer, source, max_length), source, max_length, what)
    pad_id = tokenizer.pad_token_id
    if source.packing:
        as_documents = [
            Document(ids, labels) for ids, labels in zip(docs["input_ids"], docs["labels"], strict=True)
        ]
        tokenized = datasets.Dataset.from_dict(packed_rows(as_documents, max_length, pad_id))
    else:
        tokenized = docs.map(
            lambda batch: padded_rows(
                (Document(i, lab) for i, lab in zip(batch["input_ids"], batch["labels"], strict=True)),
                max_length,
                pad_id,
            ),
            batched=True,
            desc="padding",
        )
    if len(tokenized) < min_rows:
        packed = f" after packing {len(docs)} documents" if source.packing else ""
        raise DataError(
            f"{what} {source.name} has {len(tokenized)} rows{packed}, fewer than one global batch ({min_rows}); "
            "every batch must be full (drop_last)"
        )
    return tokenized


def _with_a_target(docs: Any, source: DatasetSource, max_length: int, what: str) -> Any:
    """The documents with at least one label to learn (beyond their first token, which nothing
    predicts). The others add nothing but padding, and a batch of only such rows has a loss of 0/0
    (NaN): with assistant-only loss, a conversation cut at max_seq_length before the assistant speaks."""
    kept = docs.filter(
        lambda row: any(label != IGNORE for label in row["labels"][1:]), desc="dropping rows without a target"
    )
    dropped = len(docs) - len(kept)
    cause = (
        "the assistant's turns fall beyond training.maxSeqLength"
        if source.trains_on_assistant_only
        else "they are empty or one token long"
    )
    if dropped and not len(kept):
        raise DataError(
            f"{what} {source.name}: none of its {len(docs)} rows has a token to learn within "
            f"{max_length} positions ({cause}); raise training.maxSeqLength"
        )
    if dropped:
        log.warning("%s %s: %d of %d rows dropped: %s", what, source.name, dropped, len(docs), cause)
    return kept


@dataclass(frozen=True)
class RowFigures:
    """What a dataset of fixed-length rows holds: positions, and the positions that count in the loss
    (a causal LM's first position predicts nothing: labels[1:] are the targets, as the Trainer counts)."""

    rows: int
    positions: int
    loss_tokens: int

    @property
    def loss_share(self) -> float:
        return self.loss_tokens / self.positions if self.positions else 0.0


def figures(dataset: Any) -> RowFigures:
    import numpy as np

    loss_tokens = positions = 0
    for batch in dataset.with_format("numpy").iter(batch_size=1024):
        labels = np.asarray(batch["labels"])
        positions += labels.size
        loss_tokens += int((labels[:, 1:] != IGNORE).sum())
    return RowFigures(len(dataset), positions, loss_tokens)
