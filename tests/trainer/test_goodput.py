"""A run loses no work to a stop (issue 17): SIGTERM mid-run makes every host save the step it reached
and exit 75; the next start resumes there with the uninterrupted run's losses; a host that was not
signalled joins the save; the compilation cache is written and harms nothing. (A save cut off by
SIGKILL is never resumed from: test_checkpoints.py, in the reshard chain.)"""

from __future__ import annotations

import socket
import tempfile
import threading
from pathlib import Path

import pytest
from runs import full, losses, metrics, write_config
from spmd import Pool, Proc, run_together, run_train

from tpuft_trainer.exit_codes import ExitCode
from tpuft_trainer.stop import Decision, GlooChannel, LocalChannel, StopCoordinator, read_request
from tpuft_trainer.storage import COMPLETE

pytestmark = pytest.mark.trainer

STOPPED = ExitCode.STOPPED_AFTER_CHECKPOINT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sigterm_then_resume() -> tuple[Proc, list[str], Proc, Path]:
    """No saveSteps: the stop's checkpoint is the only one."""
    config, output = write_config({"training": {"save_steps": None}})
    stopped = run_train(config, TPUFT_FAULT_SIGTERM_AT_STEP="5")
    left = sorted(p.name for p in output.iterdir()) if output.exists() else []
    resumed = run_train(config, TPUFT_RESTART_ATTEMPT="1")
    return stopped, left, resumed, output


def two_hosts_one_signalled() -> tuple[list[Proc], list[Path]]:
    """Two processes as the two hosts of one slice, agreeing over their own stop channel (on CPU they
    cannot join into one SPMD program: each trains its own copy on 2 devices). Only host 1 gets
    SIGTERM, at the end of step 4."""
    port = free_port()
    runs, outputs = [], []
    for host in (0, 1):
        config, output = write_config(
            {
                "training": {"save_steps": None},
                "world": {"hosts_per_slice": 2, "chips_per_host": 2},
                "stop": {"coordination_port": port},
            }
        )
        env = {
            "TPU_WORKER_ID": str(host),
            "TPU_WORKER_HOSTNAMES": "127.0.0.1,127.0.0.1",
            "TPUFT_COORDINATOR_ADDRESS": "127.0.0.1",
        }
        if host == 1:
            env["TPUFT_FAULT_SIGTERM_AT_STEP"] = "4"
        runs.append((config, 2, env))
        outputs.append(output)
    return run_together(runs), outputs


def compilation_cache_twice() -> tuple[list[Proc], list[Path], Path, list[int]]:
    cache = Path(tempfile.mkdtemp(prefix="tpuft-xla-cache-"))
    procs, outputs, entries = [], [], []
    for _ in range(2):
        config, output = write_config({"fsdp": {"compilation_cache_path": str(cache)}})
        procs.append(run_train(config))
        outputs.append(output)
        entries.append(sum(1 for p in cache.rglob("*") if p.is_file()))
    return procs, outputs, cache, entries


SPMD_JOBS = {
    "train:full": full,
    "goodput:sigterm": sigterm_then_resume,
    "goodput:two-hosts": two_hosts_one_signalled,
    "goodput:cache": compilation_cache_twice,
}


def test_sigterm_without_save_steps_checkpoints_the_step_reached_and_resume_loses_nothing(
    pool: Pool,
) -> None:
    stopped, left, resumed, output = pool.get("goodput:sigterm")
    reference_proc, reference_output = pool.get("train:full")
    assert reference_proc.returncode == 0, reference_proc.tail()
    assert stopped.returncode == STOPPED, stopped.tail()
    # What the stop left: the step it reached, complete, the record of it and the TensorBoard
    # events so far (no final model).
    assert left == ["checkpoint-5", "prepared", "tensorboard", "tpuft-metrics.json"], left  # prepared: data/
    assert "saved checkpoint-5 in" in stopped.stderr and "stopped at step 5" in stopped.stderr
    assert resumed.returncode == 0, resumed.tail()
    record = metrics(output)
    assert record["resumed_from"] == "checkpoint-5"
    assert record["attempt"]["resumed_from_step"] == 5
    reference = losses(metrics(reference_output))
    got = losses(record)
    assert sorted(got) == [6, 7, 8]  # no step was lost, none was done twice
    assert got == {step: reference[step] for step in (6, 7, 8)}
    assert (output / "model.safetensors").exists()


def test_a_host_that_was_not_signalled_joins_the_save_at_the_same_step(pool: Pool) -> None:
    (host0, host1), (out0, out1) = pool.get("goodput:two-hosts")
    assert host1.returncode == STOPPED, host1.tail()
    assert host0.returncode == STOPPED, host0.tail()  # not signalled, never hung
    rec0, rec1 = metrics(out0), metrics(out1)
    # Host 1's SIGTERM at the end of step 4 reaches both at the next boundary (the channel is lagged
    # by one step so that it never stalls one): both save step 5.
    assert rec0["stopped"]["step"] == rec1["stopped"]["step"] == 5, (rec0["stopped"], rec1["stopped"])
    assert (out0 / "checkpoint-5" / COMPLETE).exists() and (out1 / "checkpoint-5" / COMPLETE).exists()
    assert rec1["stopped"]["signal_to_exit_seconds"] is not None
    assert rec0["stopped"]["signal_to_exit_seconds"] is None
    assert "stop channel: 2 processes joined" in host0.stderr
    # What the channel cost: the wait for the previous boundary's result, over 5 steps.
    assert rec0["stop_channel_wait_seconds"] < 5.0, rec0["stop_channel_wait_seconds"]


def test_the_compilation_cache_is_written_and_a_second_run_is_unharmed(pool: Pool) -> None:
    (first, second), (out1, out2), cache, entries = pool.get("goodput:cache")
    assert first.returncode == 0, first.tail()
    assert second.returncode == 0, second.tail()
    assert entries[0] > 0, f"no cache entries in {cache}"
    assert "XLA compilation cache at" in first.stderr
    # On PJRT CPU the entries cannot be read back (PersistentCacheDeserializeFailure): the second
    # run compiles again and must train exactly as the first.
    assert losses(metrics(out2)) == losses(metrics(out1))


# ---- the agreement, without XLA -------------------------------------------------------------------
def test_checkpoint_requests_are_saved_once_each_and_sigterm_stops(tmp_path: Path) -> None:
    request = tmp_path / "checkpoint-request"
    coordinator = StopCoordinator(LocalChannel(), request, exit_now=lambda code: None)
    coordinator.training_started()
    assert coordinator.at_step_boundary(1).save is False  # no file yet
    request.write_text("")
    assert coordinator.at_step_boundary(2).save is False  # the annotation is absent
    request.write_text("1733083200\n")
    first = coordinator.at_step_boundary(3)
    assert (first.save, first.stop, first.reason) == (True, False, "checkpoint request 1733083200")
    assert coordinator.at_step_boundary(4).save is False  # handled
    request.write_text("not a number")
    assert coordinator.at_step_boundary(5).save is False
    request.write_text("1733090000")
    assert coordinator.at_step_boundary(6).save is True  # a newer request
    coordinator._on_sigterm(15, None)
    decision = coordinator.at_step_boundary(7)
    assert (decision.save, decision.stop, decision.reason, decision.resume_step) == (True, True, "SIGTERM", 7)
    assert coordinator.decided == decision


def signalled() -> StopCoordinator:
    """A coordinator that got SIGTERM once training had started."""
    coordinator = StopCoordinator(LocalChannel(), exit_now=lambda code: None)
    coordinator.training_started()
    coordinator._on_sigterm(15, None)
    assert coordinator.terminated_at is not None
    return coordinator


def test_a_sigterm_while_the_last_save_writes_stops_at_it_without_another_save() -> None:
    in_flight = lambda moment: 4  # noqa: E731  (the save of step 4 was writing when the signal came)
    # At the boundary right after that save (agreed at once): finish it, stop there, one step redone.
    decision = signalled().at_step_boundary(5, immediate=True, last_save=4, in_flight_at=in_flight)
    assert (decision.save, decision.stop, decision.resume_step) == (False, True, 4)
    # Right after its staging: no step lost at all.
    assert signalled().after_save_staged(4) == decision.__class__(stop=True, reason="SIGTERM", resume_step=4)
    # An agreement read a step late would lose two steps: save the step reached instead.
    late = signalled().at_step_boundary(5, immediate=False, last_save=4, in_flight_at=in_flight)
    assert (late.save, late.stop, late.resume_step) == (True, True, 5)
    # A save long done (nothing writing when the signal came): save the step reached.
    done = signalled().at_step_boundary(5, immediate=True, last_save=4, in_flight_at=lambda moment: None)
    assert (done.save, done.stop, done.resume_step) == (True, True, 5)
    # Not signalled: nothing, even right after a save.
    quiet = StopCoordinator(LocalChannel(), exit_now=lambda code: None)
    assert quiet.at_step_boundary(5, immediate=True, last_save=4, in_flight_at=in_flight) == Decision()
    assert quiet.after_save_staged(4) == Decision()


def test_sigterm_before_the_first_step_exits_at_once() -> None:
    codes: list[int] = []
    coordinator = StopCoordinator(LocalChannel(), exit_now=codes.append)
    coordinator._on_sigterm(15, None)
    assert codes == [143]
    assert read_request(None) == 0


def test_the_gloo_channel_agrees_one_boundary_later_on_every_rank() -> None:
    """Two ranks of a real gloo group (threads of this process): a flag raised on rank 1 at boundary
    k is what both ranks read at boundary k+1, so they act at the same step; an immediate round reads
    its own values and any not yet read."""
    port = free_port()
    seen: dict[int, list[tuple[int, int]]] = {}

    def rank(index: int) -> None:
        channel = GlooChannel("127.0.0.1", port, index, 2, timeout_seconds=60)
        values = []
        for boundary in range(4):
            mine = (1, 0) if (index == 1 and boundary == 1) else (0, 7 if index == 0 and boundary == 2 else 0)
            values.append(channel.exchange(mine))
        values.append(channel.exchange_now((0, 9) if index == 1 else (0, 0)))  # reads boundary 3 too
        values.append(channel.exchange_now((2, 0) if index == 0 else (0, 0)))
        values.append(channel.exchange((0, 0)))  # nothing pending: the next lagged round starts afresh
        channel.close()
        seen[index] = values

    threads = [threading.Thread(target=rank, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert seen[0] == seen[1] == [(0, 0), (0, 0), (1, 0), (0, 7), (0, 9), (2, 0), (0, 0)], seen
