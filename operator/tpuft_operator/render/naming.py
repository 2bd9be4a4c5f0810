"""Names of the objects a TPUFineTune owns: deterministic, valid, and short enough for every child.

The JobSet name is the TPUFineTune's name when it already fits, else a readable prefix plus a hash of
the run's uid (of the full name before there is one, as in `tpuft render -f`). Not of the name:
a derived name is itself a valid run name, and another user who created a run of exactly that name
(before or after) would own the JobSet name this run needs; a uid is known to no one in advance.
The operator checks ownership anyway (k8s.py: it never adopts an object another run controls). It must fit because JobSet
derives names from it: pods are ``<jobset>-slice-<slice>-<host>-<5 random chars>`` and pod hostnames
``<jobset>-slice-<slice>-<host>``, all DNS-1035 labels of at most 63 characters (the JobSet webhook
rejects a JobSet whose longest pod name would not fit).
"""

from __future__ import annotations

import hashlib
import re

REPLICATED_JOB = "slice"
# The account trainer pods run as unless the user names one (one per namespace; render/identity.py).
TRAINER_SERVICE_ACCOUNT = "tpuft-trainer"
# 63 - len("-slice-") - 3 digits of slice index (<= 256 slices) - "-" - 4 digits of host index
# (<= 2304 hosts in the largest slice) - len("-abcde") of the Job controller's random suffix.
MAX_JOBSET_NAME = 63 - len(f"-{REPLICATED_JOB}-") - 3 - 1 - 4 - 6
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_HASH_CHARS = 6


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:_HASH_CHARS]


def short_name(name: str, limit: int, key: str | None = None) -> str:
    """``name`` if it is a DNS-1035 label of at most ``limit`` characters, else prefix + hash of
    ``key`` (default: of ``name``)."""
    if len(name) <= limit and _DNS_1035.match(name):
        return name
    prefix = re.sub(r"[^a-z0-9-]", "-", name.lower())
    prefix = re.sub(r"-+", "-", prefix).strip("-")
    if not prefix or not prefix[0].isalpha():
        prefix = "ft-" + prefix
    prefix = prefix[: limit - _HASH_CHARS - 1].rstrip("-")
    return f"{prefix}-{_digest(key or name)}"


def jobset_name(finetune_name: str, uid: str | None = None) -> str:
    return short_name(finetune_name, MAX_JOBSET_NAME, key=uid)


def label_value(text: str) -> str:
    """A label value for ``text`` (<= 63 characters): itself when it fits, else prefix + hash."""
    if len(text) <= 63:
        return text
    return f"{text[: 63 - _HASH_CHARS - 1].rstrip('-.')}-{_digest(text)}"


def coordinator_address(jobset: str) -> str:
    """DNS name of the first host of the first slice (JobSet's headless service is the subdomain)."""
    return f"{jobset}-{REPLICATED_JOB}-0-0.{jobset}"


def progress_identity_name(finetune_name: str, uid: str | None = None) -> str:
    """The RoleBinding that lets a user-named pod ServiceAccount report progress (render/identity.py)."""
    return f"{jobset_name(finetune_name, uid)}-progress"


def pod_service_account(user_service_account: str | None) -> str:
    """The account trainer pods run as: the user's (Workload Identity) or the namespace's trainer one."""
    return user_service_account or TRAINER_SERVICE_ACCOUNT
