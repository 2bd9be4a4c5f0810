"""Chat rows -> token ids and which of them are the assistant's (assistant-only loss).

Two ways to find the assistant's tokens, in this order:

1. The chat template marks them with ``{% generation %} ... {% endgeneration %}`` (trl's mechanism):
   transformers' ``apply_chat_template(return_assistant_tokens_mask=True)`` returns the mask.
2. No markers (most templates on the hub): the conversation is rendered once whole and once up to each
   assistant turn, with and without that turn. The turn is the text between "everything before it
   plus the generation prompt" and "everything up to and including it" (its content and its
   end-of-turn token, so the model learns to stop). This only holds when the template is *prefix
   stable*: rendering a prefix of the conversation gives a prefix of the whole rendering. That is
   checked for every conversation; a template that fails it (one that rewrites earlier turns, e.g.
   drops their reasoning) is a DataError, never a silent fall back to training on every token.

Characters map to tokens through the fast tokenizer's offsets: a token is the assistant's when its
characters overlap a turn's span (as transformers does for the markers).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from tpuft_trainer.errors import DataError

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")

Messages = Sequence[dict[str, Any]]
Span = tuple[int, int]


def has_generation_markers(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and bool(GENERATION_MARKER.search(template))


def render(tokenizer: Any, messages: Messages, *, add_generation_prompt: bool = False) -> str:
    text = tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return str(text)


class NotPrefixStable(ValueError):
    """The template renders a prefix of the conversation as something that is not a prefix."""


def assistant_spans(tokenizer: Any, messages: Messages) -> tuple[str, list[Span]]:
    """The whole rendering and the character spans of its assistant turns (method 2 above)."""
    whole = render(tokenizer, messages)
    spans: list[Span] = []
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = render(tokenizer, messages[:index], add_generation_prompt=True) if index else ""
        # The last turn's rendering through it is the whole one (most conversations end with the
        # assistant): one render fewer per conversation.
        through = whole if index == len(messages) - 1 else render(tokenizer, messages[: index + 1])
        if not (whole.startswith(through) and through.startswith(before) and len(through) > len(before)):
            raise NotPrefixStable(f"turn {index}")
        spans.append((len(before), len(through)))
    return whole, spans


def token_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[Span]) -> list[int]:
    """1 for every token whose characters overlap a span (spans and offsets both ascending)."""
    mask = [0] * len(offsets)
    index = 0
    for position, (start, end) in enumerate(offsets):
        while index < len(spans) and start >= spans[index][1]:
            index += 1
        if index == len(spans):
            break
        if end > spans[index][0] and end > start:
            mask[position] = 1
    return mask


def encode(
    tokenizer: Any, messages: Messages, *, assistant_only: bool, dataset: str
) -> tuple[list[int], list[int]]:
    """Token ids of one conversation and its loss mask (1 = the token counts in the loss).

    The template carries the special tokens itself, so the tokenizer adds none (as apply_chat_template)."""
    if not assistant_only:
        ids = tokenizer(render(tokenizer, messages), add_special_tokens=False)["input_ids"]
        return list(ids), [1] * len(ids)
    if has_generation_markers(tokenizer):
        out = tokenizer.apply_chat_template(
            list(messages), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), list(out["assistant_masks"])
    text, spans = spans_or_error(tokenizer, messages, dataset=dataset)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoded["input_ids"]), token_mask(encoded["offset_mapping"], spans)


def spans_or_error(tokenizer: Any, messages: Messages, *, dataset: str) -> tuple[str, list[Span]]:
    """``assistant_spans``, with a template that is not prefix-stable as the user's DataError."""
    try:
        return assistant_spans(tokenizer, messages)
    except NotPrefixStable as error:
        raise DataError(
            f"dataset {dataset}: the chat template has no {{% generation %}} markers and is not prefix-stable "
            f"({error}: rendering the conversation up to that turn is not a prefix of the whole), so the "
            "assistant's tokens cannot be found. Use a template with {% generation %} markers, or set "
            "dataset.assistantOnlyLoss: false to train on every token."
        ) from None
