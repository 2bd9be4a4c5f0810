"""What a storage error means for the run, for reads and writes of checkpoints alike. No torch at import.

Every error met while reading or writing a checkpoint is sorted once (``kind_of``):

- ``PERMISSION``: storage refuses access (``PermissionError``, EACCES/EPERM, HTTP 401/403, and
  gcsfs's ``OSError("Forbidden: <path> ...")`` for a 403). The same on every retry:
  ``PermissionDeniedError``, exit 77, the run fails without a restart.
- ``TRANSIENT``: storage that may answer if asked again (timeouts, dropped connections, EIO/EAGAIN,
  HTTP 408/429/5xx: what gcsfs raises as ``HttpError`` once its own retries are exhausted). Retried
  here a few times where a read decides something (``retrying``); otherwise as ``STORAGE``.
- ``STORAGE``: any other failure of the storage (storage full, a file gone, another ``OSError``, an
  error of a storage client library): an infrastructure failure, exit 1, which the JobSet restarts
  from the newest complete checkpoint.
- ``NOT_STORAGE``: the storage answered but what it holds does not fit (DCP's missing keys or
  mismatched shapes, a corrupt index), or something else failed: the caller decides. A load that
  does not fit this run's model (``is_mismatch``) is a ``ConfigError``, exit 64, naming the tensor;
  an index that cannot be parsed makes its checkpoint skipped.

HTTP errors are recognised by their integer ``code`` (gcsfs's ``HttpError``) or ``status`` (aiohttp's)
and client libraries' errors by the package that defines them, not by class: no filesystem package
is imported here, and another fsspec backend's errors sort the same way.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from enum import Enum
from typing import TypeVar

from tpuft_trainer.errors import PermissionDeniedError, TrainerError

log = logging.getLogger(__name__)

T = TypeVar("T")


class Kind(Enum):
    PERMISSION = "permission"
    TRANSIENT = "transient"
    STORAGE = "storage"
    NOT_STORAGE = "not a storage failure"


class CheckpointStorageError(TrainerError):
    """Checkpoint storage failed (full, unreachable, a file gone): an infrastructure failure, so the
    JobSet restarts the run from the newest complete checkpoint."""

    exit_code = 1


class CheckpointWriteError(CheckpointStorageError):
    """A checkpoint could not be written."""


class CheckpointReadError(CheckpointStorageError):
    """A checkpoint could not be read."""


PERMISSION_ERRNOS = frozenset({errno.EACCES, errno.EPERM})
TRANSIENT_ERRNOS = frozenset(
    {
        errno.EIO,
        errno.EAGAIN,
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.ENETDOWN,
        errno.ENETUNREACH,
        errno.EHOSTUNREACH,
    }
)
PERMISSION_HTTP = frozenset({401, 403})
TRANSIENT_HTTP = frozenset({408, 429})  # and every 5xx
# Packages whose errors are the storage's (HTTP clients, cloud SDKs, fsspec and its backends).
STORAGE_CLIENTS = frozenset(
    {"aiohttp", "requests", "urllib3", "google", "botocore", "fsspec", "gcsfs", "s3fs", "adlfs"}
)
# Words in the name of an error class (or one it derives from) that says the storage did not answer
# in time or the connection failed: requests' ConnectionError and ReadTimeout, aiohttp's
# ClientConnectionError and ServerTimeoutError...
TRANSIENT_NAMES = ("Timeout", "Connection")


def http_code(error: BaseException) -> int | None:
    """The HTTP status an error carries (``code``: gcsfs's HttpError; ``status``: aiohttp's), if any."""
    for attribute in ("code", "status"):
        code = getattr(error, attribute, None)
        if isinstance(code, int) and 100 <= code < 600:
            return code
    return None


def kind_of(error: BaseException) -> Kind:
    code = http_code(error)
    if code is not None:
        if code in PERMISSION_HTTP:
            return Kind.PERMISSION
        if code in TRANSIENT_HTTP or code >= 500:
            return Kind.TRANSIENT
        return Kind.STORAGE
    if (
        isinstance(error, PermissionError)
        or getattr(error, "errno", None) in PERMISSION_ERRNOS
        or (isinstance(error, OSError) and str(error).startswith("Forbidden"))  # gcsfs's 403
    ):
        return Kind.PERMISSION
    if isinstance(error, (TimeoutError, ConnectionError)) or any(
        word in cls.__name__ for cls in type(error).__mro__ for word in TRANSIENT_NAMES
    ):
        return Kind.TRANSIENT
    if isinstance(error, OSError):
        return Kind.TRANSIENT if error.errno in TRANSIENT_ERRNOS else Kind.STORAGE
    if type(error).__module__.split(".")[0] in STORAGE_CLIENTS:
        return Kind.STORAGE
    return Kind.NOT_STORAGE


def is_mismatch(error: BaseException) -> bool:
    """DCP's planners refusing a checkpoint for this run's state: a key the checkpoint lacks (torch's
    ``RuntimeError("Missing key in checkpoint state_dict: <name>.")``, torch_xla's ``KeyError``) or a
    shape that differs (``ValueError("Size mismatch between saved ... for <name>")``)."""
    text = str(error)
    return isinstance(error, KeyError) or "Missing key" in text or "Size mismatch" in text


def storage_failure(error: BaseException, message: str, *, writing: bool) -> TrainerError | None:
    """The run-ending error for a storage failure (``message`` says what failed, in the user's words),
    or None when ``error`` is not one (the caller decides)."""
    kind = kind_of(error)
    if kind is Kind.NOT_STORAGE:
        return None
    if kind is Kind.PERMISSION:
        failure: TrainerError = PermissionDeniedError(f"{message} (access denied)")
    elif writing:
        failure = CheckpointWriteError(message)
    else:
        failure = CheckpointReadError(message)
    failure.__cause__ = error
    return failure


def retrying(
    call: Callable[[], T],
    *,
    what: str,
    attempts: int = 4,
    backoff_seconds: float = 0.5,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``call()``, asked again after a transient error up to ``attempts`` times in all, waiting
    ``backoff_seconds``, then twice as long, and so on; the last error is raised as it is."""
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except Exception as error:
            if attempt == attempts or kind_of(error) is not Kind.TRANSIENT:
                raise
            wait = backoff_seconds * 2 ** (attempt - 1)
            log.warning(
                "reading %s failed (%s: %s); trying again in %.1f s", what, type(error).__name__, error, wait
            )
            sleep(wait)
    raise AssertionError("unreachable")
