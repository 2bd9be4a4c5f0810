"""The materials and configurations `tpuft train` tests share: a tiny Llama and datasets built once per
session, configurations that the operator's contract validates, and readers of what a run left."""

from __future__ import annotations

import json
import re
import tempfile
import threading
from pathlib import Path
from typing import Any

import tiny
import yaml
from spmd import Proc, run_train

from tpuft_trainer.config import TrainerConfig

_lock = threading.Lock()
_materials: dict[str, Path] = {}


def materials() -> dict[str, Path]:
    """A tiny Llama directory and datasets, built once per session (nothing downloaded)."""
    with _lock:
        if not _materials:
            root = Path(tempfile.mkdtemp(prefix="tpuft-materials-"))
            _materials["model"] = tiny.save_model_dir(root / "llama")
            _materials["text"] = tiny.write_jsonl(root / "text.jsonl")
            _materials["chat"] = tiny.write_jsonl(root / "chat.jsonl", chat=True)
            _materials["pairs"] = tiny.write_rows(root / "pairs.jsonl", tiny.preference_pairs())
            _materials["chat_pairs"] = tiny.write_rows(
                root / "chat_pairs.jsonl", tiny.preference_pairs(chat=True)
            )
        return _materials


def write_config(overrides: dict[str, Any]) -> tuple[Path, Path]:
    m = materials()
    out = Path(tempfile.mkdtemp(prefix="tpuft-out-"))
    config: dict[str, Any] = {
        "model": {"name": str(m["model"]), "dtype": "float32"},
        "dataset": {"name": str(m["text"])},
        "training": {
            "max_steps": 8,
            "learning_rate": 0.01,
            "per_device_batch_size": 2,
            "max_seq_length": 32,
            "save_steps": 4,
        },
        "output": {"uri": str(out / "model")},
        "world": {"chips_per_host": 4},
        "progress": {"namespace": "default", "name": "demo", "min_interval_seconds": 0},
    }
    for section, values in overrides.items():
        if isinstance(values, dict):
            config.setdefault(section, {}).update(values)
        else:
            config[section] = values
    TrainerConfig.model_validate(config)  # the same contract the operator renders
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, out / "model"


def metrics(output: Path) -> dict[str, Any]:
    return json.loads((output / "tpuft-metrics.json").read_text())  # type: ignore[no-any-return]


def losses(record: dict[str, Any]) -> dict[int, float]:
    return {int(step): loss for step, loss in record["losses"].items()}


def logged_losses(proc: Proc) -> dict[int, float]:
    """Rank 0's `progress: step S/T | loss L` lines (a killed run writes no metrics file)."""
    found = re.findall(r"progress: step (\d+)/\d+ \| loss ([\d.]+)", proc.stderr)
    return {int(step): float(loss) for step, loss in found}


def checkpoint_lines(proc: Proc) -> str:
    """The lines of a run's log that name a checkpoint (what it resumed from, skipped, removed)."""
    return "\n".join(line for line in proc.stderr.splitlines() if "checkpoint-" in line)


def full() -> tuple[Proc, Path]:
    """The reference run: 8 steps, a checkpoint every 4 (the same function in every module's
    SPMD_JOBS under the same name runs once per session)."""
    config, output = write_config({})
    return run_train(config), output
