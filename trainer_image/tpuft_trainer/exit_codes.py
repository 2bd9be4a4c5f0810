"""Exit codes of `tpuft train`: the contract between the training core and the operator.

The JobSet's pod failure policy fails the run at once (no restart) on a *user error*: retrying a bad
config or a missing dataset burns TPU hours and cannot succeed. A *checkpointed stop* (SIGTERM, then
every host saved the same step, stop.py) restarts the JobSet without counting against
`spec.maxRestarts`: no work was lost and the next start makes progress from a newer checkpoint.
Every other non-zero exit (a crash, SIGKILL, a lost node, SIGTERM before the first step) is an
*infrastructure failure* and restarts the JobSet up to `spec.maxRestarts`, resuming from the latest
checkpoint. Values follow BSD sysexits where one fits. Light module: the operator imports it.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    CONFIG_ERROR = 64  # EX_USAGE: the trainer configuration is invalid (unknown layer class, bad mesh)
    DATA_ERROR = 65  # EX_DATAERR: the dataset is malformed (missing text field, empty after filtering)
    NOT_FOUND = 66  # EX_NOINPUT: model, dataset or output location does not exist / cannot be read
    PERMISSION_DENIED = 77  # EX_NOPERM: gated model without a valid token, bucket access denied
    OUT_OF_MEMORY = 78  # the model does not fit the slice's HBM as configured
    # EX_TEMPFAIL: stopped by SIGTERM after saving a checkpoint newer than the one it resumed from.
    STOPPED_AFTER_CHECKPOINT = 75


USER_ERROR_EXIT_CODES: tuple[int, ...] = (
    ExitCode.CONFIG_ERROR,
    ExitCode.DATA_ERROR,
    ExitCode.NOT_FOUND,
    ExitCode.PERMISSION_DENIED,
    ExitCode.OUT_OF_MEMORY,
)


def is_user_error(exit_code: int) -> bool:
    return exit_code in USER_ERROR_EXIT_CODES
