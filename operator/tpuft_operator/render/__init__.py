"""Rendering: a TPUFineTune -> every object the operator creates for it. Pure functions, no I/O.

run = render_run(ft, RenderSettings())
run.objects      # [ServiceAccount, Role, RoleBinding, ConfigMap, JobSet], in creation order
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tpuft_operator.api.models import TPUFineTune
from tpuft_operator.api.validation import SpecError, parse, validate
from tpuft_operator.render import naming
from tpuft_operator.render.identity import identity_objects
from tpuft_operator.render.jobset import config_map, jobset
from tpuft_operator.render.settings import RenderSettings
from tpuft_operator.render.trainer_config import trainer_config
from tpuft_operator.topology import SliceShape, resolve
from tpuft_trainer.config import TrainerConfig

__all__ = ["RenderSettings", "RenderedRun", "SpecError", "render_run"]


@dataclass(frozen=True)
class RenderedRun:
    """What the operator creates for one TPUFineTune, and the facts it was computed from."""

    jobset: dict[str, Any]
    config_map: dict[str, Any]
    trainer_config: TrainerConfig
    shape: SliceShape
    # ServiceAccount (unless the user names one), Role, RoleBinding of the progress channel.
    identity: tuple[dict[str, Any], ...] = ()

    @property
    def jobset_name(self) -> str:
        return str(self.jobset["metadata"]["name"])

    @property
    def objects(self) -> list[dict[str, Any]]:
        """In creation order: the pods' identity and ConfigMap exist before the JobSet makes pods."""
        return [*self.identity, self.config_map, self.jobset]


def render_run(ft: TPUFineTune | dict[str, Any], settings: RenderSettings | None = None) -> RenderedRun:
    """Render a TPUFineTune (model or plain dict). Raises only `SpecError` for a spec that cannot run."""
    settings = settings or RenderSettings()
    if isinstance(ft, dict):
        ft = parse(ft)
    else:
        errors = validate(ft.spec)
        if errors:
            raise SpecError.of(errors)
    tpu = ft.spec.tpu
    shape = resolve(tpu.type, tpu.topology, slices=tpu.slices, chips_per_host=tpu.chips_per_host)
    config = trainer_config(ft, shape, settings)
    return RenderedRun(
        jobset=jobset(ft, shape, settings),
        config_map=config_map(ft, config.to_yaml()),
        trainer_config=config,
        shape=shape,
        identity=tuple(identity_objects(ft)),
    )


def jobset_name(finetune_name: str) -> str:
    """The name of the JobSet of the TPUFineTune ``finetune_name`` (for the operator's lookups)."""
    return naming.jobset_name(finetune_name)
