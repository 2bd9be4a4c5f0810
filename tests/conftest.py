"""Fixtures shared by the whole suite.

The local cluster is started once per session, only when a test asks for it, and reused if it is
already running (`tpuft cluster up --name "$(tpuft cluster test-name)"` beforehand keeps it between
runs; set TPUFT_KEEP_CLUSTER=1 to leave a cluster this session started running afterwards). It is
this checkout's own, `pytest-<directory>-<hash of the checkout's path>` (TPUFT_TEST_CLUSTER
overrides), so two checkouts' sessions on one machine never share one. A reused cluster still has
what earlier sessions left in it: tests name what they create uniquely and look only at that. A
cluster that is not running but left state behind (a run that was killed before its teardown) is
started afresh: its etcd would otherwise hand this session the objects and node pools of the last one.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tpuft_dev.cluster.local import LocalCluster, checkout_cluster_name

# No per-example deadline: on a shared 2-core machine an example that takes 200 ms one time takes
# 400 ms the next, and Hypothesis then fails the test as flaky (it did in CI). Speed is for benchmarks.
settings.register_profile("tpuft", deadline=None)
settings.load_profile("tpuft")

# The checkout this file is in, not whichever one the shared venv's editable install points at.
TEST_CLUSTER = checkout_cluster_name(Path(__file__).resolve().parent.parent)


def session_cluster(name: str, log: Callable[[str], None], *, fresh: bool = False) -> Iterator[LocalCluster]:
    """Starts the cluster ``name`` for a test session (reusing it only if it is running; never with
    ``fresh``) and, unless it was already running or TPUFT_KEEP_CLUSTER=1, removes it afterwards."""
    cluster = LocalCluster(name=name, log=log)
    was_running = cluster.layout.state.exists() and all(s.healthy for s in cluster.status())
    if fresh and cluster.layout.root.exists():
        log(f"cluster {name!r} is left from an earlier session: starting afresh")
        cluster.down()
        was_running = False
    elif not was_running and cluster.layout.root.exists():
        log(
            f"cluster {name!r} is not running but left state behind (an earlier run was killed?): starting afresh"
        )
        cluster.down()
    cluster.up()
    yield cluster
    if not was_running and os.environ.get("TPUFT_KEEP_CLUSTER") != "1":
        cluster.down()


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[LocalCluster]:
    yield from session_cluster(TEST_CLUSTER, log=lambda line: print(f"[cluster] {line}"))


@pytest.fixture
def namespace(local_cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards (without waiting: deletion is asynchronous)."""
    base = request.node.name.lower().replace("_", "-")
    name = f"{''.join(c for c in base if c.isalnum() or c == '-')[:40].strip('-')}-{secrets.token_hex(3)}"
    local_cluster.kubectl("create", "namespace", name)
    yield name
    local_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"
