"""Helpers for the trainer tests: each SPMD configuration runs in its own process (use_spmd is
process-global), a few at a time.

Test modules declare the jobs they need in ``SPMD_JOBS``; the first test that asks for a result starts
every declared job on a small pool (two processes on this two-core machine), so their start-up and
compilation overlap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

HERE = Path(__file__).parent
PYTHON = sys.executable
TPUFT = str(Path(PYTHON).with_name("tpuft"))
TIMEOUT = 600


def spmd_env(devices: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "PJRT_", "TPU_", "MEGASCALE_"))}
    env.update(
        PJRT_DEVICE="CPU",
        CPU_NUM_DEVICES=str(devices),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        KUBECONFIG="/nonexistent/kubeconfig",  # progress must not reach any real cluster
        TPUFT_CACHE_DIR=tempfile.mkdtemp(prefix="tpuft-cache-"),
        # A native abort of a case ("terminate called without an active exception", seen once in CI
        # in compat_needed) then prints every thread's Python stack, which the failure message shows.
        PYTHONFAULTHANDLER="1",
    )
    env.update(extra)
    return env


@dataclass
class Proc:
    returncode: int
    stdout: str
    stderr: str
    result: dict[str, Any] = field(default_factory=dict)

    def tail(self, lines: int = 40) -> str:
        useful = [line for line in self.stderr.splitlines() if "sharding_propagation" not in line]
        return "\n".join(useful[-lines:])


def finish_case(out_path: str, result: Any) -> NoReturn:
    """The end of a case script (cases.py, recipe_cases.py): writes its result, then leaves without
    the interpreter's teardown. torch_xla's runtime threads can race that teardown into a native
    abort (pytorch/xla#4033; seen here as SIGABRT, "terminate called without an active exception",
    in 2 of 15 runs of compat_needed, whose errors leave a training loop's loader threads behind),
    and an abort after the result is written says nothing about the case."""
    Path(out_path).write_text(json.dumps(result, indent=1, default=str))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_case(case: str, devices: int, script: str = "cases.py") -> Proc:
    out = Path(tempfile.mkdtemp()) / "result.json"
    done = subprocess.run(
        [PYTHON, str(HERE / script), case, str(out)],
        env=spmd_env(devices),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    proc = Proc(done.returncode, done.stdout, done.stderr)
    written = "its result written" if out.exists() else "no result written"
    assert done.returncode == 0, (
        f"case {case} on {devices} devices failed (exit {done.returncode}, {written}):\n{proc.tail()}"
    )
    proc.result = json.loads(out.read_text())
    return proc


def run_train(config: Path, devices: int = 4, **env: str) -> Proc:
    done = subprocess.run(
        [TPUFT, "train", "--config", str(config)],
        env=spmd_env(devices, **env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    return Proc(done.returncode, done.stdout, done.stderr)


def run_together(runs: list[tuple[Path, int, dict[str, str]]]) -> list[Proc]:
    """Several `tpuft train` processes at once, as the hosts of one job: (config, devices, env) each.
    Their output goes to files, not pipes: a host blocked on a full pipe would stall its peers."""
    procs = []
    logs = Path(tempfile.mkdtemp(prefix="tpuft-hosts-"))
    for index, (config, devices, env) in enumerate(runs):
        log_path = logs / f"host-{index}.log"
        with log_path.open("wb") as log:  # the child keeps its own descriptor
            process = subprocess.Popen(
                [TPUFT, "train", "--config", str(config)],
                env=spmd_env(devices, **env),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        procs.append((process, log_path))
    done = []
    for process, log_path in procs:
        try:
            code = process.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for other, _ in procs:
                other.kill()
            raise
        done.append(Proc(code, "", log_path.read_text(errors="replace")))
    return done


class Pool:
    def __init__(self, workers: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=workers)
        self._futures: dict[str, Future[Any]] = {}
        self.jobs: dict[str, Callable[[], Any]] = {}

    def start(self, name: str) -> None:
        if name not in self._futures:
            self._futures[name] = self._executor.submit(self.jobs[name])

    def get(self, name: str) -> Any:
        for pending in self.jobs:  # everything this session needs starts as soon as anything is asked
            self.start(pending)
        return self._futures[name].result(timeout=3 * TIMEOUT)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
