"""The one owner of saving and restoring checkpoints (torchtitan's CheckpointManager is the model).

A save first waits for the device to finish the steps the training loop dispatched ahead of it
(``Backend.wait_for_device``): the device computes them meanwhile, so that wait is timed apart and is
not counted as lost to training. Then it has two parts. *Staging* copies this process's chunks of the
model and optimizer state to host memory (``Backend.stage``): training waits for it, and only for it.
*Writing* hands the staged copy to ``torch.distributed.checkpoint`` (each process writes its own
chunks, the coordinator the index) and, on rank 0, the small files and the completion marker; a
periodic save writes in a background thread while training goes on. One save is in flight at a
time: a new save, a stop and the end of training first wait for the one writing. A stop's save (and
the last step's) is synchronous.

A write that fails (storage full, permission denied) is reported at the next step boundary or save
(``poll``/``wait``) naming the checkpoint, the location and the newest checkpoint that is complete;
its partial directory is removed (best effort) and no complete checkpoint is ever deleted because of
it (retention runs only after a checkpoint is complete). Reads and writes share one classification
(failures.py): permission denied is ``PermissionDeniedError`` (exit 77, not restarted), any other
storage failure ``CheckpointWriteError`` / ``CheckpointReadError`` (exit 1, restarted); a checkpoint
that storage returns but that does not fit this run's model is a ``ConfigError`` (exit 64).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tpuft_trainer import compat, host_memory
from tpuft_trainer.checkpoint import layout
from tpuft_trainer.checkpoint.backend import Backend
from tpuft_trainer.checkpoint.failures import (
    CheckpointReadError,
    CheckpointWriteError,
    is_mismatch,
    storage_failure,
)
from tpuft_trainer.errors import ConfigError, TrainerError

__all__ = ["CheckpointManager", "CheckpointReadError", "CheckpointWriteError", "Faults", "SaveRecord"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Faults:
    """Fault injection for tests and chaos drills (pod_contract's TPUFT_FAULT_* variables): at the
    save of step ``kill_before_marker``, SIGKILL this process once every file is written but before
    the marker; at the save of step ``sigterm_while_writing``, send it SIGTERM as the write begins;
    ``slow_write_seconds``: every write waits that long before its first file (slow storage)."""

    kill_before_marker: int = 0
    sigterm_while_writing: int = 0
    slow_write_seconds: float = 0.0


@dataclass(frozen=True)
class SaveRecord:
    """One completed save, as attempt.py records it."""

    step: int
    reason: str  # "periodic", "SIGTERM", "checkpoint request <n>", "final"
    # The device finishing the steps dispatched before the save: it computed them meanwhile, so this
    # is not lost to training (a stop's save takes it too, within the grace period).
    device_wait_seconds: float
    staging_seconds: float  # the copy to host memory, alone
    # What the save cost training: the staging (and a wait for the previous save's write, if it was
    # still writing); a synchronous save: also its write. Everything but the device wait.
    blocked_seconds: float
    write_seconds: float  # the write after the staging (in the background for a periodic save)
    seconds: float  # from the save's start to the checkpoint complete on storage: all of it


@dataclass
class _Save:
    step: int
    reason: str
    staged: dict[str, Any]
    small_files: dict[str, bytes]
    device_wait_seconds: float
    staging_seconds: float
    started: float  # monotonic: the save call
    staged_at: float  # monotonic: the end of the staging
    blocking: bool = False
    completed_at: float | None = None  # monotonic: on storage (or failed)
    thread: threading.Thread | None = None
    error: BaseException | None = None
    record: SaveRecord | None = None


class CheckpointManager:
    """Saves and restores the checkpoints of one run at ``store`` (every process makes the same calls)."""

    def __init__(
        self,
        store: layout.Store,
        backend: Backend,
        *,
        keep: int | None = None,
        faults: Faults = Faults(),
    ) -> None:
        self.store = store
        self.backend = backend
        self.keep = keep
        self.is_coordinator = backend.process_index == 0
        self._faults = faults
        self._current: _Save | None = None
        self._recent: list[_Save] = []  # the last few saves, for in_flight_at
        self._completed: list[SaveRecord] = []  # only the caller's thread: _join, poll
        self.newest_complete: int | None = None  # the newest checkpoint known complete
        self.resumed_step = 0  # the checkpoint this attempt loaded (0: none)
        self._complete_here: set[str] = set()  # the checkpoints this attempt completed
        self.newest_started: int | None = None  # the newest save this process started
        self._writer = layout.this_writer(backend.name).to_json()  # every checkpoint's layout.WRITER

    # ---- saving ---------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        small_files: Callable[[], dict[str, bytes]],
        *,
        reason: str,
        blocking: bool,
    ) -> None:
        """Save ``state`` (nested dicts of tensors) as checkpoint-``step``. Returns after the staging
        copy (``blocking=False``) or once the checkpoint is complete. ``small_files`` gives rank 0's
        small files (name -> bytes) as of now."""
        started = time.monotonic()
        self._join()  # one save in flight: the previous one must be on storage first
        joined = time.monotonic()
        self.backend.wait_for_device()
        device_ready = time.monotonic()
        staged = self.backend.stage(state)
        files = {**small_files(), layout.WRITER: self._writer.encode()} if self.is_coordinator else {}
        staged_at = time.monotonic()
        save = _Save(
            step,
            reason,
            staged,
            files,
            device_ready - joined,
            staged_at - device_ready,
            started,
            staged_at,
            blocking,
        )
        self.newest_started = step
        self._recent = [*self._recent[-3:], save]
        if blocking:
            self._write(save)
            self._current = save
            self._join()
            return
        save.thread = threading.Thread(
            target=self._write, args=(save,), name=f"checkpoint-{step}", daemon=True
        )
        self._current = save
        save.thread.start()

    def _write(self, save: _Save) -> None:
        name = layout.name_for(save.step)
        try:
            if self._faults.sigterm_while_writing == save.step:
                log.warning("fault injection: SIGTERM while checkpoint-%d is being written", save.step)
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(self._faults.slow_write_seconds)
            if self.is_coordinator:
                self.store.fs.makedirs(self.store.path(name), exist_ok=True)
                for file_name, data in save.small_files.items():
                    with self.store.fs.open(self.store.path(name, file_name), "wb") as out:
                        out.write(data)
            _dcp_save(save.staged, self.store, name, self.backend.save_planner(), _group(self.backend))
            save.staged = {}  # the host copy can go as soon as it is written
            host_memory.release()
            if self.is_coordinator:
                if self._faults.kill_before_marker == save.step:
                    log.warning(
                        "fault injection: killing this process before checkpoint-%d is marked", save.step
                    )
                    logging.shutdown()
                    os.kill(os.getpid(), signal.SIGKILL)
                layout.mark_complete(self.store, name)
            done = save.completed_at = time.monotonic()
            training_waited_until = done if save.blocking else save.staged_at
            save.record = SaveRecord(
                save.step,
                save.reason,
                device_wait_seconds=save.device_wait_seconds,
                staging_seconds=save.staging_seconds,
                blocked_seconds=training_waited_until - save.started - save.device_wait_seconds,
                write_seconds=done - save.staged_at,
                seconds=done - save.started,
            )
        except BaseException as error:  # reported in the training thread (poll/wait)
            save.completed_at = time.monotonic()
            save.error = error
            save.staged = {}
            host_memory.release()
            if self.is_coordinator:
                try:
                    self.store.remove(name)
                except Exception:  # best effort: the next start removes it anyway (no marker)
                    log.debug("could not remove the partial %s", name, exc_info=True)

    def _join(self) -> None:
        save, self._current = self._current, None
        if save is None:
            return
        waited = time.monotonic()
        if save.thread is not None:
            save.thread.join()
        if save.error is not None:
            raise self._write_failure(save)
        assert save.record is not None
        if save.thread is not None and time.monotonic() - waited > 0.05:
            log.info(
                "waited %.1f s for checkpoint-%d to finish writing", time.monotonic() - waited, save.step
            )
        self._finished(save.record)

    def _finished(self, record: SaveRecord) -> None:
        self.newest_complete = record.step
        self._completed.append(record)
        self._complete_here.add(layout.name_for(record.step))
        if self.is_coordinator:
            retired = layout.retire(
                self.store,
                self.keep,
                record.step,
                known_complete=self._complete_here,
                since=self.resumed_step,
            )
            for action in retired:
                log.info("%s", action)

    def _write_failure(self, save: _Save) -> TrainerError:
        assert save.error is not None
        error = root_cause(save.error)
        where = self.store.url(layout.name_for(save.step))
        kept = (
            f"checkpoint-{self.newest_complete} is the newest complete one and is kept"
            if self.newest_complete is not None
            else "no earlier checkpoint of this attempt is complete"
        )
        message = f"checkpoint-{save.step} could not be written to {where}: {_first_line(error)}; {kept}"
        if getattr(error, "errno", None) == errno.ENOSPC:
            message += " (the output's storage is full: free space or use a larger volume)"
        failure = storage_failure(error, message, writing=True)
        if failure is None:  # not storage (a bug, a planner's error): still not a complete checkpoint
            failure = CheckpointWriteError(message)
        failure.__cause__ = save.error
        return failure

    def poll(self) -> list[SaveRecord]:
        """At a step boundary: saves completed since the last call; raises if a background write failed."""
        save = self._current
        if save is not None and save.thread is not None and not save.thread.is_alive():
            self._join()
        done, self._completed = self._completed, []
        return done

    def wait(self) -> list[SaveRecord]:
        """Waits for the save in flight (if any); then as ``poll``."""
        self._join()
        return self.poll()

    def in_flight_at(self, moment: float) -> int | None:
        """The step of the save that was being made at monotonic time ``moment`` (staging or
        writing), if any."""
        for save in reversed(self._recent):
            if save.started <= moment and (save.completed_at is None or moment < save.completed_at):
                return save.step
        return None

    def close(self) -> None:
        """Joins the save in flight without raising (on the way out of a failed run)."""
        save, self._current = self._current, None
        if save is not None and save.thread is not None:
            save.thread.join()

    # ---- restoring --------------------------------------------------------------------------------
    def load(self, found: layout.Found, state: Mapping[str, Any]) -> dict[str, Any]:
        """Loads checkpoint ``found`` into ``state`` in place (resharding to the current layout);
        returns the optimizer's non-tensor state (optimizer.json)."""
        import torch.distributed.checkpoint as dcp

        try:
            with quiet():
                dcp.load(
                    dict(state),
                    storage_reader=_reader(self.store, found.name),
                    planner=self.backend.load_planner(),
                    process_group=_group(self.backend),
                )
        except (Exception, dcp.CheckpointException) as error:
            cause = root_cause(error)
            where = self.store.url(found.name)
            failure = storage_failure(
                cause, f"{found.name} at {where} could not be read: {_first_line(cause)}", writing=False
            )
            if failure is None and not is_mismatch(cause):  # neither storage nor the model: restarted
                failure = CheckpointReadError(
                    f"{found.name} at {where} could not be loaded: {type(cause).__name__}: {_first_line(cause)}"
                )
            if failure is not None:
                raise failure from error
            raise ConfigError(
                f"{found.name} at {where} does not fit this run's model and optimizer (was it saved by a "
                f"run of another model, method or optimizer?): {_first_line(cause)}"
            ) from error
        host_memory.release()  # the read buffers
        with self._reading(found, layout.OPTIMIZER_EXTRAS):
            extras: dict[str, Any] = json.loads(self.store.read_text(found.name, layout.OPTIMIZER_EXTRAS))
        self.newest_complete = self.resumed_step = found.step
        return extras

    @contextlib.contextmanager
    def _reading(self, found: layout.Found, file_name: str) -> Iterator[None]:
        """A storage failure reading one of ``found``'s files, as the run's error (failures.py)."""
        try:
            yield
        except Exception as error:
            where = self.store.url(found.name, file_name)
            failure = storage_failure(
                error, f"{where} could not be read: {_first_line(error)}", writing=False
            )
            if failure is None:
                raise
            raise failure from error

    def fetch_small_files(self, found: layout.Found, local_dir: str) -> str:
        """A local directory with the checkpoint's small files (where the Trainer reads its state): the
        checkpoint itself on a local store, else a copy in ``local_dir/<name>``."""
        if self.store.is_local:
            return self.store.local_path(found.name)
        target = os.path.join(local_dir, found.name)
        os.makedirs(target, exist_ok=True)
        for file_name in layout.SMALL_FILES:
            with self._reading(found, file_name):
                self.store.get_file((found.name, file_name), os.path.join(target, file_name))
        return target


def root_cause(error: BaseException) -> BaseException:
    """The first process's own exception inside DCP's CheckpointException (a BaseException that
    carries each rank's failure), else ``error``."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        return first[0] if isinstance(first, tuple) else error
    return error


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:500] if text else type(error).__name__


def _writer(store: layout.Store, name: str) -> Any:
    if store.is_local:
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(store.local_path(name), single_file_per_rank=True, sync_files=True)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(store.url(name), single_file_per_rank=True, sync_files=True)


def _reader(store: layout.Store, name: str) -> Any:
    """DCP's reader of checkpoint ``name``, reading its index through ``compat.read_dcp_index`` (an
    index a newer torch wrote: the native backend's checkpoints resumed by the xla backend)."""
    return _reader_class(store.is_local)(store.local_path(name) if store.is_local else store.url(name))


@functools.cache
def _reader_class(local: bool) -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    base: Any = FileSystemReader if local else FsspecReader

    class Reader(base):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            # What the base's read_metadata does, with the tolerant unpickling in place of pickle.load.
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as stream:
                metadata = compat.read_dcp_index(stream)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader


# Said at every save or load, by DCP and torch_xla's planners, about their own code: noise in a log.
QUIET = (
    "torch.distributed is disabled",  # one process: DCP assumes so
    "The function definition for SavePlanner.set_up_planner",
    "TypedStorage is deprecated",
    "Using a non-tuple sequence for multidimensional indexing",
)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        for message in QUIET:
            warnings.filterwarnings("ignore", message=message)
        yield


def _group(backend: Backend) -> Any:
    """The process group DCP's collectives use: the backend's own when it has one (a background write
    must not share a group with the training loop's collectives: two threads issuing collectives on
    one group in different orders deadlock), else the default group."""
    return getattr(backend, "process_group", None)


def _dcp_save(
    staged: dict[str, Any], store: layout.Store, name: str, planner: Any, group: Any = None
) -> None:
    import torch.distributed.checkpoint as dcp

    with quiet():
        dcp.save(staged, storage_writer=_writer(store, name), planner=planner, process_group=group)
