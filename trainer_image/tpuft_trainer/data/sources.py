"""Where models, tokenizers and datasets come from.

Sources: a hub id (``HF_HUB_OFFLINE`` and the local cache are honoured by huggingface_hub), a local
directory or file, or any fsspec URI (``gs://`` through gcsfs, ``file://``, ...). Remote models are copied
to a local cache first because ``from_pretrained`` reads local files only; for a tokenizer alone
(``tpuft prepare``) only the small files are copied, never the weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from tpuft_trainer.config import DatasetSource, ModelSource
from tpuft_trainer.errors import DataError, NotFoundError, PermissionDeniedError
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


# A model directory's weights: what a tokenizer-only copy leaves behind, and what the pre-flight lists.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".gguf")


def download(uri: str, *, weights: bool = True) -> Path:
    """Copy the directory at ``uri`` to a local cache keyed by the URI (reused when complete); with
    ``weights=False`` only its small files (config, tokenizer, chat template)."""
    import fsspec

    kind = "models" if weights else "tokenizers"
    target = cache_dir() / kind / hashlib.sha256(uri.encode()).hexdigest()[:16]
    if (target / ".complete").exists():
        return target
    try:
        fs, path = fsspec.core.url_to_fs(uri)
        if not fs.exists(path):
            raise NotFoundError(f"model {uri} does not exist")
        if weights:
            fs.get(path.rstrip("/") + "/", str(target) + "/", recursive=True)
        else:
            target.mkdir(parents=True, exist_ok=True)
            for entry in fs.ls(path, detail=False):
                name = str(entry).rstrip("/").rsplit("/", 1)[-1]
                if fs.isfile(entry) and not name.endswith(WEIGHT_SUFFIXES):
                    fs.get_file(entry, str(target / name))
    except PermissionError as error:
        raise PermissionDeniedError(f"cannot read model {uri}: {error}") from error
    except FileNotFoundError as error:
        raise NotFoundError(f"model {uri} does not exist: {error}") from error
    (target / ".complete").touch()
    return target


def model_location(source: ModelSource, *, weights: bool = True) -> str:
    """What ``from_pretrained`` should read: a local directory or a hub id (``weights=False``: a
    remote directory is copied without its weight files, enough for its config and tokenizer)."""
    if is_uri(source.name):
        return str(download(source.name, weights=weights))
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


def weight_files(source: ModelSource, location: str) -> list[str]:
    """The names of the model's weight files, listed and never read (the pre-flight's check that the
    weights are there and readable with the run's token before a TPU slice is requested)."""
    try:
        if is_uri(source.name):
            import fsspec

            fs, path = fsspec.core.url_to_fs(source.name)
            names = [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)]
        elif looks_local(source.name):
            names = [entry.name for entry in Path(location).iterdir()]
        else:
            from huggingface_hub import list_repo_files

            names = list_repo_files(source.name, revision=source.revision, token=token(source))
    except Exception as error:
        raise hub_errors(error, f"model {source.name}") from error
    return sorted(name for name in names if name.endswith(WEIGHT_SUFFIXES))


SAFETENSORS_HEADER_LIMIT = 100 * 1024**2  # a header larger than this is not a safetensors header


def parameter_count(source: ModelSource, location: str, weights: list[str]) -> int | None:
    """The model's parameters, from the tensor shapes in its safetensors files' headers: a few kB of
    each file read (ranges, never the weights). None when it has no safetensors files (e.g. .bin) or
    the headers cannot be read: the count is a figure for the operator's plan, which then computes
    it from the config's dimensions, never a reason to fail the pre-flight."""
    files = [name for name in weights if name.endswith(".safetensors") and "/" not in name]
    if not files:
        return None
    try:
        if not is_uri(source.name) and not looks_local(source.name):
            from huggingface_hub import get_safetensors_metadata

            found = get_safetensors_metadata(source.name, revision=source.revision, token=token(source))
            return int(sum(found.parameter_count.values()))
        import fsspec

        root = source.name if is_uri(source.name) else location
        fs, path = fsspec.core.url_to_fs(root)
        paths = [f"{path.rstrip('/')}/{name}" for name in files]
        # Two rounds of ranged reads over every file (batched: concurrent on a bucket): each header's
        # length (8 bytes, little-endian), then the header (JSON: each tensor's dtype and shape).
        lengths = [
            int.from_bytes(head, "little")
            for head in fs.cat_ranges(paths, [0] * len(paths), [8] * len(paths))
        ]
        if any(n <= 0 or n > SAFETENSORS_HEADER_LIMIT for n in lengths):
            raise ValueError(f"not a safetensors header length: {lengths}")
        headers = fs.cat_ranges(paths, [8] * len(paths), [8 + n for n in lengths])
        return sum(_header_parameters(json.loads(header)) for header in headers)
    except Exception as error:  # a figure, not a check: the pre-flight's checks passed already
        log.warning(
            "model %s: its parameters could not be counted from the weight files' headers (%s); "
            "the operator's plan computes them from config.json",
            source.name,
            error,
        )
        return None


def _header_parameters(header: dict[str, Any]) -> int:
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        count = 1
        for size in entry["shape"]:
            count *= int(size)
        total += count
    return total
