"""The operator on the local cluster, the way the chart runs it: its CRD, its ServiceAccount and
RBAC rendered by helm from charts/tpuft, and a `tpuft operator` process that authenticates as that
ServiceAccount (so it has exactly the chart's permissions). Used by `make demo` and the e2e tests."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import yaml

from tpuft_dev.cluster.local import ClusterError, LocalCluster

REPO = Path(__file__).resolve().parents[3]
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Looked up once, here: the child calls it between fork and exec, where it must not import or allocate.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent() -> None:
    """In the operator's process before exec: SIGTERM when the thread that started it dies. A killed
    benchmark or test run left its operator running against the next cluster of the same name (it
    then competed for the CPUs with the next run); `start` is called from the main thread."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


CHART = REPO / "charts" / "tpuft"
CRD = REPO / "crds" / "tpufinetunes.tpuft.dev.yaml"
OPERATOR_NAMESPACE = "tpuft-system"
RELEASE = "tpuft"
SERVICE_ACCOUNT = "tpuft"  # the chart's full name for release "tpuft"
ADMIN_POLICY = f"{RELEASE}-admin"  # the chart's admin ValidatingAdmissionPolicy (and its binding)
# Chart values for the local executor, which runs the real trainer on this host from files on it:
# the admin opts in to hostPath volumes (off by default: they reach the node's filesystem).
HOST_PATH_VALUES = (
    "--set-json",
    'policy.allowedVolumeTypes=["configMap","csi","downwardAPI","emptyDir","ephemeral",'
    '"persistentVolumeClaim","projected","secret","hostPath"]',
)


def _helm_template(cluster: LocalCluster, namespace: str, values: Sequence[str], *templates: str) -> str:
    shown = [arg for t in templates for arg in ("--show-only", f"templates/{t}")]
    rendered = subprocess.run(
        [str(cluster.bins.helm), "template", RELEASE, str(CHART), "--namespace", namespace, *values, *shown],
        capture_output=True,
        text=True,
    )
    if rendered.returncode != 0:
        raise ClusterError(f"helm template {CHART} failed: {rendered.stderr.strip()}")
    return rendered.stdout


def operator_env(
    cluster: LocalCluster, values: Sequence[str] = (), namespace: str = OPERATOR_NAMESPACE
) -> dict[str, str]:
    """The operator's settings as the chart's Deployment gives them (its container's TPUFT_* env),
    for ``values``: a local operator process then enforces exactly what the chart configures."""
    (deployment,) = [
        d for d in yaml.safe_load_all(_helm_template(cluster, namespace, values, "deployment.yaml")) if d
    ]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    skip = {"TPUFT_METRICS_PORT", "TPUFT_HEALTH_PORT", "TPUFT_BIND_ADDRESS", "TPUFT_LOG_FORMAT"}
    return {
        e["name"]: str(e["value"])
        for e in container["env"]
        if "value" in e and e["name"].startswith("TPUFT_") and e["name"] not in skip
    }


def install_operator(
    cluster: LocalCluster, namespace: str = OPERATOR_NAMESPACE, values: Sequence[str] = ()
) -> Path:
    """Installs the CRD and the chart's ServiceAccount, RBAC and admission policies (progress and
    admin, for ``values``: helm --set/--set-json arguments); returns a kubeconfig acting as that
    ServiceAccount. Without the admin policy in the render (policy.admission=false) an earlier one
    is removed, so only the operator enforces the rules."""
    cluster.apply(CRD.read_text())
    cluster.wait_established("tpufinetunes.tpuft.dev")
    cluster.kubectl("create", "namespace", namespace, check=False)
    rendered = _helm_template(
        cluster,
        namespace,
        values,
        "serviceaccount.yaml",
        "rbac.yaml",
        "progress-policy.yaml",
        "admin-policy.yaml",
    )
    documents = [d for d in yaml.safe_load_all(rendered) if d]
    if not any(
        d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"] == ADMIN_POLICY for d in documents
    ):
        for kind in ("validatingadmissionpolicybinding", "validatingadmissionpolicy"):
            cluster.kubectl("delete", kind, ADMIN_POLICY, "--ignore-not-found", check=False)
    cluster.apply(documents)
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
                preexec_fn=_die_with_parent,
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
