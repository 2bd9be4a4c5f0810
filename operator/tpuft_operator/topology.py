"""The catalog of GKE TPU types: data plus a few small pure functions.

Every number here comes from Google's documentation (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e,
/tpu7x, the GKE "Plan TPUs" and "About Ironwood (TPU7x) in GKE" pages) and is cross-checked with xpk's
`src/xpk/core/system_characteristics.py` (AI-Hypercomputer/xpk): accelerator label values, machine
types, the topology lists per family and the largest slice of each. Host RAM per machine type is
from Google's pages where one lists it (v5e, v5p, and the tpu7x page's comparison table for v6e and
tpu7x 4-chip VMs); the machine types no page lists (v4, v6e 1t and 8t, tpu7x 1t) take the Compute
Engine API's figure (`gcloud compute machine-types list`), with GKE's cluster autoscaler as a second
source (it disagrees for tpu7x: see the comment there). The pages say "GB" but mean what gcloud and
the autoscaler report, GiB. docs/topology.md shows the catalog as a table, generated from this module.
It is the single source of truth for TPU shapes: the CRD's CEL rules, the renderer, `tpuft plan` and
`tpuft cluster add-nodepool` all read it.

Terms, in the user's words:
- *topology*: the physical arrangement of chips in one slice, e.g. ``4x4`` or ``2x2x4``;
- *chips*: product of the topology (one slice);
- *chips per host*: chips attached to one TPU VM (the ``google.com/tpu`` request of each pod);
- *hosts per slice*: chips / chips per host (the pods of one slice).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

TpuType = Literal["v4", "v5e", "v5p", "v6e", "tpu7x"]

ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
# Kubernetes' well-known label of a node's machine type (GKE: e.g. ct5lp-hightpu-4t).
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
PLACEMENT_POLICY_LABEL = "cloud.google.com/placement-policy-name"
SPOT_LABEL = "cloud.google.com/gke-spot"
RESERVATION_LABEL = "cloud.google.com/reservation-name"
TPU_RESOURCE = "google.com/tpu"

_TOPOLOGY_RE = re.compile(r"^[1-9][0-9]*(x[1-9][0-9]*){1,2}$")


class TopologyError(ValueError):
    """A TPU shape that GKE does not offer. ``field`` is the spec path the user has to fix."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class TpuFamily:
    """One TPU generation as GKE exposes it."""

    name: TpuType
    accelerator: str  # value of cloud.google.com/gke-tpu-accelerator
    dimensions: int  # 2 (AxB) or 3 (AxBxC)
    machine_types: dict[int, str]  # chips per host -> GKE machine type
    # chips per host -> RAM of that machine type in GiB (the VM's memory, not HBM): what a host has to
    # stage its chips' share of a checkpoint, load the model and run the trainer in (`tpuft plan`).
    # Google's pages label it "GB"; gcloud and GKE's autoscaler treat the same numbers as GiB.
    host_ram_gib: dict[int, int]
    default_chips_per_host: int
    hbm_gib_per_chip: int
    tensorcores_per_chip: int
    # Peak dense bf16 compute of one chip, TFLOP/s (Google's "peak compute per chip"): the MFU denominator.
    peak_bf16_tflops_per_chip: float
    max_chips_per_slice: int
    # Longest side of a slice, in chips: no slice of this type is longer in any dimension (the sources
    # are at each family; docs/topology.md lists them). `resolve` and the CRD's CEL rule refuse a longer side.
    max_side: int
    # 2-D families list their shapes; 3-D families follow the rule in `_valid_3d`.
    topologies_2d: tuple[str, ...] = ()
    # 3-D shapes that are valid although not every dimension is a multiple of 4 (the small slices).
    small_topologies_3d: tuple[str, ...] = ()
    # Ironwood multi-host node pools carry a placement policy instead of the topology flag.
    multihost_uses_placement_policy: bool = False
    # The host size of multi-host slices. Every other host size exists only as a single-host slice
    # of exactly that many chips (v5e/v6e 1t and 8t machines, Ironwood 1t): GKE has no multi-host
    # pool of 1-chip or 8-chip VMs.
    multihost_chips_per_host: int = 4

    def __post_init__(self) -> None:
        if set(self.host_ram_gib) != set(self.machine_types):
            raise ValueError(f"{self.name}: host_ram_gib must name the RAM of every machine type")

    @property
    def chips_per_host_choices(self) -> tuple[int, ...]:
        return tuple(sorted(self.machine_types))

    def describe_topologies(self) -> str:
        if self.dimensions == 2:
            return ", ".join(self.topologies_2d)
        return (
            f"AxBxC: {', '.join(self.small_topologies_3d)}, or every dimension a multiple of 4 in "
            f"ascending order (4x4x4, 4x4x8, 4x8x8, ...), at most {self.max_chips_per_slice} chips "
            f"and {self.max_side} chips a side"
        )

    def describe_chips_per_host(self) -> str:
        parts = []
        for chips, machine in sorted(self.machine_types.items()):
            scope = "any slice" if chips == self.multihost_chips_per_host else f"{chips}-chip slices only"
            parts.append(f"{chips} ({machine}, {scope})")
        return ", ".join(parts)


# v5e and v6e (GKE "Plan TPUs"; cloud.google.com/tpu/docs/v5e and /v6e): 1x1 (1t), 2x2 (4t) and
# 2x4 (8t, or two 4t hosts) fit one host; 2x4 and larger are multi-host pools of 4-chip VMs.
_2D_TOPOLOGIES = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
# v4, v5p, Ironwood: the slices below one 4x4x4 cube. Larger slices have every dimension a multiple
# of 4 (cloud.google.com/tpu/docs/v4: "A<=B<=C ... all multiples of 4"; xpk lists the same shapes).
_SMALL_3D = ("2x2x1", "2x2x2", "2x2x4", "2x4x4")

FAMILIES: dict[str, TpuFamily] = {
    "v4": TpuFamily(
        name="v4",
        accelerator="tpu-v4-podslice",
        dimensions=3,
        machine_types={4: "ct4p-hightpu-4t"},
        # No Google doc page lists it: the Compute Engine API (`gcloud compute machine-types list`, as
        # recorded in Cyclenerd/google-cloud-pricing-cost-calculator tools/machinetypes.csv) and GKE's
        # cluster autoscaler (GoogleCloudPlatform/cluster-autoscaler, pkg/cloudprovider/gke/
        # machinetypes/deprecated_machine_types_config.go: NewMachineTypeInfo("ct4p-hightpu-4t", 240, 407)).
        host_ram_gib={4: 407},
        default_chips_per_host=4,
        hbm_gib_per_chip=32,
        tensorcores_per_chip=2,
        peak_bf16_tflops_per_chip=275.0,  # cloud.google.com/tpu/docs/v4
        # A v4 pod is 4096 chips (cloud.google.com/tpu/docs/v4); 16x16x16 is the largest slice, and the
        # catalog keeps every side within that cube.
        max_chips_per_slice=4096,
        max_side=16,
        small_topologies_3d=_SMALL_3D,
    ),
    "v5e": TpuFamily(
        name="v5e",
        accelerator="tpu-v5-lite-podslice",
        dimensions=2,
        machine_types={1: "ct5lp-hightpu-1t", 4: "ct5lp-hightpu-4t", 8: "ct5lp-hightpu-8t"},
        host_ram_gib={1: 48, 4: 192, 8: 384},  # cloud.google.com/tpu/docs/v5e, "RAM per VM (GB)"
        default_chips_per_host=4,
        hbm_gib_per_chip=16,
        tensorcores_per_chip=1,
        peak_bf16_tflops_per_chip=197.0,  # cloud.google.com/tpu/docs/v5e
        max_chips_per_slice=256,
        max_side=16,  # the largest slice is the 16x16 pod (cloud.google.com/tpu/docs/v5e)
        topologies_2d=_2D_TOPOLOGIES,
    ),
    "v5p": TpuFamily(
        name="v5p",
        accelerator="tpu-v5p-slice",
        dimensions=3,
        machine_types={4: "ct5p-hightpu-4t"},
        # cloud.google.com/tpu/docs/v5p-training; GKE "Plan TPUs" (Autopilot table, "Memory (GiB)");
        # docs.cloud.google.com/tpu/docs/tpu7x, comparison table "RAM (GB) (4-chip VM)".
        host_ram_gib={4: 448},
        default_chips_per_host=4,
        hbm_gib_per_chip=95,
        tensorcores_per_chip=2,
        peak_bf16_tflops_per_chip=459.0,  # cloud.google.com/tpu/docs/v5p
        # A v5p pod is 8960 chips; xpk's largest v5p shape is 16x20x28 (= 8960).
        max_chips_per_slice=8960,
        # The pod's 4x4x4 cubes are joined by optical switches, so a side may be longer than the pod's
        # 28 chips (xpk lists 4x4x244), but not unbounded: xpk's `generate_tpu_topologies` takes every
        # side from 4 to 256 (AI-Hypercomputer/xpk src/xpk/core/system_characteristics.py, PR #834).
        max_side=256,
        small_topologies_3d=_SMALL_3D,
    ),
    "v6e": TpuFamily(
        name="v6e",
        accelerator="tpu-v6e-slice",
        dimensions=2,
        machine_types={1: "ct6e-standard-1t", 4: "ct6e-standard-4t", 8: "ct6e-standard-8t"},
        # 4t: docs.cloud.google.com/tpu/docs/tpu7x, comparison table "RAM (GB) (4-chip VM)". 1t and 8t:
        # no Google doc page lists them; the Compute Engine API listing (tools/machinetypes.csv of
        # Cyclenerd/google-cloud-pricing-cost-calculator) and GKE's cluster autoscaler agree.
        host_ram_gib={1: 176, 4: 720, 8: 1440},
        default_chips_per_host=4,
        hbm_gib_per_chip=32,
        tensorcores_per_chip=1,
        peak_bf16_tflops_per_chip=918.0,  # cloud.google.com/tpu/docs/v6e
        max_chips_per_slice=256,
        max_side=16,  # the largest slice is the 16x16 pod (cloud.google.com/tpu/docs/v6e)
        topologies_2d=_2D_TOPOLOGIES,
    ),
    "tpu7x": TpuFamily(
        name="tpu7x",
        accelerator="tpu7x",
        dimensions=3,
        # tpu7x-standard-1t is a single-chip VM (1x1x1), as listed by xpk; 4t is the slice building block.
        machine_types={1: "tpu7x-standard-1t", 4: "tpu7x-standard-4t"},
        # 4t: docs.cloud.google.com/tpu/docs/tpu7x, comparison table "RAM (GB) (4-chip VM)"; 1t: the
        # Compute Engine API listing (no Google doc page). GKE's cluster autoscaler says 248 and 992:
        # Google's page wins (docs/topology.md notes the disagreement).
        host_ram_gib={1: 240, 4: 960},
        default_chips_per_host=4,
        hbm_gib_per_chip=192,
        tensorcores_per_chip=2,
        peak_bf16_tflops_per_chip=2307.0,  # docs.cloud.google.com/tpu/docs/tpu7x (FP8: 4614)
        # An Ironwood pod is 9216 chips; xpk's largest shape is 16x24x24 (= 9216).
        max_chips_per_slice=9216,
        max_side=256,  # as v5p: xpk's `generate_tpu_topologies`, sides from 4 to 256
        small_topologies_3d=("1x1x1", *_SMALL_3D),
        multihost_uses_placement_policy=True,
    ),
}


@dataclass(frozen=True)
class SliceShape:
    """A resolved, valid TPU slice (or several identical ones)."""

    family: TpuFamily
    topology: str
    chips_per_host: int
    slices: int = 1

    @property
    def chips_per_slice(self) -> int:
        return math.prod(parse_topology(self.topology))

    @property
    def hosts_per_slice(self) -> int:
        return self.chips_per_slice // self.chips_per_host

    @property
    def chips(self) -> int:
        return self.chips_per_slice * self.slices

    @property
    def hosts(self) -> int:
        return self.hosts_per_slice * self.slices

    @property
    def machine_type(self) -> str:
        return self.family.machine_types[self.chips_per_host]

    @property
    def multi_host(self) -> bool:
        return self.hosts_per_slice > 1

    @property
    def machine_type_ambiguous(self) -> bool:
        """Node pools of more than one machine type carry this accelerator and topology (v5e/v6e 2x4:
        two 4-chip VMs or one 8-chip VM): only the machine type tells them apart."""
        return len(host_sizes_for(self.family, self.chips_per_slice)) > 1

    @property
    def hbm_gib_per_host(self) -> int:
        return self.family.hbm_gib_per_chip * self.chips_per_host

    @property
    def host_ram_gib(self) -> int:
        """RAM of one host (TPU VM) of this shape's machine type, GiB."""
        return self.family.host_ram_gib[self.chips_per_host]


def parse_topology(topology: str) -> tuple[int, ...]:
    if not _TOPOLOGY_RE.match(topology):
        raise TopologyError("spec.tpu.topology", f"{topology!r} is not of the form AxB or AxBxC")
    return tuple(int(d) for d in topology.split("x"))


def _valid_3d(dims: tuple[int, ...], family: TpuFamily) -> bool:
    text = "x".join(map(str, dims))
    if text in family.small_topologies_3d:
        return True
    if list(dims) != sorted(dims):
        return False
    return all(d % 4 == 0 for d in dims) and math.prod(dims) <= family.max_chips_per_slice


def host_sizes_for(fam: TpuFamily, chips: int) -> tuple[int, ...]:
    """The chips-per-host values that can hold a slice of ``chips`` chips (sorted)."""
    return tuple(
        c
        for c in fam.chips_per_host_choices
        if (c == chips) or (c == fam.multihost_chips_per_host and chips >= c and chips % c == 0)
    )


def family(tpu_type: str) -> TpuFamily:
    try:
        return FAMILIES[tpu_type]
    except KeyError:
        raise TopologyError(
            "spec.tpu.type", f"unknown TPU type {tpu_type!r}; known types: {', '.join(FAMILIES)}"
        ) from None


def default_chips_per_host(fam: TpuFamily, topology: str) -> int:
    """The documented default when ``chipsPerHost`` is not given.

    Slices smaller than the default host size (v5e/v6e ``1x1``) use one host that holds them all.
    Otherwise the family default (4 chips per VM, as xpk provisions them) applies; this resolves the
    v5e/v6e ``2x4`` ambiguity as two 4-chip hosts unless the user sets ``chipsPerHost: 8``.
    """
    chips = math.prod(parse_topology(topology))
    if chips < fam.default_chips_per_host:
        return chips
    return fam.default_chips_per_host


def valid_shapes(fam: TpuFamily) -> list[str]:
    """Every topology of the family, smallest first (3-D: enumerated up to the largest slice)."""
    if fam.dimensions == 2:
        return list(fam.topologies_2d)
    shapes = list(fam.small_topologies_3d)
    limit = fam.max_chips_per_slice
    for a in range(4, limit + 1, 4):
        for b in range(a, limit // a + 1, 4):
            for c in range(b, min(limit // (a * b), fam.max_side) + 1, 4):
                shapes.append(f"{a}x{b}x{c}")
    return sorted(shapes, key=lambda t: (math.prod(parse_topology(t)), t))


def resolve(
    tpu_type: str, topology: str, *, slices: int = 1, chips_per_host: int | None = None
) -> SliceShape:
    """Validates a TPU shape and returns it resolved, or raises `TopologyError` naming the field."""
    fam = family(tpu_type)
    dims = parse_topology(topology)
    if len(dims) != fam.dimensions:
        kind = "3-D (AxBxC)" if fam.dimensions == 3 else "2-D (AxB)"
        raise TopologyError(
            "spec.tpu.topology",
            f"{tpu_type} slices have a {kind} topology, got {topology!r}; valid: {fam.describe_topologies()}",
        )
    longest = max(dims)
    if longest > fam.max_side:
        raise TopologyError(
            "spec.tpu.topology",
            f"{topology!r} has a side of {longest} chips, longer than any {tpu_type} slice: at most "
            f"{fam.max_side} chips a side (docs/topology.md)",
        )
    valid = topology in fam.topologies_2d if fam.dimensions == 2 else _valid_3d(dims, fam)
    if not valid:
        raise TopologyError(
            "spec.tpu.topology",
            f"{topology!r} is not a {tpu_type} topology GKE offers; valid: {fam.describe_topologies()}",
        )
    if chips_per_host is None:
        chips_per_host = default_chips_per_host(fam, topology)
    elif chips_per_host not in fam.machine_types:
        raise TopologyError(
            "spec.tpu.chipsPerHost",
            f"{tpu_type} hosts have {fam.describe_chips_per_host()} chips, got {chips_per_host}",
        )
    chips = math.prod(dims)
    fitting = host_sizes_for(fam, chips)
    if chips_per_host not in fitting:
        raise TopologyError(
            "spec.tpu.chipsPerHost",
            f"a {topology} {tpu_type} slice has {chips} chips, which {chips_per_host}-chip hosts cannot hold; "
            f"valid for this topology: {', '.join(map(str, fitting))}",
        )
    if slices < 1:
        raise TopologyError("spec.tpu.slices", f"must be at least 1, got {slices}")
    shape = SliceShape(family=fam, topology=topology, chips_per_host=chips_per_host, slices=slices)
    if slices > 1 and not shape.multi_host:
        raise TopologyError(
            "spec.tpu.slices",
            f"multislice needs multi-host slices; a {topology} {tpu_type} slice is a single host "
            f"({chips} chips on one {shape.machine_type} VM)",
        )
    return shape


def node_labels(shape: SliceShape, nodepool: str, *, placement_policy: str | None = None) -> dict[str, str]:
    """Labels GKE puts on every node of a TPU node pool of this shape.

    ``placement_policy`` is the workload policy an Ironwood multi-host pool was created with.
    """
    labels = {
        ACCELERATOR_LABEL: shape.family.accelerator,
        TOPOLOGY_LABEL: shape.topology,
        NODEPOOL_LABEL: nodepool,
        INSTANCE_TYPE_LABEL: shape.machine_type,
    }
    if placement_policy is not None:
        labels[PLACEMENT_POLICY_LABEL] = placement_policy
    return labels
