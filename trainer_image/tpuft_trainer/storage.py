"""The output location: a local path (a mounted volume) or any fsspec URI (``gs://``).

The Trainer writes to a local directory; for a URI that is a staging directory, and rank 0 copies each
checkpoint (and the final model) up after it is complete, then writes a marker so a half-uploaded
checkpoint is never resumed from.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

from tpuft_trainer.data import cache_dir, is_uri
from tpuft_trainer.errors import PermissionDeniedError

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
UPLOADED = ".tpuft-uploaded"


def local_dir(uri: str) -> Path:
    if is_uri(uri):
        return cache_dir() / "output" / hashlib.sha256(uri.encode()).hexdigest()[:16]
    return Path(uri).expanduser()


def latest_local_checkpoint(directory: Path) -> Path | None:
    found = [
        (int(m.group(1)), path)
        for path in directory.glob("checkpoint-*")
        if (m := CHECKPOINT.match(path.name)) and (path / "trainer_state.json").is_file()
    ]
    return max(found)[1] if found else None


def fetch_latest_checkpoint(uri: str, local: Path) -> Path | None:
    """For a URI output: download its newest fully uploaded checkpoint into ``local``."""
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
        if (m := CHECKPOINT.match(name)) and fs.exists(f"{entry.rstrip('/')}/{UPLOADED}"):
            steps.append((int(m.group(1)), entry.rstrip("/"), name))
    if not steps:
        return None
    _, remote, name = max(steps)
    target = local / name
    if target.exists():
        shutil.rmtree(target)
    fs.get(remote + "/", str(target) + "/", recursive=True)
    return target


def upload(local: Path, uri: str, name: str = "") -> None:
    """Copy ``local`` to ``uri/name`` and mark it complete (no-op for a local output). Checkpoint
    directories inside ``local`` are skipped: each was uploaded when it was saved."""
    if not is_uri(uri):
        return
    import fsspec

    fs, root = fsspec.core.url_to_fs(uri)
    remote = f"{root.rstrip('/')}/{name}" if name else root.rstrip("/")
    fs.makedirs(remote, exist_ok=True)
    for entry in sorted(local.iterdir()):
        if entry.is_dir() and CHECKPOINT.match(entry.name):
            continue
        target = f"{remote}/{entry.name}"
        if entry.is_dir():
            fs.put(str(entry) + "/", target + "/", recursive=True)
        else:
            fs.put_file(str(entry), target)
    with fs.open(f"{remote}/{UPLOADED}", "w") as marker:
        marker.write("ok\n")
