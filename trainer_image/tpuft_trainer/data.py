"""Model and dataset loading, and fixed-length tokenisation.

Sources: a hub id (``HF_HUB_OFFLINE`` and the local cache are honoured by huggingface_hub), a local
directory or file, or any fsspec URI (``gs://`` through gcsfs, ``file://``, ...). Remote models are copied
to a local cache first because ``from_pretrained`` reads local files only. Every batch has the same
shape (rows padded or packed to ``max_seq_length``, see packing.py; the Trainer drops the last partial
batch), so XLA compiles a small, fixed number of graphs.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpuft_trainer import chat
from tpuft_trainer.config import DatasetSource, ModelSource
from tpuft_trainer.errors import DataError, NotFoundError, PermissionDeniedError
from tpuft_trainer.packing import IGNORE, Document, packed_rows, padded_rows
from tpuft_trainer.pod_contract import CACHE_DIR_ENV

log = logging.getLogger(__name__)

DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


def is_uri(name: str) -> bool:
    return "://" in name


def looks_local(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or Path(name).exists()


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV, "/tmp/tpuft-cache"))


def token(source: ModelSource) -> str | None:
    if source.token_env is None:
        return None
    value = os.environ.get(source.token_env)
    if not value:
        log.warning(
            "model.token_env names %s but it is unset or empty; loading without a token", source.token_env
        )
    return value or None


def download(uri: str) -> Path:
    """Copy the directory at ``uri`` to a local cache keyed by the URI (reused when complete)."""
    import fsspec

    target = cache_dir() / "models" / hashlib.sha256(uri.encode()).hexdigest()[:16]
    if (target / ".complete").exists():
        return target
    try:
        fs, path = fsspec.core.url_to_fs(uri)
        if not fs.exists(path):
            raise NotFoundError(f"model {uri} does not exist")
        fs.get(path.rstrip("/") + "/", str(target) + "/", recursive=True)
    except PermissionError as error:
        raise PermissionDeniedError(f"cannot read model {uri}: {error}") from error
    except FileNotFoundError as error:
        raise NotFoundError(f"model {uri} does not exist: {error}") from error
    (target / ".complete").touch()
    return target


def model_location(source: ModelSource) -> str:
    """What ``from_pretrained`` should read: a local directory or a hub id."""
    if is_uri(source.name):
        return str(download(source.name))
    if looks_local(source.name):
        path = Path(source.name).expanduser()
        if not (path / "config.json").is_file():
            raise NotFoundError(f"model directory {path} does not exist or has no config.json")
        return str(path)
    return source.name


def hub_errors(error: Exception, what: str) -> Exception:
    """Map hub/loading errors to the exit-code exceptions."""
    name = type(error).__name__
    if name in {"GatedRepoError"} or "401" in str(error) or "403" in str(error):
        return PermissionDeniedError(f"{what}: access denied ({error}); check the token Secret")
    if name in {
        "RepositoryNotFoundError",
        "RevisionNotFoundError",
        "EntryNotFoundError",
        "LocalEntryNotFoundError",
    }:
        return NotFoundError(f"{what}: not found ({error})")
    if isinstance(error, OSError):
        return NotFoundError(f"{what}: cannot be read ({error})")
    return error


def load_tokenizer(source: ModelSource, location: str) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(location, revision=source.revision, token=token(source))
    except Exception as error:
        raise hub_errors(error, f"tokenizer of {source.name}") from error
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of the loss either way
    return tokenizer


def load_model(source: ModelSource, location: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(
            location,
            revision=source.revision,
            token=token(source),
            dtype=getattr(torch, source.dtype),
            # The KV cache is useless in training and conflicts with per-block checkpointing.
            use_cache=False,
        )
    except Exception as error:
        raise hub_errors(error, f"model {source.name}") from error


def _one_split(source: DatasetSource, what: str) -> None:
    if source.split != "train":
        raise DataError(f"dataset {source.name} is {what}: it has one split, 'train', not {source.split!r}")


def load_rows(source: DatasetSource) -> Any:
    """The raw dataset (a ``datasets.Dataset``) for ``source.split``."""
    import datasets

    name = source.name
    try:
        if is_uri(name) or looks_local(name):
            suffix = Path(name.rstrip("/")).suffix.lower()
            if suffix in DATA_SUFFIXES:
                if not is_uri(name) and not Path(name).expanduser().is_file():
                    raise NotFoundError(f"dataset file {name} does not exist")
                _one_split(source, "a single file")
                return datasets.load_dataset(DATA_SUFFIXES[suffix], data_files=name, split="train")
            if not is_uri(name):
                path = Path(name).expanduser()
                if not path.is_dir():
                    raise NotFoundError(f"dataset {name} does not exist")
                if (path / "dataset_info.json").exists() or (path / "state.json").exists():
                    loaded = datasets.load_from_disk(str(path))
                    if not isinstance(loaded, datasets.DatasetDict):
                        _one_split(source, "a saved Dataset (not a DatasetDict)")
                        return loaded
                    if source.split not in loaded:
                        raise DataError(
                            f"dataset {name} has no split {source.split!r}; it has {sorted(loaded)}"
                        )
                    return loaded[source.split]
            return datasets.load_dataset(name, split=source.split)
        return datasets.load_dataset(name, split=source.split)
    except (NotFoundError, DataError):
        raise
    except FileNotFoundError as error:
        raise NotFoundError(f"dataset {name}: not found ({error})") from error
    except Exception as error:
        mapped = hub_errors(error, f"dataset {name}")
        if mapped is error:
            raise DataError(f"dataset {name} cannot be loaded: {error}") from error
        raise mapped from error


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
