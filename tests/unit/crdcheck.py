"""Runs tools/crdcheck: the apiserver's CRD and custom-resource validation, offline, from Go.

Built once per source hash into $TPUFT_CACHE/bin (needs `go` and the modules in go.sum, which the
local cluster build already fetched); without `go` they fail, saying how to get it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tpuft_dev.cluster import versions

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tools" / "crdcheck"
JOBSET_MODULE = f"sigs.k8s.io/jobset@{versions.JOBSET}"
JOBSET_CRD_RELATIVE = f"{JOBSET_MODULE}/config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml"


def _go() -> str:
    go = shutil.which("go")
    if go is None:
        pytest.fail(
            f"needs the Go toolchain (go{versions.MIN_GO[0]}.{versions.MIN_GO[1]} or later, https://go.dev/dl) to build tools/crdcheck"
            " and read the JobSet CRD; `make binaries` needs it too"
        )
    return go


def binary() -> Path:
    go = _go()
    digest = hashlib.sha256()
    for name in ("main.go", "go.mod", "go.sum"):
        digest.update((SOURCE / name).read_bytes())
    cache = Path(os.environ.get("TPUFT_CACHE", Path.home() / ".cache" / "tpuft")) / "bin"
    target = cache / f"crdcheck-{digest.hexdigest()[:12]}"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([go, "build", "-o", str(target), "."], cwd=SOURCE, check=True, timeout=900)
    return target


def jobset_crd() -> Path:
    """The JobSet CRD of the release the local cluster runs, from the Go module cache (downloaded
    from the module proxy when the cluster build has not fetched it yet)."""
    go = _go()
    modcache = subprocess.run(
        [go, "env", "GOMODCACHE"], capture_output=True, text=True, check=True
    ).stdout.strip()
    path = Path(modcache) / JOBSET_CRD_RELATIVE
    if not path.exists():
        subprocess.run([go, "mod", "download", JOBSET_MODULE], check=True, timeout=600)
    return path


def check_crd(crd_text: str) -> list[str]:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(crd_text)
        f.flush()
        out = subprocess.run([str(binary()), f.name], capture_output=True, text=True, timeout=120)
    if out.returncode not in (0, 1):
        raise RuntimeError(out.stderr)
    result: list[str] = json.loads(out.stdout)
    return result


def admit(crd_path: Path, cases: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Case name -> error messages (empty: admitted). Each case: {name, object, old?}."""
    # JSON is YAML to the tool (sigs.k8s.io/yaml) and ~50x faster to write than PyYAML's dump,
    # which took 13 of the 17 s of test_cel_agrees_with_catalog's 4560 cases.
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(cases, f)
        f.flush()
        out = subprocess.run(
            [str(binary()), str(crd_path), f.name], capture_output=True, text=True, timeout=300
        )
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    result: dict[str, list[str]] = json.loads(out.stdout)["cases"]
    return result


def merge(base: Any, patch: Any) -> Any:
    """JSON merge patch (RFC 7386): dicts merge recursively, null deletes, anything else replaces."""
    if not isinstance(patch, dict) or not isinstance(base, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge(out.get(key), value)
    return out
