"""The pace of the operator's non-urgent writes: a token bucket, as client-go gives every Go controller.

For an admin who wants to cap the operator's share of a busy API server (`--write-qps`, off by
default). It was built to leave the JobSet controller room after a burst of runs: at N=1000 the
operator wrote 978 first statuses in 7 s and then 849 Events in 4 s while the JobSet controller made
2-3 Jobs a second (30-45 once they stopped). Measured, pacing them bought little and cost status lag
(below; docs/benchmarks.md): the JobSet controller is slowed by the API server's load as a whole.

What is paced: status patches and Events. What never is: JobSet creates (and the objects a run needs
with them), suspend and resume, Kueue holds, checkpoint requests to pods: each is the thing a user
or a TPU host waits for.

A writer *reserves* its turn (`reserve`) and writes when it comes: a reconcile that has to wait asks
for a later reconcile instead of holding a worker (a worker asleep on the bucket is one fewer for the
next run's JobSet); the Event threads, which do nothing else, sleep (`wait`). Turns are handed out
in order, so under a flood a status waits its turn rather than being starved by later ones.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

# Off by default, as measured (`python -m bench pace`, docs/benchmarks.md): after a burst of 1000 runs
# on the 2-CPU benchmark machine a pace of 50 writes a second bought the JobSet controller nothing
# and delayed first statuses by 3.2 s (p50); 20 a second had every run's first Job 10-14% sooner, but
# first statuses 2.4x (p50) to 3.8x (p99) later, 7% of the runs never shown Running (their pods had
# finished before their turn), and Succeeded up to 30 s late (p99). The operator writes ~6 times per
# run (3 status patches, 3 Events): a pace below ~6 x the runs a second it must follow falls behind.
# For an admin who wants to cap the operator's share of a busy API server; APF already keeps it fair.
DEFAULT_WRITE_QPS = 0.0
DEFAULT_WRITE_BURST = 100


class WritePace:
    """A token bucket: ``rate`` writes a second on average, ``burst`` at once after a quiet spell.

    ``rate`` 0 (or less): no limit, every turn is now. Safe from any thread."""

    def __init__(self, rate: float, burst: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = max(1, burst)
        self._clock = clock
        self._tokens = float(self.burst)  # may go below 0: turns handed out ahead of the tokens
        self._refilled = clock()
        self._lock = threading.Lock()

    @property
    def limited(self) -> bool:
        return self.rate > 0

    def reserve(self) -> float:
        """Takes the next turn; returns when it comes (this clock's time: now, or later)."""
        now = self._clock()
        if not self.limited:
            return now
        with self._lock:
            self._tokens = min(self.burst, self._tokens + (now - self._refilled) * self.rate)
            self._refilled = now
            self._tokens -= 1
            if self._tokens >= 0:
                return now
            return now + -self._tokens / self.rate

    def due_in(self, turn: float) -> float:
        """Seconds until ``turn`` (a time `reserve` returned) comes; 0 once it has."""
        return max(0.0, turn - self._clock())

    def wait(self, sleep: Callable[[float], object] = time.sleep) -> float:
        """Takes the next turn and sleeps until it comes; returns the seconds slept."""
        delay = self.due_in(self.reserve())
        if delay > 0:
            sleep(delay)
        return delay
