"""What the renderer needs from the operator's configuration: a small frozen value, passed in.

The operator builds one from its flags and environment (settings.py) and hands it to `render_run`;
`tpuft render` uses the defaults. Nothing here reads the environment: rendering stays a pure function.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpuft_trainer.pod_contract import DEFAULT_TOKEN_ENV

# The one default (the operator's setting, the chart's trainerImage and `tpuft render`).
DEFAULT_TRAINER_IMAGE = "ghcr.io/tpuft/trainer:0.1.0"


@dataclass(frozen=True)
class RenderSettings:
    # Image of the trainer pods when spec.image is not set.
    trainer_image: str = DEFAULT_TRAINER_IMAGE
    image_pull_policy: str = "IfNotPresent"
    # Environment variable that carries the hub token (from spec.model.tokenSecretRef) into the pod.
    token_env: str = DEFAULT_TOKEN_ENV
    # Time the trainer gets after SIGTERM (preemption, suspend) to finish writing a checkpoint.
    termination_grace_period_seconds: int = 60
    # When set, pods run as this non-root user and group and meet the restricted Pod Security
    # Standard. Off by default: GKE documents TPU pods without privileged mode (since 1.28) but not
    # that a non-root user may open the TPU device files (/dev/vfio/*, /dev/accel*).
    run_as_user: int | None = None
    # A NetworkPolicy per run: its pods accept connections only from the same run's pods.
    network_policy: bool = False
    # How often rank 0 may patch the TPUFineTune's progress.
    progress_min_interval_seconds: float = 10.0
