"""The local cluster's pure parts: build inputs, webhook registration, kwok nodes and stages."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from tpuft_dev.cluster import build, kwok, versions
from tpuft_dev.cluster.components import (
    PORT_NAMES,
    Layout,
    jobset_configuration,
    kueue_configuration,
    specs,
)
from tpuft_dev.cluster.local import (
    ClusterError,
    ensure_kueue_metrics_cert,
    kueue_crds,
    kueue_webhook_configurations,
    webhook_configurations,
)
from tpuft_operator import topology


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
    # Kueue is built against the cluster's own Kubernetes: both versions key its cache entry.
    assert versions.KUEUE in str(bins.kueue) and versions.KUBERNETES in str(bins.kueue)
    assert set(bins.missing()) == set(bins.all())


def test_every_component_listens_on_loopback_only(tmp_path: Path) -> None:
    ports = {name: 20000 + i for i, name in enumerate(PORT_NAMES)}
    layout = Layout(tmp_path)
    every = specs(layout, build.binaries(tmp_path), ports, kueue=True)
    assert "kueue-controller" in [c.name for c in every]
    assert "kueue-controller" not in [c.name for c in specs(layout, build.binaries(tmp_path), ports)]
    for component in every:
        assert "127.0.0.1" in component.health_url
        for arg in component.argv:
            assert "0.0.0.0" not in arg, (component.name, arg)
    assert jobset_configuration(layout, ports)["webhook"] == {
        "host": "127.0.0.1",
        "port": ports["jobset-webhook"],
        "certDir": str(layout.pki.webhook_dir),
    }
    kueue = kueue_configuration(layout, ports)
    assert kueue["webhook"] == {
        "host": "127.0.0.1",
        "port": ports["kueue-webhook"],
        "certDir": str(layout.pki.webhook_dir),
    }
    assert kueue["health"] == {"healthProbeBindAddress": f"127.0.0.1:{ports['kueue-health']}"}
    assert kueue["metrics"] == {"bindAddress": "0"}
    assert kueue["featureGates"] == {"VisibilityOnDemand": False}  # its apiserver binds every interface


def _service(path: str) -> dict[str, object]:
    return {"service": {"name": "webhook-service", "namespace": "system", "path": path}}


def test_kueue_crds_get_their_conversion_webhook_on_loopback(tmp_path: Path) -> None:
    crd_dir = tmp_path / "config" / "components" / "crd"
    (crd_dir / "bases").mkdir(parents=True)
    (crd_dir / "patches").mkdir()
    for plural in ("workloads", "topologies"):
        (crd_dir / "bases" / f"{plural}.yaml").write_text(
            yaml.safe_dump(
                {
                    "kind": "CustomResourceDefinition",
                    "metadata": {"name": f"{plural}.kueue.x-k8s.io"},
                    "spec": {},
                }
            )
        )
    (crd_dir / "patches" / "webhook_in_workloads.yaml").write_text(
        yaml.safe_dump(
            {
                "metadata": {"name": "workloads.kueue.x-k8s.io"},
                "spec": {
                    "conversion": {
                        "strategy": "Webhook",
                        "webhook": {"clientConfig": _service("/convert"), "conversionReviewVersions": ["v1"]},
                    }
                },
            }
        )
    )
    (crd_dir / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": ["bases/workloads.yaml", "bases/topologies.yaml"],
                "patches": [{"path": "patches/webhook_in_workloads.yaml"}],
            }
        )
    )
    ca = tmp_path / "ca.crt"
    ca.write_text("CA")
    workloads, topologies = kueue_crds(tmp_path, 9444, ca)
    webhook = workloads["spec"]["conversion"]["webhook"]
    assert webhook["clientConfig"] == {
        "url": "https://127.0.0.1:9444/convert",
        "caBundle": base64.b64encode(b"CA").decode(),
    }
    assert webhook["conversionReviewVersions"] == ["v1"]
    assert "conversion" not in topologies["spec"]


def test_kueue_webhooks_are_kueues_and_jobsets_only_with_its_namespace_selector(tmp_path: Path) -> None:
    webhook_dir = tmp_path / "config" / "components" / "webhook"
    webhook_dir.mkdir(parents=True)

    def webhook(name: str, group: str, path: str) -> dict[str, object]:
        return {
            "name": name,
            "clientConfig": _service(path),
            "rules": [{"apiGroups": [group], "resources": ["x"]}],
        }

    (webhook_dir / "manifests.yaml").write_text(
        yaml.safe_dump_all(
            [
                {
                    "kind": "MutatingWebhookConfiguration",
                    "metadata": {"name": "mutating-webhook-configuration"},
                    "webhooks": [
                        webhook("mjobset.kb.io", "jobset.x-k8s.io", "/mutate-jobset"),
                        webhook("mpod.kb.io", "", "/mutate-pod"),
                        webhook("mworkload.kb.io", "kueue.x-k8s.io", "/mutate-workload"),
                    ],
                },
                {
                    "kind": "ValidatingWebhookConfiguration",
                    "metadata": {"name": "validating-webhook-configuration"},
                    "webhooks": [
                        webhook("vpod.kb.io", "", "/validate-pod"),
                        webhook("vjobset.kb.io", "jobset.x-k8s.io", "/validate-jobset"),
                    ],
                },
            ]
        )
    )
    selector = {
        "matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]}
        ]
    }
    patch = {
        "kind": "ValidatingWebhookConfiguration",
        "webhooks": [{"name": "vpod.kb.io", "namespaceSelector": selector}],
    }
    (webhook_dir / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "patches": [{"patch": yaml.safe_dump(patch)}],
                "replacements": [
                    {
                        "source": {"fieldPath": "webhooks.[name=vpod.kb.io].namespaceSelector"},
                        "targets": [
                            {
                                "fieldPaths": [
                                    "webhooks.[name=mjobset.kb.io].namespaceSelector",
                                    "webhooks.[name=mpod.kb.io].namespaceSelector",
                                ]
                            },
                            {"fieldPaths": ["webhooks.[name=vjobset.kb.io].namespaceSelector"]},
                        ],
                    }
                ],
            }
        )
    )
    ca = tmp_path / "ca.crt"
    ca.write_text("CA")
    mutating, validating = kueue_webhook_configurations(tmp_path, 9445, ca)
    assert mutating["metadata"]["name"] == "kueue-mutating-webhook-configuration"
    assert [w["name"] for w in mutating["webhooks"]] == ["mjobset.kb.io", "mworkload.kb.io"]
    assert [w["name"] for w in validating["webhooks"]] == ["vjobset.kb.io"]  # no pod webhook
    jobset_mutating = mutating["webhooks"][0]
    assert jobset_mutating["namespaceSelector"] == selector
    assert jobset_mutating["clientConfig"]["url"] == "https://127.0.0.1:9445/mutate-jobset"
    assert "namespaceSelector" not in mutating["webhooks"][1]


def test_kueue_metrics_certificate_is_put_once_and_a_failure_says_how(tmp_path: Path) -> None:
    source = tmp_path / "webhook"
    source.mkdir()
    (source / "tls.crt").write_text("CERT")
    (source / "tls.key").write_text("KEY")
    target = tmp_path / "etc" / "kueue"
    ensure_kueue_metrics_cert(source, target)
    assert (target / "tls.crt").read_text() == "CERT"
    (source / "tls.crt").write_text("OTHER")
    ensure_kueue_metrics_cert(source, target)
    assert (target / "tls.crt").read_text() == "CERT"  # another cluster's is kept
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ClusterError, match="create it once as root"):
        ensure_kueue_metrics_cert(source, blocker / "certs")


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
        "tpuft-prepare-pod-exit-code",
        "tpuft-prepare-pod-complete",
    ]
    # The TPU pods' simulations never touch a prepare pod (it carries the run's pod annotations too),
    # and the prepare pods' stages leave the ones the executor runs alone.
    for stage in kwok._OUR_STAGES[:3]:
        assert kwok.NOT_A_PREPARE_POD in stage["spec"]["selector"]["matchExpressions"]
    for stage in kwok._OUR_STAGES[3:]:
        expressions = stage["spec"]["selector"]["matchExpressions"]
        assert {"key": kwok._COMPONENT, "operator": "In", "values": ["prepare"]} in expressions
        assert {"key": kwok._RUN_ON_HOST, "operator": "DoesNotExist"} in expressions
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

    from tpuft_dev.cluster.cli import cluster

    for name in ("default", "demo"):
        (tmp_path / "clusters" / name / "logs").mkdir(parents=True)
    monkeypatch.setenv("TPUFT_CACHE", str(tmp_path))
    result = CliRunner().invoke(cluster, ["down", "--all"])
    assert result.exit_code == 0, result.output
    assert "cluster 'default' is down" in result.output and "cluster 'demo' is down" in result.output
    assert list((tmp_path / "clusters").iterdir()) == []


def test_the_operator_process_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    # A parent that starts a long child the way OperatorProcess starts the operator, then exits.
    parent = textwrap.dedent(
        """
        import subprocess, sys
        from tpuft_dev.cluster.operator_process import _die_with_parent
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=_die_with_parent)
        print(child.pid, flush=True)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", parent], capture_output=True, text=True, timeout=30, check=True, env=env
    )
    pid = int(out.stdout)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        if state == "Z":  # gone, waiting for init to reap it
            break
        time.sleep(0.05)
    else:
        assert not Path(f"/proc/{pid}").exists(), "the child outlived its parent"
