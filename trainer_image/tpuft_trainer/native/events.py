"""The run's TensorBoard events, from rank 0, under the tags the xla backend's Trainer writes through
transformers' TensorBoardCallback (``train/loss``, ``train/learning_rate``, ``train/grad_norm``,
``train/epoch``, ``eval/loss``), into ``<output>/tensorboard``: copied to the output URI at each save
(as train.py's upload callback does), so TensorBoard reads a run while it goes, and with the output at
the end. A run that changes backend keeps one curve: the steps continue."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tpuft_trainer import storage
from tpuft_trainer.train import TENSORBOARD_DIR


class Events:
    """Rank 0 writes; on the other processes every call does nothing."""

    def __init__(self, output: Path, output_uri: str, *, is_rank_zero: bool) -> None:
        self._directory = output / TENSORBOARD_DIR
        self._uri = output_uri
        self._writer: Any = None
        if is_rank_zero:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self._directory))

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        if self._writer is None:
            return
        for tag, value in values.items():
            if value is not None:
                self._writer.add_scalar(tag, value, step)

    def publish(self) -> None:
        """At a save: the events so far, to the output URI."""
        if self._writer is None:
            return
        self._writer.flush()
        storage.upload(self._directory, self._uri, TENSORBOARD_DIR)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
