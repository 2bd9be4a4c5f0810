"""What the operator knows about each run beyond what its watches show: one `RunState` per run.

The watches (watches.py) hold the latest TPUFineTune, JobSet and pods of every run. A few things
are known only to this process, because it did them and the watches may not have caught up yet: the
status it last wrote, the JobSet it created, when it created it, the run's render, the last look at
refused pods, and when a deferred reconcile is due. They live in one object per run, keyed by the
run's uid (a run deleted and created again under its name is a new run that starts from nothing),
created by `RunBook.of` and dropped by `RunBook.drop` (its TPUFineTune is gone) or `RunBook.retain`
(the resync's sweep, for a deletion whose event was missed): nowhere else.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from tpuft_operator.api.validation import SpecError
from tpuft_operator.render import RenderedRun
from tpuft_operator.slim import slim_finetune
from tpuft_operator.topology import SliceShape

Obj = Mapping[str, Any]
Key = tuple[str, str]  # (namespace, name) of a TPUFineTune
# A run's render: the objects to create, or once its JobSet exists only their shape (~1 KB instead of
# ~18 KB a run; a JobSet to recreate is rendered again), or why the spec does not render.
Render = RenderedRun | SliceShape | SpecError


@dataclass
class RefusalCheck:
    """The last look at why a run's pods are missing (reconcile.Reconciler._pods_refused)."""

    due: float  # monotonic time of the next look
    wait: float  # seconds between the last two looks (doubling, up to a bound)
    found: str | None  # the apiserver's words for the refusal last found


@dataclass
class RunState:
    uid: str
    key: Key
    born: float = field(default_factory=time.monotonic)  # when this process first saw the run
    # One reconcile of a run at a time (the work queue guarantees it; the lock makes it a fact for
    # callers outside the queue, such as tests).
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # The run as our last status patch left it. Events of a run's JobSet and pods carry the
    # TPUFineTune from the watch cache, which may not have seen that patch yet; deriving from the
    # older copy would repeat the patch and its event. Dropped once the watch has caught up.
    written: Obj | None = None
    # The JobSet this process created or adopted, until it is deleted or the run ends: under load the
    # JobSet index lags the API by seconds, and a reconcile that sees no JobSet there must not create
    # it again (without this, 30-90% of runs were created twice, 409, at N >= 300).
    jobset: Obj | None = None
    # When this process created the run's JobSet (monotonic), until the run's first status is written.
    created_at: float | None = None
    # The render of the spec's generation `render_generation`: rendering reads only the name, uid and
    # spec, and every pod and JobSet event reconciles the run; re-rendering for each cost ~15% of the CPU.
    render: Render | None = None
    render_generation: int = -1
    # The hash of the data settings of that render when it has a prepare Job (render/prepare_job.py),
    # kept when only the shape is: the prepare Job's outcome is read until the status says it.
    data_settings_hash: str | None = None
    refusal: RefusalCheck | None = None
    # The run's turn for its next status patch (pacing.WritePace.reserve), taken when a patch had to
    # wait for it and kept until the patch is written or no longer needed.
    write_turn: float | None = None
    # When a deferred reconcile of the run is due (monotonic), so that two reasons to look again at
    # about the same time (status settling, a refusal check) ask for one reconcile, not two.
    wakeup_due: float | None = None

    def freshest(self, finetune: Obj) -> Obj:
        """The newer of the watched TPUFineTune and the one our last status patch returned."""
        written = self.written
        if written is None:
            return finetune
        try:
            newer = int(written["metadata"]["resourceVersion"]) > int(finetune["metadata"]["resourceVersion"])
        except (KeyError, ValueError):
            return finetune  # resourceVersions are opaque in general; only compare etcd's integers
        if not newer:
            self.written = None  # the watch has caught up: no need to keep a copy
        return written if newer else finetune

    def status_written(self, answer: Obj) -> None:
        """Keeps the apiserver's answer to a status patch (slim, as the index keeps objects)."""
        self.written = slim_finetune(answer)
        self.created_at = None

    def keep_only_shape(self) -> None:
        if isinstance(self.render, RenderedRun):
            self.data_settings_hash = self.render.data_settings_hash if self.render.prepare_job else None
            self.render = self.render.shape

    def finished(self) -> None:
        """The run reached a terminal phase: nothing is ever created for it again."""
        self.render, self.render_generation, self.jobset = None, -1, None

    def wants_wakeup(self, delay: float) -> bool:
        """Whether a reconcile in ``delay`` seconds must be asked for (False: one is due by then)."""
        now = time.monotonic()
        if self.wakeup_due is not None and now < self.wakeup_due <= now + delay + 0.25:
            return False
        self.wakeup_due = now + delay
        return True


class RunBook:
    """Every RunState of this process, by run uid. Safe from any thread."""

    def __init__(self) -> None:
        self._runs: dict[str, RunState] = {}
        self._guard = threading.Lock()

    def of(self, finetune: Obj) -> RunState:
        """The state of the run ``finetune`` is (created on first sight)."""
        meta = finetune["metadata"]
        uid = str(meta.get("uid"))
        with self._guard:
            state = self._runs.get(uid)
            if state is None:
                state = self._runs[uid] = RunState(uid=uid, key=(str(meta["namespace"]), str(meta["name"])))
            return state

    def get(self, uid: str) -> RunState | None:
        with self._guard:
            return self._runs.get(uid)

    def find(self, key: Key) -> RunState | None:
        """The state of the run named ``key`` (namespace, name), if any."""
        with self._guard:
            return next((s for s in self._runs.values() if s.key == key), None)

    def drop(self, uid: str) -> RunState | None:
        with self._guard:
            return self._runs.pop(uid, None)

    def retain(self, uids: Collection[str], *, seen_before: float) -> list[RunState]:
        """Drops the states of runs not in ``uids`` (the runs the watch held at monotonic time
        ``seen_before``), except those first seen since; returns the dropped ones."""
        keep = set(uids)
        with self._guard:
            gone = [s for uid, s in self._runs.items() if uid not in keep and s.born < seen_before]
            for state in gone:
                del self._runs[state.uid]
        return gone

    def __len__(self) -> int:
        with self._guard:
            return len(self._runs)
