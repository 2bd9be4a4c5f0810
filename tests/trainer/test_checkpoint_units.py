"""The checkpoint manager and layout, in process, on plain torch tensors (checkpoint/backend.py's
TorchBackend): real torch.distributed.checkpoint files on a local path and on fsspec URIs, without
XLA. What only a real SPMD run can show (XLA shards, resharding, the Trainer's hooks, SIGTERM) is in
test_checkpoints.py."""

from __future__ import annotations

import errno
import json
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from tpuft_trainer.checkpoint import layout, state
from tpuft_trainer.checkpoint import manager as manager_module
from tpuft_trainer.checkpoint.backend import TorchBackend
from tpuft_trainer.checkpoint.failures import CheckpointReadError, CheckpointWriteError
from tpuft_trainer.checkpoint.manager import CheckpointManager, quiet
from tpuft_trainer.checkpoint.resume import agree_on_resume_point
from tpuft_trainer.errors import ConfigError, PermissionDeniedError
from tpuft_trainer.exit_codes import ExitCode

pytestmark = pytest.mark.trainer


def model_and_optimizer(kind: str = "adamw", dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    from transformers.optimization import Adafactor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(dtype)
    if kind == "adamw":
        optimizer: Any = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:  # as the Trainer configures it
        optimizer = Adafactor(model.parameters(), lr=1e-2, scale_parameter=False, relative_step=False)
    return model, optimizer


def train_step(model: Any, optimizer: Any, seed: int) -> float:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 8, generator=generator).to(next(model.parameters()).dtype)
    loss = model(x).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def checkpoint_state(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    names = state.parameter_names(model)
    tensors, extras = state.optimizer_state(optimizer, names)
    return state.stateful_tensors(state.trainable_state(model), tensors), extras


def save(
    manager: CheckpointManager, step: int, model: Any, optimizer: Any, *, blocking: bool = False
) -> None:
    tensors, extras = checkpoint_state(model, optimizer)
    small = {name: b"x" for name in (layout.TRAINER_STATE, layout.SCHEDULER, layout.RNG_STATE)} | {
        layout.OPTIMIZER_EXTRAS: state.dumps_extras(extras).encode()
    }
    manager.save(step, tensors, lambda: small, reason="periodic", blocking=blocking)


def restore(manager: CheckpointManager, found: layout.Found, model: Any, optimizer: Any) -> None:
    names = state.parameter_names(model)
    manager.backend.prime_optimizer(optimizer)
    tensors, _ = checkpoint_state(model, optimizer)
    extras = manager.load(found, tensors)
    state.restore_extras(optimizer, names, extras)


# ---- saving and restoring ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["adamw", "adafactor"])
def test_resume_continues_exactly_as_if_never_stopped(tmp_path: Path, kind: str) -> None:
    model, optimizer = model_and_optimizer(kind)
    manager = CheckpointManager(layout.Store(str(tmp_path)), TorchBackend())
    for step in (1, 2):
        train_step(model, optimizer, step)
    save(manager, 2, model, optimizer)
    manager.wait()
    reference = [train_step(model, optimizer, step) for step in (3, 4)]

    again, again_optimizer = model_and_optimizer(kind)  # a new process: fresh weights, no state
    point = layout.resume_point(layout.Store(str(tmp_path)))
    assert point.checkpoint is not None and point.checkpoint.name == "checkpoint-2" and not point.skipped
    restore(
        CheckpointManager(layout.Store(str(tmp_path)), TorchBackend()),
        point.checkpoint,
        again,
        again_optimizer,
    )
    assert [train_step(again, again_optimizer, step) for step in (3, 4)] == reference
    if kind == "adafactor":  # trap A: the int step is restored, not left at what priming set
        assert {s["step"] for s in again_optimizer.state.values()} == {4}


def test_adafactor_state_keeps_its_float32_factors_for_bfloat16_weights(tmp_path: Path) -> None:
    """Trap B: optimizer.load_state_dict casts the state to each parameter's dtype; the manager loads
    in place and never calls it."""
    model, optimizer = model_and_optimizer("adafactor", torch.bfloat16)
    train_step(model, optimizer, 1)
    factors = {
        k: v.clone() for s in optimizer.state.values() for k, v in s.items() if isinstance(v, torch.Tensor)
    }
    assert {v.dtype for v in factors.values()} == {torch.float32}
    manager = CheckpointManager(layout.Store(str(tmp_path)), TorchBackend())
    save(manager, 1, model, optimizer, blocking=True)
    again, again_optimizer = model_and_optimizer("adafactor", torch.bfloat16)
    restore(manager, layout.inspect(manager.store, "checkpoint-1"), again, again_optimizer)
    loaded = {
        k: v for s in again_optimizer.state.values() for k, v in s.items() if isinstance(v, torch.Tensor)
    }
    assert {v.dtype for v in loaded.values()} == {torch.float32}
    assert all(torch.equal(loaded[k], factors[k]) for k in factors)


def test_a_periodic_save_writes_what_was_staged_while_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = model_and_optimizer()
    train_step(model, optimizer, 1)
    manager = CheckpointManager(layout.Store(str(tmp_path)), TorchBackend())
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    original = manager_module._dcp_save
    monkeypatch.setattr(  # slow storage: every write takes a second more
        manager_module, "_dcp_save", lambda *args: (time.sleep(1.0), original(*args))
    )
    called = time.monotonic()
    save(manager, 1, model, optimizer)  # returns after the staging copy
    returned = time.monotonic() - called
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)  # the next steps change the weights in place while it writes
    records = manager.wait()
    assert [(r.step, r.reason) for r in records] == [(1, "periodic")]
    record = records[0]
    # Training waited for the staging copy only, and the record says so; the write took its second.
    assert returned < 0.5 and record.blocked_seconds < 0.5, (returned, record)
    assert record.write_seconds >= 1.0, record
    written: dict[str, Any] = {"model": {k: torch.zeros_like(v) for k, v in at_save.items()}}
    import torch.distributed.checkpoint as dcp

    with quiet():
        dcp.load(written, checkpoint_id=str(tmp_path / "checkpoint-1"))
    assert all(torch.equal(written["model"][k], at_save[k]) for k in at_save)


class DeviceRunningAhead(TorchBackend):
    """Plain torch whose device is still computing the steps dispatched before the save (as an XLA
    device is while the training loop runs ahead of it): waiting for it takes ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def wait_for_device(self) -> None:
        time.sleep(self.seconds)


@pytest.mark.parametrize("blocking", [False, True], ids=["periodic", "synchronous"])
def test_a_save_times_the_device_wait_apart_from_the_staging_and_what_training_lost(
    tmp_path: Path, blocking: bool
) -> None:
    """The wait for the device is not a cost of the save (the device computes the steps meanwhile):
    it is reported on its own, and neither in the staging nor in what training lost (blocked)."""
    device_seconds = 0.5
    model, optimizer = model_and_optimizer()
    train_step(model, optimizer, 1)
    manager = CheckpointManager(layout.Store(str(tmp_path)), DeviceRunningAhead(device_seconds))
    save(manager, 1, model, optimizer, blocking=blocking)
    (record,) = manager.wait()
    assert record.device_wait_seconds >= device_seconds
    assert record.staging_seconds < device_seconds / 2  # a copy of a few hundred floats
    assert record.blocked_seconds < device_seconds / 2 + (record.write_seconds if blocking else 0.0)
    assert record.staging_seconds <= record.blocked_seconds
    # All of it is in the save's seconds: a stop's save (synchronous) takes the device wait too.
    parts = record.device_wait_seconds + record.blocked_seconds + (0.0 if blocking else record.write_seconds)
    assert record.seconds == pytest.approx(parts, abs=1e-6)
    if blocking:  # a synchronous save costs training its write as well
        assert record.blocked_seconds >= record.staging_seconds + record.write_seconds - 1e-6
    from tpuft_trainer.train import _save_line

    line = _save_line(record)
    assert (
        f"training lost {record.blocked_seconds:.2f} s (the staging copy {record.staging_seconds:.2f} s"
        in line
    )
    assert f"the device finished the steps dispatched ahead in {record.device_wait_seconds:.2f} s" in line


def test_one_save_in_flight_a_new_one_waits_for_it(tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer()
    train_step(model, optimizer, 1)
    manager = CheckpointManager(layout.Store(str(tmp_path)), TorchBackend())
    order: list[str] = []
    original = manager._write

    def slow_write(save: Any) -> None:
        order.append(f"start {save.step}")
        time.sleep(0.3)
        original(save)
        order.append(f"end {save.step}")

    manager._write = slow_write  # type: ignore[method-assign]
    save(manager, 1, model, optimizer)
    started = time.monotonic()
    assert manager.in_flight_at(started) == 1
    save(manager, 2, model, optimizer)  # waits for checkpoint-1's write before staging
    assert order[:2] == ["start 1", "end 1"]
    assert [r.step for r in manager.wait()] == [1, 2]
    assert manager.in_flight_at(time.monotonic()) is None
    assert manager.in_flight_at(started) == 1  # what a SIGTERM at that moment would have seen
    assert [layout.inspect(manager.store, f"checkpoint-{s}").resumable for s in (1, 2)] == [True, True]


def test_a_checkpoint_from_another_model_is_a_clear_error(tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer()
    train_step(model, optimizer, 1)
    manager = CheckpointManager(layout.Store(str(tmp_path)), TorchBackend())
    save(manager, 1, model, optimizer, blocking=True)
    other = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with pytest.raises(ConfigError, match="does not fit this run's model and optimizer"):
        restore(
            manager,
            layout.inspect(manager.store, "checkpoint-1"),
            other,
            torch.optim.AdamW(other.parameters()),
        )


# ---- which checkpoint is resumed from ------------------------------------------------------------
def saved_steps(tmp_path: Path, steps: list[int], keep: int | None = None) -> CheckpointManager:
    model, optimizer = model_and_optimizer()
    train_step(model, optimizer, 1)
    manager = CheckpointManager(layout.Store(str(tmp_path)), TorchBackend(), keep=keep)
    for step in steps:
        save(manager, step, model, optimizer)
    manager.wait()
    return manager


def test_a_missing_or_truncated_shard_is_never_resumed_from(tmp_path: Path) -> None:
    saved_steps(tmp_path, [2, 4, 6])
    store = layout.Store(str(tmp_path))
    (tmp_path / "checkpoint-6" / "__0_0.distcp").unlink()
    shard = tmp_path / "checkpoint-4" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    point = layout.resume_point(store)
    assert point.checkpoint is not None and point.checkpoint.name == "checkpoint-2"
    assert [(f.name, f.problem) for f in point.skipped] == [
        ("checkpoint-6", "shard __0_0.distcp is missing"),
        (
            "checkpoint-4",
            f"shard __0_0.distcp is truncated (100 of {shard_length(tmp_path / 'checkpoint-2')} bytes)",
        ),
    ]
    # Before training resumes from 2, nothing newer may look complete: the broken ones lose their marker.
    assert layout.clear_after(store, 2) == [
        "unmarked checkpoint-6: it is not whole, and a new save of step 6 will replace it",
        "unmarked checkpoint-4: it is not whole, and a new save of step 4 will replace it",
    ]
    assert not (tmp_path / "checkpoint-6" / layout.COMPLETE).exists()
    assert (tmp_path / "checkpoint-2" / layout.COMPLETE).exists()


def shard_length(checkpoint: Path) -> int:
    return (checkpoint / "__0_0.distcp").stat().st_size


def test_a_cut_off_save_is_skipped_and_removed_before_saving_again(tmp_path: Path) -> None:
    saved_steps(tmp_path, [2, 4])
    (tmp_path / "checkpoint-4" / layout.COMPLETE).unlink()  # SIGKILL before the marker
    store = layout.Store(str(tmp_path))
    point = layout.resume_point(store)
    assert point.checkpoint is not None and point.checkpoint.step == 2
    assert point.skipped[0].problem == "its save was cut off (no completion marker)"
    assert layout.clear_after(store, 2) == [
        "removed checkpoint-4: its save was cut off (no completion marker)"
    ]
    assert not (tmp_path / "checkpoint-4").exists()


def test_every_checkpoint_says_who_wrote_it(tmp_path: Path) -> None:
    saved_steps(tmp_path, [2])
    written = json.loads((tmp_path / "checkpoint-2" / layout.WRITER).read_text())
    assert written == {"backend": "native", "torch": torch.__version__, "format": layout.FORMAT_VERSION}


def _unreadable_index(checkpoint: Path, writer: dict[str, Any] | None) -> None:
    """An index this process cannot parse (as torch 2.9 could not parse torch 2.15's), and a writer file."""
    (checkpoint / layout.DCP_METADATA).write_bytes(b"\x80\x04not an index this torch reads")
    if writer is None:
        (checkpoint / layout.WRITER).unlink()
    else:
        (checkpoint / layout.WRITER).write_text(json.dumps(writer))


@pytest.mark.parametrize(
    "foreign",
    [
        {"backend": "native", "torch": "2.15.0", "format": 1},  # another torch (the native image's)
        {"backend": "xla", "torch": torch.__version__, "format": 1},  # another backend
        {
            "backend": "native",
            "torch": torch.__version__,
            "format": layout.FORMAT_VERSION + 1,
        },  # newer layout
    ],
)
def test_an_index_only_its_writer_reads_is_refused_not_skipped_nor_cleared(
    tmp_path: Path, foreign: dict[str, Any]
) -> None:
    """Skipping it would resume from checkpoint-2 and clear checkpoint-4 (the newest work): data loss."""
    saved_steps(tmp_path, [2, 4])
    _unreadable_index(tmp_path / "checkpoint-4", foreign)
    store = layout.Store(str(tmp_path))
    with pytest.raises(ConfigError) as refused:
        agree_on_resume_point(store, TorchBackend())
    message = str(refused.value)
    assert refused.value.exit_code == ExitCode.CONFIG_ERROR
    assert (
        f"checkpoint-4 at {tmp_path}/checkpoint-4 was written by the {foreign['backend']} backend" in message
    )
    assert f"torch {foreign['torch']}" in message and f"(native backend, torch {torch.__version__}" in message
    assert "cannot read it: its .metadata cannot be read (" in message
    assert f"spec.backend: {foreign['backend']}" in message and "spec.output.uri" in message
    assert (tmp_path / "checkpoint-4" / layout.COMPLETE).exists()  # not unmarked
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4"]


@pytest.mark.parametrize("writer", ["same", "none", "unreadable"])
def test_an_unreadable_index_of_this_code_or_of_an_earlier_tpuft_is_skipped_as_before(
    tmp_path: Path, writer: str
) -> None:
    """Written by this very backend and torch (so really damaged), without a writer file (a checkpoint
    of an earlier tpuft) or with one that says nothing: skipped, and unmarked before training resumes."""
    saved_steps(tmp_path, [2, 4])
    this = {"backend": "native", "torch": torch.__version__, "format": layout.FORMAT_VERSION}
    _unreadable_index(tmp_path / "checkpoint-4", this if writer != "none" else None)
    if writer == "unreadable":
        (tmp_path / "checkpoint-4" / layout.WRITER).write_text("{")
    agreed = agree_on_resume_point(layout.Store(str(tmp_path)), TorchBackend())
    assert agreed.point.checkpoint is not None and agreed.point.checkpoint.name == "checkpoint-2"
    assert agreed.point.skipped[0].problem is not None
    assert agreed.point.skipped[0].problem.startswith("its .metadata cannot be read (")
    assert agreed.cleared == [
        "unmarked checkpoint-4: it is not whole, and a new save of step 4 will replace it"
    ]


def test_the_full_file_format_of_earlier_versions_is_recognised(tmp_path: Path) -> None:
    saved_steps(tmp_path, [2])
    old = tmp_path / "checkpoint-4"
    old.mkdir()
    for name in ("model.safetensors", "optimizer.pt", "trainer_state.json", layout.COMPLETE):
        (old / name).write_text("x")
    point = layout.resume_point(layout.Store(str(tmp_path)))
    assert (
        point.checkpoint is not None and point.checkpoint.name == "checkpoint-4" and point.checkpoint.legacy
    )


def test_retention_deletes_only_complete_older_checkpoints(tmp_path: Path) -> None:
    saved_steps(tmp_path, [1, 2, 3, 4], keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-4"]
    (tmp_path / "checkpoint-9").mkdir()  # a save in flight (no marker yet): never retired
    (tmp_path / "checkpoint-9" / "__0_0.distcp").write_text("partial")
    assert layout.retire(layout.Store(str(tmp_path)), keep=1, newest=4) == [
        "removed checkpoint-3 (keepCheckpoints: 1)"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-9"]


def test_a_checkpoint_unmarked_at_a_resume_is_removed_once_a_newer_one_is_complete(tmp_path: Path) -> None:
    """clear_after unmarks a broken checkpoint newer than the resume point and keeps its files; when
    this attempt saves other steps (here saveSteps changed from 2 to 3), nothing would ever remove them:
    a leak on every resume of a long run. Retention removes them once a newer checkpoint is complete,
    with or without keepCheckpoints."""
    saved_steps(tmp_path, [2, 4])
    (tmp_path / "checkpoint-4" / "__0_0.distcp").unlink()
    store = layout.Store(str(tmp_path))
    agreed = agree_on_resume_point(store, TorchBackend())
    assert agreed.point.checkpoint is not None and agreed.point.checkpoint.step == 2
    assert agreed.cleared == [
        "unmarked checkpoint-4: it is not whole, and a new save of step 4 will replace it"
    ]
    model, optimizer = model_and_optimizer()
    manager = CheckpointManager(store, TorchBackend())
    save(manager, 3, model, optimizer)
    manager.wait()
    assert (tmp_path / "checkpoint-4").exists()  # newer than every complete checkpoint: left alone
    save(manager, 6, model, optimizer)
    manager.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3", "checkpoint-6"]


# ---- storage that fails --------------------------------------------------------------------------
class FailingFileSystem(MemoryFileSystem):
    """An in-memory filesystem that, once ``error`` is set, raises it on opening a file whose name
    ends with ``suffix`` for ``mode`` ("r" or "w"), ``times`` times (-1: every time)."""

    protocol = "failingfs"
    store: dict[str, Any] = {}  # its own files (MemoryFileSystem's class attributes)
    pseudo_dirs = [""]
    error: BaseException | None = None
    suffix = ".distcp"
    mode = "w"
    times = -1

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        failing = type(self)
        armed = failing.error is not None and failing.times != 0
        if armed and failing.mode in mode and path.endswith(failing.suffix):
            failing.times -= 1
            raise failing.error
        return super()._open(path, mode, **kwargs)

    @classmethod
    def reset(cls) -> None:
        """No files, no failures."""
        fsspec.register_implementation(cls.protocol, cls, clobber=True)
        cls.store.clear()
        cls.pseudo_dirs[:] = [""]
        cls.heal()

    @classmethod
    def heal(cls) -> None:
        cls.error, cls.suffix, cls.mode, cls.times = None, ".distcp", "w", -1

    @classmethod
    def fail(cls, error: BaseException, suffix: str, mode: str, times: int = -1) -> None:
        cls.error, cls.suffix, cls.mode, cls.times = error, suffix, mode, times


def http_error(code: int) -> Exception:
    """What gcsfs raises once its own retries of a request are exhausted (gcsfs is in the trainer's
    requirements; the classification reads only the error's ``code``)."""
    from gcsfs.retry import HttpError

    return HttpError({"code": code, "message": f"HTTP {code}"})


def test_a_full_disk_fails_the_run_clearly_and_keeps_the_previous_checkpoint() -> None:
    FailingFileSystem.reset()
    model, optimizer = model_and_optimizer()
    train_step(model, optimizer, 1)
    store = layout.Store("failingfs://bucket/run")
    manager = CheckpointManager(store, TorchBackend(), keep=1)
    save(manager, 2, model, optimizer)
    manager.wait()
    FailingFileSystem.fail(OSError(errno.ENOSPC, "No space left on device"), ".distcp", "w")
    save(manager, 4, model, optimizer)  # the write fails in the background...
    deadline = time.monotonic() + 30
    while manager.in_flight_at(time.monotonic()) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(CheckpointWriteError) as failure:  # ...and the next step boundary says so
        manager.poll()
    message = str(failure.value)
    assert "checkpoint-4 could not be written to failingfs://bucket/run/checkpoint-4" in message
    assert "No space left on device" in message and "the output's storage is full" in message
    assert "checkpoint-2 is the newest complete one and is kept" in message
    assert failure.value.exit_code == 1  # infrastructure: restarted from checkpoint-2
    FailingFileSystem.heal()
    point = layout.resume_point(store)
    assert point.checkpoint is not None and point.checkpoint.name == "checkpoint-2"
    assert not store.exists("checkpoint-4")  # its partial directory removed


# What storage raises -> what the run raises and exits with, the same for reading and for writing.
STORAGE_ERRORS = {
    "exhausted 503": (lambda: http_error(503), "storage", 1),
    "exhausted 429": (lambda: http_error(429), "storage", 1),
    "I/O error": (lambda: OSError(errno.EIO, "Input/output error"), "storage", 1),
    "permission": (lambda: PermissionError(errno.EACCES, "Permission denied"), "permission", 77),
    "HTTP 403": (lambda: http_error(403), "permission", 77),
}


@pytest.mark.parametrize("name", sorted(STORAGE_ERRORS))
def test_a_write_error_is_classified_as_a_read_error_is(name: str) -> None:
    make_error, kind, exit_code = STORAGE_ERRORS[name]
    FailingFileSystem.reset()
    model, optimizer = model_and_optimizer()
    manager = CheckpointManager(layout.Store("failingfs://bucket/run"), TorchBackend())
    train_step(model, optimizer, 1)

    FailingFileSystem.fail(make_error(), ".distcp", "w")
    with pytest.raises((CheckpointWriteError, PermissionDeniedError)) as writing:
        save(manager, 2, model, optimizer, blocking=True)
    assert type(writing.value) is (CheckpointWriteError if kind == "storage" else PermissionDeniedError)
    assert writing.value.exit_code == exit_code, writing.value
    assert "checkpoint-2 could not be written to failingfs://bucket/run/checkpoint-2" in str(writing.value)

    FailingFileSystem.heal()
    save(manager, 2, model, optimizer, blocking=True)
    FailingFileSystem.fail(make_error(), ".distcp", "r")
    found = layout.inspect(manager.store, "checkpoint-2")  # (reads no shard)
    assert found.resumable, found
    with pytest.raises((CheckpointReadError, PermissionDeniedError)) as reading:
        restore(manager, found, *model_and_optimizer())
    assert type(reading.value) is (CheckpointReadError if kind == "storage" else PermissionDeniedError)
    assert reading.value.exit_code == exit_code, reading.value
    assert "checkpoint-2 at failingfs://bucket/run/checkpoint-2 could not be read" in str(reading.value)


def test_a_transient_error_reading_an_index_is_retried_before_anything_is_concluded() -> None:
    FailingFileSystem.reset()
    saved = saved_steps_at("failingfs://bucket/run", [2, 4])
    store = saved.store
    FailingFileSystem.fail(http_error(503), f"checkpoint-4/{layout.DCP_METADATA}", "r", times=2)
    point = layout.resume_point(store, backoff_seconds=0.01)
    assert point.checkpoint is not None and point.checkpoint.step == 4 and not point.skipped
    assert FailingFileSystem.times == 0  # failed twice, read the third time
    # Storage that stays down ends the start (restarted later), never skips a checkpoint: skipping
    # would unmark it, though nothing is wrong with it.
    FailingFileSystem.fail(http_error(503), f"checkpoint-4/{layout.DCP_METADATA}", "r")
    with pytest.raises(CheckpointReadError) as down:
        layout.resume_point(store, backoff_seconds=0.01)
    assert down.value.exit_code == 1
    assert f"failingfs://bucket/run/checkpoint-4/{layout.DCP_METADATA} could not be read" in str(down.value)
    FailingFileSystem.fail(PermissionError(errno.EACCES, "Permission denied"), layout.DCP_METADATA, "r")
    with pytest.raises(PermissionDeniedError) as refused:
        layout.resume_point(store, backoff_seconds=0.01)
    assert refused.value.exit_code == ExitCode.PERMISSION_DENIED
    # An index storage returned but that is not one: that checkpoint is skipped, the one before it used.
    FailingFileSystem.heal()
    with store.fs.open(store.path("checkpoint-4", layout.DCP_METADATA), "wb") as f:
        f.write(b"not a pickle")
    point = layout.resume_point(store, backoff_seconds=0.01)
    assert point.checkpoint is not None and point.checkpoint.step == 2
    assert [f.name for f in point.skipped] == ["checkpoint-4"]
    assert f"its {layout.DCP_METADATA} cannot be read" in str(point.skipped[0].problem)


def saved_steps_at(location: str, steps: list[int]) -> CheckpointManager:
    model, optimizer = model_and_optimizer()
    train_step(model, optimizer, 1)
    manager = CheckpointManager(layout.Store(location), TorchBackend())
    for step in steps:
        save(manager, step, model, optimizer, blocking=True)
    return manager


def test_checkpoints_on_a_uri_round_trip(tmp_path: Path) -> None:
    """Through fsspec (the gs:// code path: DCP's fsspec reader and writer, fetched small files)."""
    model, optimizer = model_and_optimizer()
    train_step(model, optimizer, 1)
    store = layout.Store("memory://bucket/run")
    assert not store.is_local and layout.Store(f"file://{tmp_path}").is_local
    manager = CheckpointManager(store, TorchBackend())
    save(manager, 3, model, optimizer)
    manager.wait()
    found = layout.inspect(layout.Store("memory://bucket/run"), "checkpoint-3")
    assert found.resumable, found
    again, again_optimizer = model_and_optimizer()
    restore(manager, found, again, again_optimizer)
    assert all(
        torch.equal(a, b)
        for a, b in zip(again.state_dict().values(), model.state_dict().values(), strict=True)
    )
    fetched = manager.fetch_small_files(found, str(tmp_path / "local"))
    assert json.loads(Path(fetched, layout.OPTIMIZER_EXTRAS).read_text())["param_groups"]


# ---- the optimizer's state by parameter name -----------------------------------------------------
def test_optimizer_state_is_keyed_by_parameter_name_and_groups_must_match() -> None:
    model, optimizer = model_and_optimizer("adafactor")
    train_step(model, optimizer, 1)
    names = state.parameter_names(model)
    tensors, extras = state.optimizer_state(optimizer, names)
    assert "0.weight.exp_avg_sq_row" in tensors and "2.bias.exp_avg_sq" in tensors
    assert extras["scalars"]["0.weight"]["step"] == 1
    assert extras["param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    restored = json.loads(state.dumps_extras(extras))
    assert restored["param_groups"][0]["eps"] == {"__tuple__": [1e-30, 1e-3]}
    state.restore_extras(optimizer, names, restored)
    assert optimizer.param_groups[0]["eps"] == (1e-30, 1e-3)
    restored["param_groups"][0]["params"] = ["0.weight"]
    with pytest.raises(ConfigError, match="holds other parameters"):
        state.restore_extras(optimizer, names, restored)


def test_wrapper_prefixes_are_stripped_and_tied_weights_saved_once() -> None:
    assert state.hf_name("_orig_module.model.layers.0._orig_module.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )
    embedding = torch.nn.Embedding(4, 2)
    head = torch.nn.Linear(2, 4, bias=False)
    head.weight = embedding.weight
    frozen = torch.nn.Linear(2, 2)
    frozen.requires_grad_(False)
    model = torch.nn.ModuleDict({"embed": embedding, "head": head, "frozen": frozen})
    assert sorted(state.trainable_state(model)) == ["embed.weight"]


def test_a_stop_sees_the_save_that_was_writing_when_the_signal_came(tmp_path: Path) -> None:
    """in_flight_at, which the stop agreement reads: the save's window, from its start to its marker."""
    model, optimizer = model_and_optimizer()
    train_step(model, optimizer, 1)
    manager = CheckpointManager(layout.Store(str(tmp_path)), TorchBackend())
    release = threading.Event()
    original = manager._write
    manager._write = lambda save: (release.wait(10), original(save))  # type: ignore[method-assign,func-returns-value]
    before = time.monotonic()
    save(manager, 5, model, optimizer)
    during = time.monotonic()
    release.set()
    manager.wait()
    assert manager.in_flight_at(before - 1) is None
    assert manager.in_flight_at(during) == 5
    assert manager.in_flight_at(time.monotonic()) is None


# ---- several processes ----------------------------------------------------------------------------
def run_two_ranks(mode: str, directory: Path) -> list[Any]:
    """Runs two_ranks.py's ``mode`` as ranks 0 and 1 of a gloo group; what each wrote."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).with_name("two_ranks.py")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(script.parent), os.environ.get("PYTHONPATH", "")]),
    }
    ranks = [
        subprocess.Popen([sys.executable, str(script), mode, str(r), str(port), str(directory)], env=env)
        for r in (0, 1)
    ]
    assert [p.wait(timeout=300) for p in ranks] == [0, 0]
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_every_process_resumes_from_the_checkpoint_process_zero_chose(tmp_path: Path) -> None:
    """One host's read of the newest index fails (rank 0's once; rank 1's every time): both still
    resume from checkpoint-4, and it keeps its marker. Before, each host chose for itself (rank 1
    skipped checkpoint-4 for checkpoint-2: a model assembled from two steps), and rank 0 unmarked every
    checkpoint newer than its own choice while the others loaded it."""
    import two_ranks

    for case in two_ranks.RESUME_CASES:
        saved_steps(tmp_path / case, [2, 4])
    results = run_two_ranks("resume", tmp_path)
    for case in two_ranks.RESUME_CASES:
        assert [r[case] for r in results] == [{"step": 4, "skipped": []}] * 2, (case, results)
        store = layout.Store(str(tmp_path / case))
        assert [layout.inspect(store, f"checkpoint-{s}").resumable for s in (2, 4)] == [True, True], case


def test_two_processes_each_write_only_what_they_hold(tmp_path: Path) -> None:
    """Two real processes over a gloo group, as two hosts (torch_xla's CPU client cannot join
    processes into one SPMD program, plain torch's DTensors can): each writes its own chunks of the
    checkpoint and its share of the exported files; rank 0 marks the checkpoint once both are done."""
    import two_ranks
    from safetensors.torch import load_file

    results = run_two_ranks("save", tmp_path)
    assert results[0]["records"] == results[1]["records"] == [[3, "periodic"]]
    run = tmp_path / "run"
    shards = sorted(p.name for p in (run / "checkpoint-3").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # one file per process: its own chunks
    found = layout.inspect(layout.Store(str(run)), "checkpoint-3")
    assert found.resumable, found
    full = two_ranks.full_tensors()
    loaded: dict[str, Any] = {"model": {name: torch.zeros(t.shape) for name, t in full.items()}}
    import torch.distributed.checkpoint as dcp

    with quiet():
        dcp.load(loaded, checkpoint_id=str(run / "checkpoint-3"))
    assert all(torch.equal(loaded["model"][n], full[n]) for n in full)
    # The export: three groups of <= 150 bytes, files 1 and 3 by rank 0, file 2 by rank 1, one index.
    files = results[0]["exported"]
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert results[0]["written_here"] == [files[0], files[2]] and results[1]["written_here"] == [files[1]]
    index = json.loads((run / "model" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(full)
    exported = {k: v for f in files for k, v in load_file(run / "model" / f).items()}
    assert all(torch.equal(exported[n], full[n]) for n in full)
