"""Stopping without losing work: SIGTERM, and the operator's checkpoint requests, become a checkpoint
at a step boundary that every process of the run agrees on.

Why agreement: saving under SPMD is a collective (every process gathers its shards), so all hosts
must decide to save at the *same* step. Only one VM may be signalled (a Spot reclaim, one node
drained), and the operator's request file (a downward-API view of a pod annotation) changes on each
host whenever its kubelet refreshes it. So at every step boundary each process contributes
``(terminated, newest checkpoint request seen)`` to an all-reduce with MAX, and all act on the
result together.

The all-reduce is lagged by one step: the values contributed at boundary k are read at boundary
k+1, so the exchange runs in the background during a training step and never stalls one. Every
process makes the same calls in the same order (they run the same steps), so every process reads
the same agreed values at the same boundary: a host that was not signalled joins the save at that
boundary, one step after the signal at most. One process alone (one host) needs no channel;
several use a gloo process group of their own over TCP to the first host (`GlooChannel`), apart
from XLA's collectives and from the group checkpoints are written over.

Periodic saves write in the background (checkpoint/manager.py), so a stop may come while one is
writing. Then the quickest safe stop is to finish that write and end there, rather than train on
and save again: right after a periodic save is staged, and at the boundary after it, the
agreement is immediate (a blocking round, where every process is anyway), and a process signalled
while that save was writing asks to stop at it (``STOP_AT_SAVE_IN_FLIGHT``: the step just trained,
at most one, is redone after the restart); any other SIGTERM asks for a save of the step reached
(``SAVE_AND_STOP``, which wins the MAX: no process ever stops short of a save another one needs).

A SIGTERM before the first step of this process has nothing new to save: the process exits at
once with 143 (the shell's code for SIGTERM), which the operator counts as an ordinary restart.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

from tpuft_trainer.pod_contract import COORDINATOR_ADDRESS_ENV

log = logging.getLogger(__name__)

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM


class Channel(Protocol):
    """Element-wise MAX of small integer vectors over every process of the run."""

    def exchange(self, values: tuple[int, int]) -> tuple[int, int]:
        """Contribute ``values``; return the agreed values of the *previous* call (a lagged
        channel) or of this one (an immediate one)."""
        ...

    def exchange_now(self, values: tuple[int, int]) -> tuple[int, int]:
        """Contribute ``values`` and return the agreed values of this call, and of a previous call
        not yet read (element-wise MAX of both): a blocking round, for the points where waiting one
        step would cost work (right after a periodic save was staged)."""
        ...

    def close(self, wait: bool = True) -> None: ...


class LocalChannel:
    """One process: its own values are the agreed ones, at once."""

    def exchange(self, values: tuple[int, int]) -> tuple[int, int]:
        return values

    def exchange_now(self, values: tuple[int, int]) -> tuple[int, int]:
        return values

    def close(self, wait: bool = True) -> None:
        pass


class GlooChannel:
    """A gloo process group of the run's processes, rendezvous at ``host:port`` (the first host).

    ``exchange`` starts an asynchronous all-reduce of this boundary's values and returns the result
    of the previous boundary's, waiting for it if needed (it had a whole step to finish).
    """

    def __init__(self, host: str, port: int, rank: int, size: int, timeout_seconds: float) -> None:
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_seconds)
        # A TCPStore hosted by rank 0 is the rendezvous; the group talks over its own connections.
        self._store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timeout)
        # Any: torch's stubs omit the collectives a backend object has at run time.
        self._group: Any = dist.ProcessGroupGloo(self._store, rank, size, timeout)
        self._options = dist.AllreduceOptions()
        self._options.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        self._pending: tuple[Any, Any] | None = None  # (work, tensor) of the previous boundary
        self.wait_seconds = 0.0  # time spent waiting for results (what the channel costs a step)

    @classmethod
    def over_group(cls, group: Any) -> GlooChannel:
        """The channel over an existing gloo process group (the native backend's processes already
        share a store: torch.distributed's ``new_group(backend="gloo")``), rather than one of its own."""
        import torch.distributed as dist

        channel = cls.__new__(cls)
        channel._group = group
        channel._options = dist.AllreduceOptions()
        channel._options.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        channel._pending = None
        channel.wait_seconds = 0.0
        return channel

    def exchange(self, values: tuple[int, int]) -> tuple[int, int]:
        import torch

        agreed = self._read_pending()
        tensor = torch.tensor(values, dtype=torch.int64)
        self._pending = (self._group.allreduce([tensor], self._options), tensor)
        return agreed

    def exchange_now(self, values: tuple[int, int]) -> tuple[int, int]:
        import torch

        earlier = self._read_pending()
        tensor = torch.tensor(values, dtype=torch.int64)
        started = time.perf_counter()
        self._group.allreduce([tensor], self._options).wait()
        self.wait_seconds += time.perf_counter() - started
        return (max(earlier[0], int(tensor[0])), max(earlier[1], int(tensor[1])))

    def _read_pending(self) -> tuple[int, int]:
        if self._pending is None:
            return (0, 0)
        work, tensor = self._pending
        self._pending = None
        started = time.perf_counter()
        work.wait()
        self.wait_seconds += time.perf_counter() - started
        return (int(tensor[0]), int(tensor[1]))

    def close(self, wait: bool = True) -> None:
        """``wait``: for the last exchange, which completes when every process made the same calls
        (training ended normally). A process leaving on an error must not wait for peers that may
        never make that call (up to the timeout): the restart is what they need."""
        if self._pending is not None and wait:
            try:
                self._pending[0].wait()
            except Exception as error:  # a peer already gone: nothing to agree on any more
                log.debug("stop channel: last exchange did not complete: %s", error)
        self._pending = None


@dataclass(frozen=True)
class Decision:
    """What the run does at a step boundary. A stop without a save ends at ``resume_step``, the
    checkpoint that was being written when the signal came (its write is finished first)."""

    save: bool = False
    stop: bool = False
    reason: str = ""  # "SIGTERM" or "checkpoint request <n>" (for logs and status)
    resume_step: int | None = None  # a stop: the step the next start resumes from


# What a process contributes for SIGTERM (the channel agrees on the MAX, so "save" wins over "no save").
NOT_TERMINATED, STOP_AT_SAVE_IN_FLIGHT, SAVE_AND_STOP = 0, 1, 2


def slow_save_advice(save_seconds: float, grace_seconds: float, *, spot: bool) -> str:
    """What a user should hear when a stop's save took more than half the grace it had.

    Off Spot the pods' terminationGracePeriodSeconds is the grace: raising it is the fix. On Spot it is
    not: GKE gives ordinary pods ~15 s of a reclaimed VM's 30 s notice whatever that field says
    (more only on a node pool whose node system config raises the shutdown time, which
    spec.tpu.spotGracePeriodSeconds then declares), so the fixes are a smaller loss when the save is
    cut off (save more often) or a faster save (a smaller share of the state per host)."""
    if not spot:
        return (
            f"the stop's save took {save_seconds:.1f} s, more than half the {grace_seconds:.0f} s grace period: "
            "raise spec.terminationGracePeriodSeconds or the next stop may be cut off"
        )
    return (
        f"the stop's save took {save_seconds:.1f} s, more than half the {grace_seconds:.0f} s a Spot reclaim "
        "gives the pods (GKE: ~15 s of the VM's 30 s notice for ordinary pods, whatever "
        "spec.terminationGracePeriodSeconds says): a reclaim's save is likely cut off, and the steps since "
        "the last complete checkpoint are trained again. Save more often (a smaller training.saveSteps) or "
        "make each host's share of the checkpoint smaller (more hosts, LoRA, adafactor); set "
        "spec.tpu.spotGracePeriodSeconds only for a node pool whose node system config gives more "
        "shutdown time"
    )


def read_request(path: Path | None) -> int:
    """The checkpoint request in the operator's file: a positive integer (the request's number, e.g.
    the maintenance time in Unix seconds), or 0 when there is none or the file is empty."""
    if path is None:
        return 0
    try:
        text = path.read_text().strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0


class StopCoordinator:
    """This process's view of stop signals and requests, and the agreement over all processes.

    ``install`` takes SIGTERM; ``training_started`` marks the point after which a SIGTERM means
    "checkpoint and stop" rather than "exit now"; ``at_step_boundary`` is called once per optimizer
    step by every process and says whether to save and whether to stop.
    """

    def __init__(
        self,
        channel: Channel,
        request_file: Path | None = None,
        *,
        exit_now: Callable[[int], None] = os._exit,
    ) -> None:
        self.channel = channel
        self.request_file = request_file
        self._exit_now = exit_now
        self._terminated = threading.Event()
        self._training = False
        # Starts at 0 on every process and moves only with agreed values: a decision must be the same
        # everywhere, and a host that read the file before the others must not skip a save they make.
        self._handled_request = 0
        self.terminated_at: float | None = None  # monotonic time of the SIGTERM, if any
        self.decided: Decision | None = None  # the stop decision, once made

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self._terminated.is_set():
            return  # one stop is enough; the grace period keeps running
        self.terminated_at = time.monotonic()
        self._terminated.set()
        if not self._training:
            log.warning("SIGTERM before the first training step: nothing new to save, exiting now")
            logging.shutdown()
            self._exit_now(SIGTERM_EXIT_CODE)
            return
        log.warning("SIGTERM: checkpointing at the next step boundary every host agrees on, then stopping")

    def training_started(self) -> None:
        self._training = True

    @property
    def terminated(self) -> bool:
        return self._terminated.is_set()

    def at_step_boundary(
        self,
        step: int,
        *,
        immediate: bool = False,
        last_save: int | None = None,
        in_flight_at: Callable[[float], int | None] = lambda moment: None,
    ) -> Decision:
        """The decision at the end of ``step``, the same on every process. ``immediate``: agree now
        (a blocking round) rather than one step later; every process must pass the same value (the
        run's saves, the same everywhere, decide it). ``last_save``: the newest checkpoint step
        saved or being saved; ``in_flight_at(t)``: the step of the save that was writing at
        monotonic time t, if any."""
        request = read_request(self.request_file)
        local = (
            self._termination(step, immediate, in_flight_at),
            request if request > self._handled_request else 0,
        )
        code, newest_request = (self.channel.exchange_now if immediate else self.channel.exchange)(local)
        if code:
            if code == STOP_AT_SAVE_IN_FLIGHT and last_save is not None:
                self.decided = Decision(stop=True, reason="SIGTERM", resume_step=last_save)
            else:
                self.decided = Decision(save=True, stop=True, reason="SIGTERM", resume_step=step)
            return self.decided
        if newest_request > self._handled_request:
            self._handled_request = newest_request
            return Decision(save=True, reason=f"checkpoint request {newest_request}")
        return Decision()

    def after_save_staged(self, step: int) -> Decision:
        """Right after the staging of a periodic save of ``step`` (a blocking round on every process):
        a SIGTERM that came meanwhile stops the run at this very save, with no step lost; a checkpoint
        request that came meanwhile is served by it."""
        request = read_request(self.request_file)
        terminated = SAVE_AND_STOP if self._terminated.is_set() else NOT_TERMINATED
        code, newest_request = self.channel.exchange_now(
            (terminated, request if request > self._handled_request else 0)
        )
        self._handled_request = max(self._handled_request, newest_request)
        if code:
            self.decided = Decision(stop=True, reason="SIGTERM", resume_step=step)
            return self.decided
        return Decision()

    def _termination(self, step: int, immediate: bool, in_flight_at: Callable[[float], int | None]) -> int:
        if not self._terminated.is_set() or self.terminated_at is None:
            return NOT_TERMINATED
        writing = in_flight_at(self.terminated_at)
        # Stopping at the save that was writing loses the steps after it: at most the one just done,
        # and only when the agreement is immediate (a lagged one is read a step later).
        if immediate and writing is not None and writing >= step - 1:
            return STOP_AT_SAVE_IN_FLIGHT
        return SAVE_AND_STOP

    def close(self, wait: bool = True) -> None:
        self.channel.close(wait)


def open_channel(
    coordinator: str | None, port: int, rank: int, size: int, timeout_seconds: float = 300.0
) -> Channel:
    """The channel for ``size`` processes: local for one, gloo over ``coordinator:port`` otherwise."""
    if size <= 1:
        return LocalChannel()
    if not coordinator:
        from tpuft_trainer.errors import WorldError

        raise WorldError(
            f"this job has {size} processes but {COORDINATOR_ADDRESS_ENV} is unset: the hosts could "
            "not agree on a step to checkpoint at when one of them is stopped"
        )
    started = time.monotonic()
    channel = GlooChannel(coordinator, port, rank, size, timeout_seconds)
    log.info(
        "stop channel: %d processes joined over %s:%d in %.1f s",
        size,
        coordinator,
        port,
        time.monotonic() - started,
    )
    return channel
