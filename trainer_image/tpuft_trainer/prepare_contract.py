"""What `tpuft prepare` reports to the operator: the contract of the prepare Job. Light module (the
operator imports it): the standard library only.

The prepare Job's container runs ``tpuft prepare --config FILE --workers N --summary-file
/dev/termination-log``. Kubernetes keeps that file's content (at most 4096 bytes) as the container's
``state.terminated.message``, which the operator reads from the pod: no extra permission, no channel
of its own. On success the message is a ``PrepareSummary`` as compact JSON; on a failure, ``{"error":
..., "exitCode": ...}`` with the exit code of exit_codes.py (64-78: a user error, the run fails; any
other: an infrastructure failure the Job retries).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

SUMMARY_LIMIT = 4096  # bytes Kubernetes keeps of a termination message


@dataclass(frozen=True)
class PrepareSummary:
    """The figures of a prepared dataset (its manifest's, in the API's camelCase on the wire)."""

    fingerprint: str  # the directory under <output>/prepared/ that holds it
    reused: bool  # it was complete already: nothing was tokenised
    documents: int  # training documents read (rows of the source's split, minus held-out ones)
    dropped: int  # documents without a token to learn within maxSeqLength
    rows: int  # training rows of maxSeqLength (packed or padded)
    positions: int  # rows x maxSeqLength
    loss_tokens: int  # positions that count in the loss
    eval_rows: int  # evaluation rows (0: no evaluation set)
    seconds: float  # the prepare's wall time (0 when reused)
    tokens_per_second: float  # tokenised tokens a second (0 when reused)

    def to_message(self) -> str:
        body = {_camel(key): value for key, value in asdict(self).items()}
        return json.dumps(body, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_message(cls, text: str) -> PrepareSummary | None:
        """The summary in a termination message, or None when it holds none (an error, garbage)."""
        try:
            body = json.loads(text)
            return cls(**{f.name: body[_camel(f.name)] for f in fields(cls)})
        except (ValueError, TypeError, KeyError):
            return None


def error_message(message: str, exit_code: int) -> str:
    """A failure's termination message, cut to fit Kubernetes' limit."""
    room = SUMMARY_LIMIT - 64
    return json.dumps({"error": message[:room], "exitCode": exit_code}, separators=(",", ":"))


def parse_error(text: str) -> tuple[str, int] | None:
    """(message, exit code) of a failure's termination message, or None."""
    try:
        body: Any = json.loads(text)
        return str(body["error"]), int(body["exitCode"])
    except (ValueError, TypeError, KeyError):
        return None


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)
