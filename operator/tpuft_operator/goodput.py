"""status.goodput: productive training time against wall time since creation. Pure.

The trainer's rank 0 reports its attempt (one start of the run's pods) in ``status.progress``: when
its process started, when its first step was done, which step it resumed from, how long training
waited for its saves (``checkpointSeconds``) and how long they took to write
(``checkpointWriteSeconds``; tpuft_trainer/attempt.py). Saves are asynchronous: a periodic save
blocks training only while each host copies its shards to host memory, and writes them in the
background while training goes on; a stop's save (SIGTERM) is synchronous and blocks in full. So
only the blocked time is lost; the write time is kept in the attempt's record for information. The
operator keeps one record per attempt in ``status.goodput.attempts`` and derives the rest from them,
the run's creation time and the pods' start times:

    wall       = creation -> asOf (the last report, or completion)
    waiting    = creation -> the first attempt's pod start (capacity, Kueue admission, scheduling)
    startup    = pod start -> first step, every attempt (image, model load, compilation)
    checkpoint = time training waited for saves, every attempt (and the final save after the last
                 report of a success)
    redone     = the steps an attempt did past the checkpoint the next attempt resumed from (their
                 time, and their count in ``redoneSteps``: what a stop whose save was cut off, e.g.
                 a Spot reclaim's ~15 s, or a host lost without notice cost)
    gaps       = one attempt's last report -> the next one's pod start (restarts, suspension)
    productive = wall - all of the above

so the buckets and productive time sum to the wall time by construction. An attempt's record is
refreshed at most every ``interval`` seconds of report time, and always when the phase changes
(a restart ends an attempt: its last report is kept before the next attempt's reports replace it)
or the run finishes: one status write per interval, not one per progress report.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from tpuft_operator.api.models import TERMINAL_PHASES, Phase

MAX_ATTEMPTS = 32  # the API's bound on status.goodput.attempts
Obj = Mapping[str, Any]


def parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(UTC)
    except ValueError:
        return None


def _stamp(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _seconds(later: datetime | None, earlier: datetime | None) -> float:
    if later is None or earlier is None:
        return 0.0
    return max(0.0, (later - earlier).total_seconds())


def _attempt_from(progress: Obj, pod_start: datetime | None) -> dict[str, Any] | None:
    """The current attempt's record, from the trainer's report (None: nothing usable reported)."""
    report = progress.get("attempt") or {}
    start = parse_time(report.get("startTime"))
    end = parse_time(progress.get("updateTime"))
    if start is None or end is None:
        return None
    record: dict[str, Any] = {
        "startTime": _stamp(start),
        "endTime": _stamp(max(end, start)),
        "resumedFromStep": int(report.get("resumedFromStep") or 0),
        "lastStep": int(progress.get("step") or 0),
        # Blocked time only (the staging copy; a stop's save in full): what goodput counts as lost.
        "checkpointSeconds": round(float(report.get("checkpointSeconds") or 0.0), 2),
    }
    written = report.get("checkpointWriteSeconds")
    if isinstance(written, (int, float)):  # informational: the writes overlap training
        record["checkpointWriteSeconds"] = round(float(written), 2)
    # The pod started before the trainer's process (image pull, container start): start-up counts
    # from there. A pod start after the trainer's is another attempt's pod; ignore it.
    if pod_start is not None and pod_start <= start:
        record["podStartTime"] = _stamp(pod_start)
    first = parse_time(report.get("firstStepTime"))
    if first is not None:
        record["firstStepTime"] = _stamp(first)
    return record


def _refreshed(stored: Obj, fresh: Obj, *, interval: float, force: bool) -> bool:
    """Whether the stored record of the same attempt takes the fresh values now."""
    if force or stored.get("firstStepTime") != fresh.get("firstStepTime"):
        return True
    if stored.get("checkpointSeconds") != fresh.get("checkpointSeconds"):
        return True  # a save blocked training: rare, and it decides a bucket (a write alone does not)
    return _seconds(parse_time(fresh["endTime"]), parse_time(stored.get("endTime"))) >= interval


def fold_attempts(
    previous: list[Obj], progress: Obj | None, pod_start: datetime | None, *, interval: float, force: bool
) -> list[dict[str, Any]]:
    """The attempts with the trainer's latest report folded in (the newest MAX_ATTEMPTS)."""
    attempts = [dict(a) for a in previous]
    fresh = _attempt_from(progress or {}, pod_start)
    if fresh is None:
        return attempts
    for i, stored in enumerate(attempts):
        if stored.get("startTime") == fresh["startTime"]:
            if _refreshed(stored, fresh, interval=interval, force=force):
                merged = dict(fresh)
                if "podStartTime" in stored and "podStartTime" not in merged:
                    # Seen once, it stays: the pods of an ended attempt leave the index.
                    merged["podStartTime"] = stored["podStartTime"]
                attempts[i] = merged
            return attempts
    if attempts and fresh["startTime"] < str(attempts[-1].get("startTime")):
        return attempts  # a late report of an attempt already dropped: nothing to learn from it
    return [*attempts, fresh][-MAX_ATTEMPTS:]


def _start(attempt: Obj) -> datetime | None:
    return parse_time(attempt.get("podStartTime")) or parse_time(attempt.get("startTime"))


def derive_goodput(
    previous: Obj | None,
    progress: Obj | None,
    *,
    created: datetime | None,
    pod_start: datetime | None,
    phase: str,
    phase_changed: bool,
    completed: datetime | None,
    interval: float,
) -> dict[str, Any] | None:
    """The new ``status.goodput`` (camelCase), or None before the trainer has reported anything."""
    finished = phase in TERMINAL_PHASES
    attempts = fold_attempts(
        list((previous or {}).get("attempts") or []),
        progress,
        pod_start,
        interval=interval,
        force=phase_changed or finished,
    )
    if not attempts or created is None:
        return None
    ends = [parse_time(a.get("endTime")) for a in attempts]
    last_end = max(e for e in ends if e is not None)
    as_of = completed if finished and completed is not None and completed >= last_end else last_end
    lost = {
        "waitingSeconds": _seconds(_start(attempts[0]), created),
        "startupSeconds": 0.0,
        "checkpointSeconds": 0.0,
        "redoneSeconds": 0.0,
        "restartGapSeconds": 0.0,
    }
    redone_steps = 0
    for i, attempt in enumerate(attempts):
        start, end = _start(attempt), parse_time(attempt.get("endTime"))
        first = parse_time(attempt.get("firstStepTime")) or end
        lost["startupSeconds"] += _seconds(first, start)
        saves = float(attempt.get("checkpointSeconds") or 0.0)  # blocked; the writes overlapped steps
        lost["checkpointSeconds"] += saves
        if i + 1 < len(attempts):
            following = attempts[i + 1]
            lost["restartGapSeconds"] += _seconds(_start(following), end)
            done = int(attempt.get("lastStep") or 0) - int(attempt.get("resumedFromStep") or 0)
            again = int(attempt.get("lastStep") or 0) - int(following.get("resumedFromStep") or 0)
            if done > 0 and again > 0:
                stepping = max(0.0, _seconds(end, first) - saves)
                lost["redoneSeconds"] += stepping * min(1.0, again / done)
                redone_steps += min(again, done)
    # After the last report: the final save of a success, else the failure being noticed.
    tail = _seconds(as_of, last_end)
    lost["checkpointSeconds" if phase == Phase.SUCCEEDED else "restartGapSeconds"] += tail
    wall = round(_seconds(as_of, created), 1)
    spent = sum(lost.values())
    if spent > wall:  # the clocks of the trainer's host and the API server disagree by a little
        lost = {key: value * wall / spent for key, value in lost.items()}
    lost = {key: round(value, 1) for key, value in lost.items()}
    productive = round(max(0.0, wall - sum(lost.values())), 1)
    return {
        "ratio": round(productive / wall, 4) if wall > 0 else None,
        "wallSeconds": wall,
        "productiveSeconds": productive,
        "lost": lost,
        "redoneSteps": redone_steps,
        "asOf": _stamp(as_of),
        "attempts": attempts,
    }
