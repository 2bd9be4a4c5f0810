"""The TPUFineTune API: pydantic models (the one source of truth), CRD and reference generation.

Light on purpose: pydantic and the standard library only, so the operator, `tpuft render` and
`tpuft plan` never import the training stack.
"""

from tpuft_operator.api.models import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    TPUFineTune,
    TPUFineTuneSpec,
    TPUFineTuneStatus,
)

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "VERSION",
    "TPUFineTune",
    "TPUFineTuneSpec",
    "TPUFineTuneStatus",
]
