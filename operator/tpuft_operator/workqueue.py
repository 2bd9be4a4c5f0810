"""The queue of runs waiting to be reconciled, with the guarantees of client-go's workqueue.

Every watch event of a run (its TPUFineTune, JobSet and pods: ~10 per run) only *marks* the run as
needing a reconcile; worker threads take runs from here and reconcile each from the watches' stores as they
are by then. So:
- a run waits here at most once, however many events arrive for it meanwhile (a burst of pod
  events costs one reconcile, not one each);
- no two workers reconcile the same run at once (a run marked while it is being reconciled is
  queued again when that reconcile ends, so the last event is never missed);
- runs that still need their JobSet go first: creating JobSets is what users wait for, while a
  status that says Running a second later costs them nothing. Under a burst of 300 creates the
  pod events of the first runs no longer delay the creation of the last ones;
- while JobSets are being created (a burst: runs needing one wait or are being reconciled, or one
  was marked within QUIET_SECONDS; `wait_quiet` waits for its end), the other runs wait, up to
  HOLD_SECONDS each: their status writes would compete with the creates for the same API server.
  After that they go, but no more than BURST_OTHER_WORKERS at a time while the burst lasts: in a
  burst of 1000 runs the holds of the first hundred ended together, every worker took one of them,
  and the operator sent 95 status patches and no JobSet in that second (`python -m bench operator`,
  its audit log); a status a few seconds late costs users less than JobSets that wait.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

Key = tuple[str, str]  # (namespace, name) of a TPUFineTune
# A burst of creates counts as going on this long after its last mark (the gaps between arrivals).
QUIET_SECONDS = 0.3
# No run waits longer than this for a burst of creates to end...
HOLD_SECONDS = 5.0
# ...and while the burst lasts, no more than this many workers do the work of such runs at once.
BURST_OTHER_WORKERS = 2
# The longest a worker sleeps before it looks again when nothing wakes it (a safety net).
RECHECK_SECONDS = 1.0


class WorkQueue:
    def __init__(self, *, waited: Callable[[float, bool], None] | None = None) -> None:
        """``waited``: called with the seconds each run waited, from its mark to a worker taking it,
        and whether it was taken as urgent (it needed its JobSet)."""
        self._waited = waited
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # workers wait here for a run
        self._quiet = threading.Condition(lock)  # `wait_quiet` waits here for a burst to end
        self._urgent: deque[Key] = deque()
        self._normal: deque[Key] = deque()
        # Marked runs -> whether urgent. A run is in a deque unless it is being processed; a deque
        # may hold a stale copy of a run that was promoted or already taken (skipped when met).
        self._waiting: dict[Key, bool] = {}
        self._urgent_waiting = 0  # how many of `_waiting` are urgent: `_creating_now` reads it on every get
        self._processing: set[Key] = set()
        self._marked_at: dict[Key, float] = {}  # the first mark of each waiting run (monotonic)
        self._creating: set[Key] = set()  # urgent runs being reconciled
        self._others: set[Key] = set()  # the other runs being reconciled
        self._last_urgent = float("-inf")  # when a run was last marked urgent (monotonic)
        self._closed = False

    def add(self, key: Key, *, urgent: bool = False) -> None:
        """Marks ``key`` as needing a reconcile. Safe from any thread."""
        with self._cond:
            if self._closed:
                return
            was = self._waiting.get(key)
            if was is not None and (was or not urgent):
                return  # already waiting, at this priority or a higher one
            self._waiting[key] = urgent
            self._marked_at.setdefault(key, time.monotonic())
            if urgent:
                self._urgent_waiting += 1
                self._last_urgent = time.monotonic()
            if key not in self._processing:
                (self._urgent if urgent else self._normal).append(key)
                self._cond.notify()

    def get(self) -> Key | None:
        """The next run to reconcile (urgent ones first), waiting for one; None once closed.
        The caller must call ``done(key)`` when the reconcile ends, whatever its outcome."""
        with self._cond:
            while not self._closed:
                key = self._pop(self._urgent)
                if key is not None:
                    self._creating.add(key)
                    return self._take(key)
                hold = self._hold()
                if hold <= 0:
                    key = self._pop(self._normal)
                    if key is not None:
                        self._others.add(key)
                        return self._take(key)
                    self._cond.wait()
                else:
                    self._cond.wait(hold)
            return None

    def wait_quiet(self, timeout: float) -> bool:
        """Waits until no burst of JobSet creation is going on, at most ``timeout`` seconds; returns
        whether it has ended. For the work that should not compete with the creates (Events)."""
        deadline = time.monotonic() + timeout
        with self._quiet:
            while not self._closed:
                now = time.monotonic()
                if not self._creating_now(now):
                    return True
                if now >= deadline:
                    return False
                self._quiet.wait(self._wake_within(deadline - now, now))
            return True

    def _creating_now(self, now: float) -> bool:
        return bool(self._creating) or self._urgent_waiting > 0 or now - self._last_urgent < QUIET_SECONDS

    def _wake_within(self, seconds: float, now: float) -> float:
        """How long a waiter for the end of a burst may sleep: ``seconds``, or less if the quiet period
        after the last urgent mark ends first. The end of an urgent reconcile notifies (`done`); the
        end of the quiet period does not, so a waiter must wake up for it."""
        quiet_ends = self._last_urgent + QUIET_SECONDS - now
        return min(seconds, quiet_ends) if quiet_ends > 0 else seconds

    def _hold(self) -> float:
        """Seconds the next normal run should still wait (0: take it now)."""
        now = time.monotonic()
        if not self._creating_now(now):
            return 0.0
        oldest = next((self._marked_at.get(k) for k in self._normal if k in self._waiting), None)
        if oldest is None:
            return 0.0
        hold = oldest + HOLD_SECONDS - now
        if hold <= 0 and len(self._others) >= BURST_OTHER_WORKERS:
            # Held no longer, but as many workers as a burst allows are on such runs: the end of
            # one of them or of the burst (`done`, or the quiet period: `_wake_within`) lets it go.
            hold = RECHECK_SECONDS
        return self._wake_within(hold, now) if hold > 0 else 0.0

    def _pop(self, queue: deque[Key]) -> Key | None:
        while queue:
            key = queue.popleft()
            if key in self._waiting and key not in self._processing:
                return key
        return None

    def _take(self, key: Key) -> Key:
        urgent = self._waiting.pop(key)
        if urgent:
            self._urgent_waiting -= 1
        self._processing.add(key)
        marked = self._marked_at.pop(key, None)
        if self._waited is not None and marked is not None:
            self._waited(time.monotonic() - marked, urgent)
        return key

    def done(self, key: Key) -> None:
        with self._cond:
            self._processing.discard(key)
            if key in self._others:
                self._others.discard(key)
                self._cond.notify()  # a held run may go in its place
            if key in self._creating:
                self._creating.discard(key)
                if not self._creating and self._urgent_waiting == 0:
                    # The burst may be over (or is, once its quiet period passes: `_wake_within`):
                    # the held runs and `wait_quiet` look again. Not at the end of every create: in a
                    # burst of 1000 that woke every worker a thousand times for nothing.
                    self._cond.notify_all()
                    self._quiet.notify_all()
            if key in self._waiting and not self._closed:
                (self._urgent if self._waiting[key] else self._normal).append(key)
                self._cond.notify()

    def close(self) -> None:
        """Wakes every waiting worker with None; later adds are ignored."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self._quiet.notify_all()

    def __len__(self) -> int:
        """Runs waiting (not counting those being reconciled)."""
        with self._cond:
            return len(self._waiting)
