"""`tpuft crd`: print, write or check the generated CRD and API reference."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from tpuft_operator.api.crd import CRD_NAME, crd_yaml
from tpuft_operator.api.reference import api_markdown
from tpuft_operator.topology_doc import topology_markdown


def generated_files(root: Path) -> dict[Path, str]:
    """Every file `tpuft crd --write` owns, relative to the repository root, with its content."""
    text = crd_yaml()
    return {
        root / "crds" / f"{CRD_NAME}.yaml": text,
        root / "charts" / "tpuft" / "crds" / f"{CRD_NAME}.yaml": text,
        root / "docs" / "api.md": api_markdown(),
        root / "docs" / "topology.md": topology_markdown(),
    }


def _repo_root() -> Path:
    # The checkout this package is installed from (editable install), else the working directory.
    here = Path(__file__).resolve().parents[3]
    return here if (here / "pyproject.toml").exists() else Path.cwd()


@click.command(name="crd")
@click.option(
    "--write", is_flag=True, help="Write crds/, charts/tpuft/crds/, docs/api.md and docs/topology.md."
)
@click.option("--check", is_flag=True, help="Exit 1 if the committed files differ from the models.")
@click.option(
    "--root",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Repository root (default: this checkout).",
)
def crd(write: bool, check: bool, root: Path | None) -> None:
    """Print the TPUFineTune CRD generated from the API models (YAML)."""
    base = root or _repo_root()
    if not write and not check:
        sys.stdout.write(crd_yaml())
        return
    stale = []
    for path, content in generated_files(base).items():
        current = path.read_text() if path.exists() else None
        if current == content:
            continue
        if check:
            stale.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
            click.echo(f"wrote {path.relative_to(base)}", err=True)
    if stale:
        names = ", ".join(str(p.relative_to(base)) for p in stale)
        raise click.ClickException(f"out of date: {names}; run `tpuft crd --write` (or `make crd`)")
