"""One fine-tuning run, top to bottom: where am I, mesh, checkpoints, model, data, train, export.

Every process of the job (every host of every slice) runs this same program: with SPMD they are ONE
program over all the devices. Each process writes its own chunks of every checkpoint and its share
of the exported model's files; rank 0 writes what is shared (small files, markers, progress).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tpuft_trainer import (
    data,
    device_access,
    dpo,
    evaluation,
    export,
    fsdp_v2,
    host_memory,
    loading,
    recipe,
    storage,
    throughput,
)
from tpuft_trainer import mesh as mesh_module
from tpuft_trainer import stop as stop_module
from tpuft_trainer.attempt import Attempt, SkippedCheckpoint, process_start_time
from tpuft_trainer.checkpoint import layout
from tpuft_trainer.checkpoint.backend import Backend
from tpuft_trainer.checkpoint.hf_trainer import TrainerCheckpoints, with_sharded_checkpoints
from tpuft_trainer.checkpoint.manager import CheckpointManager, Faults, SaveRecord
from tpuft_trainer.checkpoint.resume import agree_on_resume_point
from tpuft_trainer.checkpoint.xla import XlaBackend
from tpuft_trainer.config import TrainerConfig
from tpuft_trainer.data import packing, prepared
from tpuft_trainer.data import prepare as data_prepare
from tpuft_trainer.errors import ConfigError, StoppedAfterCheckpoint
from tpuft_trainer.lora import adapt, peft_lora_config
from tpuft_trainer.pod_contract import (
    COORDINATOR_ADDRESS_ENV,
    FAULT_KILL_AT_STEP_ENV,
    FAULT_KILL_IN_SAVE_AT_STEP_ENV,
    FAULT_SIGTERM_AT_STEP_ENV,
    FAULT_SIGTERM_IN_SAVE_AT_STEP_ENV,
    FAULT_SLOW_WRITE_SECONDS_ENV,
)
from tpuft_trainer.progress import LogBar, Meter, StatusReporter, make_callback
from tpuft_trainer.world import World, check_one_feeder, check_runtime, detect_world

log = logging.getLogger(__name__)

OPTIMIZERS = {"adafactor": "adafactor", "adamw": "adamw_torch"}
METRICS_FILE = "tpuft-metrics.json"
TENSORBOARD_DIR = "tensorboard"


@dataclass
class RunRecord:
    """What the run did, written to ``<output>/tpuft-metrics.json`` by rank 0."""

    mesh: dict[str, int] = field(default_factory=dict)
    mesh_during_training: dict[str, int] = field(default_factory=dict)
    devices: int = 0
    process_index: int = 0
    process_count: int = 1
    resumed_from: str | None = None
    losses: dict[int, float] = field(default_factory=dict)
    compiles_after_step: dict[int, int] = field(default_factory=dict)
    compiles_after_eval: dict[int, int] = field(default_factory=dict)
    compiles_after_save: dict[int, int] = field(default_factory=dict)
    parameter_sharding: dict[str, str] = field(default_factory=dict)
    # objective dpo, method full: the frozen reference's parameters (sharded like the policy's).
    reference_sharding: dict[str, str] = field(default_factory=dict)
    checkpointed_blocks: int = 0
    tensor_parallel_weights: int = 0
    final_step: int = 0
    seconds: float = 0.0
    # Figures of this process's steps (a resumed run counts from its checkpoint on).
    rows_per_step: int = 0  # global batch x gradient accumulation
    tokens: int = 0  # positions processed (padding included)
    loss_tokens: int | None = None  # positions that counted in the loss
    loss_token_share: float = 0.0  # of the training rows' positions
    eval_losses: dict[int, float] = field(default_factory=dict)
    # rows, padding rows (no loss), loss tokens and batches of the evaluation set (evaluation.py).
    eval_set: dict[str, int] = field(default_factory=dict)
    # objective dpo: the share of pairs whose chosen completion the policy rewards more than the
    # rejected one, and the mean reward margin (beta x the log-ratio difference), per logged step.
    reward_accuracies: dict[int, float] = field(default_factory=dict)
    reward_margins: dict[int, float] = field(default_factory=dict)
    learning_rates: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    tokens_per_second: float | None = None  # from the end of the first step (compilation) to the last
    step_seconds: list[float] = field(default_factory=list)  # wall time of each step after the first
    flops_per_token: float = 0.0  # model FLOPs, throughput.py
    mfu: float | None = None  # an estimate: see throughput.py
    # This attempt in time (attempt.py): start-up, saves; the run's totals are in status.goodput.
    attempt: dict[str, Any] = field(default_factory=dict)
    # Set when SIGTERM stopped the run after a checkpoint: {step (resumed from next), trained_to,
    # steps_lost, reason, save_seconds, grace_seconds, signal_to_exit_seconds}.
    stopped: dict[str, Any] | None = None
    # How the model was loaded: {sharded, why (when not), seconds}; and the final export's figures.
    model_load: dict[str, Any] = field(default_factory=dict)
    export: dict[str, Any] = field(default_factory=dict)
    # This process's peak resident memory (bytes, Linux VmHWM) in each part: load, train (resume and
    # saves included), export; each part's own (host_memory.part_peak); the process's is the largest.
    peak_rss: dict[str, int] = field(default_factory=dict)
    # The prepared dataset read: {fingerprint, reused (prepared before: nothing tokenised), seconds
    # (its prepare's wall time), directory}.
    data: dict[str, Any] = field(default_factory=dict)
    # Seconds the stop channel made the steps wait, in all (0 with one process).
    stop_channel_wait_seconds: float = 0.0


def run(config: TrainerConfig, env: Mapping[str, str] | None = None) -> RunRecord:
    env = os.environ if env is None else env
    started = time.monotonic()
    record = RunRecord()
    # 1. Where this process stands, the runtime, and SIGTERM as a request to checkpoint and stop.
    process = _start(config, env, record)
    # 2. The mesh, which must win over the Trainer's own (compat.mesh_wins re-installs it).
    shape = _mesh(config, process, record)
    # 3. Output and resume: the newest checkpoint at the output that is complete and whole, one for
    # every host (process 0 decides and tells the others over the checkpoints' own group, which the
    # backend starts with several processes: resume.py).
    output = storage.local_dir(config.output.uri)  # the Trainer's directory (a staging copy for a URI)
    output.mkdir(parents=True, exist_ok=True)
    store = layout.Store(config.output.uri)
    backend = XlaBackend()
    resume = _resume_point(store, process.attempt, process.world.restart_attempt, backend)
    record.resumed_from = resume.name if resume else None
    # 4. Model (+ LoRA) and data: the model onto the mesh slice by slice, the prepared dataset.
    inputs = _model_and_data(config, resume, shape, process, record)
    record.peak_rss["load"] = host_memory.part_peak()
    # 5. The Trainer (FSDPv2 arguments from the same function users call), with the checkpoint manager
    # behind its save and resume hooks, progress, the stop agreement and the run record's callbacks.
    run_ = _trainer(config, env, inputs, process, store, backend, output, resume, record)
    # 6. Train (resuming restores weights, optimizer, scheduler, RNG and the data position); a stop
    # ends here with its checkpoint; else evaluate at the end unless the last step just did.
    _train(run_, process, output)
    record.peak_rss["train"] = host_memory.part_peak()
    _after_training(config, run_, process, record)
    if process.stopper.decided is not None:
        _stopped(
            record,
            process.stopper,
            process.attempt,
            int(run_.trainer.state.global_step),
            output,
            config,
            started,
            process.is_rank_zero,
        )
    if inputs.eval_dataset is not None and recipe.needs_final_evaluation(
        config.training.eval_steps, run_.trainer.state.global_step
    ):
        run_.trainer.evaluate()
    # 7. The final model in the standard format, streamed from the devices group by group (export.py).
    # The optimizer's state is no longer needed (the last checkpoint is written): its memory goes to
    # the export's gathers.
    _drop_optimizer_state(run_.trainer)
    record.export = _export(
        run_.trainer, inputs.tokenizer, config, store, backend, output, process.is_rank_zero
    )
    record.peak_rss["export"] = host_memory.part_peak()
    record.final_step = int(run_.trainer.state.global_step)
    record.seconds = round(time.monotonic() - started, 2)
    if process.is_rank_zero:
        _write_record(record, output)
        storage.upload(output, config.output.uri)
    return record


@dataclass
class _Process:
    """This process in the job: its place, the runtime's devices, its attempt and the stop agreement."""

    world: World
    attempt: Attempt
    stopper: stop_module.StopCoordinator
    devices: int
    is_rank_zero: bool


def _start(config: TrainerConfig, env: Mapping[str, str], record: RunRecord) -> _Process:
    """Where this process stands; refuses multi-host shapes whose environment cannot join up; starts
    the XLA runtime (SPMD) and the stop agreement (from here SIGTERM is a request to checkpoint and
    stop, agreed on by every host: stop.py)."""
    world = detect_world(config.world, env)
    # Pods run as a non-root user by default: say so plainly if it cannot open the chips (before
    # libtpu tries and fails in its own words).
    device_access.check_tpu_device_access()
    attempt = Attempt(process_start_time(), grace_seconds=config.stop.grace_seconds)
    fsdp_v2.use_fsdp_v2()
    import torch_xla.runtime as xr

    if config.fsdp.compilation_cache_path:
        _use_compilation_cache(config.fsdp.compilation_cache_path, world)
    devices = xr.global_runtime_device_count()
    for problem in check_runtime(
        world, process_count=xr.process_count(), device_count=devices, on_tpu=xr.device_type() == "TPU"
    ):
        log.warning("world: %s (fine on CPU; fatal on TPU)", problem)
    record.devices, record.process_index, record.process_count = (
        devices,
        xr.process_index(),
        xr.process_count(),
    )
    stopper = stop_module.StopCoordinator(
        stop_module.open_channel(
            env.get(COORDINATOR_ADDRESS_ENV),
            config.stop.coordination_port,
            world.process_index,
            world.process_count,
        ),
        Path(config.stop.request_file) if config.stop.request_file else None,
    )
    stopper.install()
    return _Process(world, attempt, stopper, devices, is_rank_zero=xr.process_index() == 0)


def _mesh(config: TrainerConfig, process: _Process, record: RunRecord) -> mesh_module.MeshShape:
    shape = mesh_module.plan_mesh(config.fsdp.mesh, process.devices)
    fsdp_v2.use_mesh(mesh_module.build_mesh(shape))
    record.mesh = dict(zip(mesh_module.AXIS_NAMES, shape.shape, strict=True))
    log.info("mesh %s over %d devices, %d process(es)", record.mesh, process.devices, record.process_count)
    return shape


@dataclass
class _Inputs:
    """What the Trainer is built from: the model (with LoRA), its tokenizer, the rows, the reference."""

    model: Any
    tokenizer: Any
    tensor_parallel_weights: int  # projections the loader laid out over the tensor axis already
    dataset: Any
    eval_dataset: Any
    eval_items_per_batch: float | None  # evaluation.token_mean_loss's divisor
    reference: Any  # objective dpo, method full: the frozen reference model
    global_batch: int


def _model_and_data(
    config: TrainerConfig, resume: Any, shape: mesh_module.MeshShape, process: _Process, record: RunRecord
) -> _Inputs:
    """The model goes onto the mesh slice by slice (loading.py); a full fine-tune resuming from a
    checkpoint skips the source's weights: the checkpoint has them all. The rows are the prepared
    dataset's (data/), or preference pairs for DPO."""
    training = config.training
    preference = training.objective == "dpo"
    weights_from_checkpoint = resume is not None and training.method == "full"
    load_started = time.monotonic()
    location = data.model_location(config.model)
    tokenizer = data.load_tokenizer(config.model, location)
    loaded = loading.load_model(config.model, location, weights=not weights_from_checkpoint)
    model = loaded.model
    record.model_load = {
        "sharded": loaded.sharded,
        "why": loaded.why or None,
        "weights_from": "checkpoint" if weights_from_checkpoint else "source",
        "seconds": round(time.monotonic() - load_started, 2),
    }
    if config.dataset.packing and (refusal := packing.packing_refusal(model)):
        raise ConfigError(refusal)
    if training.method == "lora" and not preference:  # (trl's DPOTrainer adds the adapter itself)
        model, _ = adapt(model, training.lora, training.seed)  # the adapter drawn from the seed
    global_batch = training.per_device_batch_size * shape.batch_ways
    if preference:
        dataset, eval_dataset = _preference_datasets(
            config, tokenizer, global_batch, record, process.is_rank_zero
        )
        return _Inputs(
            model, tokenizer, loaded.tensor_parallel_weights, dataset, eval_dataset, None,
            dpo.load_reference(config, location), global_batch,
        )  # fmt: skip
    dataset, eval_dataset, eval_batches = _datasets(
        config, tokenizer, global_batch, record, process.is_rank_zero
    )
    return _Inputs(
        model, tokenizer, loaded.tensor_parallel_weights, dataset, eval_dataset,
        eval_batches.items_per_batch if eval_batches else None, None, global_batch,
    )  # fmt: skip


@dataclass
class _Run:
    """The Trainer and what hangs on it."""

    trainer: Any
    manager: CheckpointManager
    checkpoints: TrainerCheckpoints
    saves: _SaveLog
    recorder: Any  # _run_record_callback's: the end time of each step
    counter: throughput.TokenCounter
    flops: throughput.ModelFlops


def _trainer(
    config: TrainerConfig,
    env: Mapping[str, str],
    inputs: _Inputs,
    process: _Process,
    store: layout.Store,
    backend: XlaBackend,
    output: Path,
    resume: Any,
    record: RunRecord,
) -> _Run:
    training = config.training
    preference = training.objective == "dpo"
    fsdp_args = fsdp_v2.get_fsdp_training_args(
        inputs.model, config.fsdp.layer_cls_to_wrap, gradient_checkpointing=config.fsdp.gradient_checkpointing
    )
    trainer = _build_trainer(
        config,
        inputs.model,
        inputs.reference,
        inputs.tokenizer,
        inputs.dataset,
        inputs.eval_dataset,
        output,
        inputs.global_batch,
        fsdp_args,
        process.is_rank_zero,
        inputs.eval_items_per_batch,
    )
    check_one_feeder(world_size=trainer.args.world_size, process_index=trainer.args.process_index)
    # Checkpoints: the manager owns saving and restoring; the Trainer calls it through its own hooks.
    manager = CheckpointManager(
        store,
        backend,
        keep=training.keep_checkpoints,
        faults=Faults(
            kill_before_marker=int(env.get(FAULT_KILL_IN_SAVE_AT_STEP_ENV, "0") or 0),
            sigterm_while_writing=int(env.get(FAULT_SIGTERM_IN_SAVE_AT_STEP_ENV, "0") or 0),
            slow_write_seconds=float(env.get(FAULT_SLOW_WRITE_SECONDS_ENV, "0") or 0),
        ),
    )
    stopper, attempt = process.stopper, process.attempt
    saves = _SaveLog(attempt, config, stopper, process.is_rank_zero)
    checkpoints = TrainerCheckpoints(
        manager, resume=resume, after_staging=_stop_at_this_save(stopper, manager, saves)
    )
    trainer.tpuft_checkpoints = checkpoints
    flops = throughput.model_flops(trainer.model, reference_forward=preference)
    record.reference_sharding = dpo.reference_sharding(trainer)
    record.rows_per_step = inputs.global_batch * training.gradient_accumulation_steps
    # A preference pair is two rows of max_seq_length: prompt + chosen, prompt + rejected.
    tokens_per_step = record.rows_per_step * training.max_seq_length * (2 if preference else 1)
    total_steps = (
        trainer.args.max_steps
        if trainer.args.max_steps > 0
        else _steps_for_epochs(config, inputs.dataset, record.rows_per_step)
    )
    meter = Meter(total_steps, tokens_per_step=tokens_per_step)
    sinks: list[Any] = [LogBar(total_steps), StatusReporter(config.progress)] if process.is_rank_zero else []
    # The stop callback first: at a boundary where the hosts agree to stop, the final progress
    # report must already carry the save (on_save runs before on_train_end either way).
    trainer.add_callback(_stop_callback(stopper, attempt, checkpoints, saves, env))
    trainer.add_callback(
        make_callback(sinks, meter, is_rank_zero=process.is_rank_zero, details=attempt.to_status)
    )
    # Then, in this order: tensor parallelism re-annotates the parameters before the record reads
    # their sharding; at a save the record counts compiles after the stop callback has marked and
    # uploaded the checkpoint; the test-only fault injection comes last.
    trainer.add_callback(_tensor_parallel_callback(record, laid_out=inputs.tensor_parallel_weights))
    recorder = _run_record_callback(record)
    trainer.add_callback(recorder)
    if process.is_rank_zero:
        trainer.add_callback(_tensorboard_upload_callback(config))
    if kill_at_step := int(env.get(FAULT_KILL_AT_STEP_ENV, "0") or 0):
        trainer.add_callback(_fault_injection_callback(kill_at_step, manager))
    counter = throughput.TokenCounter(trainer)
    return _Run(trainer, manager, checkpoints, saves, recorder, counter, flops)


def _train(run_: _Run, process: _Process, output: Path) -> None:
    """Trains to the end (or to an agreed stop); on the way out of a failure, no save is left
    writing and the stop channel is closed without waiting for the other hosts."""
    try:
        run_.trainer.train(resume_from_checkpoint=run_.checkpoints.prepare_resume(run_.trainer, str(output)))
        run_.saves.record(run_.manager.wait())  # the last save, if one is still writing
    except BaseException:
        run_.manager.close()
        process.stopper.close(wait=False)
        raise
    process.stopper.close()


def _after_training(config: TrainerConfig, run_: _Run, process: _Process, record: RunRecord) -> None:
    """The attempt's record, the stop channel's wait and the throughput figures."""
    record.attempt = process.attempt.to_record()
    record.stop_channel_wait_seconds = round(getattr(process.stopper.channel, "wait_seconds", 0.0), 3)
    _throughput(
        record, run_.recorder.step_times, run_.counter, run_.flops.per_token(config.training.max_seq_length)
    )
    record.mfu = throughput.mfu(
        record.tokens_per_second, record.flops_per_token, process.devices, config.world.peak_flops_per_chip
    )


def _write_record(record: RunRecord, output: Path) -> None:
    (output / METRICS_FILE).write_text(json.dumps(asdict(record), indent=1, sort_keys=True))


def _use_compilation_cache(path: str, world: World) -> None:
    """XLA's persistent compilation cache, before anything is compiled. Every host runs the same
    program, so one writer (rank 0) fills it and the others read; a restarted run then loads its
    graphs instead of compiling them (on TPU: PJRT CPU in torch_xla 2.9 writes entries it cannot
    read back, see docs/trainer.md)."""
    import torch_xla.runtime as xr

    Path(path).mkdir(parents=True, exist_ok=True)
    xr.initialize_cache(path, readonly=not world.is_rank_zero)
    log.info("XLA compilation cache at %s (%s)", path, "read-write" if world.is_rank_zero else "read-only")


def _stopped(
    record: RunRecord,
    stopper: stop_module.StopCoordinator,
    attempt: Attempt,
    trained_to: int,
    output: Path,
    config: TrainerConfig,
    started: float,
    is_rank_zero: bool,
) -> None:
    """After a checkpointed stop: record what happened and end the run with its exit code."""
    decided = stopper.decided
    resume_step = decided.resume_step if decided and decided.resume_step is not None else trained_to
    save = next((s for s in reversed(attempt.saves) if s.step == resume_step), None)
    since_signal = time.monotonic() - stopper.terminated_at if stopper.terminated_at is not None else None
    record.final_step = trained_to
    record.seconds = round(time.monotonic() - started, 2)
    record.stopped = {
        "step": resume_step,
        "trained_to": trained_to,
        "steps_lost": trained_to - resume_step,
        "reason": decided.reason if decided else "",
        "save_seconds": round(save.seconds, 2) if save else None,
        "grace_seconds": config.stop.grace_seconds,
        # From the signal this process received (None on a host that was not signalled itself).
        "signal_to_exit_seconds": round(since_signal, 2) if since_signal is not None else None,
    }
    if is_rank_zero:
        _write_record(record, output)
    redone = "" if trained_to == resume_step else f"; step {trained_to} will be trained again"
    raise StoppedAfterCheckpoint(
        f"stopped at step {trained_to} after saving checkpoint-{resume_step} "
        f"({record.stopped['reason']}); the next start resumes from it{redone}"
    )


def _resume_point(store: layout.Store, attempt: Attempt, restart_attempt: int, backend: Backend) -> Any:
    """The checkpoint to resume from (``layout.Found``) or None, the same on every process; records
    and logs the skipped ones. Process 0 then removes every checkpoint directory newer than it (cut
    off, or not whole), so no save of this attempt writes into a directory that holds another
    attempt's files (resume.py)."""
    agreed = agree_on_resume_point(store, backend)
    for skipped in agreed.point.skipped:
        log.warning("not resuming from %s at %s: %s", skipped.name, store.url(skipped.name), skipped.problem)
        attempt.skipped.append(SkippedCheckpoint(skipped.step, f"{skipped.name}: {skipped.problem}"))
    found = agreed.point.checkpoint
    if found is not None and found.legacy:
        raise ConfigError(
            f"{found.name} at {store.url(found.name)} is in the full-file format of an earlier tpuft "
            "(model.safetensors + optimizer.pt, gathered on every host); this trainer resumes only sharded "
            "(torch.distributed.checkpoint) checkpoints. To continue from its weights, start a new run with "
            f"spec.model.name set to {store.url(found.name)} (a standard Hugging Face model directory); to "
            "start over, use another spec.output.uri or delete its checkpoint-* directories"
        )
    if found is not None:
        log.info("resuming from %s (restart attempt %d)", store.url(found.name), restart_attempt)
        attempt.resumed_from_step = found.step
    elif restart_attempt:
        log.info(
            "restart attempt %d but no complete checkpoint at the output: starting from the beginning",
            restart_attempt,
        )
    if backend.process_index == 0:
        for action in agreed.cleared:
            log.warning("%s", action)
    return found


class _SaveLog:
    """Completed saves into the attempt's record and the log, in the training thread."""

    def __init__(
        self,
        attempt: Attempt,
        config: TrainerConfig,
        stopper: stop_module.StopCoordinator,
        is_rank_zero: bool,
    ) -> None:
        self.attempt, self.config, self.stopper, self.is_rank_zero = attempt, config, stopper, is_rank_zero

    def record(self, saves: list[SaveRecord]) -> None:
        for save in saves:
            self.attempt.checkpoint_saved(
                save.step,
                save.reason,
                device_wait_seconds=save.device_wait_seconds,
                staging_seconds=save.staging_seconds,
                blocked_seconds=save.blocked_seconds,
                write_seconds=save.write_seconds,
                seconds=save.seconds,
            )
            log.info("%s", _save_line(save))
            grace = self.config.stop.grace_seconds
            if self.stopper.decided is not None and save.seconds > grace / 2:
                advice = stop_module.slow_save_advice(save.seconds, grace, spot=self.config.stop.spot)
                log.warning("%s", advice)


def _save_line(save: SaveRecord) -> str:
    """The log line of a completed save: what it cost training and of what, and apart from it the
    wait for the device (it computed the steps dispatched before the save meanwhile)."""
    background = save.reason == "periodic"
    parts = [f"the staging copy {save.staging_seconds:.2f} s"]
    if not background:
        parts.append(f"the write {save.write_seconds:.1f} s")
    previous = save.blocked_seconds - save.staging_seconds - (0.0 if background else save.write_seconds)
    if previous > 0.05:
        parts.append(f"waiting for the previous save's write {previous:.1f} s")
    return (
        f"saved checkpoint-{save.step} in {save.seconds:.1f} s ({save.reason}): training lost"
        f" {save.blocked_seconds:.2f} s ({', '.join(parts)})"
        + (f", the write took {save.write_seconds:.1f} s in the background" if background else "")
        + f"; before it the device finished the steps dispatched ahead in {save.device_wait_seconds:.2f} s"
        " (not lost: it computed them)"
    )


def _stop_at_this_save(
    stopper: stop_module.StopCoordinator, manager: CheckpointManager, saves: _SaveLog
) -> Any:
    """After a periodic save's staging: a SIGTERM that came meanwhile ends the run at this save (its
    write is finished first), with no step lost."""

    def after_staging(trainer: Any, step: int) -> None:
        decision = stopper.after_save_staged(step)
        if decision.stop:
            log.warning("SIGTERM while checkpoint-%d was being saved: finishing it and stopping there", step)
            trainer.control.should_training_stop = True
            saves.record(manager.wait())

    return after_staging


def _export(
    trainer: Any,
    tokenizer: Any,
    config: TrainerConfig,
    store: layout.Store,
    backend: Any,
    output: Path,
    is_rank_zero: bool,
) -> dict[str, Any]:
    """The final model at the output: a full fine-tune's weights streamed to safetensors files; a LoRA
    run's adapter (and with lora.save_merged, the merged model streamed the same way under merged/)."""
    training = config.training
    if training.method == "lora":
        trainer.save_model(str(output))  # compat.reloadable_checkpoint: the adapter's weights only
        if not (training.lora and training.lora.save_merged):
            return {"adapter": True}
        merged = export.export_merged(export.unwrap(trainer.model), tokenizer, store, backend, output)
        return {"adapter": True, "merged": asdict(merged)}
    weights = export.export_weights(export.model_tensors(trainer.model), store, backend)
    if is_rank_zero:
        export.write_config(trainer.model, output)
        tokenizer.save_pretrained(output)
    log.info(
        "exported %d tensors (%.2f GB) in %d file(s) in %.1f s, at most %.2f GB at a time",
        weights.tensors,
        weights.bytes / 1e9,
        len(weights.files),
        weights.seconds,
        weights.largest_group_bytes / 1e9,
    )
    return asdict(weights)


def _drop_optimizer_state(trainer: Any) -> None:
    import torch_xla

    trainer.optimizer.state.clear()
    trainer.model.zero_grad(set_to_none=True)
    torch_xla.sync()
    host_memory.release()


def _datasets(
    config: TrainerConfig, tokenizer: Any, global_batch: int, record: RunRecord, is_rank_zero: bool
) -> tuple[Any, Any, evaluation.EvalBatches | None]:
    """Training rows and evaluation rows (or None) of fixed length, padded or packed, read from the
    prepared dataset (data/): the one ``tpuft prepare`` left at the output, else prepared here with
    the same code (rank 0 publishes it, so a restart reads it); the evaluation rows filled up to whole
    batches with rows that carry no loss."""
    training = config.training
    ready = data_prepare.find_or_prepare(
        config, tokenizer, workers=data_prepare.default_workers(), publish=is_rank_zero
    )
    ready.check_fills_a_batch(global_batch, config.dataset.name)
    train = ready.manifest.splits[prepared.TRAIN]
    dataset = ready.rows(prepared.TRAIN)
    eval_dataset = eval_batches = None
    if ready.has_eval:
        eval_dataset, eval_batches = evaluation.full_batches(ready, global_batch, name=config.dataset.name)
        record.eval_set = asdict(eval_batches)
    record.loss_token_share = round(train.loss_tokens / max(1, ready.manifest.positions()), 4)
    record.data = {
        "fingerprint": ready.manifest.fingerprint,
        "reused": ready.reused,
        "seconds": ready.manifest.seconds,
        "directory": str(ready.directory),
    }
    log.info(
        "%d training rows of %d positions (%s, %s); %.1f%% of the positions count in the loss%s",
        train.rows,
        training.max_seq_length,
        "packed" if config.dataset.packing else "padded",
        "prepared before, read memory-mapped" if ready.reused else "prepared now",
        100 * record.loss_token_share,
        f"; {eval_batches.rows} evaluation rows" if eval_batches is not None else "",
    )
    return dataset, eval_dataset, eval_batches


def _preference_datasets(
    config: TrainerConfig, tokenizer: Any, global_batch: int, record: RunRecord, is_rank_zero: bool
) -> tuple[Any, Any]:
    """Preference pairs and evaluation pairs (or None), tokenised as trl's DPOTrainer tokenises them,
    read from the prepared dataset (data/preference.py): the one ``tpuft prepare`` left at the output,
    else prepared here (rank 0 publishes it, so a restart reads it). DPOTrainer takes them as they are
    (compat.dpo_pretokenised)."""
    ready = data_prepare.find_or_prepare(
        config, tokenizer, workers=data_prepare.default_workers(), publish=is_rank_zero
    )
    ready.check_fills_a_batch(global_batch, config.dataset.name)
    train = ready.manifest.splits[prepared.TRAIN]
    dataset = ready.pairs(prepared.TRAIN)
    eval_dataset = ready.pairs(prepared.EVAL) if ready.has_eval else None
    record.loss_token_share = round(train.loss_tokens / max(1, ready.manifest.positions()), 4)
    record.data = {
        "fingerprint": ready.manifest.fingerprint,
        "reused": ready.reused,
        "seconds": ready.manifest.seconds,
        "directory": str(ready.directory),
    }
    log.info(
        "%d preference pairs, each two rows of %d positions (%s; %d longer, cut when batched)%s",
        len(dataset),
        config.training.max_seq_length,
        "prepared before, read memory-mapped" if ready.reused else "prepared now",
        train.truncated,
        f"; {len(eval_dataset)} evaluation pairs" if eval_dataset is not None else "",
    )
    return dataset, eval_dataset


def _throughput(
    record: RunRecord, step_times: list[float], counter: throughput.TokenCounter, flops: float
) -> None:
    """Positions, loss tokens and rates of the steps this process ran (the first step compiles: rates
    start at its end)."""
    record.tokens = sum(counter.positions)
    record.loss_tokens = counter.loss_tokens()
    record.step_seconds = [round(b - a, 4) for a, b in itertools.pairwise(step_times)]
    if len(step_times) > 1:
        seconds = step_times[-1] - step_times[0]
        record.tokens_per_second = round(sum(counter.positions[1:]) / seconds, 1)
    record.flops_per_token = flops


def _steps_for_epochs(config: TrainerConfig, dataset: Any, rows_per_step: int) -> int:
    import math

    return max(1, math.ceil((config.training.epochs or 1) * (len(dataset) // rows_per_step)))


def _build_trainer(
    config: TrainerConfig,
    model: Any,
    reference: Any,
    tokenizer: Any,
    dataset: Any,
    eval_dataset: Any,
    output: Path,
    global_batch: int,
    fsdp_args: dict[str, Any],
    is_rank_zero: bool,
    eval_items_per_batch: float | None = None,
) -> Any:
    from transformers import Trainer, TrainingArguments, default_data_collator

    training = config.training
    arguments: dict[str, Any] = dict(
        output_dir=str(output),
        max_steps=training.max_steps or -1,
        num_train_epochs=training.epochs or 1.0,
        # Under SPMD one process feeds the whole mesh: the Trainer's "per device" batch is the global one.
        per_device_train_batch_size=global_batch,
        learning_rate=training.learning_rate,
        optim=OPTIMIZERS[training.optimizer],
        logging_steps=training.logging_steps,
        save_strategy="steps" if training.save_steps else "no",
        save_steps=training.save_steps or 500,
        seed=training.seed,
        data_seed=training.seed,
        report_to=[],  # TensorBoard through its callback below, writing where we choose
        disable_tqdm=True,  # progress.LogBar draws the one bar, on rank 0
        **recipe.training_arguments(training, global_batch=global_batch, evaluates=eval_dataset is not None),
        **fsdp_args,
    )
    callbacks = [_tensorboard(output / TENSORBOARD_DIR)] if is_rank_zero else []
    if training.objective == "dpo":
        # With LoRA trl adds the adapter, and computes the reference with it disabled.
        lora = peft_lora_config(config.training.lora) if training.method == "lora" else None
        return dpo.build_trainer(
            config,
            model,
            reference,
            lora,
            tokenizer,
            dataset,
            eval_dataset,
            arguments,
            callbacks,
        )
    # Text and chat alike: the rows are tokenised, labelled (assistant-only loss) and packed (position
    # ids) already, so they are stacked as they are. trl's SFTTrainer would rebuild the position ids
    # and add an attention mask (undoing packing), and it reads metrics to the host every step.
    trainer_class: type = Trainer
    if eval_items_per_batch is not None:
        trainer_class = evaluation.token_mean_loss(Trainer, eval_items_per_batch)
    return with_sharded_checkpoints(trainer_class)(
        model=model,
        args=TrainingArguments(**arguments),
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=default_data_collator,
        callbacks=callbacks,
    )


def _tensorboard(directory: Path) -> Any:
    """transformers' TensorBoard callback writing to ``<output>/tensorboard`` (uploaded with the output)."""
    from torch.utils.tensorboard import SummaryWriter
    from transformers.integrations import TensorBoardCallback

    return TensorBoardCallback(tb_writer=SummaryWriter(log_dir=str(directory)))


def _tensor_parallel_callback(record: RunRecord, *, laid_out: int) -> Any:
    """Megatron-style tensor parallelism (``mesh.shard_tensor_parallel``) on the wrapped model, when
    training begins; fills ``record.tensor_parallel_weights``.

    The sharded loader (loading.py) lays the projections out so from the start (``laid_out`` of
    them), and then this only records it. A model loaded whole (from_pretrained) is re-annotated
    here: the Trainer wraps the model in FSDPv2 (laying every parameter out along ``fsdp``) inside
    ``train()``, and on_train_begin is the first point after the wrapping, before the first step, so
    the optimizer's state is created in the new layout. The mesh is the one in force, which the
    wrapping used (ours: compat.mesh_wins)."""
    from transformers import TrainerCallback

    class TensorParallelCallback(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            import torch_xla.distributed.spmd as xs

            if laid_out:
                record.tensor_parallel_weights = laid_out
            elif model is not None:
                record.tensor_parallel_weights = mesh_module.shard_tensor_parallel(
                    model, xs.get_global_mesh()
                )

    return TensorParallelCallback()


def _run_record_callback(record: RunRecord) -> Any:
    """Fills the run record (``tpuft-metrics.json``, what the tests assert): the mesh in force and the
    parameter sharding when training begins; losses, learning rates, gradient norms and DPO reward
    figures as they are logged; evaluation losses; XLA compile counts after each step, evaluation and
    save; and the end time of each step (``step_times``, for the throughput figures). It only observes."""
    import torch_xla
    from transformers import TrainerCallback

    class RunRecordCallback(TrainerCallback):
        def __init__(self) -> None:
            self.step_times: list[float] = []  # monotonic time at the end of each step this process ran

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            record.mesh_during_training = mesh_module.current_mesh_shape()
            if model is not None:
                record.parameter_sharding = {
                    name: torch_xla._XLAC._get_xla_sharding_spec(param)
                    for name, param in model.named_parameters()
                }
                record.checkpointed_blocks = (
                    sum(1 for m in model.modules() if type(m).__name__ == "SpmdFullyShardedDataParallel") - 1
                )

        def on_log(
            self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any
        ) -> None:
            step = int(state.global_step)
            if logs and "loss" in logs:
                record.losses[step] = float(logs["loss"])
            if logs and "learning_rate" in logs:
                record.learning_rates[step] = float(logs["learning_rate"])
            if logs and "grad_norm" in logs:
                record.grad_norms[step] = float(logs["grad_norm"])
            if logs and dpo.REWARD_ACCURACY in logs and "loss" in logs:
                record.reward_accuracies[step] = float(logs[dpo.REWARD_ACCURACY])
                record.reward_margins[step] = float(logs[dpo.REWARD_MARGIN])

        def on_evaluate(
            self, args: Any, state: Any, control: Any, metrics: dict[str, Any] | None = None, **kw: Any
        ) -> None:
            if metrics and "eval_loss" in metrics:
                record.eval_losses[int(state.global_step)] = float(metrics["eval_loss"])
            record.compiles_after_eval[int(state.global_step)] = _compile_count()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.step_times.append(time.monotonic())
            record.compiles_after_step[int(state.global_step)] = _compile_count()

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            # (The checkpoint itself is marked and uploaded by the stop callback, which runs first.)
            record.compiles_after_save[int(state.global_step)] = _compile_count()

    return RunRecordCallback()


def _tensorboard_upload_callback(config: TrainerConfig) -> Any:
    """At each save, copies ``<output>/tensorboard`` to the output URI, so TensorBoard (and Vertex AI
    TensorBoard) read the events as they come, not only at the end. Rank 0 only: it writes them."""
    from transformers import TrainerCallback

    class TensorBoardUploadCallback(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            logs = Path(args.output_dir) / TENSORBOARD_DIR
            if logs.is_dir():
                storage.upload(logs, config.output.uri, TENSORBOARD_DIR)

    return TensorBoardUploadCallback()


def _fault_injection_callback(kill_at_step: int, manager: CheckpointManager) -> Any:
    """Fault injection for tests and chaos drills (``TPUFT_FAULT_KILL_AT_STEP``): SIGKILL this process
    at the end of step ``kill_at_step``, before that step's own save, as a preempted or crashed host
    would die (no save, no exit). Deterministic: an earlier save still writing in the background is
    finished first, so which checkpoints exist after the kill does not depend on the machine's speed
    (a kill during a write is ``TPUFT_FAULT_KILL_IN_SAVE_AT_STEP``'s case)."""
    from transformers import TrainerCallback

    class FaultInjectionCallback(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == kill_at_step:
                manager.wait()
                log.warning("%s=%d: killing this process now", FAULT_KILL_AT_STEP_ENV, kill_at_step)
                os.kill(os.getpid(), signal.SIGKILL)

    return FaultInjectionCallback()


def _compile_count() -> int:
    import torch_xla.debug.metrics as met

    compile_data = met.metric_data("CompileTime")
    return int(compile_data[0]) if compile_data else 0


def _stop_callback(
    stopper: stop_module.StopCoordinator,
    attempt: Attempt,
    checkpoints: TrainerCheckpoints,
    saves: _SaveLog,
    env: Mapping[str, str],
) -> Any:
    """At every step boundary: saves that finished writing are recorded (a failed background write
    ends the run here); then the stop agreement (stop.py) may ask for a save, and a stop. A SIGTERM
    that came while the previous step's periodic save was writing stops the run at that save
    (finished first) instead of saving again."""
    from transformers import TrainerCallback

    sigterm_at = int(env.get(FAULT_SIGTERM_AT_STEP_ENV, "0") or 0)
    manager = checkpoints.manager

    class StopCallback(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            attempt.step_ended()
            stopper.training_started()
            saves.record(manager.poll())
            step = int(state.global_step)
            if sigterm_at and step == sigterm_at:
                # Deterministic: no save is writing, so the stop saves the step reached (a SIGTERM
                # during a save's write is TPUFT_FAULT_SIGTERM_IN_SAVE_AT_STEP's case).
                saves.record(manager.wait())
                log.warning("%s=%d: sending this process SIGTERM", FAULT_SIGTERM_AT_STEP_ENV, sigterm_at)
                os.kill(os.getpid(), signal.SIGTERM)
            # Agree at once right after a periodic save: a stop then ends at that save.
            immediate = manager.newest_started is not None and manager.newest_started == step - 1
            decision = stopper.at_step_boundary(
                step, immediate=immediate, last_save=manager.newest_started, in_flight_at=manager.in_flight_at
            )
            if decision.stop and not decision.save:
                control.should_save = False
                control.should_training_stop = True
                log.warning(
                    "SIGTERM while checkpoint-%s was being written: finishing it and stopping there "
                    "(step %d will be trained again after the restart)",
                    decision.resume_step,
                    step,
                )
                saves.record(manager.wait())
                return
            if decision.save:
                control.should_save = True
                checkpoints.reason = decision.reason
                log.info("checkpointing at step %d: %s", step, decision.reason)
            if decision.stop:
                control.should_training_stop = True

    return StopCallback()
