"""Every operator setting in one place: name, default, flag, environment variable, and why.

`tpuft operator --help` is generated from this table, so the documentation cannot drift from the
code. Settings are read once at start-up; nothing else in the operator reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from tpuft_operator.render.settings import RenderSettings

DEFAULT_TRAINER_IMAGE = "ghcr.io/tpuft/trainer:0.1.0"


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
        "retries a failed API call and heals a missed event.",
        "TPUFT_RESYNC_SECONDS",
    )
    status_settle_seconds: float = _setting(
        2.0,
        "A new run's first status waits this long after its JobSet is created, so a run whose pods "
        "start at once is reported Running in one write instead of Pending then Running. 0: at once.",
        "TPUFT_STATUS_SETTLE_SECONDS",
    )
    workers: int = _setting(
        32,
        "Reconciles that run at once (threads; they mostly wait on the API server).",
        "TPUFT_WORKERS",
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
    goodput_interval_seconds: float = _setting(
        60.0,
        "Least report time between two refreshes of a running run's status.goodput (each is a status "
        "write; a phase change always refreshes it).",
        "TPUFT_GOODPUT_INTERVAL_SECONDS",
    )
    termination_grace_period_seconds: int = _setting(
        60,
        "Default grace period of trainer pods after SIGTERM (a run's spec.terminationGracePeriodSeconds "
        "overrides it): every host saves the step it reached in that time.",
        "TPUFT_TERMINATION_GRACE_PERIOD_SECONDS",
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
            progress_min_interval_seconds=self.progress_interval_seconds,
            termination_grace_period_seconds=self.termination_grace_period_seconds,
        )

    @classmethod
    def describe(cls) -> list[tuple[str, str, str, Any]]:
        """(flag, env var, help, default) for every setting: the source of `--help` and the docs."""
        rows = []
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            rows.append((flag, f.metadata["env"], f.metadata["help"], f.default))
        return rows
