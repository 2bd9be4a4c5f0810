"""One fine-tuning run on the native backend, top to bottom (one process per chip, FSDP2 + DTensor).

An owned loop in torchtitan's style rather than the HF Trainer: under FSDP on CPU accelerate silently
falls back to DDP, it knows no ``tpu`` device, and ``save_model`` with a sharded state dict writes
nothing (shared/facts/torchtpu.md). What the xla backend shares is reused as it is: the prepared
datasets (data/), the checkpoint manager, layout, names and resume agreement (checkpoint/), the
optimizer and schedule as the Trainer builds them (optimizer.py), the stop agreement (stop.py), the
progress sinks (progress.py), the attempt's record (attempt.py), the run record and its helpers
(train.py) and the streamed export (export.py).

The loss of a step is the xla backend's: the sum of every loss token's cross-entropy over the global
batch (all micro-batches of the step) divided by the global count of loss tokens (an all-reduce), so
it equals an unsharded run's. Each process computes its rows' sum over that global count; FSDP2
averages gradients over the processes it shards over, so the backward pass scales by their number
(the batch's parts: processes / tensor, as the ranks of a tensor group share their rows). Objective
dpo takes its step, reference and metrics from preference.py (trl's DPO loss: the mean over the
step's pairs); the rest of the loop is the same.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from tpuft_trainer import data, device_access, evaluation, export, host_memory, recipe, storage, throughput
from tpuft_trainer import stop as stop_module
from tpuft_trainer.attempt import Attempt, process_start_time
from tpuft_trainer.checkpoint import layout
from tpuft_trainer.checkpoint.backend import TorchBackend
from tpuft_trainer.checkpoint.manager import CheckpointManager, Faults
from tpuft_trainer.config import TrainerConfig
from tpuft_trainer.data import packing
from tpuft_trainer.errors import ConfigError
from tpuft_trainer.native import batches, checkpoints, preference, runtime
from tpuft_trainer.native import model as native_model
from tpuft_trainer.native import optimizer as native_optimizer
from tpuft_trainer.native.events import Events
from tpuft_trainer.pod_contract import (
    FAULT_KILL_AT_STEP_ENV,
    FAULT_KILL_IN_SAVE_AT_STEP_ENV,
    FAULT_SIGTERM_AT_STEP_ENV,
    FAULT_SIGTERM_IN_SAVE_AT_STEP_ENV,
    FAULT_SLOW_WRITE_SECONDS_ENV,
)
from tpuft_trainer.progress import LogBar, Meter, Sink, StatusReporter
from tpuft_trainer.train import (
    RunRecord,
    _datasets,
    _preference_datasets,
    _resume_point,
    _SaveLog,
    _steps_for_epochs,
    _stopped,
    _write_record,
)
from tpuft_trainer.world import detect_world

log = logging.getLogger(__name__)


def run(config: TrainerConfig, env: Mapping[str, str] | None = None) -> RunRecord:
    env = os.environ if env is None else env
    started = time.monotonic()
    record = RunRecord()
    training = config.training
    if config.backend != "native":
        raise ConfigError("the native loop trains backend native")
    # 1. Where this process stands: its host in the job, its rank among the chips' processes, the mesh.
    world = detect_world(config.world, env)
    device_access.check_tpu_device_access()
    attempt = Attempt(process_start_time(), grace_seconds=config.stop.grace_seconds)
    rt = runtime.start(config.fsdp.mesh)
    record.devices, record.process_index, record.process_count = rt.world_size, rt.rank, rt.world_size
    record.mesh = record.mesh_during_training = {
        "dcn": rt.shape.dcn,
        "data": rt.shape.data,
        "fsdp": rt.shape.fsdp,
        "tensor": rt.shape.tensor,
    }
    channel = (
        stop_module.GlooChannel.over_group(runtime.stop_group())
        if rt.world_size > 1
        else stop_module.LocalChannel()
    )
    stopper = stop_module.StopCoordinator(
        channel, Path(config.stop.request_file) if config.stop.request_file else None
    )
    stopper.install()
    # 2. Output and resume: the same agreement as the xla backend (process 0 decides, all follow).
    output = storage.local_dir(config.output.uri)
    output.mkdir(parents=True, exist_ok=True)
    store = layout.Store(config.output.uri)
    backend = TorchBackend(runtime.checkpoint_group() if rt.world_size > 1 else None)
    resume = _resume_point(store, attempt, world.restart_attempt, backend)
    record.resumed_from = resume.name if resume else None
    # 3. The model, sharded at load; the tokenizer; the prepared rows (process 0 prepares or finds
    # them first and publishes them, then the others read what it published).
    load_started = time.monotonic()
    tokenizer = data.load_tokenizer(config.model, data.model_location(config.model))
    # A LoRA checkpoint holds the adapter only: the base weights come from the source (as on xla).
    weights_from_checkpoint = resume is not None and training.method == "full"
    built = native_model.build(config, rt, weights=not weights_from_checkpoint)
    model = built.model
    record.model_load = {
        "sharded": built.sharded_load,
        "why": built.why or None,
        "weights_from": "checkpoint" if weights_from_checkpoint else "source",
        "seconds": round(time.monotonic() - load_started, 2),
    }
    record.checkpointed_blocks = built.wrapped_layers if config.fsdp.gradient_checkpointing else 0
    # The xla path's model FLOPs (throughput.py): DTensor parameters count their global elements.
    flops = throughput.model_flops(model, reference_forward=training.objective == "dpo")
    record.parameter_sharding = {name: _placement(param) for name, param in model.named_parameters()}
    if config.dataset.packing and (refusal := packing.packing_refusal(model)):
        raise ConfigError(refusal)
    global_batch = training.per_device_batch_size * rt.data_ways
    if not rt.is_rank_zero:
        backend.barrier()
    if training.objective == "dpo":
        dataset, eval_dataset = _preference_datasets(config, tokenizer, global_batch, record, rt.is_rank_zero)
        eval_batches = None
    else:
        dataset, eval_dataset, eval_batches = _datasets(
            config, tokenizer, global_batch, record, rt.is_rank_zero
        )
    if rt.is_rank_zero:
        backend.barrier()
    dpo: preference.Trainer | None = None
    if training.objective == "dpo":  # the reference is rebuilt from the source, never checkpointed
        reference = preference.prepare(model, config, rt)
        record.reference_sharding = reference.sharding()
        dpo = preference.Trainer(
            preference.Settings.of(config, tokenizer),
            reference,
            rt,
            pairs_per_step=global_batch * training.gradient_accumulation_steps,
        )
    record.peak_rss["load"] = host_memory.part_peak()
    # 4. Optimizer, schedule, checkpoints; restored from the resume point (either backend's).
    plan = batches.Plan(
        len(dataset),
        global_batch,
        training.gradient_accumulation_steps,
        training.seed,
        rt.data_rank,
        rt.data_ways,
    )
    order = batches.Order(plan)
    record.rows_per_step = global_batch * training.gradient_accumulation_steps
    total_steps = training.max_steps or _steps_for_epochs(config, dataset, record.rows_per_step)
    optimizer, scheduler = native_optimizer.build(model, training, total_steps)
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
    progress = checkpoints.Progress(
        step=0,
        total_steps=total_steps,
        steps_per_epoch=plan.steps_per_epoch,
        global_batch=global_batch,
        logging_steps=training.logging_steps,
        eval_steps=training.eval_steps,
        save_steps=training.save_steps,
    )
    if resume is not None:
        restored = checkpoints.restore(manager, resume, model, optimizer, scheduler)
        progress.step, progress.log_history = restored.step, restored.log_history
    saves = _SaveLog(attempt, config, stopper, rt.is_rank_zero)
    # A preference pair is two rows of max_seq_length (prompt + chosen, prompt + rejected), as on xla.
    rows_per_step = record.rows_per_step * (2 if dpo is not None else 1)
    reporter = _Reporter(config, total_steps, rows_per_step, rt.is_rank_zero, attempt)
    reporter.events = Events(output, config.output.uri, is_rank_zero=rt.is_rank_zero)
    evaluate: _Evaluator | preference.Evaluator = (
        _Evaluator(model, eval_dataset, eval_batches, global_batch, rt)
        if dpo is None
        else preference.Evaluator(model, dpo, eval_dataset, global_batch)
    )
    # 5. Train.
    try:
        _train(config, env, rt, model, optimizer, scheduler, manager, stopper, attempt, saves, order,
               dataset, progress, evaluate, reporter, record, dpo)  # fmt: skip
        saves.record(manager.wait())
    except BaseException:
        manager.close()
        stopper.close(wait=False)
        raise
    stopper.close()
    record.flops_per_token = flops.per_token(training.max_seq_length)
    record.mfu = throughput.mfu(
        record.tokens_per_second, record.flops_per_token, rt.world_size, config.world.peak_flops_per_chip
    )
    record.peak_rss["train"] = host_memory.part_peak()
    record.attempt = attempt.to_record()
    record.stop_channel_wait_seconds = round(getattr(stopper.channel, "wait_seconds", 0.0), 3)
    if stopper.decided is not None:
        _stopped(record, stopper, attempt, progress.step, output, config, started, rt.is_rank_zero)
    if evaluate.available and recipe.needs_final_evaluation(training.eval_steps, progress.step):
        record.eval_losses[progress.step] = eval_loss = evaluate()
        reporter.events.scalars(progress.step, {"eval/loss": eval_loss})
        reporter.report(progress.step, eval_loss=eval_loss, final=True)
    reporter.events.close()
    # 6. The final model in the standard format, streamed shard group by group (export.py).
    optimizer.state.clear()
    model.zero_grad(set_to_none=True)
    if dpo is not None:
        dpo.reference.release()
    host_memory.release()
    if training.method == "lora":  # the xla backend's files: the adapter, and the merged model if asked
        arguments = native_optimizer.arguments(training, total_steps, output_dir=str(output))
        export.export_adapter(model, tokenizer, backend, output, arguments)
        record.export = {"adapter": True}
        if training.lora and training.lora.save_merged:
            merged = export.export_merged(model, tokenizer, store, backend, output)
            record.export["merged"] = asdict(merged)
    else:
        weights = export.export_weights(export.model_tensors(model), store, backend)
        if rt.is_rank_zero:
            export.write_config(model, output)
            tokenizer.save_pretrained(output)
        record.export = asdict(weights)
    record.peak_rss["export"] = host_memory.part_peak()
    record.final_step = progress.step
    record.seconds = round(time.monotonic() - started, 2)
    if rt.is_rank_zero:
        _write_record(record, output)
        storage.upload(output, config.output.uri)
    backend.barrier()
    return record


def _train(
    config: TrainerConfig,
    env: Mapping[str, str],
    rt: runtime.Runtime,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    manager: CheckpointManager,
    stopper: stop_module.StopCoordinator,
    attempt: Attempt,
    saves: _SaveLog,
    order: batches.Order,
    dataset: Any,
    progress: checkpoints.Progress,
    evaluate: _Evaluator | preference.Evaluator,
    reporter: _Reporter,
    record: RunRecord,
    dpo: preference.Trainer | None = None,
) -> None:
    """Steps from the one after the resume point to the last, or to an agreed stop."""
    import torch

    training = config.training
    sigterm_at = int(env.get(FAULT_SIGTERM_AT_STEP_ENV, "0") or 0)
    kill_at = int(env.get(FAULT_KILL_AT_STEP_ENV, "0") or 0)

    # The loss and the loss-token counts stay on the device until a logging step (the loss) or the
    # end (the counts): reading them at every step would make the host wait for the chips each step.
    def on_device() -> Any:
        return torch.zeros((), dtype=torch.float32, device=rt.device)

    pending_loss, pending_steps = on_device(), 0
    step_times: list[float] = []
    positions: list[int] = []
    loss_token_counts: list[Any] = []  # one device scalar a step
    model.train()
    for step in range(progress.step + 1, progress.total_steps + 1):
        # -- one optimizer step over the global batch (this process's rows of each micro-batch) --
        if dpo is not None:
            done = dpo.step(model, [[dataset[i] for i in rows] for rows in order.micro_batches(step)])
            step_loss, items, here = done.loss, done.loss_tokens, done.positions
        else:
            micro = [
                batches.collate([dataset[i] for i in rows], rt.device) for rows in order.micro_batches(step)
            ]
            items = runtime.batch_sum(sum(batches.loss_tokens(b) for b in micro).to(torch.float32), rt)
            step_loss = on_device()
            for batch in micro:
                loss = model(**batch, num_items_in_batch=items).loss
                (loss * rt.data_ways).backward()  # FSDP2 averages over the batch's parts: undo it
                step_loss += loss.detach().float()
            here = len(micro) * micro[0]["input_ids"].numel()
        grad_norm = (
            native_model.clip_grad_norm(model.parameters(), training.max_grad_norm)
            if training.max_grad_norm > 0
            else None
        )
        optimizer.step()
        scheduler.step()
        learning_rate = scheduler.get_last_lr()[0]  # the next step's, as the Trainer logs it
        optimizer.zero_grad(set_to_none=True)
        progress.step = step
        step_times.append(time.monotonic())
        positions.append(here * rt.data_ways)
        loss_token_counts.append(items.detach())
        attempt.step_ended()
        stopper.training_started()
        saves.record(manager.poll())
        if kill_at and step == kill_at:  # before this step's log and save, as a crashed host dies
            saves.record(manager.wait())
            log.warning("%s=%d: killing this process now", FAULT_KILL_AT_STEP_ENV, kill_at)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
        # -- logging (the loss read to the host only at a logging step), evaluation, progress --
        pending_loss += step_loss
        pending_steps += 1
        logged: float | None = None
        if step % training.logging_steps == 0 or step == progress.total_steps:
            logged = float(runtime.batch_sum(pending_loss.to(torch.float64).cpu(), rt)) / pending_steps
            pending_loss, pending_steps = on_device(), 0
            record.losses[step] = logged
            record.learning_rates[step] = learning_rate
            entry: dict[str, Any] = {"epoch": progress.epoch, "learning_rate": learning_rate, "loss": logged}
            if grad_norm is not None:
                record.grad_norms[step] = entry["grad_norm"] = float(_full(grad_norm))
            if dpo is not None:  # trl's metrics, logged beside the loss as DPOTrainer logs them
                rewards = dpo.metrics()
                entry.update(rewards)
                record.reward_accuracies[step] = reporter.rewards["reward_accuracy"] = rewards[
                    "rewards/accuracies"
                ]
                record.reward_margins[step] = reporter.rewards["reward_margin"] = rewards[preference.MARGINS]
            progress.log_history.append({**entry, "step": step})
            reporter.events.scalars(step, {f"train/{key}": value for key, value in entry.items()})
        eval_loss = None
        if evaluate.available and training.eval_steps and step % training.eval_steps == 0:
            record.eval_losses[step] = eval_loss = evaluate()
            progress.log_history.append({"epoch": progress.epoch, "eval_loss": eval_loss, "step": step})
            reporter.events.scalars(step, {"eval/loss": eval_loss})
        if sigterm_at and step == sigterm_at:
            saves.record(manager.wait())
            log.warning("%s=%d: sending this process SIGTERM", FAULT_SIGTERM_AT_STEP_ENV, sigterm_at)
            os.kill(os.getpid(), signal.SIGTERM)
        # -- the stop agreement, then a save: periodic, requested, a stop's, or the last step's --
        immediate = manager.newest_started is not None and manager.newest_started == step - 1
        decision = stopper.at_step_boundary(
            step, immediate=immediate, last_save=manager.newest_started, in_flight_at=manager.in_flight_at
        )
        if decision.stop and not decision.save:
            log.warning(
                "SIGTERM while checkpoint-%s was being written: finishing it and stopping there "
                "(step %d will be trained again after the restart)",
                decision.resume_step,
                step,
            )
            saves.record(manager.wait())
            reporter.report(step, loss=logged, eval_loss=eval_loss, final=True)
            break
        final = step == progress.total_steps
        periodic = training.save_steps is not None and (step % training.save_steps == 0 or final)
        if decision.save or periodic:
            reason = decision.reason if decision.save else ("final" if final else "periodic")
            if decision.save:
                log.info("checkpointing at step %d: %s", step, reason)
            checkpoints.save(
                manager, model, optimizer, scheduler, progress, reason=reason, blocking=reason != "periodic"
            )
            reporter.events.publish()
            if reason == "periodic" and stopper.after_save_staged(step).stop:
                log.warning(
                    "SIGTERM while checkpoint-%d was being saved: finishing it and stopping there", step
                )
                saves.record(manager.wait())
                reporter.report(step, loss=logged, eval_loss=eval_loss, final=True)
                break
            saves.record(manager.poll())
        reporter.report(step, loss=logged, eval_loss=eval_loss, final=final or decision.stop)
        if decision.stop:
            break
    record.tokens = sum(positions)
    record.loss_tokens = int(torch.stack(loss_token_counts).double().sum()) if loss_token_counts else 0
    record.step_seconds = [round(b - a, 4) for a, b in itertools.pairwise(step_times)]
    if len(step_times) > 1:
        record.tokens_per_second = round(sum(positions[1:]) / (step_times[-1] - step_times[0]), 1)


def _full(value: Any) -> Any:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _placement(param: Any) -> str:
    placements = getattr(param, "placements", None)
    return str(tuple(placements)) if placements is not None else "local"


class _Evaluator:
    """The evaluation loss: the mean over every real token of the evaluation rows (full global
    batches, evaluation.py), each process reading its rows of each batch."""

    def __init__(
        self,
        model: Any,
        rows: Any,
        figures: evaluation.EvalBatches | None,
        global_batch: int,
        rt: runtime.Runtime,
    ) -> None:
        self.model, self.rows, self.figures, self.global_batch, self.rt = (
            model,
            rows,
            figures,
            global_batch,
            rt,
        )

    @property
    def available(self) -> bool:
        return self.rows is not None and self.figures is not None

    def __call__(self) -> float:
        import torch

        assert self.figures is not None
        per = self.global_batch // self.rt.data_ways
        total = torch.zeros(2, dtype=torch.float64)
        self.model.eval()
        with torch.no_grad():
            for index in range(self.figures.batches):
                start = index * self.global_batch + self.rt.data_rank * per
                batch = batches.collate([self.rows[i] for i in range(start, start + per)], self.rt.device)
                summed = self.model(**batch, num_items_in_batch=1).loss
                total += torch.stack([summed.detach().double().cpu(), batches.loss_tokens(batch).double()])
        native_model.reshard(self.model)  # else a save at this step finds the root's parameters gathered
        self.model.train()
        runtime.batch_sum(total, self.rt)
        return float(total[0] / total[1].clamp(min=1))


class _Reporter:
    """Progress from rank 0 (progress.py's meter and sinks), a line per step."""

    def __init__(
        self,
        config: TrainerConfig,
        total_steps: int,
        rows_per_step: int,
        is_rank_zero: bool,
        attempt: Attempt,
    ) -> None:
        self.meter = Meter(total_steps, tokens_per_step=rows_per_step * config.training.max_seq_length)
        self.sinks: list[Sink] = (
            [LogBar(total_steps), StatusReporter(config.progress)] if is_rank_zero else []
        )
        self.is_rank_zero, self.attempt = is_rank_zero, attempt
        self.last_loss: float | None = None
        self.last_loss_step: int | None = None
        self.last_eval_loss: float | None = None
        self.rewards: dict[str, float] = {}  # objective dpo: the last logged reward accuracy and margin
        self.events: Events  # set by run(), once the output directory is known

    def report(
        self, step: int, *, loss: float | None = None, eval_loss: float | None = None, final: bool = False
    ) -> None:
        if loss is not None:
            self.last_loss, self.last_loss_step = loss, step
        if eval_loss is not None:
            self.last_eval_loss = eval_loss
        if not self.is_rank_zero:
            return
        snapshot = self.meter.update(step, self.last_loss, self.last_eval_loss, loss_step=self.last_loss_step)
        snapshot = replace(
            snapshot,
            details=self.attempt.to_status(),
            reward_accuracy=self.rewards.get("reward_accuracy"),
            reward_margin=self.rewards.get("reward_margin"),
        )
        log.info("progress: %s", snapshot.to_line())
        for sink in self.sinks:
            try:
                sink.report(snapshot, final=final)
            except Exception as error:  # sinks swallow their own errors; this is belt and braces
                log.warning("progress sink %s failed: %s", type(sink).__name__, error)
