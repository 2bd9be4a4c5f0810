"""The processes of the local control plane: how each is started and how we know it is healthy.

Pure data over the cluster's paths and ports: `specs()` says what to run; `local.py` runs it.
Flags follow what envtest and kwokctl use (see docs/local-cluster.md for the why of each choice).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tpuft_dev.cluster.build import Binaries
from tpuft_dev.cluster.pki import Pki

# Order matters: each component needs the ones before it.
COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "jobset-controller",
    "kueue-controller",  # only in clusters started with Kueue (`tpuft cluster up`; tests opt in)
    "kwok",
)
PORT_NAMES = (
    "etcd",
    "etcd-peer",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "jobset-webhook",
    "jobset-health",
    "kueue-webhook",
    "kueue-health",
    "kwok",
)
SERVICE_CIDR = "10.96.0.0/16"  # only a setting of the apiserver: nothing listens there
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"


@dataclass(frozen=True)
class Component:
    name: str
    argv: list[str]
    # (scheme+host+port+path); https health checks of the apiserver use the admin client certificate.
    health_url: str
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Layout:
    """Every path of one local cluster, under one directory."""

    root: Path

    @property
    def pki(self) -> Pki:
        return Pki(self.root / "pki")

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def jobset_config(self) -> Path:
        return self.root / "jobset-config.yaml"

    @property
    def kueue_config(self) -> Path:
        return self.root / "kueue-config.yaml"

    @property
    def kwok_config(self) -> Path:
        return self.root / "kwok.yaml"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def audit_policy(self) -> Path:
        """Opt-in: when this file exists at start-up, the apiserver writes an audit log with it."""
        return self.root / "audit-policy.yaml"

    @property
    def audit_log(self) -> Path:
        return self.logs / "audit.log"


def _audit_flags(layout: Layout) -> list[str]:
    """Off unless the cluster directory holds an audit policy (the operator benchmark writes one to
    count the operator's API requests); it is read when the apiserver starts."""
    if not layout.audit_policy.exists():
        return []
    return [
        f"--audit-policy-file={layout.audit_policy}",
        f"--audit-log-path={layout.audit_log}",
        "--audit-log-format=json",
        "--audit-log-maxsize=0",  # one file, never rotated: the reader keeps an offset into it
    ]


def specs(layout: Layout, bins: Binaries, ports: dict[str, int], *, kueue: bool = False) -> list[Component]:
    """The cluster's processes in start order; the Kueue controller only when ``kueue``."""
    pki = layout.pki
    kubeconfig = str(layout.admin_kubeconfig)
    apiserver_url = f"https://127.0.0.1:{ports['kube-apiserver']}"
    every = [
        Component(
            name="etcd",
            argv=[
                str(bins.etcd),
                "--name=tpuft",
                f"--data-dir={layout.etcd_data}",
                f"--listen-client-urls=http://127.0.0.1:{ports['etcd']}",
                f"--advertise-client-urls=http://127.0.0.1:{ports['etcd']}",
                f"--listen-peer-urls=http://127.0.0.1:{ports['etcd-peer']}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{ports['etcd-peer']}",
                f"--initial-cluster=tpuft=http://127.0.0.1:{ports['etcd-peer']}",
                # A test cluster: durability across power loss is not worth the fsync latency.
                "--unsafe-no-fsync",
                "--quota-backend-bytes=4294967296",
                "--log-level=warn",
            ],
            health_url=f"http://127.0.0.1:{ports['etcd']}/health",
        ),
        Component(
            name="kube-apiserver",
            argv=[
                str(bins.kube_apiserver),
                f"--etcd-servers=http://127.0.0.1:{ports['etcd']}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={ports['kube-apiserver']}",
                f"--tls-cert-file={pki.apiserver_cert}",
                f"--tls-private-key-file={pki.apiserver_key}",
                f"--client-ca-file={pki.ca_cert}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki.sa_public}",
                f"--service-account-signing-key-file={pki.sa_private}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                # RBAC for real: the operator is tested with only the permissions its chart grants.
                "--authorization-mode=RBAC",
                "--allow-privileged=true",
                # GKE enables this plugin: pods requesting google.com/tpu get the toleration for the
                # TPU node taint, exactly as on GKE.
                "--enable-admission-plugins=ExtendedResourceToleration",
                # No kube-proxy or endpoints here; a loopback endpoint for `kubernetes` is invalid.
                "--endpoint-reconciler-type=none",
                "--profiling=false",
                "--v=1",
                *_audit_flags(layout),
            ],
            health_url=f"{apiserver_url}/readyz",
        ),
        Component(
            name="kube-controller-manager",
            argv=[
                str(bins.kube_controller_manager),
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--leader-elect=false",
                f"--service-account-private-key-file={pki.sa_private}",
                f"--root-ca-file={pki.ca_cert}",
                f"--cluster-signing-cert-file={pki.ca_cert}",
                f"--cluster-signing-key-file={pki.ca_key}",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports['kube-controller-manager']}",
                "--use-service-account-credentials=false",
                # Deleted TPU nodes (preemption tests) should release their pods quickly.
                "--terminated-pod-gc-threshold=1000",
                "--v=1",
            ],
            health_url=f"https://127.0.0.1:{ports['kube-controller-manager']}/healthz",
        ),
        Component(
            name="kube-scheduler",
            argv=[
                str(bins.kube_scheduler),
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports['kube-scheduler']}",
                "--v=1",
            ],
            health_url=f"https://127.0.0.1:{ports['kube-scheduler']}/healthz",
        ),
        Component(
            name="jobset-controller",
            argv=[
                str(bins.jobset),
                f"--config={layout.jobset_config}",
                f"--kubeconfig={kubeconfig}",
                "--zap-log-level=info",
            ],
            health_url=f"http://127.0.0.1:{ports['jobset-health']}/readyz",
        ),
        Component(
            name="kueue-controller",
            argv=[
                str(bins.kueue),
                f"--config={layout.kueue_config}",
                f"--kubeconfig={kubeconfig}",
                "--zap-log-level=info",
            ],
            # Ready once its webhook server listens: before that, JobSets with a queue label and
            # Kueue's own objects are refused by its webhooks.
            health_url=f"http://127.0.0.1:{ports['kueue-health']}/readyz",
        ),
        Component(
            name="kwok",
            argv=[
                str(bins.kwok),
                f"--kubeconfig={kubeconfig}",
                f"--config={layout.kwok_config}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
                f"--server-address=127.0.0.1:{ports['kwok']}",
                "--node-ip=127.0.0.1",
                f"--node-port={ports['kwok']}",
                "--cidr=10.244.0.0/16",
                "--node-lease-duration-seconds=40",
            ],
            health_url=f"http://127.0.0.1:{ports['kwok']}/healthz",
        ),
    ]
    return [c for c in every if kueue or c.name != "kueue-controller"]


def jobset_configuration(layout: Layout, ports: dict[str, int]) -> dict[str, object]:
    """The JobSet controller's own config file, for running outside the cluster."""
    return {
        "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        # We sign its webhook certificate ourselves (it cannot patch a Service it does not have).
        "internalCertManagement": {"enable": False},
        "webhook": {
            "host": "127.0.0.1",
            "port": ports["jobset-webhook"],
            "certDir": str(layout.pki.webhook_dir),
        },
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports['jobset-health']}"},
    }


# Kueue's manager loads a metrics serving certificate from this fixed path whenever its internal
# certificate management is off (cmd/kueue/main.go), even with the metrics server disabled. Out of
# cluster there is no Secret mounted there, so the cluster puts a certificate of its own there.
KUEUE_METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")
# The one integration the local cluster enables: tpuft's runs are JobSets. Each other framework would
# need its CRDs (or intercept every pod, for "pod"); their webhooks are not registered either.
KUEUE_FRAMEWORKS = ("jobset.x-k8s.io/jobset",)


def kueue_configuration(layout: Layout, ports: dict[str, int]) -> dict[str, object]:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2) for a manager outside the cluster:
    upstream's controller_manager_config.yaml, with webhooks on loopback under our CA."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": "kueue-system",
        "manageJobsWithoutQueueName": False,
        "leaderElection": {"leaderElect": False},
        # We sign its webhook certificate (its own rotation patches a Service and Secret it has not got).
        "internalCertManagement": {"enable": False},
        "webhook": {
            "host": "127.0.0.1",
            "port": ports["kueue-webhook"],
            "certDir": str(layout.pki.webhook_dir),
        },
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports['kueue-health']}"},
        "integrations": {"frameworks": list(KUEUE_FRAMEWORKS)},
        # The on-demand visibility API is an aggregated apiserver on a fixed port of every interface:
        # several local clusters could not run side by side, and tpuft reads Workloads instead.
        "featureGates": {"VisibilityOnDemand": False},
    }
