"""The native backend (FSDP2 + DTensor + DCP, one process per chip; gloo on CPU) through `tpuft train`
in its own venv (`scripts/venv.sh native`: torch 2.15, no torch_xla), on a tiny Llama:

- 2 processes x FSDP2 give the losses of 1 process on the same global batch (8 rows);
- a run killed after a save resumes to the uninterrupted run's losses; resharding 2 -> 1 and 1 -> 2;
- the meta-device model with a sliced safetensors load gives from_pretrained's logits;
- checkpoints cross backends: an xla checkpoint resumed by native, a native one by xla.
The runs are shared between assertions (a few chains on the session pool)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from runs import logged_losses, losses, materials, metrics, write_config
from spmd import Pool, Proc, run_train, spmd_env

pytestmark = pytest.mark.trainer

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
TIMEOUT = 600
# The same global batch of 8 rows on every process count (per-device batch x processes).
NATIVE = {"backend": "native", "training": {"per_device_batch_size": 4}, "world": {"chips_per_host": 2}}


@functools.cache
def native_python() -> str:
    path = subprocess.run(
        [str(ROOT / "scripts" / "venv.sh"), "native", "--path"], capture_output=True, text=True, check=True
    ).stdout.strip()
    python = Path(path) / "bin" / "python"
    if not (Path(path) / ".complete").is_file():
        pytest.fail(
            f"the native backend's venv is missing at {path}: run `scripts/venv.sh native` (or make venv-native)"
        )
    return str(python)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def native_env(**extra: str) -> dict[str, str]:
    env = spmd_env(1, **extra)
    env["PYTHONPATH"] = os.pathsep.join(str(ROOT / p) for p in ("operator", "trainer_image"))
    env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(_free_port())
    return env


def run_native(config: Path, **env: str) -> Proc:
    done = subprocess.run(
        [native_python(), "-m", "tpuft_operator", "train", "--config", str(config)],
        env=native_env(**env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    return Proc(done.returncode, done.stdout, done.stderr)


def native_config(chips: int, **training: Any) -> tuple[Path, Path]:
    body = {
        **NATIVE,
        "training": {"per_device_batch_size": 8 // chips, **training},
        "world": {"chips_per_host": chips},
    }
    return write_config(body)


def variant(config: Path, name: str, **changes: Any) -> Path:
    """The same run (same output) with top-level sections replaced or updated."""
    body = yaml.safe_load(config.read_text())
    for section, values in changes.items():
        if isinstance(values, dict):
            body.setdefault(section, {}).update(values)
        else:
            body[section] = values
    path = config.with_name(name)
    path.write_text(yaml.safe_dump(body))
    return path


def keep_only(output: Path, checkpoint: str, into: Path) -> Path:
    """A copy of a finished run's output holding one checkpoint and its prepared data (a run to resume)."""
    shutil.copytree(output, into)
    for path in into.glob("checkpoint-*"):
        if path.name != checkpoint:
            shutil.rmtree(path)
    (into / "tpuft-metrics.json").unlink()
    return into


def two_then_one_then_xla() -> dict[str, Any]:
    """2 processes, 8 steps, checkpoints 4 and 8; its checkpoint-4 resumed on 1 process (2 -> 1), and
    by the xla backend on 4 PJRT CPU devices (2 rows each: the same global batch)."""
    config, output = native_config(2)
    two = run_native(config)
    resumed_on_one = keep_only(output, "checkpoint-4", output.parent / "on-one")
    one = run_native(
        variant(config, "one.yaml", training={"per_device_batch_size": 8}, world={"chips_per_host": 1},
                output={"uri": str(resumed_on_one)})
    )  # fmt: skip
    by_xla = keep_only(output, "checkpoint-4", output.parent / "by-xla")
    xla = run_train(
        variant(config, "xla.yaml", backend="xla", training={"per_device_batch_size": 2},
                world={"chips_per_host": 4}, output={"uri": str(by_xla)}),
        4,
    )  # fmt: skip
    return {"two": (two, output), "two_to_one": (one, resumed_on_one), "to_xla": (xla, by_xla)}


def one_then_two() -> dict[str, Any]:
    """1 process, 8 steps; its checkpoint-4 resumed on 2 processes (1 -> 2)."""
    config, output = native_config(1)
    one = run_native(config)
    resumed = keep_only(output, "checkpoint-4", output.parent / "on-two")
    two = run_native(
        variant(config, "two.yaml", training={"per_device_batch_size": 4}, world={"chips_per_host": 2},
                output={"uri": str(resumed)})
    )  # fmt: skip
    return {"one": (one, output), "one_to_two": (two, resumed)}


def killed_then_resumed() -> tuple[Proc, Proc, Path, list[str]]:
    """2 processes, checkpoints every 2 steps, both killed (SIGKILL) at the end of step 5; then started
    again as a restarted pod would be."""
    config, output = native_config(2, save_steps=2)
    killed = run_native(config, TPUFT_FAULT_KILL_AT_STEP="5")
    left = sorted(p.name for p in output.glob("checkpoint-*"))
    resumed = run_native(config, TPUFT_RESTART_ATTEMPT="1")
    return killed, resumed, output, left


def xla_then_native() -> tuple[Proc, Proc, Path]:
    """The xla backend's 8 steps on 4 devices; its checkpoint-4 resumed by native on 2 processes."""
    config, output = write_config({})
    xla = run_train(config)
    copy = keep_only(output, "checkpoint-4", output.parent / "by-native")
    native = run_native(
        variant(config, "native.yaml", backend="native", training={"per_device_batch_size": 4},
                world={"chips_per_host": 2}, output={"uri": str(copy)})
    )  # fmt: skip
    return xla, native, copy


def meta_load() -> dict[str, Any]:
    out = Path(tempfile.mkdtemp()) / "result.json"
    env = native_env()
    done = subprocess.run(
        [native_python(), "-m", "torch.distributed.run", "--nproc-per-node=2",
         f"--master-port={env['MASTER_PORT']}", str(HERE / "native_cases.py"), "meta_load",
         str(materials()["model"]), str(out)],
        env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())  # type: ignore[no-any-return]


SPMD_JOBS = {
    "native:two": two_then_one_then_xla,
    "native:one": one_then_two,
    "native:killed": killed_then_resumed,
    "native:from-xla": xla_then_native,
    "native:meta-load": meta_load,
}


def _ok(proc: Proc) -> None:
    assert proc.returncode == 0, proc.tail()


def test_the_native_entry_point_imports_without_torch_xla() -> None:
    code = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('torch_xla') is None, 'torch_xla is installed in the native venv'\n"
        "import tpuft_trainer.cli, tpuft_trainer.native.launcher, tpuft_trainer.native.loop\n"
        "assert 'torch_xla' not in sys.modules\n"
        "import torch; print(torch.__version__)\n"
    )
    done = subprocess.run([native_python(), "-c", code], env=native_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("2.15."), done.stdout


def test_two_processes_give_the_losses_of_one(pool: Pool) -> None:
    two, two_out = pool.get("native:two")["two"]
    one, one_out = pool.get("native:one")["one"]
    _ok(two)
    _ok(one)
    assert "--nproc-per-node=2" in two.stderr and "rank 1 of 2" in two.stderr
    sharded, whole = losses(metrics(two_out)), losses(metrics(one_out))
    assert sorted(sharded) == list(range(1, 9))
    assert sharded == pytest.approx(whole, abs=1e-6, rel=0)
    assert sharded[8] < sharded[1] - 1.0  # it learns
    record = metrics(two_out)
    assert record["process_count"] == 2 and record["mesh"]["fsdp"] == 2
    assert all("Shard(dim=0)" in p for p in record["parameter_sharding"].values())
    # The final export reloads as a standard model.
    assert (two_out / "model.safetensors").is_file() and (two_out / "config.json").is_file()


def test_a_killed_run_resumes_to_the_uninterrupted_losses(pool: Pool) -> None:
    killed, resumed, output, left = pool.get("native:killed")
    reference = losses(metrics(pool.get("native:two")["two"][1]))
    assert killed.returncode == 128 + 9, killed.tail()
    assert left == ["checkpoint-2", "checkpoint-4"], left
    assert logged_losses(killed) == pytest.approx({s: reference[s] for s in range(1, 5)}, abs=1e-4)
    _ok(resumed)
    record = metrics(output)
    assert record["resumed_from"] == "checkpoint-4"
    assert losses(record) == {step: reference[step] for step in range(5, 9)}  # exact: same processes


def test_resharding_two_to_one_and_one_to_two(pool: Pool) -> None:
    runs_two, runs_one = pool.get("native:two"), pool.get("native:one")
    reference = losses(metrics(runs_two["two"][1]))
    for proc, output in (runs_two["two_to_one"], runs_one["one_to_two"]):
        _ok(proc)
        record = metrics(output)
        assert record["resumed_from"] == "checkpoint-4"
        assert record["model_load"]["weights_from"] == "checkpoint"
        assert losses(record) == pytest.approx({s: reference[s] for s in range(5, 9)}, abs=1e-6, rel=0)


def test_the_sliced_meta_load_gives_from_pretrained_logits(pool: Pool) -> None:
    result = pool.get("native:meta-load")
    assert result["sharded_load"] and result["world_size"] == 2 and result["wrapped_layers"] == 2
    assert result["not_sharded"] == [], result
    assert result["max_abs_diff"] <= 1e-5, result


def test_checkpoints_cross_backends(pool: Pool) -> None:
    """Not bit-equal across backends (XLA's CPU kernels and torch's differ): the native run resumed
    from the xla checkpoint starts at the right step and follows the xla run's losses closely. The
    reverse is a known gap, asserted as it is so that a fix shows up here."""
    xla, native, copy = pool.get("native:from-xla")
    _ok(xla)
    _ok(native)
    by_native = metrics(copy)
    assert by_native["resumed_from"] == "checkpoint-4"
    xla_losses = losses(metrics(copy.parent / "model"))
    assert losses(by_native) == pytest.approx({s: xla_losses[s] for s in range(5, 9)}, abs=1e-3)
    # The other way, xla (torch 2.9) cannot read torch 2.15's DCP index ("its .metadata cannot be
    # read (ValueError: too many values to unpack (expected 5))"): docs/trainer.md, native backend.
    to_xla, by_xla = pool.get("native:two")["to_xla"]
    _ok(to_xla)
    assert metrics(by_xla)["resumed_from"] is None
    assert "its .metadata cannot be read" in to_xla.stderr
