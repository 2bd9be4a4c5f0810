"""The API layer without a cluster: what a caller sees when no API server answers, and how often the
client looks at its credentials."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.config.incluster_config import InClusterConfigLoader

from tpuft_operator.k8s import Api, ApiError, ThrottledRefresh, load_client, throttle_credential_refresh


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


def bearer(configuration: client.Configuration) -> str:
    return (
        str(configuration.auth_settings()["BearerToken"]["value"])
        .removeprefix("bearer ")
        .removeprefix("Bearer ")
    )


def test_a_rotated_service_account_token_is_used_within_a_check_period(tmp_path: Path) -> None:
    """In a pod: the kubelet rewrites the projected token file; the client rereads it once its own
    refresh period has passed, and at most a check period later with the throttle in front."""
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("first")
    ca.write_text("not read until a TLS connection is made")
    loader = InClusterConfigLoader(
        str(token), str(ca), environ={"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    )
    loader._token_refresh_period = type(loader._token_refresh_period)(0)  # reread whenever asked
    configuration = client.Configuration()
    loader.load_and_set(configuration)
    throttle_credential_refresh(configuration, period=0.2)
    assert bearer(configuration) == "first"
    token.write_text("second")
    assert bearer(configuration) == "first"  # within the period: not looked at again
    time.sleep(0.25)
    assert bearer(configuration) == "second"
    token.write_text("third")
    time.sleep(0.25)
    assert bearer(configuration) == "third"  # the throttle stays in front of the client's hook


def test_the_client_looks_at_its_credentials_at_most_once_a_period() -> None:
    calls = 0

    def refresh(configuration: client.Configuration) -> None:
        # As the client's loaders do: set the token, and put a fresh copy of the hook in place.
        nonlocal calls
        calls += 1
        configuration.api_key["BearerToken"] = f"token-{calls}"
        configuration.refresh_api_key_hook = refresh

    configuration = client.Configuration()
    configuration.api_key["BearerToken"] = "token-0"
    configuration.refresh_api_key_hook = refresh
    throttle_credential_refresh(configuration, period=3600)
    assert [bearer(configuration) for _ in range(1000)] == ["token-1"] * 1000
    assert calls == 1 and isinstance(configuration.refresh_api_key_hook, ThrottledRefresh)


def test_a_kubeconfig_token_client_is_throttled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client.Configuration, "_default", None)  # load_kube_config sets the default
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:6443'}}]\n"
        "users: [{name: u, user: {token: sa-token}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    configuration = load_client(str(kubeconfig)).configuration
    assert [bearer(configuration) for _ in range(3)] == ["sa-token"] * 3
    assert isinstance(configuration.refresh_api_key_hook, ThrottledRefresh)
