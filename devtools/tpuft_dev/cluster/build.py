"""Builds the control-plane binaries from their Go modules and caches them by version.

No registry we can reach ships kube-apiserver & co. as binaries, so they are compiled with the
machine's Go from the Go module proxy. Each component lands in ``<cache>/bin/<component>-<version>/``
and is rebuilt only when missing; a warm Go build cache makes a rebuild take seconds.

Kubernetes cannot be `go install`ed: its go.mod replaces every staging module (k8s.io/api, ...) with
a local path. A small helper module requires k8s.io/kubernetes and replaces each staging module with
its tagged release instead; the list is read from that release's own go.mod, never hard-coded. The
same helper module builds etcd from the exact etcd server version Kubernetes requires.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tpuft_dev.cluster import versions

Log = Callable[[str], None]


class BuildError(RuntimeError):
    """A component could not be built; the message says which and how to fix it."""


@dataclass(frozen=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    jobset: Path
    kueue: Path
    kwok: Path
    helm: Path

    def all(self) -> dict[str, Path]:
        return {name.replace("_", "-"): path for name, path in vars(self).items()}

    def missing(self) -> list[str]:
        return [name for name, path in self.all().items() if not os.access(path, os.X_OK)]


def _kubernetes_dir(cache: Path) -> Path:
    return cache / "bin" / f"kubernetes-{versions.KUBERNETES}"


def binaries(cache: Path) -> Binaries:
    """Where each binary lives for the pinned versions (built or not)."""
    k8s = _kubernetes_dir(cache)
    return Binaries(
        etcd=k8s / "etcd",
        kube_apiserver=k8s / "kube-apiserver",
        kube_controller_manager=k8s / "kube-controller-manager",
        kube_scheduler=k8s / "kube-scheduler",
        kubectl=k8s / "kubectl",
        jobset=cache / "bin" / f"jobset-{versions.JOBSET}" / "jobset",
        kueue=cache / "bin" / f"kueue-{versions.KUEUE}-k8s{versions.KUBERNETES}" / "kueue",
        kwok=cache / "bin" / f"kwok-{versions.KWOK}" / "kwok",
        helm=cache / "bin" / f"helm-{versions.HELM}-k8s1.{versions.kubernetes_minor()}" / "helm",
    )


def go_env() -> dict[str, str]:
    env = dict(os.environ)
    # The machine's Go is new enough; never download another toolchain behind the user's back.
    env.update(GOTOOLCHAIN="local", CGO_ENABLED="0")
    return env


def check_go() -> str:
    go = shutil.which("go")
    if go is None:
        raise BuildError(
            "the Go toolchain is not installed; the local cluster builds Kubernetes, JobSet, kwok and helm "
            f"from source and needs Go {'.'.join(map(str, versions.MIN_GO))} or newer "
            "(Debian: apt-get install golang-go, or https://go.dev/dl)"
        )
    out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, check=True).stdout.strip()
    match = re.match(r"go(\d+)\.(\d+)", out)
    if not match or (int(match[1]), int(match[2])) < versions.MIN_GO:
        raise BuildError(
            f"Go {'.'.join(map(str, versions.MIN_GO))}+ is required to build the cluster, found {out}"
        )
    return go


def module_cache_dir(module: str, version: str) -> Path:
    """Downloads a Go module (if needed) and returns its directory in the module cache."""
    info = _go_json(["mod", "download", "-json", f"{module}@{version}"])
    return Path(info["Dir"])


def _go_json(args: Sequence[str]) -> dict[str, str]:
    proc = subprocess.run(["go", *args], capture_output=True, text=True, env=go_env())
    if proc.returncode != 0:
        raise BuildError(f"`go {' '.join(args)}` failed:\n{proc.stderr.strip() or proc.stdout.strip()}")
    result: dict[str, str] = json.loads(proc.stdout)
    return result


def _run(cmd: Sequence[str], *, cwd: Path, log_file: Path, what: str) -> None:
    with log_file.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=go_env())
    if proc.returncode != 0:
        tail = "\n".join(log_file.read_text().splitlines()[-25:])
        raise BuildError(f"building {what} failed (exit {proc.returncode}); full log: {log_file}\n{tail}")


def _version_ldflags() -> str:
    # Without these the binaries report v0.0.0-master, which breaks helm's kubeVersion checks and kwok.
    major, minor = "1", versions.kubernetes_minor()
    flags = ["-s", "-w"]
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {pkg}.gitVersion={versions.KUBERNETES}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
            f"-X {pkg}.buildDate=1970-01-01T00:00:00Z",
        ]
    return " ".join(flags)


def _staging_modules(kubernetes_go_mod: str) -> list[str]:
    return sorted(set(re.findall(r"^\s*(k8s\.io/\S+)\s+=>\s+\./staging/src/", kubernetes_go_mod, re.M)))


_ETCD_MAIN = """package main

// etcd's own main package lives in a module with local replaces; this calls the same entry point.
import (
\t"os"

\t"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
"""

_K8S_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")


def _write_helper_module(
    src: Path, name: str, requires: dict[str, str], packages: Sequence[str], replaces: Sequence[str] = ()
) -> None:
    """A throwaway main module that depends on the component and names its commands.

    `go install module@version` is not used: the module proxy here refuses the version list that
    `go install` reads for deprecation notices, and Kubernetes needs replaces anyway.
    """
    src.mkdir(parents=True, exist_ok=True)
    lines = [f"module tpuft.local/{name}-build", "", "go 1.26.0", ""]
    lines += [f"require {module} {version}" for module, version in requires.items()] + [""]
    lines += list(replaces)
    (src / "go.mod").write_text("\n".join(lines) + "\n")
    imports = "\n".join(f'\t_ "{pkg}"' for pkg in packages if not pkg.startswith("./"))
    (src / "tools.go").write_text(f"//go:build tools\n\npackage tools\n\nimport (\n{imports}\n)\n")


def _build_helper_module(
    cache: Path,
    *,
    name: str,
    version: str,
    requires: dict[str, str],
    packages: Sequence[str],
    out_dir: Path,
    log_file: Path,
    ldflags: str = "-s -w",
    replaces: Sequence[str] = (),
    extra_files: dict[str, str] | None = None,
) -> None:
    src = cache / "src" / f"{name}-{version}"
    _write_helper_module(src, name, requires, packages, replaces)
    for relative, text in (extra_files or {}).items():
        (src / relative).parent.mkdir(parents=True, exist_ok=True)
        (src / relative).write_text(text)
    _run(["go", "mod", "tidy"], cwd=src, log_file=log_file, what=f"the {name} helper module (go mod tidy)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging_dir = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    cmd = ["go", "build", "-trimpath", "-tags=selinux,notest", f"-ldflags={ldflags}", "-o", f"{staging_dir}/"]
    _run([*cmd, *packages], cwd=src, log_file=log_file, what=f"{name} {version} ({', '.join(packages)})")
    _publish(staging_dir, out_dir)


def _build_kubernetes(cache: Path, log_file: Path, log: Log) -> None:
    log(f"building kubernetes {versions.KUBERNETES} and etcd (cold: ~10-25 min on 2 cores; log: {log_file})")
    go_mod_path = _go_json(["mod", "download", "-json", f"k8s.io/kubernetes@{versions.KUBERNETES}"])["GoMod"]
    staging = _staging_modules(Path(go_mod_path).read_text())
    if not staging:
        raise BuildError(f"found no staging modules in k8s.io/kubernetes@{versions.KUBERNETES}'s go.mod")
    _build_helper_module(
        cache,
        name="kubernetes",
        version=versions.KUBERNETES,
        requires={"k8s.io/kubernetes": versions.KUBERNETES},
        replaces=[f"replace {mod} => {mod} {versions.staging_version()}" for mod in staging],
        packages=[*(f"k8s.io/kubernetes/cmd/{c}" for c in _K8S_COMMANDS), "./cmd/etcd"],
        extra_files={"cmd/etcd/main.go": _ETCD_MAIN},
        out_dir=_kubernetes_dir(cache),
        log_file=log_file,
        ldflags=_version_ldflags(),
    )


def _build_kueue(cache: Path, binary: Path, log_file: Path, log: Log) -> None:
    """Kueue's manager (sigs.k8s.io/kueue/cmd/kueue). It imports a few scheduler packages of
    k8s.io/kubernetes, so it gets the same staging replaces as the Kubernetes build, pinned to the
    cluster's own Kubernetes patch release: one set of client libraries, shared in the Go build cache."""
    log(f"building kueue {versions.KUEUE} (cold: ~5-10 min on 2 cores after Kubernetes; log: {log_file})")
    go_mod_path = _go_json(["mod", "download", "-json", f"k8s.io/kubernetes@{versions.KUBERNETES}"])["GoMod"]
    staging = _staging_modules(Path(go_mod_path).read_text())
    version_pkg = "sigs.k8s.io/kueue/pkg/version"
    _build_helper_module(
        cache,
        name="kueue",
        version=f"{versions.KUEUE}-k8s{versions.KUBERNETES}",
        requires={"sigs.k8s.io/kueue": versions.KUEUE, "k8s.io/kubernetes": versions.KUBERNETES},
        replaces=[f"replace {mod} => {mod} {versions.staging_version()}" for mod in staging],
        packages=["sigs.k8s.io/kueue/cmd/kueue"],
        out_dir=binary.parent,
        log_file=log_file,
        ldflags=(
            f"-s -w -X {version_pkg}.GitVersion={versions.KUEUE} -X {version_pkg}.BuildDate=1970-01-01T00:00:00Z"
        ),
    )


def _publish(staging_dir: Path, final_dir: Path) -> None:
    """Makes a finished build visible atomically, so an interrupted build is never mistaken for one."""
    if final_dir.exists():
        shutil.rmtree(final_dir)
    staging_dir.chmod(0o755)
    staging_dir.rename(final_dir)


def _helm_ldflags() -> str:
    # Offline `helm template`/`lint` otherwise assume Kubernetes 1.20 for .Capabilities.KubeVersion.
    minor = versions.kubernetes_minor()
    flags = [
        f"-X helm.sh/helm/v3/pkg/{pkg}.k8sVersion{part}={value}"
        for pkg in ("lint/rules", "chartutil")
        for part, value in (("Major", "1"), ("Minor", minor))
    ]
    return " ".join(["-s", "-w", *flags])


def ensure_built(cache: Path, log: Log = print, *, kueue: bool = True) -> Binaries:
    """Builds whatever is missing for the pinned versions and returns the binaries (Kueue's only
    with ``kueue``: a cluster without it need not wait for its build)."""
    bins = binaries(cache)
    missing = [name for name in bins.missing() if kueue or name != "kueue"]
    if not missing:
        return bins
    check_go()
    (cache / "bin").mkdir(parents=True, exist_ok=True)
    logs = cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    k8s_names = {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl"}
    if k8s_names & set(missing):
        _build_kubernetes(cache, logs / f"build-kubernetes-{versions.KUBERNETES}.log", log)
    if "kueue" in missing:
        _build_kueue(cache, bins.kueue, logs / f"build-kueue-{versions.KUEUE}.log", log)
    simple = (
        ("jobset", "sigs.k8s.io/jobset", versions.JOBSET, "sigs.k8s.io/jobset", bins.jobset, "-s -w"),
        ("kwok", "sigs.k8s.io/kwok", versions.KWOK, "sigs.k8s.io/kwok/cmd/kwok", bins.kwok, "-s -w"),
        ("helm", "helm.sh/helm/v3", versions.HELM, "helm.sh/helm/v3/cmd/helm", bins.helm, _helm_ldflags()),
    )
    for name, module, version, package, binary, ldflags in simple:
        if name not in missing:
            continue
        log(f"building {name} {version}")
        _build_helper_module(
            cache,
            name=name,
            version=version,
            requires={module: version},
            packages=[package],
            out_dir=binary.parent,
            log_file=logs / f"build-{name}-{version}.log",
            ldflags=ldflags,
        )
    still_missing = [name for name in bins.missing() if kueue or name != "kueue"]
    if still_missing:
        raise BuildError(f"the build finished but these binaries are missing: {', '.join(still_missing)}")
    return bins
