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
from tpuft_trainer.data import prepared, sources
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

    @property
    def has_eval(self) -> bool:
        return prepared.EVAL in self.manifest.splits

    def check_fills_a_batch(self, global_batch: int, name: str) -> None:
        """Every training batch must be full (one compiled shape; the Trainer drops a partial last one):
        a set of fewer rows than one global batch is the user's error, said with its figures."""
        train = self.manifest.splits[prepared.TRAIN]
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
    writer = prepared.SplitWriter(directory)
    for chunk in encoded_chunks(rows, tokenizer, source, max_length, workers):
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


# ---- the workers ----------------------------------------------------------------------------------
def encoded_chunks(
    rows: Any, tokenizer: Any, source: DatasetSource, max_length: int, workers: int
) -> Iterator[EncodedChunk]:
    """Every chunk of ``rows`` encoded, in order, on ``workers`` processes (1: this one)."""
    column = rows.select_columns([field_of(source)])
    ranges = [(start, min(start + CHUNK_ROWS, len(rows))) for start in range(0, len(rows), CHUNK_ROWS)]
    if workers <= 1 or len(ranges) <= 1:
        for start, stop in ranges:
            yield encode_chunk(column[start:stop][field_of(source)], tokenizer, source, max_length)
        return
    with _pool_context().Pool(
        workers, initializer=_start_worker, initargs=(column, tokenizer, source, max_length)
    ) as pool:
        yield from pool.imap(_encode_range, ranges)


def _pool_context() -> Any:
    """fork where this process runs no accelerator runtime (``tpuft prepare``): the workers start at
    once and share the memory-mapped rows. Inside ``tpuft train`` the XLA runtime's threads make a
    fork unsafe, so the workers are spawned (each imports the tokenizer's library first)."""
    return multiprocessing.get_context("spawn" if "torch_xla" in sys.modules else "fork")


_WORKER: dict[str, Any] = {}


def _start_worker(column: Any, tokenizer: Any, source: DatasetSource, max_length: int) -> None:
    # One tokenizer thread a worker: the workers are the parallelism (as many as cores).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(column=column, tokenizer=tokenizer, source=source, max_length=max_length)


def _encode_range(bounds: tuple[int, int]) -> EncodedChunk:
    start, stop = bounds
    source: DatasetSource = _WORKER["source"]
    values = _WORKER["column"][start:stop][field_of(source)]
    return encode_chunk(values, _WORKER["tokenizer"], source, _WORKER["max_length"])


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
