"""Model and dataset loading, and fixed-length tokenisation.

Sources: a hub id (``HF_HUB_OFFLINE`` and the local cache are honoured by huggingface_hub), a local
directory or file, or any fsspec URI (``gs://`` through gcsfs, ``file://``, ...). Remote models are copied
to a local cache first because ``from_pretrained`` reads local files only. Every batch has the same
shape (pad/truncate to ``max_seq_length``; the Trainer drops the last partial batch), so XLA compiles a
small, fixed number of graphs.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from tpuft_trainer.config import DatasetSource, ModelSource
from tpuft_trainer.errors import DataError, NotFoundError, PermissionDeniedError

log = logging.getLogger(__name__)

DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


def is_uri(name: str) -> bool:
    return "://" in name


def looks_local(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or Path(name).exists()


def cache_dir() -> Path:
    return Path(os.environ.get("TPUFT_CACHE_DIR", "/tmp/tpuft-cache"))


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


def _hub_errors(error: Exception, what: str) -> Exception:
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
        raise _hub_errors(error, f"tokenizer of {source.name}") from error
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
        raise _hub_errors(error, f"model {source.name}") from error


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
                return datasets.load_dataset(DATA_SUFFIXES[suffix], data_files=name, split="train")
            if not is_uri(name):
                path = Path(name).expanduser()
                if not path.is_dir():
                    raise NotFoundError(f"dataset {name} does not exist")
                if (path / "dataset_info.json").exists() or (path / "state.json").exists():
                    loaded = datasets.load_from_disk(str(path))
                    return loaded[source.split] if isinstance(loaded, datasets.DatasetDict) else loaded
            return datasets.load_dataset(name, split=source.split)
        return datasets.load_dataset(name, split=source.split)
    except (NotFoundError, DataError):
        raise
    except FileNotFoundError as error:
        raise NotFoundError(f"dataset {name}: not found ({error})") from error
    except Exception as error:
        mapped = _hub_errors(error, f"dataset {name}")
        if mapped is error:
            raise DataError(f"dataset {name} cannot be loaded: {error}") from error
        raise mapped from error


def tokenize(rows: Any, tokenizer: Any, source: DatasetSource, max_length: int, min_rows: int) -> Any:
    """Fixed-length ``input_ids``/``attention_mask``/``labels`` (padding masked out of the loss)."""
    field = source.text_field if source.format == "text" else source.messages_field
    if field not in rows.column_names:
        raise DataError(
            f"dataset {source.name} has no {field!r} field (format {source.format}); its fields are "
            f"{rows.column_names}. Set dataset.{'textField' if source.format == 'text' else 'messagesField'}."
        )
    if source.format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise DataError(f"dataset {source.name} is in chat format but the tokenizer has no chat template")

    def encode(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if source.format == "chat":
            texts = [tokenizer.apply_chat_template(messages, tokenize=False) for messages in batch[field]]
        else:
            texts = [str(text) for text in batch[field]]
        encoded = tokenizer(texts, max_length=max_length, truncation=True, padding="max_length")
        encoded["labels"] = [
            [token_id if keep else -100 for token_id, keep in zip(ids, mask, strict=True)]
            for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"], strict=True)
        ]
        return dict(encoded)

    try:
        tokenized = rows.map(encode, batched=True, remove_columns=rows.column_names, desc="tokenising")
    except (KeyError, TypeError, ValueError) as error:
        raise DataError(f"dataset {source.name}: rows cannot be tokenised ({error})") from error
    if len(tokenized) < min_rows:
        raise DataError(
            f"dataset {source.name} has {len(tokenized)} rows, fewer than one global batch ({min_rows}); "
            "every batch must be full (drop_last)"
        )
    return tokenized
