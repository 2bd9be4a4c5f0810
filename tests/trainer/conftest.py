"""Session pool for the SPMD jobs declared by the test modules (see spmd.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# The helpers next to this file (spmd.py, tiny.py) are imported by name from the tests.
sys.path.insert(0, str(Path(__file__).parent))

from spmd import Pool

_SESSION_JOBS: dict[str, Callable[[], Any]] = {}


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: start only what the selected modules need
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        _SESSION_JOBS.update(getattr(getattr(item, "module", None), "SPMD_JOBS", {}))


@pytest.fixture(scope="session")
def pool() -> Iterator[Pool]:
    p = Pool(int(os.environ.get("TPUFT_TEST_WORKERS", "2")))
    p.jobs.update(_SESSION_JOBS)
    yield p
    p.close()
