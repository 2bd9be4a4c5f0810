"""A real Kubernetes control plane on loopback: start, check, stop, and fake TPU node pools.

`LocalCluster.up()` is idempotent: it starts whatever is not running (keeping etcd's data), so the
same call brings up a new cluster, reuses a running one, or heals one a fault test broke.
Every component is a detached process with its log and pid under the cluster's directory, so the
cluster outlives the command that started it; `down()` stops them all and removes the directory.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonpatch
import yaml

from tpuft_dev.cluster import build, components, kwok, pki, versions
from tpuft_dev.cluster.components import Component, Layout
from tpuft_operator import topology

Log = Callable[[str], None]


def default_cache() -> Path:
    return Path(os.environ.get("TPUFT_CACHE", Path.home() / ".cache" / "tpuft"))


def default_name() -> str:
    return os.environ.get("TPUFT_CLUSTER", "default")


class ClusterError(RuntimeError):
    """The local cluster could not do what was asked; the message names the component."""


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def check_name(name: str) -> str:
    """``name`` if it can name a cluster: it is a directory under $TPUFT_CACHE/clusters (which
    `down` removes), a word in `tpuft cluster env`'s shell lines, and the test suite's fault cluster
    adds `-faults` to it. So: letters, digits, '.', '_' and '-', starting with a letter or digit, at
    most 63 characters (no '/' or '..' to leave the cache, nothing a shell would split or expand)."""
    if not _NAME.fullmatch(name):
        raise ClusterError(
            f"invalid cluster name {name!r}: use letters, digits, '.', '_' and '-', starting with a "
            "letter or digit, at most 63 characters"
        )
    return name


def checkout_cluster_name(checkout: Path, environ: Mapping[str, str] = os.environ) -> str:
    """The cluster the test suite of ``checkout`` runs on: TPUFT_TEST_CLUSTER if set, else
    `pytest-<directory name>-<8 hex digits of the sha256 of its resolved path>`. The same checkout
    always gets the same name (a warm re-run reuses its cluster), two checkouts two names (two
    `make test` on one machine do not share one cluster)."""
    override = environ.get("TPUFT_TEST_CLUSTER")
    if override:
        return check_name(override)
    root = checkout.resolve()
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:8]
    slug = re.sub(r"[^a-z0-9]+", "-", root.name.lower())[:24].strip("-")
    return check_name(f"pytest-{slug}-{digest}" if slug else f"pytest-{digest}")


def enclosing_checkout(start: Path) -> Path | None:
    """The checkout of this repository that ``start`` is in (the nearest directory, ``start``
    included, holding devtools/tpuft_dev and tests/conftest.py), or None."""
    for directory in [start.resolve(), *start.resolve().parents]:
        if (directory / "devtools" / "tpuft_dev").is_dir() and (directory / "tests/conftest.py").is_file():
            return directory
    return None


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    pid: int | None
    running: bool
    healthy: bool


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _tail(path: Path, lines: int = 30) -> str:
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class LocalCluster:
    def __init__(self, name: str | None = None, cache: Path | None = None, log: Log = print) -> None:
        self.name = check_name(name or default_name())
        self.cache = cache or default_cache()
        self.layout = Layout(self.cache / "clusters" / self.name)
        self.bins = build.binaries(self.cache)
        self.log = log

    # ----------------------------------------------------------------- state
    @property
    def ports(self) -> dict[str, int]:
        if not self.layout.state.exists():
            raise ClusterError(f"cluster {self.name!r} is not up: run `tpuft cluster up`")
        ports: dict[str, int] = json.loads(self.layout.state.read_text())["ports"]
        return ports

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['kube-apiserver']}"

    @property
    def kubeconfig(self) -> Path:
        return self.layout.admin_kubeconfig

    @property
    def kueue(self) -> bool:
        """Whether this cluster runs Kueue (recorded at `up(kueue=True)`, kept by later `up()`s)."""
        if not self.layout.state.exists():
            return False
        return bool(json.loads(self.layout.state.read_text()).get("kueue"))

    def _ensure_state(self, kueue: bool | None) -> dict[str, int]:
        state: dict[str, Any]
        if self.layout.state.exists():
            state = json.loads(self.layout.state.read_text())
        else:
            self.layout.root.mkdir(parents=True, exist_ok=True)
            state = {
                "name": self.name,
                "kubernetes": versions.KUBERNETES,
                "jobset": versions.JOBSET,
                "ports": {},
            }
        # A cluster made by an older tpuft lacks the ports of newer components: give them free ones.
        missing = [name for name in components.PORT_NAMES if name not in state["ports"]]
        state["ports"].update(zip(missing, _free_ports(len(missing)), strict=True))
        if kueue is not None:
            state["kueue"] = kueue
            state["kueueVersion"] = versions.KUEUE if kueue else None
        self.layout.state.write_text(json.dumps(state, indent=2))
        ports: dict[str, int] = state["ports"]
        return ports

    def _components(self) -> list[Component]:
        return components.specs(self.layout, self.bins, self.ports, kueue=self.kueue)

    # ----------------------------------------------------------------- processes
    def _pid(self, name: str) -> int | None:
        path = self.layout.pids / f"{name}.pid"
        if not path.exists():
            return None
        try:
            return int(path.read_text().strip())
        except ValueError:
            return None

    def _alive(self, component: Component) -> bool:
        pid = self._pid(component.name)
        if pid is None:
            return False
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            stat = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return False
        # A recycled pid runs some other program; a zombie has exited.
        return cmdline == component.argv[0] and stat != "Z"

    def _ssl_context(self, url: str) -> ssl.SSLContext | None:
        if not url.startswith("https://"):
            return None
        if f":{self.ports['kube-apiserver']}/" in url:
            ctx = ssl.create_default_context(cafile=str(self.layout.pki.ca_cert))
            ctx.load_cert_chain(str(self.layout.pki.admin_cert), str(self.layout.pki.admin_key))
            return ctx
        # kube-controller-manager and kube-scheduler serve /healthz with a self-signed certificate.
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx

    def _healthy(self, component: Component) -> bool:
        try:
            with urllib.request.urlopen(
                component.health_url, timeout=3, context=self._ssl_context(component.health_url)
            ) as response:
                return bool(response.status == 200)
        except (OSError, ssl.SSLError):
            return False

    def _start(self, component: Component, timeout: float) -> None:
        self.layout.logs.mkdir(parents=True, exist_ok=True)
        self.layout.pids.mkdir(parents=True, exist_ok=True)
        log_path = self.layout.logs / f"{component.name}.log"
        with log_path.open("ab") as log_file:
            process = subprocess.Popen(
                component.argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **component.env},
                start_new_session=True,  # outlives `tpuft cluster up`; Ctrl-C there does not kill it
            )
        (self.layout.pids / f"{component.name}.pid").write_text(str(process.pid))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise ClusterError(
                    f"{component.name} exited with code {process.returncode} while starting; "
                    f"last lines of {log_path}:\n{_tail(log_path)}"
                )
            if self._healthy(component):
                return
            time.sleep(0.3)
        raise ClusterError(
            f"{component.name} did not become healthy within {timeout:.0f}s ({component.health_url}); "
            f"last lines of {log_path}:\n{_tail(log_path)}"
        )

    def log_path(self, name: str) -> Path:
        """Where component ``name`` logs (ClusterError for a component this cluster does not run)."""
        return self.layout.logs / f"{self._component(name).name}.log"

    def start_component(self, name: str, timeout: float = 120) -> None:
        component = self._component(name)
        if not self._alive(component):
            self._start(component, timeout)

    def stop_component(self, name: str, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        component = self._component(name)
        pid = self._pid(name)
        if pid is None or not self._alive(component):
            return
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._alive(component):
            time.sleep(0.1)
        if self._alive(component):
            os.killpg(pid, signal.SIGKILL)
            time.sleep(0.2)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reap it when we are its parent (tests)

    def _component(self, name: str) -> Component:
        for component in self._components():
            if component.name == name:
                return component
        raise ClusterError(f"unknown component {name!r}; components: {', '.join(components.COMPONENTS)}")

    # ----------------------------------------------------------------- lifecycle
    def up(self, timeout: float = 180, *, kueue: bool | None = None) -> None:
        """Builds what is missing, then starts every component that is not running. ``kueue``
        True/False adds or leaves out the Kueue controller (None: as the cluster was started); once
        added it stays (its webhooks and CRDs would refuse or strand queued JobSets without it)."""
        if kueue is False and self.kueue:
            raise ClusterError(
                f"cluster {self.name!r} runs Kueue; `tpuft cluster down` it to start one without Kueue"
            )
        build.ensure_built(self.cache, self.log, kueue=bool(kueue) or self.kueue)
        ports = self._ensure_state(kueue)
        layout = self.layout
        pki.create(layout.pki.directory)
        layout.admin_kubeconfig.write_text(pki.admin_kubeconfig(self.server, layout.pki))
        layout.admin_kubeconfig.chmod(0o600)
        kwok_dir = build.module_cache_dir("sigs.k8s.io/kwok", versions.KWOK)
        configs = [
            (
                "jobset-controller",
                layout.jobset_config,
                yaml.safe_dump(components.jobset_configuration(layout, ports)),
            ),
            ("kwok", layout.kwok_config, kwok.stages_config(kwok_dir)),
        ]
        if self.kueue:
            configs.append(
                (
                    "kueue-controller",
                    layout.kueue_config,
                    yaml.safe_dump(components.kueue_configuration(layout, ports)),
                )
            )
        changed = [name for name, path, text in configs if _write_if_changed(path, text)]
        for name in changed:
            self.stop_component(name)  # restarted below with the new configuration

        started = []
        for component in self._components():
            if self._alive(component) and self._healthy(component):
                continue
            if self._alive(component):
                # Running but not healthy (yet): give it the same time as a fresh start before giving up.
                self._wait_healthy(component, timeout)
                continue
            if component.name == "kueue-controller":
                # Its manager will not start before its CRDs are served.
                self._install_kueue_api()
            self.log(f"starting {component.name}")
            self._start(component, timeout)
            started.append(component.name)
            if component.name == "kube-apiserver":
                self._install_jobset_api()
        if "kube-apiserver" not in started:
            self._install_jobset_api()  # idempotent; also repairs a deleted webhook configuration
        if self.kueue and "kueue-controller" not in started:
            self._install_kueue_api()
        self.add_cpu_pool()
        with_kueue = f"Kueue {versions.KUEUE}, " if self.kueue else ""
        self.log(
            f"cluster {self.name!r} is up: Kubernetes {versions.KUBERNETES}, JobSet {versions.JOBSET}, "
            f"{with_kueue}kwok {versions.KWOK}; apiserver {self.server}"
        )

    def _wait_healthy(self, component: Component, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._healthy(component):
                return
            time.sleep(0.3)
        log_path = self.layout.logs / f"{component.name}.log"
        raise ClusterError(
            f"{component.name} is running but not healthy; last lines of {log_path}:\n{_tail(log_path)}"
        )

    @classmethod
    def every(cls, cache: Path | None = None, log: Log = print) -> list[LocalCluster]:
        """Every cluster with state under the cache (``tpuft cluster down --all``)."""
        root = (cache or default_cache()) / "clusters"
        names = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        return [cls(name=name, cache=cache, log=log) for name in names]

    def down(self) -> None:
        """Stops every component (in reverse order) and removes the cluster's state."""
        if not self.layout.root.exists():
            return
        if self.layout.state.exists():
            for component in reversed(self._components()):
                self.stop_component(component.name)
        shutil.rmtree(self.layout.root, ignore_errors=True)

    def status(self) -> list[ComponentStatus]:
        result = []
        for component in self._components():
            alive = self._alive(component)
            result.append(
                ComponentStatus(
                    name=component.name,
                    pid=self._pid(component.name) if alive else None,
                    running=alive,
                    healthy=alive and self._healthy(component),
                )
            )
        return result

    def env(self) -> str:
        """Shell lines that point kubectl and helm at this cluster."""
        paths = sorted({str(self.bins.kubectl.parent), str(self.bins.helm.parent)})
        return "\n".join(
            [
                f"export KUBECONFIG={self.kubeconfig}",
                f"export PATH={':'.join(paths)}:$PATH",
                f"export TPUFT_CLUSTER={self.name}",
            ]
        )

    # ----------------------------------------------------------------- API helpers
    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, kubeconfig: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bins.kubectl), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=120)
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc

    def apply(self, objects: Sequence[dict[str, Any]] | str, *, field_manager: str = "tpuft-cluster") -> None:
        text = objects if isinstance(objects, str) else yaml.safe_dump_all(list(objects), sort_keys=False)
        self.kubectl(
            "apply",
            "--server-side",
            "--force-conflicts",
            f"--field-manager={field_manager}",
            "-f",
            "-",
            input=text,
        )

    def _install_jobset_api(self) -> None:
        """JobSet's CRD and its webhooks, pointed at the controller on loopback with our CA."""
        module = build.module_cache_dir("sigs.k8s.io/jobset", versions.JOBSET)
        crd = module / "config" / "components" / "crd" / "bases" / "jobset.x-k8s.io_jobsets.yaml"
        # ~800 KB: too big for client-side apply's last-applied annotation, hence server-side.
        self.apply(crd.read_text())
        self.apply(webhook_configurations(module, self.ports["jobset-webhook"], self.layout.pki.ca_cert))
        self.wait_established("jobsets.jobset.x-k8s.io")

    def _install_kueue_api(self) -> None:
        """Kueue's CRDs (with their conversion webhook) and its webhooks, from its module, pointed at
        the manager on loopback with our CA; and the metrics certificate its manager insists on."""
        module = build.module_cache_dir("sigs.k8s.io/kueue", versions.KUEUE)
        port, ca = self.ports["kueue-webhook"], self.layout.pki.ca_cert
        crds = kueue_crds(module, port, ca)
        self.apply(crds)
        self.apply(kueue_webhook_configurations(module, port, ca))
        for crd in crds:
            self.wait_established(crd["metadata"]["name"])
        ensure_kueue_metrics_cert(self.layout.pki.webhook_dir)

    def wait_established(self, crd: str, timeout: float = 60) -> None:
        """Waits for a CRD to be served. (`kubectl wait` fails outright while status is still empty.)"""
        jsonpath = '{.status.conditions[?(@.type=="Established")].status}'
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self.kubectl("get", "crd", crd, "-o", f"jsonpath={jsonpath}", check=False)
            if result.stdout.strip() == "True":
                return
            time.sleep(0.2)
        raise ClusterError(f"CRD {crd} was not established within {timeout:.0f}s")

    def add_nodepool(
        self,
        tpu_type: str,
        topology_name: str,
        *,
        slices: int = 1,
        chips_per_host: int | None = None,
        prefix: str | None = None,
        labels: Mapping[str, str] | None = None,
        wait: bool = True,
    ) -> list[str]:
        """Creates one kwok node pool per slice, shaped like GKE's, and waits for the nodes to be Ready.
        ``labels`` are added to every node (e.g. GKE's cloud.google.com/reservation-name)."""
        shape = topology.resolve(tpu_type, topology_name, slices=1, chips_per_host=chips_per_host)
        shape = topology.SliceShape(shape.family, shape.topology, shape.chips_per_host, slices)
        nodes = kwok.nodepool_nodes(shape, prefix=prefix)
        for node in nodes:
            node["metadata"]["labels"].update(labels or {})
        self.apply(nodes)
        names = [node["metadata"]["name"] for node in nodes]
        if wait:
            self.kubectl("wait", "--for=condition=Ready", "--timeout=60s", *[f"node/{n}" for n in names])
        return names

    def add_cpu_pool(self, *, wait: bool = True) -> list[str]:
        """The CPU node pool (kwok.cpu_pool_nodes): where the runs' prepare Jobs run. Idempotent;
        `up` makes it, so a run's data preparation never waits for a node."""
        nodes = kwok.cpu_pool_nodes()
        self.apply(nodes)
        names = [node["metadata"]["name"] for node in nodes]
        if wait:
            self.kubectl("wait", "--for=condition=Ready", "--timeout=60s", *[f"node/{n}" for n in names])
        return names

    def service_account_kubeconfig(
        self, namespace: str, name: str, *, duration: str = "24h", pod: tuple[str, str] | None = None
    ) -> str:
        """A kubeconfig that authenticates as a ServiceAccount, so RBAC applies. With ``pod`` (name,
        uid) the token is bound to that pod, as the one a kubelet mounts: the apiserver then knows
        the pod it comes from, and the token stops working once the pod is gone."""
        bound = (
            ["--bound-object-kind=Pod", f"--bound-object-name={pod[0]}", f"--bound-object-uid={pod[1]}"]
            if pod
            else []
        )
        token = self.kubectl(
            "create", "token", name, "-n", namespace, f"--duration={duration}", *bound
        ).stdout.strip()
        return pki.token_kubeconfig(self.server, self.layout.pki, token, namespace=namespace)


def _write_if_changed(path: Path, text: str) -> bool:
    if path.exists() and path.read_text() == text:
        return False
    path.write_text(text)
    return True


def webhook_configurations(jobset_module: Path, port: int, ca_cert: Path) -> list[dict[str, Any]]:
    """JobSet's webhook configurations from its module, with its kustomize patches applied and the
    in-cluster Service replaced by a URL on loopback (the controller runs as a local process)."""
    webhook_dir = jobset_module / "config" / "components" / "webhook"
    configs = [doc for doc in yaml.safe_load_all((webhook_dir / "manifests.yaml").read_text()) if doc]
    kustomization = yaml.safe_load((webhook_dir / "kustomization.yaml").read_text())
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        ops = yaml.safe_load((webhook_dir / patch["path"]).read_text())
        for config in configs:
            if config["kind"] == target["kind"] and config["metadata"]["name"] == target["name"]:
                config.update(jsonpatch.apply_patch(config, ops))
    ca_bundle = base64.b64encode(ca_cert.read_bytes()).decode()
    for config in configs:
        config["metadata"]["name"] = f"jobset-{config['metadata']['name']}"
        for webhook in config["webhooks"]:
            path = webhook["clientConfig"]["service"]["path"]
            webhook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca_bundle}
    return configs


def _url_client_config(path: str, port: int, ca_cert: Path) -> dict[str, str]:
    ca_bundle = base64.b64encode(ca_cert.read_bytes()).decode()
    return {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca_bundle}


def kueue_crds(kueue_module: Path, port: int, ca_cert: Path) -> list[dict[str, Any]]:
    """Kueue's CRDs as its config/components/crd kustomization lists them, with its conversion
    webhook patches (served by the manager at /convert) pointed at loopback."""
    crd_dir = kueue_module / "config" / "components" / "crd"
    kustomization = yaml.safe_load((crd_dir / "kustomization.yaml").read_text())
    crds = [yaml.safe_load((crd_dir / resource).read_text()) for resource in kustomization["resources"]]
    by_name = {crd["metadata"]["name"]: crd for crd in crds}
    for patch in kustomization.get("patches") or []:
        patched = yaml.safe_load((crd_dir / patch["path"]).read_text())
        conversion = (patched.get("spec") or {}).get("conversion")
        if not conversion or patched["metadata"]["name"] not in by_name:
            continue  # the cert-manager annotations are commented out upstream; nothing else is patched
        webhook = dict(conversion["webhook"])
        webhook["clientConfig"] = _url_client_config(
            webhook["clientConfig"]["service"]["path"], port, ca_cert
        )
        by_name[patched["metadata"]["name"]]["spec"]["conversion"] = {**conversion, "webhook": webhook}
    return crds


_WEBHOOK_FIELD = re.compile(r"^webhooks\.\[name=([^\]]+)\]\.(\w+)$")


def kueue_webhook_configurations(kueue_module: Path, port: int, ca_cert: Path) -> list[dict[str, Any]]:
    """Kueue's admission webhooks for its own objects and for JobSets (the one integration the local
    cluster enables: `components.KUEUE_FRAMEWORKS`), with its kustomization's namespaceSelector (not
    kube-system, not kueue-system) and URLs on loopback. The webhooks of disabled integrations are
    left out: the manager does not serve them, and a registered one would refuse every pod or Job."""
    webhook_dir = kueue_module / "config" / "components" / "webhook"
    configs = [doc for doc in yaml.safe_load_all((webhook_dir / "manifests.yaml").read_text()) if doc]
    kustomization = yaml.safe_load((webhook_dir / "kustomization.yaml").read_text())
    by_name = {w["name"]: w for config in configs for w in config["webhooks"]}
    for patch in kustomization.get("patches") or []:
        doc = yaml.safe_load(patch["patch"]) if "patch" in patch else {}
        for webhook in doc.get("webhooks") or []:
            if webhook["name"] in by_name:
                by_name[webhook["name"]].update({k: v for k, v in webhook.items() if k != "name"})
    for replacement in kustomization.get("replacements") or []:
        source = _WEBHOOK_FIELD.match(replacement["source"]["fieldPath"])
        if source is None or source[1] not in by_name:
            raise ClusterError(f"unexpected replacement in Kueue's webhook kustomization: {replacement}")
        value = by_name[source[1]].get(source[2])
        for target in replacement["targets"]:
            for field_path in target["fieldPaths"]:
                match = _WEBHOOK_FIELD.match(field_path)
                if match and match[1] in by_name:
                    by_name[match[1]][match[2]] = value
    groups = {"kueue.x-k8s.io", *(f.split("/")[0] for f in components.KUEUE_FRAMEWORKS)}
    for config in configs:
        config["metadata"]["name"] = f"kueue-{config['metadata']['name']}"
        config["webhooks"] = [
            {**w, "clientConfig": _url_client_config(w["clientConfig"]["service"]["path"], port, ca_cert)}
            for w in config["webhooks"]
            if {g for rule in w.get("rules") or [] for g in rule.get("apiGroups") or []} <= groups
        ]
    return configs


def ensure_kueue_metrics_cert(webhook_dir: Path, target: Path = components.KUEUE_METRICS_CERT_DIR) -> None:
    """Puts a certificate where Kueue's manager reads its metrics one (it serves no metrics here: any
    valid pair will do, so one left by another local cluster is kept)."""
    if (target / "tls.crt").exists() and (target / "tls.key").exists():
        return
    try:
        target.mkdir(parents=True, exist_ok=True)
        for name in ("tls.crt", "tls.key"):
            shutil.copyfile(webhook_dir / name, target / name)
    except OSError as error:
        raise ClusterError(
            f"Kueue's manager reads a metrics certificate from {target} even with metrics off, and it "
            f"cannot be written ({error}); create it once as root: mkdir -p {target} && "
            f"cp {webhook_dir}/tls.crt {webhook_dir}/tls.key {target}/"
        ) from error
