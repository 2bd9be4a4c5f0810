"""The training recipe as Trainer arguments: schedule, warmup, weight decay, clipping, accumulation,
evaluation. Light (no torch): the values are transformers' own names, so its schedulers and its
clipping do the work."""

from __future__ import annotations

from typing import Any

from tpuft_trainer.config import TrainingConfig

# Our names -> transformers' SchedulerType values. Every one of them warms up linearly first.
SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup"}


def warmup(training: TrainingConfig) -> float:
    """transformers' ``warmup_steps``: whole steps, or a fraction of the run when below 1."""
    if training.warmup_steps is not None:
        return training.warmup_steps
    return training.warmup_ratio or 0


def training_arguments(training: TrainingConfig, *, global_batch: int, evaluates: bool) -> dict[str, Any]:
    """Keyword arguments for ``TrainingArguments`` (besides length, batch, output and FSDPv2)."""
    arguments: dict[str, Any] = dict(
        lr_scheduler_type=SCHEDULERS[training.lr_scheduler],
        warmup_steps=warmup(training),
        weight_decay=training.weight_decay,
        max_grad_norm=training.max_grad_norm,
        gradient_accumulation_steps=training.gradient_accumulation_steps,
    )
    if evaluates:
        arguments.update(
            eval_strategy="steps" if training.eval_steps else "no",
            eval_steps=training.eval_steps,
            per_device_eval_batch_size=global_batch,  # under SPMD the "per device" batch is the mesh's
            # Only the loss: gathering every logit to the host would cost more than the evaluation.
            prediction_loss_only=True,
        )
    return arguments


def needs_final_evaluation(eval_steps: int | None, final_step: int) -> bool:
    """The Trainer evaluates at multiples of eval_steps; the end gets one more unless it just did."""
    return not eval_steps or final_step % eval_steps != 0
