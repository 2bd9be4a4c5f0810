"""The CheckpointManager wired into a transformers ``Trainer`` (or trl's ``DPOTrainer``).

The Trainer keeps what it does well (when to save, the data position, skipping the batches already
trained on after a resume, RNG and scheduler bookkeeping); ``ShardedCheckpoints`` replaces what it
cannot do at scale, through the Trainer's own hooks rather than patches:

- ``_save_checkpoint``: the model's trainable weights and the optimizer's state as sharded DCP state
  (each process writes its own chunks) through the manager, asynchronously unless this is a stop's or
  the last step's save; the Trainer's state, scheduler and RNG as small files from rank 0.
- ``_load_from_checkpoint``: nothing. The weights are loaded together with the optimizer state
  (next hook), because creating that state first (priming) changes the weights.
- ``_load_optimizer_and_scheduler``: prime the optimizer, load weights and optimizer state in place
  (DCP reshards to the current mesh), set its non-tensor state back, load the scheduler.
- ``_load_rng_state``: the generators from the RNG file rank 0 wrote (under SPMD every process runs
  the same program with the same generators), from the local copy of the small files
  (``prepare_resume``). Not the Trainer's own: it reads ``rng_state_<process>.pth`` with several
  processes, and under XLA it requires an ``xla`` entry, which a checkpoint of the native backend
  (no XLA generator) does not have (``KeyError: 'xla'`` resuming one).
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import random
from collections.abc import Callable
from typing import Any

from tpuft_trainer.checkpoint import layout, state
from tpuft_trainer.checkpoint.manager import CheckpointManager

log = logging.getLogger(__name__)


class TrainerCheckpoints:
    """What the Trainer subclass calls: saving now, and restoring the checkpoint found at start."""

    def __init__(
        self,
        manager: CheckpointManager,
        *,
        resume: layout.Found | None = None,
        after_staging: Callable[[Any, int], None] | None = None,
    ) -> None:
        self.manager = manager
        self.resume = resume
        # Called after a periodic save's staging (its write has just begun): the stop logic may
        # decide to finish this save and stop here, rather than train another step.
        self.after_staging = after_staging
        self.reason = "periodic"  # why the next save happens (the stop callback sets it)

    def save(self, trainer: Any) -> None:
        step = int(trainer.state.global_step)
        reason, self.reason = self.reason, "periodic"
        if reason == "periodic" and step >= int(trainer.state.max_steps):
            reason = "final"  # the last step's save: synchronous, then the export reads a quiet host
        model = trainer.model
        names = state.parameter_names(model)
        optim_tensors, extras = state.optimizer_state(trainer.optimizer, names)
        self.manager.save(
            step,
            state.stateful_tensors(state.trainable_state(model), optim_tensors),
            lambda: _small_files(trainer, extras),
            reason=reason,
            blocking=reason != "periodic",
        )
        if reason == "periodic" and self.after_staging is not None:
            self.after_staging(trainer, step)

    def prepare_resume(self, trainer: Any, local_dir: str) -> str | None:
        """The local directory to hand ``Trainer.train(resume_from_checkpoint=...)``: the resumed
        checkpoint's small files (the Trainer reads its state there), or None to start afresh."""
        if self.resume is None:
            return None
        return self.manager.fetch_small_files(self.resume, local_dir)

    def restore_rng(self, checkpoint_dir: str) -> None:
        """Python's, NumPy's, torch's CPU and (when there is one) XLA's generators from the checkpoint."""
        import numpy as np
        import torch
        from transformers.trainer_pt_utils import safe_globals

        with safe_globals():  # numpy's generator state, as the Trainer allows it when it reads this file
            rng = torch.load(os.path.join(checkpoint_dir, layout.RNG_STATE), weights_only=True)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.random.set_rng_state(rng["cpu"])
        try:
            import torch_xla.core.xla_model as xm
        except ImportError:
            return
        if "xla" in rng:
            xm.set_rng_state(rng["xla"])
        else:
            name = self.resume.name if self.resume else checkpoint_dir
            log.info(
                "%s has no XLA generator state (the native backend wrote it): XLA's keeps its seed", name
            )

    def restore(self, trainer: Any, checkpoint_dir: str) -> None:
        """Weights, optimizer and scheduler from the resumed checkpoint (``checkpoint_dir`` holds its small files)."""
        import torch

        assert self.resume is not None, "restore() without a checkpoint to resume from"
        model, optimizer = trainer.model, trainer.optimizer
        names = state.parameter_names(model)
        if state.missing_optimizer_state(optimizer):
            self.manager.backend.prime_optimizer(optimizer)
        optim_tensors, _ = state.optimizer_state(optimizer, names)
        extras = self.manager.load(
            self.resume, state.stateful_tensors(state.trainable_state(model), optim_tensors)
        )
        state.restore_extras(optimizer, names, extras)
        scheduler = torch.load(os.path.join(checkpoint_dir, layout.SCHEDULER), weights_only=True)
        trainer.lr_scheduler.load_state_dict(scheduler)
        log.info(
            "restored weights, optimizer and scheduler from %s", self.manager.store.url(self.resume.name)
        )


def _small_files(trainer: Any, extras: dict[str, Any]) -> dict[str, bytes]:
    """Rank 0's small files of a checkpoint, as of now (the Trainer's own formats)."""
    import numpy as np
    import torch
    from transformers.trainer_callback import ExportableState

    trainer.store_flos()
    # What Trainer._save_checkpoint does before writing its state: stateful callbacks' state.
    for callback in [*trainer.callback_handler.callbacks, trainer.control]:
        if isinstance(callback, ExportableState):
            name = type(callback).__name__
            if isinstance(trainer.state.stateful_callbacks.get(name), list):
                trainer.state.stateful_callbacks[name].append(callback.state())
            else:
                trainer.state.stateful_callbacks[name] = callback.state()
    trainer_state = json.dumps(dataclasses.asdict(trainer.state), indent=2, sort_keys=True) + "\n"
    rng: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    try:
        import torch_xla.core.xla_model as xm

        rng["xla"] = xm.get_rng_state()
    except ImportError:
        pass
    return {
        layout.TRAINER_STATE: trainer_state.encode(),
        layout.SCHEDULER: _torch_bytes(trainer.lr_scheduler.state_dict()),
        layout.RNG_STATE: _torch_bytes(rng),
        layout.OPTIMIZER_EXTRAS: state.dumps_extras(extras).encode(),
    }


def _torch_bytes(value: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


class ShardedCheckpoints:
    """Mixin for a transformers Trainer class: checkpoints through ``tpuft_checkpoints`` when set
    (``with_sharded_checkpoints``), the Trainer's own behaviour otherwise."""

    tpuft_checkpoints: TrainerCheckpoints | None = None

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if self.tpuft_checkpoints is None:
            return super()._save_checkpoint(model, trial)  # type: ignore[misc]
        self.tpuft_checkpoints.save(self)
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self.tpuft_checkpoints is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        return None  # loaded with the optimizer state, in _load_optimizer_and_scheduler

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if self.tpuft_checkpoints is None or checkpoint is None:
            return super()._load_rng_state(checkpoint)  # type: ignore[misc]
        self.tpuft_checkpoints.restore_rng(checkpoint)
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self.tpuft_checkpoints is None:
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        if checkpoint is not None:
            self.tpuft_checkpoints.restore(self, checkpoint)
        return None


_CLASSES: dict[type, type] = {}


def with_sharded_checkpoints(trainer_class: type) -> type:
    """``trainer_class`` with ``ShardedCheckpoints`` mixed in (one class per base)."""
    if trainer_class not in _CLASSES:
        _CLASSES[trainer_class] = type(trainer_class.__name__, (ShardedCheckpoints, trainer_class), {})
    return _CLASSES[trainer_class]
