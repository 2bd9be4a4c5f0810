"""The TPU catalog: shape arithmetic for every shape GKE offers, and the failures users hit."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tpuft_operator import topology
from tpuft_operator.topology import FAMILIES, TopologyError, resolve


def _valid_cases() -> list[tuple[str, str, int]]:
    out = []
    for fam in FAMILIES.values():
        for topo in topology.valid_shapes(fam):
            chips = math.prod(topology.parse_topology(topo))
            for per_host in topology.host_sizes_for(fam, chips):
                out.append((fam.name, topo, per_host))
    return out


VALID = _valid_cases()


@given(st.sampled_from(VALID), st.integers(min_value=1, max_value=8))
def test_hosts_times_chips_per_host_is_chips(case: tuple[str, str, int], slices: int) -> None:
    tpu_type, topo, per_host = case
    fam = FAMILIES[tpu_type]
    chips = math.prod(topology.parse_topology(topo))
    if slices > 1 and chips <= per_host:
        with pytest.raises(TopologyError, match="multislice"):
            resolve(tpu_type, topo, slices=slices, chips_per_host=per_host)
        return
    shape = resolve(tpu_type, topo, slices=slices, chips_per_host=per_host)
    assert shape.hosts_per_slice * shape.chips_per_host == shape.chips_per_slice == chips
    assert shape.hosts == shape.hosts_per_slice * slices
    assert shape.chips == chips * slices
    assert shape.machine_type == fam.machine_types[per_host]
    assert shape.chips_per_slice <= fam.max_chips_per_slice


@given(st.sampled_from(VALID))
def test_default_host_size_is_documented(case: tuple[str, str, int]) -> None:
    tpu_type, topo, _ = case
    shape = resolve(tpu_type, topo)
    chips = shape.chips_per_slice
    assert shape.chips_per_host == min(chips, FAMILIES[tpu_type].default_chips_per_host)


@pytest.mark.parametrize(
    ("tpu_type", "topo", "chips", "hosts", "machine"),
    [
        ("v5e", "1x1", 1, 1, "ct5lp-hightpu-1t"),
        ("v5e", "2x2", 4, 1, "ct5lp-hightpu-4t"),
        ("v5e", "2x4", 8, 2, "ct5lp-hightpu-4t"),  # the documented default: two 4-chip VMs
        ("v5e", "16x16", 256, 64, "ct5lp-hightpu-4t"),
        ("v6e", "4x4", 16, 4, "ct6e-standard-4t"),
        ("v4", "2x2x1", 4, 1, "ct4p-hightpu-4t"),
        ("v4", "2x2x2", 8, 2, "ct4p-hightpu-4t"),
        ("v5p", "2x2x4", 16, 4, "ct5p-hightpu-4t"),
        ("v5p", "16x20x28", 8960, 2240, "ct5p-hightpu-4t"),
        ("tpu7x", "1x1x1", 1, 1, "tpu7x-standard-1t"),
        ("tpu7x", "16x24x24", 9216, 2304, "tpu7x-standard-4t"),
    ],
)
def test_known_shapes(tpu_type: str, topo: str, chips: int, hosts: int, machine: str) -> None:
    shape = resolve(tpu_type, topo)
    assert (shape.chips_per_slice, shape.hosts_per_slice, shape.machine_type) == (chips, hosts, machine)


# Host RAM per machine type, GiB (the sources are in topology.py and docs/topology.md).
HOST_RAM_GIB = {
    "ct4p-hightpu-4t": 407,
    "ct5lp-hightpu-1t": 48,
    "ct5lp-hightpu-4t": 192,
    "ct5lp-hightpu-8t": 384,
    "ct5p-hightpu-4t": 448,
    "ct6e-standard-1t": 176,
    "ct6e-standard-4t": 720,
    "ct6e-standard-8t": 1440,
    "tpu7x-standard-1t": 240,
    "tpu7x-standard-4t": 960,  # Google's tpu7x page; GKE's cluster autoscaler says 992
}


def test_every_machine_type_has_its_host_ram() -> None:
    catalog = {
        machine: fam.host_ram_gib[chips]
        for fam in FAMILIES.values()
        for chips, machine in fam.machine_types.items()
    }
    assert catalog == HOST_RAM_GIB
    assert resolve("v6e", "2x4", chips_per_host=8).host_ram_gib == 1440
    assert resolve("v5e", "4x4").host_ram_gib == 192


def test_a_family_without_the_ram_of_a_machine_type_is_refused() -> None:
    with pytest.raises(ValueError, match="host_ram_gib"):
        dataclasses.replace(FAMILIES["v5e"], host_ram_gib={4: 192})


def test_2x4_on_one_8_chip_vm() -> None:
    shape = resolve("v6e", "2x4", chips_per_host=8)
    assert (shape.hosts_per_slice, shape.machine_type, shape.multi_host) == (1, "ct6e-standard-8t", False)


@pytest.mark.parametrize(
    ("tpu_type", "topo", "kwargs", "field", "match"),
    [
        ("v3", "2x2", {}, "spec.tpu.type", "unknown TPU type"),
        ("v5e", "2x2x2", {}, "spec.tpu.topology", "2-D"),
        ("v5p", "4x4", {}, "spec.tpu.topology", "3-D"),
        ("v5p", "4x4x6", {}, "spec.tpu.topology", "not a v5p topology"),
        ("v5p", "8x4x4", {}, "spec.tpu.topology", "ascending"),
        ("v4", "8x8x32", {}, "spec.tpu.topology", "16 chips a side"),
        ("v5p", "4x4x548", {}, "spec.tpu.topology", "548 chips, longer than any v5p slice: at most 256"),
        ("v5p", "548x4x4", {}, "spec.tpu.topology", "side of 548 chips"),
        ("tpu7x", "4x4x260", {}, "spec.tpu.topology", "side of 260 chips, longer than any tpu7x slice"),
        ("v5e", "2x64", {}, "spec.tpu.topology", "side of 64 chips, longer than any v5e slice: at most 16"),
        ("v5e", "4x4", {"chips_per_host": 8}, "spec.tpu.chipsPerHost", "cannot hold"),
        ("v5e", "4x4", {"chips_per_host": 2}, "spec.tpu.chipsPerHost", "v5e hosts have"),
        ("v5e", "2x2", {"slices": 2}, "spec.tpu.slices", "multislice needs multi-host"),
        ("v5e", "4x4", {"slices": 0}, "spec.tpu.slices", "at least 1"),
    ],
)
def test_invalid_shapes_name_the_field(
    tpu_type: str, topo: str, kwargs: dict[str, int], field: str, match: str
) -> None:
    with pytest.raises(TopologyError, match=match) as error:
        resolve(tpu_type, topo, **kwargs)
    assert error.value.field == field


@pytest.mark.parametrize(("tpu_type", "topo"), [("v5p", "4x4x244"), ("v5p", "4x4x256"), ("tpu7x", "4x4x244")])
def test_long_thin_slices_xpk_lists_are_still_accepted(tpu_type: str, topo: str) -> None:
    # The pod's cubes are joined by optical switches: a side may exceed the pod's own (xpk lists 4x4x244).
    assert resolve(tpu_type, topo).chips_per_slice == math.prod(topology.parse_topology(topo))


def test_no_listed_shape_has_a_side_longer_than_its_family_allows() -> None:
    for fam in FAMILIES.values():
        assert max(max(topology.parse_topology(t)) for t in topology.valid_shapes(fam)) <= fam.max_side


def test_node_labels_match_the_renderer_selector() -> None:
    shape = resolve("tpu7x", "2x2x4")
    labels = topology.node_labels(shape, "pool-a", placement_policy="ironwood-policy")
    assert labels[topology.ACCELERATOR_LABEL] == "tpu7x"
    assert labels[topology.TOPOLOGY_LABEL] == "2x2x4"
    assert labels[topology.PLACEMENT_POLICY_LABEL] == "ironwood-policy"
    assert labels["node.kubernetes.io/instance-type"] == "tpu7x-standard-4t"
