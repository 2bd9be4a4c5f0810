"""Pinned versions of every component of the local control plane: the one place to change them.

They move together: JobSet v0.12 builds against Kubernetes 1.36; Kueue v0.19 is the first release
built against Kubernetes 1.36 (and JobSet v0.12), and its e2e suites run on 1.34-1.36 (v0.18 is not
served by the module proxy; v0.17 is built against 1.35); etcd comes from the version that
Kubernetes itself requires (read from its go.mod at build time, so it cannot disagree); helm's
offline `template`/`lint` assume the Kubernetes minor given here.
"""

from __future__ import annotations

KUBERNETES = "v1.36.3"
JOBSET = "v0.12.0"
KUEUE = "v0.19.0"
KWOK = "v0.8.0"
HELM = "v3.22.0"
# The Go toolchain these modules need (go.mod `go` lines of kubernetes 1.36, jobset 0.12, kueue 0.19).
MIN_GO = (1, 26)


def kubernetes_minor() -> str:
    return KUBERNETES.lstrip("v").split(".")[1]


def staging_version() -> str:
    """k8s.io/api & co. are tagged v0.<minor>.<patch> for Kubernetes v1.<minor>.<patch>."""
    _, minor, patch = KUBERNETES.lstrip("v").split(".")
    return f"v0.{minor}.{patch}"
