"""Preference pairs (objective dpo), prepared once as trl's DPOTrainer would tokenise them at start.

trl 1.16's ``DPOTrainer._prepare_dataset`` tokenises every pair when the trainer is built, on every
host and at every restart (measured: ~170 chat pairs a second, each pair rendered three times, one
pair a call). Here the same columns are made once by ``data.prepare`` (``tpuft prepare``, or
``tpuft train`` when none is prepared), on the pool of workers, one batched tokeniser call a chunk,
and written memory-mappable; compat.py's ``dpo_pretokenised`` lets DPOTrainer take them as they are.

What a pair becomes (trl 1.16, exactly; tests/trainer/test_dpo.py holds this to trl's own output):

- plain text: EOS appended to chosen and rejected unless they end with it; then ``prompt``,
  ``prompt + chosen`` and ``prompt + rejected`` tokenised with the tokenizer's special tokens;
- chat messages: ``prompt`` rendered with the generation prompt, ``prompt + chosen`` and
  ``prompt + rejected`` rendered whole, each tokenised without special tokens (the template has them);
- the completion starts where the prompt's ids and prompt + completion's first differ (a template
  that renders the prompt alone differently, or a token merging across the boundary, moves it back):
  ``prompt_ids`` is that common prefix, ``chosen_ids``/``rejected_ids`` the rest;
- a pair whose prompt alone fills ``max_length`` is dropped (trl's ``keep_start`` filter: nothing of
  its completions would be left). Completions are stored whole: trl's collator cuts prompt +
  completion to ``max_length`` when it builds a batch, and a pair it will cut counts as *truncated*.

Files of a split (``prepared/<fingerprint>/<split>/``), little-endian, as the rows' of SFT::

    prompt_ids.bin, chosen_ids.bin, rejected_ids.bin           int32  every kept pair's ids, back to back
    prompt_starts.bin, chosen_starts.bin, rejected_starts.bin  int64  pair i is ids[starts[i]:starts[i + 1]]

Read back as a ``datasets.Dataset`` (what DPOTrainer requires) of Arrow large-list columns laid over
the memory-mapped files: nothing is copied or decoded until a row is read, and then only that row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tpuft_trainer.config import DatasetSource
from tpuft_trainer.data.prepared import SplitFigures, memmap
from tpuft_trainer.errors import DataError

PARTS = ("prompt", "chosen", "rejected")
# The columns trl's DPOTrainer reads of a tokenised pair (its collator's input) and the API field that
# names each part in the user's rows.
ID_COLUMNS = tuple(f"{part}_ids" for part in PARTS)
SETTINGS = {"prompt": "promptField", "chosen": "chosenField", "rejected": "rejectedField"}
TEXT, MESSAGES = "text", "messages"


def fields(source: DatasetSource) -> dict[str, str]:
    """Each part's field in the user's rows."""
    return {"prompt": source.prompt_field, "chosen": source.chosen_field, "rejected": source.rejected_field}


def check_fields(column_names: Sequence[str], source: DatasetSource) -> None:
    """The rows have the three fields, and they are three different ones."""
    named = fields(source)
    for part, name in named.items():
        if name not in column_names:
            raise DataError(
                f"dataset {source.name} has no {name!r} field (format preference, the {part}); its fields "
                f"are {list(column_names)}. Set dataset.{SETTINGS[part]}."
            )
    if len(set(named.values())) < len(named):
        raise DataError(
            f"dataset {source.name}: dataset.promptField, chosenField and rejectedField must name three "
            f"different fields, not {list(named.values())}"
        )


def _kind(value: Any) -> str:
    if isinstance(value, str):
        return TEXT
    if (
        isinstance(value, list)
        and value
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    ):
        return MESSAGES
    return type(value).__name__ if not isinstance(value, list) else "list (not chat messages)"


def kind_of(values: Mapping[str, Sequence[Any]], source: DatasetSource) -> str:
    """``text`` or ``messages``: every prompt, chosen and rejected value of the chunk of one kind (trl
    decides by the first pair whether the whole set is chat)."""
    named = fields(source)
    kinds = {part: {_kind(v) for v in values[named[part]]} for part in PARTS}
    found = set().union(*kinds.values())
    if len(found) != 1 or not found <= {TEXT, MESSAGES}:
        detail = ", ".join(f"{named[part]}: {sorted(k)}" for part, k in kinds.items())
        raise DataError(
            f"dataset {source.name}: every prompt, chosen and rejected value must be a string, or every one a "
            f"list of chat messages ({{role, content}}); found {detail}"
        )
    return found.pop()


# ---- a chunk of pairs -> their columns ------------------------------------------------------------
@dataclass
class EncodedPairs:
    """The kept pairs of a chunk, each part's ids back to back with their lengths."""

    ids: dict[str, np.ndarray]  # part -> int32 ids of every kept pair
    lengths: dict[str, np.ndarray]  # part -> int32 length of each kept pair's ids
    kind: str  # text or messages
    rows: int  # pairs read
    dropped: int  # pairs whose prompt alone fills max_length (trl drops them)
    truncated: int  # kept pairs whose prompt + chosen or prompt + rejected exceeds max_length
    loss_tokens: int  # completion tokens within max_length (the positions DPO scores), both sides
    moved_boundary: int  # pairs whose completion starts before the end of the prompt's own ids
    tokens: int  # ids stored, all parts


def encode_pairs(
    values: Mapping[str, Sequence[Any]], tokenizer: Any, source: DatasetSource, max_length: int, *, kind: str
) -> EncodedPairs:
    """The pairs of ``values`` (the three fields of a chunk of rows), all of ``kind`` (the set's)."""
    named = fields(source)
    found = kind_of(values, source)
    if found != kind:
        raise DataError(
            f"dataset {source.name}: its first pair is {kind} but later pairs are {found}; every prompt, "
            "chosen and rejected value must be a string, or every one a list of chat messages"
        )
    prompts, chosen, rejected = (list(values[named[part]]) for part in PARTS)
    try:
        if kind == MESSAGES:
            if not getattr(tokenizer, "chat_template", None):
                raise DataError(
                    f"dataset {source.name} has chat messages but the tokenizer has no chat template"
                )
            texts = _render(tokenizer, prompts, add_generation_prompt=True)
            texts += _render(tokenizer, [p + c for p, c in zip(prompts, chosen, strict=True)])
            texts += _render(tokenizer, [p + r for p, r in zip(prompts, rejected, strict=True)])
            encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        else:
            eos = tokenizer.eos_token
            chosen = [c if c.endswith(eos) else c + eos for c in chosen]
            rejected = [r if r.endswith(eos) else r + eos for r in rejected]
            texts = prompts + [p + c for p, c in zip(prompts, chosen, strict=True)]
            texts += [p + r for p, r in zip(prompts, rejected, strict=True)]
            encoded = tokenizer(texts)["input_ids"]
    except DataError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise DataError(f"dataset {source.name}: pairs cannot be tokenised ({error})") from error
    n = len(prompts)
    kept: dict[str, list[np.ndarray]] = {part: [] for part in PARTS}
    dropped = truncated = loss_tokens = moved = 0
    for i in range(n):
        prompt = np.asarray(encoded[i], dtype=np.int32)
        with_chosen = np.asarray(encoded[n + i], dtype=np.int32)
        with_rejected = np.asarray(encoded[2 * n + i], dtype=np.int32)
        start = min(_common_prefix(prompt, with_chosen), _common_prefix(prompt, with_rejected))
        moved += start < len(prompt)
        if start >= max_length:  # trl: keep only pairs whose prompt is shorter than max_length
            dropped += 1
            continue
        good, bad = with_chosen[start:], with_rejected[start:]
        truncated += start + max(len(good), len(bad)) > max_length
        loss_tokens += min(len(good), max_length - start) + min(len(bad), max_length - start)
        kept["prompt"].append(prompt[:start])
        kept["chosen"].append(good)
        kept["rejected"].append(bad)
    ids = {part: _concatenate(kept[part]) for part in PARTS}
    return EncodedPairs(
        ids=ids,
        lengths={
            part: np.fromiter((len(a) for a in kept[part]), dtype=np.int32, count=len(kept[part]))
            for part in PARTS
        },
        kind=kind,
        rows=n,
        dropped=dropped,
        truncated=truncated,
        loss_tokens=loss_tokens,
        moved_boundary=moved,
        tokens=sum(len(a) for a in ids.values()),
    )


def _render(tokenizer: Any, conversations: list[Any], *, add_generation_prompt: bool = False) -> list[str]:
    """What ``apply_chat_template(tokenize=True)`` tokenises (it renders, then tokenises without special
    tokens), for a whole chunk of conversations in one call."""
    if not conversations:
        return []
    rendered = tokenizer.apply_chat_template(
        conversations, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return [str(text) for text in rendered]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _concatenate(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays).astype(np.int32, copy=False) if arrays else np.empty(0, dtype=np.int32)


# ---- writing and reading a split ------------------------------------------------------------------
class PairWriter:
    """Appends chunks of pairs to a split's files; ``finish`` writes the offsets."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._files = {part: open(directory / f"{part}_ids.bin", "wb") for part in PARTS}  # noqa: SIM115
        self._lengths: dict[str, list[np.ndarray]] = {part: [] for part in PARTS}
        self.kind: str | None = None
        self.documents = self.dropped = self.truncated = self.loss_tokens = self.moved_boundary = 0

    def add(self, chunk: EncodedPairs) -> None:
        for part in PARTS:
            self._files[part].write(chunk.ids[part].astype("<i4", copy=False).tobytes())
            self._lengths[part].append(chunk.lengths[part])
        self.documents += chunk.rows
        self.dropped += chunk.dropped
        self.truncated += chunk.truncated
        self.loss_tokens += chunk.loss_tokens
        self.moved_boundary += chunk.moved_boundary

    def finish(self) -> SplitFigures:
        tokens = 0
        rows = 0
        for part in PARTS:
            self._files[part].close()
            lengths = np.concatenate(self._lengths[part]) if self._lengths[part] else np.empty(0, np.int32)
            starts = np.zeros(len(lengths) + 1, dtype="<i8")
            np.cumsum(lengths, out=starts[1:])
            with open(self.directory / f"{part}_starts.bin", "wb") as out:
                out.write(starts.tobytes())
            tokens += int(starts[-1])
            rows = len(lengths)
        self._lengths = {part: [] for part in PARTS}
        return SplitFigures(self.documents, self.dropped, tokens, self.loss_tokens, rows, self.truncated)


def pairs_dataset(directory: Path, name: str) -> Any:
    """A split's pairs as trl's tokenised columns (``prompt_ids``, ``chosen_ids``, ``rejected_ids``):
    a ``datasets.Dataset`` over the memory-mapped files, each column an Arrow large list whose values
    and offsets are those files' pages (zero-copy; nothing read until a row is). ``name`` is its
    fingerprint: ``datasets`` would otherwise hash the whole table to make one."""
    import pyarrow as pa
    from datasets import Dataset

    columns = {}
    for part in PARTS:
        ids = memmap(directory / f"{part}_ids.bin", np.int32)
        starts = memmap(directory / f"{part}_starts.bin", np.int64)
        if not len(starts):  # never written: an empty split still has its one offset
            starts = np.zeros(1, dtype=np.int64)
        columns[f"{part}_ids"] = pa.LargeListArray.from_arrays(pa.array(starts), pa.array(ids))
    return Dataset(pa.table(columns), fingerprint=name)
