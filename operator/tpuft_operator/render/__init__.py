"""Rendering: a TPUFineTune -> every object the operator creates for it. Pure functions, no I/O.

run = render_run(ft, RenderSettings())
run.objects             # [JobSet] (+ a RoleBinding first for a user-named account)
run.prepare_job         # the CPU Job that prepares the data before the JobSet (None: spec.prepare.enabled false)
run.namespace_objects   # the namespace's trainer ServiceAccount + progress Role/RoleBinding, shared
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tpuft_operator import plan, trainer_stack
from tpuft_operator.api.models import TPUFineTune
from tpuft_operator.api.validation import SpecError, ValidatedRun, parse_run, validate_run
from tpuft_operator.render.identity import namespace_objects, run_objects
from tpuft_operator.render.jobset import jobset
from tpuft_operator.render.network import network_policy
from tpuft_operator.render.prepare_job import data_settings_hash, prepare_job
from tpuft_operator.render.settings import RenderSettings
from tpuft_operator.render.trainer_config import trainer_config
from tpuft_operator.topology import SliceShape
from tpuft_trainer.config import TrainerConfig

__all__ = ["RenderSettings", "RenderedRun", "SpecError", "render_run"]


@dataclass(frozen=True)
class RenderedRun:
    """What the operator creates for one TPUFineTune, and the facts it was computed from."""

    jobset: dict[str, Any]  # its pod template carries the trainer config (render/jobset.py)
    trainer_config: TrainerConfig
    shape: SliceShape
    # The progress channel's RoleBinding for a user-named pod ServiceAccount; usually empty.
    identity: tuple[dict[str, Any], ...] = ()
    # The run's NetworkPolicy (RenderSettings.network_policy), before its pods exist.
    network: tuple[dict[str, Any], ...] = ()
    # A Spot run of a known model whose stop save cannot fit a reclaim's ~15 s (plan.spot_stop_warning):
    # the operator says so with the run's start (Warning SpotStopTooShort).
    spot_stop_warning: str | None = None
    # The Job that prepares the data on CPU before the JobSet is created (render/prepare_job.py), and
    # the hash of the data settings it prepares for; None when spec.prepare.enabled is false.
    prepare_job: dict[str, Any] | None = None
    data_settings_hash: str = ""
    # Why the trainer's stack is unverified for the run (trainer_stack.py: backend native), posted as
    # a Warning TrainerStackUnverified with the run's start; the run is not refused.
    trainer_stack_caveat: str | None = None

    @property
    def jobset_name(self) -> str:
        return str(self.jobset["metadata"]["name"])

    @property
    def objects(self) -> list[dict[str, Any]]:
        """The run's own objects in creation order: the RoleBinding (if any) before the pods need it."""
        return [*self.identity, *self.network, self.jobset]

    @property
    def namespace_objects(self) -> list[dict[str, Any]]:
        """Shared by every run of the namespace (created once, before the first run's objects)."""
        return namespace_objects(str(self.jobset["metadata"]["namespace"]))


def render_run(
    ft: TPUFineTune | ValidatedRun | dict[str, Any], settings: RenderSettings | None = None
) -> RenderedRun:
    """Render a TPUFineTune (model, plain dict, or already validated: `parse_run`). Raises only
    `SpecError` for a spec that cannot run. The slice shape is the one validation resolved."""
    settings = settings or RenderSettings()
    if isinstance(ft, dict):
        run = parse_run(ft)
    elif isinstance(ft, ValidatedRun):
        run = ft
    else:
        run = validate_run(ft)
    model, shape = run.finetune, run.shape
    config = trainer_config(model, shape, settings)
    return RenderedRun(
        jobset=jobset(model, shape, config.to_yaml(), settings, config.stop.coordination_port),
        trainer_config=config,
        shape=shape,
        identity=tuple(run_objects(model)),
        network=tuple(p for p in [network_policy(model)] if p is not None and settings.network_policy),
        spot_stop_warning=plan.spot_stop_warning(model),
        prepare_job=prepare_job(model, config, settings) if model.spec.prepare.enabled else None,
        data_settings_hash=data_settings_hash(config),
        trainer_stack_caveat=trainer_stack.trainer_stack_caveat(model.spec.model_dump(by_alias=True)),
    )
