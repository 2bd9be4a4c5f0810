"""The output location: a local path (a mounted volume) or any fsspec URI (``gs://``).

Checkpoints and the exported model's weights are written straight to the output by every process
(checkpoint/, export.py). What the Trainer and rank 0 write as files (the final model's config and
tokenizer, TensorBoard events, ``tpuft-metrics.json``) goes to a local directory first; for a URI,
``upload`` copies it up and writes the output's completion marker last.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tpuft_trainer.checkpoint.layout import CHECKPOINT, COMPLETE
from tpuft_trainer.data import cache_dir, is_uri


def local_dir(uri: str) -> Path:
    if is_uri(uri):
        return cache_dir() / "output" / hashlib.sha256(uri.encode()).hexdigest()[:16]
    return Path(uri).expanduser()


def upload(local: Path, uri: str, name: str = "") -> None:
    """Copy ``local`` to ``uri/name`` and mark it complete last (no-op for a local output).
    Checkpoint directories inside ``local`` are skipped: checkpoints are written to the output directly."""
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
