"""The native loop's checkpoints: the same layout, keys and small files as the xla backend's.

The sharded state goes through ``CheckpointManager`` with ``TorchBackend`` (DTensors: each process
writes its shards) under checkpoint/state.py's names (``model.<HF name>``, ``optim.<HF name>.<key>``);
the small files are the Trainer's own formats, so either backend resumes the other's checkpoints:
``trainer_state.json`` (transformers' TrainerState: the step, the epoch, the logs), ``scheduler.pt``
(the LambdaLR's state_dict), ``rng_state.pth`` (python, numpy and torch's CPU generators) and
``optimizer.json`` (state.py's extras).
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import random
from dataclasses import dataclass, field
from typing import Any, cast

from tpuft_trainer.checkpoint import layout, state
from tpuft_trainer.checkpoint.manager import CheckpointManager

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """What trainer_state.json records of the loop (the TrainerState fields a resume reads)."""

    step: int
    total_steps: int
    steps_per_epoch: int
    global_batch: int
    logging_steps: int
    eval_steps: int | None
    save_steps: int | None
    log_history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def epoch(self) -> float:
        return self.step / self.steps_per_epoch


def trainer_state_json(progress: Progress) -> str:
    """transformers' TrainerState as its ``save_to_json`` writes it."""
    import math

    from transformers import TrainerControl, TrainerState

    trainer_state = TrainerState(
        epoch=progress.epoch,
        global_step=progress.step,
        max_steps=progress.total_steps,
        logging_steps=progress.logging_steps,
        eval_steps=progress.eval_steps or 500,
        save_steps=progress.save_steps or 500,
        train_batch_size=progress.global_batch,
        num_train_epochs=math.ceil(progress.total_steps / progress.steps_per_epoch),
        log_history=list(progress.log_history),
        stateful_callbacks=cast(
            Any, {"TrainerControl": TrainerControl().state()}
        ),  # (its __post_init__ takes a dict too)
    )
    return json.dumps(dataclasses.asdict(trainer_state), indent=2, sort_keys=True) + "\n"


def small_files(progress: Progress, scheduler: Any, extras: dict[str, Any]) -> dict[str, bytes]:
    import numpy as np
    import torch

    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    return {
        layout.TRAINER_STATE: trainer_state_json(progress).encode(),
        layout.SCHEDULER: _torch_bytes(scheduler.state_dict()),
        layout.RNG_STATE: _torch_bytes(rng),
        layout.OPTIMIZER_EXTRAS: state.dumps_extras(extras).encode(),
    }


def save(
    manager: CheckpointManager,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    progress: Progress,
    *,
    reason: str,
    blocking: bool,
) -> None:
    names = state.parameter_names(model)
    optim_tensors, extras = state.optimizer_state(optimizer, names)
    manager.save(
        progress.step,
        state.stateful_tensors(state.trainable_state(model), optim_tensors),
        lambda: small_files(progress, scheduler, extras),
        reason=reason,
        blocking=blocking,
    )


@dataclass(frozen=True)
class Restored:
    step: int
    log_history: list[dict[str, Any]]


def restore(
    manager: CheckpointManager, found: layout.Found, model: Any, optimizer: Any, scheduler: Any
) -> Restored:
    """Weights, optimizer (tensors in place, then its plain values), scheduler and RNG from ``found``
    (either backend's), resharded to this run's processes by DCP."""
    import numpy as np
    import torch

    names = state.parameter_names(model)
    if state.missing_optimizer_state(optimizer):
        manager.backend.prime_optimizer(optimizer)  # changes the weights: they are loaded after it
    optim_tensors, _ = state.optimizer_state(optimizer, names)
    extras = manager.load(found, state.stateful_tensors(state.trainable_state(model), optim_tensors))
    state.restore_extras(optimizer, names, extras)
    store = manager.store
    scheduler.load_state_dict(
        torch.load(io.BytesIO(_read_bytes(store, found.name, layout.SCHEDULER)), weights_only=True)
    )
    from transformers.trainer_pt_utils import safe_globals

    with safe_globals():  # numpy's generator state, as the Trainer allows it when it reads this file
        rng = torch.load(io.BytesIO(_read_bytes(store, found.name, layout.RNG_STATE)), weights_only=True)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.random.set_rng_state(rng["cpu"])
    trainer_state = json.loads(store.read_text(found.name, layout.TRAINER_STATE))
    log.info("restored weights, optimizer, scheduler and RNG from %s", store.url(found.name))
    return Restored(int(trainer_state["global_step"]), list(trainer_state.get("log_history") or []))


def _read_bytes(store: layout.Store, *parts: str) -> bytes:
    with store.fs.open(store.path(*parts), "rb") as file:
        return bytes(file.read())


def _torch_bytes(value: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()
