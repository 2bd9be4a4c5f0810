"""Sharded checkpoints through `tpuft train` on real SPMD (PJRT CPU devices): resuming on another
device count and mesh (DCP reshards), a checkpoint with replicated chunks that is whole (trap C), a
shard lost after its checkpoint completed (skipped, reported, re-saved), a save cut off by SIGKILL
(never resumed from, removed), a SIGTERM while a periodic
save is writing (that save finished, no second one), and the model loaded slice by slice onto the
mesh giving from_pretrained's logits. The manager's own behaviour on plain torch is in
test_checkpoint_units.py."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from runs import checkpoint_lines, full, logged_losses, losses, metrics, write_config
from spmd import Pool, Proc, run_case, run_train

from tpuft_trainer.checkpoint import layout
from tpuft_trainer.exit_codes import ExitCode

pytestmark = pytest.mark.trainer


def variant(config: Path, name: str, *, per_device_batch_size: int | None = None, **mesh: int) -> Path:
    """The same run (same output) under another mesh or per-device batch."""
    body = yaml.safe_load(config.read_text())
    if mesh:
        body.setdefault("fsdp", {})["mesh"] = mesh
    if per_device_batch_size:
        body["training"]["per_device_batch_size"] = per_device_batch_size
    path = config.with_name(name)
    path.write_text(yaml.safe_dump(body))
    return path


def reshard_chain() -> tuple[list[Proc], Path, list[str]]:
    """One run in three attempts, with the same global batch of 8 rows: 4 devices (fsdp=4) killed
    after step 5; checkpoint-4's shard then lost; 2 devices (fsdp=2, 4 rows each) resuming from
    checkpoint-2, SIGKILLed while checkpoint-6's files are written (before its marker: a save cut
    off); 4 devices as data=2 x fsdp=2 (every chunk on two devices) resuming from the checkpoint-4
    the 2-device attempt wrote, to the end."""
    config, output = write_config({"training": {"save_steps": 2}})
    first = run_train(config, 4, TPUFT_FAULT_KILL_AT_STEP="5", TPUFT_RESTART_ATTEMPT="0")
    left_after_first = sorted(p.name for p in output.glob("checkpoint-*"))
    (output / "checkpoint-4" / "__0_0.distcp").unlink()
    on_two = variant(config, "two.yaml", per_device_batch_size=4)
    second = run_train(on_two, 2, TPUFT_FAULT_KILL_IN_SAVE_AT_STEP="6", TPUFT_RESTART_ATTEMPT="1")
    third = run_train(variant(config, "data2.yaml", data=2, fsdp=2), 4, TPUFT_RESTART_ATTEMPT="2")
    return [first, second, third], output, left_after_first


def sigterm_while_a_save_writes() -> tuple[Proc, Path, list[str]]:
    """saveSteps 2: SIGTERM arrives as checkpoint-4's write begins (in the background); storage slowed
    by 2 s a write."""
    config, output = write_config({"training": {"save_steps": 2}})
    stopped = run_train(config, TPUFT_FAULT_SIGTERM_IN_SAVE_AT_STEP="4", TPUFT_FAULT_SLOW_WRITE_SECONDS="2")
    return stopped, output, sorted(p.name for p in output.glob("checkpoint-*"))


SPMD_JOBS = {
    "train:full": full,
    "checkpoints:reshard": reshard_chain,
    "checkpoints:sigterm-in-save": sigterm_while_a_save_writes,
    "checkpoints:sharded-load@4": functools.partial(run_case, "sharded_load", 4),
}


def test_a_run_resumes_across_device_counts_and_meshes(pool: Pool) -> None:
    (first, second, third), output, left_after_first = pool.get("checkpoints:reshard")
    reference = losses(metrics(pool.get("train:full")[1]))
    assert first.returncode == -9, first.tail()
    assert left_after_first == ["checkpoint-2", "checkpoint-4"]
    # The second attempt (2 devices): checkpoint-4 lost a shard after it completed, so it is skipped,
    # said so, unmarked, and saved again; training resumes from checkpoint-2.
    assert second.returncode == -9, second.tail()
    said = checkpoint_lines(second)
    assert "not resuming from checkpoint-4" in said and "shard __0_0.distcp is missing" in said, said
    assert "unmarked checkpoint-4" in said, said
    assert "resuming from" in said and "checkpoint-2 (restart attempt 1)" in said, said
    # Killed in checkpoint-6's background write: step 7 may have been logged meanwhile.
    on_two = logged_losses(second)
    assert sorted(on_two)[:4] == [3, 4, 5, 6] and max(on_two) <= 7, on_two
    # DCP reshards 4 -> 2 devices: the same numbers up to the reduction order (the log rounds to 1e-4).
    assert on_two == pytest.approx({step: reference[step] for step in on_two}, abs=1e-4)
    # The third attempt (4 devices, data=2 x fsdp=2): checkpoint-6 has every file but no marker, so
    # it is never resumed from and is removed before step 6 is saved into that name again; the
    # checkpoint-4 the 2-device attempt re-saved is the newest complete one.
    assert third.returncode == 0, third.tail()
    said = checkpoint_lines(third)
    assert "removed checkpoint-6: its save was cut off" in said, said
    record = metrics(output)
    assert record["resumed_from"] == "checkpoint-4"
    assert record["mesh_during_training"] == {"dcn": 1, "data": 2, "fsdp": 2, "tensor": 1}
    assert record["model_load"]["weights_from"] == "checkpoint" and record["model_load"]["sharded"]
    assert losses(record) == pytest.approx({step: reference[step] for step in (5, 6, 7, 8)}, rel=1e-5)
    store = layout.Store(str(output))
    assert all(layout.inspect(store, f"checkpoint-{step}").resumable for step in (4, 6, 8))


def test_a_checkpoint_of_replicated_chunks_is_whole_and_the_export_matches_it(pool: Pool) -> None:
    """Trap C: with data=2 every chunk is on two of the host's devices; torch_xla 2.9's dedup dropped
    every such chunk (an empty checkpoint, no error). The final checkpoint holds each weight, equal to
    the exported model's."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from tpuft_trainer.checkpoint.manager import quiet

    (_, _, third), output, _ = pool.get("checkpoints:reshard")
    assert third.returncode == 0, third.tail()
    final = load_file(output / "model.safetensors")
    reader = dcp.FileSystemReader(str(output / "checkpoint-8"))
    shapes = {
        key: md.size
        for key, md in reader.read_metadata().state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata) and key.startswith("model.")
    }
    saved: dict[str, Any] = {"model": {k[len("model.") :]: torch.zeros(s) for k, s in shapes.items()}}
    with quiet():
        dcp.load(saved, storage_reader=reader)
    assert sorted(saved["model"]) == sorted(final)
    assert all(torch.equal(saved["model"][k], final[k]) for k in final)
    assert all(saved["model"][k].abs().sum() > 0 for k in final)


def test_a_sigterm_while_a_periodic_save_writes_finishes_it_and_stops_without_another(pool: Pool) -> None:
    stopped, output, checkpoints = pool.get("checkpoints:sigterm-in-save")
    reference = losses(metrics(pool.get("train:full")[1]))
    assert stopped.returncode == ExitCode.STOPPED_AFTER_CHECKPOINT, stopped.tail()
    record = metrics(output)
    assert record["stopped"]["step"] == 4 and record["stopped"]["reason"] == "SIGTERM"
    assert record["stopped"]["steps_lost"] <= 1, record["stopped"]  # 0: caught as the staging ended
    # checkpoint-4 is finished and nothing is saved after it: one save per step, none of step 5.
    assert checkpoints == ["checkpoint-2", "checkpoint-4"]
    assert layout.inspect(layout.Store(str(output)), "checkpoint-4").resumable
    saves = record["attempt"]["checkpoints"]
    assert [(s["step"], s["reason"]) for s in saves] == [(2, "periodic"), (4, "periodic")]
    # A periodic save blocks training for its staging, not its (slowed) write, counted apart (the
    # second also waits for the first's write, still going: one save in flight).
    assert saves[0]["blocked_seconds"] < 1.0 and all(s["write_seconds"] >= 2.0 for s in saves), saves
    assert record["attempt"]["checkpoint_seconds"] == pytest.approx(
        sum(s["blocked_seconds"] for s in saves), abs=0.02
    )
    assert "after saving checkpoint-4 (SIGTERM); the next start resumes from it" in stopped.stderr
    assert losses(record) == {step: reference[step] for step in losses(record)}


def test_the_model_loads_slice_by_slice_with_from_pretrained_logits(pool: Pool) -> None:
    found = pool.get("checkpoints:sharded-load@4").result
    for name in ("local", "hub"):
        run = found[name]
        assert run["sharded"] is True, run
        assert run["max_logit_difference"] < 1e-5, run
        assert run["rotary_equal"] is True
    # tensor=2: the projections are laid out Megatron-style at load (the FSDPv2 wrapper keeps them)
    assert found["local"]["q_proj_spec"] == "{devices=[2,2]0,2,1,3}", found["local"]
    assert found["local"]["tensor_parallel_weights"] == 2 * 7
    # a model directory without safetensors falls back to from_pretrained, saying why
    assert found["bin_only"]["sharded"] is False
    assert "no .safetensors files" in found["bin_only"]["why"]


def test_old_full_file_checkpoints_are_refused_with_what_to_do(tmp_path: Path) -> None:
    from tpuft_trainer.attempt import Attempt, process_start_time
    from tpuft_trainer.checkpoint.backend import TorchBackend
    from tpuft_trainer.errors import ConfigError
    from tpuft_trainer.train import _resume_point

    old = tmp_path / "checkpoint-8"
    old.mkdir()
    for name in ("config.json", "model.safetensors", "optimizer.pt", "trainer_state.json", layout.COMPLETE):
        (old / name).write_text("{}")
    with pytest.raises(ConfigError) as refused:
        _resume_point(layout.Store(str(tmp_path)), Attempt(process_start_time()), 1, TorchBackend())
    message = str(refused.value)
    assert "checkpoint-8" in message and "full-file format of an earlier tpuft" in message
    assert (
        f"spec.model.name set to {tmp_path}/checkpoint-8" in message and "another spec.output.uri" in message
    )
    assert refused.value.exit_code == ExitCode.CONFIG_ERROR
    shutil.rmtree(old)  # nothing left to resume from: a fresh start
    assert (
        _resume_point(layout.Store(str(tmp_path)), Attempt(process_start_time()), 0, TorchBackend()) is None
    )
