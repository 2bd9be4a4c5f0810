"""What is known of the trainer's stack (torch_xla + libtpu) on the TPU a run asks for. Pure.

The catalog (topology.py) offers every GKE TPU family, Ironwood (tpu7x) included, because the shapes
and node pools are real. Whether the trainer's software runs there is another question: the trainer
image pins torch_xla 2.9.0 with the libtpu it asks for (0.0.21), and nothing upstream says that stack
works on tpu7x (the sources are in the message below). Until a backend that runs there exists, a
tpu7x run is not refused: it gets condition ``TrainerStackVerified=False`` (reason
``UnverifiedOnTpu7x``) and a Warning Event with the same words when its JobSet is created, and
``tpuft plan``, README.md and docs/topology.md say the same.

A backend verified on tpu7x (e.g. a future ``spec.backend: native`` on TorchTPU) lifts it in one place:
``trainer_stack_caveat`` returns None for that spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The trainer image's pins (trainer_image/requirements-tpu.txt; a unit test keeps these equal).
TORCH_XLA_VERSION = "2.9.0"
LIBTPU_VERSION = "0.0.21"

CONDITION = "TrainerStackVerified"
REASON_TPU7X = "UnverifiedOnTpu7x"
# The Event posted with the JobSet's creation (the condition's own reason says which caveat).
EVENT_REASON = "TrainerStackUnverified"

TPU7X_CAVEAT = (
    f"the trainer's stack is unverified on tpu7x (Ironwood): the trainer image runs torch_xla "
    f"{TORCH_XLA_VERSION} with libtpu {LIBTPU_VERSION} (the libtpu that torch_xla {TORCH_XLA_VERSION}'s setup.py "
    "pins); torch_xla's own TPU CI runs on v4 only (pytorch/xla .github/workflows/_tpu_ci.yml, "
    "runs-on: v4-runner-set) and no torch_xla release note says tpu7x works; Google's Ironwood page "
    "(docs.cloud.google.com/tpu/docs/tpu7x) points PyTorch users to TorchTPU instead. The run is not "
    "refused, but tpuft has not run it there: if it fails to start or runs far slower than "
    "`tpuft plan` estimates, this stack is the first suspect (docs/topology.md)"
)


def trainer_stack_caveat(spec: Mapping[str, Any]) -> str | None:
    """Why the trainer's stack is unverified on the TPU ``spec`` asks for, or None when nothing is
    known against it. ``spec`` is the TPUFineTune's spec as stored (camelCase keys)."""
    tpu = spec.get("tpu") or {}
    if tpu.get("type") == "tpu7x":
        return TPU7X_CAVEAT
    return None


def condition(spec: Mapping[str, Any]) -> dict[str, tuple[str, str, str]]:
    """``{TrainerStackVerified: ("False", reason, message)}`` for a run with a caveat; else empty (a
    run on a family torch_xla supports carries no such condition, as no run claims to be verified)."""
    caveat = trainer_stack_caveat(spec)
    if caveat is None:
        return {}
    return {CONDITION: ("False", REASON_TPU7X, caveat)}
