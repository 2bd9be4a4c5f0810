"""What the renderer needs from the operator's configuration: a small frozen value, passed in.

The operator builds one from its flags and environment (settings.py) and hands it to `render_run`;
`tpuft render` uses the defaults. Nothing here reads the environment: rendering stays a pure function.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpuft_operator.api.models import DEFAULT_GRACE_SECONDS
from tpuft_trainer.pod_contract import DEFAULT_TOKEN_ENV

# The one default (the operator's setting, the chart's trainerImage and `tpuft render`).
DEFAULT_TRAINER_IMAGE = "ghcr.io/tpuft/trainer:0.1.0"
# The image of `backend: native` runs (torch 2.15 + torch-tpu, no torch_xla): the same repository, so
# the admin policy's rule on spec.image (the trainer image's repository is always allowed) covers it.
DEFAULT_TRAINER_IMAGE_NATIVE = f"{DEFAULT_TRAINER_IMAGE}-native"
# The trainer image's numeric USER (trainer_image/Dockerfile; a test holds them equal): the user
# trainer pods run as by default, so they meet the restricted Pod Security Standard.
TRAINER_IMAGE_USER = 1000


@dataclass(frozen=True)
class RenderSettings:
    # Image of the trainer pods when spec.image is not set.
    trainer_image: str = DEFAULT_TRAINER_IMAGE
    # Image of the trainer pods of a `backend: native` run when spec.image is not set.
    trainer_image_native: str = DEFAULT_TRAINER_IMAGE_NATIVE
    image_pull_policy: str = "IfNotPresent"
    # Environment variable that carries the hub token (from spec.model.tokenSecretRef) into the pod.
    token_env: str = DEFAULT_TOKEN_ENV
    # Time the trainer gets after SIGTERM (preemption, suspend) to finish writing a checkpoint.
    termination_grace_period_seconds: int = DEFAULT_GRACE_SECONDS
    # Pods run as this user and group. Non-root (the default: the trainer image's user), they meet the
    # restricted Pod Security Standard. 0: root with the baseline settings, for node pools whose TPU
    # device files a non-root user cannot open (the trainer says so: device_access.py).
    run_as_user: int = TRAINER_IMAGE_USER
    # A NetworkPolicy per run: its pods accept connections only from the same run's pods.
    network_policy: bool = False
    # How often rank 0 may patch the TPUFineTune's progress.
    progress_min_interval_seconds: float = 10.0

    def image_for(self, backend: str) -> str:
        """The default trainer image of a run of ``backend`` (spec.image overrides it)."""
        return self.trainer_image_native if backend == "native" else self.trainer_image
