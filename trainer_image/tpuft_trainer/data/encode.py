"""Rows of a dataset -> documents: token ids and a loss mask each, as flat arrays. One chunk at a time.

A chunk of rows is rendered (chat), tokenised in one batched call (the fast tokenizer spreads a batch
over its threads) and cut to ``max_length``; rows with nothing to learn are dropped. What comes out is
three arrays (every kept document's ids back to back, their loss masks, their lengths), never a
Python list per token: prepare.py appends them to files and the chunk is gone.

What a document is, per format (the same as ``chat.encode`` says for one conversation, which the
tests hold this to):

- text: the text tokenised with the tokenizer's special tokens, cut at ``max_length``; every token
  counts in the loss;
- chat: the conversation rendered with the chat template (which carries its special tokens); with
  assistant-only loss only the assistant's turns count (chat.py finds them: the template's
  ``{% generation %}`` markers, else the prefix renderings, here tokenised in one batch with
  character offsets).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpuft_trainer.config import DatasetSource
from tpuft_trainer.data import chat
from tpuft_trainer.errors import DataError


@dataclass
class EncodedChunk:
    """The kept documents of a chunk of rows, and what happened to the others."""

    tokens: np.ndarray  # int32: every kept document's token ids, back to back
    masks: np.ndarray  # uint8: 1 where the token counts in the loss
    lengths: np.ndarray  # int32: each kept document's length (<= max_length)
    rows: int  # rows read
    dropped: int  # rows without a token to learn within max_length
    loss_tokens: int  # tokens that count in the loss, beyond each document's first (nothing predicts it)


def field_of(source: DatasetSource) -> str:
    return source.text_field if source.format == "text" else source.messages_field


def check_fields(column_names: Sequence[str], tokenizer: Any, source: DatasetSource) -> None:
    """The dataset has the field its format reads, and a chat set's tokenizer has a chat template."""
    field = field_of(source)
    if field not in column_names:
        setting = "textField" if source.format == "text" else "messagesField"
        raise DataError(
            f"dataset {source.name} has no {field!r} field (format {source.format}); its fields are "
            f"{list(column_names)}. Set dataset.{setting}."
        )
    if source.format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise DataError(f"dataset {source.name} is in chat format but the tokenizer has no chat template")


def encode_chunk(
    values: Sequence[Any], tokenizer: Any, source: DatasetSource, max_length: int
) -> EncodedChunk:
    """The documents of ``values`` (the format's field of a chunk of rows)."""
    try:
        ids, masks = _tokenise(values, tokenizer, source, max_length)
    except DataError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise DataError(f"dataset {source.name}: rows cannot be tokenised ({error})") from error
    kept_ids, kept_masks = [], []
    dropped = loss_tokens = 0
    for row_ids, row_mask in zip(ids, masks, strict=True):
        row_ids, row_mask = row_ids[:max_length], row_mask[:max_length]
        learnable = int(row_mask[1:].sum())
        if not learnable:  # a batch of only such rows would have a loss of 0/0 (NaN)
            dropped += 1
            continue
        loss_tokens += learnable
        kept_ids.append(row_ids)
        kept_masks.append(row_mask)
    return EncodedChunk(
        tokens=_concatenate(kept_ids, np.int32),
        masks=_concatenate(kept_masks, np.uint8),
        lengths=np.fromiter((len(row) for row in kept_ids), dtype=np.int32, count=len(kept_ids)),
        rows=len(values),
        dropped=dropped,
        loss_tokens=loss_tokens,
    )


def _concatenate(arrays: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.empty(0, dtype=dtype)


def _tokenise(
    values: Sequence[Any], tokenizer: Any, source: DatasetSource, max_length: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each row's token ids and loss mask (uint8), not yet cut."""
    if source.format == "text":
        encoded = tokenizer([str(text) for text in values], max_length=max_length, truncation=True)
        ids = [np.asarray(row, dtype=np.int32) for row in encoded["input_ids"]]
        return ids, [np.ones(len(row), dtype=np.uint8) for row in ids]
    if not source.trains_on_assistant_only:
        texts = [chat.render(tokenizer, messages) for messages in values]
        ids = [
            np.asarray(row, dtype=np.int32) for row in tokenizer(texts, add_special_tokens=False)["input_ids"]
        ]
        return ids, [np.ones(len(row), dtype=np.uint8) for row in ids]
    if chat.has_generation_markers(tokenizer):  # the template marks the assistant's tokens itself
        pairs = [chat.encode(tokenizer, m, assistant_only=True, dataset=source.name) for m in values]
        return (
            [np.asarray(row_ids, dtype=np.int32) for row_ids, _ in pairs],
            [np.asarray(mask, dtype=np.uint8) for _, mask in pairs],
        )
    rendered = [chat.spans_or_error(tokenizer, messages, dataset=source.name) for messages in values]
    encoded = tokenizer([text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
    ids, masks = [], []
    for row_ids, offsets, (_, spans) in zip(
        encoded["input_ids"], encoded["offset_mapping"], rendered, strict=True
    ):
        ids.append(np.asarray(row_ids, dtype=np.int32))
        masks.append(span_mask(np.asarray(offsets, dtype=np.int64).reshape(-1, 2), spans))
    return ids, masks


def span_mask(offsets: np.ndarray, spans: Sequence[chat.Span]) -> np.ndarray:
    """1 for every token whose characters overlap a span: ``chat.token_mask`` on arrays."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(offsets), dtype=bool)
    for span_start, span_end in spans:
        mask |= (starts < span_end) & (ends > span_start)
    mask &= ends > starts  # tokens the tokenizer added (no characters) are nobody's
    return mask.astype(np.uint8)
