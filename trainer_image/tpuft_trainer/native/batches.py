"""Which rows each process trains on at each step: a pure function of (seed, step), so a resumed run
reads exactly the rows the uninterrupted one would have, on any number of processes.

The order is the xla backend's: the Trainer's data loader draws each epoch's order as
``torch.randperm(rows, generator seeded with seed + epoch)`` (accelerate's seedable sampler, with
``data_seed = seed``) and cuts it into consecutive global batches, dropping a last partial one. A step
takes ``gradient_accumulation_steps`` such batches; within each, the process of data-parallel rank r
(of n) takes rows ``[r x b, (r + 1) x b)`` with b = the per-device batch: every process reads only
its own rows from the memory-mapped prepared dataset.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Plan:
    rows: int  # the training rows
    global_batch: int  # per_device_batch_size x processes
    accumulation: int
    seed: int
    rank: int
    processes: int

    @property
    def batches_per_epoch(self) -> int:
        return self.rows // self.global_batch

    @property
    def steps_per_epoch(self) -> int:
        """The Trainer's: whole accumulation rounds of the epoch's batches (at least one)."""
        return max(1, self.batches_per_epoch // self.accumulation)

    @property
    def per_process(self) -> int:
        return self.global_batch // self.processes


class Order:
    """Each epoch's permutation, computed once when first asked for."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._epochs: dict[int, list[int]] = {}

    def epoch(self, epoch: int) -> list[int]:
        if epoch not in self._epochs:
            import torch

            generator = torch.Generator()
            generator.manual_seed(self.plan.seed + epoch)
            self._epochs = {epoch: torch.randperm(self.plan.rows, generator=generator).tolist()}
        return self._epochs[epoch]

    def micro_batches(self, step: int) -> list[list[int]]:
        """This process's row indices for each micro-batch of ``step`` (1-based, as the Trainer counts)."""
        plan = self.plan
        epoch, within = divmod(step - 1, plan.steps_per_epoch)
        order = self.epoch(epoch)
        out = []
        for micro in range(plan.accumulation):
            batch = within * plan.accumulation + micro
            start = batch * plan.global_batch + plan.rank * plan.per_process
            out.append(order[start : start + plan.per_process])
        return out


def collate(rows: Sequence[dict[str, Any]], device: Any) -> dict[str, Any]:
    """Rows (numpy arrays of one length) stacked into tensors on ``device``."""
    import numpy as np
    import torch

    return {key: torch.from_numpy(np.stack([row[key] for row in rows])).to(device) for key in rows[0]}


def loss_tokens(batch: dict[str, Any]) -> Any:
    """The positions that count in a causal LM's loss: labels after the shift (what the Trainer counts)."""
    return (batch["labels"][..., 1:] != -100).sum()
