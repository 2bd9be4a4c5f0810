"""The prepared dataset on storage: its fingerprint, its files, how it is published and read.

A run's output holds one directory per prepared dataset, named by its fingerprint::

    prepared/<fingerprint>/
        train/tokens.bin        int32   every kept document's token ids, back to back
        train/masks.bin         uint8   1 where a token counts in the loss
        train/doc_starts.bin    int64   document d is tokens[doc_starts[d]:doc_starts[d + 1]]
        train/row_members.bin   int64   the documents of every row, row after row (packing.best_fit)
        train/row_starts.bin    int64   row r is row_members[row_starts[r]:row_starts[r + 1]]
        eval/...                        the same for the evaluation rows, when there are any
        (preference pairs: their own files, data/preference.py)
        manifest.json           what it holds (figures, settings, the tokenizer's pad id, timings)
        .tpuft-complete         written last: a directory without it is a cut-off prepare, never read

Why these files and not Arrow or Parquet: every column is one fixed-width integer array, so plain
little-endian files memory-map with ``numpy.memmap`` and a row is a few slices of them (O(1), no
decoding, nothing copied but the row); either training backend reads them with numpy alone. Storing
documents plus a row index (not the rows themselves) keeps the files at 5 bytes a token (rows of int64
ids, labels and positions would be 24 bytes a position) and lets a row's padding be made when it is
read. Packing that ``position_ids``/``labels`` encode is rebuilt by ``packing.build_row``.

The fingerprint hashes everything that decides the content (``TrainerConfig.data_settings``, the
tokenizer's own files and chat template, the dataset files' identity, this format's version): a
change to any of them prepares again; anything else (steps, learning rate, the TPU shape, a restart)
reuses the files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tpuft_trainer.checkpoint.layout import Store
from tpuft_trainer.config import DatasetSource, TrainerConfig
from tpuft_trainer.data import packing
from tpuft_trainer.data.encode import EncodedChunk
from tpuft_trainer.data.sources import is_uri, looks_local

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
PREPARED = "prepared"
MANIFEST = "manifest.json"
COMPLETE = ".tpuft-complete"
TRAIN, EVAL = "train", "eval"
# name -> dtype of each column file of a split
COLUMNS = {
    "tokens": np.int32,
    "masks": np.uint8,
    "doc_starts": np.int64,
    "row_members": np.int64,
    "row_starts": np.int64,
}


# ---- the fingerprint ------------------------------------------------------------------------------
def fingerprint(config: TrainerConfig, tokenizer: Any) -> str:
    """A name for the prepared content of ``config``'s dataset with ``tokenizer`` (24 hex digits)."""
    identity = {
        "format": FORMAT_VERSION,
        "settings": config.data_settings(),
        "tokenizer": tokenizer_identity(tokenizer),
        "dataset": dataset_identity(config.dataset),
    }
    if config.dataset.format == "preference":
        from tpuft_trainer import compat

        # The pairs are tokenised as this trl's DPOTrainer tokenises them (data/preference.py).
        identity["pairs"] = compat.PREPARED_PAIRS_TOKENISATION
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:24]


def tokenizer_identity(tokenizer: Any) -> str:
    """A hash of what decides the tokenizer's output: its vocabulary, merges and normalisers (the fast
    tokenizer's whole definition), special tokens, padding token and chat template."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # Its truncation and padding are call-time state (a call with max_length sets them), not content.
        definition = {
            k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")
        }
    else:
        definition = tokenizer.get_vocab()
    digest.update(json.dumps(definition, sort_keys=True).encode())
    digest.update(
        json.dumps(
            {
                "class": type(tokenizer).__name__,
                "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
                "pad": tokenizer.pad_token_id,
                "template": getattr(tokenizer, "chat_template", None),
            },
            sort_keys=True,
        ).encode()
    )
    return digest.hexdigest()


def dataset_identity(source: DatasetSource) -> dict[str, Any]:
    """The dataset's files as they are now: name, size and modification time (or ETag) of each, read
    from the filesystem without reading the data. A hub dataset: its name and split (its revision is
    what the hub's cache serves, recorded by ``datasets``' own fingerprint at load time)."""
    name = source.name
    if is_uri(name):
        import fsspec

        fs, path = fsspec.core.url_to_fs(name)
        entries = fs.find(path, detail=True) if fs.isdir(path) else {path: fs.info(path)}
        return {"uri": name, "files": _file_facts(entries)}
    if looks_local(name):
        path = Path(name).expanduser().resolve()
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        return {
            "path": str(path),
            "files": [
                [
                    str(f.relative_to(path) if path.is_dir() else f.name),
                    f.stat().st_size,
                    f.stat().st_mtime_ns,
                ]
                for f in files
                if f.is_file()
            ],
        }
    return {"hub": name}


def _file_facts(entries: dict[str, Any]) -> list[list[Any]]:
    facts = []
    for key, info in sorted(entries.items()):
        if info.get("type", "file") != "file":
            continue
        version = info.get("etag") or info.get("md5Hash") or info.get("mtime") or info.get("updated")
        facts.append([key, int(info.get("size") or 0), str(version)])
    return facts


# ---- writing --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SplitFigures:
    """What one split of a prepared dataset holds. Of preference pairs (data/preference.py): documents
    are the pairs read, rows the pairs kept (each two sequences of max_seq_length), dropped those whose
    prompt alone fills it, loss tokens the completions' tokens within it."""

    documents: int  # rows of the source read
    dropped: int  # documents without a token to learn within max_seq_length
    tokens: int  # tokens of the kept documents
    loss_tokens: int  # tokens that count in the loss
    rows: int  # rows of max_seq_length
    truncated: int = 0  # preference pairs that trl's collator cuts to max_seq_length


class SplitWriter:
    """Appends chunks of documents to a split's files, then lays out its rows (packed or padded)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._tokens = open(directory / "tokens.bin", "wb")  # noqa: SIM115  (closed in finish)
        self._masks = open(directory / "masks.bin", "wb")  # noqa: SIM115
        self._lengths: list[np.ndarray] = []
        self.documents = self.dropped = self.loss_tokens = 0

    def add(self, chunk: EncodedChunk) -> None:
        self._tokens.write(chunk.tokens.astype("<i4", copy=False).tobytes())
        self._masks.write(chunk.masks.tobytes())
        self._lengths.append(chunk.lengths)
        self.documents += chunk.rows
        self.dropped += chunk.dropped
        self.loss_tokens += chunk.loss_tokens

    def finish(self, max_length: int, *, packed: bool) -> SplitFigures:
        self._tokens.close()
        self._masks.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.empty(0, dtype=np.int32)
        self._lengths = []
        starts = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        if packed:
            members, row_starts = packing.best_fit(lengths, max_length)
        else:
            members, row_starts = (
                np.arange(len(lengths), dtype=np.int64),
                np.arange(len(lengths) + 1, dtype=np.int64),
            )
        _write(self.directory / "doc_starts.bin", starts)
        _write(self.directory / "row_members.bin", members.astype(np.int64))
        _write(self.directory / "row_starts.bin", row_starts.astype(np.int64))
        return SplitFigures(
            self.documents, self.dropped, int(starts[-1]), self.loss_tokens, len(row_starts) - 1
        )


def _write(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as out:
        out.write(np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes())


@dataclass(frozen=True)
class Manifest:
    """``manifest.json``: what a prepared dataset holds and how it was made."""

    format: int
    fingerprint: str
    settings: dict[str, Any]
    max_length: int
    packed: bool
    pad_id: int
    splits: dict[str, SplitFigures]
    seconds: float  # the prepare's wall time
    workers: int
    # Preference pairs (data/preference.py), each row two sequences; else rows of SFT.
    pairs: bool = False

    def positions(self, split: str = TRAIN) -> int:
        sequences = 2 if self.pairs else 1
        return sequences * self.splits[split].rows * self.max_length if split in self.splits else 0

    @property
    def tokens_per_second(self) -> float:
        tokens = sum(figures.tokens for figures in self.splits.values())
        return round(tokens / self.seconds, 1) if self.seconds > 0 else 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        body = json.loads(text)
        body["splits"] = {name: SplitFigures(**figures) for name, figures in body["splits"].items()}
        return cls(**body)


def publish(local: Path, manifest: Manifest, store: Store) -> None:
    """Writes the manifest and the marker (last) into ``local``, and when the run's output is not that
    directory (a bucket), uploads every file and then the marker."""
    (local / MANIFEST).write_text(manifest.to_json())
    name = f"{PREPARED}/{manifest.fingerprint}"
    if store.is_local and Path(store.local_path(name)).resolve() == local.resolve():
        _sync_directory(local)
        (local / COMPLETE).write_text("ok\n")
        return
    (local / COMPLETE).write_text("ok\n")  # the local copy is complete: a later read reuses it
    store.remove(name)  # a cut-off upload of an earlier attempt
    for path in sorted(local.rglob("*")):
        if path.is_file() and path.name != COMPLETE:
            store.put_file(str(path), name, str(path.relative_to(local)))
    store.write_text("ok\n", name, COMPLETE)


def _sync_directory(directory: Path) -> None:
    """Every file on disk before the marker says so (a node crash must not leave a marked, torn set)."""
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def location(store: Store, fingerprint_: str) -> str:
    return store.url(PREPARED, fingerprint_)


def is_complete(store: Store, fingerprint_: str) -> bool:
    return store.exists(PREPARED, fingerprint_, COMPLETE)


def local_copy(store: Store, fingerprint_: str, cache: Path) -> Path:
    """A local directory holding the complete prepared dataset: the output itself when it is on a
    local (or mounted) filesystem, else a copy in ``cache`` (kept and reused while complete)."""
    name = f"{PREPARED}/{fingerprint_}"
    if store.is_local:
        return Path(store.local_path(name))
    target = cache / PREPARED / fingerprint_
    if (target / COMPLETE).exists():
        return target
    # Downloaded beside, then renamed into place: processes sharing a cache never see half a copy.
    partial = target.with_name(f"{fingerprint_}.download-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for relative in _files_under(store, name):
        (partial / relative).parent.mkdir(parents=True, exist_ok=True)
        store.get_file((name, relative), str(partial / relative))
    (partial / COMPLETE).write_text("ok\n")
    shutil.rmtree(target, ignore_errors=True)  # an incomplete copy (no marker) of an earlier start
    try:
        os.rename(partial, target)
    except OSError:  # another process renamed its copy first: use that one
        shutil.rmtree(partial, ignore_errors=True)
    return target


def _files_under(store: Store, name: str) -> list[str]:
    root = store.path(name)
    return sorted(
        str(path)[len(root) :].lstrip("/") for path in store.fs.find(root) if not str(path).endswith(COMPLETE)
    )


# ---- reading --------------------------------------------------------------------------------------
class PreparedRows:
    """The rows of one split, read from memory-mapped files: a map-style dataset (``len``, ``[i]``) that
    the Hugging Face Trainer's DataLoader and a plain torch loop take alike. Each row is built when it
    is read (``packing.build_row``); ``padding_rows`` rows that carry no loss follow the real ones (an
    evaluation set filled to whole global batches, evaluation.py)."""

    def __init__(self, directory: Path, manifest: Manifest, split: str, *, padding_rows: int = 0) -> None:
        self.directory = directory / split
        self.max_length = manifest.max_length
        self.packed = manifest.packed
        self.pad_id = manifest.pad_id
        self.real_rows = manifest.splits[split].rows
        self.padding_rows = padding_rows
        self._columns: dict[str, np.ndarray] | None = None  # opened on first read (after a fork too)

    def __len__(self) -> int:
        return self.real_rows + self.padding_rows

    def columns(self) -> dict[str, np.ndarray]:
        if self._columns is None:
            self._columns = {
                name: memmap(self.directory / f"{name}.bin", dtype) for name, dtype in COLUMNS.items()
            }
        return self._columns

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        if index >= self.real_rows:
            return self._padding_row()
        c = self.columns()
        members = c["row_members"][c["row_starts"][index] : c["row_starts"][index + 1]]
        spans = [(int(c["doc_starts"][d]), int(c["doc_starts"][d + 1])) for d in members]
        return packing.build_row(
            [c["tokens"][a:b] for a, b in spans],
            [c["masks"][a:b] for a, b in spans],
            self.max_length,
            self.pad_id,
            packed=self.packed,
        )

    def _padding_row(self) -> dict[str, np.ndarray]:
        """A row that attends to its own pad tokens (an all-zero mask gives NaN on some backends) and
        carries no loss."""
        row = {
            "input_ids": np.full(self.max_length, self.pad_id, dtype=np.int64),
            "labels": np.full(self.max_length, packing.IGNORE, dtype=np.int64),
        }
        if self.packed:
            row["position_ids"] = np.arange(self.max_length, dtype=np.int64)
        else:
            row["attention_mask"] = np.ones(self.max_length, dtype=np.int64)
        return row


def memmap(path: Path, dtype: Any) -> np.ndarray:
    if path.stat().st_size == 0:  # numpy cannot map an empty file
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")


def read_manifest(directory: Path) -> Manifest:
    return Manifest.from_json((directory / MANIFEST).read_text())
