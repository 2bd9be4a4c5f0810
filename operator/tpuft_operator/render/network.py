"""The run's NetworkPolicy (with the operator's --trainer-network-policy): its pods accept
connections only from pods of the same run.

A run's hosts talk to each other (the trainer's stop channel on TCP 29500, the TPU runtime's own
ports, multislice traffic between slices) and to nothing else inside the cluster: no other pod needs
to reach them. Selected by the run's uid label (another run of the same name, even a later one,
does not match). Egress stays open: the trainer reads the hub and GCS. Owned by the run, deleted with it.
"""

from __future__ import annotations

from typing import Any

from tpuft_operator.api.models import TPUFineTune
from tpuft_operator.api.resources import NETWORK_POLICY
from tpuft_operator.render import naming
from tpuft_operator.render.jobset import FINETUNE_UID_LABEL, common_labels, object_metadata


def network_policy(ft: TPUFineTune) -> dict[str, Any] | None:
    """None before the run has a uid (`tpuft render -f`): it could select nothing of its own."""
    uid = ft.metadata.uid
    if not uid:
        return None
    name = f"{naming.jobset_name(ft.metadata.name, uid)}-net"
    own = {"matchLabels": {FINETUNE_UID_LABEL: uid}}
    return {
        "apiVersion": NETWORK_POLICY.api_version,
        "kind": NETWORK_POLICY.kind,
        "metadata": object_metadata(ft, name, {**common_labels(ft), "tpuft.dev/component": "network"}, {}),
        "spec": {
            "podSelector": own,
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": own}]}],
        },
    }
