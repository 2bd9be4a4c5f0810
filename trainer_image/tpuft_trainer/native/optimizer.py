"""The optimizer and learning-rate schedule, built as the xla backend's Trainer builds them.

Checkpoints are interchangeable between the backends only if the optimizer is the same: the same class
with the same hyperparameters (transformers' own ``Trainer.get_optimizer_cls_and_kwargs`` for
``adafactor`` / ``adamw_torch``), and the same two parameter groups in the same order (those that
decay, those that do not: ``Trainer.get_decay_parameter_names``), so optimizer.json's groups match
parameter for parameter (checkpoint/state.py). The schedule is transformers' ``get_scheduler`` with
the Trainer's warmup rule. No Trainer is built: only its arguments, which compute nothing.
"""

from __future__ import annotations

import tempfile
from typing import Any

from tpuft_trainer import compat, recipe
from tpuft_trainer.config import TrainingConfig

OPTIMIZERS = {"adafactor": "adafactor", "adamw": "adamw_torch"}


def arguments(training: TrainingConfig, total_steps: int, output_dir: str | None = None) -> Any:
    """The TrainingArguments whose optimizer and schedule settings the xla backend's Trainer uses
    (``output_dir``: what training_args.bin records, beside a LoRA run's adapter)."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir or tempfile.gettempdir(),  # never written: no Trainer is built from these
        max_steps=total_steps,
        learning_rate=training.learning_rate,
        optim=OPTIMIZERS[training.optimizer],
        seed=training.seed,
        report_to=[],
        **recipe.training_arguments(training, global_batch=1, evaluates=False),
    )


def build(model: Any, training: TrainingConfig, total_steps: int) -> tuple[Any, Any]:
    """(optimizer, scheduler) for ``model``'s trainable parameters."""
    from transformers import Trainer, get_scheduler

    args = arguments(training, total_steps)
    decay = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]  # (self unused)
    named = list(model.named_parameters())
    groups = [
        {
            "params": [p for n, p in named if n in decay and p.requires_grad],
            "weight_decay": args.weight_decay,
        },
        {"params": [p for n, p in named if n not in decay and p.requires_grad], "weight_decay": 0.0},
    ]
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    optimizer = optimizer_cls(groups, **kwargs)
    if training.optimizer == "adafactor":
        compat.adafactor_dtensor_state(optimizer)
    scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=args.get_warmup_steps(total_steps),
        num_training_steps=total_steps,
    )
    return optimizer, scheduler
