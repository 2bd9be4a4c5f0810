"""`tpuft operator`: start-up in one place (settings -> logging -> kopf settings -> run)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
from dataclasses import fields
from typing import Any, cast

import click
import kopf
from prometheus_client import start_http_server

from tpuft_operator.api.resources import JOB, JOBSET, NODE, POD, WORKLOAD
from tpuft_operator.handlers import build_registry
from tpuft_operator.jobset_crd import CRD_NAME, InstalledJobSet, representative_jobsets
from tpuft_operator.k8s import Api, load_client
from tpuft_operator.pacing import WritePace
from tpuft_operator.reconcile import Reconciler
from tpuft_operator.render.jobset import FINETUNE_LABEL
from tpuft_operator.render.prepare_job import COMPONENT_LABEL, PREPARE_COMPONENT
from tpuft_operator.runtime import Runtime, api_connections
from tpuft_operator.settings import OperatorSettings
from tpuft_operator.topology import ACCELERATOR_LABEL
from tpuft_operator.watches import Watches

log = logging.getLogger("tpuft.operator")


def _options(command: Any) -> Any:
    """One click option per setting, with its environment variable and default in --help."""
    for f in reversed(fields(OperatorSettings)):
        extra: dict[str, Any] = {}
        if f.metadata.get("choices"):
            extra["type"] = click.Choice(f.metadata["choices"], case_sensitive=False)
        elif f.type in ("int", int):
            extra["type"] = int
        elif f.type in ("float", float):
            extra["type"] = float
        elif f.type in ("bool", bool):
            extra["type"] = bool
        option = click.option(
            "--" + f.name.replace("_", "-"),
            f.name,
            envvar=f.metadata["env"],
            default=list(f.default) if f.metadata.get("multiple") else f.default,
            multiple=bool(f.metadata.get("multiple")),
            show_default=f.default not in (None, ()),
            show_envvar=True,
            help=f.metadata["help"],
            **extra,
        )
        command = option(command)
    return command


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf's "essence" of each object feeds only change-detecting handlers, and we register none
    (every reconcile is level-triggered). The default storage builds it anyway by deep-copying the
    whole body of every watch event: 12% of the operator's CPU at N=300 (bench, py-spy)."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return cast(kopf.BodyEssence, {})

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


class QuietHandlerSuccess(logging.Filter):
    """Drops kopf's "Handler '...' succeeded." line, logged at INFO for every watch event (~10 per run):
    our handlers only mark a run for the workers, so the line says nothing and buries the ones that do."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        message = record.getMessage()
        return not (message.startswith("Handler '") and message.endswith("' succeeded."))


def configure_kopf(kopf_settings: kopf.OperatorSettings, settings: OperatorSettings) -> None:
    """Production defaults: watches that cannot stall, bounded backoff, no log spam as Events."""
    kopf_settings.watching.server_timeout = settings.watch_server_timeout
    kopf_settings.watching.client_timeout = settings.watch_client_timeout
    kopf_settings.watching.connect_timeout = 30
    kopf_settings.networking.request_timeout = 60
    kopf_settings.networking.error_backoffs = [1, 2, 5, 10, 30, 60]
    # Only our explicit transition events and handler errors become Kubernetes Events.
    kopf_settings.posting.level = logging.ERROR
    # kopf must not write anything on our objects: we use no change-detecting handlers, and
    # keeping its bookkeeping in annotations would show up as drift in GitOps tools.
    kopf_settings.persistence.finalizer = "tpuft.dev/unused-finalizer"
    kopf_settings.persistence.diffbase_storage = NoDiffBase()
    # Server-side filtering: only the pods and JobSets of runs reach the operator (watches.py; kopf's
    # watch client reads the selectors from here), not every pod event of the whole cluster.
    for resource in (POD, JOBSET):
        kopf_settings.watching.label_selectors[resource.gvp] = FINETUNE_LABEL
    # Of Jobs, only the runs' prepare Jobs (the JobSets' Jobs carry the run's label too).
    kopf_settings.watching.label_selectors[JOB.gvp] = (
        f"{FINETUNE_LABEL},{COMPONENT_LABEL}={PREPARE_COMPONENT}"
    )
    kopf_settings.watching.label_selectors[NODE.gvp] = ACCELERATOR_LABEL  # only TPU nodes
    kopf_settings.peering.standalone = True
    if settings.namespaces:
        # Namespaced install: kopf would first try to list namespaces and CRDs cluster-wide, which the
        # chart's namespaced Roles rightly deny, and retry for minutes before watching anything.
        kopf_settings.scanning.disabled = True


def check_node_access(settings: OperatorSettings, api: Api) -> OperatorSettings:
    """--watch-nodes without the right to list nodes would leave kopf waiting forever for an index it
    may not fill (and every handler behind it): say so and run without the maintenance signals."""
    if settings.watch_nodes and not (api.may("list", NODE.plural) and api.may("watch", NODE.plural)):
        log.warning(
            "--watch-nodes is on but this identity may not list and watch nodes: running without GKE's "
            "maintenance signals (grant the chart's node read, watchNodes: true, or set "
            "--watch-nodes=false to silence this)"
        )
        return dataclasses.replace(settings, watch_nodes=False)
    return settings


def check_workload_access(settings: OperatorSettings, api: Api) -> OperatorSettings:
    """As for nodes: a watch of Kueue's Workloads that RBAC denies would hold every handler behind
    its index. Without the right, run without Kueue's reasons (a chart older than the operator)."""
    if not settings.watch_workloads:
        return settings
    namespaces: list[str | None] = list(settings.namespaces) or [None]
    allowed = all(
        api.may(verb, WORKLOAD.plural, WORKLOAD.group, namespace)
        for verb in ("list", "watch")
        for namespace in namespaces
    )
    if not allowed:
        log.warning(
            "this identity may not list and watch Kueue's workloads.kueue.x-k8s.io: queued runs will not "
            "say why Kueue keeps them waiting (upgrade the chart's RBAC, or set --watch-workloads=false "
            "to silence this)"
        )
        return dataclasses.replace(settings, watch_workloads=False)
    return settings


def installed_jobset(settings: OperatorSettings, api: Api) -> InstalledJobSet:
    """The check of the cluster's JobSet CRD against what this operator renders (jobset_crd.py),
    looked at again every resync period while it falls short."""
    return InstalledJobSet(
        lambda: api.read_crd(CRD_NAME),
        representative_jobsets(settings.render_settings()),
        recheck_seconds=settings.resync_seconds,
    )


def build_memo(settings: OperatorSettings, api: Api, jobset: InstalledJobSet | None = None) -> kopf.Memo:
    """The runtime (queue, workers, resync) and the Reconciler it feeds, which asks it for deferred
    reconciles: what the handlers reach through kopf's memo. Both take their status patches and
    Events in turn from one write pace (pacing.py). ``jobset``: the check of the cluster's JobSet,
    asked before each JobSet is created (none: unchecked)."""
    pace = WritePace(settings.write_qps, settings.write_burst)
    runtime = Runtime(
        workers=settings.workers,
        resync_seconds=settings.resync_seconds,
        watches=Watches(settings.namespaces, nodes=settings.watch_nodes, workloads=settings.watch_workloads),
        post_event=api.post_event,
        pace=pace,
    )
    reconciler = Reconciler(
        api=api,
        render_settings=settings.render_settings(),
        policy=settings.admin_policy(),
        defer=runtime.defer,
        pace=pace,
        status_settle_seconds=settings.status_settle_seconds,
        goodput_interval_seconds=settings.goodput_interval_seconds,
    )
    if jobset is not None:
        reconciler.jobset_shortfall = jobset.shortfall
    return kopf.Memo(settings=settings, reconciler=reconciler, runtime=runtime)


def run(settings: OperatorSettings, *, stop_flag: threading.Event | None = None) -> None:
    """Runs the operator until stopped (SIGTERM/SIGINT, or ``stop_flag`` in tests)."""
    logging.getLogger("kopf.objects").addFilter(QuietHandlerSuccess())
    connections = api_connections(settings.workers)
    api = Api(load_client(settings.kubeconfig, connections=connections))
    settings = check_workload_access(check_node_access(settings, api), api)
    # Not a refusal to start: runs say why they wait (Created=False) and the operator keeps reporting
    # the others; it looks again while JobSet is missing or too old (docs/operator.md).
    jobset = installed_jobset(settings, api)
    jobset.check()
    api.warm_up(connections)  # a burst of runs at start-up (a restart) finds its connections open
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr=settings.bind_address)
    # kopf's settings are configured by the first startup handler, before the runtime opens its
    # watches (which read their label selectors and timeouts from them).
    registry = build_registry(
        settings, configure=lambda kopf_settings: configure_kopf(kopf_settings, settings)
    )
    liveness = (
        f"http://{settings.bind_address}:{settings.health_port}/healthz" if settings.health_port else None
    )
    log.info(
        "starting: watching %s; trainer images %s (xla), %s (native); metrics :%s; health :%s; node maintenance signals %s",
        ", ".join(settings.namespaces) or "all namespaces",
        settings.trainer_image,
        settings.trainer_image_native,
        settings.metrics_port,
        settings.health_port,
        "watched" if settings.watch_nodes else "not watched (--watch-nodes=false)",
    )
    asyncio.run(
        kopf.operator(
            registry=registry,
            memo=build_memo(settings, api, jobset),
            standalone=True,
            clusterwide=not settings.namespaces,
            namespaces=list(settings.namespaces),
            liveness_endpoint=liveness,
            stop_flag=stop_flag,
        )
    )


@click.command("operator", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@_options
def operator(**values: Any) -> None:
    """Run the tpuft operator: reconcile TPUFineTunes into JobSets and report their status.

    \b
    Run exactly one replica (Deployment strategy Recreate): kopf has no leader election.
    Every setting below can be given as a flag or as the environment variable shown.
    Endpoints: /metrics (Prometheus) on --metrics-port, /healthz on --health-port.
    """
    for f in fields(OperatorSettings):
        if f.metadata.get("multiple"):  # repeated flags, or comma-separated in the env var
            items: list[str] = []
            for item in values[f.name]:
                items += [n.strip() for n in str(item).split(",") if n.strip()]
            values[f.name] = tuple(items)
    values["log_level"] = values["log_level"].upper()
    settings = OperatorSettings(**values)
    if settings.kubeconfig:
        os.environ["KUBECONFIG"] = settings.kubeconfig  # kopf's login and the client both read it
    kopf.configure(
        verbose=settings.log_level == "DEBUG",
        log_format=kopf.LogFormat.JSON if settings.log_format == "json" else kopf.LogFormat.PLAIN,
        log_prefix=False,
    )
    logging.getLogger().setLevel(settings.log_level)
    run(settings)
