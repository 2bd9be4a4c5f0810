"""Small helpers for tests that talk to the local cluster."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tpuft_operator.cluster.local import LocalCluster

T = TypeVar("T")


def wait_for(check: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.5) -> T:
    """Polls ``check`` until it returns something truthy; fails with ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last value: {last!r}")


def get_json(cluster: LocalCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for cond in obj.get("status", {}).get("conditions", []) or []:
        if cond.get("type") == type_:
            return dict(cond)
    return None
