"""This process's host memory: how much each part of the run peaked at, and giving freed memory back
to the system.

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
    """The process's peak resident memory since it started or since the last ``part_peak`` (Linux
    VmHWM), 0 where the kernel does not say."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def part_peak() -> int:
    """The peak resident memory of the part of the run that ends now (since the previous call, or the
    process's start), and a fresh high-water mark for the next part: writing 5 to /proc/self/clear_refs
    resets VmHWM to the current RSS. Without the reset each part would report the largest peak so far
    (a training peak hidden behind the load's). The kernel's ru_maxrss is taken from the same mark, so
    after a reset it holds the peak since then: the process's peak is the largest part. Where the reset
    is refused (not Linux, a locked-down /proc), the parts are cumulative and a warning says so."""
    peak = peak_bytes()
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError as error:
        if not _reset_refused:
            log.warning(
                "cannot reset the peak RSS between parts (%s): each part reports the peak so far", error
            )
            _reset_refused.append(error)
    return peak


_reset_refused: list[OSError] = []  # the first refusal (warned about once)
