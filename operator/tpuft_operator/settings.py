"""Every operator setting in one place: name, default, flag, environment variable, and why.

`tpuft operator --help` is generated from this table, so the documentation cannot drift from the
code. Settings are read once at start-up; nothing else in the operator reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from tpuft_operator.api.models import DEFAULT_GRACE_SECONDS
from tpuft_operator.api.policy import DEFAULT_MAX_CHIPS, DEFAULT_VOLUME_TYPES, AdminPolicy
from tpuft_operator.pacing import DEFAULT_WRITE_BURST, DEFAULT_WRITE_QPS
from tpuft_operator.render.settings import (
    DEFAULT_TRAINER_IMAGE,
    DEFAULT_TRAINER_IMAGE_NATIVE,
    TRAINER_IMAGE_USER,
    RenderSettings,
)


def _setting(default: Any, help: str, env: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, "env": env, **extra})


@dataclass(frozen=True)
class OperatorSettings:
    namespaces: tuple[str, ...] = _setting(
        (),
        "Namespaces to watch (repeat the flag, or comma-separate in the env var). Empty: all namespaces, "
        "which needs the cluster-wide role of the chart.",
        "TPUFT_NAMESPACES",
        multiple=True,
    )
    trainer_image: str = _setting(
        DEFAULT_TRAINER_IMAGE,
        "Image for trainer pods when a TPUFineTune does not set spec.image.",
        "TPUFT_TRAINER_IMAGE",
    )
    trainer_image_native: str = _setting(
        DEFAULT_TRAINER_IMAGE_NATIVE,
        "Image for the trainer pods (and the prepare Job) of a `backend: native` run when it does not set "
        "spec.image: torch 2.15 with torch-tpu, no torch_xla. Default: the trainer image's repository, "
        "tag suffixed -native.",
        "TPUFT_TRAINER_IMAGE_NATIVE",
    )
    metrics_port: int = _setting(
        8080, "Port of the Prometheus /metrics endpoint (0 disables it).", "TPUFT_METRICS_PORT"
    )
    health_port: int = _setting(
        8081, "Port of the /healthz liveness and readiness endpoint (0 disables it).", "TPUFT_HEALTH_PORT"
    )
    bind_address: str = _setting(
        "0.0.0.0", "Address the metrics and health endpoints listen on.", "TPUFT_BIND_ADDRESS"
    )
    watch_server_timeout: int = _setting(
        300,
        "Seconds after which the API server ends a watch and the operator re-opens it; "
        "bounds how long a silently broken stream can stall.",
        "TPUFT_WATCH_SERVER_TIMEOUT",
    )
    watch_client_timeout: int = _setting(
        330,
        "Client-side deadline of a watch request (a little above the server timeout).",
        "TPUFT_WATCH_CLIENT_TIMEOUT",
    )
    resync_seconds: float = _setting(
        30.0,
        "Every unfinished run is re-reconciled this often even without events: the safety net that "
        "retries a failed API call and heals a missed event. One due during a burst of JobSet creates "
        "waits for its end (at most another period).",
        "TPUFT_RESYNC_SECONDS",
    )
    status_settle_seconds: float = _setting(
        2.0,
        "A new run's first status waits this long after its JobSet is created, so a run whose pods "
        "start at once is reported Running in one write instead of Pending then Running. 0: at once.",
        "TPUFT_STATUS_SETTLE_SECONDS",
    )
    # 32: measured best for a burst of 100 runs on 2 CPUs (docs/benchmarks.md, 8/16/32/64 workers):
    # fewer keep too few JobSet POSTs in flight, more only share the API server's CPU more thinly.
    workers: int = _setting(
        32,
        "Reconciles that run at once (threads; they mostly wait on the API server).",
        "TPUFT_WORKERS",
    )
    # Off by default: see pacing.py and docs/benchmarks.md for what each pace bought and cost.
    write_qps: float = _setting(
        DEFAULT_WRITE_QPS,
        "Status patches and Events per second, on average (a token bucket, like client-go's QPS), to cap "
        "the operator's share of a busy API server. JobSet creates, suspends and checkpoint requests are "
        "never paced; statuses and Events arrive later under a burst (below ~6 x the runs a second it "
        "follows, it falls behind). 0: no limit.",
        "TPUFT_WRITE_QPS",
    )
    write_burst: int = _setting(
        DEFAULT_WRITE_BURST,
        "Status patches and Events sent at once after a quiet spell, before --write-qps paces them.",
        "TPUFT_WRITE_BURST",
    )
    progress_interval_seconds: float = _setting(
        10.0,
        "Least time between two progress reports of a run's trainer (each is one status patch).",
        "TPUFT_PROGRESS_INTERVAL_SECONDS",
    )
    watch_nodes: bool = _setting(
        True,
        "Watch TPU nodes (read-only) for GKE's maintenance signals, to checkpoint runs on a node before "
        "its maintenance. Needs the chart's cluster-scoped node read (nodes get/list/watch); without it "
        "runs still save on the SIGTERM a maintenance brings, but get no early checkpoint and no "
        "MaintenanceScheduled condition.",
        "TPUFT_WATCH_NODES",
    )
    watch_workloads: bool = _setting(
        True,
        "Watch Kueue's Workloads (workloads.kueue.x-k8s.io list/watch; patch of spec.active only, to hold "
        "a queued run whose spec.suspend is set): a queued run's Queued condition then says why it waits "
        "(no such LocalQueue, inactive ClusterQueue, not enough quota, admission checks) and Kueue's "
        "admission and eviction become Events. Off, or without Kueue installed, queued runs only say "
        "that they wait.",
        "TPUFT_WATCH_WORKLOADS",
    )
    goodput_interval_seconds: float = _setting(
        60.0,
        "Least report time between two refreshes of a running run's status.goodput (each is a status "
        "write; a phase change always refreshes it).",
        "TPUFT_GOODPUT_INTERVAL_SECONDS",
    )
    termination_grace_period_seconds: int = _setting(
        DEFAULT_GRACE_SECONDS,
        "Default grace period of trainer pods after SIGTERM (a run's spec.terminationGracePeriodSeconds "
        "overrides it): every host saves the step it reached in that time. A Spot reclaim gives ~15 s "
        "whatever it says (spec.tpu.spotGracePeriodSeconds).",
        "TPUFT_TERMINATION_GRACE_PERIOD_SECONDS",
    )
    # The admin policy (api/policy.py; the chart's `policy` values): what runs may ask for.
    operator_namespace: str | None = _setting(
        None,
        "The operator's own namespace: runs there are refused (their pods could use its ServiceAccount).",
        "TPUFT_OPERATOR_NAMESPACE",
    )
    allowed_images: tuple[str, ...] = _setting(
        (),
        "Prefixes spec.image may start with, besides the trainer image's repository ('*': any).",
        "TPUFT_ALLOWED_IMAGES",
        multiple=True,
    )
    allowed_service_accounts: tuple[str, ...] = _setting(
        (),
        "spec.serviceAccountName values allowed besides the run's own identity tpuft-trainer ('*': any).",
        "TPUFT_ALLOWED_SERVICE_ACCOUNTS",
        multiple=True,
    )
    allowed_volume_types: tuple[str, ...] = _setting(
        DEFAULT_VOLUME_TYPES,
        "Volume types spec.volumes may use ('none': no extra volumes).",
        "TPUFT_ALLOWED_VOLUME_TYPES",
        multiple=True,
    )
    allowed_env: tuple[str, ...] = _setting(
        (),
        "Reserved environment variables (HF_*, PYTHON*, LD_*, TPU_*, XLA_*, proxies, ...) runs may set "
        "anyway: names or PREFIX*.",
        "TPUFT_ALLOWED_ENV",
        multiple=True,
    )
    allowed_secrets: tuple[str, ...] = _setting(
        (),
        "Secrets env secretKeyRefs and secret volumes may read besides model.tokenSecretRef ('*': any).",
        "TPUFT_ALLOWED_SECRETS",
        multiple=True,
    )
    allowed_tolerations: tuple[str, ...] = _setting(
        (),
        "Reserved taints (control plane, node lifecycle, GKE, other accelerators: api/policy.py) runs "
        "may tolerate anyway: keys or PREFIX* ('*': any, including a toleration of every taint).",
        "TPUFT_ALLOWED_TOLERATIONS",
        multiple=True,
    )
    allow_host_network: bool = _setting(
        False,
        "Runs may set spec.network.hostNetwork (pods in their node's network namespace, forbidden by the "
        "baseline Pod Security Standard).",
        "TPUFT_ALLOW_HOST_NETWORK",
    )
    max_chips_per_run: int = _setting(
        DEFAULT_MAX_CHIPS, "Most TPU chips of one run, all slices (0: no cap).", "TPUFT_MAX_CHIPS_PER_RUN"
    )
    require_queue_name: bool = _setting(
        False, "Every run must set spec.queueName (a Kueue LocalQueue).", "TPUFT_REQUIRE_QUEUE_NAME"
    )
    run_as_user: int = _setting(
        TRAINER_IMAGE_USER,
        "Trainer pods run as this numeric user; non-root, they meet the restricted Pod Security Standard "
        "(0: root with the baseline settings, for node pools whose TPU device files a non-root user "
        "cannot open).",
        "TPUFT_RUN_AS_USER",
    )
    trainer_network_policy: bool = _setting(
        False,
        "Create a NetworkPolicy per run: its pods accept connections only from the same run's pods "
        "(needs the chart's networkpolicies grant).",
        "TPUFT_TRAINER_NETWORK_POLICY",
    )
    log_level: str = _setting(
        "INFO",
        "Log level: DEBUG, INFO, WARNING, ERROR.",
        "TPUFT_LOG_LEVEL",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
    )
    log_format: str = _setting(
        "json",
        "Log format: json (one object per line, with namespace and name) or text.",
        "TPUFT_LOG_FORMAT",
        choices=("json", "text"),
    )
    kubeconfig: str | None = _setting(
        None,
        "Kubeconfig to use outside a cluster; inside a pod the ServiceAccount is used.",
        "KUBECONFIG",
    )

    def render_settings(self) -> RenderSettings:
        """What of these settings shapes the objects of a run (the JobSet and its trainer config)."""
        return RenderSettings(
            trainer_image=self.trainer_image,
            trainer_image_native=self.trainer_image_native,
            progress_min_interval_seconds=self.progress_interval_seconds,
            termination_grace_period_seconds=self.termination_grace_period_seconds,
            run_as_user=self.run_as_user,
            network_policy=self.trainer_network_policy,
        )

    def admin_policy(self) -> AdminPolicy:
        """What runs may ask for (api/policy.py)."""
        return AdminPolicy(
            images=self.allowed_images,
            service_accounts=self.allowed_service_accounts,
            volume_types=tuple(t for t in self.allowed_volume_types if t != "none"),
            env=self.allowed_env,
            secrets=self.allowed_secrets,
            tolerations=self.allowed_tolerations,
            host_network=self.allow_host_network,
            max_chips=self.max_chips_per_run,
            require_queue=self.require_queue_name,
            operator_namespace=self.operator_namespace or None,
        )

    @classmethod
    def describe(cls) -> list[tuple[str, str, str, Any]]:
        """(flag, env var, help, default) for every setting: the source of `--help` and the docs."""
        rows = []
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            rows.append((flag, f.metadata["env"], f.metadata["help"], f.default))
        return rows
