"""Can this process open the TPU's device files? Checked before the XLA runtime starts.

Trainer pods run as a non-root user by default (the restricted Pod Security Standard). The TPU
device plugin hands the pod `/dev/vfio/*` (v5e, v5p, v6e, Ironwood) or `/dev/accel*` (v4), and
containerd keeps the host's owner and mode on them unless the node enables
`device_ownership_from_security_context`. Where a non-root user cannot open them, libtpu fails deep
in its start-up with a message that names neither the cause nor the fix; this check names both and
exits 77 (a user's setting, not restarted).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tpuft_trainer.errors import PermissionDeniedError

# Where the TPU device plugin puts the chips' device files.
TPU_DEVICE_PATTERNS: tuple[str, ...] = ("vfio/*", "accel*")
OPT_OUT = "helm upgrade ... --set trainerSecurity.restricted=false (operator: --run-as-user 0)"


@dataclass(frozen=True)
class Device:
    path: str
    uid: int
    gid: int
    mode: int


def tpu_devices(dev: Path = Path("/dev")) -> list[Device]:
    found = sorted({p for pattern in TPU_DEVICE_PATTERNS for p in dev.glob(pattern)})
    devices = []
    for path in found:
        info = path.stat()
        if stat.S_ISCHR(info.st_mode) or stat.S_ISREG(info.st_mode):  # regular: tests stand in files
            devices.append(Device(str(path), info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)))
    return devices


def can_read_and_write(device: Device, uid: int, gids: Iterable[int]) -> bool:
    """The kernel's owner/group/other check (root passes any; no ACLs on device nodes here)."""
    if uid == 0:
        return True
    if device.uid == uid:
        bits = device.mode >> 6
    elif device.gid in set(gids):
        bits = device.mode >> 3
    else:
        bits = device.mode
    return bits & 0o6 == 0o6


def check_tpu_device_access(
    devices: Sequence[Device] | None = None, uid: int | None = None, gids: Iterable[int] | None = None
) -> None:
    """Raises PermissionDeniedError naming each TPU device file this process cannot open read-write,
    and what to change. No device files (a CPU host): nothing to check."""
    devices = tpu_devices() if devices is None else devices
    uid = os.getuid() if uid is None else uid
    gids = [os.getgid(), *os.getgroups()] if gids is None else list(gids)
    closed = [d for d in devices if not can_read_and_write(d, uid, gids)]
    if not closed:
        return
    described = ", ".join(f"{d.path} (owner {d.uid}:{d.gid}, mode {d.mode:04o})" for d in closed)
    raise PermissionDeniedError(
        f"the TPU device files {described} cannot be opened by this pod's user {uid} (groups "
        f"{sorted(set(gids))}): the node's container runtime keeps the host's owner and mode on devices. "
        f"Run trainer pods as root on this node pool: {OPT_OUT}, or enable containerd's "
        "device_ownership_from_security_context on the nodes (docs/install-gke.md#pod-security)"
    )
