"""Exceptions that carry their exit code, so `tpuft train` maps a failure to the operator's policy in
one place (cli.py) and every module raises in the user's words."""

from __future__ import annotations

from tpuft_trainer.exit_codes import ExitCode


class TrainerError(Exception):
    """A failure with a known cause. ``exit_code`` is what `tpuft train` exits with."""

    exit_code: ExitCode | int = 1

    def __init__(self, message: str, exit_code: ExitCode | int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(TrainerError, ValueError):
    """The configuration cannot work (unknown layer class, mesh that does not fit the devices)."""

    exit_code = ExitCode.CONFIG_ERROR


class DataError(TrainerError, ValueError):
    """The dataset is readable but not usable (missing field, too few rows for one batch)."""

    exit_code = ExitCode.DATA_ERROR


class NotFoundError(TrainerError, FileNotFoundError):
    """The model, dataset or output location does not exist or cannot be read."""

    exit_code = ExitCode.NOT_FOUND


class PermissionDeniedError(TrainerError, PermissionError):
    """A gated model without a valid token, or storage access denied."""

    exit_code = ExitCode.PERMISSION_DENIED


class WorldError(TrainerError, RuntimeError):
    """The processes and devices the runtime sees differ from the job's shape: an infrastructure
    failure (a host missing, wrong environment), so the generic non-zero code lets the JobSet restart."""

    exit_code = 1


class StoppedAfterCheckpoint(TrainerError):
    """SIGTERM stopped the run after every host saved the same step (stop.py): not a failure, the
    next start resumes from that checkpoint and the restart does not count against maxRestarts."""

    exit_code = ExitCode.STOPPED_AFTER_CHECKPOINT
