"""`tpuft plan -f FILE`: shape, memory per chip and host RAM per host, offline.

Where the model's architecture comes from, first match wins:
1. `spec.model.name` is a local directory with a config.json;
2. the Hugging Face cache on this machine ($HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub);
3. the built-in table of well-known models (plan.KNOWN_MODELS);
4. --params-billions N (a typical architecture of that size is assumed for the activations).
--params-billions also overrides the parameter count of 1-3. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import click

from tpuft_operator import plan as planning
from tpuft_operator.api.validation import SpecError, parse
from tpuft_operator.render.cli import load_documents


class InvalidInput(click.ClickException):
    """Input `tpuft plan` cannot estimate from. Exit 2: 1 means "does not fit"."""

    exit_code = 2


def _documents(path: Path) -> list[dict[str, object]]:
    try:
        return load_documents(path)
    except OSError as error:
        raise InvalidInput(
            f"cannot read {path}: {error.strerror or error}; pass a TPUFineTune manifest (-f FILE, or - for stdin)"
        ) from None
    except click.ClickException as error:  # not YAML, or a document that is not a mapping
        raise InvalidInput(error.message) from None


def _hub_cache_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    return dirs


def find_config(model: str, revision: str | None) -> Path | None:
    """A config.json for ``model`` available without network, or None."""
    local = Path(model)
    if local.is_absolute() and (local / "config.json").is_file():
        return local / "config.json"
    if model.startswith("gs://") or "/" not in model:
        return None
    for cache in _hub_cache_dirs():
        repo = cache / f"models--{model.replace('/', '--')}"
        ref = repo / "refs" / (revision or "main")
        snapshots = [repo / "snapshots" / ref.read_text().strip()] if ref.is_file() else []
        snapshots += sorted((repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
        for snapshot in snapshots:
            if (snapshot / "config.json").is_file():
                return snapshot / "config.json"
    return None


def model_dims(model: str, revision: str | None, params_billions: float | None) -> planning.ModelDims:
    config = find_config(model, revision)
    found: planning.ModelDims | None = None
    if config is not None:
        try:
            found = planning.dims_from_config(json.loads(config.read_text()), f"config {config}")
        except (ValueError, KeyError) as error:
            raise InvalidInput(
                f"cannot read {config}: {error}; fix the file, or pass --params-billions N to estimate from a "
                "typical architecture"
            ) from None
    elif model in planning.KNOWN_MODELS:
        found = planning.KNOWN_MODELS[model]
    if params_billions is not None:
        count = int(params_billions * 1e9)
        if found is None:
            return planning.dims_from_params(
                count, f"--params-billions {params_billions:g}, typical architecture"
            )
        return replace(found, params=count, source=f"{found.source}; count from --params-billions")
    if found is None:
        raise InvalidInput(
            f"no config.json for {model!r} on this machine (local directory or Hugging Face cache) and it is "
            "not in the built-in table; pass --params-billions N"
        )
    return found


@click.command(name="plan")
@click.option("-f", "--filename", "path", required=True, type=click.Path(path_type=Path, allow_dash=True))
@click.option("--params-billions", type=float, default=None, help="Model size when no config is available.")
def plan(path: Path, params_billions: float | None) -> None:
    """Show a TPUFineTune's TPU shape, mesh, estimated memory per chip against HBM and host memory
    per host against the machine type's RAM.

    Exits 0 when both estimates fit, 1 when either does not, 2 on invalid input. A spec the operator
    refuses because a host's RAM cannot hold it is shown in full (exit 1), not as invalid input.
    """
    docs = [d for d in _documents(path) if d.get("kind") == "TPUFineTune"]
    if not docs:
        raise InvalidInput(
            f"{path}: no TPUFineTune found (a document with apiVersion: tpuft.dev/v1alpha1 and kind: TPUFineTune)"
        )
    fits = True
    for doc in docs:
        try:
            ft = parse(doc, check_host_ram=False)  # the host-RAM rule: shown below in full
        except SpecError as error:
            lines = "\n".join(f"  {e.field}: {e.reason}" for e in error.errors)
            raise click.UsageError(f"TPUFineTune is invalid:\n{lines}") from None
        dims = model_dims(ft.spec.model.name, ft.spec.model.revision, params_billions)
        result = planning.plan(ft, dims)
        click.echo(planning.format_plan(result, ft))
        fits = fits and result.fits and result.host.fits
    if not fits:
        raise SystemExit(1)
