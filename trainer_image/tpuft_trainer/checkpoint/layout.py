"""Where checkpoints live and which of them can be resumed from. No torch at import.

A run's output (a local path, e.g. a mounted volume, or any fsspec URI such as ``gs://``) holds one
directory per checkpoint::

    checkpoint-<step>/
        .metadata              torch.distributed.checkpoint's index of every tensor chunk (written
                               last by DCP's coordinator, after every process wrote its files)
        __<rank>_<n>.distcp    the chunks each process wrote: only those its devices hold
        trainer_state.json     the Trainer's state (step, logs: the data position), scheduler.pt,
        scheduler.pt           rng_state.pth and optimizer.json (non-tensor optimizer state): small
        rng_state.pth          files written by rank 0
        optimizer.json
        tpuft-checkpoint.json  who wrote it: the backend, its torch version, the format's version
        .tpuft-complete        written by rank 0 once everything above is on storage

A checkpoint is resumed from only if it carries the completion marker AND every file its
``.metadata`` names exists at least as long as the bytes it points into (a shard deleted or cut
short after the marker is caught here, not as a failed load in the middle of the start). Anything
else is skipped, and the reason is reported (the operator turns it into an Event).

Reads that decide this are asked again after a transient storage error (failures.py) before anything
is concluded: a checkpoint is never skipped, nor later unmarked, because storage hiccuped once. A
failure that outlasts the retries ends the start (exit 1, restarted), permission denied exits 77; only
an index that storage returned but that cannot be parsed (or is gone) makes its checkpoint skipped.
Unless another torch or backend wrote it (``tpuft-checkpoint.json``): then the index may be whole and
only unreadable *here*, and skipping it would train from an older step and clear the newer
checkpoints, so the start fails (ConfigError, exit 64) and nothing is skipped or cleared. A checkpoint
of an earlier tpuft without that file is treated as before.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from tpuft_trainer.checkpoint import failures
from tpuft_trainer.errors import ConfigError, TrainerError

log = logging.getLogger(__name__)

PREFIX = "checkpoint-"
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
COMPLETE = ".tpuft-complete"
LEGACY_UPLOADED = ".tpuft-uploaded"  # the remote marker of the full-file format's uploads
DCP_METADATA = ".metadata"
TRAINER_STATE = "trainer_state.json"
SCHEDULER = "scheduler.pt"
RNG_STATE = "rng_state.pth"
OPTIMIZER_EXTRAS = "optimizer.json"
SMALL_FILES = (TRAINER_STATE, SCHEDULER, RNG_STATE, OPTIMIZER_EXTRAS)
# Who wrote a checkpoint (not in SMALL_FILES: checkpoints of an earlier tpuft lack it and still resume).
WRITER = "tpuft-checkpoint.json"
# This layout (the directory above, state.py's keys, the small files' formats); raised on a change that
# an earlier trainer could misread.
FORMAT_VERSION = 1
# What the earlier full-file format wrote instead of DCP shards (the model gathered on every host).
LEGACY_FILES = ("model.safetensors", "adapter_model.safetensors", "optimizer.pt", "pytorch_model.bin")
# The first wait before a read that failed transiently is asked again (then 2x, 4x: 3.5 s in all).
READ_BACKOFF_SECONDS = 0.5

T = TypeVar("T")


def name_for(step: int) -> str:
    return f"{PREFIX}{step}"


def step_of(name: str) -> int | None:
    match = CHECKPOINT.match(name)
    return int(match.group(1)) if match else None


class Store:
    """A directory on a local path or behind an fsspec URI, with the few operations checkpoints need."""

    def __init__(self, location: str) -> None:
        import fsspec

        self.location = location.rstrip("/") or "/"
        self.fs: Any
        self.fs, self.root = fsspec.core.url_to_fs(self.location)
        self.root = self.root.rstrip("/") or "/"
        self.is_local = "://" not in location or location.startswith("file://")

    def path(self, *parts: str) -> str:
        """The fsspec path of ``parts`` under the root."""
        return "/".join([self.root, *[p.strip("/") for p in parts if p]])

    def url(self, *parts: str) -> str:
        """The location of ``parts`` as the user wrote the root (a path or a URI)."""
        return "/".join([self.location, *[p.strip("/") for p in parts if p]])

    def local_path(self, *parts: str) -> str:
        """A path the operating system can open (only for local stores)."""
        assert self.is_local, f"{self.location} is not on a local filesystem"
        return self.path(*parts)

    def exists(self, *parts: str) -> bool:
        return bool(self.fs.exists(self.path(*parts)))

    def names(self, *parts: str) -> list[str]:
        """Names of the entries of a directory (empty when it does not exist)."""
        directory = self.path(*parts)
        if not self.fs.exists(directory):
            return []
        return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(directory, detail=False))

    def sizes(self, *parts: str) -> dict[str, int]:
        """Name -> size in bytes of the files in a directory."""
        directory = self.path(*parts)
        if not self.fs.exists(directory):
            return {}
        return {
            str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]: int(entry.get("size") or 0)
            for entry in self.fs.ls(directory, detail=True)
            if entry.get("type") == "file"
        }

    def read_text(self, *parts: str) -> str:
        with self.fs.open(self.path(*parts), "r") as f:
            return str(f.read())

    def write_text(self, text: str, *parts: str) -> None:
        self.fs.makedirs(self.path(*parts[:-1]), exist_ok=True)
        with self.fs.open(self.path(*parts), "w") as f:
            f.write(text)

    def put_file(self, local: str, *parts: str) -> None:
        self.fs.makedirs(self.path(*parts[:-1]), exist_ok=True)
        self.fs.put_file(local, self.path(*parts))

    def get_file(self, remote_parts: tuple[str, ...], local: str) -> None:
        self.fs.get_file(self.path(*remote_parts), local)

    def remove(self, *parts: str) -> None:
        target = self.path(*parts)
        if self.fs.exists(target):
            self.fs.rm(target, recursive=True)


@dataclass(frozen=True)
class Writer:
    """Who wrote a checkpoint (``tpuft-checkpoint.json``), or who is reading one."""

    backend: str  # the trainer's backend: "xla" or "native"
    torch: str  # torch.__version__ of the process that wrote it
    format: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps({"backend": self.backend, "torch": self.torch, "format": self.format}) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Writer:
        value = json.loads(text)
        return cls(str(value["backend"]), str(value["torch"]), int(value["format"]))

    def differs_from(self, reader: Writer) -> bool:
        """Whether ``reader`` may fail to parse what this writer wrote, whole as it is."""
        return (self.backend, self.torch) != (reader.backend, reader.torch) or self.format > reader.format


def this_writer(backend: str) -> Writer:
    """This process, as the writer (or reader) of a checkpoint with ``backend``'s tensor code."""
    return Writer(backend, _torch_version())


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


@dataclass(frozen=True)
class Found:
    """A checkpoint directory at the output, and whether it can be resumed from."""

    name: str
    step: int
    problem: str | None = None  # None: complete and resumable
    legacy: bool = False  # written in the earlier full-file format

    @property
    def resumable(self) -> bool:
        return self.problem is None and not self.legacy


def checkpoints(store: Store) -> Iterator[tuple[int, str]]:
    """(step, name) of every checkpoint directory at the output, newest first."""
    found = [(step, name) for name in store.names() if (step := step_of(name)) is not None]
    yield from sorted(found, reverse=True)


def is_marked(store: Store, name: str) -> bool:
    return store.exists(name, COMPLETE) or store.exists(name, LEGACY_UPLOADED)


def inspect(
    store: Store, name: str, backoff_seconds: float = READ_BACKOFF_SECONDS, reader: Writer | None = None
) -> Found:
    """Whether checkpoint ``name`` can be resumed from, and if not, why (in the user's words). Raises
    ``PermissionDeniedError`` or ``CheckpointReadError`` when storage cannot be read (failures.py), and
    ``ConfigError`` when its index cannot be parsed by this process (``reader``: this run's backend and
    torch) but its writer file names another backend, torch or format."""
    step = step_of(name)
    assert step is not None, name
    files = _read(store, name, lambda: store.sizes(name), backoff_seconds)
    if COMPLETE not in files and LEGACY_UPLOADED not in files:
        return Found(name, step, "its save was cut off (no completion marker)")
    if DCP_METADATA not in files:
        if any(legacy in files for legacy in LEGACY_FILES):
            return Found(name, step, None, legacy=True)
        return Found(name, step, f"it has no {DCP_METADATA} (not a sharded checkpoint)")
    missing_small = [small for small in SMALL_FILES if small not in files]
    if missing_small:
        return Found(name, step, f"{', '.join(missing_small)} missing")
    try:
        needed = _read(store, f"{name}/{DCP_METADATA}", lambda: shard_extents(store, name), backoff_seconds)
    except TrainerError as failure:  # storage failed (failures.py): nothing to conclude...
        if not isinstance(failure.__cause__, FileNotFoundError):
            raise
        return Found(name, step, f"its {DCP_METADATA} is gone ({failure.__cause__})")  # ...unless gone
    except Exception as error:  # storage returned it, but it is not an index: as bad as none...
        problem = f"its {DCP_METADATA} cannot be read ({type(error).__name__}: {error})"
        if WRITER in files:  # ...unless it may be whole, in a format only its writer reads
            _refuse_foreign(store, name, problem, reader, backoff_seconds)
        return Found(name, step, problem)
    for shard, extent in sorted(needed.items()):
        if shard not in files:
            return Found(name, step, f"shard {shard} is missing")
        if files[shard] < extent:
            return Found(name, step, f"shard {shard} is truncated ({files[shard]} of {extent} bytes)")
    return Found(name, step)


def _refuse_foreign(
    store: Store, name: str, problem: str, reader: Writer | None, backoff_seconds: float
) -> None:
    """Raises ConfigError when checkpoint ``name``'s writer file names a backend, torch or format other
    than ``reader``'s (None: this process's torch, any backend): its unreadable index is then no proof
    that the checkpoint is bad, and skipping it would lose it and every newer one (``clear_after``)."""
    try:
        writer = Writer.from_json(
            _read(store, f"{name}/{WRITER}", lambda: store.read_text(name, WRITER), backoff_seconds)
        )
    except TrainerError as failure:
        if isinstance(failure.__cause__, FileNotFoundError):
            return
        raise
    except (ValueError, KeyError, TypeError) as error:  # a writer file we cannot parse says nothing
        log.warning("%s at %s: %s is not readable (%s)", name, store.url(name), WRITER, error)
        return
    if reader is None:
        reader = Writer(writer.backend, _torch_version())
    if not writer.differs_from(reader):
        return  # written by the same code that cannot read it: really bad, skipped as before
    raise ConfigError(
        f"{name} at {store.url(name)} was written by the {writer.backend} backend with torch "
        f"{writer.torch} (checkpoint format {writer.format}), and this run ({reader.backend} backend, "
        f"torch {reader.torch}, format {reader.format}) cannot read it: {problem}. It is neither skipped "
        "nor cleared (a run that starts over would delete it and every newer checkpoint). Resume it "
        f"with the backend and image that wrote it (spec.backend: {writer.backend}), or start a new "
        "run with another spec.output.uri"
    )


def _read(store: Store, what: str, call: Callable[[], T], backoff_seconds: float) -> T:
    """``call()`` (a read of ``what`` under the output), retried after transient errors; a storage
    failure that outlasts them is raised as the run's error (failures.py), anything else as it is."""
    try:
        return failures.retrying(call, what=store.url(what), backoff_seconds=backoff_seconds)
    except Exception as error:
        failure = failures.storage_failure(
            error, f"{store.url(what)} could not be read: {type(error).__name__}: {error}", writing=False
        )
        if failure is None:
            raise
        raise failure from error


def shard_extents(store: Store, name: str) -> dict[str, int]:
    """Shard file -> the end of the last byte range ``.metadata`` points into it."""
    from tpuft_trainer import compat

    with store.fs.open(store.path(name, DCP_METADATA), "rb") as f:
        # DCP's own format: a pickled Metadata (torch.distributed.checkpoint), maybe of a newer torch
        metadata = compat.read_dcp_index(f)
    extents: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        extents[info.relative_path] = max(extents.get(info.relative_path, 0), end)
    return extents


@dataclass(frozen=True)
class ResumePoint:
    """The newest resumable checkpoint (None: start from the beginning) and what was skipped on the way."""

    checkpoint: Found | None
    skipped: list[Found]


def resume_point(
    store: Store, backoff_seconds: float = READ_BACKOFF_SECONDS, reader: Writer | None = None
) -> ResumePoint:
    """The newest checkpoint that can be resumed from, checking newest first. A legacy (full-file)
    checkpoint that is the newest complete one is returned as is: the caller says what to do. One
    process decides (resume.py): every host must resume from the same checkpoint. ``reader``: this
    run's backend and torch (``inspect``)."""
    skipped: list[Found] = []
    for _, name in _read(store, "", lambda: list(checkpoints(store)), backoff_seconds):
        found = inspect(store, name, backoff_seconds, reader)
        if found.resumable or found.legacy:
            return ResumePoint(found, skipped)
        skipped.append(found)
    return ResumePoint(None, skipped)


def mark_complete(store: Store, name: str) -> None:
    """Rank 0, after every file of the checkpoint is on storage."""
    store.write_text("ok\n", name, COMPLETE)


def clear_after(store: Store, step: int) -> list[str]:
    """Rank 0, before training resumes from ``step``, once every process knows it (resume.py): no
    checkpoint directory newer than it may look complete, since this attempt will save those steps
    again (possibly into the same directories). Unmarked ones (a save cut off) are deleted; marked ones
    that are not whole (a shard missing or cut short) lose their marker and keep their files for
    whoever wants to look, until a newer checkpoint is complete (``retire``). Returns what was done."""
    done = []
    for found_step, name in checkpoints(store):
        if found_step <= step:
            continue
        if not is_marked(store, name):
            store.remove(name)
            done.append(f"removed {name}: its save was cut off (no completion marker)")
        else:
            store.remove(name, COMPLETE)
            store.remove(name, LEGACY_UPLOADED)
            done.append(
                f"unmarked {name}: it is not whole, and a new save of step {found_step} will replace it"
            )
    return done


def retire(
    store: Store, keep: int | None, newest: int, *, known_complete: Collection[str] = (), since: int = 0
) -> list[str]:
    """Rank 0, once checkpoint-``newest`` is complete (no save is in flight then: one at a time).

    Deletes the unmarked directories older than it and newer than ``since``, the step this attempt
    resumed from: what ``clear_after`` unmarked at the start (or a save cut off) that this attempt did
    not save again. Nothing resumes from them, and on a long run with many restarts they would pile
    up. Older ones were there before this attempt, and an unmarked one newer than ``newest`` may be a
    save to come: both are left alone. ``known_complete`` (this attempt's own saves) are not asked
    about, so storage is asked only about the few others.
    With ``keep``, also deletes the oldest complete checkpoints beyond the newest ``keep`` (never an
    incomplete one). Returns what was done."""
    found = list(checkpoints(store))

    def marked(name: str) -> bool:
        return name in known_complete or is_marked(store, name)

    done, gone = [], set()
    for step, name in found:
        if since < step < newest and not marked(name):
            store.remove(name)
            gone.add(name)
            done.append(f"removed {name}: it is not complete, and checkpoint-{newest} is")
    if keep:
        complete = [name for _, name in found if name not in gone and marked(name)]
        for name in complete[keep:]:
            store.remove(name)
            done.append(f"removed {name} (keepCheckpoints: {keep})")
    return done
