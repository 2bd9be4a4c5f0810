"""This process's host memory: how much it peaked at, and giving freed memory back to the system.

Why ``release``: a checkpoint's staging copy, a resumed checkpoint's read buffers and the export's
groups are many tensors of a few to tens of MB each, freed once written. glibc serves allocations
below its (dynamic, up to 32 MB) mmap threshold from its heaps and keeps what is freed there for
later, so the process's resident memory stayed up by the size of a staging copy between saves and
by the size of the checkpoint after a resume (measured: bench/results/scale.json). ``malloc_trim(0)``
returns free heap pages to the system; it is called after each of those, and does nothing where
the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from functools import cache

log = logging.getLogger(__name__)


@cache
def _malloc_trim() -> object | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def release() -> None:
    """Give the memory freed so far back to the system (glibc's heaps)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)  # type: ignore[operator]


def peak_bytes() -> int:
    """The process's peak resident memory so far (Linux VmHWM), 0 where the kernel does not say.
    Never reset: that would also reset what ``getrusage``'s ru_maxrss reports to whoever watches."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0
