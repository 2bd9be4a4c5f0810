"""One resume point for every process of the run.

Every host must resume from the same checkpoint: otherwise the model is assembled from two steps, or
the hosts hang at their first collective. So process 0 alone reads the output and decides
(``layout.resume_point``, which asks storage again after a transient error), and every process takes
its answer (``Backend.broadcast_object``: torch.distributed's default group, the one DCP's own
collectives use; nothing to send with one process). Only once every process has the answer does
process 0 clear what is newer than it (``layout.clear_after``), and the others wait for that cleanup
before going on, so no save of this attempt starts before it. A failure on process 0 (permission
denied, storage that stays down) is sent too and raised by every process: the same exit code on every
host, and no host left waiting for a collective process 0 will never join. Backend-neutral.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tpuft_trainer.checkpoint import layout
from tpuft_trainer.checkpoint.backend import Backend
from tpuft_trainer.errors import TrainerError

T = TypeVar("T")


@dataclass(frozen=True)
class Agreed:
    """The resume point every process agreed on, and what process 0 cleared after it."""

    point: layout.ResumePoint
    cleared: list[str] = field(default_factory=list)


def agree_on_resume_point(
    store: layout.Store, backend: Backend, *, backoff_seconds: float = layout.READ_BACKOFF_SECONDS
) -> Agreed:
    """Every process calls it, and gets the same answer. A legacy (full-file) checkpoint is returned
    without clearing anything: the caller refuses it."""
    point: layout.ResumePoint = _from_process_zero(
        backend, lambda: layout.resume_point(store, backoff_seconds, layout.this_writer(backend.name))
    )
    backend.barrier()  # every process has the answer before anything at the output changes
    found = point.checkpoint
    if found is not None and found.legacy:
        return Agreed(point)
    cleared: list[str] = _from_process_zero(
        backend, lambda: layout.clear_after(store, found.step if found else 0)
    )
    return Agreed(point, cleared)


def _from_process_zero(backend: Backend, call: Callable[[], T]) -> T:
    """``call()`` on process 0, its result (or its failure, raised) on every process."""
    result: Any = None
    failure: BaseException | None = None
    if backend.process_index == 0:
        try:
            result = call()
        except Exception as error:
            failure = error
    sent_result, sent_failure = backend.broadcast_object((result, _sendable(failure)))
    if failure is not None:
        raise failure  # process 0's own, with its traceback
    if sent_failure is not None:
        raise sent_failure
    return sent_result


def _sendable(error: BaseException | None) -> TrainerError | None:
    """What the other processes raise for process 0's failure: the same TrainerError (so the same exit
    code), or for anything else an infrastructure failure that names it."""
    if error is None or isinstance(error, TrainerError):
        return error
    return TrainerError(f"process 0 could not decide where to resume from: {type(error).__name__}: {error}")
