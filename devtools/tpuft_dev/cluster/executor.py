"""Runs the containers of fake-node pods as host processes: a tiny kubelet for the local cluster.

kwok schedules and starts pods on fake TPU nodes but runs nothing. For `make demo` (and the e2e test
of progress), pods annotated ``tpuft.dev/run-on-host: "true"`` are executed for real: the executor
waits until kwok reports the pod Running, then runs the container's exact command on this machine
with the pod's environment (values, downward-API fields, Secret keys), its downward-API and
ConfigMap volumes materialised in a temporary directory (downward-API files refreshed while it runs,
as a kubelet does: the operator's checkpoint requests arrive that way), and credentials of the pod's
ServiceAccount (a bound token, so RBAC applies exactly as in the pod). When the process exits it
reports the exit code in the pod status, as a kubelet does, with the container's termination message
(the file at its terminationMessagePath, default /dev/termination-log, is a file of the pod's work
directory here: `tpuft prepare --summary-file` writes the prepared data's figures there). `google.com/tpu:
N` becomes N PJRT CPU devices.

Deletion is a kubelet's too (suspend, a drain, a JobSet restart): the process gets SIGTERM, SIGKILL
after the pod's grace period, its exit code is reported, and only then is the pod deleted (kwok's
own pod-delete stage is switched off for these pods, see `run_on_host_annotations`).

Each pod's processes form one process group, killed whole when the container stops (a container's
cgroup): a native pod's `tpuft train` is a launcher with one worker process per chip, and SIGKILL of the
launcher alone would orphan them. SIGTERM goes to the first process only, as a kubelet sends it.

Images are ignored: the host's Python environment is the image. Except for the trainer's backend (the
`backend:` of the trainer config the pod mounts, pod_contract.TRAINER_CONFIG_ANNOTATION: what `tpuft`
itself branches on, in the prepare pod as in the TPU pods): a `backend: native` pod's `tpuft` runs in the
native venv (`scripts/venv.sh native`: torch 2.15, no torch_xla), as the native image would. Its
torch.distributed rendezvous address, the first pod's cluster DNS name, does not resolve here: it becomes
127.0.0.1, with a free port per JobSet and restart attempt, which every host of that attempt agrees on,
and a native pod of several hosts gets the TPU_WORKER_ID and TPU_WORKER_HOSTNAMES GKE's TPU webhook would
set (see `native_rendezvous`).

Limits, by design: hostPath volumes must be mounted at their own path (no chroot here); xla pods of a
multi-host shape are not joined up (PJRT's CPU client here is one process's: the executor runs
single-host xla shapes).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tpuft_dev.cluster.kwok import hold_running
from tpuft_dev.cluster.local import LocalCluster
from tpuft_operator.topology import TPU_RESOURCE
from tpuft_trainer.pod_contract import (
    COORDINATOR_ADDRESS_ENV,
    JOB_COMPLETION_INDEX_ENV,
    MASTER_ADDR_ENV,
    MASTER_PORT_ENV,
    MEGASCALE_NUM_SLICES_ENV,
    NNODES_ENV,
    TPU_WORKER_HOSTNAMES_ENV,
    TPU_WORKER_ID_ENV,
    TRAINER_CONFIG_ANNOTATION,
)

RUN_ON_HOST_ANNOTATION = "tpuft.dev/run-on-host"
# A kubelet keeps at most this much of a termination message (the API's limit).
TERMINATION_MESSAGE_LIMIT = 4096
DEFAULT_TERMINATION_MESSAGE_PATH = "/dev/termination-log"
log = logging.getLogger("tpuft.executor")
REPO = Path(__file__).resolve().parents[3]
# The labels and annotation JobSet puts on its pods: which JobSet, and which restart of it.
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
RESTART_ATTEMPT_ANNOTATION = "jobset.sigs.k8s.io/restart-attempt"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"  # the Job controller's, on each pod of a Job
LOOPBACK = "127.0.0.1"


# kwok's upstream pod-delete stage reads its weight from this annotation; 0 leaves deletion to us.
_DELETE_WEIGHT_ANNOTATION = "pod-delete.stage.kwok.x-k8s.io/weight"


def run_on_host_annotations() -> dict[str, str]:
    """Pod annotations for a pod the executor should run (kwok keeps it Running meanwhile, and leaves
    its deletion to the executor, which stops the process first)."""
    return {RUN_ON_HOST_ANNOTATION: "true", _DELETE_WEIGHT_ANNOTATION: "0", **hold_running("24h")}


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.tmp")
    partial.write_text(text)
    os.replace(partial, path)


class PodSpecError(RuntimeError):
    """The pod uses something the executor cannot reproduce on the host."""


def pod_backend(pod: dict[str, Any]) -> str:
    """The trainer backend a pod runs: the `backend:` of the trainer config it mounts (the annotation
    both the prepare pod and the TPU pods carry), `xla` when it has none. This, not the image (a spec's
    own image, an operator's image settings) nor the native environment variables (the prepare pod has
    none), is what `tpuft prepare` and `tpuft train` themselves read."""
    text = (pod["metadata"].get("annotations") or {}).get(TRAINER_CONFIG_ANNOTATION)
    if not text:
        return "xla"
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise PodSpecError(f"its {TRAINER_CONFIG_ANNOTATION} annotation is not YAML: {error}") from error
    backend = config.get("backend", "xla") if isinstance(config, dict) else "xla"
    return str(backend)


def native_python() -> str:
    """The interpreter of the native backend's venv (what the native image's `tpuft` runs in)."""
    path = subprocess.run(
        [str(REPO / "scripts" / "venv.sh"), "native", "--path"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if not (Path(path) / ".complete").is_file():
        raise PodSpecError(
            f"the native backend's venv is missing at {path}: run `scripts/venv.sh native` (or make "
            "venv-native) to run backend native pods on this host"
        )
    return str(Path(path) / "bin" / "python")


def tpu_webhook_env(pod: dict[str, Any], env: dict[str, str]) -> dict[str, str]:
    """What GKE's TPU webhook sets on the pods of an Indexed Job with a subdomain, and kwok does not:
    TPU_WORKER_ID (the completion index) and TPU_WORKER_HOSTNAMES (every host of the pod's own Job,
    i.e. its slice, by stable name, in completion-index order), which the trainer counts against the
    job's hosts per slice before it will launch (world.detect_world). The hosts of a slice: the NNODES
    the renderer sets on native pods (every slice's hosts) over MEGASCALE_NUM_SLICES (rendered on native
    pods of several slices). Given only to native pods: their processes meet at MASTER_ADDR, rewritten
    to this host; an xla pod of several hosts would start as an independent copy here, and is better
    refused by that check."""
    index = env.get(JOB_COMPLETION_INDEX_ENV)
    hosts = env.get(NNODES_ENV)
    slices = int(env.get(MEGASCALE_NUM_SLICES_ENV) or 1)
    job = (pod["metadata"].get("labels") or {}).get(JOB_NAME_LABEL)
    subdomain = pod["spec"].get("subdomain")
    if TPU_WORKER_HOSTNAMES_ENV in env or None in (index, hosts, job, subdomain):
        return {}  # set already (a real node), or not a pod the webhook would touch
    names = [f"{job}-{i}.{subdomain}" for i in range(int(str(hosts)) // slices)]
    return {TPU_WORKER_ID_ENV: str(index), TPU_WORKER_HOSTNAMES_ENV: ",".join(names)}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


_FIELD_PATH = re.compile(r"^metadata\.(annotations|labels)\['([^']+)'\]$")


def _field_value(pod: dict[str, Any], path: str) -> str:
    simple = {
        "metadata.name": pod["metadata"]["name"],
        "metadata.namespace": pod["metadata"]["namespace"],
        "metadata.uid": pod["metadata"].get("uid", ""),
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
        "status.podIP": pod.get("status", {}).get("podIP", "127.0.0.1"),
    }
    if path in simple:
        return str(simple[path])
    match = _FIELD_PATH.match(path)
    if match:
        return str((pod["metadata"].get(match[1]) or {}).get(match[2], ""))
    raise PodSpecError(f"unsupported fieldRef {path!r}")


@dataclass
class HostProcess:
    pod: str
    process: subprocess.Popen[bytes]
    workdir: Path
    log_path: Path
    # The pod's downward-API volumes: mount name -> host directory, rewritten when the pod changes.
    downward: dict[str, Path] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    # Set once the pod is being deleted: when SIGTERM was sent, and the grace period after it.
    terminating_since: float | None = None
    grace_seconds: float = 30.0
    # Where the container's terminationMessagePath points on the host.
    termination_log: Path | None = None

    def termination_message(self) -> str:
        """What a kubelet reports as the container's state.terminated.message (policy File)."""
        if self.termination_log is None or not self.termination_log.is_file():
            return ""
        return self.termination_log.read_bytes()[:TERMINATION_MESSAGE_LIMIT].decode(errors="replace")


@dataclass
class LocalExecutor:
    cluster: LocalCluster
    namespace: str
    log_dir: Path
    poll_seconds: float = 1.0
    extra_env: dict[str, str] = field(default_factory=dict)
    _running: dict[str, HostProcess] = field(default_factory=dict)
    # (namespace, JobSet, restart attempt) -> the rendezvous port its native pods meet on here.
    _rendezvous_ports: dict[tuple[str, str, str], int] = field(default_factory=dict)
    _done: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._loop, name="local-executor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for host in self._running.values():
            if host.process.poll() is None:
                host.process.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    host.process.wait(timeout=20)
            _kill_group(host.process)
            shutil.rmtree(host.workdir, ignore_errors=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception as error:  # a transient API error must not end the executor
                log.warning("executor pass failed: %s", error)
            self._stop.wait(self.poll_seconds)

    def _tick(self) -> None:
        pods = json.loads(self.cluster.kubectl("get", "pods", "-n", self.namespace, "-o", "json").stdout)[
            "items"
        ]
        by_name = {pod["metadata"]["name"]: pod for pod in pods}
        for pod in pods:
            name = pod["metadata"]["name"]
            wanted = (pod["metadata"].get("annotations") or {}).get(RUN_ON_HOST_ANNOTATION) == "true"
            running = pod.get("status", {}).get("phase") == "Running"
            deleting = bool(pod["metadata"].get("deletionTimestamp"))
            if wanted and running and not deleting and name not in self._running and name not in self._done:
                self._launch(pod)
            elif wanted and deleting and name not in self._running:
                self._finish_deletion(name)  # never started here, or already stopped
        for name, host in list(self._running.items()):
            pod = by_name.get(name)
            if pod is None or pod["metadata"].get("deletionTimestamp"):
                self._terminate(host, pod)
            elif host.process.poll() is None:
                self._refresh_downward(host, pod)
            code = host.process.poll()
            if code is not None:
                _kill_group(host.process)  # the container stopped: whatever it left running goes too
                if pod is not None:
                    self._report_exit(name, code, host.termination_message())
                    if pod["metadata"].get("deletionTimestamp"):
                        self._finish_deletion(name)
                del self._running[name]
                self._done.add(name)
                shutil.rmtree(host.workdir, ignore_errors=True)

    def _terminate(self, host: HostProcess, pod: dict[str, Any] | None) -> None:
        """What a kubelet does for a pod being deleted: SIGTERM, then SIGKILL after the grace period."""
        if host.process.poll() is not None:
            return
        now = time.monotonic()
        if host.terminating_since is None:
            grace = None
            if pod is not None:
                grace = pod["metadata"].get("deletionGracePeriodSeconds")
                if grace is None:
                    grace = pod["spec"].get("terminationGracePeriodSeconds")
            host.grace_seconds = float(grace if grace is not None else 30)
            host.terminating_since = now
            host.process.send_signal(signal.SIGTERM)
            log.info("pod %s is being deleted: SIGTERM, %.0f s grace", host.pod, host.grace_seconds)
        elif now - host.terminating_since > host.grace_seconds:
            log.warning("pod %s did not stop within %.0f s: SIGKILL", host.pod, host.grace_seconds)
            _kill_group(host.process)

    def _finish_deletion(self, name: str) -> None:
        """The kubelet's last word on a deleted pod whose containers have stopped."""
        self.cluster.kubectl(
            "delete",
            "pod",
            name,
            "-n",
            self.namespace,
            "--grace-period=0",
            "--force",
            "--wait=false",
            check=False,
        )

    def _refresh_downward(self, host: HostProcess, pod: dict[str, Any]) -> None:
        """Rewrites the downward-API files when the pod's annotations changed (kubelets do this on
        their sync loop), each file replaced at once so a reader never sees half of it."""
        annotations = dict(pod["metadata"].get("annotations") or {})
        if annotations == host.annotations:
            return
        host.annotations = annotations
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        for name, target in host.downward.items():
            for relative, text in self._volume_files(pod, name, volumes[name]).items():
                _write_atomically(target / relative, text)

    # ------------------------------------------------------------------ one pod
    def _launch(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        workdir = Path(tempfile.mkdtemp(prefix=f"tpuft-pod-{name}-"))
        try:
            container = pod["spec"]["containers"][0]
            mounts = self._mounts(pod, container, workdir)
            termination_log = workdir / "termination-log"
            mounts[container.get("terminationMessagePath") or DEFAULT_TERMINATION_MESSAGE_PATH] = str(
                termination_log
            )
            argv = [
                self._rewrite(arg, mounts)
                for arg in [*container.get("command", []), *container.get("args", [])]
            ]
            native = pod_backend(pod) == "native"
            if argv and argv[0] == "tpuft":
                # The image's entry point is this environment's tpuft, whatever PATH says; the native
                # image's is the native venv's.
                argv[:1] = [native_python() if native else sys.executable, "-m", "tpuft_operator"]
            env = self._environment(pod, container, workdir)
            if native:
                env.update(self.native_rendezvous(pod, env))
        except PodSpecError as error:
            log.error("cannot run pod %s on the host: %s", name, error)
            self._report_exit(name, 127, f"the local executor cannot run this pod: {error}")
            self._done.add(name)
            return
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("ab") as out:
            try:
                # A session of its own: the pod's processes are one group, stopped together (_kill_group).
                process = subprocess.Popen(
                    argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir, start_new_session=True
                )
            except OSError as error:  # what a kubelet reports as a failed container start
                log.error("cannot start pod %s: %s", name, error)
                self._report_exit(name, 127)
                self._done.add(name)
                return
        log.info("running pod %s on the host: %s (log %s)", name, " ".join(argv), log_path)
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        downward = {
            m["name"]: workdir / "volumes" / m["name"]
            for m in container.get("volumeMounts") or []
            if "downwardAPI" in volumes.get(m["name"], {})
        }
        annotations = dict(pod["metadata"].get("annotations") or {})
        self._running[name] = HostProcess(
            name, process, workdir, log_path, downward, annotations, termination_log=termination_log
        )

    def _mounts(self, pod: dict[str, Any], container: dict[str, Any], workdir: Path) -> dict[str, str]:
        """mountPath -> host path, materialising downward-API and ConfigMap volumes."""
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        mounts: dict[str, str] = {}
        for mount in container.get("volumeMounts") or []:
            volume = volumes.get(mount["name"], {})
            if "downwardAPI" in volume or "configMap" in volume:
                target = workdir / "volumes" / mount["name"]
                target.mkdir(parents=True, exist_ok=True)
                for relative, text in self._volume_files(pod, mount["name"], volume).items():
                    _write_atomically(target / relative, text)
                mounts[mount["mountPath"]] = str(target)
            elif "hostPath" in volume:
                if volume["hostPath"]["path"] != mount["mountPath"]:
                    raise PodSpecError(
                        f"hostPath {volume['hostPath']['path']} is mounted at {mount['mountPath']}; "
                        "on the host a hostPath must be mounted at its own path"
                    )
            elif "projected" in volume or "emptyDir" in volume:
                continue  # the ServiceAccount token (handled by KUBECONFIG) and scratch space
            else:
                raise PodSpecError(f"volume {mount['name']} has a kind the executor does not support")
        return mounts

    def _volume_files(self, pod: dict[str, Any], name: str, volume: dict[str, Any]) -> dict[str, str]:
        """Relative path -> content of a downward-API or ConfigMap volume, as a kubelet would write it."""
        if "downwardAPI" in volume:  # the trainer config (render/jobset.py)
            files = {}
            for item in volume["downwardAPI"].get("items") or []:
                if "fieldRef" not in item:
                    raise PodSpecError(f"volume {name}: only fieldRef items are supported")
                files[item["path"]] = _field_value(pod, item["fieldRef"]["fieldPath"])
            return files
        namespace = pod["metadata"]["namespace"]
        config_map = json.loads(
            self.cluster.kubectl(
                "get", "configmap", volume["configMap"]["name"], "-n", namespace, "-o", "json"
            ).stdout
        )
        return dict(config_map.get("data") or {})

    @staticmethod
    def _rewrite(arg: str, mounts: dict[str, str]) -> str:
        for mount_path, host_path in mounts.items():
            if arg == mount_path or arg.startswith(mount_path.rstrip("/") + "/"):
                return host_path + arg[len(mount_path.rstrip("/")) :]
        return arg

    def _environment(self, pod: dict[str, Any], container: dict[str, Any], workdir: Path) -> dict[str, str]:
        namespace = pod["metadata"]["namespace"]
        env = {
            key: value
            for key, value in os.environ.items()
            if key in ("PATH", "HOME", "LANG", "PYTHONPATH", "TPUFT_CACHE")
        }
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = str(item["value"])
                continue
            source = item.get("valueFrom") or {}
            if "fieldRef" in source:
                env[item["name"]] = _field_value(pod, source["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                result = self.cluster.kubectl(
                    "get",
                    "secret",
                    ref["name"],
                    "-n",
                    namespace,
                    "-o",
                    f"jsonpath={{.data.{ref['key']}}}",
                    check=False,
                )
                if result.returncode == 0 and result.stdout:
                    import base64

                    env[item["name"]] = base64.b64decode(result.stdout).decode()
                elif not ref.get("optional"):
                    raise PodSpecError(f"Secret {ref['name']} key {ref['key']} not found")
        # The pod's own identity: a token of its ServiceAccount bound to the pod, like the one a
        # kubelet mounts, so RBAC and admission see exactly what they would see on a node.
        kubeconfig = workdir / "kubeconfig"
        kubeconfig.write_text(
            self.cluster.service_account_kubeconfig(
                namespace,
                pod["spec"].get("serviceAccountName") or "default",
                pod=(pod["metadata"]["name"], pod["metadata"]["uid"]),
            )
        )
        env["KUBECONFIG"] = str(kubeconfig)
        chips = (container.get("resources", {}).get("limits") or {}).get(TPU_RESOURCE, "1")
        env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(chips), HF_HUB_OFFLINE="1")
        env.update(self.extra_env)
        return env

    def native_rendezvous(self, pod: dict[str, Any], env: dict[str, str]) -> dict[str, str]:
        """A native pod's rendezvous, made to work on this host: MASTER_ADDR (the first pod of the first
        slice's cluster DNS name) becomes 127.0.0.1, and MASTER_PORT a free port shared by every pod of
        the same JobSet (every slice's Job) and restart attempt (one per attempt: a restarted group never meets a port the previous one
        may still hold), so concurrent runs never meet each other. TPUFT_COORDINATOR_ADDRESS (the same
        DNS name) is pointed here too, though the native trainer's stop channel rides its own
        torch.distributed group and does not dial it."""
        if MASTER_ADDR_ENV not in env:  # the prepare pod: one process, no rendezvous
            return {}
        metadata = pod["metadata"]
        key = (
            metadata["namespace"],
            (metadata.get("labels") or {}).get(JOBSET_NAME_LABEL, metadata["name"]),
            (metadata.get("annotations") or {}).get(RESTART_ATTEMPT_ANNOTATION, "0"),
        )
        if key not in self._rendezvous_ports:
            self._rendezvous_ports[key] = free_port()
        rewritten = {MASTER_ADDR_ENV: LOOPBACK, MASTER_PORT_ENV: str(self._rendezvous_ports[key])}
        if COORDINATOR_ADDRESS_ENV in env:
            rewritten[COORDINATOR_ADDRESS_ENV] = LOOPBACK
        rewritten.update(tpu_webhook_env(pod, env))
        return rewritten

    def _report_exit(self, name: str, code: int, message: str = "") -> None:
        """What a kubelet reports when the container exits (``message``: its termination message)."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        pod = json.loads(self.cluster.kubectl("get", "pod", name, "-n", self.namespace, "-o", "json").stdout)
        statuses = [
            {
                "name": c["name"],
                "image": c["image"],
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "started": False,
                "state": {
                    "terminated": {
                        "exitCode": code,
                        "reason": "Completed" if code == 0 else "Error",
                        "startedAt": now,
                        "finishedAt": now,
                        **({"message": message} if message else {}),
                    }
                },
            }
            for c in pod["spec"]["containers"]
        ]
        patch = {
            "status": {
                "phase": "Succeeded" if code == 0 else "Failed",
                "containerStatuses": statuses,
                "conditions": [{"type": "Ready", "status": "False", "reason": "PodCompleted"}],
            }
        }
        self.cluster.kubectl(
            "patch",
            "pod",
            name,
            "-n",
            self.namespace,
            "--subresource=status",
            "--type=strategic",
            "-p",
            json.dumps(patch),
        )
        log.info("pod %s exited with code %d", name, code)

    def kill_all(self) -> list[str]:
        """SIGKILLs every running pod process (a preempted host); returns the pods hit."""
        hit = []
        for name, host in self._running.items():
            if host.process.poll() is None:
                _kill_group(host.process)
                hit.append(name)
        return hit

    def logs(self) -> dict[str, Path]:
        return {name: host.log_path for name, host in self._running.items()}


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL to every process of a pod (its own session: start_new_session), as a container's
    cgroup is killed: a native launcher's workers die with it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
        os.killpg(process.pid, signal.SIGKILL)
