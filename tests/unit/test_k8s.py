"""The API layer's error type, without a cluster: what a caller sees when no API server answers."""

from __future__ import annotations

import socket

import pytest
from kubernetes import client

from tpuft_operator.k8s import Api, ApiError


def test_an_api_server_that_does_not_answer_is_a_retryable_api_error() -> None:
    # Found by the fault suite: with kube-apiserver down, the connection error escaped every caller
    # (they catch ApiError) and each run's reconcile was logged with a Python traceback.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again below: nothing listens there
    configuration = client.Configuration(host=f"https://127.0.0.1:{port}")
    configuration.retries = 0
    api = Api(client.ApiClient(configuration))
    with pytest.raises(ApiError) as caught:
        api.patch_finetune_status("ns", "run", {"phase": "Running"})
    assert caught.value.retryable and caught.value.status == 0
    assert str(caught.value).startswith(
        "updating the status of TPUFineTune ns/run: cannot reach the API server"
    )
