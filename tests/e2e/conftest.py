"""The operator under test: a real `tpuft operator` process that authenticates as the Helm chart's
ServiceAccount, with exactly the chart's RBAC, against the local cluster."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tpuft_dev.cluster.local import LocalCluster
from tpuft_dev.cluster.operator_process import (
    HOST_PATH_VALUES,
    OPERATOR_NAMESPACE,
    SERVICE_ACCOUNT,
    OperatorProcess,
    install_operator,
    operator_env,
)
from tpuft_dev.demo import build_assets
from tpuft_operator.settings import OperatorSettings

__all__ = ["E2E_VALUES", "OPERATOR_NAMESPACE", "OPERATOR_SETTINGS", "SERVICE_ACCOUNT", "OperatorProcess"]

# The settings the operator under test runs with (what its renders depend on).
OPERATOR_SETTINGS = OperatorSettings(
    trainer_image="example.invalid/tpuft-trainer:test", progress_interval_seconds=1.0
)
# The chart's values for the operator under test: its defaults (the admin policy included), and
# what the tests opt in to as an admin would: hostPath volumes (the local executor runs the real
# trainer from files on this host: test_progress, test_stops) and the ServiceAccount "ci"
# (test_tenancy's CI account named as a run's serviceAccountName).
E2E_VALUES = (
    *HOST_PATH_VALUES,
    "--set-json",
    'policy.allowedServiceAccounts=["ci"]',
    "--set",
    f"trainerImage={OPERATOR_SETTINGS.trainer_image}",
)
# Settings of the operator process beyond the chart's (faster resyncs and reports than production).
E2E_OVERRIDES = {
    "TPUFT_RESYNC_SECONDS": "5",
    "TPUFT_PROGRESS_INTERVAL_SECONDS": str(OPERATOR_SETTINGS.progress_interval_seconds),
}


@pytest.fixture(scope="session")
def operator(
    local_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    kubeconfig = install_operator(local_cluster, values=E2E_VALUES)
    process = OperatorProcess(
        kubeconfig,
        tmp_path_factory.mktemp("operator") / "operator.log",
        **{**operator_env(local_cluster, E2E_VALUES), **E2E_OVERRIDES},
    )
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's tiny model and data (`build_assets`), built once a session for the tests that
    train for real on this host: each build is a subprocess importing torch and transformers (10-20 s
    on the loaded 2-core machine). The build is seeded, so a copy is what a fresh build would make."""
    root = tmp_path_factory.mktemp("tiny-assets")
    build_assets(root)
    return root


def copy_assets(tiny_assets: Path, root: Path) -> Path:
    """A test's own copy of the tiny assets at ``root`` (its runs write their outputs there)."""
    shutil.copytree(tiny_assets, root)
    return root
