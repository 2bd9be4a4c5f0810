"""The local executor's handling of `backend: native` pods, without a cluster: which pods are native
(the trainer config they mount), the rendezvous they meet on here (one port per JobSet and restart
attempt, on loopback), the missing native venv as an error that says how to get it, and a pod's
processes stopped together (a native launcher's workers die with it). The whole path through a
cluster is tests/e2e/test_native_run.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from tpuft_dev.cluster import executor as executor_module
from tpuft_dev.cluster.executor import (
    LocalExecutor,
    PodSpecError,
    native_python,
    pod_backend,
    tpu_webhook_env,
)
from tpuft_dev.cluster.local import LocalCluster
from tpuft_trainer.pod_contract import TRAINER_CONFIG_ANNOTATION

FIRST_HOST = "run-abc-slice-0-0.run-abc"


def pod(
    name: str, *, backend: str | None, jobset: str | None = "run-abc", attempt: str = "0", job: int = 0
) -> dict[str, Any]:
    config = {"model": {"name": "m"}} | ({"backend": backend} if backend else {})
    labels = {"jobset.sigs.k8s.io/jobset-name": jobset} if jobset else {}
    if jobset:
        labels["batch.kubernetes.io/job-name"] = f"{jobset}-slice-{job}"
    return {
        "spec": {"subdomain": jobset} if jobset else {},
        "metadata": {
            "name": name,
            "namespace": "ns",
            "labels": labels,
            "annotations": {
                TRAINER_CONFIG_ANNOTATION: yaml.safe_dump(config),
                "jobset.sigs.k8s.io/restart-attempt": attempt,
            },
        },
    }


def test_a_pod_is_native_when_the_config_it_mounts_says_so() -> None:
    assert pod_backend(pod("a", backend="native")) == "native"
    assert pod_backend(pod("a", backend="xla")) == "xla"
    assert pod_backend(pod("a", backend=None)) == "xla"  # the config's default
    assert pod_backend({"metadata": {"name": "plain"}}) == "xla"  # not a tpuft pod at all
    broken = pod("a", backend="native")
    broken["metadata"]["annotations"][TRAINER_CONFIG_ANNOTATION] = "backend: [native"
    with pytest.raises(PodSpecError, match="not YAML"):
        pod_backend(broken)


def test_the_hosts_of_one_attempt_meet_on_one_loopback_port_and_no_one_else_does() -> None:
    executor = LocalExecutor(cast(LocalCluster, None), "ns", Path("/nonexistent"))
    env = {"MASTER_ADDR": FIRST_HOST, "MASTER_PORT": "29400", "TPUFT_COORDINATOR_ADDRESS": FIRST_HOST}
    first = executor.native_rendezvous(pod("run-abc-slice-0-0", backend="native"), env)
    second = executor.native_rendezvous(pod("run-abc-slice-0-1", backend="native"), env)
    # Another slice's Job of the same JobSet meets there too.
    other_slice = executor.native_rendezvous(pod("run-abc-slice-1-0", backend="native", job=1), env)
    assert first == second == other_slice
    assert first["MASTER_ADDR"] == first["TPUFT_COORDINATOR_ADDRESS"] == "127.0.0.1"
    assert first["MASTER_PORT"] != "29400" and 0 < int(first["MASTER_PORT"]) < 65536
    other_run = executor.native_rendezvous(pod("x", backend="native", jobset="other"), env)
    restarted = executor.native_rendezvous(pod("run-abc-slice-0-0", backend="native", attempt="1"), env)
    ports = {first["MASTER_PORT"], other_run["MASTER_PORT"], restarted["MASTER_PORT"]}
    assert len(ports) == 3, ports
    # The prepare pod has no rendezvous: nothing to rewrite.
    assert executor.native_rendezvous(pod("run-abc-prepare-x", backend="native", jobset=None), {}) == {}


def test_a_host_of_a_native_job_gets_what_gkes_tpu_webhook_would_set() -> None:
    """TPU_WORKER_ID and TPU_WORKER_HOSTNAMES (the trainer counts the hosts before it launches), from
    the pod's completion index, its Job and subdomain, and the NNODES the renderer set."""
    host = pod("run-abc-slice-0-1", backend="native")
    env = {"JOB_COMPLETION_INDEX": "1", "NNODES": "2"}
    assert tpu_webhook_env(host, env) == {
        "TPU_WORKER_ID": "1",
        "TPU_WORKER_HOSTNAMES": "run-abc-slice-0-0.run-abc,run-abc-slice-0-1.run-abc",
    }
    executor = LocalExecutor(cast(LocalCluster, None), "ns", Path("/nonexistent"))
    rewritten = executor.native_rendezvous(host, {**env, "MASTER_ADDR": FIRST_HOST})
    assert rewritten["TPU_WORKER_HOSTNAMES"].split(",")[0] == FIRST_HOST
    # On a real node GKE set them already; a pod that is no Indexed Job's host gets none.
    assert tpu_webhook_env(host, {**env, "TPU_WORKER_HOSTNAMES": "a,b"}) == {}
    assert tpu_webhook_env(host, {"NNODES": "2"}) == {}


def test_a_host_of_a_native_multislice_job_is_listed_with_its_own_slices_hosts_only() -> None:
    """GKE's webhook lists the hosts of the pod's own Job: NNODES counts every slice's hosts."""
    host = pod("run-abc-slice-1-0", backend="native", job=1)
    env = {"JOB_COMPLETION_INDEX": "0", "NNODES": "4", "MEGASCALE_NUM_SLICES": "2"}
    assert tpu_webhook_env(host, env) == {
        "TPU_WORKER_ID": "0",
        "TPU_WORKER_HOSTNAMES": "run-abc-slice-1-0.run-abc,run-abc-slice-1-1.run-abc",
    }


def test_a_missing_native_venv_says_how_to_make_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TPUFT_CACHE", str(tmp_path))  # scripts/venv.sh's cache: empty here
    with pytest.raises(PodSpecError, match=r"run `scripts/venv\.sh native`"):
        native_python()


def test_a_killed_pod_takes_its_child_processes_with_it(tmp_path: Path) -> None:
    """A launcher SIGKILLed (a preempted host, a grace period run out) must not leave its per-chip
    workers running: the executor kills the pod's process group, as a container's cgroup dies."""
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(300)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.is_file() and pid_file.read_text()):
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.1)
        child = int(pid_file.read_text())
        executor_module._kill_group(launcher)
        assert launcher.wait(timeout=10) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while _alive(child):
            assert time.monotonic() < deadline, "the child outlived the pod"
            time.sleep(0.1)
    finally:
        if launcher.poll() is None:
            launcher.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, its parent gone) is reaped by init soon; it is not running.
    stat = Path(f"/proc/{pid}/stat")
    return stat.is_file() and stat.read_text().split()[2] != "Z"
