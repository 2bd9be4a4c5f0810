"""The operator under test: a real `tpuft operator` process that authenticates as the Helm chart's
ServiceAccount, with exactly the chart's RBAC, against the local cluster."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tpuft_operator.cluster.local import LocalCluster
from tpuft_operator.cluster.operator_process import (
    OPERATOR_NAMESPACE,
    SERVICE_ACCOUNT,
    OperatorProcess,
    install_operator,
)
from tpuft_operator.settings import OperatorSettings

__all__ = ["OPERATOR_NAMESPACE", "OPERATOR_SETTINGS", "SERVICE_ACCOUNT", "OperatorProcess"]

# The settings the operator under test runs with (what its renders depend on).
OPERATOR_SETTINGS = OperatorSettings(
    trainer_image="example.invalid/tpuft-trainer:test", progress_interval_seconds=1.0
)


@pytest.fixture(scope="session")
def operator(
    local_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    kubeconfig = install_operator(local_cluster)
    process = OperatorProcess(
        kubeconfig,
        tmp_path_factory.mktemp("operator") / "operator.log",
        TPUFT_RESYNC_SECONDS="5",
        TPUFT_TRAINER_IMAGE=OPERATOR_SETTINGS.trainer_image,
        TPUFT_PROGRESS_INTERVAL_SECONDS=str(OPERATOR_SETTINGS.progress_interval_seconds),
    )
    process.start()
    yield process
    process.stop()
