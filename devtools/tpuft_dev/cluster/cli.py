"""`tpuft cluster`: a real Kubernetes control plane on loopback, with fake GKE TPU node pools."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from tpuft_dev.cluster import build, versions
from tpuft_dev.cluster.local import (
    ClusterError,
    LocalCluster,
    checkout_cluster_name,
    default_cache,
    enclosing_checkout,
)
from tpuft_operator import topology


def _err(message: str) -> None:
    click.echo(message, err=True)


def _cluster(name: str | None) -> LocalCluster:
    return LocalCluster(name=name, log=_err)


name_option = click.option(
    "--name",
    envvar="TPUFT_CLUSTER",
    default="default",
    show_default=True,
    help="Cluster name; several clusters can run side by side (own ports and state). Env: TPUFT_CLUSTER.",
)


_HELP = f"""Run a real local control plane with fake GKE TPU nodes (no GKE, no Docker).

    \b
    Components (built from Go modules with your Go, cached under $TPUFT_CACHE/bin by version):
      etcd, kube-apiserver (RBAC on), kube-controller-manager, kube-scheduler, kubectl,
      the JobSet controller {versions.JOBSET} with its webhooks, the Kueue controller {versions.KUEUE}
      with its webhooks (JobSet integration; --no-kueue leaves it out), kwok {versions.KWOK}
      (fake nodes), helm.
    Kubernetes {versions.KUBERNETES}. Everything listens on 127.0.0.1 only.

    \b
    Quick start:
      tpuft cluster up
      eval "$(tpuft cluster env)"
      tpuft cluster add-nodepool --type v5p --topology 2x2x2
      kubectl get nodes -L cloud.google.com/gke-tpu-topology
      tpuft cluster down
"""


@click.group(help=_HELP)
def cluster() -> None:
    pass


def _run(action: str, fn: object) -> None:
    try:
        fn()  # type: ignore[operator]
    except (ClusterError, build.BuildError, topology.TopologyError) as error:
        _err(f"error: {action}: {error}")
        sys.exit(1)


@cluster.command("build")
def build_command() -> None:
    """Build (or reuse) the control-plane binaries. Cold: tens of minutes; cached afterwards."""

    def go() -> None:
        bins = build.ensure_built(default_cache(), _err)
        for name, path in bins.all().items():
            click.echo(f"{name:24} {path}")

    _run("build", go)


@cluster.command()
@name_option
@click.option("--timeout", default=180.0, show_default=True, help="Seconds to wait for each component.")
@click.option(
    "--kueue/--no-kueue",
    default=None,
    help="Run Kueue (default for a new cluster: yes; a running cluster keeps what it has).",
)
def up(name: str, timeout: float, kueue: bool | None) -> None:
    """Start the cluster, or the components of it that are not running (idempotent)."""

    def go() -> None:
        c = _cluster(name)
        wanted = kueue if kueue is not None else (None if c.layout.state.exists() else True)
        c.up(timeout=timeout, kueue=wanted)

    _run("cluster up", go)


@cluster.command()
@name_option
@click.option(
    "--all", "every", is_flag=True, help="Every local cluster on this machine (all names under the cache)."
)
def down(name: str, every: bool) -> None:
    """Stop every component and delete the cluster's state (etcd data, certificates, logs)."""

    def go() -> None:
        for one in LocalCluster.every(log=_err) if every else [_cluster(name)]:
            one.down()
            _err(f"cluster {one.name!r} is down")

    _run("cluster down", go)


@cluster.command("test-name")
@click.option(
    "--checkout",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=".",
    show_default=True,
    help="A directory in the checkout whose test cluster to name.",
)
def print_test_name(checkout: Path) -> None:
    """Print the name of the cluster the test suite of a checkout runs on (one per checkout:
    pytest-<directory>-<hash of its path>; TPUFT_TEST_CLUSTER overrides). Remove it with
    `tpuft cluster down --name "$(tpuft cluster test-name)"`, or `make clean-cluster`."""

    def go() -> None:
        root = enclosing_checkout(checkout)
        if root is None:
            raise ClusterError(f"{checkout.resolve()} is not in a checkout of tpuft: pass --checkout")
        click.echo(checkout_cluster_name(root))

    _run("cluster test-name", go)


@cluster.command()
@name_option
def status(name: str) -> None:
    """Show each component's process and health; exits 1 if any is down."""

    def go() -> None:
        c = _cluster(name)
        rows = c.status()
        click.echo(f"cluster {c.name!r} at {c.server} (state: {c.layout.root})")
        for row in rows:
            state = "healthy" if row.healthy else ("running, unhealthy" if row.running else "down")
            click.echo(f"  {row.name:24} {state:20} pid={row.pid or '-'}")
        if not all(row.healthy for row in rows):
            sys.exit(1)

    _run("cluster status", go)


@cluster.command()
@name_option
@click.argument("component", required=False)
@click.option("--lines", default=50, show_default=True, help="How many of the last lines to print.")
def logs(name: str, component: str | None, lines: int) -> None:
    """Print the last lines of a component's log (e.g. kueue-controller), or list the log files."""

    def go() -> None:
        c = _cluster(name)
        if component is None:
            for path in sorted(c.layout.logs.glob("*.log")):
                click.echo(path)
            return
        path = c.log_path(component)  # an unknown name: an error that lists the components
        if not path.exists():
            raise ClusterError(f"{component} has no log yet ({path}): has it been started?")
        click.echo("\n".join(path.read_text(errors="replace").splitlines()[-lines:]))

    _run("cluster logs", go)


@cluster.command()
@name_option
def env(name: str) -> None:
    """Print shell lines for `eval "$(tpuft cluster env)"`: KUBECONFIG, and kubectl/helm on PATH."""
    _run("cluster env", lambda: click.echo(_cluster(name).env()))


@cluster.command("add-nodepool")
@name_option
@click.option(
    "--type", "tpu_type", required=True, type=click.Choice(sorted(topology.FAMILIES)), help="TPU type."
)
@click.option(
    "--topology",
    "topology_name",
    required=True,
    help="Slice topology, e.g. 2x2 (v5e/v6e) or 2x2x2 (v4/v5p/tpu7x).",
)
@click.option("--slices", default=1, show_default=True, help="Node pools to create, one per slice.")
@click.option(
    "--chips-per-host",
    type=int,
    default=None,
    help="Chips per VM (v5e/v6e: 1, 4 or 8). Default: the catalog's.",
)
@click.option("--prefix", default=None, help="Node pool name prefix (default tpu-<type>-<topology>).")
def add_nodepool(
    name: str, tpu_type: str, topology_name: str, slices: int, chips_per_host: int | None, prefix: str | None
) -> None:
    """Add kwok nodes labelled, tainted and sized exactly like a GKE TPU node pool of this shape."""

    def go() -> None:
        nodes = _cluster(name).add_nodepool(
            tpu_type, topology_name, slices=slices, chips_per_host=chips_per_host, prefix=prefix
        )
        for node in nodes:
            click.echo(node)

    _run("add-nodepool", go)


@cluster.command()
@name_option
@click.option(
    "--service-account",
    metavar="NAMESPACE/NAME",
    default=None,
    help="Act as this ServiceAccount (RBAC applies).",
)
@click.option("--duration", default="24h", show_default=True, help="Token lifetime for --service-account.")
def kubeconfig(name: str, service_account: str | None, duration: str) -> None:
    """Print a kubeconfig: the admin one, or one that authenticates as a ServiceAccount."""

    def go() -> None:
        c = _cluster(name)
        if service_account is None:
            click.echo(c.kubeconfig.read_text(), nl=False)
            return
        namespace, _, sa = service_account.partition("/")
        if not sa:
            raise ClusterError("--service-account must be NAMESPACE/NAME")
        click.echo(c.service_account_kubeconfig(namespace, sa, duration=duration), nl=False)

    _run("kubeconfig", go)
