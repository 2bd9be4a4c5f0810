"""The operator under test: a real `tpuft operator` process that authenticates as the Helm chart's
ServiceAccount, with exactly the chart's RBAC, against the local cluster."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tpuft_operator.cluster.local import LocalCluster

REPO = Path(__file__).resolve().parents[2]
OPERATOR_NAMESPACE = "tpuft-system"
RELEASE = "tpuft"
SERVICE_ACCOUNT = "tpuft"  # the chart's full name for release "tpuft"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class OperatorProcess:
    def __init__(self, cluster: LocalCluster, kubeconfig: Path, log_path: Path) -> None:
        self.cluster = cluster
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        self.metrics_port = _free_port()
        self.health_port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {
            **os.environ,
            "TPUFT_METRICS_PORT": str(self.metrics_port),
            "TPUFT_HEALTH_PORT": str(self.health_port),
            "TPUFT_BIND_ADDRESS": "127.0.0.1",
            "TPUFT_LOG_FORMAT": "text",
            "TPUFT_RESYNC_SECONDS": "5",
            "TPUFT_TRAINER_IMAGE": "example.invalid/tpuft-trainer:test",
        }
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tpuft_operator", "operator", f"--kubeconfig={self.kubeconfig}"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the operator exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the operator did not become healthy:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL: no cleanup, as when a node dies."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()


def install_operator_rbac(cluster: LocalCluster) -> Path:
    """The chart's ServiceAccount and RBAC (rendered by helm from charts/tpuft), and a kubeconfig
    that authenticates as that ServiceAccount."""
    cluster.apply((REPO / "crds" / "tpufinetunes.tpuft.dev.yaml").read_text())
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/tpufinetunes.tpuft.dev")
    cluster.kubectl("create", "namespace", OPERATOR_NAMESPACE, check=False)
    rendered = subprocess.run(
        [
            str(cluster.bins.helm),
            "template",
            RELEASE,
            str(REPO / "charts" / "tpuft"),
            "--namespace",
            OPERATOR_NAMESPACE,
            "--show-only",
            "templates/serviceaccount.yaml",
            "--show-only",
            "templates/rbac.yaml",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    cluster.apply(rendered)
    path = cluster.layout.root / "operator-sa.kubeconfig"
    path.write_text(cluster.service_account_kubeconfig(OPERATOR_NAMESPACE, SERVICE_ACCOUNT))
    return path


@pytest.fixture(scope="session")
def operator(
    local_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    kubeconfig = install_operator_rbac(local_cluster)
    process = OperatorProcess(local_cluster, kubeconfig, tmp_path_factory.mktemp("operator") / "operator.log")
    process.start()
    yield process
    process.stop()
