"""The output location: a local path (a mounted volume) or any fsspec URI (``gs://``).

The Trainer writes to a local directory; for a URI that is a staging directory, and rank 0 copies each
checkpoint (and the final model) up after it is complete.

A checkpoint is complete or absent: rank 0 writes the marker ``.tpuft-complete`` into it after every
other file of it exists (locally after the Trainer's save, remotely after the upload), and resume
considers marked checkpoints only. A save cut off by SIGKILL (the grace period ran out, the VM went
away) leaves a directory without the marker, which is never resumed from and is removed when the next
start resumes from an older one. ``.tpuft-uploaded`` is the remote marker of earlier versions, still
read.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
from pathlib import Path

from tpuft_trainer.data import cache_dir, is_uri
from tpuft_trainer.errors import PermissionDeniedError

log = logging.getLogger(__name__)

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
COMPLETE = ".tpuft-complete"
_LEGACY_UPLOADED = ".tpuft-uploaded"


def local_dir(uri: str) -> Path:
    if is_uri(uri):
        return cache_dir() / "output" / hashlib.sha256(uri.encode()).hexdigest()[:16]
    return Path(uri).expanduser()


def checkpoint_step(name: str) -> int | None:
    match = CHECKPOINT.match(name)
    return int(match.group(1)) if match else None


def mark_complete(checkpoint: Path) -> None:
    """Rank 0, after the Trainer saved ``checkpoint`` (every file of it is written)."""
    (checkpoint / COMPLETE).write_text("ok\n")


def latest_local_checkpoint(directory: Path) -> Path | None:
    found = [
        (step, path)
        for path in directory.glob("checkpoint-*")
        if (step := checkpoint_step(path.name)) is not None and (path / COMPLETE).is_file()
    ]
    return max(found)[1] if found else None


def remove_incomplete_checkpoints(directory: Path, after_step: int) -> list[str]:
    """Rank 0, before training resumes from ``after_step``: deletes the unmarked checkpoint
    directories a cut-off save left behind (newer than the one resumed from), so the Trainer never
    saves into a directory holding stale files of another attempt. Returns their names."""
    removed = []
    for path in sorted(directory.glob("checkpoint-*")):
        step = checkpoint_step(path.name)
        if step is not None and step > after_step and not (path / COMPLETE).is_file():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def fetch_latest_checkpoint(uri: str, local: Path) -> Path | None:
    """The newest complete checkpoint at the output; for a URI, downloaded into ``local``."""
    if not is_uri(uri):
        return latest_local_checkpoint(local)
    import fsspec

    fs, root = fsspec.core.url_to_fs(uri)
    try:
        entries = fs.ls(root, detail=False) if fs.exists(root) else []
    except PermissionError as error:
        raise PermissionDeniedError(f"cannot list output {uri}: {error}") from error
    steps = []
    for entry in entries:
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        step = checkpoint_step(name)
        if step is None:
            continue
        remote = entry.rstrip("/")
        if fs.exists(f"{remote}/{COMPLETE}") or fs.exists(f"{remote}/{_LEGACY_UPLOADED}"):
            steps.append((step, remote, name))
    if not steps:
        return None
    _, remote, name = max(steps)
    target = local / name
    if target.exists():
        shutil.rmtree(target)
    fs.get(remote + "/", str(target) + "/", recursive=True)
    (target / COMPLETE).write_text("ok\n")  # complete remotely, so complete here
    return target


def upload(local: Path, uri: str, name: str = "") -> None:
    """Copy ``local`` to ``uri/name`` and mark it complete last (no-op for a local output).
    Checkpoint directories inside ``local`` are skipped: each was uploaded when it was saved."""
    if not is_uri(uri):
        return
    import fsspec

    fs, root = fsspec.core.url_to_fs(uri)
    remote = f"{root.rstrip('/')}/{name}" if name else root.rstrip("/")
    fs.makedirs(remote, exist_ok=True)
    for entry in sorted(local.iterdir()):
        if (entry.is_dir() and CHECKPOINT.match(entry.name)) or entry.name == COMPLETE:
            continue
        target = f"{remote}/{entry.name}"
        if entry.is_dir():
            fs.put(str(entry) + "/", target + "/", recursive=True)
        else:
            fs.put_file(str(entry), target)
    with fs.open(f"{remote}/{COMPLETE}", "w") as marker:
        marker.write("ok\n")
