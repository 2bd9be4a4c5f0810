"""Issue 42, items 4 and 5, as rendered: host networking (spec.network.hostNetwork) and the
reservation selector (spec.tpu.reservation), over the whole TPU catalog.

Host networking changes exactly three things of a run's JobSet, as xpk renders TPU pods: the pod's
hostNetwork, its DNS policy (ClusterFirstWithHostNet, so the coordinator's name under the JobSet's
headless Service still resolves) and the stop channel's port, declared as a host port; everything
else, JobSet's DNS hostnames included, is the pod-network run's. A reservation is one node selector,
only when asked for, never an affinity (docs/install-gke.md, "Reservations": xpk selects the
reservation only for node auto-provisioning; a node pool created with --reservation-affinity=specific
is selected by its shape)."""

from __future__ import annotations

import copy
import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit import crdcheck
from tests.unit.test_render import BASE
from tests.unit.test_render import _shapes as catalog_shapes
from tpuft_operator import topology
from tpuft_operator.render import naming, render_run
from tpuft_operator.render.jobset import STOP_PORT_NAME

# The render tests' base run and catalog of shapes, without the per-shape chip count.
SHAPES = [(tpu_type, topo, per_host) for tpu_type, topo, per_host, _ in catalog_shapes()]


def run_of(shape: tuple[str, str, int], slices: int, **spec: Any) -> dict[str, Any]:
    tpu_type, topo, per_host = shape
    # Ironwood runs backend native (xla is refused there), which runs one slice.
    native = tpu_type == "tpu7x"
    if math.prod(topology.parse_topology(topo)) <= per_host or native:
        slices = 1  # multislice needs multi-host slices, and backend xla
    obj = copy.deepcopy(BASE)
    obj["spec"]["tpu"] = {"type": tpu_type, "topology": topo, "chipsPerHost": per_host, "slices": slices}
    if native:
        obj["spec"]["backend"] = "native"
    obj["spec"].update(spec)
    return obj


def pod_template(jobset: dict[str, Any]) -> dict[str, Any]:
    template: dict[str, Any] = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    return template


@settings(max_examples=150)
@given(st.sampled_from(SHAPES), st.integers(min_value=1, max_value=8))
def test_host_network_changes_only_the_pods_network_dns_policy_and_declared_port(
    shape: tuple[str, str, int], slices: int
) -> None:
    pod_network = render_run(run_of(shape, slices))
    host = render_run(run_of(shape, slices, network={"hostNetwork": True}))
    pod = pod_template(host.jobset)["spec"]
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    port = host.trainer_config.stop.coordination_port  # where the first host listens (stop.py)
    (container,) = pod["containers"]
    assert container["ports"] == [
        {"name": STOP_PORT_NAME, "containerPort": port, "hostPort": port, "protocol": "TCP"}
    ]
    # Nothing else differs: the same coordinator name, under the same headless Service, which then
    # resolves to the first pod's node IP; the same selectors, security context and config.
    expected = copy.deepcopy(pod_network.jobset)
    expected_pod = pod_template(expected)["spec"]
    expected_pod.update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")
    expected_pod["containers"][0]["ports"] = container["ports"]
    assert host.jobset == expected
    assert host.trainer_config == pod_network.trainer_config
    network = host.jobset["spec"]["network"]
    assert network == {
        "enableDNSHostnames": True,
        "publishNotReadyAddresses": True,
        "subdomain": host.jobset_name,
    }
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TPUFT_COORDINATOR_ADDRESS"] == naming.coordinator_address(host.jobset_name)


@settings(max_examples=60)
@given(st.sampled_from(SHAPES), st.integers(min_value=1, max_value=8), st.sampled_from([None, False]))
def test_a_pod_network_run_renders_no_network_fields(
    shape: tuple[str, str, int], slices: int, host_network: bool | None
) -> None:
    """hostNetwork false (or no spec.network) renders what tpuft rendered before the field existed:
    the golden renders and the objects already stored stay byte for byte the same."""
    extra = {} if host_network is None else {"network": {"hostNetwork": host_network}}
    pod = pod_template(render_run(run_of(shape, slices, **extra)).jobset)["spec"]
    assert not {"hostNetwork", "dnsPolicy", "hostPID", "hostIPC"} & set(pod)
    assert "ports" not in pod["containers"][0]
    assert render_run(run_of(shape, slices, **extra)).jobset == render_run(run_of(shape, slices)).jobset


@settings(max_examples=150)
@given(
    st.sampled_from(SHAPES),
    st.integers(min_value=1, max_value=8),
    st.sampled_from([None, "res-a", "tpu-v6e-reservation"]),
    st.booleans(),
)
def test_a_reservation_is_one_node_selector_and_only_when_asked_for(
    shape: tuple[str, str, int], slices: int, reservation: str | None, spot: bool
) -> None:
    obj = run_of(shape, slices)
    if reservation is not None:
        obj["spec"]["tpu"]["reservation"] = reservation
    if spot:
        obj["spec"]["tpu"]["spot"] = True
    pod = pod_template(render_run(obj).jobset)["spec"]
    selector = pod["nodeSelector"]
    assert selector.get(topology.RESERVATION_LABEL) == reservation
    if reservation is None:
        assert topology.RESERVATION_LABEL not in selector
    # Never an affinity, and no reservation-affinity or -project label: only the name, as xpk selects
    # a reservation for GKE's node auto-provisioning.
    assert "affinity" not in pod
    assert not [
        k
        for k in selector
        if k.startswith("cloud.google.com/reservation") and k != topology.RESERVATION_LABEL
    ]


def test_host_network_jobsets_pass_the_jobset_crd_schema() -> None:
    """Single-host, multi-host and multislice host-network JobSets are valid for the JobSet v0.12.0 CRD
    (schema + CEL, offline); the JobSet webhook and the pods are the local-cluster tests'
    (tests/e2e/test_policy.py)."""
    cases = [
        {
            "name": f"{tpu_type}-{topo}-x{slices}",
            "object": render_run(run_of((tpu_type, topo, 4), slices, network={"hostNetwork": True})).jobset,
        }
        for tpu_type, topo, slices in (("v5e", "2x2", 1), ("v6e", "4x4", 2), ("tpu7x", "2x2x4", 1))
    ]
    assert crdcheck.admit(crdcheck.jobset_crd(), cases) == {c["name"]: [] for c in cases}
