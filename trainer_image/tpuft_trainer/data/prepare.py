"""Prepare a run's dataset once: find it prepared, or read, split, tokenise, pack and publish it.

``tpuft prepare`` (the operator's CPU Job, before any TPU is requested) and ``tpuft train`` (when no
prepared dataset with its fingerprint exists: ``spec.prepare.enabled: false``, the optimum-compatible
API, a set deleted meanwhile) run this same code, so both give the same rows, bit for bit.

Tokenising runs on a pool of ``workers`` processes, each taking chunks of rows in order (results come
back in order: the output does not depend on the worker count); the parent appends each chunk to the
split's files and forgets it. Memory therefore stays at a few chunks plus four bytes a document (the
lengths packing needs), whatever the dataset's size.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpuft_trainer.checkpoint.layout import Store
from tpuft_trainer.config import DatasetSource, TrainerConfig
from tpuft_trainer.data import preference, prepared, sources
from tpuft_trainer.data.encode import EncodedChunk, check_fields, encode_chunk, field_of
from tpuft_trainer.errors import DataError, PermissionDeniedError

log = logging.getLogger(__name__)

CHUNK_ROWS = 512  # rows a worker renders and tokenises at a time: ~1-2 MB of text, one batched call


@dataclass(frozen=True)
class Prepared:
    """A complete prepared dataset on this host's filesystem."""

    directory: Path
    manifest: prepared.Manifest
    reused: bool  # found complete: nothing was tokenised

    def rows(self, split: str = prepared.TRAIN, *, padding_rows: int = 0) -> prepared.PreparedRows:
        return prepared.PreparedRows(self.directory, self.manifest, split, padding_rows=padding_rows)

    def pairs(self, split: str = prepared.TRAIN) -> Any:
        """Preference pairs as trl's DPOTrainer's tokenised columns (a ``datasets.Dataset`` laid over
        the memory-mapped files, data/preference.py)."""
        return preference.pairs_dataset(self.directory / split, f"{self.manifest.fingerprint}-{split}")

    @property
    def has_eval(self) -> bool:
        return prepared.EVAL in self.manifest.splits

    def check_fills_a_batch(self, global_batch: int, name: str) -> None:
        """Every training batch must be full (one compiled shape; the Trainer drops a partial last one):
        a set of fewer rows than one global batch is the user's error, said with its figures."""
        train = self.manifest.splits[prepared.TRAIN]
        if self.manifest.pairs:
            for split, what in ((prepared.TRAIN, "dataset"), (prepared.EVAL, "evaluation set")):
                figures = self.manifest.splits.get(split)
                if figures is not None and figures.rows < global_batch:
                    raise DataError(
                        f"{what} {name} has {figures.rows} preference pairs whose prompt fits in "
                        f"training.maxSeqLength ({figures.dropped} of {figures.documents} do not), fewer "
                        f"than one global batch ({global_batch}); every batch must be full"
                    )
            return
        if train.rows < global_batch:
            packed = (
                f" after packing {train.documents - train.dropped} documents" if self.manifest.packed else ""
            )
            raise DataError(
                f"dataset {name} has {train.rows} rows{packed}, fewer than one global batch ({global_batch}); "
                "every batch must be full (drop_last): add rows, or lower training.perDeviceBatchSize"
            )


def find_or_prepare(
    config: TrainerConfig, tokenizer: Any, *, workers: int = 1, publish: bool = True
) -> Prepared:
    """The prepared dataset of ``config``: the complete one at the output with its fingerprint, else
    prepared now (and published at the output when ``publish``: rank 0, or the prepare Job)."""
    store = Store(config.output.uri)
    key = prepared.fingerprint(config, tokenizer)
    try:
        if prepared.is_complete(store, key):
            directory = prepared.local_copy(store, key, sources.cache_dir())
            manifest = prepared.read_manifest(directory)
            log.info(
                "dataset prepared already at %s (%d training rows, %d evaluation rows): nothing to tokenise",
                prepared.location(store, key),
                manifest.splits[prepared.TRAIN].rows,
                manifest.splits[prepared.EVAL].rows if prepared.EVAL in manifest.splits else 0,
            )
            return Prepared(directory, manifest, reused=True)
    except PermissionError as error:
        raise PermissionDeniedError(f"cannot read the output {config.output.uri}: {error}") from error
    return prepare(config, tokenizer, key, store, workers=workers, publish=publish)


def prepare(
    config: TrainerConfig, tokenizer: Any, key: str, store: Store, *, workers: int, publish: bool
) -> Prepared:
    started = time.monotonic()
    source, training = config.dataset, config.training
    name = f"{prepared.PREPARED}/{key}"
    # Written in place on a local output (a mounted volume); else locally, then uploaded.
    # A host that does not publish prepares a copy of its own (hosts may share a cache directory).
    if store.is_local and publish:
        local = Path(store.local_path(name))
    elif publish:
        local = sources.cache_dir() / prepared.PREPARED / key
    else:
        local = sources.cache_dir() / prepared.PREPARED / f"{key}.host-{os.getpid()}"
    shutil.rmtree(local, ignore_errors=True)  # a cut-off prepare (no marker) of an earlier attempt
    log.info("preparing dataset %s with %d worker(s) into %s", source.name, workers, local)
    train_rows, eval_rows = split_rows(sources.load_rows(source), source, training.seed)
    pairs = source.format == "preference"
    if pairs:
        from tpuft_trainer import compat

        compat.check_prepared_pairs_trl()
    else:
        check_fields(train_rows.column_names, tokenizer, source)
    figures = {
        prepared.TRAIN: _prepare_split(
            train_rows, local / prepared.TRAIN, config, tokenizer, workers, "dataset"
        )
    }
    if eval_rows is not None:
        figures[prepared.EVAL] = _prepare_split(
            eval_rows, local / prepared.EVAL, config, tokenizer, workers, "evaluation set"
        )
    manifest = prepared.Manifest(
        format=prepared.FORMAT_VERSION,
        fingerprint=key,
        settings=config.data_settings(),
        max_length=training.max_seq_length,
        packed=source.packing,
        pad_id=int(tokenizer.pad_token_id),
        splits=figures,
        seconds=round(time.monotonic() - started, 2),
        workers=workers,
        pairs=pairs,
    )
    if publish:
        try:
            prepared.publish(local, manifest, store)
        except PermissionError as error:
            raise PermissionDeniedError(
                f"cannot write the prepared dataset to {config.output.uri}: {error}"
            ) from error
    else:
        (local / prepared.MANIFEST).write_text(manifest.to_json())
    train = figures[prepared.TRAIN]
    if pairs:
        log.info(
            "prepared %d preference pairs (%d dropped: prompt fills training.maxSeqLength; %d longer than it, "
            "cut when batched) in %.1f s (%.1f pairs/s, %.0f tokens/s)%s",
            train.rows,
            train.dropped,
            train.truncated,
            manifest.seconds,
            sum(f.documents for f in figures.values()) / max(manifest.seconds, 1e-9),
            manifest.tokens_per_second,
            f"; {figures[prepared.EVAL].rows} evaluation pairs" if prepared.EVAL in figures else "",
        )
        return Prepared(local, manifest, reused=False)
    log.info(
        "prepared %d documents (%d dropped) into %d %s rows of %d positions in %.1f s (%.0f tokens/s); "
        "%.1f%% of the positions count in the loss%s",
        train.documents,
        train.dropped,
        train.rows,
        "packed" if source.packing else "padded",
        training.max_seq_length,
        manifest.seconds,
        manifest.tokens_per_second,
        100 * train.loss_tokens / max(1, manifest.positions()),
        f"; {figures[prepared.EVAL].rows} evaluation rows" if prepared.EVAL in figures else "",
    )
    return Prepared(local, manifest, reused=False)


def split_rows(rows: Any, source: DatasetSource, seed: int) -> tuple[Any, Any | None]:
    """(training rows, evaluation rows or None): a named split of the same source, or a fraction of
    the rows held out, drawn by ``seed`` (a restarted run holds out the same rows). Rows are split
    before tokenising: a conversation is either trained on or evaluated on, never cut between them."""
    if source.eval_fraction is not None:
        held = max(1, round(len(rows) * source.eval_fraction))
        if held >= len(rows):
            raise DataError(
                f"dataset {source.name}: dataset.evalFraction {source.eval_fraction} of {len(rows)} rows "
                "leaves nothing to train on"
            )
        parts = rows.train_test_split(test_size=held, seed=seed, shuffle=True)
        return parts["train"], parts["test"]
    if source.eval_split is not None:
        if source.eval_split == source.split:
            raise DataError(
                f"dataset {source.name}: dataset.evalSplit {source.eval_split!r} is the training split; "
                "evaluating on the training rows measures nothing (use evalFraction to hold rows out)"
            )
        held_out = sources.load_rows(source.model_copy(update={"split": source.eval_split}))
        if not len(held_out):
            raise DataError(f"dataset {source.name}: dataset.evalSplit {source.eval_split!r} has no rows")
        return rows, held_out
    return rows, None


def _prepare_split(
    rows: Any, directory: Path, config: TrainerConfig, tokenizer: Any, workers: int, what: str
) -> prepared.SplitFigures:
    source, max_length = config.dataset, config.training.max_seq_length
    if source.format == "preference":
        return _prepare_pairs(rows, directory, config, tokenizer, workers, what)
    writer = prepared.SplitWriter(directory)
    for chunk in encoded_chunks(rows, tokenizer, source, max_length, workers):
        assert isinstance(chunk, EncodedChunk)
        writer.add(chunk)
    figures = writer.finish(max_length, packed=source.packing)
    cause = (
        "the assistant's turns fall beyond training.maxSeqLength"
        if source.trains_on_assistant_only
        else "they are empty or one token long"
    )
    if figures.documents and figures.dropped == figures.documents:
        raise DataError(
            f"{what} {source.name}: none of its {figures.documents} rows has a token to learn within "
            f"{max_length} positions ({cause}); raise training.maxSeqLength"
        )
    if not figures.documents:
        raise DataError(f"{what} {source.name} has no rows")
    if figures.dropped:
        log.warning(
            "%s %s: %d of %d rows dropped: %s", what, source.name, figures.dropped, figures.documents, cause
        )
    return figures


def _prepare_pairs(
    rows: Any, directory: Path, config: TrainerConfig, tokenizer: Any, workers: int, what: str
) -> prepared.SplitFigures:
    source, max_length = config.dataset, config.training.max_seq_length
    preference.check_fields(rows.column_names, source)  # each split's own (an evalSplit is another)
    if not len(rows):
        raise DataError(f"{what} {source.name} has no rows")
    writer = preference.PairWriter(directory)
    for chunk in encoded_chunks(rows, tokenizer, source, max_length, workers):
        assert isinstance(chunk, preference.EncodedPairs)
        writer.add(chunk)
    figures = writer.finish()
    if figures.dropped == figures.documents:
        raise DataError(
            f"{what} {source.name}: the prompt of every one of its {figures.documents} pairs fills "
            f"training.maxSeqLength ({max_length} tokens), leaving nothing of the completions; raise it"
        )
    if figures.dropped:
        log.warning(
            "%s %s: %d of %d pairs dropped: their prompt fills training.maxSeqLength (%d tokens)",
            what, source.name, figures.dropped, figures.documents, max_length,
        )  # fmt: skip
    if writer.moved_boundary:
        log.warning(
            "%s %s: in %d of %d pairs the tokenised prompt is not a prefix of prompt + completion (a chat "
            "template that renders the prompt alone differently, or tokens merging across the boundary): "
            "the completion starts where they differ, as trl's DPOTrainer does",
            what, source.name, writer.moved_boundary, figures.documents,
        )  # fmt: skip
    return figures


# ---- the workers ----------------------------------------------------------------------------------
def encoded_chunks(
    rows: Any, tokenizer: Any, source: DatasetSource, max_length: int, workers: int
) -> Iterator[EncodedChunk | preference.EncodedPairs]:
    """Every chunk of ``rows`` encoded, in order, on ``workers`` processes (1: this one): documents
    (``EncodedChunk``), or for format preference pairs (``preference.EncodedPairs``)."""
    if source.format == "preference":
        # trl decides by the first pair whether the set is chat; every chunk must agree with it.
        named = preference.fields(source)
        column = rows.select_columns(list(named.values()))
        kind = preference.kind_of(column[:1], source) if len(rows) else preference.TEXT
    else:
        column, kind = rows.select_columns([field_of(source)]), ""
    ranges = [(start, min(start + CHUNK_ROWS, len(rows))) for start in range(0, len(rows), CHUNK_ROWS)]
    if workers <= 1 or len(ranges) <= 1:
        for start, stop in ranges:
            yield _encode(column[start:stop], tokenizer, source, max_length, kind)
        return
    with _pool_context().Pool(
        workers, initializer=_start_worker, initargs=(column, tokenizer, source, max_length, kind)
    ) as pool:
        yield from pool.imap(_encode_range, ranges)


def _encode(
    values: dict[str, list[Any]], tokenizer: Any, source: DatasetSource, max_length: int, kind: str
) -> EncodedChunk | preference.EncodedPairs:
    if source.format == "preference":
        return preference.encode_pairs(values, tokenizer, source, max_length, kind=kind)
    return encode_chunk(values[field_of(source)], tokenizer, source, max_length)


def _pool_context() -> Any:
    """fork where this process runs no accelerator runtime (``tpuft prepare``): the workers start at
    once and share the memory-mapped rows. Inside ``tpuft train`` the XLA runtime's threads make a
    fork unsafe, so the workers are spawned (each imports the tokenizer's library first)."""
    return multiprocessing.get_context("spawn" if "torch_xla" in sys.modules else "fork")


_WORKER: dict[str, Any] = {}


def _start_worker(column: Any, tokenizer: Any, source: DatasetSource, max_length: int, kind: str) -> None:
    # One tokenizer thread a worker: the workers are the parallelism (as many as cores).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(column=column, tokenizer=tokenizer, source=source, max_length=max_length, kind=kind)


def _encode_range(bounds: tuple[int, int]) -> EncodedChunk | preference.EncodedPairs:
    start, stop = bounds
    values = _WORKER["column"][start:stop]
    return _encode(values, _WORKER["tokenizer"], _WORKER["source"], _WORKER["max_length"], _WORKER["kind"])


def default_workers(limit: int = 16) -> int:
    """The CPUs this process may use (its affinity, and its cgroup's CPU quota: a pod's CPU limit),
    at most ``limit``: beyond that the parent's writing, not the tokenising, is the bound."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, min(cpus, limit))
