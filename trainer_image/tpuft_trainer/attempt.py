"""What this attempt of the run did, in time: when its process started, when its first step was done,
which step it resumed from, which checkpoints it skipped, and each checkpoint save (step, how long
the device took to finish the steps dispatched before it, how long the staging copy and training's
wait took, how long it took to write, why).

Rank 0 reports it in ``status.progress.attempt`` and ``status.progress.lastCheckpoint``; the operator
folds the attempts of a run into ``status.goodput`` (productive time against what was lost to
waiting, start-up, saves, redone steps and restart gaps), and ``tpuft-metrics.json`` carries this
attempt's part. Wall-clock times (UTC) because they are compared with the operator's clock and the
pods' start times; durations from the monotonic clock.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any


def process_start_time() -> datetime:
    """When this process was started (Linux: /proc), else now: model loading and imports count as
    start-up, so the clock starts before Python had imported anything."""
    try:
        with open("/proc/self/stat") as stat:
            # Field 22 (starttime) in clock ticks since boot; the command name (field 2) may hold
            # spaces but ends at the last ')'.
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as boot:
            btime = next(int(line.split()[1]) for line in boot if line.startswith("btime "))
        return datetime.fromtimestamp(btime + ticks / os.sysconf("SC_CLK_TCK"), UTC)
    except (OSError, ValueError, IndexError, StopIteration):
        return datetime.now(UTC)


def _timestamp(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class CheckpointSave:
    """One save's times, as checkpoint.manager.SaveRecord measures them."""

    step: int
    device_wait_seconds: float  # the device finishing the steps dispatched before the save (not lost)
    staging_seconds: float  # the copy to host memory
    blocked_seconds: (
        float  # what the save cost training: all but the device wait (and a periodic save's write)
    )
    write_seconds: float  # the write after the staging (in the background for a periodic save)
    seconds: float  # from the save's start to the checkpoint complete on storage
    reason: str  # "periodic", "final", "SIGTERM", "checkpoint request <n>"
    time: datetime

    def to_status(self, grace_seconds: float) -> dict[str, Any]:
        return {
            "step": self.step,
            "seconds": round(self.seconds, 2),
            "deviceWaitSeconds": round(self.device_wait_seconds, 2),
            "stagingSeconds": round(self.staging_seconds, 2),
            "blockedSeconds": round(self.blocked_seconds, 2),
            "writeSeconds": round(self.write_seconds, 2),
            "reason": self.reason,
            "graceSeconds": grace_seconds,
            "time": _timestamp(self.time),
        }


@dataclass(frozen=True)
class SkippedCheckpoint:
    step: int
    reason: str

    def to_status(self) -> dict[str, Any]:
        return {"step": self.step, "reason": self.reason[:256]}


MAX_SKIPPED = 8  # the API's bound on status.progress.attempt.skippedCheckpoints


@dataclass
class Attempt:
    started_at: datetime
    resumed_from_step: int = 0
    grace_seconds: float = 60.0
    first_step_at: datetime | None = None
    saves: list[CheckpointSave] = field(default_factory=list)
    skipped: list[SkippedCheckpoint] = field(default_factory=list)
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC), repr=False)

    def step_ended(self) -> None:
        """Called at every step boundary."""
        if self.first_step_at is None:
            self.first_step_at = self.clock()

    def checkpoint_saved(
        self,
        step: int,
        reason: str,
        *,
        device_wait_seconds: float,
        staging_seconds: float,
        blocked_seconds: float,
        write_seconds: float,
        seconds: float,
    ) -> CheckpointSave:
        save = CheckpointSave(
            step,
            device_wait_seconds,
            staging_seconds,
            blocked_seconds,
            write_seconds,
            seconds,
            reason,
            self.clock(),
        )
        self.saves.append(save)
        return save

    @property
    def checkpoint_seconds(self) -> float:
        """Time training waited for saves (what goodput counts as lost)."""
        return sum(save.blocked_seconds for save in self.saves)

    @property
    def checkpoint_write_seconds(self) -> float:
        return sum(save.write_seconds for save in self.saves)

    def to_status(self) -> dict[str, Any]:
        """``status.progress`` fields (camelCase, as in the API)."""
        body: dict[str, Any] = {
            "attempt": {
                "startTime": _timestamp(self.started_at),
                "resumedFromStep": self.resumed_from_step,
                "checkpointSeconds": round(self.checkpoint_seconds, 2),
                "checkpointWriteSeconds": round(self.checkpoint_write_seconds, 2),
                # Always sent: a merge patch keeps what it leaves out, and an earlier attempt's
                # skipped checkpoints are not this one's.
                "skippedCheckpoints": [s.to_status() for s in self.skipped[:MAX_SKIPPED]],
            }
        }
        if self.first_step_at is not None:
            body["attempt"]["firstStepTime"] = _timestamp(self.first_step_at)
        if self.saves:
            body["lastCheckpoint"] = self.saves[-1].to_status(self.grace_seconds)
        return body

    def to_record(self) -> dict[str, Any]:
        """This attempt's part of ``tpuft-metrics.json``."""
        startup = (
            (self.first_step_at - self.started_at).total_seconds() if self.first_step_at is not None else None
        )
        return {
            "started_at": _timestamp(self.started_at),
            "first_step_at": _timestamp(self.first_step_at) if self.first_step_at else None,
            "startup_seconds": round(startup, 2) if startup is not None else None,
            "resumed_from_step": self.resumed_from_step,
            "skipped_checkpoints": [{"step": s.step, "reason": s.reason} for s in self.skipped],
            "checkpoint_seconds": round(self.checkpoint_seconds, 2),
            "checkpoint_write_seconds": round(self.checkpoint_write_seconds, 2),
            "checkpoints": [
                {
                    "step": s.step,
                    "device_wait_seconds": round(s.device_wait_seconds, 3),
                    "staging_seconds": round(s.staging_seconds, 3),
                    "blocked_seconds": round(s.blocked_seconds, 3),
                    "write_seconds": round(s.write_seconds, 3),
                    "seconds": round(s.seconds, 3),
                    "reason": s.reason,
                }
                for s in self.saves
            ],
        }
