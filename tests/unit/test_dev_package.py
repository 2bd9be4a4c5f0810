"""The development tools (package tpuft_dev in devtools/: the local cluster and the demo) stay out of
the operator: no tpuft_operator module imports them, the operator package has no `cluster`
subpackage any more, the operator image's package holds no tpuft_dev, and there `tpuft cluster`
says where to get it."""

from __future__ import annotations

import json
import pkgutil
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import tpuft_operator

ROOT = Path(__file__).resolve().parents[2]
PIP_WHEEL = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]

# Every tpuft_operator module, imported in a fresh interpreter (other tests import tpuft_dev).
IMPORT_ALL = """
import importlib, json, pkgutil, sys
import tpuft_operator
names = [m.name for m in pkgutil.walk_packages(tpuft_operator.__path__, "tpuft_operator.")]
for name in names:
    if name.rpartition(".")[2] != "__main__":  # runs the command line
        importlib.import_module(name)
print(json.dumps({"modules": names, "dev": sorted(m for m in sys.modules if m.split(".")[0] == "tpuft_dev")}))
"""

# The operator image: tpuft_dev is not installed (None in sys.modules makes its import fail as absent).
WITHOUT_DEV = """
import sys
sys.modules["tpuft_dev"] = None
from click.testing import CliRunner
from tpuft_operator.cli import cli
listing = CliRunner().invoke(cli, ["--help"])
assert listing.exit_code == 0, listing.output
assert "cluster" in listing.output, listing.output
result = CliRunner().invoke(cli, ["cluster", "up"])
print(result.exit_code)
print(result.output)
"""


def test_no_operator_module_imports_the_dev_package() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "tpuft_operator.handlers" in found["modules"] and "tpuft_operator.render.cli" in found["modules"]
    assert found["dev"] == [], f"importing tpuft_operator imported {found['dev']}"


def test_the_operator_package_has_no_cluster_or_demo_any_more() -> None:
    package = Path(tpuft_operator.__file__).parent
    assert not (package / "cluster").exists() and not (package / "demo.py").exists()
    # By the package's own path: a shared venv's editable install may point at an older checkout.
    names = {m.name for m in pkgutil.iter_modules(tpuft_operator.__path__)}
    assert "render" in names and not {"cluster", "demo"} & names, names


def test_only_the_cli_table_names_the_dev_package() -> None:
    package = Path(tpuft_operator.__file__).parent
    naming = sorted(
        str(path.relative_to(package)) for path in package.rglob("*.py") if "tpuft_dev" in path.read_text()
    )
    assert naming == ["cli.py"], naming
    from tpuft_operator.cli import SUBCOMMANDS

    assert SUBCOMMANDS["cluster"][0] == "tpuft_dev.cluster.cli:cluster"
    assert [name for name, (target, _) in SUBCOMMANDS.items() if target.startswith("tpuft_dev")] == [
        "cluster"
    ]


def test_tpuft_cluster_without_the_dev_package_says_it_is_a_development_tool() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_DEV], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    code, _, output = proc.stdout.partition("\n")
    assert code == "1", proc.stdout
    assert "`tpuft cluster` cannot run" in output
    assert "development tool" in output and "checkout of the tpuft repository" in output, output


def _dockerfile_copy_sources(dockerfile: Path) -> list[str]:
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    sources: list[str] = []
    for line in text.splitlines():
        words = line.split()
        if words and words[0].upper() == "COPY":
            sources += [w.rstrip("/") for w in words[1:-1] if not w.startswith("--")]
    return sources


def test_the_operator_image_neither_copies_nor_packages_the_dev_tools(tmp_path: Path) -> None:
    for dockerfile in (ROOT / "Dockerfile", ROOT / "trainer_image" / "Dockerfile"):
        copied = _dockerfile_copy_sources(dockerfile)
        assert not any(s == "devtools" or s.startswith("devtools/") or s == "." for s in copied), copied
    sources = _dockerfile_copy_sources(ROOT / "Dockerfile")
    # The wheel `pip install .` builds in the image, from exactly what the Dockerfile copies.
    context = tmp_path / "context"
    for source in sources:
        for path in ROOT.glob(source):
            target = context / path.relative_to(ROOT)
            if path.is_dir():
                shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
    proc = subprocess.run(
        [*PIP_WHEEL, "--wheel-dir", str(tmp_path / "wheels"), str(context)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("tpuft-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {"tpuft_operator", "tpuft_trainer"} <= tops, tops
    assert "tpuft_dev" not in tops, tops
    assert not any(name.startswith("tpuft_operator/cluster/") for name in zipfile.ZipFile(wheel).namelist())
