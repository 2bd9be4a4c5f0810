"""What is known of the trainer's stack on the TPU a run asks for, per backend. Pure.

The catalog (topology.py) offers every GKE TPU family, Ironwood (tpu7x) included, because the shapes
and node pools are real. Whether the trainer's software runs there is another question, answered per
``spec.backend``:

- ``xla``: the trainer image pins torch_xla 2.9.0 with the libtpu it asks for (0.0.21). Nothing
  upstream says that stack works on tpu7x, so an xla run on tpu7x is refused at apply time (the CRD's
  CEL rule and api/validation.py, message ``cel.XLA_ON_TPU7X_MESSAGE``); on v4, v5e, v5p and v6e it
  carries no caveat (torch_xla's own targets).
- ``native``: torch-native FSDP2 on TorchTPU (torch-tpu 0.2.0, Beta). tpuft has verified this backend
  on CPU with gloo only, never on a TPU slice of any family, so every native run gets condition
  ``TrainerStackVerified=False`` (reason ``NativeUnverifiedOnTpu``) and a Warning Event with the same
  words when its JobSet is created; ``tpuft plan``, README.md and docs/topology.md say the same. It
  is not refused: on tpu7x it is the stack Google points PyTorch users to.

A run of the native backend recorded on a slice lifts the caveat in one place: ``trainer_stack_caveat``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The xla trainer image's pins (trainer_image/requirements-tpu.txt; a unit test keeps these equal).
TORCH_XLA_VERSION = "2.9.0"
LIBTPU_VERSION = "0.0.21"
# The torch-tpu release whose launch environment the renderer follows (render/native_env.py).
TORCH_TPU_VERSION = "0.2.0"

CONDITION = "TrainerStackVerified"
REASON_NATIVE = "NativeUnverifiedOnTpu"
# The Event posted with the JobSet's creation (the condition's own reason says which caveat).
EVENT_REASON = "TrainerStackUnverified"

NATIVE_CAVEAT = (
    f"backend native is unverified on TPU: it runs torch-native FSDP2 on TorchTPU (torch-tpu "
    f"{TORCH_TPU_VERSION}, Beta: torch 2.11-2.15, libtpu >= 0.0.50), which tpuft has verified on CPU "
    "with gloo only (losses, checkpoints, resume), never on a TPU slice: the tpu_dist collectives, bf16 "
    'numerics and throughput are unchecked (docs/trainer.md, "What CPU runs prove, and what they '
    'cannot"). The run is not refused; if it fails to start or runs far slower than `tpuft plan` '
    "estimates, this stack is the first suspect"
)


def trainer_stack_caveat(spec: Mapping[str, Any]) -> str | None:
    """Why the trainer's stack is unverified for ``spec``, or None when nothing is known against it.
    ``spec`` is the TPUFineTune's spec as stored (camelCase keys; a spec without backend is xla)."""
    if spec.get("backend") == "native":
        return NATIVE_CAVEAT
    return None


def condition(spec: Mapping[str, Any]) -> dict[str, tuple[str, str, str]]:
    """``{TrainerStackVerified: ("False", reason, message)}`` for a run with a caveat; else empty (an
    xla run on a family torch_xla supports carries no such condition, as no run claims to be verified)."""
    caveat = trainer_stack_caveat(spec)
    if caveat is None:
        return {}
    return {CONDITION: ("False", REASON_NATIVE, caveat)}
