"""The operator on the local cluster, the way the chart runs it: its CRD, its ServiceAccount and
RBAC rendered by helm from charts/tpuft, and a `tpuft operator` process that authenticates as that
ServiceAccount (so it has exactly the chart's permissions). Used by `make demo` and the e2e tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tpuft_operator.cluster.local import ClusterError, LocalCluster

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "charts" / "tpuft"
CRD = REPO / "crds" / "tpufinetunes.tpuft.dev.yaml"
OPERATOR_NAMESPACE = "tpuft-system"
RELEASE = "tpuft"
SERVICE_ACCOUNT = "tpuft"  # the chart's full name for release "tpuft"


def install_operator(cluster: LocalCluster, namespace: str = OPERATOR_NAMESPACE) -> Path:
    """Installs the CRD and the chart's ServiceAccount, RBAC and progress admission policy; returns a
    kubeconfig acting as that ServiceAccount."""
    cluster.apply(CRD.read_text())
    cluster.wait_established("tpufinetunes.tpuft.dev")
    cluster.kubectl("create", "namespace", namespace, check=False)
    rendered = subprocess.run(
        [
            str(cluster.bins.helm),
            "template",
            RELEASE,
            str(CHART),
            "--namespace",
            namespace,
            "--show-only",
            "templates/serviceaccount.yaml",
            "--show-only",
            "templates/rbac.yaml",
            "--show-only",
            "templates/progress-policy.yaml",
        ],
        capture_output=True,
        text=True,
    )
    if rendered.returncode != 0:
        raise ClusterError(f"helm template {CHART} failed: {rendered.stderr.strip()}")
    cluster.apply(rendered.stdout)
    path = cluster.layout.root / "operator-sa.kubeconfig"
    path.write_text(cluster.service_account_kubeconfig(namespace, SERVICE_ACCOUNT))
    path.chmod(0o600)
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class OperatorProcess:
    """`tpuft operator` as a child process, with its own metrics and health ports."""

    def __init__(self, kubeconfig: Path, log_path: Path, **settings: str) -> None:
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        self.metrics_port = _free_port()
        self.health_port = _free_port()
        self.settings = settings
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> None:
        env = {
            **os.environ,
            "TPUFT_METRICS_PORT": str(self.metrics_port),
            "TPUFT_HEALTH_PORT": str(self.health_port),
            "TPUFT_BIND_ADDRESS": "127.0.0.1",
            "TPUFT_LOG_FORMAT": "text",
            **self.settings,
        }
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tpuft_operator", "operator", f"--kubeconfig={self.kubeconfig}"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ClusterError(f"the operator exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise ClusterError(f"the operator did not become healthy within {timeout:.0f}s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL: no cleanup, as when its node dies."""
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
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return str(r.read().decode())
