"""The local cluster's pure parts: build inputs, webhook registration, kwok nodes and stages."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from tpuft_operator import topology
from tpuft_operator.cluster import build, kwok, versions
from tpuft_operator.cluster.components import PORT_NAMES, Layout, jobset_configuration, specs
from tpuft_operator.cluster.local import webhook_configurations


def test_missing_go_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(build.BuildError, match=r"Go toolchain is not installed.*Go 1\.26"):
        build.check_go()


def test_staging_modules_are_read_from_the_kubernetes_go_mod() -> None:
    go_mod = """module k8s.io/kubernetes
replace (
	k8s.io/api => ./staging/src/k8s.io/api
	k8s.io/client-go => ./staging/src/k8s.io/client-go
	github.com/other/thing => github.com/fork/thing v1.0.0
)
"""
    assert build._staging_modules(go_mod) == ["k8s.io/api", "k8s.io/client-go"]
    assert versions.staging_version() == "v0." + versions.KUBERNETES.split(".", 1)[1]


def test_binaries_are_cached_by_version(tmp_path: Path) -> None:
    bins = build.binaries(tmp_path)
    assert versions.KUBERNETES in str(bins.kube_apiserver)
    assert versions.JOBSET in str(bins.jobset)
    assert set(bins.missing()) == set(bins.all())


def test_every_component_listens_on_loopback_only(tmp_path: Path) -> None:
    ports = {name: 20000 + i for i, name in enumerate(PORT_NAMES)}
    layout = Layout(tmp_path)
    for component in specs(layout, build.binaries(tmp_path), ports):
        assert "127.0.0.1" in component.health_url
        for arg in component.argv:
            assert "0.0.0.0" not in arg, (component.name, arg)
    assert jobset_configuration(layout, ports)["webhook"] == {
        "host": "127.0.0.1",
        "port": ports["jobset-webhook"],
        "certDir": str(layout.pki.webhook_dir),
    }


def test_jobset_webhooks_are_registered_by_url_with_the_module_patches(tmp_path: Path) -> None:
    module = tmp_path / "jobset"
    webhook_dir = module / "config" / "components" / "webhook"
    (webhook_dir / "patches").mkdir(parents=True)
    (webhook_dir / "manifests.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "MutatingWebhookConfiguration",
                "metadata": {"name": "mutating-webhook-configuration"},
                "webhooks": [
                    {
                        "name": "a",
                        "clientConfig": {"service": {"name": "s", "namespace": "n", "path": "/mutate-a"}},
                    },
                    {
                        "name": "b",
                        "clientConfig": {"service": {"name": "s", "namespace": "n", "path": "/mutate-b"}},
                    },
                ],
            }
        )
    )
    (webhook_dir / "patches" / "p.yaml").write_text(
        yaml.safe_dump(
            [
                {
                    "op": "replace",
                    "path": "/webhooks/1",
                    "value": {
                        "name": "b",
                        "objectSelector": {"matchExpressions": [{"key": "x", "operator": "Exists"}]},
                        "clientConfig": {"service": {"name": "s", "namespace": "n", "path": "/mutate-b"}},
                    },
                }
            ]
        )
    )
    (webhook_dir / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "patches": [
                    {
                        "path": "patches/p.yaml",
                        "target": {
                            "kind": "MutatingWebhookConfiguration",
                            "name": "mutating-webhook-configuration",
                        },
                    }
                ]
            }
        )
    )
    ca = tmp_path / "ca.crt"
    ca.write_text("CA")
    (config,) = webhook_configurations(module, 9443, ca)
    assert config["metadata"]["name"] == "jobset-mutating-webhook-configuration"
    first, second = config["webhooks"]
    assert first["clientConfig"] == {
        "url": "https://127.0.0.1:9443/mutate-a",
        "caBundle": base64.b64encode(b"CA").decode(),
    }
    assert second["objectSelector"]["matchExpressions"][0]["key"] == "x"  # the kustomize patch applied
    assert second["clientConfig"]["url"] == "https://127.0.0.1:9443/mutate-b"


def test_our_kwok_stages_select_what_they_claim() -> None:
    names = [stage["metadata"]["name"] for stage in kwok._OUR_STAGES]
    assert names == [
        "tpuft-pod-exit-code",
        "tpuft-pod-exit-code-first-attempt",
        "tpuft-pod-complete-after-first-attempt",
    ]
    first, later = (
        kwok._OUR_STAGES[1]["spec"]["selector"]["matchExpressions"],
        kwok._OUR_STAGES[2]["spec"]["selector"]["matchExpressions"],
    )
    assert {"key": kwok._RESTART_ATTEMPT, "operator": "In", "values": ["0"]} in first
    assert {"key": kwok._RESTART_ATTEMPT, "operator": "NotIn", "values": ["0"]} in later
    # A simulated exit takes kwok's own completion out of the race, deterministically (weight 0).
    assert kwok.simulated_exit(64)["pod-complete.stage.kwok.x-k8s.io/weight"] == "0"
    held = kwok.hold_running("60s")
    assert set(held.values()) == {"60s"} and len(held) == 2  # delay and its jitter bound


_SHAPES = sorted(
    (name, topo)
    for name, fam in topology.FAMILIES.items()
    for topo in topology.valid_shapes(fam)
    if topology.resolve(name, topo).hosts_per_slice <= 64  # node objects for up to 192 hosts
)


@given(st.sampled_from(_SHAPES), st.integers(min_value=1, max_value=3))
def test_node_pools_have_the_chips_of_their_shape(shape_key: tuple[str, str], slices: int) -> None:
    tpu_type, topo = shape_key
    shape = topology.resolve(tpu_type, topo)
    if slices > 1 and not shape.multi_host:
        return
    shape = topology.SliceShape(shape.family, shape.topology, shape.chips_per_host, slices)
    nodes = kwok.nodepool_nodes(shape, prefix="p")
    assert len(nodes) == shape.hosts
    assert sum(int(n["status"]["capacity"][topology.TPU_RESOURCE]) for n in nodes) == shape.chips
    pools = {n["metadata"]["labels"][topology.NODEPOOL_LABEL] for n in nodes}
    assert pools == {f"p-{i}" for i in range(slices)}
    for node in nodes:
        assert node["metadata"]["labels"][topology.ACCELERATOR_LABEL] == shape.family.accelerator
        assert node["metadata"]["labels"][topology.TOPOLOGY_LABEL] == shape.topology
        assert kwok.TPU_TAINT in node["spec"]["taints"]


def test_down_all_removes_every_cluster_under_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from tpuft_operator.cluster.cli import cluster

    for name in ("default", "demo"):
        (tmp_path / "clusters" / name / "logs").mkdir(parents=True)
    monkeypatch.setenv("TPUFT_CACHE", str(tmp_path))
    result = CliRunner().invoke(cluster, ["down", "--all"])
    assert result.exit_code == 0, result.output
    assert "cluster 'default' is down" in result.output and "cluster 'demo' is down" in result.output
    assert list((tmp_path / "clusters").iterdir()) == []
